// EXPECT-ERROR: kvc: queries, keys and values must be kvc::tensor_input of the element type and memory space the call expects: kvc::HostTensor<T>, an Eigen::TensorMap of one or kvc::TensorView<T> on the host (other memory: kvc::TensorView<T>{data, extents, strides} over contiguous [seq, head_dim] blocks; kvc::input_view(x) is the view of any input), kvc::DeviceTensor<T> or kvc::DeviceTensorView<T> on a CUDA device (kvc::to_device copies a HostTensor there)
// Double tensors given to a float cache (a column-major Eigen::Tensor<float, 4> fails the same
// way). docs/errors.md lists the fix.
#include <kvc/cache.hpp>

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>> cache;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(0.5f);
  cache.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  kvc::HostTensor<double> d(1, 2, 3, 4);
  d.setConstant(0.5);
  cache.update(d, d, 0);
#endif
  return cache.get_seq_length(0) == 3 ? 0 : 1;
}

// EXPECT-ERROR: kvc: queries, keys and values must be kvc::tensor_input of the element type and memory space the call expects: kvc::HostTensor<T>, an Eigen::TensorMap of one or kvc::TensorView<T> on the host (other memory: kvc::TensorView<T>{data, extents, strides} over contiguous [seq, head_dim] blocks; kvc::input_view(x) is the view of any input), kvc::DeviceTensor<T> or kvc::DeviceTensorView<T> on a CUDA device (kvc::to_device copies a HostTensor there)
// Double queries, keys and values given to kvc::attend on a float cache: kvc never converts
// elements, and attend says so with the same message as every function that takes tensors.
// docs/errors.md lists the fix.
#include <kvc/kvc.hpp>

int main() {
  kvc::DynamicCache<float> cache;
#ifdef KVC_SHOULD_FAIL
  kvc::HostTensor<double> x(1, 2, 3, 4);
#else
  kvc::HostTensor<float> x(1, 2, 3, 4);
#endif
  x.setConstant(0.5);
  return kvc::attend(cache, 0, x, x, x).dimension(2) == 3 ? 0 : 1;
}

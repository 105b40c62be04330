// EXPECT-ERROR: kvc: queries, keys and values must be kvc::tensor_input of the element type and memory space the call expects: kvc::HostTensor<T>, an Eigen::TensorMap of one or kvc::TensorView<T> on the host (other memory: kvc::TensorView<T>{data, extents, strides} over contiguous [seq, head_dim] blocks; kvc::input_view(x) is the view of any input), kvc::DeviceTensor<T> or kvc::DeviceTensorView<T> on a CUDA device (kvc::to_device copies a HostTensor there)
// A column-major Eigen::Tensor (Eigen's default layout) given to kvc::paged_attention: what every
// function that takes queries, keys or values says when an input is not a kvc::tensor_input.
// docs/errors.md lists the fix.
#include <kvc/paged.hpp>

int main() {
  kvc::ModelConfig model;
  model.num_hidden_layers = 1;
  model.num_attention_heads = 2;
  model.num_key_value_heads = 1;
  model.head_dim = 4;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 4;
  const kvc::PagedCache<kvc::HostStorage<float>> cache(model, cb);
  const kvc::PagedAttentionStep step{{}, {}, {}};
#ifdef KVC_SHOULD_FAIL
  Eigen::Tensor<float, 4> q(1, 2, 0, 4), k(1, 1, 0, 4);
#else
  kvc::HostTensor<float> q(1, 2, 0, 4), k(1, 1, 0, 4);
#endif
  return kvc::paged_attention(cache, 0, step, q, k, k).size() == 0 ? 0 : 1;
}

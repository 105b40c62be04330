// EXPECT-ERROR: kvc::QuantizedOptions is not a layer kind: use QuantoQuantizedLayer or HQQQuantizedLayer
// QuantizedOptions is QuantizedLayer<void>: the options without a codec, which QuantizedCache turns
// into a layer kind. Building a layer state from it names the kinds to use instead.
#include <kvc/policies/layers/quantized.hpp>
#include <kvc/policies/storage/host.hpp>

int main() {
#ifdef KVC_SHOULD_FAIL
  kvc::QuantizedOptions::state<kvc::HostStorage<float>> layer(kvc::QuantizedOptions{});
#else
  kvc::QuantoQuantizedLayer::state<kvc::HostStorage<float>> layer(kvc::QuantoQuantizedLayer{});
#endif
  return layer.is_initialized() ? 1 : 0;
}

// EXPECT-ERROR: kvc::EncoderDecoderCache: One of the two arguments is not a Cache. SelfCache and CrossCache must each be a kvc::Cache instantiation or a class derived from one, such as kvc::DynamicCache or kvc::StaticCache
// An EncoderDecoderCache whose cross-attention half is not a kvc::Cache (transformers' TypeError
// "One of the two arguments is not a Cache"). docs/errors.md lists the fix.
#include <vector>

#include <kvc/encoder_decoder_cache.hpp>

int main() {
  kvc::EncoderDecoderCache<kvc::DynamicCache<float>, kvc::DynamicCache<float>> fine;
#ifdef KVC_SHOULD_FAIL
  kvc::EncoderDecoderCache<kvc::DynamicCache<float>, std::vector<float>> misuse(kvc::DynamicCache<float>(),
                                                                                std::vector<float>{});
  (void)misuse;
#endif
  return fine.size() == 0 ? 0 : 1;
}

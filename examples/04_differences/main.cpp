// The places where kvc deliberately behaves differently from transformers, each shown on a tiny
// cache and checked (docs/differences.md quotes the snippets). Comments give what transformers
// at commit a597f974, the reference kvc follows ([ref]), does instead.
#include <kvc/kvc.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../common/tokens.hpp"

using examples::expect;
using examples::same;
using examples::seq;
using examples::tokens;

namespace {

kvc::ModelConfig small_config() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 1;
  config.head_dim = 1;
  config.sliding_window = 4;
  config.layer_types = {"sliding_attention", "full_attention"};
  return config;
}

void reset() {
  // [snippet:reset]
  kvc::DynamicCache<float> cache;
  cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), 0);
  cache.reset();                                        // the layer drops its tokens and its shape
  auto kv = cache.update(tokens({7}), tokens({7}), 0);  // returns 7   ([ref]: 0 0 0 7)
  // [/snippet]
  expect(same(seq(kv.values), {7}), "reset drops dynamic states");
}

void record_past() {
  // [snippet:record_past]
  kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{.sliding_window = 4});
  cache.activate_past_recording();  // keep every token, so that crop can roll back past the window
  for (float t : {0, 1, 2, 3, 4}) cache.update(tokens({t}), tokens({t}), 0);
  auto [kv_length, kv_offset] = cache.get_mask_sizes(1, 0);  // 4, 2
  auto kv = cache.update(tokens({5}), tokens({5}), 0);       // returns 2 3 4 5   ([ref]: 0 1 2 3 4 5)
  cache.crop(-2);                                            // forget 4 5: keeps 1 2 3, get_seq_length() == 4
  // [/snippet]
  expect(kv_length == 4 && kv_offset == 2, "record_past: mask sizes");
  expect(same(seq(kv.values), {2, 3, 4, 5}), "record_past: update returns kv_length tokens");
  expect(same(seq(cache.stored(0).values), {1, 2, 3}) && cache.get_seq_length() == 4, "record_past: crop");

  // [snippet:crop_clamps]
  kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> recorded(kvc::DynamicSlidingWindowLayer{.sliding_window = 4});
  recorded.activate_past_recording();
  for (float t : {0, 1, 2, 3, 4, 5}) recorded.update(tokens({t}), tokens({t}), 0);
  recorded.crop(-10);  // more than was seen: get_seq_length() == 0   ([ref]: -4)
  // [/snippet]
  expect(recorded.get_seq_length() == 0, "crop clamps cumulative_length");
}

void crop_uninitialized() {
  // [snippet:crop_uninitialized]
  auto cache = kvc::make_dynamic_cache<float>(small_config());  // 2 layers, no tokens yet
  cache.crop(-1);  // no-op   ([ref]: AttributeError from the sliding layer, TypeError from the full one)
  // [/snippet]
  expect(cache.get_seq_length(0) == 0 && !cache.is_initialized(), "crop on uninitialized layers");
}

void static_index_error() {
  // [snippet:static_index_error]
  kvc::Cache<kvc::Layers<kvc::StaticLayer>> cache(kvc::StaticLayer{.max_cache_len = 4});
  cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), 0);
  try {
    cache.update(tokens({4, 5}), tokens({4, 5}), 0);  // 5 tokens do not fit in 4 slots
  } catch (const kvc::IndexError&) {
    // cache.get_seq_length() is still 3   ([ref]: 5, the counter moved before the copy failed)
  }
  // [/snippet]
  expect(cache.get_seq_length() == 3, "StaticLayer IndexError leaves the counter");
}

void max_length() {
  // [snippet:get_max_length]
  auto cache = kvc::make_dynamic_cache<float>(small_config());  // a window-4 layer and a full layer
  std::int64_t longest = cache.get_max_length();                // -1: the full layer is unbounded   ([ref]: 4)

  kvc::DynamicCache<float> lazy;  // no layer until the first update
  // lazy.get_max_length() throws kvc::ValueError naming the cause   ([ref]: max() of an empty sequence)
  // [/snippet]
  expect(longest == -1, "get_max_length is -1 with an unbounded layer");
  bool threw = false;
  try {
    (void)lazy.get_max_length();
  } catch (const kvc::ValueError&) {
    threw = true;
  }
  expect(threw, "get_max_length on an empty cache");
}

void batch_size() {
  // [snippet:batch_size]
  kvc::DynamicCache<float> cache;
  kvc::HostTensor<float> k(3, 2, 5, 8);  // batch 3
  k.setZero();
  cache.update(k, k, 0);
  std::int64_t b = cache.batch_size();  // 3   ([ref]: -1 for every dynamic layer)
  // [/snippet]
  expect(b == 3, "batch_size of a dynamic cache");
}

void window_one() {
  // [snippet:window_one]
  kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{.sliding_window = 1});
  cache.update(tokens({1, 2}), tokens({1, 2}), 0);      // returns 1 2, keeps nothing
  auto kv = cache.update(tokens({3}), tokens({3}), 0);  // returns 3   ([ref]: 1 2 3, it keeps everything)
  // [/snippet]
  expect(same(seq(kv.values), {3}), "window 1 keeps nothing");
}

void missing_method() {
  // [snippet:attribute_error]
  // A cache whose layer kinds are only partly croppable: crop compiles, and fails at run time.
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>> cache(kvc::DynamicLayer{},
                                                                     kvc::StaticLayer{.max_cache_len = 8});
  cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), 0);
  try {
    cache.crop(-1);
  } catch (const kvc::AttributeError& e) {
    // e.what() == "'StaticLayer' object has no attribute 'crop'"; layer 0 still holds 1 2 3
  }
  // kvc::StaticCache<float> has no croppable kind at all: its crop(-1) does not compile.
  // [/snippet]
  expect(cache.get_seq_length(0) == 3, "AttributeError changes nothing");
}

}  // namespace

int main() {
  reset();
  record_past();
  crop_uninitialized();
  static_index_error();
  max_length();
  batch_size();
  window_one();
  missing_method();
  if (examples::failures == 0) std::printf("differences: OK\n");
  return examples::failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

#pragma once
// The caches the fuzz target loads saved states into (tests/fuzz/fuzz_kvc.cpp, modes 'S', 'F', 'N', 'P'),
// and the seeds it starts from (tests/fuzz/make_state_seeds.cpp writes tests/fuzz/corpus_state):
// one cache of each kind family, small, with fixed parameters.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <kvc/kvc.hpp>
#include <kvc/state.hpp>

namespace kvc_fuzz {

using Dyn = kvc::DynamicCache<float>;
using Mixed = kvc::Cache<
    kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer, kvc::StaticLayer, kvc::StaticSlidingWindowLayer>>;
using Linear =
    kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer, kvc::LinearAttentionAndFullAttentionLayer>>;
using Indexed = kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer, kvc::StaticIndexedLayer>>;
using EncDec = kvc::EncoderDecoderCache<Dyn, Dyn>;
using Paged = kvc::PagedCache<kvc::HostStorage<float>>;

inline kvc::ModelConfig model(std::int64_t layers) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.hidden_size = 8;
  return c;
}
inline Mixed mixed() {
  return Mixed(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{5}, kvc::StaticLayer{12},
               kvc::StaticSlidingWindowLayer{12, 5});
}
inline kvc::QuantizedCache<float> quantized() {
  // Keys rotated, so that loading rebuilds the residual's rotated copy under the fuzzer too; values
  // at their own width.
  return kvc::QuantizedCache<float>(
      "quanto", model(2), {.nbits = 4, .q_group_size = 8, .residual_length = 3, .rotate_keys = true, .value_nbits = 2});
}
inline Linear linear() {
  // The linear layer keeps a ring of 2 steps, so that the loader's ring checks are fuzzed too.
  return Linear(kvc::LinearAttentionLayer{2, 2}, kvc::DynamicLayer{}, kvc::LinearAttentionAndFullAttentionLayer{});
}
inline Indexed indexed() { return Indexed(kvc::DynamicIndexedLayer{}, kvc::StaticIndexedLayer{12}); }
inline Paged paged() {
  // A linear-attention layer too, so that the loader's checks of a request's states are fuzzed.
  kvc::ModelConfig m = model(3);
  m.sliding_window = 6;
  m.layer_types = std::vector<std::string>{"full_attention", "sliding_attention", "linear_attention"};
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 8;
  cb.allow_block_sharing = false;
  return Paged(m, cb);
}

// `tokens` more tokens of small values in every K/V layer of `c` (two layers of a replicated
// cache without any).
template <class C>
void fill(C& c, std::int64_t tokens, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-8, 8);
  const std::int64_t layers = c.size() == 0 ? 2 : c.size();
  for (std::int64_t l = 0; l < layers; ++l) {
    if (l < c.size() && c.is_linear()[static_cast<std::size_t>(l)]) continue;
    kvc::HostTensor<float> k(1, 2, tokens, 4), v(1, 2, tokens, 4);
    for (std::int64_t i = 0; i < k.size(); ++i) {
      k.data()[i] = static_cast<float>(dist(rng)) / 4;
      v.data()[i] = static_cast<float>(dist(rng)) / 4;
    }
    c.update(k, v, l);
  }
}

// Calls f(cache) with a fresh cache of kind `which` (0..5: Dyn, Mixed, quantized, Linear, Indexed,
// EncDec).
template <class F>
void with_cache(int which, F&& f) {
  switch (which % 6) {
    case 0: {
      Dyn c;
      f(c);
      break;
    }
    case 1: {
      Mixed c = mixed();
      f(c);
      break;
    }
    case 2: {
      auto c = quantized();
      f(c);
      break;
    }
    case 3: {
      Linear c = linear();
      f(c);
      break;
    }
    case 4: {
      Indexed c = indexed();
      f(c);
      break;
    }
    default: {
      EncDec c{Dyn(), Dyn()};
      f(c);
    }
  }
}

}  // namespace kvc_fuzz

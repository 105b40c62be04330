// The "Using X" examples of docs/policies/*.md and docs/kv_layout.md: every layer policy, layer
// kind, storage and offload policy kvc ships, each in a few lines, with its results checked.
#include <kvc/kvc.hpp>

#include <boost/mp11/list.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "../common/tokens.hpp"

using examples::expect;
using examples::same;
using examples::seq;
using examples::tokens;

// [snippet:custom_layer_policy]
// Any type with exactly one of the member types `layers` or `layer_class_to_replicate` is a
// layer policy; kvc::Layers and kvc::Replicate are just the two ready-made spellings.
struct StaticOnly {
  using layers = boost::mp11::mp_list<kvc::StaticLayer>;
};
static_assert(kvc::concepts::LayerPolicy<StaticOnly>);
// [/snippet]

// [snippet:counting_offload]
// An offload policy with hooks that only count: the skeleton of a real one. `serves` says which
// storage policies it can move; the Cache owns one `engine` and calls it around every update.
struct CountingOffload {
  static inline int updates = 0;

  template <class Storage>
  static constexpr bool serves = Storage::space == kvc::memory_space::host;

  template <class Storage>
  struct engine {
    template <class Cache>
    void before_update(Cache&, std::int64_t) {}  // e.g. wait for the prefetch of this layer
    template <class Cache>
    void after_update(Cache&, std::int64_t) {  // e.g. prefetch the next layer, offload this one
      ++updates;
    }
  };
};
// [/snippet]

namespace {

void layer_policies() {
  {
    // [snippet:using_layers]
    using Hybrid = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>>;

    // Layer kinds known when the program is written ...
    Hybrid a(kvc::DynamicSlidingWindowLayer{.sliding_window = 4}, kvc::DynamicLayer{});

    // ... or only at run time (this is what make_dynamic_cache does with a config's layer_types).
    std::vector<Hybrid::kind_variant> kinds{kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{.sliding_window = 4}};
    Hybrid b(kinds);
    // a.layer_name(0) == "DynamicSlidingWindowLayer", b.layer_name(0) == "DynamicLayer"
    // [/snippet]
    expect(a.size() == 2 && b.size() == 2, "Layers: two layers each");
    expect(a.layer_name(0) == "DynamicSlidingWindowLayer" && a.layer_name(1) == "DynamicLayer", "Layers: a's kinds");
    expect(b.layer_name(0) == "DynamicLayer" && b.get_max_length(1) == 4, "Layers: b's kinds");
  }
  {
    // [snippet:using_replicate]
    kvc::Cache<kvc::Replicate<kvc::DynamicSlidingWindowLayer>> cache(
        kvc::DynamicSlidingWindowLayer{.sliding_window = 8});  // the prototype every new layer copies

    cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), /*layer_idx=*/2);
    // layers 0, 1 and 2 now exist; only layer 2 holds tokens: cache.size() == 3,
    // cache.get_seq_length(2) == 3, cache.get_seq_length(0) == 0
    // [/snippet]
    expect(cache.size() == 3, "Replicate: skipped indices are filled");
    expect(cache.get_seq_length(2) == 3 && cache.get_seq_length(0) == 0, "Replicate: lengths");
    expect(cache.get_max_length(0) == 8, "Replicate: every layer copies the prototype");
  }
  {
    // [snippet:using_custom_layer_policy]
    kvc::Cache<StaticOnly> cache(kvc::StaticLayer{.max_cache_len = 32}, kvc::StaticLayer{.max_cache_len = 32});
    // [/snippet]
    expect(cache.size() == 2 && cache.get_max_length() == 32, "custom layer policy");
  }
}

void layer_kinds() {
  {
    // [snippet:using_dynamic_layer]
    kvc::Cache<kvc::Layers<kvc::DynamicLayer>> cache(kvc::DynamicLayer{});
    auto kv = cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), 0);  // returns 1 2 3
    kv = cache.update(tokens({4}), tokens({4}), 0);                   // returns 1 2 3 4
    cache.crop(-1);                                                   // now holds 1 2 3
    // [/snippet]
    expect(same(seq(kv.values), {1, 2, 3, 4}), "DynamicLayer: returns everything");
    expect(same(seq(cache.stored(0).values), {1, 2, 3}), "DynamicLayer: crop");
    expect(cache.get_max_length() == -1, "DynamicLayer: unbounded");
  }
  {
    // [snippet:using_dynamic_sliding_window_layer]
    kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{.sliding_window = 4});
    auto kv = cache.update(tokens({1, 2, 3}), tokens({1, 2, 3}), 0);  // returns 1 2 3,   keeps 1 2 3
    kv = cache.update(tokens({4}), tokens({4}), 0);                   // returns 1 2 3 4, keeps 2 3 4
    kv = cache.update(tokens({5}), tokens({5}), 0);                   // returns 2 3 4 5, keeps 3 4 5
    auto [kv_length, kv_offset] = cache.get_mask_sizes(2, 0);         // 5, 2: two new tokens see 3 4 5 6 7
    // cache.get_seq_length() == 5: tokens seen, not tokens kept
    // [/snippet]
    expect(same(seq(kv.values), {2, 3, 4, 5}), "DynamicSlidingWindowLayer: returned");
    expect(same(seq(cache.stored(0).values), {3, 4, 5}), "DynamicSlidingWindowLayer: kept");
    expect(kv_length == 5 && kv_offset == 2, "DynamicSlidingWindowLayer: mask sizes");
    expect(cache.get_seq_length() == 5, "DynamicSlidingWindowLayer: seq length");
  }
  {
    // [snippet:using_static_layer]
    kvc::Cache<kvc::Layers<kvc::StaticLayer>> cache(kvc::StaticLayer{.max_cache_len = 6});
    auto kv = cache.update(tokens({1, 2}), tokens({1, 2}), 0);  // returns 1 2 0 0 0 0
    kv = cache.update(tokens({3}), tokens({3}), 0);             // returns 1 2 3 0 0 0
    // cache.get_mask_sizes(1, 0) == (6, 0); 4 more tokens would throw kvc::IndexError
    // [/snippet]
    expect(same(seq(kv.values), {1, 2, 3, 0, 0, 0}), "StaticLayer: the whole buffer");
    expect(cache.get_mask_sizes(1, 0) == std::pair<std::int64_t, std::int64_t>{6, 0}, "StaticLayer: mask sizes");
    bool threw = false;
    try {
      cache.update(tokens({4, 5, 6, 7}), tokens({4, 5, 6, 7}), 0);
    } catch (const kvc::IndexError&) {
      threw = true;
    }
    expect(threw && cache.get_seq_length() == 3, "StaticLayer: IndexError, counter unchanged");
  }
  {
    // [snippet:using_static_sliding_window_layer]
    kvc::Cache<kvc::Layers<kvc::StaticSlidingWindowLayer>> cache(
        kvc::StaticSlidingWindowLayer{.max_cache_len = 16, .sliding_window = 4});  // W = min(16, 4) = 4
    auto kv = cache.update(tokens({1, 2}), tokens({1, 2}), 0);                     // fits: returns the window 1 2 0 0
    kv = cache.update(tokens({3, 4, 5}), tokens({3, 4, 5}), 0);                    // becomes full: returns 1 2 3 4 5
    kv = cache.update(tokens({6}), tokens({6}), 0);                                // full: returns 3 4 5 6
    // [/snippet]
    expect(same(seq(kv.values), {3, 4, 5, 6}), "StaticSlidingWindowLayer: full");
    expect(same(seq(cache.stored(0).values), {3, 4, 5, 6}), "StaticSlidingWindowLayer: window");
    expect(cache.get_max_length() == 4, "StaticSlidingWindowLayer: W");
  }
}

void storage_and_offload() {
  {
    // [snippet:using_host_storage]
    // Half-precision K/V in host memory; the inputs must have the cache's element type.
    kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<Eigen::half>> cache;
    kvc::HostTensor<Eigen::half> k(1, 8, 16, 64);
    k.setConstant(Eigen::half(0.5f));
    auto kv = cache.update(k, k, 0);  // kv.keys is a kvc::TensorView<Eigen::half>
    // cache.bytes() == 2 * (1 * 8 * 16 * 64) * sizeof(Eigen::half): K and V, 16 slots each
    // [/snippet]
    expect(kv.keys(0, 7, 15, 63) == Eigen::half(0.5f), "HostStorage<half>: values");
    expect(cache.bytes() == 2 * 8 * 16 * 64 * 2, "HostStorage<half>: bytes");
    static_assert(std::is_same_v<decltype(kv.keys), kvc::TensorView<Eigen::half>>);
  }
  {
    // [snippet:using_no_offload]
    // The third parameter defaults to kvc::NoOffload; spelled out:
    kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, kvc::NoOffload> cache;
    static_assert(std::is_same_v<decltype(cache), kvc::Cache<kvc::Replicate<kvc::DynamicLayer>>>);
    // [/snippet]
    expect(cache.size() == 0, "NoOffload: an empty replicated cache");
  }
  {
    // [snippet:using_counting_offload]
    kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, CountingOffload> cache;
    cache.update(tokens({1}), tokens({1}), 0);
    cache.update(tokens({1}), tokens({1}), 1);  // CountingOffload::updates == 2
    // [/snippet]
    expect(CountingOffload::updates == 2, "custom offload policy: hooks called");
  }
}

void layout() {
  {
    // [snippet:layout_views]
    kvc::DynamicCache<float> cache;
    kvc::HostTensor<float> k(2, 4, 10, 8);  // batch 2, 4 KV heads, 10 tokens, head_dim 8
    k.setRandom();
    auto kv = cache.update(k, k, 0);
    // The layer allocated 16 slots: the view is [2, 4, 10, 8] with strides [4*16*8, 16*8, 8, 1].
    auto block = kv.keys.head(1, 2);                       // batch 1, head 2: an Eigen::Map [10, 8]
    bool in_place = block.data() == &kv.keys(1, 2, 0, 0);  // true: no copy was made
    kvc::HostTensor<float> owned = kv.keys.to_tensor();    // an explicit, owning copy
    // [/snippet]
    expect(kv.keys.stride(0) == 512 && kv.keys.stride(1) == 128 && kv.keys.stride(2) == 8 && kv.keys.stride(3) == 1,
           "layout: strides");
    expect(in_place && block.rows() == 10 && block.cols() == 8, "layout: head() is a map of the block");
    expect(owned.dimension(2) == 10 && owned(1, 3, 9, 7) == k(1, 3, 9, 7), "layout: to_tensor copies");
  }
  {
    // [snippet:layout_sliding]
    kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{.sliding_window = 4});
    std::vector<std::int64_t> first_slot;  // where each returned window starts in the buffer
    const float* buffer = cache.update(tokens({0, 1, 2}), tokens({0, 1, 2}), 0).keys.data();
    for (float t = 3; t < 20; ++t) first_slot.push_back(cache.update(tokens({t}), tokens({t}), 0).keys.data() - buffer);
    // first_slot: 0 1 2 ... 12, then 0 1 2 3: the window slides along a 16-slot buffer and
    // is moved back to the front (3 tokens copied) only when it reaches the end
    // [/snippet]
    const std::vector<std::int64_t> want{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3};
    expect(first_slot == want, "layout: the sliding window moves back only at the end of the buffer");
    expect(cache.bytes() == 2 * 16 * static_cast<std::int64_t>(sizeof(float)), "layout: 16 slots, never regrown");
  }
}

}  // namespace

int main() {
  layer_policies();
  layer_kinds();
  storage_and_offload();
  layout();
  if (examples::failures == 0) std::printf("policies: OK\n");
  return examples::failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

// The layer selection shared by the offload policies (<kvc/policies/offload/selection.hpp>):
// which layer is prefetched (first offloadable at or after the index, wrapping around), which is
// offloaded after its update, only_non_sliding, linear layers, and the table of what transformers
// does for every layer kind (Cache.prefetch, Cache.offload, Cache.is_linear in cache_utils.py;
// docs/offload.md).

#include "../support/kvc_test.hpp"

#include <kvc/policies/offload/selection.hpp>

#include <array>
#include <string>
#include <string_view>

using kvc::offload::layer_flags;
using kvc::offload::offloadable;
using kvc::offload::prefetch_target;
using kvc::offload::should_offload;

namespace {
// Flags from a string: f = full, s = sliding, l = pure linear.
layer_flags flags(std::string_view kinds) {
  layer_flags f;
  for (const char c : kinds) {
    f.is_linear.push_back(c == 'l');
    f.is_sliding.push_back(c == 's');
  }
  return f;
}

// transformers' Cache.prefetch index choice, written from its code to compare with: `is_offloaded` is
// its list, and list.index(True) raises when nothing is True.
std::int64_t transformers_prefetch(std::int64_t layer_idx, const std::vector<bool>& is_offloaded) {
  const auto n = static_cast<std::int64_t>(is_offloaded.size());
  for (std::int64_t i = layer_idx; i < n; ++i)
    if (is_offloaded[static_cast<std::size_t>(i)]) return i;
  for (std::int64_t i = 0; i < n; ++i)
    if (is_offloaded[static_cast<std::size_t>(i)]) return i;
  throw kvc::ValueError("True is not in list");
}
}  // namespace

TEST_CASE("offloadable: linear layers never, sliding layers unless only_non_sliding") {
  const layer_flags f = flags("fslf");
  CHECK(offloadable(0, f, false));
  CHECK(offloadable(1, f, false));
  CHECK_FALSE(offloadable(2, f, false));
  CHECK(offloadable(3, f, false));
  CHECK(offloadable(0, f, true));
  CHECK_FALSE(offloadable(1, f, true));
  CHECK_FALSE(offloadable(2, f, true));
  CHECK(offloadable(3, f, true));
  CHECK_FALSE(offloadable(4, f, false));  // past the last layer
  CHECK(kvc::offload::any_offloadable(f, true));
  CHECK_FALSE(kvc::offload::any_offloadable(flags("sls"), true));
  CHECK(kvc::offload::any_offloadable(flags("sls"), false));
  CHECK_FALSE(kvc::offload::any_offloadable(flags(""), false));
}

TEST_CASE("prefetch_target: the first offloadable layer at or after the index, else wrap around") {
  const layer_flags f = flags("fsfsl");
  // only_non_sliding = false: every non-linear layer.
  CHECK(prefetch_target(0, f, false) == 0);
  CHECK(prefetch_target(1, f, false) == 1);
  CHECK(prefetch_target(3, f, false) == 3);
  CHECK(prefetch_target(4, f, false) == 0);  // layer 4 is linear: wrap
  CHECK(prefetch_target(5, f, false) == 0);  // past the end: wrap
  CHECK(prefetch_target(99, f, false) == 0);
  // only_non_sliding = true: full layers only.
  CHECK(prefetch_target(0, f, true) == 0);
  CHECK(prefetch_target(1, f, true) == 2);
  CHECK(prefetch_target(2, f, true) == 2);
  CHECK(prefetch_target(3, f, true) == 0);
  CHECK(prefetch_target(5, f, true) == 0);
  // The wrap goes to the first offloadable layer overall, not to 0.
  CHECK(prefetch_target(3, flags("lsfl"), true) == 2);
  CHECK(prefetch_target(3, flags("lsfl"), false) == 1);
}

TEST_CASE("prefetch_target agrees with transformers' list.index for every small layout") {
  // Every layout of up to 5 layers over {f, s, l}, every index up to one past the end.
  for (int n = 1; n <= 5; ++n) {
    int total = 1;
    for (int i = 0; i < n; ++i) total *= 3;
    for (int code = 0; code < total; ++code) {
      std::string kinds;
      for (int i = 0, c = code; i < n; ++i, c /= 3) kinds.push_back("fsl"[c % 3]);
      const layer_flags f = flags(kinds);
      for (const bool ons : {false, true}) {
        std::vector<bool> is_offloaded;
        for (std::size_t i = 0; i < kinds.size(); ++i)
          is_offloaded.push_back(!f.is_linear[i] && !(ons && f.is_sliding[i]));
        for (std::int64_t idx = 0; idx <= n; ++idx) {
          CAPTURE(kinds);
          CAPTURE(ons);
          CAPTURE(idx);
          if (kvc::offload::any_offloadable(f, ons))
            CHECK(prefetch_target(idx, f, ons) == transformers_prefetch(idx, is_offloaded));
          else
            CHECK_THROWS_AS(prefetch_target(idx, f, ons), kvc::ValueError);
        }
      }
    }
  }
}

TEST_CASE("no offloadable layer: a ValueError that says what to change") {
  const std::string expected =
      "Offloading cannot pick a layer to prefetch: no layer can be offloaded, because every layer is a "
      "linear-attention layer or, with offload_only_non_sliding, a sliding-window layer. Offload sliding layers "
      "too, e.g. kvc::OffloadToFile<false>, or use kvc::NoOffload";
  CHECK(std::string(kvc::offload::no_offloadable_layer_message) == expected);
  CHECK_THROWS_WITH_AS(prefetch_target(0, flags("ss"), true), expected.c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(prefetch_target(1, flags("ll"), false), expected.c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(prefetch_target(0, flags(""), false), expected.c_str(), kvc::ValueError);
  CHECK_NOTHROW(prefetch_target(0, flags("ss"), false));
}

TEST_CASE("should_offload: every K/V layer, sliding ones only without only_non_sliding") {
  const layer_flags f = flags("fsl");
  CHECK(should_offload(0, f, false));
  CHECK(should_offload(0, f, true));
  CHECK(should_offload(1, f, false));
  CHECK_FALSE(should_offload(1, f, true));
  CHECK_FALSE(should_offload(2, f, false));  // pure linear: kvc keeps it (transformers never updates it)
  CHECK_FALSE(should_offload(2, f, true));
  CHECK_FALSE(should_offload(3, f, false));
}

TEST_CASE("bad arguments are errors, not undefined behaviour") {
  layer_flags f = flags("ff");
  f.is_sliding.pop_back();
  CHECK_THROWS_WITH_AS(prefetch_target(0, f, false),
                       "kvc::offload::prefetch_target: is_linear has 2 entries but is_sliding has 1; both must list "
                       "every layer of the cache",
                       kvc::ValueError);
  CHECK_THROWS_AS(should_offload(0, f, false), kvc::ValueError);
  CHECK_THROWS_WITH_AS(prefetch_target(-1, flags("f"), false),
                       "kvc::offload::prefetch_target: layer_idx -1 is negative", kvc::IndexError);
  CHECK_THROWS_AS(offloadable(-2, flags("f"), false), kvc::IndexError);
}

// transformers, per layer kind (Cache.is_linear / Cache.is_sliding and the hybrid classes):
//   prefetched  = not is_linear and not (only_non_sliding and is_sliding), where is_linear is True
//                 for every linear-mixin layer except LinearAttentionAndFullAttentionLayer;
//   offloaded   = reached Cache.update and not (only_non_sliding and is_sliding).
// kvc: a layer is prefetched and offloaded alike: not pure linear, and not a sliding layer under
// only_non_sliding. The rows where the two differ are the hybrids transformers offloads without
// ever prefetching them back (docs/offload.md).
TEST_CASE("the table of prefetched and offloaded layers, transformers and kvc") {
  struct row {
    std::string_view name;
    bool sliding, tf_is_linear, kvc_is_linear, has_kv;
  };
  constexpr std::array rows{
      row{"DynamicLayer", false, false, false, true},
      row{"DynamicSlidingWindowLayer", true, false, false, true},
      row{"StaticLayer", false, false, false, true},
      row{"StaticSlidingWindowLayer", true, false, false, true},
      row{"LinearAttentionLayer", false, true, true, false},
      row{"LinearAttentionAndFullAttentionLayer", false, false, false, true},
      row{"LinearAttentionAndSlidingWindowAttentionLayer", true, true, false, true},
      row{"LinearAttentionAndStaticFullAttentionLayer", false, true, false, true},
      row{"LinearAttentionAndStaticSlidingWindowAttentionLayer", true, true, false, true},
  };
  for (const bool ons : {false, true}) {
    for (const row& r : rows) {
      CAPTURE(r.name);
      CAPTURE(ons);
      const layer_flags f{{r.kvc_is_linear}, {r.sliding}};
      const bool tf_prefetched = !r.tf_is_linear && !(ons && r.sliding);
      const bool tf_offloaded = r.has_kv && !(ons && r.sliding);
      const bool kvc_moved = should_offload(0, f, ons);
      CHECK(offloadable(0, f, ons) == kvc_moved);
      CHECK(kvc_moved == (r.has_kv && !(ons && r.sliding)));
      // kvc offloads exactly what transformers offloads...
      CHECK(kvc_moved == tf_offloaded);
      // ...and, unlike transformers, prefetches every layer it offloads.
      if (tf_prefetched != tf_offloaded) CHECK(r.name.starts_with("LinearAttentionAnd"));
    }
  }
  // The three hybrids transformers offloads but never prefetches (when they are offloaded at all).
  CHECK_FALSE(rows[6].tf_is_linear == rows[6].kvc_is_linear);
  CHECK_FALSE(rows[7].tf_is_linear == rows[7].kvc_is_linear);
  CHECK_FALSE(rows[8].tf_is_linear == rows[8].kvc_is_linear);
}

TEST_CASE("the flags a real cache reports feed the selection as the table says") {
  using C = kvc::ConfiguredDynamicCache<float>;
  C cache(std::vector<C::kind_variant>{kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{4},
                                       kvc::LinearAttentionLayer{}, kvc::LinearAttentionAndFullAttentionLayer{},
                                       kvc::LinearAttentionAndSlidingWindowAttentionLayer{{4}, 1}});
  const layer_flags f{cache.is_linear(), cache.is_sliding()};
  CHECK(f.is_linear == std::vector<bool>{false, false, true, false, false});
  CHECK(f.is_sliding == std::vector<bool>{false, true, false, false, true});
  // only_non_sliding = false: every layer but the pure linear one; after the last layer, wrap to 0.
  CHECK(prefetch_target(2, f, false) == 3);
  CHECK(prefetch_target(5, f, false) == 0);
  // only_non_sliding = true: layers 0 and 3.
  CHECK(prefetch_target(1, f, true) == 3);
  CHECK(prefetch_target(4, f, true) == 0);
  CHECK(should_offload(4, f, false));
  CHECK_FALSE(should_offload(4, f, true));
}

// The strong guarantee at every public mutating entry point: each cache make_cache builds (dynamic,
// offloaded, static, offloaded static, quantized), behind AnyCache, and a typed DynamicCache and
// an offloaded typed cache, is given bad input through attend, update, the batch operations,
// crop, early_initialization and set_write_position; every call must throw, and every observable of
// the cache must be as it was before the call.

#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {

// What a caller can observe of an AnyCache (or a typed cache through the same method names).
struct observed {
  std::int64_t size = 0;
  std::string batch;
  std::int64_t bytes = 0;
  bool initialized = false;
  std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::string, std::vector<double>,
                         std::vector<double>>>
      layers;
};

template <class C>
observed observe(const C& c) {
  observed o;
  o.size = c.size();
  try {
    o.batch = std::to_string(c.batch_size());
  } catch (const std::exception& e) {
    o.batch = e.what();
  }
  o.bytes = c.bytes();
  o.initialized = c.is_initialized();
  for (std::int64_t i = 0; i < c.size(); ++i) {
    const auto kv = [&] {
      if constexpr (requires { c.template stored<float>(i); })
        return c.template stored<float>(i);
      else
        return c.stored(i);
    }();
    const auto [kl, ko] = c.get_mask_sizes(2, i);
    o.layers.emplace_back(c.get_seq_length(i), c.get_max_length(i), kl, ko, std::string(c.layer_name(i)),
                          kvc_test::flatten(kv.keys), kvc_test::flatten(kv.values));
  }
  return o;
}

// Runs `op`, which must throw, and checks that the cache is exactly as before. Of an offloaded
// cache, which layers are in RAM (hence bytes()) is not state the guarantee covers: a refused call
// may already have brought its layer in, as a const call does (docs/offload.md).
bool offloaded = false;

template <class C, class Op>
void refused_unchanged(C& cache, const char* what, Op&& op) {
  CAPTURE(std::string(what));
  const observed before = observe(cache);
  CHECK_THROWS(op());
  const observed after = observe(cache);
  CHECK(after.size == before.size);
  CHECK(after.batch == before.batch);
  if (!offloaded) CHECK(after.bytes == before.bytes);
  CHECK(after.initialized == before.initialized);
  CHECK(after.layers == before.layers);
}

// 2 layers (full, sliding window 3), 4 query heads over 2 key/value heads, head_dim 4.
kvc::ModelConfig model(bool with_sliding) {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.sliding_window = 3;
  c.layer_types = with_sliding ? std::vector<std::string>{"full_attention", "sliding_attention"}
                               : std::vector<std::string>{"full_attention", "full_attention"};
  return c;
}

// Every entry point with input it must refuse, after a valid prefill of 2 tokens per layer.
// `dynamic`: the cache's layers are dynamic (crop and the batch operations apply, no write position).
template <class C>
void check_every_entry_point(C& cache, bool dynamic, std::mt19937& rng) {
  constexpr bool erased = requires { cache.element_type_name(); };  // an AnyCache
  using kvc_test::random_tensor;
  const auto q = random_tensor<float>(1, 4, 2, 4, rng);
  const auto k = random_tensor<float>(1, 2, 2, 4, rng);
  for (std::int64_t l = 0; l < 2; ++l) (void)kvc::attend(cache, l, q, k, k);
  REQUIRE(cache.get_seq_length(0) == 2);

  refused_unchanged(cache, "attend: 3 query heads over 2 key/value heads", [&] {
    (void)kvc::attend(cache, 0, random_tensor<float>(1, 3, 1, 4, rng), random_tensor<float>(1, 2, 1, 4, rng),
                      random_tensor<float>(1, 2, 1, 4, rng));
  });
  refused_unchanged(cache, "attend: queries of another head_dim", [&] {
    (void)kvc::attend(cache, 0, random_tensor<float>(1, 4, 1, 5, rng), random_tensor<float>(1, 2, 1, 4, rng),
                      random_tensor<float>(1, 2, 1, 4, rng));
  });
  refused_unchanged(cache, "attend: queries and keys of different lengths", [&] {
    (void)kvc::attend(cache, 1, random_tensor<float>(1, 4, 2, 4, rng), random_tensor<float>(1, 2, 1, 4, rng),
                      random_tensor<float>(1, 2, 1, 4, rng));
  });
  refused_unchanged(cache, "attend: keys of another head count than the layer holds", [&] {
    (void)kvc::attend(cache, 0, random_tensor<float>(1, 3, 1, 4, rng), random_tensor<float>(1, 3, 1, 4, rng),
                      random_tensor<float>(1, 3, 1, 4, rng));
  });
  refused_unchanged(cache, "attend: a layer index past the last", [&] { (void)kvc::attend(cache, 7, q, k, k); });
  refused_unchanged(cache, "attend: a zero sliding window", [&] {
    (void)kvc::attend(cache, 0, random_tensor<float>(1, 4, 1, 4, rng), random_tensor<float>(1, 2, 1, 4, rng),
                      random_tensor<float>(1, 2, 1, 4, rng), {.sliding_window = 0});
  });
  refused_unchanged(cache, "update: another batch", [&] {
    (void)cache.update(random_tensor<float>(2, 2, 1, 4, rng), random_tensor<float>(2, 2, 1, 4, rng), 0);
  });
  refused_unchanged(cache, "update: another head_dim", [&] {
    (void)cache.update(random_tensor<float>(1, 2, 1, 3, rng), random_tensor<float>(1, 2, 1, 3, rng), 1);
  });
  refused_unchanged(cache, "update: keys and values of different lengths", [&] {
    (void)cache.update(random_tensor<float>(1, 2, 1, 4, rng), random_tensor<float>(1, 2, 2, 4, rng), 0);
  });
  refused_unchanged(cache, "update: a negative layer index", [&] {
    (void)cache.update(random_tensor<float>(1, 2, 1, 4, rng), random_tensor<float>(1, 2, 1, 4, rng), -1);
  });
  refused_unchanged(cache, "reorder_cache: an index past the batch", [&] { cache.reorder_cache({1}); });
  refused_unchanged(cache, "early_initialization: lists of the wrong length", [&] {
    cache.early_initialization(1, std::vector<std::int64_t>{2, 2, 2}, std::vector<std::int64_t>{4, 4, 4});
  });
  constexpr bool has_batch_ops = [] {
    if constexpr (erased)
      return true;
    else
      return C::can_batch_ops;
  }();
  const bool batch_ops = dynamic && has_batch_ops;
  if constexpr (has_batch_ops) {
    if (batch_ops)
      refused_unchanged(cache, "batch_select_indices: an index past the batch",
                        [&] { cache.batch_select_indices({5}); });
    if (batch_ops)
      refused_unchanged(cache, "batch_repeat_interleave: a negative count", [&] { cache.batch_repeat_interleave(-1); });
  }
  if constexpr (erased) {  // what a typed cache refuses at compile time
    refused_unchanged(cache, "set_write_position: a negative position", [&] { cache.set_write_position(-1); });
    if (!dynamic) {
      refused_unchanged(cache, "crop of a static cache", [&] { cache.crop(1); });
      refused_unchanged(cache, "batch_select_indices of a static cache", [&] { cache.batch_select_indices({0}); });
    }
    refused_unchanged(cache, "update: another element type", [&] {
      (void)cache.update(random_tensor<double>(1, 2, 1, 4, rng), random_tensor<double>(1, 2, 1, 4, rng), 0);
    });
  }
  // Still usable: one more valid step goes in once.
  (void)kvc::attend(cache, 0, random_tensor<float>(1, 4, 1, 4, rng), random_tensor<float>(1, 2, 1, 4, rng),
                    random_tensor<float>(1, 2, 1, 4, rng));
  CHECK(cache.get_seq_length(0) == 3);
}

}  // namespace

TEST_CASE("every cache make_cache builds refuses bad input at every entry point and stays as it was") {
  kvc_test::spill_dir spill;  // the offloaded caches' spill files
  kvc_test::captured_warnings warnings;
  std::mt19937 rng(11);
  for (const std::string impl : {"dynamic", "offloaded", "static", "offloaded_static", "quantized"}) {
    CAPTURE(impl);
    kvc::GenerationConfig generation;
    generation.cache_implementation = impl;
    generation.max_length = 9;
    if (impl == "quantized")
      generation.cache_config =
          nlohmann::ordered_json{{"backend", "quanto"}, {"nbits", 4}, {"residual_length", 2}, {"q_group_size", 4}};
    kvc::AnyCache cache = kvc::make_cache<float>(generation, model(impl != "quantized"));
    offloaded = impl.find("offloaded") != std::string::npos;
    check_every_entry_point(cache, cache.is_dynamic_cache(), rng);
  }
}

TEST_CASE("typed caches, plain and offloaded, refuse bad input at every entry point and stay as they were") {
  kvc_test::spill_dir spill;
  std::mt19937 rng(12);
  offloaded = false;
  SUBCASE("make_dynamic_cache") {
    auto cache = kvc::make_dynamic_cache<float>(model(true));
    check_every_entry_point(cache, true, rng);
  }
  SUBCASE("make_dynamic_cache with OffloadToFile") {
    offloaded = true;
    auto cache = kvc::make_dynamic_cache<float, kvc::HostStorage<float>, kvc::OffloadToFile<false>>(model(true));
    check_every_entry_point(cache, true, rng);
  }
  SUBCASE("StaticCache with OffloadToFile") {
    offloaded = true;
    kvc::StaticCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<true>> cache(model(true), 8);
    check_every_entry_point(cache, false, rng);
    refused_unchanged(cache, "set_write_position: a negative position", [&] { cache.set_write_position(-1); });
  }
}

TEST_CASE("a warning handler that throws from a positive crop leaves every layer as it was") {
  // The deprecation warning of a positive crop comes from check_crop, which every layer passes
  // before any layer changes: a handler that throws stops the crop before it starts.
  std::mt19937 rng(13);
  auto cache = kvc::make_dynamic_cache<float>(model(true));
  const auto k = kvc_test::random_tensor<float>(1, 2, 2, 4, rng);
  for (std::int64_t l = 0; l < 2; ++l) (void)cache.update(k, k, l);
  kvc::reset_warnings_seen();
  auto previous = kvc::set_warning_handler([](std::string_view m) { throw kvc::RuntimeError(std::string(m)); });
  const auto before = kvc_test::take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.crop(1), std::string(kvc::positive_crop_deprecation).c_str(), kvc::RuntimeError);
  CHECK(kvc_test::take_snapshot(cache) == before);
  kvc::set_warning_handler(previous);
  // The warning was delivered (once); the same crop now runs, keeping 1 token in every layer.
  cache.crop(1);
  CHECK(cache.get_seq_length(0) == 1);
  CHECK(cache.get_seq_length(1) == 1);
  kvc::reset_warnings_seen();
}

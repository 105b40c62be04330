// Property tests over random operation sequences:
//  - a DynamicCache and a StaticCache with room enough hold and return the same data;
//  - every call that throws leaves every observable of the cache unchanged (strong guarantee).

#include "../support/kvc_test.hpp"

namespace {
std::int64_t uniform(std::mt19937& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

// Every draw from the generator is sequenced (no two in one call's arguments, whose order differs
// between g++ and clang++), so that a seed walks the same path in every build of this test.

// Runs `op`; if it throws, checks that the cache is exactly as before. Returns whether it threw.
template <class Cache, class Op>
bool run_checked(Cache& cache, Op&& op) {
  const auto before = kvc_test::take_snapshot(cache);
  try {
    op();
    return false;
  } catch (const std::exception& e) {
    INFO("threw: " << std::string(e.what()));
    REQUIRE(kvc_test::take_snapshot(cache) == before);
    return true;
  }
}
}  // namespace

TEST_CASE_TEMPLATE_DEFINE("DynamicCache and StaticCache hold and return the same tokens", T, same_data) {
  std::mt19937 rng(31337);
  for (int trial = 0; trial < 5; ++trial) {
    const std::int64_t layers = uniform(rng, 1, 4), batch = uniform(rng, 1, 3), heads = uniform(rng, 1, 4),
                       dim = uniform(rng, 1, 9), room = 48;
    kvc::ModelConfig c;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.head_dim = dim;
    kvc::DynamicCache<T> dynamic;
    kvc::StaticCache<T> fixed(c, room);
    std::vector<std::int64_t> length(static_cast<std::size_t>(layers), 0);
    for (int step = 0; step < 60; ++step) {
      const std::int64_t l = uniform(rng, 0, layers - 1);
      const std::int64_t q = uniform(rng, 1, 6);
      if (length[static_cast<std::size_t>(l)] + q > room) continue;
      length[static_cast<std::size_t>(l)] += q;
      const auto k = kvc_test::random_tensor<T>(batch, heads, q, dim, rng);
      const auto v = kvc_test::random_tensor<T>(batch, heads, q, dim, rng);
      const auto a = dynamic.update(k, v, l);
      const auto b = fixed.update(k, v, l);
      const std::int64_t n = length[static_cast<std::size_t>(l)];
      REQUIRE(a.keys.extent(2) == n);
      REQUIRE(b.keys.extent(2) == room);
      REQUIRE(dynamic.get_seq_length(l) == fixed.get_seq_length(l));
      for (std::int64_t i = 0; i < batch; ++i)
        for (std::int64_t h = 0; h < heads; ++h) {
          REQUIRE(a.keys.head(i, h) == b.keys.head(i, h).topRows(n));
          REQUIRE(a.values.head(i, h) == b.values.head(i, h).topRows(n));
        }
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(same_data, kvc_test::element_types);

TEST_CASE("random operations on a configured dynamic cache: every throwing call changes nothing") {
  std::mt19937 rng(7);
  kvc::ModelConfig c;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.head_dim = 3;
  c.sliding_window = 3;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention", "full_attention"};
  int threw = 0, ran = 0;
  auto previous = kvc::set_warning_handler({});
  for (int trial = 0; trial < 8; ++trial) {
    auto cache = kvc::make_dynamic_cache<float>(c);
    std::int64_t batch = 2;
    for (int step = 0; step < 80; ++step) {
      const auto op = uniform(rng, 0, 9);
      const bool t = run_checked(cache, [&] {
        switch (op) {
          case 0:
          case 1: {  // update, sometimes with a wrong batch, head count, head_dim or index
            const auto bad = uniform(rng, 0, 5);
            const std::int64_t b = bad == 1 ? batch + 1 : batch, h = bad == 2 ? 3 : 2, d = bad == 3 ? 4 : 3;
            const std::int64_t l = bad == 4 ? 3 : uniform(rng, 0, 2);
            const auto k = kvc_test::random_tensor<float>(b, h, uniform(rng, 0, 4), d, rng);
            const auto v = bad == 5 ? kvc_test::random_tensor<float>(b, h, k.dimension(2) + 1, d, rng) : k;
            cache.update(k, v, l);
            break;
          }
          case 2:
            cache.crop(uniform(rng, -6, 4));
            break;
          case 3: {
            std::vector<std::int64_t> idx(static_cast<std::size_t>(batch));
            for (auto& i : idx) i = uniform(rng, -1, batch);
            cache.reorder_cache(idx);
            break;
          }
          case 4: {
            std::vector<std::int64_t> idx(static_cast<std::size_t>(uniform(rng, 0, 2)));
            for (auto& i : idx) i = uniform(rng, 0, batch);
            cache.batch_select_indices(idx);
            batch = static_cast<std::int64_t>(idx.size());
            break;
          }
          case 5: {
            const auto r = uniform(rng, 0, 2);
            if (batch * r > 4) return;
            cache.batch_repeat_interleave(r);
            batch *= r;
            break;
          }
          case 6:
            cache.early_initialization(batch,
                                       std::vector<std::int64_t>(static_cast<std::size_t>(uniform(rng, 2, 4)), 2), 3);
            break;
          case 7: {
            const auto q = uniform(rng, -1, 3), l = uniform(rng, -1, 4);
            (void)cache.get_mask_sizes(q, l);
            break;
          }
          case 8:
            if (uniform(rng, 0, 4) == 0) cache.activate_past_recording();
            break;
          default:
            if (uniform(rng, 0, 6) == 0) {
              cache.reset();
              batch = 2;
            }
            break;
        }
      });
      threw += t;
      ran += !t;
    }
  }
  kvc::set_warning_handler(previous);
  CHECK(threw > 100);
  CHECK(ran > 100);
}

TEST_CASE("random operations on static caches: every throwing call changes nothing") {
  std::mt19937 rng(11);
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 1;
  c.head_dim = 2;
  c.sliding_window = 3;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  int threw = 0;
  for (int trial = 0; trial < 8; ++trial) {
    kvc::StaticCache<float> cache(c, 6);
    kvc::Cache<kvc::Layers<kvc::StaticLayer>> only_static(kvc::StaticLayer{5}, kvc::StaticLayer{7});
    for (int step = 0; step < 60; ++step) {
      const auto op = uniform(rng, 0, 4);
      const std::int64_t q = uniform(rng, 1, 4), d = uniform(rng, 0, 5) == 0 ? 3 : 2;
      const auto k = kvc_test::random_tensor<float>(1, 1, q, d, rng);
      threw += run_checked(cache, [&] {
        switch (op) {
          case 0:
          case 1:
            cache.update(k, k, uniform(rng, 0, 2));
            break;
          case 2:
            cache.reorder_cache({uniform(rng, 0, 1)});
            break;
          case 3:
            cache.early_initialization(1, {1, 1, 1}, 2);
            break;
          default:
            if (uniform(rng, 0, 5) == 0) cache.reset();
            break;
        }
      });
      threw += run_checked(only_static, [&] {
        switch (op) {
          case 0:
          case 1:
            only_static.update(k, k, uniform(rng, 0, 1));
            break;
          case 2:
            only_static.set_write_position(uniform(rng, -1, 8));
            break;
          case 3:
            only_static.early_initialization(uniform(rng, 0, 1), 1, 2);
            break;
          default:
            if (uniform(rng, 0, 5) == 0) only_static.reset();
            break;
        }
      });
    }
  }
  CHECK(threw > 100);
}

TEST_CASE("random operations on every dynamic kind (linear, hybrid, indexed, quantized): throws change nothing") {
  using C = kvc::Cache<
      kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer, kvc::LinearAttentionLayer,
                  kvc::LinearAttentionAndFullAttentionLayer, kvc::LinearAttentionAndSlidingWindowAttentionLayer,
                  kvc::DynamicIndexedLayer, kvc::QuantoQuantizedLayer>>;
  using State = Eigen::Tensor<float, 3, Eigen::RowMajor>;
  std::mt19937 rng(11);
  int threw = 0, ran = 0;
  auto previous = kvc::set_warning_handler({});
  auto state = [&](std::int64_t b, std::int64_t c, std::int64_t t) {
    State x(b, c, t);
    for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(uniform(rng, -8, 8)) / 4;
    return x;
  };
  for (int trial = 0; trial < 6; ++trial) {
    C cache(std::vector<C::kind_variant>{kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{3},
                                         kvc::LinearAttentionLayer{2}, kvc::LinearAttentionAndFullAttentionLayer{},
                                         kvc::LinearAttentionAndSlidingWindowAttentionLayer{{3}, 1},
                                         kvc::DynamicIndexedLayer{}, kvc::QuantoQuantizedLayer{4, 0, 0, 4, 2}});
    std::int64_t batch = 2;
    for (int step = 0; step < 120; ++step) {
      const auto op = uniform(rng, 0, 11);
      const bool t = run_checked(cache, [&] {
        const auto bad = uniform(rng, 0, 5);
        const std::int64_t b = bad == 1 ? batch + 1 : batch;
        switch (op) {
          case 0:
          case 1: {  // K/V update: wrong batch, head_dim or index sometimes; pure linear layers throw
            const std::int64_t d = bad == 2 ? 5 : 4, l = bad == 3 ? 7 : uniform(rng, 0, 6);
            const auto k = kvc_test::random_tensor<float>(b, 2, uniform(rng, 0, 3), d, rng);
            cache.update(k, k, l);
            break;
          }
          case 2: {  // conv states: wrong channels or kernel sometimes; attention layers throw
            const std::int64_t channels = bad == 2 ? 5 : 3;
            const auto t = uniform(rng, 1, 4), l = uniform(rng, 0, 6), i = uniform(rng, 0, 2),
                       kernel = uniform(rng, -1, 3);
            cache.update_conv_state(state(b, channels, t), l, i, kernel);
            break;
          }
          case 3: {
            const auto x = state(b, bad == 2 ? 3 : 2, 2);
            const auto l = uniform(rng, 0, 6), i = uniform(rng, 0, 1);
            cache.update_recurrent_state(x, l, i);
            break;
          }
          case 4: {
            const auto x = state(b, uniform(rng, 0, 2), bad == 2 ? 3 : 4);
            cache.update_indexer(x, uniform(rng, 4, 6));
            break;
          }
          case 5:
            cache.crop(uniform(rng, -5, 2));
            break;
          case 6: {
            std::vector<std::int64_t> idx(static_cast<std::size_t>(batch));
            for (auto& i : idx) i = uniform(rng, -1, batch);
            cache.reorder_cache(idx);
            break;
          }
          case 7: {
            std::vector<std::int64_t> idx(static_cast<std::size_t>(uniform(rng, 1, 2)));
            for (auto& i : idx) i = uniform(rng, 0, batch);
            cache.batch_select_indices(idx);
            batch = static_cast<std::int64_t>(idx.size());
            break;
          }
          case 8: {
            const auto r = uniform(rng, 0, 2);
            if (batch * r > 4) return;
            cache.batch_repeat_interleave(r);
            batch *= r;
            break;
          }
          case 9: {
            const auto l = uniform(rng, 0, 7), i = uniform(rng, -1, 2);
            (void)cache.has_previous_state(l, i);
            break;
          }
          case 10:
            if (uniform(rng, 0, 3) == 0) cache.activate_past_recording();
            break;
          default:
            if (uniform(rng, 0, 8) == 0) {
              cache.reset();
              batch = 2;
            }
            break;
        }
      });
      threw += t;
      ran += !t;
    }
  }
  kvc::set_warning_handler(previous);
  CHECK(threw > 100);
  CHECK(ran > 100);
}

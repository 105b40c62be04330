// kvc::AnyCache: the Cache method set behind one type-erased handle, with the compile-time checks
// of a typed Cache turned into run-time errors.

#include <kvc/any_cache.hpp>

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

namespace {
kvc::ModelConfig two_layers() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 1;
  c.head_dim = 1;
  c.sliding_window = 2;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  return c;
}
}  // namespace

TEST_CASE("an AnyCache behaves like the cache it holds") {
  std::vector<kvc::AnyCache> caches;
  caches.emplace_back(kvc::DynamicCache<float>());
  caches.emplace_back(kvc::make_dynamic_cache<float>(two_layers()));
  caches.emplace_back(kvc::StaticCache<float>(two_layers(), 4));
  for (auto& c : caches) {
    c.update(seq({1, 2, 3}), seq({1, 2, 3}), 0);
    c.update(seq({1, 2, 3}), seq({1, 2, 3}), 1);
    CHECK(c.size() == 2);
    CHECK(c.get_seq_length(1) == 3);
    CHECK(c.element_type_name() == "float");
    CHECK(c.bytes() > 0);
    CHECK(c.batch_size() == 1);
  }
  CHECK(values_of(caches[0].stored<float>(1).keys) == V{1, 2, 3});
  CHECK(values_of(caches[1].stored<float>(1).keys) == V{3});
  CHECK(values_of(caches[2].stored<float>(1).keys) == V{2, 3});
  CHECK(values_of(caches[2].stored<float>(0).keys) == V{1, 2, 3, 0});
  CHECK(caches[1].is_sliding() == std::vector<bool>{false, true});
  CHECK(caches[1].is_sliding(1));
  CHECK(caches[2].is_compileable());
  CHECK_FALSE(caches[0].is_compileable());
  CHECK(caches[1].get_max_length() == -1);
  CHECK(caches[2].get_max_length() == 4);
  CHECK(caches[1].get_mask_sizes(1, 1) == std::pair<std::int64_t, std::int64_t>{2, 2});
  caches[0].crop(-1);
  CHECK(caches[0].get_seq_length(0) == 2);
  caches[0].batch_repeat_interleave(2);
  caches[0].batch_select_indices({1});
  caches[0].reorder_cache({0});
  CHECK(caches[0].batch_size() == 1);
  CHECK_THROWS_WITH_AS(caches[2].set_write_position(1),
                       "'StaticSlidingWindowLayer' object has no attribute 'set_write_position'", kvc::AttributeError);
  caches[2].reset();
  CHECK(caches[2].get_seq_length(0) == 0);
  CHECK(caches[2].is_initialized());
  caches[0].activate_past_recording();
}

TEST_CASE("AnyCache::reserve reaches the held cache's growing layers") {
  kvc::HostTensor<float> kv(1, 1, 1, 1);
  kv.setConstant(1.0f);
  const auto grown = [&](kvc::AnyCache cache, std::int64_t reserved) {
    if (reserved > 0) cache.reserve(reserved);
    for (std::int64_t l = 0; l < 2; ++l) cache.update(kv, kv, l);
    return cache.bytes();
  };
  kvc::DynamicCache<float> typed;
  typed.reserve(300);
  for (std::int64_t l = 0; l < 2; ++l) typed.update(kv, kv, l);
  CHECK(grown(kvc::DynamicCache<float>(), 300) == typed.bytes());
  CHECK(grown(kvc::DynamicCache<float>(), 300) > grown(kvc::DynamicCache<float>(), 0));
  // Layers that do not grow keep their room; an empty handle has no cache to reserve in.
  CHECK(grown(kvc::StaticCache<float>(two_layers(), 4), 300) == grown(kvc::StaticCache<float>(two_layers(), 4), 0));
  CHECK_THROWS_AS(kvc::AnyCache().reserve(8), kvc::ValueError);
}

TEST_CASE("get<C>() recovers the held cache") {
  kvc::AnyCache any = kvc::StaticCache<Eigen::bfloat16>(two_layers(), 4);
  REQUIRE(any.get<kvc::StaticCache<Eigen::bfloat16>>() != nullptr);
  CHECK(any.get<kvc::StaticCache<float>>() == nullptr);
  CHECK(any.get<kvc::DynamicCache<Eigen::bfloat16>>() == nullptr);
  any.get<kvc::StaticCache<Eigen::bfloat16>>()->early_initialization(1, 1, 1);
  CHECK(any.is_initialized());
  CHECK(any.element_type_name() == "bfloat16");
}

TEST_CASE("what a typed Cache rejects at compile time, AnyCache rejects at run time") {
  kvc::AnyCache fixed = kvc::StaticCache<float>(two_layers(), 4);
  fixed.update(seq({1}), seq({1}), 0);
  const char* crop = "'StaticLayer' object has no attribute 'crop'";
  CHECK_THROWS_WITH_AS(fixed.crop(-1), crop, kvc::AttributeError);
  CHECK_THROWS_WITH_AS(fixed.batch_repeat_interleave(2),
                       "'StaticLayer' object has no attribute 'batch_repeat_interleave'", kvc::AttributeError);
  CHECK_THROWS_WITH_AS(fixed.batch_select_indices({0}), "'StaticLayer' object has no attribute 'batch_select_indices'",
                       kvc::AttributeError);
  kvc::AnyCache dynamic = kvc::DynamicCache<float>();
  dynamic.set_write_position(0);  // no layers yet: nothing to do, as in Python
  dynamic.update(seq({1}), seq({1}), 0);
  CHECK_THROWS_WITH_AS(dynamic.set_write_position(0), "'DynamicLayer' object has no attribute 'set_write_position'",
                       kvc::AttributeError);
  CHECK_THROWS_WITH_AS(dynamic.update(seq<double>({1}), seq<double>({1}), 0),
                       "AnyCache::update: the cache holds float elements, got double", kvc::TypeError);
  CHECK_THROWS_WITH_AS(dynamic.stored<Eigen::half>(0), "AnyCache::stored: the cache holds float elements, not half",
                       kvc::TypeError);
  CHECK(dynamic.get_seq_length() == 1);
  kvc::AnyCache empty;
  CHECK_FALSE(empty.has_value());
  CHECK_THROWS_WITH_AS(empty.size(), "AnyCache: the handle holds no cache", kvc::ValueError);
  empty.reset();  // noexcept methods do nothing on an empty handle
}

TEST_CASE("errors of the held cache pass through unchanged") {
  kvc::AnyCache fixed = kvc::StaticCache<float>(two_layers(), 2);
  fixed.update(seq({1, 2}), seq({1, 2}), 0);
  CHECK_THROWS_AS(fixed.update(seq({3}), seq({3}), 0), kvc::IndexError);
  CHECK_THROWS_WITH_AS(fixed.early_initialization(1, {1, 2, 3}, 1),
                       "`num_head` was provided as a list of length 3, but the Cache currently has 2 layers",
                       kvc::ValueError);
  CHECK(fixed.get_seq_length(0) == 2);
}

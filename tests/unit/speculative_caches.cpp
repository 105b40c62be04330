// kvc::MtpCache and kvc::DFlashCache: transformers' MtpCache and DFlashCache
// (src/transformers/cache_utils.py at a597f974).

#include <kvc/speculative_caches.hpp>

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using P = std::pair<std::int64_t, std::int64_t>;

TEST_CASE("MtpCache shifts the query offset and kv_offset by layer_idx + 1") {
  // [snippet:mtp]
  kvc::MtpCache<float> cache;
  for (std::int64_t layer = 0; layer < 3; ++layer) cache.update(seq({1, 2, 3}), seq({1, 2, 3}), layer);
  // get_query_offset(i) = get_seq_length(i) + i + 1
  // get_mask_sizes(q, i) = DynamicCache's (kv_length, kv_offset + i + 1)
  // [/snippet]
  CHECK(cache.get_query_offset() == 4);
  CHECK(cache.get_query_offset(0) == 4);
  CHECK(cache.get_query_offset(2) == 6);
  CHECK(cache.get_query_offset(7) == 8);  // a layer not created yet has length 0
  CHECK(cache.get_mask_sizes(2, 0) == P{5, 1});
  CHECK(cache.get_mask_sizes(2, 2) == P{5, 3});
  CHECK(cache.get_mask_sizes(2, 9) == P{2, 10});
  CHECK_THROWS_AS(cache.get_query_offset(-1), kvc::IndexError);

  // everything else is a DynamicCache
  CHECK(std::is_base_of_v<kvc::DynamicCache<float>, kvc::MtpCache<float>>);
  cache.crop(-1);
  CHECK(cache.get_seq_length(1) == 2);
  CHECK(cache.get_query_offset(1) == 4);
  cache.reset();
  CHECK(cache.get_query_offset(1) == 2);
  CHECK(kvc::MtpCache<double>(kvc::DynamicLayer{}).size() == 0);  // the base constructors are inherited
}

TEST_CASE("DFlashCache adds the previously accepted tokens to the query offset and kv_length") {
  kvc::DFlashCache<float> cache;
  cache.update(seq({1, 2, 3, 4}), seq({1, 2, 3, 4}), 0);
  CHECK(cache.previous_accepted_tokens() == 0);
  CHECK(cache.get_query_offset() == 4);
  CHECK(cache.get_mask_sizes(1, 0) == P{5, 0});
  cache.set_previous_accepted_tokens(3);
  CHECK(cache.previous_accepted_tokens() == 3);
  CHECK(cache.get_query_offset() == 7);
  CHECK(cache.get_query_offset(1) == 3);  // missing layer: 0 + 3
  CHECK(cache.get_mask_sizes(1, 0) == P{8, 0});
  CHECK_THROWS_WITH_AS(cache.set_previous_accepted_tokens(-1),
                       "set_previous_accepted_tokens: the number of accepted tokens must be 0 or more, got -1",
                       kvc::ValueError);
  CHECK(cache.previous_accepted_tokens() == 3);
  cache.reset();  // as in transformers, reset keeps the count
  CHECK(cache.get_query_offset() == 3);
}

TEST_CASE("the shift is seen by code that knows the type, not through a base reference") {
  kvc::MtpCache<float> mtp;
  mtp.update(seq({1, 2}), seq({1, 2}), 0);
  const kvc::DynamicCache<float>& base = mtp;
  CHECK(mtp.get_mask_sizes(1, 0) == P{3, 1});
  CHECK(base.get_mask_sizes(1, 0) == P{3, 0});  // hidden, not overridden (docs/encoder_decoder.md)
  CHECK(base.get_query_offset(0) == 2);

  // AnyCache keeps the concrete type: the shift survives type erasure
  kvc::AnyCache any(mtp);
  CHECK(any.get_mask_sizes(1, 0) == P{3, 1});
  kvc::DFlashCache<float> dflash;
  dflash.set_previous_accepted_tokens(2);
  kvc::AnyCache any_dflash(dflash);
  CHECK(any_dflash.get_mask_sizes(1, 0) == P{3, 0});
}

#pragma once
// Caches for speculative decoding (transformers' MtpCache and DFlashCache in cache_utils.py): a
// kvc::DynamicCache whose query offset and mask sizes are shifted. Usage: docs/encoder_decoder.md.
//
//  - MtpCache (multi-token prediction): the draft layer `layer_idx` predicts the token
//    `layer_idx + 1` steps ahead, so its query starts `layer_idx + 1` positions later and its
//    mask window moves with it.
//  - DFlashCache: the tokens the target model accepted in the previous round are not in the
//    cache yet but precede the query; they lengthen the mask and move the query offset.
//
// These classes *hide* Cache::get_query_offset and Cache::get_mask_sizes (Cache has no virtual
// functions). Code that knows the cache's type (kvc::attend, EncoderDecoderCache, AnyCache built
// from an MtpCache) sees the shifted values; code that holds a reference to the base
// kvc::Cache<...> or kvc::DynamicCache<...> gets the unshifted ones (docs/encoder_decoder.md).

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/caches.hpp>
#include <kvc/errors.hpp>

namespace kvc {

// transformers' MtpCache(DynamicCache).
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class MtpCache : public DynamicCache<T, Storage, Offload> {
  using base = DynamicCache<T, Storage, Offload>;

 public:
  // The name cache_repr prints: transformers' MtpCache.
  static constexpr std::string_view class_name = "MtpCache";  // what cache_repr prints

  using base::base;
  // A cache with no layers yet, as DynamicCache().
  MtpCache() = default;

  // The base offset (the layer's length) plus layer_idx + 1.
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const {
    return base::get_query_offset(layer_idx) + (layer_idx + 1);
  }

  // The base (kv_length, kv_offset) with kv_offset moved by layer_idx + 1.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t query_length, std::int64_t layer_idx) const {
    const auto [kv_length, kv_offset] = base::get_mask_sizes(query_length, layer_idx);
    return {kv_length, kv_offset + layer_idx + 1};
  }
};

// transformers' DFlashCache(DynamicCache).
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class DFlashCache : public DynamicCache<T, Storage, Offload> {
  using base = DynamicCache<T, Storage, Offload>;

 public:
  // The name cache_repr prints: transformers' DFlashCache.
  static constexpr std::string_view class_name = "DFlashCache";  // what cache_repr prints

  using base::base;
  // A cache with no layers yet and no accepted tokens, as DynamicCache().
  DFlashCache() = default;

  // How many tokens the target model accepted in the previous round (0 at first). Negative
  // counts are a ValueError (transformers does not check). reset() keeps the value, as in
  // transformers.
  void set_previous_accepted_tokens(std::int64_t n) {
    if (n < 0)
      throw ValueError("set_previous_accepted_tokens: the number of accepted tokens must be 0 or more, got " +
                       std::to_string(n));
    accepted_ = n;
  }
  // The number of tokens accepted in the previous round, as last set (0 at first).
  std::int64_t previous_accepted_tokens() const noexcept { return accepted_; }

  // The base offset plus the accepted tokens.
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const {
    return base::get_query_offset(layer_idx) + accepted_;
  }

  // The base (kv_length, kv_offset) with kv_length lengthened by the accepted tokens.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t query_length, std::int64_t layer_idx) const {
    const auto [kv_length, kv_offset] = base::get_mask_sizes(query_length, layer_idx);
    return {kv_length + accepted_, kv_offset};
  }

 private:
  std::int64_t accepted_ = 0;
};

}  // namespace kvc

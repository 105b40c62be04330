#pragma once
// DynamicIndexedLayer's state: a DynamicLayer's state and indexer keys that grow with every
// update_indexer (transformers' DynamicIndexedLayer, src/transformers/cache_utils.py at a597f974;
// docs/indexed.md).

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/indexed_parts.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

template <class S>
class DynamicIndexedLayer::state
    : public detail::indexed_state<S, DynamicLayer::state<S>, detail::dynamic_indexer_keys<S>> {
  using base = detail::indexed_state<S, DynamicLayer::state<S>, detail::dynamic_indexer_keys<S>>;
  using base::attn_;
  using base::indexer_;

 public:
  using kind_type = DynamicIndexedLayer;
  using typename base::state_view;
  static constexpr bool is_sliding = false;
  static constexpr bool is_compileable = false;
  static constexpr bool supports_early_init = true;
  static constexpr bool supports_batch_ops = true;
  static constexpr std::string_view name = "DynamicIndexedLayer";

  explicit state(const DynamicIndexedLayer&) : base(DynamicLayer::state<S>(DynamicLayer{}), {}) {}

  std::int64_t indexer_seq_length() const noexcept { return indexer_.length(); }
  DynamicIndexedLayer kind() const noexcept { return {}; }

  // Appends x ([batch, q, index_head_dim]) and returns every indexer key the layer holds.
  state_view update_indexer(const state_view& x) {
    detail::check_indexer_input(attn_, this->indexer_keys(), x);
    indexer_.append(x);
    return indexer_.view();
  }

  void check_crop(std::int64_t tokens_to_remove) const { attn_.check_crop(tokens_to_remove); }
  // transformers' DynamicIndexedLayer.crop: the K/V part as a DynamicLayer, then the indexer keys
  // by the same rule on their own length (so crop(-n) with n >= length empties them).
  void crop(std::int64_t tokens_to_remove) {
    attn_.crop(tokens_to_remove);
    if (!indexer_.initialized() || indexer_.length() == 0) return;
    const std::int64_t len = indexer_.length();
    indexer_.truncate(len - detail::dynamic_crop_count(tokens_to_remove, len));
  }

  // Drops both parts: the next update and update_indexer start afresh (transformers #48809).
  void reset() {
    attn_.reset();
    indexer_ = detail::dynamic_indexer_keys<S>();
  }

  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out{DynamicIndexedLayer{}};
    this->gather_into(out, batch_indices);
    return out;
  }
};

}  // namespace kvc

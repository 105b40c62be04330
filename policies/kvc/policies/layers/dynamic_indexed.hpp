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

// DynamicIndexedLayer's layer over storage S (transformers' DynamicIndexedLayer): a DynamicLayer
// for K/V and the lightning indexer's keys [batch, seq, index_head_dim], which grow with every
// update_indexer.
template <class S>
class DynamicIndexedLayer::state
    : public detail::indexed_state<S, DynamicLayer::state<S>, detail::dynamic_indexer_keys<S>> {
  using base = detail::indexed_state<S, DynamicLayer::state<S>, detail::dynamic_indexer_keys<S>>;
  using base::attn_;
  using base::indexer_;

 public:
  // The layer kind this state belongs to.
  using kind_type = DynamicIndexedLayer;
  using typename base::state_view;
  // False: attention sees every token.
  static constexpr bool is_sliding = false;
  // False: the buffers move as they grow (transformers' is_compileable).
  static constexpr bool is_compileable = false;
  // True: lazy_initialization may give the K/V part its shape before the first update.
  static constexpr bool supports_early_init = true;
  // True: the Cache's batch_repeat_interleave and batch_select_indices apply to both parts.
  static constexpr bool supports_batch_ops = true;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "DynamicIndexedLayer";

  // An empty layer: no K/V and no indexer keys yet (the kind has no options).
  explicit state(const DynamicIndexedLayer&) : base(DynamicLayer::state<S>(DynamicLayer{}), {}) {}

  // Returns the number of indexer keys held per batch entry.
  std::int64_t indexer_seq_length() const noexcept { return indexer_.length(); }
  // Returns the layer's kind (it has no options).
  DynamicIndexedLayer kind() const noexcept { return {}; }

  // Appends x ([batch, q, index_head_dim]) and returns every indexer key the layer holds.
  state_view update_indexer(const state_view& x) {
    detail::check_indexer_input(attn_, this->indexer_keys(), x);
    indexer_.append(x);
    return indexer_.view();
  }

  // Checks that crop(tokens_to_remove) can run, as the K/V part's DynamicLayer does (a positive
  // count gives the deprecation warning here).
  void check_crop(std::int64_t tokens_to_remove) const { attn_.check_crop(tokens_to_remove); }
  // Returns kvc::unbounded_rollback: both parts keep every token (docs/rollback.md).
  std::int64_t rollback_depth() const noexcept { return unbounded_rollback; }
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

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer, in both parts (the
  // Cache checks the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out{DynamicIndexedLayer{}};
    this->gather_into(out, batch_indices);
    return out;
  }
};

}  // namespace kvc

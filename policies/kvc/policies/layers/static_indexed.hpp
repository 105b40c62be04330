#pragma once
// StaticIndexedLayer's state: a StaticLayer's state and an indexer buffer of max_cache_len slots
// with its own counter (transformers' StaticIndexedLayer, src/transformers/cache_utils.py at
// a597f974; docs/indexed.md).

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/indexed_parts.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/static.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

// StaticIndexedLayer's layer over storage S (transformers' StaticIndexedLayer): a StaticLayer for
// K/V and an indexer buffer [batch, max_cache_len, index_head_dim] written at its own counter.
template <class S>
class StaticIndexedLayer::state
    : public detail::indexed_state<S, StaticLayer::state<S>, detail::static_indexer_keys<S>> {
  using base = detail::indexed_state<S, StaticLayer::state<S>, detail::static_indexer_keys<S>>;
  using base::attn_;
  using base::indexer_;

 public:
  // The layer kind this state belongs to.
  using kind_type = StaticIndexedLayer;
  using typename base::state_view;
  // False: attention sees every token.
  static constexpr bool is_sliding = false;
  // True: the buffers are allocated once and never move (transformers' is_compileable).
  static constexpr bool is_compileable = true;
  // True: lazy_initialization may give the K/V part its shape before the first update.
  static constexpr bool supports_early_init = true;
  // False: the Cache's batch_repeat_interleave and batch_select_indices do not apply to the layer.
  static constexpr bool supports_batch_ops = false;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "StaticIndexedLayer";

  // An empty layer of max_cache_len slots, allocated later. Throws kvc::ValueError unless
  // 1 <= max_cache_len <= kvc::max_extent.
  explicit state(const StaticIndexedLayer& kind)
      : base(StaticLayer::state<S>(checked(kind)), detail::static_indexer_keys<S>(kind.max_cache_len)) {}

  // Returns the number of slots of the K/V buffers and of the indexer buffer.
  std::int64_t max_cache_len() const noexcept { return attn_.max_cache_len(); }
  // Returns the layer's kind, with its max_cache_len.
  StaticIndexedLayer kind() const noexcept { return {attn_.max_cache_len()}; }

  // Sets where the next update *and* the next update_indexer write: both count the same tokens
  // (transformers' export wrapper moves only the K/V counter; docs/indexed.md).
  void set_write_position(std::int64_t position) {
    attn_.set_write_position(position);  // checks the range; nothing changes if it throws
    indexer_.set_position(position);
  }

  // The whole static buffer is indexer_keys(); this is the indexer counter: where the next
  // update_indexer writes.
  std::int64_t indexer_seq_length() const noexcept { return indexer_.position(); }

  // Writes x ([batch, q, index_head_dim]) at the indexer counter and returns the whole buffer.
  // Past max_cache_len: IndexError, and nothing changes (transformers advances its counter first).
  state_view update_indexer(const state_view& x) {
    detail::check_indexer_input(attn_, this->indexer_keys(), x);
    const std::int64_t q = x.extent(1), cap = attn_.max_cache_len(), pos = indexer_.position();
    if (pos + q > cap)
      throw IndexError(detail::join_message(
          {"index ", std::to_string(cap), " is out of bounds for dimension 1 with size ", std::to_string(cap),
           ": StaticIndexedLayer with max_cache_len ", std::to_string(cap), " holds ", std::to_string(pos),
           " indexer keys and cannot take ", std::to_string(q), " more"}));
    indexer_.write(x);
    return indexer_.view();
  }

  // Zeroes both parts in place and rewinds both counters; keeps the allocations.
  void reset() {
    attn_.reset();
    indexer_.reset();
  }

  // For reorder_cache (beam search keeps the batch size); there is no crop or batch operation.
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out{StaticIndexedLayer{attn_.max_cache_len()}};
    this->gather_into(out, batch_indices);
    return out;
  }

 private:
  static StaticLayer checked(const StaticIndexedLayer& kind) {
    detail::check_positive(kind.max_cache_len, "max_cache_len", "StaticIndexedLayer");
    return StaticLayer{kind.max_cache_len};
  }
};

}  // namespace kvc

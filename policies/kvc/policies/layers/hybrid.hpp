#pragma once
// The hybrids of a linear-attention part and an attention part (LinearAttentionHybrid<Attention>,
// the four LinearAttentionAnd...Layer kinds), by composition: every operation acts on both parts.
// Semantics: transformers' LinearAttentionAnd...Layer hybrids (src/transformers/cache_utils.py at
// a597f974); what kvc does differently: docs/differences.md.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/attention_part.hpp>
#include <kvc/policies/layers/crop_plan.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/dynamic_sliding.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/linear.hpp>
#include <kvc/policies/layers/static.hpp>
#include <kvc/policies/layers/static_sliding.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {
template <class Attention>
inline constexpr std::string_view hybrid_name = "LinearAttentionHybridLayer";
template <>
inline constexpr std::string_view hybrid_name<DynamicLayer> = "LinearAttentionAndFullAttentionLayer";
template <>
inline constexpr std::string_view hybrid_name<DynamicSlidingWindowLayer> =
    "LinearAttentionAndSlidingWindowAttentionLayer";
template <>
inline constexpr std::string_view hybrid_name<StaticLayer> = "LinearAttentionAndStaticFullAttentionLayer";
template <>
inline constexpr std::string_view hybrid_name<StaticSlidingWindowLayer> =
    "LinearAttentionAndStaticSlidingWindowAttentionLayer";
}  // namespace detail

// The layer of `LinearAttentionHybrid<Attention>` over storage S (transformers'
// LinearAttentionAnd...Layer hybrids): a LinearAttentionLayer part and an Attention part, kept
// at one batch size; the length queries come from the attention part.
template <class Attention>
template <class S>
class LinearAttentionHybrid<Attention>::state
    : public detail::with_attention_part<typename Attention::template state<S>> {
  using linear_state = LinearAttentionLayer::state<S>;
  using attention_state = typename Attention::template state<S>;
  using base = detail::with_attention_part<attention_state>;
  using base::attn_;

 public:
  // The layer kind this state belongs to.
  using kind_type = LinearAttentionHybrid<Attention>;
  // The view type of K/V, as `update` takes and returns them (S::view_type).
  using view = typename S::view_type;
  // The view type of the linear states (S::state_view_type).
  using state_view = typename S::state_view_type;
  // The attention part's is_sliding.
  static constexpr bool is_sliding = attention_state::is_sliding;
  // The attention part's is_compileable.
  static constexpr bool is_compileable = attention_state::is_compileable;
  static constexpr bool supports_early_init = false;  // as transformers: the first update sets the shapes
  // Whether the attention part supports the Cache's batch operations (both parts then take them).
  static constexpr bool supports_batch_ops = concepts::supports_batch_ops<attention_state>;
  // transformers' class name for the four hybrids (LinearAttentionAndFullAttentionLayer, ...),
  // LinearAttentionHybridLayer for another attention kind.
  static constexpr std::string_view name = detail::hybrid_name<Attention>;

  // Both parts empty. Throws kvc::ValueError when the attention options, number_of_states or
  // rollback_states are out of range (as the parts check them).
  explicit state(const LinearAttentionHybrid& kind)
      : base(attention_state(kind.attention)),
        linear_(LinearAttentionLayer{kind.number_of_states, kind.rollback_states}) {}

  // Returns the linear-attention part.
  const linear_state& linear_part() const noexcept { return linear_; }

  // Attention part (the length queries come from detail::with_attention_part). Both parts keep
  // one batch size: a batch operation gathers them with the same indices.
  KV<view> update(const view& k, const view& v) {
    const std::int64_t held = linear_.batch();
    if (held >= 0 && k.extent(0) != held)
      throw ValueError(detail::join_message(
          {"update: keys of shape ", shape_string(k.extents),
           " do not match the layer's linear-attention states, which have batch size ", std::to_string(held)}));
    return attn_.update(k, v);
  }
  // Gives the attention part its shape. Throws kvc::ValueError when shape.batch differs from the
  // linear states' batch size.
  void lazy_initialization(LayerShape shape) {
    const std::int64_t held = linear_.batch();
    if (held >= 0 && shape.batch != held)
      throw ValueError(detail::join_message(
          {"lazy_initialization: batch size ", std::to_string(shape.batch),
           " does not match the layer's linear-attention states, which have batch size ", std::to_string(held)}));
    attn_.lazy_initialization(shape);
  }
  // Sets where the attention part's next update writes (an attention part that has
  // set_write_position, StaticLayer); throws kvc::IndexError as it does.
  void set_write_position(std::int64_t p)
    requires concepts::supports_write_position<attention_state>
  {
    attn_.set_write_position(p);
  }

  // Linear part.
  // update_conv_state of the linear part, after checking x's batch against the attention part's
  // keys (kvc::ValueError when they differ).
  state_view update_conv_state(const state_view& x, std::int64_t state_idx, std::int64_t conv_kernel_size) {
    check_state_batch(x, "update_conv_state");
    return linear_.update_conv_state(x, state_idx, conv_kernel_size);
  }
  // update_recurrent_state of the linear part, after checking x's batch against the attention
  // part's keys (kvc::ValueError when they differ).
  state_view update_recurrent_state(const state_view& x, std::int64_t state_idx) {
    check_state_batch(x, "update_recurrent_state");
    return linear_.update_recurrent_state(x, state_idx);
  }
  // The linear part's has_previous_state(state_idx) (kvc::KeyError for an index out of range).
  bool has_previous_state(std::int64_t state_idx) const { return linear_.has_previous_state(state_idx); }
  // Returns the linear part's number of state slots.
  std::int64_t number_of_states() const noexcept { return linear_.number_of_states(); }
  // Returns the batch size of the attention part, else of the linear states; -1 when neither
  // holds anything.
  std::int64_t batch() const noexcept { return attn_.is_initialized() ? attn_.shape().batch : linear_.batch(); }

  // Both parts.
  // Returns the bytes both parts hold.
  std::int64_t bytes() const noexcept { return attn_.bytes() + linear_.bytes(); }
  // Resets both parts, each as its own kind resets.
  void reset() {
    linear_.reset();
    attn_.reset();
  }
  // Turns past recording on in the linear part, and in the attention part when it has it, so
  // that `crop` can roll both back.
  void activate_past_recording() noexcept {
    linear_.activate_past_recording();
    if constexpr (concepts::supports_past_recording<attention_state>) attn_.activate_past_recording();
  }
  // The smaller of the two parts' rollback depths (docs/rollback.md).
  std::int64_t rollback_depth() const noexcept
    requires concepts::supports_crop<attention_state>
  {
    return std::min(linear_.rollback_depth(), attn_.rollback_depth());
  }
  // Checks that crop(n) can run in both parts, changing nothing; throws kvc::RuntimeError as their
  // check_crop does.
  void check_crop(std::int64_t n) const
    requires concepts::supports_crop<attention_state>
  {
    linear_.check_crop(n);
    attn_.check_crop(n);
  }
  // Crops both parts by n (see prepare_crop); when it throws, neither part has changed.
  void crop(std::int64_t n)
    requires concepts::supports_crop<attention_state>
  {
    commit_crop(prepare_crop(n));
  }
  // crop in two steps (see LinearAttentionLayer): the linear part's new states are prepared aside,
  // and so is the attention part's crop when it allocates (a quantized attention part); the crop of
  // a dynamic attention part cannot throw once checked.
  static constexpr bool staged_attention = detail::staged_crop<attention_state>;
  // What prepare_crop builds and commit_crop applies.
  struct crop_plan {
    // The linear part's cropped states.
    typename linear_state::crop_plan linear;
    // The crop count, for an attention part whose crop cannot fail once checked.
    std::int64_t tokens_to_remove = 0;
    // The attention part's own plan when its crop allocates (std::monostate otherwise).
    typename detail::crop_plan<attention_state>::type attention{};
  };
  // Checks crop(n) (as check_crop) and builds both parts' new states aside; changes nothing.
  crop_plan prepare_crop(std::int64_t n) const
    requires concepts::supports_crop<attention_state>
  {
    check_crop(n);
    crop_plan plan{linear_.prepare_crop(n), n};
    if constexpr (staged_attention) plan.attention = attn_.prepare_crop(n);
    return plan;
  }
  // Applies a plan from prepare_crop to both parts. Cannot throw.
  void commit_crop(crop_plan&& plan) noexcept
    requires concepts::supports_crop<attention_state>
  {
    if constexpr (staged_attention)
      attn_.commit_crop(std::move(plan.attention));
    else
      attn_.crop(plan.tokens_to_remove);
    linear_.commit_crop(std::move(plan.linear));
  }
  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer, in both parts (the
  // Cache checks the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out = *this;
    out.linear_ = linear_.gathered(batch_indices);
    if (attn_.is_initialized()) out.attn_ = attn_.gathered(batch_indices);
    return out;
  }
  // Calls f(buffer&) on the attention part's buffers, then the linear part's, for offload engines
  // (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    attn_.for_each_buffer(f);
    linear_.for_each_buffer(f);
  }

  // Saved state (docs/state.md): both parts.
  LinearAttentionHybrid kind() const noexcept {
    return {attn_.kind(), linear_.number_of_states(), linear_.rollback_states()};
  }
  // Writes both parts into a saved state, or reads them back (kvc::save, kvc::load); loading
  // throws kvc::StateError when a part does not fit this layer or the parts' batch sizes differ.
  template <class A>
  void transfer(A& ar) {
    attn_.transfer(ar);
    linear_.transfer(ar);
    ar.check(!attn_.is_initialized() || linear_.batch() < 0 || linear_.batch() == attn_.shape().batch,
             "the two parts' batch sizes differ");
  }

 private:
  // A linear state whose batch differs from the attention part's keys (the shape checks of the
  // linear part itself come after this one).
  void check_state_batch(const state_view& x, std::string_view method) const {
    if (x.rank >= 1 && attn_.is_initialized() && x.extent(0) != attn_.shape().batch)
      throw ValueError(detail::join_message({method, ": states of shape ", shape_string(x),
                                             " do not match the layer's keys of shape ",
                                             shape_string(attn_.stored().keys.extents), ": the batch sizes differ"}));
  }

  linear_state linear_;
};

}  // namespace kvc

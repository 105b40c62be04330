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

template <class Attention>
template <class S>
class LinearAttentionHybrid<Attention>::state
    : public detail::with_attention_part<typename Attention::template state<S>> {
  using linear_state = LinearAttentionLayer::state<S>;
  using attention_state = typename Attention::template state<S>;
  using base = detail::with_attention_part<attention_state>;
  using base::attn_;

 public:
  using kind_type = LinearAttentionHybrid<Attention>;
  using view = typename S::view_type;
  using state_view = typename S::state_view_type;
  static constexpr bool is_sliding = attention_state::is_sliding;
  static constexpr bool is_compileable = attention_state::is_compileable;
  static constexpr bool supports_early_init = false;  // as transformers: the first update sets the shapes
  static constexpr bool supports_batch_ops = concepts::supports_batch_ops<attention_state>;
  static constexpr std::string_view name = detail::hybrid_name<Attention>;

  explicit state(const LinearAttentionHybrid& kind)
      : base(attention_state(kind.attention)), linear_(LinearAttentionLayer{kind.number_of_states}) {}

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
  void lazy_initialization(LayerShape shape) {
    const std::int64_t held = linear_.batch();
    if (held >= 0 && shape.batch != held)
      throw ValueError(detail::join_message(
          {"lazy_initialization: batch size ", std::to_string(shape.batch),
           " does not match the layer's linear-attention states, which have batch size ", std::to_string(held)}));
    attn_.lazy_initialization(shape);
  }
  void set_write_position(std::int64_t p)
    requires concepts::supports_write_position<attention_state>
  {
    attn_.set_write_position(p);
  }

  // Linear part.
  state_view update_conv_state(const state_view& x, std::int64_t state_idx, std::int64_t conv_kernel_size) {
    check_state_batch(x, "update_conv_state");
    return linear_.update_conv_state(x, state_idx, conv_kernel_size);
  }
  state_view update_recurrent_state(const state_view& x, std::int64_t state_idx) {
    check_state_batch(x, "update_recurrent_state");
    return linear_.update_recurrent_state(x, state_idx);
  }
  bool has_previous_state(std::int64_t state_idx) const { return linear_.has_previous_state(state_idx); }
  std::int64_t number_of_states() const noexcept { return linear_.number_of_states(); }
  std::int64_t batch() const noexcept { return attn_.is_initialized() ? attn_.shape().batch : linear_.batch(); }

  // Both parts.
  std::int64_t bytes() const noexcept { return attn_.bytes() + linear_.bytes(); }
  void reset() {
    linear_.reset();
    attn_.reset();
  }
  void activate_past_recording() noexcept {
    linear_.activate_past_recording();
    if constexpr (concepts::supports_past_recording<attention_state>) attn_.activate_past_recording();
  }
  void check_crop(std::int64_t n) const
    requires concepts::supports_crop<attention_state>
  {
    linear_.check_crop(n);
    attn_.check_crop(n);
  }
  void crop(std::int64_t n)
    requires concepts::supports_crop<attention_state>
  {
    commit_crop(prepare_crop(n));
  }
  // crop in two steps (see LinearAttentionLayer): the linear part's new states are prepared aside,
  // and so is the attention part's crop when it allocates (a quantized attention part); the crop of
  // a dynamic attention part cannot throw once checked.
  static constexpr bool staged_attention = detail::staged_crop<attention_state>;
  struct crop_plan {
    typename linear_state::crop_plan linear;
    std::int64_t tokens_to_remove = 0;
    typename detail::crop_plan<attention_state>::type attention{};
  };
  crop_plan prepare_crop(std::int64_t n) const
    requires concepts::supports_crop<attention_state>
  {
    check_crop(n);
    crop_plan plan{linear_.prepare_crop(n), n};
    if constexpr (staged_attention) plan.attention = attn_.prepare_crop(n);
    return plan;
  }
  void commit_crop(crop_plan&& plan) noexcept
    requires concepts::supports_crop<attention_state>
  {
    if constexpr (staged_attention)
      attn_.commit_crop(std::move(plan.attention));
    else
      attn_.crop(plan.tokens_to_remove);
    linear_.commit_crop(std::move(plan.linear));
  }
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out = *this;
    out.linear_ = linear_.gathered(batch_indices);
    if (attn_.is_initialized()) out.attn_ = attn_.gathered(batch_indices);
    return out;
  }
  template <class F>
  void for_each_buffer(F&& f) {
    attn_.for_each_buffer(f);
    linear_.for_each_buffer(f);
  }

  // Saved state (docs/state.md): both parts.
  LinearAttentionHybrid kind() const noexcept { return {attn_.kind(), linear_.number_of_states()}; }
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

#pragma once
// kvc::concepts::LinearCacheLayer<K, S>: a layer kind whose state holds linear-attention states
// (conv and recurrent states, no sequence axis) instead of K/V. Such a layer has no `update`;
// the Cache reaches it through `update_conv_state` / `update_recurrent_state`.
// Required of St = K::state<S>, with sv = S::state_view_type and i, n of type int64_t:
//   St::is_sliding, St::is_compileable, St::supports_early_init, St::name   (as CacheLayer)
//   st.update_conv_state(sv, i, n) -> sv      (n: the conv kernel size, 0 = the input's time axis)
//   st.update_recurrent_state(sv, i) -> sv
//   st.has_previous_state(i) -> bool          (i == -1: all states)
//   st.reset()   st.bytes()   st.is_initialized()   st.batch()   st.gathered(span) -> St
//   st.for_each_buffer(f)                     (as CacheLayer: the walk offload engines use)
// Hybrid layers (a linear part and an attention part) model both this and CacheLayer.

#include <concepts>
#include <cstdint>
#include <span>

#include <kvc/concepts/cache_layer.hpp>
#include <kvc/concepts/storage_policy.hpp>

namespace kvc::concepts {

// St has the linear-attention members listed at the top of this header.
template <class St, class S>
concept has_linear_states =
    requires(St& st, const St& cst, typename S::state_view_type sv, std::int64_t i, std::span<const std::int64_t> idx) {
      { st.update_conv_state(sv, i, i) } -> std::same_as<typename S::state_view_type>;
      { st.update_recurrent_state(sv, i) } -> std::same_as<typename S::state_view_type>;
      { cst.has_previous_state(i) } -> std::convertible_to<bool>;
      { cst.number_of_states() } -> std::convertible_to<std::int64_t>;
      { cst.batch() } -> std::convertible_to<std::int64_t>;
      { cst.is_initialized() } -> std::convertible_to<bool>;
      { cst.gathered(idx) } -> std::same_as<St>;
      { cst.bytes() } -> std::convertible_to<std::int64_t>;
      st.reset();
    };

// S names a view type for linear states, `S::state_view_type`.
template <class S>
concept has_state_views = requires { typename S::state_view_type; };

// K's state for S holds linear-attention states: the traits, the linear members and the
// buffer walk, over a storage policy with state views.
template <class K, class S>
concept LinearCacheLayer =
    StoragePolicy<S> && has_state_views<S> && has_layer_state<K, S> &&
    has_layer_traits<typename K::template state<S>> && has_linear_states<typename K::template state<S>, S> &&
    has_buffer_walk<typename K::template state<S>>;

// A layer the Cache can hold: a K/V layer, a linear-attention layer, or a hybrid of both.
template <class K, class S>
concept AnyCacheLayer = CacheLayer<K, S> || LinearCacheLayer<K, S>;

}  // namespace kvc::concepts

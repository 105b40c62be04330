#pragma once
// kvc::concepts::CacheLayer<K, S>: a layer kind K whose state for storage S can serve a Cache.
//
// A layer kind is a configuration-only struct (for example `StaticLayer{.max_cache_len = 64}`).
// Required (docs/concepts/cache_layer.md):
//   typename K::template state<S>        the runtime layer, constructible from `const K&`
// and of that state St, with v = S::view_type and n, q of type int64_t:
//   St::is_sliding, St::is_compileable, St::supports_early_init     static constexpr bool
//   St::name                                                         convertible to string_view
//   st.update(v, v) -> KV<v>             append/write q new tokens, return what attention reads
//   st.get_seq_length() -> int64_t       st.get_max_length() -> int64_t
//   st.get_mask_sizes(q) -> std::pair<int64_t, int64_t>   (kv_length, kv_offset), before update
//   st.is_initialized() -> bool          st.shape() -> LayerShape
//   st.lazy_initialization(LayerShape)   st.reset()
//   st.stored() -> KV<v>                 what the layer holds (transformers' layer.keys/values)
//   st.gathered(std::span<const int64_t>) -> St   a copy with the batch rows picked by index
//   st.bytes() -> int64_t                bytes of K/V memory held
//   st.for_each_buffer(f)                f(buffer&) on each buffer the state owns, in a fixed
//                                        order: how offload engines move the layer between tiers
//                                        (a state with nothing to move walks nothing, on purpose)
// Optional capabilities, detected by the Cache: crop/check_crop, activate_past_recording,
// set_write_position, and `supports_batch_ops` (batch_repeat_interleave/batch_select_indices).

#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>

#include <kvc/concepts/storage_policy.hpp>
#include <kvc/tensor_view.hpp>

namespace kvc::concepts {

// K names a state for storage S, `K::template state<S>`, constructible from `const K&`.
template <class K, class S>
concept has_layer_state =
    requires { typename K::template state<S>; } && std::constructible_from<typename K::template state<S>, const K&>;

// St has the static traits is_sliding, is_compileable and supports_early_init (bool) and name
// (a string_view).
template <class St>
concept has_layer_traits = requires {
  { St::is_sliding } -> std::convertible_to<bool>;
  { St::is_compileable } -> std::convertible_to<bool>;
  { St::supports_early_init } -> std::convertible_to<bool>;
  { St::name } -> std::convertible_to<std::string_view>;
};

// St has update(k, v), taking and returning views of S (`KV<S::view_type>`).
template <class St, class S>
concept has_update = requires(St& st, typename S::view_type v) {
  { st.update(v, v) } -> std::same_as<KV<typename S::view_type>>;
};

// St answers get_seq_length(), get_max_length() and get_mask_sizes(q), a pair of int64_t.
template <class St>
concept has_length_queries = requires(const St& st, std::int64_t q) {
  { st.get_seq_length() } -> std::convertible_to<std::int64_t>;
  { st.get_max_length() } -> std::convertible_to<std::int64_t>;
  { st.get_mask_sizes(q) } -> std::same_as<std::pair<std::int64_t, std::int64_t>>;
};

// St has is_initialized(), shape(), lazy_initialization(shape), reset(), stored(),
// gathered(indices) and bytes(), with the types listed at the top of this header.
template <class St, class S>
concept has_lifecycle = requires(St& st, const St& cst, LayerShape shape, std::span<const std::int64_t> idx) {
  { cst.is_initialized() } -> std::convertible_to<bool>;
  { cst.shape() } -> std::same_as<LayerShape>;
  st.lazy_initialization(shape);
  st.reset();
  { cst.stored() } -> std::same_as<KV<typename S::view_type>>;
  { cst.gathered(idx) } -> std::same_as<St>;
  { cst.bytes() } -> std::convertible_to<std::int64_t>;
};

// What for_each_buffer is called with when the concept is checked: any buffer type is accepted
// (the walk's body is not instantiated by the check).
struct buffer_visitor {
  // Takes any buffer and does nothing.
  template <class Buffer>
  void operator()(Buffer&) const noexcept {}
};

// The buffer walk offload engines move a layer's bytes through. Required, so that a kind without
// it is a compile error rather than a layer that an offloading cache silently never offloads.
template <class St>
concept has_buffer_walk = requires(St& st, buffer_visitor f) { st.for_each_buffer(f); };

// `StoragePolicy<S>` comes first: the conjunction stops there, before naming `K::state<S>` for an S
// that has no view_type (which would be a hard error, not a false).
template <class K, class S>
concept CacheLayer =
    StoragePolicy<S> && has_layer_state<K, S> && has_layer_traits<typename K::template state<S>> &&
    has_update<typename K::template state<S>, S> && has_length_queries<typename K::template state<S>> &&
    has_lifecycle<typename K::template state<S>, S> && has_buffer_walk<typename K::template state<S>>;

// Optional capabilities.
// supports_crop: St has check_crop(n) (const) and crop(n), so Cache::crop applies to it.
template <class St>
concept supports_crop = requires(St& st, const St& cst, std::int64_t n) {
  cst.check_crop(n);
  st.crop(n);
};
// St has activate_past_recording(), which the Cache calls to allow a later crop.
template <class St>
concept supports_past_recording = requires(St& st) { st.activate_past_recording(); };
// St has set_write_position(p), which moves where its next update writes.
template <class St>
concept supports_write_position = requires(St& st, std::int64_t p) { st.set_write_position(p); };
// St::supports_batch_ops is true: the Cache's batch_repeat_interleave and batch_select_indices
// apply to it.
template <class St>
concept supports_batch_ops = requires { requires static_cast<bool>(St::supports_batch_ops); };

}  // namespace kvc::concepts

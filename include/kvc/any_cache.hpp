#pragma once
// kvc::AnyCache: a type-erased handle over any host kvc::Cache<...> instantiation (DynamicCache,
// StaticCache, make_dynamic_cache's cache, ...), with the Cache method set, for code that picks
// its cache at run time (from a cache_implementation string, a JSON description). What a typed
// Cache checks at compile time, AnyCache checks at run time:
//  - an update whose element type is not the cache's is a kvc::TypeError;
//  - an operation no layer kind of the held cache has (crop on a StaticCache) is a
//    kvc::AttributeError naming the layer, as in Python.
// One virtual call per method; the held cache does the work.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/element_types.hpp>
#include <kvc/cache_traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// A host cache: what AnyCache can hold (a kvc::Cache<...> instantiation, or a cache with its
// method set such as kvc::PagedBatchCache).
template <class C>
concept host_cache =
    requires {
      typename C::storage_policy;
      typename C::kv_type;
    } && std::is_same_v<typename C::view_type, TensorView<typename C::element_type>> &&
    std::is_same_v<typename C::kv_type, KV<TensorView<typename C::element_type>>>;

enum class state_update { conv, recurrent, indexer };

// The virtual interface, one `update`/`stored` per element type.
template <class T>
struct typed_ops {
  virtual ~typed_ops() = default;
  virtual KV<TensorView<T>> update(const TensorView<T>& k, const TensorView<T>& v, std::int64_t layer_idx) = 0;
  virtual KV<TensorView<T>> stored(std::int64_t layer_idx, std::type_identity<T>) const = 0;
  // update_conv_state, update_recurrent_state or update_indexer, by `which`.
  virtual StateView<T> update_state(state_update which, const StateView<T>& x, std::int64_t layer_idx,
                                    std::int64_t state_idx, std::int64_t conv_kernel_size) = 0;
};

// One typed_ops per element type of the table (<kvc/element_types.hpp>), their overloads side by side.
template <class List>
struct typed_iface;
template <class... Ts>
struct typed_iface<boost::mp11::mp_list<Ts...>> : typed_ops<Ts>... {
  using typed_ops<Ts>::update...;
  using typed_ops<Ts>::stored...;
  using typed_ops<Ts>::update_state...;
};

struct any_cache_iface : typed_iface<host_element_types> {
  virtual bool has_previous_state(std::optional<std::int64_t>, std::optional<std::int64_t>) const = 0;
  virtual std::vector<bool> is_linear() const = 0;
  virtual bool is_dynamic_cache() const noexcept = 0;
  virtual std::string repr() const = 0;
  virtual std::string_view element_type_name() const noexcept = 0;
  virtual std::int64_t get_seq_length(std::int64_t) const = 0;
  virtual std::int64_t get_query_offset(std::int64_t) const = 0;
  virtual std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t, std::int64_t) const = 0;
  virtual std::int64_t get_max_length() const = 0;
  virtual std::int64_t get_max_length(std::int64_t) const = 0;
  virtual void crop(std::int64_t) = 0;
  virtual std::int64_t rollback_depth() const = 0;
  virtual void reorder_cache(std::span<const std::int64_t>) = 0;
  virtual void batch_repeat_interleave(std::int64_t) = 0;
  virtual void batch_select_indices(std::span<const std::int64_t>) = 0;
  virtual void reset() = 0;
  virtual void make_resident(std::int64_t) = 0;
  virtual void reserve(std::int64_t) = 0;
  virtual void activate_past_recording() noexcept = 0;
  virtual void set_write_position(std::int64_t) = 0;
  virtual void early_initialization(std::int64_t, const int_or_list&, const int_or_list&) = 0;
  virtual std::vector<bool> is_sliding() const = 0;
  virtual bool is_sliding(std::int64_t) const = 0;
  virtual bool is_compileable() const noexcept = 0;
  virtual bool is_initialized() const noexcept = 0;
  virtual std::int64_t batch_size() const = 0;
  virtual std::int64_t size() const noexcept = 0;
  virtual std::string_view layer_name(std::int64_t) const = 0;
  virtual std::int64_t bytes() const noexcept = 0;
  virtual const void* address() const noexcept = 0;
  virtual const std::type_info& type() const noexcept = 0;
};

template <class C>
class any_cache_model final : public any_cache_iface {
  using E = typename C::element_type;

 public:
  explicit any_cache_model(C cache) : cache_(std::move(cache)) {}

  // The typed overrides, one set per element type of the table.
#define KVC_DETAIL_TYPED_OVERRIDES(T, NAME, TORCH)                                                                 \
  KV<TensorView<T>> update(const TensorView<T>& k, const TensorView<T>& v, std::int64_t i) override {              \
    return update_as(k, v, i);                                                                                     \
  }                                                                                                                \
  KV<TensorView<T>> stored(std::int64_t i, std::type_identity<T>) const override { return stored_as<T>(i); }       \
  StateView<T> update_state(state_update w, const StateView<T>& x, std::int64_t l, std::int64_t s, std::int64_t k) \
      override {                                                                                                   \
    return update_state_as(w, x, l, s, k);                                                                         \
  }
  KVC_ELEMENT_TYPES(KVC_DETAIL_TYPED_OVERRIDES)
#undef KVC_DETAIL_TYPED_OVERRIDES

  bool has_previous_state(std::optional<std::int64_t> l, std::optional<std::int64_t> s) const override {
    return cache_.has_previous_state(l, s);
  }
  std::vector<bool> is_linear() const override { return cache_.is_linear(); }
  bool is_dynamic_cache() const noexcept override { return detail::is_dynamic_cache_v<C>; }
  std::string repr() const override {
    if constexpr (requires { cache_.repr(); })
      return cache_.repr();  // a cache that is not a kvc::Cache says what it is
    else
      return cache_repr(cache_);
  }

  std::string_view element_type_name() const noexcept override { return element_name<E>(); }
  std::int64_t get_seq_length(std::int64_t i) const override { return cache_.get_seq_length(i); }
  // The held type's own (MtpCache and DFlashCache shift it).
  std::int64_t get_query_offset(std::int64_t i) const override { return cache_.get_query_offset(i); }
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q, std::int64_t i) const override {
    return cache_.get_mask_sizes(q, i);
  }
  std::int64_t get_max_length() const override { return cache_.get_max_length(); }
  std::int64_t get_max_length(std::int64_t i) const override { return cache_.get_max_length(i); }
  void crop(std::int64_t n) override {
    if constexpr (C::can_crop)
      cache_.crop(n);
    else
      missing("crop");
  }
  std::int64_t rollback_depth() const override {
    if constexpr (requires { cache_.rollback_depth(); })
      return cache_.rollback_depth();
    else
      return 0;
  }
  void reorder_cache(std::span<const std::int64_t> idx) override { cache_.reorder_cache(idx); }
  void batch_repeat_interleave(std::int64_t r) override {
    if constexpr (C::can_batch_ops)
      cache_.batch_repeat_interleave(r);
    else
      missing("batch_repeat_interleave");
  }
  void batch_select_indices(std::span<const std::int64_t> idx) override {
    if constexpr (C::can_batch_ops)
      cache_.batch_select_indices(idx);
    else
      missing("batch_select_indices");
  }
  void reset() override { cache_.reset(); }
  void make_resident(std::int64_t i) override { cache_.make_resident(i); }
  void reserve(std::int64_t tokens) override {
    if constexpr (requires { cache_.reserve(tokens); }) cache_.reserve(tokens);  // else nothing grows
  }
  void activate_past_recording() noexcept override { cache_.activate_past_recording(); }
  void set_write_position(std::int64_t p) override {
    if constexpr (C::can_set_write_position)
      cache_.set_write_position(p);
    else
      missing("set_write_position");
  }
  void early_initialization(std::int64_t b, const int_or_list& h, const int_or_list& d) override {
    cache_.early_initialization(b, h, d);
  }
  std::vector<bool> is_sliding() const override { return cache_.is_sliding(); }
  bool is_sliding(std::int64_t i) const override { return cache_.is_sliding(i); }
  bool is_compileable() const noexcept override { return cache_.is_compileable(); }
  bool is_initialized() const noexcept override { return cache_.is_initialized(); }
  std::int64_t batch_size() const override { return cache_.batch_size(); }
  std::int64_t size() const noexcept override { return cache_.size(); }
  std::string_view layer_name(std::int64_t i) const override { return cache_.layer_name(i); }
  std::int64_t bytes() const noexcept override { return cache_.bytes(); }
  const void* address() const noexcept override { return &cache_; }
  const std::type_info& type() const noexcept override { return typeid(C); }

 private:
  template <class T>
  KV<TensorView<T>> update_as(const TensorView<T>& k, const TensorView<T>& v, std::int64_t i) {
    if constexpr (std::is_same_v<T, E>)
      return cache_.update(k, v, i);
    else
      throw TypeError("AnyCache::update: the cache holds " + std::string(element_name<E>()) + " elements, got " +
                      std::string(element_name<T>()));
  }
  template <class T>
  StateView<T> update_state_as(state_update which, const StateView<T>& x, std::int64_t layer, std::int64_t state,
                               std::int64_t kernel) {
    if constexpr (std::is_same_v<T, E> && std::is_same_v<typename C::storage_policy::state_view_type, StateView<T>>) {
      switch (which) {
        case state_update::conv:
          return cache_.update_conv_state(x, layer, state, kernel);
        case state_update::recurrent:
          return cache_.update_recurrent_state(x, layer, state);
        default:
          return cache_.update_indexer(x, layer);
      }
    } else {
      throw TypeError("AnyCache: the cache holds " + std::string(element_name<E>()) + " elements, got " +
                      std::string(element_name<T>()));
    }
  }
  template <class T>
  KV<TensorView<T>> stored_as(std::int64_t i) const {
    if constexpr (std::is_same_v<T, E>)
      return cache_.stored(i);
    else
      throw TypeError("AnyCache::stored: the cache holds " + std::string(element_name<E>()) + " elements, not " +
                      std::string(element_name<T>()));
  }
  // The typed Cache would not compile this call; at run time it is Python's AttributeError on the
  // first layer (a cache with no layers has nothing to do).
  void missing(const char* method) const {
    if (cache_.size() > 0)
      throw AttributeError("'" + std::string(cache_.layer_name(0)) + "' object has no attribute '" + method + "'");
  }

  C cache_;
};

}  // namespace detail

// A move-only, type-erased handle over one host cache (a kvc::Cache<...> or a cache with its
// method set), chosen at run time. Methods forward to the held cache and throw what it throws;
// on an empty handle most of them throw kvc::ValueError.
class AnyCache {
 public:
  // kvc::EncoderDecoderCache<AnyCache, AnyCache> asks the two methods below at run time.
  static constexpr bool is_type_erased_cache = true;

  AnyCache() = default;
  // Takes ownership of `cache` (moved or copied in); implicit, like std::any.
  template <class C>
    requires(detail::host_cache<std::remove_cvref_t<C>> && !std::is_same_v<std::remove_cvref_t<C>, AnyCache>)
  AnyCache(C&& cache)  // NOLINT: implicit, like std::any
      : impl_(std::make_unique<detail::any_cache_model<std::remove_cvref_t<C>>>(std::forward<C>(cache))) {}

  // Whether the handle holds a cache.
  bool has_value() const noexcept { return impl_ != nullptr; }
  // kvc's name of the held cache's element type ("float", "half", ...); ValueError when empty.
  std::string_view element_type_name() const { return self().element_type_name(); }

  // The held cache if it is a C, else nullptr.
  template <class C>
  C* get() noexcept {
    return impl_ && impl_->type() == typeid(C) ? static_cast<C*>(const_cast<void*>(impl_->address())) : nullptr;
  }
  // The held cache if it is a C, else nullptr (const access).
  template <class C>
  const C* get() const noexcept {
    return impl_ && impl_->type() == typeid(C) ? static_cast<const C*>(impl_->address()) : nullptr;
  }

  // Keys and values: any kvc::tensor_input on the host, both of the held cache's element type
  // (checked at run time: kvc::TypeError otherwise).
  template <class KeysT, class ValuesT>
  auto update(const KeysT& keys, const ValuesT& values, std::int64_t layer_idx) {
    using T = detail::input_element_or_t<KeysT>;
    constexpr bool accepted =
        detail::input_in<KeysT, memory_space::host> && detail::input_in<ValuesT, memory_space::host>;
    if constexpr (!detail::require_inputs<accepted, KeysT, ValuesT>()) {
      return KV<TensorView<T>>{};
    } else {
      constexpr bool same = std::is_same_v<T, input_element_t<ValuesT>>;
      static_assert(same, "kvc::AnyCache::update: keys and values must have the same element type");
      if constexpr (same)
        return self().update(input_view(keys), input_view(values), layer_idx);
      else
        return KV<TensorView<T>>{};
    }
  }
  // What layer `layer_idx` holds, as T views (Cache::stored). TypeError if T is not the held
  // element type, IndexError for a layer out of range, ValueError when empty.
  template <class T>
  KV<TensorView<T>> stored(std::int64_t layer_idx) const {
    return self().stored(layer_idx, std::type_identity<T>{});
  }

  // The number of tokens layer `layer_idx` holds (Cache::get_seq_length). IndexError for a
  // negative index, ValueError for a linear-attention layer or an empty handle.
  std::int64_t get_seq_length(std::int64_t layer_idx = 0) const { return self().get_seq_length(layer_idx); }
  // Where the query of layer `layer_idx` starts, as the held cache says (MtpCache and DFlashCache
  // shift it). Throws as get_seq_length.
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const { return self().get_query_offset(layer_idx); }

  // Linear-attention states and indexer keys (Cache::update_conv_state and friends).
  template <class X>
    requires detail::state_input<std::remove_cvref_t<X>>::valid
  auto update_conv_state(const X& conv_states, std::int64_t layer_idx, std::int64_t state_idx = 0,
                         std::int64_t conv_kernel_size = 0) {
    return self().update_state(detail::state_update::conv,
                               detail::state_input<std::remove_cvref_t<X>>::view(conv_states), layer_idx, state_idx,
                               conv_kernel_size);
  }
  // Overwrites recurrent state `state_idx` of linear-attention layer `layer_idx` and returns it.
  // TypeError for another element type; the held cache's errors for a bad index or layer.
  template <class X>
    requires detail::state_input<std::remove_cvref_t<X>>::valid
  auto update_recurrent_state(const X& recurrent_states, std::int64_t layer_idx, std::int64_t state_idx = 0) {
    return self().update_state(detail::state_update::recurrent,
                               detail::state_input<std::remove_cvref_t<X>>::view(recurrent_states), layer_idx,
                               state_idx, 0);
  }
  // Appends indexer keys to indexed layer `layer_idx` and returns what the layer holds. TypeError
  // for another element type; IndexError or ValueError from the held cache (no such layer).
  template <class X>
    requires detail::state_input<std::remove_cvref_t<X>>::valid
  auto update_indexer(const X& indexer_key_states, std::int64_t layer_idx) {
    return self().update_state(detail::state_update::indexer,
                               detail::state_input<std::remove_cvref_t<X>>::view(indexer_key_states), layer_idx, 0, 0);
  }
  // Whether the linear-attention layer (default: the last one) has seen a conv update. ValueError
  // when asked of an attention layer, when there is none, or when empty.
  bool has_previous_state(std::optional<std::int64_t> layer_idx = std::nullopt,
                          std::optional<std::int64_t> state_idx = std::nullopt) const {
    return self().has_previous_state(layer_idx, state_idx);
  }
  // Per layer: whether it is a pure linear-attention layer. ValueError when empty.
  std::vector<bool> is_linear() const { return self().is_linear(); }
  // Whether the held cache is what transformers calls a DynamicCache (every layer kind can crop
  // and change its batch), and transformers' repr of it, `DynamicCache(layers=[...])`.
  bool is_dynamic_cache() const { return self().is_dynamic_cache(); }
  // The held cache's repr (transformers' style for a Cache). ValueError when empty.
  std::string repr() const { return self().repr(); }
  // (kv_length, kv_offset) for a query of `q` new tokens at layer `layer_idx`, asked before the
  // update. IndexError for a negative index, ValueError for a linear layer or an empty handle.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q, std::int64_t layer_idx) const {
    return self().get_mask_sizes(q, layer_idx);
  }
  // The largest number of tokens any layer can return, -1 when some layer is unbounded.
  // ValueError when the held cache has no layers yet or the handle is empty.
  std::int64_t get_max_length() const { return self().get_max_length(); }
  // The number of tokens layer `layer_idx` can return (-1: unbounded, or past the last layer).
  // IndexError for a negative index; ValueError when empty.
  std::int64_t get_max_length(std::int64_t layer_idx) const { return self().get_max_length(layer_idx); }
  // Removes tokens from every layer (Cache::crop). AttributeError naming the layer when the held
  // cache cannot crop (a StaticCache); ValueError when empty.
  void crop(std::int64_t tokens_to_remove) { self().crop(tokens_to_remove); }
  // How many of their last tokens all layers can drop exactly now (Cache::rollback_depth,
  // docs/rollback.md); ValueError when empty.
  std::int64_t rollback_depth() const { return self().rollback_depth(); }
  // Picks batch rows by beam index in every layer (beam search). IndexError for an index out of
  // bounds, ValueError for an empty list or an empty handle.
  void reorder_cache(std::span<const std::int64_t> beam_idx) { self().reorder_cache(beam_idx); }
  // reorder_cache for a braced list of beam indices; throws as the span overload.
  void reorder_cache(std::initializer_list<std::int64_t> beam_idx) {
    self().reorder_cache(std::span(beam_idx.begin(), beam_idx.size()));
  }
  // Repeats every batch row `repeats` times. AttributeError when the held cache has no batch
  // operations (a StaticCache); ValueError for repeats < 1 or an empty handle.
  void batch_repeat_interleave(std::int64_t repeats) { self().batch_repeat_interleave(repeats); }
  // Keeps only the batch rows named by `indices`, in that order. AttributeError without batch
  // operations, IndexError for an index out of bounds, ValueError for none or an empty handle.
  void batch_select_indices(std::span<const std::int64_t> indices) { self().batch_select_indices(indices); }
  // batch_select_indices for a braced list of rows; throws as the span overload.
  void batch_select_indices(std::initializer_list<std::int64_t> indices) {
    self().batch_select_indices(std::span(indices.begin(), indices.size()));
  }
  // Empties or rewinds every layer of the held cache (Cache::reset); does nothing when empty.
  void reset() {
    if (impl_) impl_->reset();
  }
  // Room for `tokens` tokens in every layer that grows as it is appended to (Cache::reserve); a
  // held cache without such layers (the paged one) is left as it is.
  void reserve(std::int64_t tokens) { self().reserve(tokens); }
  // Brings layer `layer_idx` (-1: every layer) back from an offload tier (Cache::make_resident).
  void make_resident(std::int64_t layer_idx = -1) {
    if (impl_) impl_->make_resident(layer_idx);
  }
  // Turns on the recording of past states in the layers that support it; nothing when empty.
  void activate_past_recording() noexcept {
    if (impl_) impl_->activate_past_recording();
  }
  // Sets every layer's write position (the export path). AttributeError when a layer has none,
  // IndexError for a negative position or one past a layer's max_cache_len; ValueError when empty.
  void set_write_position(std::int64_t position) { self().set_write_position(position); }
  // Allocates every layer that supports it now instead of at its first update. ValueError for
  // bad sizes or an empty handle.
  void early_initialization(std::int64_t batch_size, detail::int_or_list num_heads, detail::int_or_list head_dim) {
    self().early_initialization(batch_size, num_heads, head_dim);
  }
  // Per layer: whether it is a sliding-window layer. ValueError when empty.
  std::vector<bool> is_sliding() const { return self().is_sliding(); }
  // Whether layer `layer_idx` is a sliding layer (false past the last layer). IndexError for a
  // negative index; ValueError when empty.
  bool is_sliding(std::int64_t layer_idx) const { return self().is_sliding(layer_idx); }
  // Whether the held cache has layers and every one is compileable. ValueError when empty.
  bool is_compileable() const { return self().is_compileable(); }
  // Whether some layer supports early initialization and all those are initialized. ValueError
  // when empty.
  bool is_initialized() const { return self().is_initialized(); }
  // The batch size shared by the initialized layers, -1 when none is. ValueError when layers
  // disagree or the handle is empty.
  std::int64_t batch_size() const { return self().batch_size(); }
  // The number of layers of the held cache. ValueError when empty.
  std::int64_t size() const { return self().size(); }
  // The kind name of layer `layer_idx`, e.g. "DynamicLayer". IndexError for a layer out of range;
  // ValueError when empty.
  std::string_view layer_name(std::int64_t layer_idx) const { return self().layer_name(layer_idx); }
  // Bytes of K/V memory the held cache's layers hold (allocated capacity). ValueError when empty.
  std::int64_t bytes() const { return self().bytes(); }

 private:
  detail::any_cache_iface& self() {
    if (!impl_) throw ValueError("AnyCache: the handle holds no cache");
    return *impl_;
  }
  const detail::any_cache_iface& self() const {
    if (!impl_) throw ValueError("AnyCache: the handle holds no cache");
    return *impl_;
  }

  std::unique_ptr<detail::any_cache_iface> impl_;
};

}  // namespace kvc

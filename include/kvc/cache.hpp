#pragma once
// kvc::Cache<LayerPolicy, StoragePolicy, OffloadPolicy>: a list of layers with transformers'
// Cache method set (../shared/DESIGN.md, "Public API contract"). What is known at compile time is
// checked by the primary template's static_asserts; the implementation is the constrained partial
// specialisation. Everything only known at run time throws, and a throwing call leaves the cache
// exactly as it was.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

#include <kvc/concepts/cache_layer.hpp>
#include <kvc/concepts/layer_policy.hpp>
#include <kvc/concepts/linear_layer.hpp>
#include <kvc/concepts/offload_policy.hpp>
#include <kvc/concepts/storage_policy.hpp>
#include <kvc/detail/checked_state_view.hpp>
#include <kvc/detail/state_io.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers.hpp>
#include <kvc/policies/layers/crop_plan.hpp>
#include <kvc/policies/offload/none.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/tensor.hpp>
#include <kvc/warnings.hpp>

namespace kvc {
namespace detail {

template <class List, class S>
struct all_cache_layers : std::false_type {};
template <class... K, class S>
struct all_cache_layers<boost::mp11::mp_list<K...>, S> : std::bool_constant<(concepts::AnyCacheLayer<K, S> && ...)> {};

// For a misconfigured Cache: one instantiation per layer kind, so that the compiler's context line
// ("in instantiation of kvc::detail::layer_kind_check<Kind, Storage>") names each kind that is not
// a layer kind. `value` is always true: the static_assert inside is the one error.
template <class Kind, class S>
struct layer_kind_check {
  static_assert(concepts::AnyCacheLayer<Kind, S>,
                "kvc::Cache: a layer kind of the LayerPolicy does not model kvc::concepts::CacheLayer (nor "
                "LinearCacheLayer) for this storage. Use the kvc layer kinds, e.g. DynamicLayer or StaticLayer. "
                "The kind is the first argument of kvc::detail::layer_kind_check<Kind, Storage> in this error's "
                "instantiation context");
  static constexpr bool value = true;
};
template <class List, class S>
struct check_each_layer_kind : std::true_type {};
template <class... K, class S>
struct check_each_layer_kind<boost::mp11::mp_list<K...>, S>
    : std::bool_constant<(layer_kind_check<K, S>::value && ...)> {};
// Only once the layer and storage policies are valid (their own message comes first, and alone).
template <class L, class S, bool = concepts::LayerPolicy<L>&& concepts::StoragePolicy<S>>
struct check_layer_kinds_of : std::true_type {};
template <class L, class S>
struct check_layer_kinds_of<L, S, true> : check_each_layer_kind<layer_kinds<L>, S> {};

// What every method of a misconfigured Cache returns: it converts to anything and binds as a
// (keys, values) pair, so that code calling the Cache adds no second error to the policy's.
struct misconfigured_result {
  template <class T>
  operator T() const;  // NOLINT: never defined, never called (the program does not compile)
};
struct misconfigured_kv {
  misconfigured_result keys, values;
};

// An offload policy for device storage (it names `moves_device_to_host`) used with host storage.
template <class O, class S>
inline constexpr bool device_offload_on_host = [] {
  if constexpr (requires { O::moves_device_to_host; })
    return static_cast<bool>(O::moves_device_to_host) && S::space == memory_space::host;
  else
    return false;
}();

template <class L>
inline constexpr bool has_layer_kinds = boost::mp11::mp_size<layer_kinds<L>>::value > 0;

// An int broadcast to every layer, or one value per layer (early_initialization's arguments).
class int_or_list {
 public:
  template <class I>
    requires std::is_integral_v<I>
  int_or_list(I value) : scalar_(static_cast<std::int64_t>(value)) {}  // NOLINT: implicit by design
  int_or_list(std::vector<std::int64_t> values) : list_(std::move(values)), is_list_(true) {}  // NOLINT
  int_or_list(std::initializer_list<std::int64_t> values) : list_(values), is_list_(true) {}   // NOLINT

  bool is_list() const noexcept { return is_list_; }
  std::size_t length() const noexcept { return list_.size(); }
  std::int64_t at(std::size_t i) const noexcept { return is_list_ ? list_[i] : scalar_; }

 private:
  std::int64_t scalar_ = 0;
  std::vector<std::int64_t> list_;
  bool is_list_ = false;
};

// early_initialization's checks of its arguments for a cache of n layers (transformers' texts for
// lists of the wrong length; kvc's bound on the batch).
inline void check_early_initialization(std::size_t n, std::int64_t batch_size, const int_or_list& num_heads,
                                       const int_or_list& head_dim) {
  if (num_heads.is_list() && num_heads.length() != n)
    throw ValueError("`num_head` was provided as a list of length " + std::to_string(num_heads.length()) +
                     ", but the Cache currently has " + std::to_string(n) + " layers");
  if (head_dim.is_list() && head_dim.length() != n)
    throw ValueError("`head_dim` was provided as a list of length " + std::to_string(head_dim.length()) +
                     ", but the Cache currently has " + std::to_string(n) + " layers");
  check_size("early_initialization: batch_size", batch_size, 1, max_batch);
}

// batch_repeat_interleave's batch rows: row b repeated `repeats` times, checked against max_batch.
inline std::vector<std::int64_t> repeated_rows(std::int64_t batch, std::int64_t repeats) {
  if (batch * repeats > max_batch)  // batch at most max_extent, repeats at most max_batch: no overflow
    throw ValueError("batch_repeat_interleave: batch " + std::to_string(batch) + " repeated " +
                     std::to_string(repeats) + " times is " + std::to_string(batch * repeats) +
                     ", above kvc's limit of " + std::to_string(max_batch));
  std::vector<std::int64_t> idx;
  idx.reserve(static_cast<std::size_t>(batch * repeats));
  for (std::int64_t b = 0; b < batch; ++b) idx.insert(idx.end(), static_cast<std::size_t>(repeats), b);
  return idx;
}

// The layer a length or mask query on layer `idx` reads (transformers' Cache methods on a cache
// with linear-attention layers): idx itself when it has keys and values; for idx 0 the first
// layer that has them; otherwise transformers' ValueError. `has_kv(i)` says whether layer i has
// keys and values; idx is in range.
template <class HasKV>
std::int64_t attention_layer_for(const char* method, std::int64_t idx, std::int64_t layers, HasKV&& has_kv) {
  if (has_kv(idx)) return idx;
  if (idx != 0)
    throw ValueError("You called `" + std::string(method) + "` on layer index " + std::to_string(idx) +
                     ", but this layer is a LinearAttention layer, which does not track sequence length.");
  for (std::int64_t i = 0; i < layers; ++i)
    if (has_kv(i)) return i;
  throw ValueError("`" + std::string(method) +
                   "` can only be called on Attention layers, and the current Cache seem to only contain "
                   "LinearAttention layers.");
}

// The layer has_previous_state reads: `layer_idx` (checked: not negative; -1 past the last layer,
// where the answer is false), else the last layer with linear-attention states; transformers'
// ValueError for a layer without them or a cache with none. `has_states(i)` says whether layer i
// has them.
template <class HasStates>
std::int64_t previous_state_layer(std::optional<std::int64_t> layer_idx, std::int64_t layers, HasStates&& has_states) {
  if (layer_idx) {
    if (*layer_idx < 0)
      throw IndexError("has_previous_state: layer_idx " + std::to_string(*layer_idx) +
                       " is out of range: layer indices start at 0");
    if (*layer_idx >= layers) return -1;
    if (!has_states(*layer_idx))
      throw ValueError("You called `has_previous_state` on layer index " + std::to_string(*layer_idx) +
                       ", but this layer is an Attention layer, which does not support calling it.");
    return *layer_idx;
  }
  for (std::int64_t i = layers - 1; i >= 0; --i)
    if (has_states(i)) return i;
  throw ValueError(
      "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to only "
      "contain Attention layers.");
}

}  // namespace detail

namespace concepts {
// Everything the Cache's implementation needs; each failing part has its own message in the
// primary template below.
template <class L, class S, class O>
concept ValidCacheConfig = LayerPolicy<L> && supports_its_element_type<S> && serves_storage<O, S> &&
                           detail::has_layer_kinds<L> && detail::all_cache_layers<detail::layer_kinds<L>, S>::value;
}  // namespace concepts

// Reached only on misuse: one static_assert per mistake (docs/errors.md), each guarded so that one
// mistake produces one error.
template <class LayerPolicy, class StoragePolicy = HostStorage<float>, class OffloadPolicy = NoOffload>
class Cache {
  static_assert(!(concepts::has_layers_list<LayerPolicy> && concepts::has_layer_class_to_replicate<LayerPolicy>),
                "You can construct a Cache either from a list `layers` of all the predefined `CacheLayer`, or from a "
                "`layer_class_to_replicate`, in which case the Cache will append a new layer corresponding to "
                "`layer_class_to_replicate` for each new call to `update` with an idx not already in the Cache. "
                "In kvc: a LayerPolicy with `layers` only is kvc::Layers<Kinds...>, one with "
                "`layer_class_to_replicate` only is kvc::Replicate<Kind>; use one of them.");
  static_assert(concepts::has_layers_list<LayerPolicy> || concepts::has_layer_class_to_replicate<LayerPolicy>,
                "You should provide exactly one of `layers` or `layer_class_to_replicate` to initialize a Cache. "
                "In kvc: use kvc::Layers<Kinds...> (a fixed list of layer kinds) or kvc::Replicate<Kind> (a layer "
                "appended for each new layer index) as the LayerPolicy.");
  static_assert(!concepts::LayerPolicy<LayerPolicy> || detail::has_layer_kinds<LayerPolicy>,
                "kvc::Cache: the LayerPolicy's `layers` list is empty. Name at least one layer kind in kvc::Layers");
  static_assert(concepts::StoragePolicy<StoragePolicy>,
                "kvc::Cache: the StoragePolicy does not model kvc::concepts::StoragePolicy. Use kvc::HostStorage "
                "or see docs/concepts/storage_policy.md");
  static_assert(!concepts::StoragePolicy<StoragePolicy> || concepts::supports_its_element_type<StoragePolicy>,
                "kvc::Cache: the StoragePolicy does not support this element type. Use float, double, Eigen::half, "
                "Eigen::bfloat16 or an 8-bit float (kvc::float8_e4m3, float8_e5m2) with HostStorage; float, __half, "
                "__nv_bfloat16 or an 8-bit float with CudaStorage");
  static_assert(!concepts::StoragePolicy<StoragePolicy> || concepts::OffloadPolicy<OffloadPolicy, StoragePolicy>,
                "kvc::Cache: the OffloadPolicy does not model kvc::concepts::OffloadPolicy. Use kvc::NoOffload or see "
                "docs/concepts/offload_policy.md");
  static_assert(!concepts::OffloadPolicy<OffloadPolicy, StoragePolicy> ||
                    !detail::device_offload_on_host<OffloadPolicy, StoragePolicy>,
                "kvc::Cache: kvc::OffloadToHost moves layers from device memory to pinned host memory, but "
                "HostStorage already keeps them in host memory. Use kvc::OffloadToFile to spill host layers to a file, "
                "or kvc::CudaStorage with OffloadToHost");
  static_assert(!concepts::OffloadPolicy<OffloadPolicy, StoragePolicy> ||
                    detail::device_offload_on_host<OffloadPolicy, StoragePolicy> ||
                    concepts::serves_storage<OffloadPolicy, StoragePolicy>,
                "kvc::Cache: the OffloadPolicy cannot serve this StoragePolicy. Pick an offload policy made for the "
                "storage's memory space");
  static_assert(detail::check_layer_kinds_of<LayerPolicy, StoragePolicy>::value);  // layer_kind_check's message

 public:
  // Accepts any arguments, and has the Cache methods, so that constructing and using a
  // misconfigured Cache reports only the asserts above.
  template <class... Args>
  explicit Cache(Args&&...) {}
  // Stand-in for update on a misconfigured Cache: takes any arguments and returns a placeholder
  // (keys, values) pair. Never runs: the static_asserts above stop the build.
  template <class... Args>
  detail::misconfigured_kv update(Args&&...) {
    return {};
  }
  // Stand-in for stored on a misconfigured Cache: returns a placeholder (keys, values) pair.
  template <class... Args>
  detail::misconfigured_kv stored(Args&&...) const {
    return {};
  }
#define KVC_DETAIL_MISCONFIGURED(type, name) \
  template <class... Args>                   \
  type name(Args&&...) const {               \
    return type();                           \
  }
  // Stand-in for get_seq_length on a misconfigured Cache: returns a placeholder length (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, get_seq_length)
  // Stand-in for get_query_offset on a misconfigured Cache: returns a placeholder offset (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, get_query_offset)
  // Stand-in for get_max_length on a misconfigured Cache: returns a placeholder length (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, get_max_length)
  // Stand-in for batch_size on a misconfigured Cache: returns a placeholder batch size (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, batch_size)
  // Stand-in for size on a misconfigured Cache: returns a placeholder layer count (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, size)
  // Stand-in for bytes on a misconfigured Cache: returns a placeholder byte count (0).
  KVC_DETAIL_MISCONFIGURED(std::int64_t, bytes)
  // get_mask_sizes' result type: a (kv_length, kv_offset) pair.
  using mask_sizes = std::pair<std::int64_t, std::int64_t>;
  // Stand-in for get_mask_sizes on a misconfigured Cache: returns a placeholder (0, 0) pair.
  KVC_DETAIL_MISCONFIGURED(mask_sizes, get_mask_sizes)
  // Stand-in for is_compileable on a misconfigured Cache: returns false.
  KVC_DETAIL_MISCONFIGURED(bool, is_compileable)
  // Stand-in for is_initialized on a misconfigured Cache: returns false.
  KVC_DETAIL_MISCONFIGURED(bool, is_initialized)
  // Stand-in for has_previous_state on a misconfigured Cache: returns false.
  KVC_DETAIL_MISCONFIGURED(bool, has_previous_state)
  // Stand-in for layer_name on a misconfigured Cache: returns an empty name.
  KVC_DETAIL_MISCONFIGURED(std::string_view, layer_name)
  // Stand-in for is_linear on a misconfigured Cache: returns a placeholder that converts to any
  // type.
  KVC_DETAIL_MISCONFIGURED(detail::misconfigured_result, is_linear)
  // Stand-in for is_sliding on a misconfigured Cache: returns a placeholder that converts to any
  // type.
  KVC_DETAIL_MISCONFIGURED(detail::misconfigured_result, is_sliding)
  // Stand-in for update_conv_state on a misconfigured Cache: returns a placeholder that converts to
  // any type.
  KVC_DETAIL_MISCONFIGURED(detail::misconfigured_result, update_conv_state)
  // Stand-in for update_recurrent_state on a misconfigured Cache: returns a placeholder that
  // converts to any type.
  KVC_DETAIL_MISCONFIGURED(detail::misconfigured_result, update_recurrent_state)
  // Stand-in for update_indexer on a misconfigured Cache: returns a placeholder that converts to
  // any type.
  KVC_DETAIL_MISCONFIGURED(detail::misconfigured_result, update_indexer)
  // Stand-in for crop on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, crop)
  // Stand-in for reorder_cache on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, reorder_cache)
  // Stand-in for batch_repeat_interleave on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, batch_repeat_interleave)
  // Stand-in for batch_select_indices on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, batch_select_indices)
  // Stand-in for reset on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, reset)
  // Stand-in for make_resident on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, make_resident)
  // Stand-in for early_initialization on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, early_initialization)
  // Stand-in for set_write_position on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, set_write_position)
  // Stand-in for activate_past_recording on a misconfigured Cache: does nothing.
  KVC_DETAIL_MISCONFIGURED(void, activate_past_recording)
#undef KVC_DETAIL_MISCONFIGURED
  // Stand-in for reorder_cache({...}) (a braced list) on a misconfigured Cache: does nothing.
  void reorder_cache(std::initializer_list<std::int64_t>) const {}
  // Stand-in for batch_select_indices({...}) (a braced list) on a misconfigured Cache: does
  // nothing.
  void batch_select_indices(std::initializer_list<std::int64_t>) const {}
};

// The cache for a valid configuration: a list of layers, each the state of one of the LayerPolicy's
// kinds in StoragePolicy S's memory, offloaded by OffloadPolicy O, with transformers' Cache method
// set (update, get_seq_length, crop, reorder_cache, ...) for a model's attention to store K/V in.
template <class L, class S, class O>
  requires concepts::ValidCacheConfig<L, S, O>
class Cache<L, S, O> {
 public:
  // The LayerPolicy: kvc::Layers<Kinds...> (a fixed list) or kvc::Replicate<Kind> (made on demand).
  using layer_policy = L;
  // The StoragePolicy: where the layers' buffers live and which element type they hold.
  using storage_policy = S;
  // The OffloadPolicy: where layers go between their updates (kvc::NoOffload: nowhere).
  using offload_policy = O;
  // The element type of the stored keys and values (e.g. float).
  using element_type = typename S::element_type;
  // The storage's [batch, heads, seq, head_dim] tensor view type: kv_type's keys and values.
  using view_type = typename S::view_type;
  // A (keys, values) pair of views: what update and stored return.
  using kv_type = KV<view_type>;
  // The LayerPolicy's layer kinds, as a boost::mp11 list.
  using kinds = detail::layer_kinds<L>;
  // The state type of layer kind K in this storage: what the cache holds for a layer of kind K.
  template <class K>
  using state_of = typename K::template state<S>;
  // A std::variant of the layer kinds: one entry of a layer list known only at run time.
  using kind_variant = boost::mp11::mp_rename<kinds, std::variant>;
  // A std::variant of the layer kinds' states: what the cache holds for each layer.
  using layer_variant = boost::mp11::mp_rename<boost::mp11::mp_transform<state_of, kinds>, std::variant>;
  // True for a replicated LayerPolicy (kvc::Replicate): a layer is made from the prototype on the
  // first update of each new layer index.
  static constexpr bool replicated = concepts::has_layer_class_to_replicate<L>;

 private:
  template <class St>
  using has_crop = std::bool_constant<concepts::supports_crop<St>>;
  template <class St>
  using has_batch_ops = std::bool_constant<concepts::supports_batch_ops<St>>;
  template <class St>
  using has_write_position = std::bool_constant<concepts::supports_write_position<St>>;
  template <class St>
  using has_staged_crop = std::bool_constant<detail::staged_crop<St>>;
  template <class St>
  using crop_plan_of = typename detail::crop_plan<St>::type;
  // K/V layers have `update`; linear-attention layers have conv/recurrent states; hybrids both.
  template <class St>
  static constexpr bool has_kv = concepts::has_update<St, S>;
  template <class St>
  static constexpr bool has_linear = concepts::has_state_views<S> && concepts::has_linear_states<St, S>;
  template <template <class> class Pred>
  static constexpr bool any_kind = boost::mp11::mp_any_of<boost::mp11::mp_transform<state_of, kinds>, Pred>::value;

 public:
  // Which optional operations some layer kind of this cache has (the others do not compile).
  static constexpr bool can_crop = any_kind<has_crop>;
  // True when some layer kind supports batch_repeat_interleave and batch_select_indices.
  static constexpr bool can_batch_ops = any_kind<has_batch_ops>;
  // True when some layer kind has a write position (set_write_position; StaticLayer).
  static constexpr bool can_set_write_position = any_kind<has_write_position>;

  // ---- construction --------------------------------------------------------------------------

  // Copies are deep; a copy assignment that throws (out of memory, a spill file that cannot be
  // copied) leaves the cache as it was.
  Cache(const Cache&) = default;
  // Moves: takes over the other cache's layers and offload state.
  Cache(Cache&&) = default;
  // Deep copy assignment, copied aside then moved in; returns *this. On std::bad_alloc or a spill
  // file that cannot be copied (kvc::RuntimeError) the cache is left as it was.
  Cache& operator=(const Cache& other) {
    if (this != &other) {
      Cache copy(other);
      *this = std::move(copy);
    }
    return *this;
  }
  // Move assignment: takes over the other cache's layers and offload state; returns *this.
  Cache& operator=(Cache&&) = default;

  // Replicated: layers are copies of `prototype` (checked now, so a bad prototype throws here).
  // The constrained constructors are templates so that `template class Cache<...>;` skips them.
  template <bool R = replicated>
    requires R
  Cache() : Cache(boost::mp11::mp_front<kinds>{}) {}
  // Replicated: every layer is made as a copy of `prototype`. kvc::ValueError now for a bad
  // prototype (e.g. a sliding_window or max_cache_len below 1).
  template <bool R = replicated>
    requires R
  explicit Cache(boost::mp11::mp_front<kinds> prototype) : prototype_(prototype) {
    (void)state_of<boost::mp11::mp_front<kinds>>(prototype_);
  }

  // Pre-built from layer kinds known at compile time: Cache<Layers<A, B>>(A{...}, B{...}, A{...}).
  template <class... K>
    requires(!replicated && sizeof...(K) > 0 &&
             (!std::is_same_v<std::remove_cvref_t<K>, std::vector<kind_variant>> && ...))
  explicit Cache(K... layer_kinds) {
    static_assert((boost::mp11::mp_contains<kinds, K>::value && ...),
                  "kvc::Cache: a layer kind given to the constructor is not in the LayerPolicy's `layers` list. Add "
                  "it to kvc::Layers");
    if constexpr ((boost::mp11::mp_contains<kinds, K>::value && ...)) {
      layers_.reserve(sizeof...(K));
      (layers_.emplace_back(std::in_place_type<state_of<K>>, layer_kinds), ...);
    }
  }

  // Pre-built from a list only known at run time (a config's layer_types).
  template <bool R = replicated>
    requires(!R)
  explicit Cache(const std::vector<kind_variant>& layer_kinds) {
    layers_.reserve(layer_kinds.size());
    for (const auto& kind : layer_kinds)
      std::visit(
          [&](const auto& k) { layers_.emplace_back(std::in_place_type<state_of<std::decay_t<decltype(k)>>>, k); },
          kind);
  }

  // ---- update --------------------------------------------------------------------------------

  // Stores `keys`/`values` ([batch, heads, q, head_dim]) in layer `layer_idx` and returns the views
  // attention reads (valid until the next call that changes this layer). The inputs must not alias
  // this cache's own buffers.
  // Keys and values: what the storage accepts (HostStorage and CudaStorage: any kvc::tensor_input of
  // the cache's element type in their memory space).
  template <class KeysT, class ValuesT>
  kv_type update(const KeysT& keys, const ValuesT& values, std::int64_t layer_idx) {
    constexpr bool accepted = S::template accepts_input<KeysT> && S::template accepts_input<ValuesT>;
    if constexpr (detail::require_inputs<accepted, KeysT, ValuesT>())
      return update_views(S::input_view(keys), S::input_view(values), layer_idx);
    else
      return {};
  }

  // update's checks (the layer index, a replicated layer appended on demand, the shapes against
  // the layer's) and offload hooks around op(layer state) instead of the layer's own update: for
  // a path that stores a step its own way (kvc::attend_quantized attends from a quantized layer's
  // codes, then appends). op must take every layer kind of the cache and return one type, which
  // this returns; a layer appended for the call is dropped again if op throws. Keys and values:
  // what update takes.
  template <class KeysT, class ValuesT, class Op>
  auto update_with(const KeysT& keys, const ValuesT& values, std::int64_t layer_idx, Op&& op) {
    using R = std::invoke_result_t<Op&, std::variant_alternative_t<0, layer_variant>&>;
    constexpr bool accepted = S::template accepts_input<KeysT> && S::template accepts_input<ValuesT>;
    if constexpr (detail::require_inputs<accepted, KeysT, ValuesT>())
      return store_views<R>(S::input_view(keys), S::input_view(values), layer_idx, op);
    else  // (compiled only after the assertion failed)
      return store_views<R>(view_type{}, view_type{}, layer_idx, op);
  }

  // ---- length queries ------------------------------------------------------------------------

  // A pure linear-attention layer has no length: index 0 answers for the first attention layer,
  // any other index throws.
  std::int64_t get_seq_length(std::int64_t layer_idx = 0) const {
    check_index(layer_idx, "get_seq_length");
    if (layer_idx >= size()) return 0;
    layer_idx = attention_layer_for("get_seq_length", layer_idx);
    return visit_layer(layer_idx, [](const auto& l) -> std::int64_t {
      if constexpr (has_kv<std::decay_t<decltype(l)>>)
        return l.get_seq_length();
      else
        return 0;  // unreachable: attention_layer_for picked a K/V layer
    });
  }

  // Where the query of layer `layer_idx` starts (transformers' get_query_offset).
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const { return get_seq_length(layer_idx); }

  // (kv_length, kv_offset) for a query of `query_length` new tokens, asked before the update.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t query_length, std::int64_t layer_idx) const {
    check_index(layer_idx, "get_mask_sizes");
    detail::check_size("get_mask_sizes: query_length", query_length, 0, max_extent);
    if (layer_idx >= size()) return {query_length, 0};
    layer_idx = attention_layer_for("get_mask_sizes", layer_idx);
    return visit_layer(layer_idx, [&](const auto& l) -> std::pair<std::int64_t, std::int64_t> {
      if constexpr (has_kv<std::decay_t<decltype(l)>>)
        return l.get_mask_sizes(query_length);
      else
        return {query_length, 0};  // unreachable: attention_layer_for picked a K/V layer
    });
  }

  // The largest number of tokens any layer can return; -1 when some layer is unbounded.
  std::int64_t get_max_length() const {
    if (layers_.empty())
      throw ValueError(
          "`get_max_length` was called on a Cache that has no layers yet: a replicated Cache creates its layers on "
          "the first `update` of each index");
    // Linear-attention layers have no length; with no attention layer at all the answer is -1
    // (transformers' max over the layers' -1).
    std::int64_t out = -1;
    for (std::int64_t i = 0; i < size(); ++i) {
      if (!layer_has_kv(i)) continue;
      const std::int64_t m = get_max_length(i);
      if (m < 0) return -1;
      out = std::max(out, m);
    }
    return out;
  }
  // The largest number of tokens layer `layer_idx` can return; -1 when it is unbounded, a pure
  // linear-attention layer or past the last layer. kvc::IndexError for a negative index.
  std::int64_t get_max_length(std::int64_t layer_idx) const {
    check_index(layer_idx, "get_max_length");
    if (layer_idx >= size()) return -1;
    return visit_layer(layer_idx, [](const auto& l) -> std::int64_t {
      if constexpr (has_kv<std::decay_t<decltype(l)>>)
        return l.get_max_length();
      else
        return -1;
    });
  }

  // ---- whole-cache operations ----------------------------------------------------------------

  // Removes `-tokens_to_remove` tokens (tokens_to_remove < 0), or keeps `tokens_to_remove` tokens
  // (> 0, deprecated), from every layer. crop(0) may still shrink recorded sliding states.
  template <int = 0>  // a template, so that `template class Cache<...>;` skips it for static caches
  void crop(std::int64_t tokens_to_remove) {
    before_access(-1);
    static_assert(can_crop,
                  "kvc::Cache::crop: no layer kind of this cache can be cropped. Static layers keep a fixed buffer; "
                  "use a dynamic cache to roll back");
    for_each_layer([&](const auto& l) {
      using St = std::decay_t<decltype(l)>;
      if constexpr (concepts::supports_crop<St>)
        l.check_crop(tokens_to_remove);
      else
        throw_missing_attribute<St>("crop");
    });
    if constexpr (any_kind<has_staged_crop>) {
      // Kinds whose crop allocates (a quantized history cut and quantized again, linear-attention
      // states) prepare it aside in every layer first; then every layer commits, which cannot throw.
      using namespace boost::mp11;
      using plan_variant =
          mp_rename<mp_unique<mp_push_front<mp_transform<crop_plan_of, mp_transform<state_of, kinds>>, std::monostate>>,
                    std::variant>;
      std::vector<plan_variant> plans;
      plans.reserve(layers_.size());
      for_each_layer([&](const auto& l) {
        using St = std::decay_t<decltype(l)>;
        if constexpr (detail::staged_crop<St>)
          plans.emplace_back(std::in_place_type<typename St::crop_plan>, l.prepare_crop(tokens_to_remove));
        else
          plans.emplace_back();
      });
      std::size_t i = 0;
      for_each_layer([&](auto& l) {
        using St = std::decay_t<decltype(l)>;
        auto& plan = plans[i++];
        if constexpr (detail::staged_crop<St>)
          l.commit_crop(std::move(std::get<typename St::crop_plan>(plan)));
        else if constexpr (concepts::supports_crop<St>)
          l.crop(tokens_to_remove);
      });
    } else {
      for_each_layer([&](auto& l) {
        if constexpr (concepts::supports_crop<std::decay_t<decltype(l)>>) l.crop(tokens_to_remove);
      });
    }
  }

  // How many of their last tokens all layers can drop exactly now (docs/rollback.md): the minimum of
  // the layers' depths, 0 when a layer kind cannot crop, kvc::unbounded_rollback for a cache whose
  // layers keep every token (or that has no layer). crop(-n) with n above it throws kvc::RuntimeError
  // before anything changes. transformers' `is_croppable` is rollback_depth() > 0.
  std::int64_t rollback_depth() const {
    std::int64_t depth = unbounded_rollback;
    for (const layer_variant& layer : layers_)
      std::visit(
          [&](const auto& l) {
            if constexpr (concepts::supports_crop<std::decay_t<decltype(l)>>)
              depth = std::min(depth, l.rollback_depth());
            else
              depth = 0;
          },
          layer);
    return depth;
  }
  // How many of the tokens given since the last crop the layers of this cache type can always drop
  // exactly, whatever they hold: the minimum of kvc::rollback_bound_v over the layer kinds
  // (kvc::require_rollback).
  static constexpr std::int64_t rollback_bound = [] {
    std::int64_t bound = unbounded_rollback;
    boost::mp11::mp_for_each<boost::mp11::mp_transform<boost::mp11::mp_identity, kinds>>(
        [&](auto k) { bound = std::min(bound, rollback_bound_v<typename decltype(k)::type>); });
    return bound;
  }();

  // Picks batch rows by beam index in every layer that holds data (beam search).
  void reorder_cache(std::span<const std::int64_t> beam_idx) {
    before_access(-1);
    gather_all<false>("reorder_cache",
                      [&](std::int64_t) { return std::vector<std::int64_t>(beam_idx.begin(), beam_idx.end()); });
  }
  // reorder_cache with a braced list of beam indices, e.g. reorder_cache({1, 0}).
  // kvc::IndexError for an index outside a layer's batch, kvc::ValueError for an empty list once a layer holds
  // tokens.
  void reorder_cache(std::initializer_list<std::int64_t> beam_idx) {
    reorder_cache(std::span(beam_idx.begin(), beam_idx.size()));
  }

  // Repeats every batch row `repeats` times in place (row b becomes rows b*repeats ... b*repeats+repeats-1).
  template <int = 0>
  void batch_repeat_interleave(std::int64_t repeats) {
    static_assert(can_batch_ops,
                  "kvc::Cache::batch_repeat_interleave: no layer kind of this cache supports batch operations. Static "
                  "layers keep a fixed batch; use a dynamic cache");
    before_access(-1);
    detail::check_size("batch_repeat_interleave: repeats", repeats, 1, max_batch);
    gather_all<true>("batch_repeat_interleave",
                     [&](std::int64_t batch) { return detail::repeated_rows(batch, repeats); });
  }

  // Keeps only the batch rows named by `indices`, in that order.
  template <int = 0>
  void batch_select_indices(std::span<const std::int64_t> indices) {
    static_assert(can_batch_ops,
                  "kvc::Cache::batch_select_indices: no layer kind of this cache supports batch operations. Static "
                  "layers keep a fixed batch; use a dynamic cache");
    before_access(-1);
    gather_all<true>("batch_select_indices",
                     [&](std::int64_t) { return std::vector<std::int64_t>(indices.begin(), indices.end()); });
  }
  // batch_select_indices with a braced list, e.g. batch_select_indices({2, 0}). kvc::IndexError
  // for an index outside a layer's batch, kvc::ValueError for an empty list once a layer holds
  // tokens, kvc::AttributeError for a layer kind without batch operations.
  template <int = 0>
  void batch_select_indices(std::initializer_list<std::int64_t> indices) {
    batch_select_indices(std::span(indices.begin(), indices.size()));
  }

  // Dynamic layers drop their states (the next update starts afresh); static layers zero their
  // buffers in place and rewind.
  void reset() {
    before_access(-1);
    for_each_layer([](auto& l) { l.reset(); });
  }

  // Room for `tokens` tokens in every layer that grows as it is appended to (DynamicLayer), so
  // that its appends up to that length move nothing: a layer that has a shape moves to a buffer of
  // that many slots now, one without (and, in a replicated cache, each layer made later) takes
  // them at its first update. Other layers stay as they are: a static layer has its room from the
  // start, a sliding layer grows to twice its window. All or nothing: on std::bad_alloc no layer
  // has moved. ValueError for a negative count or one above kvc's limit on a size.
  void reserve(std::int64_t tokens) {
    detail::check_size("kvc::Cache::reserve: tokens", tokens, 0, max_extent);
    before_access(-1);
    std::vector<detail::kv_store<S>> fresh(layers_.size());
    for (std::size_t i = 0; i < layers_.size(); ++i)
      std::visit(
          [&](const auto& l) {
            if constexpr (requires { l.reserved(tokens); }) fresh[i] = l.reserved(tokens);
          },
          layers_[i]);
    // Nothing below throws.
    for (std::size_t i = 0; i < layers_.size(); ++i) apply_reserve(layers_[i], tokens, std::move(fresh[i]));
    reserved_ = std::max(reserved_, tokens);
  }

  // Has every layer that can record its past (dynamic sliding-window and linear-attention layers,
  // hybrids) keep it, so that crop can roll back past the window (transformers'
  // activate_past_recording). Other layers are skipped.
  void activate_past_recording() noexcept {
    for_each_layer([](auto& l) {
      if constexpr (concepts::supports_past_recording<std::decay_t<decltype(l)>>) l.activate_past_recording();
    });
  }

  // Sets every layer's write position (the export path writes at cache_position[0]).
  template <int = 0>
  void set_write_position(std::int64_t position) {
    static_assert(can_set_write_position,
                  "kvc::Cache::set_write_position: no layer kind of this cache has a write position. Only StaticLayer "
                  "has one");
    for_each_layer([&](const auto& l) {
      using St = std::decay_t<decltype(l)>;
      if constexpr (!concepts::supports_write_position<St>) throw_missing_attribute<St>("set_write_position");
    });
    for_each_layer([&](const auto& l) {
      if constexpr (concepts::supports_write_position<std::decay_t<decltype(l)>>) {
        if (position > l.get_max_length())
          throw IndexError("set_write_position: position " + std::to_string(position) +
                           " is out of range for a StaticLayer with max_cache_len " +
                           std::to_string(l.get_max_length()));
      }
    });
    if (position < 0) throw IndexError("set_write_position: position " + std::to_string(position) + " is negative");
    before_access(-1);
    for_each_layer([&](auto& l) {
      if constexpr (concepts::supports_write_position<std::decay_t<decltype(l)>>) l.set_write_position(position);
    });
  }

  // Allocates every layer that supports it now, instead of on its first update: static layers get
  // their buffers; dynamic layers fix their shape. Already initialized layers are left alone.
  void early_initialization(std::int64_t batch_size, detail::int_or_list num_heads, detail::int_or_list head_dim) {
    const auto n = static_cast<std::size_t>(size());
    detail::check_early_initialization(n, batch_size, num_heads, head_dim);
    for (std::size_t i = 0; i < n; ++i) {
      if (num_heads.at(i) < 1 || head_dim.at(i) < 1)
        throw ValueError("early_initialization: layer " + std::to_string(i) +
                         " needs a positive number of heads and head_dim, got num_heads " +
                         std::to_string(num_heads.at(i)) + " and head_dim " + std::to_string(head_dim.at(i)));
      // The layer must at least be able to hold one token (a dynamic layer allocates nothing now).
      (void)detail::checked_elements({batch_size, num_heads.at(i), 1, head_dim.at(i)}, sizeof(element_type));
    }
    before_access(-1);
    std::vector<std::pair<std::size_t, layer_variant>> prepared;
    for (std::size_t i = 0; i < n; ++i) {
      std::visit(
          [&](const auto& l) {
            using St = std::decay_t<decltype(l)>;
            if constexpr (St::supports_early_init) {
              if (!l.is_initialized()) {
                St fresh = l;
                fresh.lazy_initialization({batch_size, num_heads.at(i), head_dim.at(i), head_dim.at(i)});
                prepared.emplace_back(i, std::move(fresh));
              }
            }
          },
          layers_[i]);
    }
    for (auto& [i, layer] : prepared) layers_[i] = std::move(layer);
  }

  // ---- linear-attention states and indexer keys -----------------------------------------------

  // Stores the conv states ([batch, channels, time]) of state `state_idx` of linear-attention layer
  // `layer_idx` and returns them with their left context (docs/caches.md, "Linear attention").
  // `conv_kernel_size` 0 takes the kernel size from the first input's time axis.
  template <class X>
  typename S::state_view_type update_conv_state(const X& conv_states, std::int64_t layer_idx,
                                                std::int64_t state_idx = 0, std::int64_t conv_kernel_size = 0) {
    const auto x = state_input<X>(conv_states);
    return with_linear_layer(layer_idx, "update_conv_state",
                             [&](auto& l) { return l.update_conv_state(x, state_idx, conv_kernel_size); });
  }

  // Overwrites the recurrent state `state_idx` of linear-attention layer `layer_idx` and returns it.
  template <class X>
  typename S::state_view_type update_recurrent_state(const X& recurrent_states, std::int64_t layer_idx,
                                                     std::int64_t state_idx = 0) {
    const auto x = state_input<X>(recurrent_states);
    return with_linear_layer(layer_idx, "update_recurrent_state",
                             [&](auto& l) { return l.update_recurrent_state(x, state_idx); });
  }

  // Whether the linear-attention layer has seen a conv update (all states, or state `state_idx`).
  // No layer index: the last linear-attention layer. False past the last layer.
  bool has_previous_state(std::optional<std::int64_t> layer_idx = std::nullopt,
                          std::optional<std::int64_t> state_idx = std::nullopt) const {
    const std::int64_t idx =
        detail::previous_state_layer(layer_idx, size(), [&](std::int64_t i) { return layer_has_linear(i); });
    if (idx < 0) return false;
    if (state_idx && *state_idx < 0)
      throw KeyError("has_previous_state: state_idx " + std::to_string(*state_idx) + " is negative");
    return visit_layer(idx, [&](const auto& l) {
      if constexpr (has_linear<std::decay_t<decltype(l)>>)
        return bool(l.has_previous_state(state_idx.value_or(-1)));
      else
        return false;  // unreachable: checked above
    });
  }

  // Appends indexer keys ([batch, seq, index_head_dim]) to indexed layer `layer_idx` and returns
  // what the layer holds (DynamicIndexedLayer, StaticIndexedLayer).
  template <class X>
  typename S::state_view_type update_indexer(const X& indexer_key_states, std::int64_t layer_idx) {
    const auto x = state_input<X>(indexer_key_states);
    check_existing(layer_idx, "update_indexer");
    before_access(layer_idx);
    return visit_layer(layer_idx, [&](auto& l) -> typename S::state_view_type {
      using St = std::decay_t<decltype(l)>;
      if constexpr (requires { l.update_indexer(x); }) {
        return l.update_indexer(x);
      } else {
        throw ValueError("Cannot call `update_indexer` on layer " + std::to_string(layer_idx) + " which is a " +
                         std::string(St::name) +
                         "; it has no indexer key cache (expected a `DynamicIndexedLayer` or `StaticIndexedLayer`).");
      }
    });
  }

  // Per layer: whether it is a pure linear-attention layer (conv/recurrent states, no K/V).
  // Hybrids hold K/V and are not (offloading moves both of their parts).
  std::vector<bool> is_linear() const {
    std::vector<bool> out;
    out.reserve(layers_.size());
    for_each_layer([&](const auto& l) { out.push_back(!has_kv<std::decay_t<decltype(l)>>); });
    return out;
  }

  // Brings layer `layer_idx` (-1: every layer) back from an offload tier, so that visit_layer sees
  // its data. Cache methods do this themselves; a no-op without offloading.
  void make_resident(std::int64_t layer_idx = -1) { before_access(layer_idx); }

  // ---- properties ----------------------------------------------------------------------------

  // The number of layers (for a replicated cache, those made so far).
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(layers_.size()); }

  // Per layer: whether it is a sliding-window layer (transformers' Cache.is_sliding).
  std::vector<bool> is_sliding() const {
    std::vector<bool> out;
    out.reserve(layers_.size());
    for_each_layer([&](const auto& l) { out.push_back(std::decay_t<decltype(l)>::is_sliding); });
    return out;
  }

  // Whether layer `layer_idx` is a sliding layer (false past the last layer), without building
  // the whole list: attention asks this once per layer and step.
  bool is_sliding(std::int64_t layer_idx) const {
    check_index(layer_idx, "is_sliding");
    if (layer_idx >= size()) return false;
    return visit_layer(layer_idx, [](const auto& l) { return std::decay_t<decltype(l)>::is_sliding; });
  }

  // Whether every layer kind is compileable (fixed-shape buffers, as transformers' is_compileable);
  // false for a cache with no layers.
  bool is_compileable() const noexcept {
    bool all = !layers_.empty();
    for_each_layer([&](const auto& l) { all = all && std::decay_t<decltype(l)>::is_compileable; });
    return all;
  }

  // transformers: whether there is a layer that supports early initialization and every such layer
  // is initialized (linear-attention layers and hybrids are not asked).
  bool is_initialized() const noexcept {
    bool any = false, all = true;
    for_each_layer([&](const auto& l) {
      if constexpr (std::decay_t<decltype(l)>::supports_early_init) {
        any = true;
        all = all && l.is_initialized();
      }
    });
    return any && all;
  }

  // The batch size shared by the initialized layers, -1 when none is initialized.
  std::int64_t batch_size() const {
    std::vector<std::int64_t> values;
    for_each_layer([&](const auto& l) {
      if constexpr (has_kv<std::decay_t<decltype(l)>>)
        if (l.is_initialized()) values.push_back(l.shape().batch);
    });
    if (values.empty()) return -1;
    if (std::set<std::int64_t>(values.begin(), values.end()).size() > 1)
      throw ValueError("The batch size is not consistent across layers: " + detail::py_list(values));
    return values.front();
  }

  // What layer `layer_idx` holds (transformers' layer.keys / layer.values); empty if uninitialized.
  kv_type stored(std::int64_t layer_idx) const {
    check_existing(layer_idx, "stored");
    before_access(layer_idx);
    return visit_layer(layer_idx, [](const auto& l) -> kv_type {
      using St = std::decay_t<decltype(l)>;
      if constexpr (has_kv<St>)
        return l.stored();
      else
        throw_missing_attribute<St>("keys");
    });
  }

  // The layer's kind name, e.g. "DynamicSlidingWindowLayer".
  std::string_view layer_name(std::int64_t layer_idx) const {
    check_existing(layer_idx, "layer_name");
    return visit_layer(layer_idx, [](const auto& l) { return std::string_view(std::decay_t<decltype(l)>::name); });
  }

  // Bytes of K/V memory the layers hold (allocated capacity, not only the tokens in use).
  std::int64_t bytes() const noexcept {
    std::int64_t total = 0;
    for_each_layer([&](const auto& l) { total += l.bytes(); });
    return total;
  }

  // Calls f with layer `layer_idx`'s state (its concrete type), for offload engines and tests.
  template <class F>
  decltype(auto) visit_layer(std::int64_t layer_idx, F&& f) const {
    check_existing(layer_idx, "visit_layer");
    return std::visit(std::forward<F>(f), layers_[static_cast<std::size_t>(layer_idx)]);
  }
  // Mutable access, for offload engines (they move a layer's buffers between memory tiers). A
  // caller that changes a layer through this takes over the cache's invariants.
  template <class F>
  decltype(auto) visit_layer(std::int64_t layer_idx, F&& f) {
    check_existing(layer_idx, "visit_layer");
    return std::visit(std::forward<F>(f), layers_[static_cast<std::size_t>(layer_idx)]);
  }

  // ---- saved state (kvc::save, kvc::load, kvc::StateLoader: <kvc/state.hpp>) --------------------
  // The payload: the cache type ("Cache"), the element type, the layer count, then each layer's
  // kind name and its own transfer. With a writing archive (A::loading false) the cache is read.
  template <class A>
    requires(!A::loading)
  void transfer(A& ar) const {
    before_access(-1);  // every layer resident (an offload engine keeps nothing away afterwards)
    detail::state_header<S>(ar, "Cache");
    ar.value(static_cast<std::int64_t>(layers_.size()));
    for (const layer_variant& layer : layers_)
      std::visit(
          [&](const auto& l) {
            ar.text(l.name);
            detail::transfer(ar, l);
          },
          layer);
  }
  // With a reading archive the layers are built aside, each checked against the cache's layer (its
  // kind, parameters and, where both are initialized, shape), and returned: commit() swaps them in
  // and cannot throw; dropping them leaves the cache as it was.
  template <class A>
    requires A::loading
  [[nodiscard]] auto transfer(A& ar) {
    before_access(-1);  // before the swap: the offload engine then holds nothing away
    const std::int64_t n = transfer_header(ar);
    loaded_layers out{this, {}};  // grows as layers arrive: n is the file's word
    for (std::int64_t i = 0; i < n; ++i) out.layers.push_back(read_layer(ar, i));
    return out;
  }
  // What transfer returns with a reading archive: the layers read and checked, held aside until
  // commit() swaps them into the cache; dropping it leaves the cache as it was.
  struct loaded_layers {
    // The cache that commit() puts the layers into.
    Cache* target;
    // The layers read from the archive, in order.
    std::vector<layer_variant> layers;
    // Swaps the read layers into the target cache (its old layers end up here); cannot throw.
    void commit() noexcept { target->layers_.swap(layers); }
  };

  // One layer at a time (kvc::StateLoader): transfer_header reads the header and returns the
  // layer count (checked against the cache); transfer_layer(ar, i) reads layer i and puts it in
  // the cache (strong guarantee: only a failure before the swap can throw); transfer_end(n) drops
  // the layers past the file's n (a replicated cache loaded from fewer layers).
  template <class A>
  std::int64_t transfer_header(A& ar) const {
    detail::state_header<S>(ar, "Cache");
    const std::int64_t n = ar.size("the layer count");
    if (n > max_layers)
      ar.fail("the file has " + std::to_string(n) + " layers, above kvc's limit of " + std::to_string(max_layers));
    if (!replicated && n != size())
      ar.fail("the file has " + std::to_string(n) + " layers and the cache " + std::to_string(size()));
    return n;
  }
  // Reads layer i from `ar` and puts it in the cache (a replicated cache grows to hold it);
  // kvc::StateError for a layer that does not match the cache's, which is then left as it was.
  template <class A>
  void transfer_layer(A& ar, std::int64_t i) {
    layer_variant layer = read_layer(ar, i);
    before_access(-1);
    const auto idx = static_cast<std::size_t>(i);
    if (idx >= layers_.size()) {
      if constexpr (replicated) {
        // (geometric: loading n layers one by one moves each layer O(1) times on average)
        if (layers_.capacity() <= idx) layers_.reserve(std::max(idx + 1, 2 * layers_.capacity()));
        while (layers_.size() < idx) layers_.emplace_back(std::in_place_index<0>, prototype_);
        layers_.push_back(std::move(layer));
        return;
      }
    }
    layers_[idx].swap(layer);
  }
  // Drops the layers past the first `n` (a replicated cache loaded from a file with fewer layers).
  void transfer_end(std::int64_t n) noexcept {
    if (static_cast<std::size_t>(n) < layers_.size())
      layers_.erase(layers_.begin() + static_cast<std::ptrdiff_t>(n), layers_.end());
  }

 private:
  // Layer i of the stream, built aside as the cache's layer i (or its prototype's copy) would be.
  template <class A>
  layer_variant read_layer(A& ar, std::int64_t i) const {
    const auto idx = static_cast<std::size_t>(i);
    ar.set_context("layer " + std::to_string(i));
    const std::string name = ar.text();
    const auto build = [&](const auto& target) -> layer_variant {
      using St = std::decay_t<decltype(target)>;
      if (name != St::name) ar.fail(detail::join_message({"the file holds a ", name, " and the cache a ", St::name}));
      ar.set_context(detail::join_message({"layer ", std::to_string(i), " (", St::name, ")"}));
      St fresh(target.kind());
      try {
        fresh.transfer(ar);
      } catch (const ValueError& e) {  // a layer kind's own size checks: the file is at fault
        ar.fail(e.what());
      }
      if constexpr (requires { target.shape(); }) {
        if (target.is_initialized() && fresh.is_initialized() && !(target.shape() == fresh.shape()))
          ar.fail(detail::join_message({"the file holds ", detail::shape_words(fresh.shape()), ", and the cache ",
                                        detail::shape_words(target.shape())}));
      }
      return layer_variant(std::in_place_type<St>, std::move(fresh));
    };
    if constexpr (replicated) {
      using St = state_of<boost::mp11::mp_front<kinds>>;
      if (idx < layers_.size()) return std::visit(build, layers_[idx]);
      return build(St(prototype_));
    } else {
      return std::visit(build, layers_[idx]);
    }
  }

  template <class St>
  [[noreturn]] static void throw_missing_attribute(const char* method) {
    throw AttributeError("'" + std::string(St::name) + "' object has no attribute '" + method + "'");
  }

  // The offload engine's optional hook: bring layer idx (-1: all) back before a non-update access.
  // Const, because where a layer's bytes live is not observable state: a const method such as
  // stored() brings the layer back too (the engine is mutable for that).
  void before_access(std::int64_t idx) const {
    auto& self = const_cast<Cache&>(*this);
    if constexpr (concepts::has_access_hook<decltype(offload_), Cache>) offload_.before_access(self, idx);
  }

  template <class X>
  static typename S::state_view_type state_input(const X& x) {
    return detail::checked_state_view<S>(x, "kvc::Cache");
  }

  bool layer_has_linear(std::int64_t idx) const {
    return std::visit([](const auto& l) { return has_linear<std::decay_t<decltype(l)>>; },
                      layers_[static_cast<std::size_t>(idx)]);
  }
  bool layer_has_kv(std::int64_t idx) const {
    return std::visit([](const auto& l) { return has_kv<std::decay_t<decltype(l)>>; },
                      layers_[static_cast<std::size_t>(idx)]);
  }

  // The layer that answers a length query asked of `idx`: itself, unless it is a pure
  // linear-attention layer (then index 0 redirects to the first attention layer).
  std::int64_t attention_layer_for(const char* method, std::int64_t idx) const {
    return detail::attention_layer_for(method, idx, size(), [&](std::int64_t i) { return layer_has_kv(i); });
  }

  template <class F>
  typename S::state_view_type with_linear_layer(std::int64_t layer_idx, const char* method, F&& f) {
    check_existing(layer_idx, method);
    before_access(layer_idx);  // a hybrid's buffers may be offloaded
    return visit_layer(layer_idx, [&](auto& l) -> typename S::state_view_type {
      if constexpr (has_linear<std::decay_t<decltype(l)>>)
        return f(l);
      else
        throw ValueError("Cannot call `" + std::string(method) + "` on a non-LinearAttention layer!");
    });
  }

  // The batch size of a layer's data, -1 when it holds none.
  template <class St>
  static std::int64_t batch_of(const St& l) {
    if constexpr (has_linear<St> || requires {
                    { l.batch() } -> std::convertible_to<std::int64_t>;
                  })
      return l.batch();
    else
      return l.is_initialized() ? l.shape().batch : -1;
  }

  template <class F>
  void for_each_layer(F&& f) {
    for (auto& layer : layers_) std::visit(f, layer);
  }
  template <class F>
  void for_each_layer(F&& f) const {
    for (const auto& layer : layers_) std::visit(f, layer);
  }

  static void check_index(std::int64_t layer_idx, const char* method) {
    if (layer_idx < 0)
      throw IndexError(std::string(method) + ": layer_idx " + std::to_string(layer_idx) +
                       " is out of range: layer indices start at 0");
  }
  void check_existing(std::int64_t layer_idx, const char* method) const {
    check_index(layer_idx, method);
    if (layer_idx >= size())
      throw IndexError(std::string(method) + ": layer_idx " + std::to_string(layer_idx) +
                       " is out of range for a Cache with " + std::to_string(size()) + " layers");
  }

  // Messages are built only on the throwing paths: this runs on every update.
  static std::string shapes_of(const view_type& k, const view_type& v) {
    return "update: keys of shape " + shape_string(k.extents) + " and values of shape " + shape_string(v.extents);
  }
  static void check_input(const view_type& k, const view_type& v) {
    if (k.extent(0) != v.extent(0) || k.extent(1) != v.extent(1) || k.extent(2) != v.extent(2))
      throw ValueError(shapes_of(k, v) + " must have the same batch, heads and seq dimensions");
    if (k.extent(0) < 1 || k.extent(1) < 1 || k.extent(2) < 0 || k.extent(3) < 1 || v.extent(3) < 1)
      throw ValueError(shapes_of(k, v) + ": batch, heads and head_dim must be positive");
    // A view describes memory its owner allocated: one whose size overflows is a bad view, and one
    // larger than a buffer kvc would allocate could not be stored (the layer's buffer holds at least
    // the view): both are refused here, so that no size computed from a view can overflow.
    for (const view_type* t : {&k, &v}) {
      std::int64_t n = 1;
      for (int r = 0; r < 4; ++r)
        if (t->extent(r) > max_extent || !detail::mul_fits(n, t->extent(r), n))
          throw ValueError(shapes_of(k, v) + ": a dimension is above kvc's limit of " + std::to_string(max_extent) +
                           " or their product overflows");
      (void)detail::checked_elements({t->extent(0), t->extent(1), t->extent(2), t->extent(3)}, sizeof(element_type));
    }
    for (const view_type* t : {&k, &v})
      if (t->stride(3) != 1 || t->stride(2) != t->extent(3) || t->stride(1) < t->extent(2) * t->extent(3))
        throw ValueError("update: keys and values must have contiguous [seq, head_dim] blocks, got strides [" +
                         std::to_string(t->stride(0)) + ", " + std::to_string(t->stride(1)) + ", " +
                         std::to_string(t->stride(2)) + ", " + std::to_string(t->stride(3)) + "]");
  }

  kv_type update_views(const view_type& k, const view_type& v, std::int64_t layer_idx) {
    return store_views<kv_type>(k, v, layer_idx, [&](auto& l) -> kv_type {
      if constexpr (has_kv<std::decay_t<decltype(l)>>)
        return l.update(k, v);
      else
        return {};  // unreachable: store_views refuses such a layer first
    });
  }

  template <class R, class Op>
  R store_views(const view_type& k, const view_type& v, std::int64_t layer_idx, Op&& op) {
    check_index(layer_idx, "update");
    check_input(k, v);
    const std::size_t old_size = layers_.size();
    const auto idx = static_cast<std::size_t>(layer_idx);
    if (idx >= old_size) {
      if constexpr (replicated) {
        if (layer_idx >= max_layers)
          throw IndexError("update: layer_idx " + std::to_string(layer_idx) + " is above kvc's limit of " +
                           std::to_string(max_layers) + " layers");
        layers_.reserve(idx + 1);  // the only allocation; the emplaces below cannot throw
        while (layers_.size() <= idx) {
          layers_.emplace_back(std::in_place_index<0>, prototype_);
          apply_reserve(layers_.back(), reserved_, {});
        }
      } else {
        throw IndexError("update: layer_idx " + std::to_string(layer_idx) + " is out of range for a Cache with " +
                         std::to_string(old_size) + " layers");
      }
    }
    try {
      const LayerShape given = detail::shape_of(k, v);
      std::visit(
          [&](const auto& l) {
            using St = std::decay_t<decltype(l)>;
            if constexpr (!has_kv<St>) {
              throw_missing_attribute<St>("update");
            } else if (l.is_initialized() && !(l.shape() == given)) {
              const LayerShape s = l.shape();
              throw ValueError(shapes_of(k, v) + " do not match layer " + std::to_string(layer_idx) +
                               ", which holds batch " + std::to_string(s.batch) + ", " + std::to_string(s.heads) +
                               " heads, key head_dim " + std::to_string(s.key_head_dim) + " and value head_dim " +
                               std::to_string(s.value_head_dim));
            }
          },
          layers_[idx]);
      offload_.before_update(*this, layer_idx);
      R out = std::visit([&](auto& l) -> R { return op(l); }, layers_[idx]);
      offload_.after_update(*this, layer_idx);
      return out;
    } catch (...) {
      layers_.erase(layers_.begin() + static_cast<std::ptrdiff_t>(old_size), layers_.end());
      throw;
    }
  }

  // Replaces every initialized layer by a copy gathered along the batch axis (strong guarantee:
  // the new layers are built aside and swapped in at the end).
  template <bool BatchOp, class MakeIndices>
  void gather_all(const char* method, MakeIndices&& make_indices) {
    std::vector<layer_variant> next;
    next.reserve(layers_.size());
    for (const auto& layer : layers_) {
      std::visit(
          [&](const auto& l) {
            using St = std::decay_t<decltype(l)>;
            if constexpr (BatchOp && !concepts::supports_batch_ops<St>) {
              throw_missing_attribute<St>(method);
            } else {
              const std::int64_t batch = batch_of(l);
              if (batch < 0) {
                next.emplace_back(l);
                return;
              }
              const std::vector<std::int64_t> indices = make_indices(batch);
              for (const std::int64_t i : indices)
                if (i < 0 || i >= batch)
                  throw IndexError(std::string(method) + ": index " + std::to_string(i) +
                                   " is out of bounds for dimension 0 with size " + std::to_string(batch));
              if (indices.empty()) throw ValueError(std::string(method) + ": the batch cannot become empty");
              next.emplace_back(l.gathered(indices));
            }
          },
          layer);
    }
    layers_.swap(next);
  }

  // reserve's commit on one layer (what it does nothing to: any kind but those that grow).
  static void apply_reserve(layer_variant& layer, std::int64_t tokens, detail::kv_store<S>&& fresh) noexcept {
    std::visit(
        [&](auto& l) {
          if constexpr (requires { l.reserved(tokens); }) l.reserve(tokens, std::move(fresh));
        },
        layer);
  }

  // mutable only for before_access: an offload engine brings layers back from a const method.
  mutable std::vector<layer_variant> layers_;
  std::int64_t reserved_ = 0;  // reserve's largest count, for the layers a replicated cache makes later
  [[no_unique_address]] std::conditional_t<replicated, boost::mp11::mp_front<kinds>, std::monostate> prototype_{};
  [[no_unique_address]] mutable typename O::template engine<S> offload_{};
};

// Fails to compile unless every layer kind of the cache's type can always drop exactly the last N
// tokens it was given since its last crop (N <= C::rollback_bound): a speculative decoder that
// verifies N draft tokens states what it needs once, where the cache type is chosen
// (docs/rollback.md). At run time, cache.rollback_depth() says how far the cache can roll back now.
template <std::int64_t N, class C>
constexpr void require_rollback(const C&) noexcept {
  static_assert(N >= 0, "kvc::require_rollback<N>: N counts tokens and cannot be negative");
  static_assert(N <= C::rollback_bound,
                "kvc::require_rollback<N>: a layer kind of this cache cannot always roll back N tokens exactly "
                "(its kvc::rollback_bound_v is smaller). Use kvc::SpeculativeSlidingWindowLayer<N> for sliding "
                "layers and kvc::SpeculativeLinearAttentionLayer<N> for linear-attention layers; static layers "
                "cannot crop; a quantized layer's or a hybrid's depth depends on what it holds: check "
                "cache.rollback_depth() at run time");
}

}  // namespace kvc

#pragma once
// kvc::EncoderDecoderCache<SelfCache, CrossCache>: the decoder's self-attention cache and the
// cross-attention cache over the encoder's output, side by side (transformers'
// EncoderDecoderCache in src/transformers/cache_utils.py at a597f974). Usage and the
// differences from transformers: docs/encoder_decoder.md.
//
// Like transformers, the pair is not itself a Cache: the model updates each half through
// self_attention_cache() / cross_attention_cache(). The length queries answer for the
// self-attention cache; reset and reorder_cache act on both; crop acts on the self-attention
// cache only; the batch operations act on both. crop and the batch operations need both halves
// to be dynamic caches (kvc::TypeError otherwise, transformers' message).
//
// kvc::cache_repr and the cache traits it shares with AnyCache are in <kvc/cache_traits.hpp>.

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

#include <kvc/cache.hpp>
#include <kvc/cache_traits.hpp>
#include <kvc/caches.hpp>
#include <kvc/errors.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

template <class SelfCache, class CrossCache>
class EncoderDecoderCache;

// Reached only when an argument is not a cache (transformers' TypeError "One of the two
// arguments is not a Cache", docs/errors.md).
template <class SelfCache, class CrossCache>
class EncoderDecoderCache {
  static_assert(detail::is_cache_v<SelfCache> && detail::is_cache_v<CrossCache>,
                "kvc::EncoderDecoderCache: One of the two arguments is not a Cache. SelfCache and CrossCache must "
                "each be a kvc::Cache instantiation or a class derived from one, such as kvc::DynamicCache or "
                "kvc::StaticCache");

 public:
  // Accepts any arguments, so that the misuse reports only the assert above.
  template <class... Args>
  explicit EncoderDecoderCache(Args&&...) {}
};

// The decoder's self-attention cache and the cross-attention cache over the encoder's output, as
// one object with transformers' EncoderDecoderCache methods (both halves are kvc caches).
template <class SelfCache, class CrossCache>
  requires(detail::is_cache_v<SelfCache> && detail::is_cache_v<CrossCache>)
class EncoderDecoderCache<SelfCache, CrossCache> {
 public:
  // The type of the decoder's self-attention half.
  using self_attention_cache_type = SelfCache;
  // The type of the cross-attention half (the encoder's keys and values).
  using cross_attention_cache_type = CrossCache;
  // The self-attention cache's element type.
  using element_type = typename detail::cache_element<SelfCache>::type;
  // Whether crop and the batch operations are defined (both halves dynamic).
  static constexpr bool is_dynamic = detail::is_dynamic_cache_v<SelfCache> && detail::is_dynamic_cache_v<CrossCache>;

 private:
  template <class C>
  static constexpr bool from_data = [] {
    if constexpr (detail::type_erased_cache<C>) {
      return false;
    } else if constexpr (!C::storage_policy::template accepts_input<HostTensor<typename C::element_type>>) {
      return false;
    } else if constexpr (C::replicated) {
      return std::is_same_v<boost::mp11::mp_front<typename C::kinds>, DynamicLayer> && std::default_initializable<C>;
    } else {
      return boost::mp11::mp_contains<typename C::kinds, DynamicLayer>::value &&
             boost::mp11::mp_contains<typename C::kinds, DynamicSlidingWindowLayer>::value &&
             std::is_constructible_v<C, std::vector<typename C::kind_variant>>;
    }
  }();

 public:
  // Whether the runtime-data constructor exists.
  static constexpr bool constructible_from_data =
      from_data<SelfCache> && from_data<CrossCache> &&
      std::is_same_v<typename detail::cache_element<SelfCache>::type, typename detail::cache_element<CrossCache>::type>;

  // Copies are deep; a copy assignment that throws leaves both halves as they were (member by
  // member, a failed copy of the cross-attention half would leave the new self-attention half).
  EncoderDecoderCache(const EncoderDecoderCache&) = default;
  // Moves both halves and the is_updated record.
  EncoderDecoderCache(EncoderDecoderCache&&) = default;
  // Deep copy assignment with the strong guarantee (copies aside, then moves in); returns *this.
  // Throws what copying a half throws (std::bad_alloc).
  EncoderDecoderCache& operator=(const EncoderDecoderCache& other)
    requires(std::is_copy_constructible_v<SelfCache> && std::is_copy_constructible_v<CrossCache>)
  {
    if (this != &other) {
      EncoderDecoderCache copy(other);
      *this = std::move(copy);
    }
    return *this;
  }
  // Move assignment of both halves and the is_updated record; returns *this.
  EncoderDecoderCache& operator=(EncoderDecoderCache&&) = default;

  // Two empty caches (an extension: transformers always takes the two caches).
  EncoderDecoderCache()
    requires(std::default_initializable<SelfCache> && std::default_initializable<CrossCache>)
      : EncoderDecoderCache(SelfCache(), CrossCache()) {}

  // transformers' EncoderDecoderCache(self_attention_cache, cross_attention_cache). A layer of the
  // cross-attention cache that already holds tokens counts as updated.
  EncoderDecoderCache(SelfCache self_attention_cache, CrossCache cross_attention_cache)
      : self_(std::move(self_attention_cache)), cross_(std::move(cross_attention_cache)) {
    if constexpr (detail::type_erased_cache<CrossCache>)
      if (!cross_.has_value()) return;  // an empty kvc::AnyCache: nothing to record yet
    for (std::int64_t i = 0; i < cross_.size(); ++i) is_updated_[i] = cross_.get_seq_length(i) > 0;
  }

  // transformers' EncoderDecoderCache(combined_cache_data): one entry per layer, either
  // {self_k, self_v, cross_k, cross_v} or {self_k, self_v, self_window, cross_k, cross_v,
  // cross_window}. A window tensor's first element is the layer's sliding window (an empty tensor
  // means none); a windowed layer needs a cache type with DynamicSlidingWindowLayer, such as
  // kvc::ConfiguredDynamicCache. Each half is filled by one update per layer, as
  // DynamicCache(ddp_cache_data) does.
  explicit EncoderDecoderCache(const std::vector<std::vector<HostTensor<element_type>>>& combined_cache_data)
    requires constructible_from_data
      : EncoderDecoderCache(split(combined_cache_data)) {}

  // ---- the two halves --------------------------------------------------------------------------

  // The decoder's self-attention cache, for the model to update.
  SelfCache& self_attention_cache() noexcept { return self_; }
  // The decoder's self-attention cache (read-only).
  const SelfCache& self_attention_cache() const noexcept { return self_; }
  // The cross-attention cache over the encoder's output, for the model to update.
  CrossCache& cross_attention_cache() noexcept { return cross_; }
  // The cross-attention cache over the encoder's output (read-only).
  const CrossCache& cross_attention_cache() const noexcept { return cross_; }

  // Whether the cross-attention cache of layer `layer_idx` is filled (models compute the encoder's
  // keys/values once, then skip the update). False for a layer never recorded (dict.get).
  bool is_updated(std::int64_t layer_idx) const {
    const auto it = is_updated_.find(layer_idx);
    return it != is_updated_.end() && it->second;
  }
  // The whole record, as transformers' `is_updated` dict.
  const std::map<std::int64_t, bool>& is_updated() const noexcept { return is_updated_; }
  // transformers' `is_updated[layer_idx] = True`, done by the model after filling the layer.
  void set_is_updated(std::int64_t layer_idx, bool updated = true) {
    if (layer_idx < 0)
      throw IndexError(detail::join_message(
          {"set_is_updated: layer_idx ", std::to_string(layer_idx), " is out of range: layer indices start at 0"}));
    is_updated_[layer_idx] = updated;
  }

  // ---- the self-attention cache answers ---------------------------------------------------------

  // The number of layers of the self-attention cache.
  std::int64_t size() const noexcept { return self_.size(); }
  // The number of tokens the self-attention cache holds at layer `layer_idx`; throws what its
  // get_seq_length throws (IndexError for a negative index, ValueError for a linear layer).
  std::int64_t get_seq_length(std::int64_t layer_idx = 0) const { return self_.get_seq_length(layer_idx); }
  // Where the query of layer `layer_idx` starts in the self-attention cache; throws as
  // get_seq_length.
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const { return self_.get_query_offset(layer_idx); }
  // The self-attention cache's largest returnable length (-1: unbounded); ValueError when it has
  // no layers yet.
  std::int64_t get_max_length() const { return self_.get_max_length(); }
  // The self-attention cache's returnable length at layer `layer_idx` (-1: unbounded or past the
  // last layer); IndexError for a negative index.
  std::int64_t get_max_length(std::int64_t layer_idx) const { return self_.get_max_length(layer_idx); }
  // (kv_length, kv_offset) of the self-attention cache for a query of `query_length` tokens at
  // layer `layer_idx`; IndexError for a negative index, ValueError for a bad length.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t query_length, std::int64_t layer_idx) const {
    return self_.get_mask_sizes(query_length, layer_idx);
  }
  // Per layer of the self-attention cache: whether it is a sliding-window layer.
  std::vector<bool> is_sliding() const { return self_.is_sliding(); }
  // Whether self-attention layer `layer_idx` is a sliding layer (false past the last layer);
  // IndexError for a negative index.
  bool is_sliding(std::int64_t layer_idx) const { return self_.is_sliding(layer_idx); }
  // Whether the self-attention cache is compileable (has layers, all of a compileable kind).
  bool is_compileable() const noexcept { return self_.is_compileable(); }
  // Turns on past-state recording in the self-attention cache.
  void activate_past_recording() noexcept { self_.activate_past_recording(); }

  // ---- both caches -------------------------------------------------------------------------------

  // Resets both caches; no layer counts as updated afterwards. Both are brought back from their
  // offload tiers first, the one step that can fail (I/O): a failure there leaves both as they
  // were, and resetting layers in memory cannot fail.
  void reset() {
    self_.make_resident();
    cross_.make_resident();
    self_.reset();
    cross_.reset();
    for (auto& entry : is_updated_) entry.second = false;
  }

  // Picks batch rows by beam index in both caches.
  void reorder_cache(std::span<const std::int64_t> beam_idx) {
    on_both([&](auto& c) { c.reorder_cache(beam_idx); });
  }
  // reorder_cache for a braced list of beam indices: IndexError for an index out of bounds,
  // ValueError for an empty list.
  void reorder_cache(std::initializer_list<std::int64_t> beam_idx) {
    reorder_cache(std::span(beam_idx.begin(), beam_idx.size()));
  }

  // Removes tokens from the self-attention cache only (the encoder's keys do not change).
  void crop(std::int64_t tokens_to_remove) {
    check_dynamic_cache("crop");
    if constexpr (is_dynamic) self_.crop(tokens_to_remove);
  }

  // Repeats every batch row `repeats` times in both caches. TypeError unless both halves are
  // dynamic caches; ValueError for repeats < 1.
  void batch_repeat_interleave(std::int64_t repeats) {
    check_dynamic_cache("batch_repeat_interleave");
    if constexpr (is_dynamic) on_both([&](auto& c) { c.batch_repeat_interleave(repeats); });
  }

  // Keeps only the batch rows named by `indices`, in that order, in both caches. TypeError unless
  // both are dynamic; IndexError for an index out of bounds, ValueError for an empty list.
  void batch_select_indices(std::span<const std::int64_t> indices) {
    check_dynamic_cache("batch_select_indices");
    if constexpr (is_dynamic) on_both([&](auto& c) { c.batch_select_indices(indices); });
  }
  // batch_select_indices for a braced list of rows; throws as the span overload.
  void batch_select_indices(std::initializer_list<std::int64_t> indices) {
    batch_select_indices(std::span(indices.begin(), indices.size()));
  }

  // transformers' check_dynamic_cache: TypeError unless both halves are dynamic caches.
  void check_dynamic_cache(std::string_view method) const {
    if (!is_dynamic || !dynamic_now(self_) || !dynamic_now(cross_))
      throw TypeError(detail::join_message({"`", method, "` is only defined for dynamic cache, got ", cache_repr(self_),
                                            " for the self attention cache and ", cache_repr(cross_),
                                            " for the cross attention cache."}));
  }

  // ---- saved state (kvc::save, kvc::load: <kvc/state.hpp>) ----------------------------------------
  // The payload: "EncoderDecoderCache", both halves' (Cache::transfer), then is_updated. Reading
  // builds all of it aside; commit() swaps it in and cannot throw.
  template <class A>
    requires(!A::loading)
  void transfer(A& ar) const {
    detail::same_text(ar, "the cache type", "EncoderDecoderCache");
    self_.transfer(ar);
    cross_.transfer(ar);
    ar.value(static_cast<std::int64_t>(is_updated_.size()));
    for (const auto& [layer, updated] : is_updated_) {
      ar.value(layer);
      ar.value(updated);
    }
  }
  // With a reading archive: reads both halves and is_updated aside and returns them; their
  // commit() swaps them in and cannot throw. kvc::StateError when the payload does not match.
  template <class A>
    requires A::loading
  [[nodiscard]] auto transfer(A& ar) {
    ar.set_context("");
    detail::same_text(ar, "the cache type", "EncoderDecoderCache");
    auto self = self_.transfer(ar);
    auto cross = cross_.transfer(ar);
    ar.set_context("is_updated");
    const std::int64_t n = ar.size("the is_updated count");
    if (n > max_layers) ar.fail("more entries than kvc's limit of layers");
    std::map<std::int64_t, bool> updated;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t layer = ar.size("a layer index");
      bool u = false;
      ar.value(u);
      updated[layer] = u;
    }
    struct loaded {
      decltype(self) s;
      decltype(cross) x;
      EncoderDecoderCache* target;
      std::map<std::int64_t, bool> updated;
      void commit() noexcept {
        s.commit();
        x.commit();
        target->is_updated_.swap(updated);
      }
    };
    return loaded{std::move(self), std::move(cross), this, std::move(updated)};
  }

 private:
  // A type-erased half answers at run time; a typed one was decided at compile time.
  template <class C>
  static bool dynamic_now(const C& c) {
    if constexpr (detail::type_erased_cache<C>)
      return c.is_dynamic_cache();
    else
      return detail::is_dynamic_cache_v<C>;
  }

 public:
 private:
  struct halves {
    SelfCache self;
    CrossCache cross;
  };
  explicit EncoderDecoderCache(halves h) : EncoderDecoderCache(std::move(h.self), std::move(h.cross)) {}

  using tensor = HostTensor<element_type>;
  struct layer_data {
    const tensor* keys;
    const tensor* values;
    const tensor* window;  // nullptr or empty: no sliding window
  };

  // Python's repr of one entry, with each tensor printed by its shape.
  static std::string entry_repr(const std::vector<tensor>& entry) {
    std::string out = "(";
    for (std::size_t i = 0; i < entry.size(); ++i) {
      if (i) out.append(", ");
      out.append("tensor of shape ");
      out.append(
          shape_string({entry[i].dimension(0), entry[i].dimension(1), entry[i].dimension(2), entry[i].dimension(3)}));
    }
    if (entry.size() == 1) out.push_back(',');
    out.push_back(')');
    return out;
  }

  static halves split(const std::vector<std::vector<tensor>>& data) {
    std::vector<layer_data> self_layers, cross_layers;
    self_layers.reserve(data.size());
    cross_layers.reserve(data.size());
    for (const auto& entry : data) {
      if (entry.size() == 6) {
        self_layers.push_back({&entry[0], &entry[1], &entry[2]});
        cross_layers.push_back({&entry[3], &entry[4], &entry[5]});
      } else if (entry.size() == 4) {
        self_layers.push_back({&entry[0], &entry[1], nullptr});
        cross_layers.push_back({&entry[2], &entry[3], nullptr});
      } else {
        throw ValueError(detail::join_message({"Expected len(combined_cache_data) = ", std::to_string(entry.size()),
                                               " to be 4 or 6.\ncombined_cache_data = ", entry_repr(entry)}));
      }
    }
    return {build<SelfCache>(self_layers), build<CrossCache>(cross_layers)};
  }

  static std::int64_t window_of(const layer_data& l) {
    return l.window && l.window->size() > 0 ? static_cast<std::int64_t>(static_cast<float>(l.window->data()[0])) : 0;
  }

  // transformers' DynamicCache(ddp_cache_data): a DynamicSlidingWindowLayer where a window is
  // given, else a DynamicLayer; then one update per layer.
  template <class C>
  static C build(const std::vector<layer_data>& layers) {
    if constexpr (C::replicated) {
      C cache;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        if (window_of(layers[i]) > 0)
          throw ValueError(
              detail::join_message({"EncoderDecoderCache: layer ", std::to_string(i), " has a sliding window, but ",
                                    detail::cache_class_name<C>(),
                                    " replicates DynamicLayer; use a cache with DynamicSlidingWindowLayer, such as "
                                    "kvc::ConfiguredDynamicCache"}));
        cache.update(*layers[i].keys, *layers[i].values, static_cast<std::int64_t>(i));
      }
      return cache;
    } else {
      std::vector<typename C::kind_variant> kinds;
      kinds.reserve(layers.size());
      for (const layer_data& l : layers) {
        const std::int64_t window = window_of(l);
        if (window > 0)
          kinds.emplace_back(DynamicSlidingWindowLayer{window});
        else
          kinds.emplace_back(DynamicLayer{});
      }
      C cache(kinds);
      for (std::size_t i = 0; i < layers.size(); ++i)
        cache.update(*layers[i].keys, *layers[i].values, static_cast<std::int64_t>(i));
      return cache;
    }
  }

  // Applies f to both caches with the strong guarantee: f runs first on a copy of the smaller
  // cache, then on the other one in place (a Cache operation that throws changes nothing), and
  // the copy is moved in last. Caches that cannot be copied get f in turn (basic guarantee).
  template <class F>
  void on_both(F&& f) {
    if constexpr (std::is_copy_constructible_v<SelfCache> && std::is_nothrow_move_assignable_v<SelfCache> &&
                  std::is_copy_constructible_v<CrossCache> && std::is_nothrow_move_assignable_v<CrossCache>) {
      if (self_.bytes() <= cross_.bytes()) {
        SelfCache s = self_;
        f(s);
        f(cross_);
        self_ = std::move(s);
      } else {
        CrossCache c = cross_;
        f(c);
        f(self_);
        cross_ = std::move(c);
      }
    } else {
      f(self_);
      f(cross_);
    }
  }

  SelfCache self_;
  CrossCache cross_;
  std::map<std::int64_t, bool> is_updated_;
};

// `EncoderDecoderCache cache(self_cache, cross_cache)` deduces both cache types.
template <class SelfCache, class CrossCache>
EncoderDecoderCache(SelfCache, CrossCache) -> EncoderDecoderCache<SelfCache, CrossCache>;

// transformers' repr: `EncoderDecoderCache(self_attention_cache=..., cross_attention_cache=...)`.
template <class SelfCache, class CrossCache>
std::string cache_repr(const EncoderDecoderCache<SelfCache, CrossCache>& cache) {
  std::string out = "EncoderDecoderCache(self_attention_cache=";
  out.append(cache_repr(cache.self_attention_cache()));
  out.append(", cross_attention_cache=");
  out.append(cache_repr(cache.cross_attention_cache()));
  out.push_back(')');
  return out;
}

}  // namespace kvc

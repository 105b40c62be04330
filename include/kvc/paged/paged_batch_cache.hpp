#pragma once
// kvc::PagedBatchCache<S>: a kvc::PagedCache behind the method set of a dynamic cache, for code
// that runs one dense batch (model.generate's [batch, heads, tokens, head_dim] tensors) and picks
// its cache at run time: make_cache("paged") builds one, and AnyCache holds it.
//
// Each batch row is one request of the paged cache. Every row has the same length (a dense
// batch), so one step of q tokens takes the same blocks for every row:
//   - update(k, v, layer) allocates the blocks the step needs for all rows (all or nothing: a
//     kvc::MemoryError when they are not free, with nothing changed), writes the new tokens to
//     their pages and returns what attention reads, gathered into [batch, heads, R, head_dim]:
//     every token for full-attention layers, the last min(past, sliding_window - 1) cached tokens
//     and the new ones for sliding layers, exactly what DynamicLayer and DynamicSlidingWindowLayer
//     return. The returned views point into one buffer of this cache that the next update
//     overwrites (the gather is the cost of paging: O(R) per layer and step, not O(new tokens));
//   - reorder_cache, batch_select_indices and batch_repeat_interleave move block tables, not
//     tokens: a row kept once keeps its blocks, a row kept twice is copied into the blocks of a
//     row that is dropped, else into new blocks (a fork);
//   - crop and set_write_position do not exist, as on transformers' PagedAttentionCache
//     (AnyCache's AttributeError);
//   - a hybrid model's layers with linear-attention states ("linear_attention", "conv", and the
//     hybrids) keep each row's conv and recurrent states in the row's state slot of the paged
//     cache: update_conv_state and update_recurrent_state take and return [batch, ...] tensors as
//     LinearAttentionLayer does (each row's state goes to its request, the results are gathered
//     into one buffer that the next such call overwrites), has_previous_state and is_linear answer
//     as the dynamic cache does, and the batch operations copy the states with the rows. A row
//     takes its slot with its first block, at its first update of either kind (transformers'
//     continuous batching refuses these models: docs/differences.md).
// Semantics of the pages: docs/paged.md; the runtime path: docs/runtime.md.

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

// A PagedCache behind a dynamic cache's method set, for code that runs one dense batch and picks
// its cache at run time (make_cache("paged"), AnyCache): each batch row is one request.
template <class S>
class PagedBatchCache {
 public:
  // The storage policy: where the pages live.
  using storage_policy = S;
  // The element type of keys and values.
  using element_type = typename S::element_type;
  // S's tensor view: what update() takes and returns.
  using view_type = typename S::view_type;
  // Keys and values as a pair of views (what update() returns).
  using kv_type = KV<view_type>;
  // Shorthand for element_type.
  using T = element_type;
  static_assert(!detail::is_kv_codes<T>,
                "kvc::PagedBatchCache: keys and values share one row width here; a kvc::kv_codes pool is read by "
                "kvc::paged_attention over a PagedCache");

  // What AnyCache asks of a cache it holds.
  static constexpr bool can_crop = false;
  // reorder_cache, batch_select_indices and batch_repeat_interleave exist.
  static constexpr bool can_batch_ops = true;
  // set_write_position does not exist (as on transformers' PagedAttentionCache).
  static constexpr bool can_set_write_position = false;
  // transformers' class: its repr, and the object an AttributeError names.
  static constexpr std::string_view class_name = "PagedAttentionCache";

  // A paged cache for `config` sized by `cb` (cb.num_blocks must be set), holding no batch yet.
  // Throws PagedCache's errors (kvc::ValueError for a bad config or layer type).
  PagedBatchCache(const ModelConfig& config, const ContinuousBatchingConfig& cb)
      : cache_(config, cb), seen_(static_cast<std::size_t>(cache_.num_layers()), 0), kinds_(seen_.size(), 0) {
    const paged::LayerGroups groups = paged::group_paged_layers(config);
    for (const auto& g : groups.groups)
      for (const std::int64_t l : g) kinds_[static_cast<std::size_t>(l)] |= has_kv_bit;
    for (const std::int64_t l : groups.state_layers) kinds_[static_cast<std::size_t>(l)] |= has_states_bit;
  }

  // Returns the paged cache behind the batch, read-only.
  const PagedCache<S>& paged() const noexcept { return cache_; }
  // The request id of batch row `row` in paged().
  const std::string& row_request(std::int64_t row) const { return rows_.at(static_cast<std::size_t>(row)); }

  // ---- update and what the layers hold -------------------------------------------------------------

  // Keys and values: any input the storage accepts (a kvc::tensor_input of T in its memory space).
  template <class KeysT, class ValuesT>
  KV<view_type> update(const KeysT& keys, const ValuesT& values, std::int64_t layer_idx) {
    constexpr bool accepted = S::template accepts_input<KeysT> && S::template accepts_input<ValuesT>;
    if constexpr (detail::require_inputs<accepted, KeysT, ValuesT>())
      return update(S::input_view(keys), S::input_view(values), layer_idx);
    else
      return {};
  }
  // update() on views of the storage ([batch, kv_heads, q, head_dim]). kvc::MemoryError, with
  // nothing changed, when the step's blocks are not free; kvc::ValueError or kvc::IndexError for a
  // bad shape or layer.
  KV<view_type> update(const view_type& k, const view_type& v, std::int64_t layer_idx) {
    if (is_linear_layer(layer_idx)) no_linear_attribute("update");
    const std::int64_t group = cache_.layer_group(layer_idx).first;
    check_input(k, v);
    const std::int64_t batch = k.extent(0), q = k.extent(2);
    const std::int64_t past = seen_[static_cast<std::size_t>(layer_idx)];
    detail::check_size("kvc::PagedBatchCache::update: tokens", q, 1, max_extent - past);

    // Everything that can fail comes before the first change: the checks, the new rows' names,
    // the index lists' memory and the output buffer; the blocks and the rows they give are taken
    // in one transaction of the paged cache, undone if anything in it fails.
    const std::int64_t bs = cache_.block_size();
    const std::int64_t wanted = (past + q + bs - 1) / bs;
    const std::int64_t more = std::max<std::int64_t>(wanted - allocated_, 0);
    const std::int64_t need = more > 0 ? batch * cache_.blocks_needed(more, allocated_) : 0;
    check_free_blocks(need, batch);
    if (allocated_ == 0) check_free_slots(batch);
    std::vector<std::string> names;
    if (rows_.empty()) names = row_names(batch);
    const std::vector<std::string>& ids = rows_.empty() ? names : rows_;
    const bool reuse = !indices_.empty() && indices_past_ == past && indices_q_ == q;
    std::vector<step_rows> next;
    if (!reuse) next = sized_indices(ids.size(), past, q);
    const auto gi = static_cast<std::size_t>(group);
    const std::int64_t r =
        reuse ? static_cast<std::int64_t>(indices_.front().reads[gi].size()) : read_rows(gi, past, q);
    // The output: out_k_ / out_v_, or new buffers made aside (when those are too small, or when an
    // input is a view a previous update returned, read while the output is written), moved in once
    // the step is written; a refused call leaves the last result where it was.
    const std::int64_t elems = batch * cache_.num_key_value_heads() * r * cache_.row_width();
    typename S::buffer_type fresh_k, fresh_v;
    if (out_k_.size() < elems || holds(out_k_, k.data()) || holds(out_k_, v.data()) || holds(out_v_, k.data()) ||
        holds(out_v_, v.data())) {
      fresh_k = typename S::buffer_type(elems);
      fresh_v = typename S::buffer_type(elems);
    }
    T* ok = fresh_k.size() > 0 ? fresh_k.data() : out_k_.data();
    T* ov = fresh_k.size() > 0 ? fresh_v.data() : out_v_.data();
    if (more > 0 || !reuse)
      cache_.transaction([&] {
        // All rows or none, and they fit (counted above); were a block missing, the indices
        // below would refuse the step (rolled back).
        if (more > 0) (void)cache_.allocate_blocks(more, ids);
        for (std::size_t b = 0; b < next.size(); ++b)
          cache_.extend_read_and_write_indices(ids[b], past, q, &next[b].reads, next[b].writes);
      });
    // Committed: nothing below allocates or fails.
    allocated_ += more;
    if (!reuse) {
      indices_ = std::move(next);
      indices_past_ = past;
      indices_q_ = q;
    }
    if (rows_.empty()) {
      rows_ = std::move(names);
      next_id_ += batch;
    }
    const std::int64_t row_elems = cache_.num_key_value_heads() * r * cache_.row_width();
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto& rb = indices_[static_cast<std::size_t>(b)];
      cache_.update_rows(row_of(k, b), row_of(v, b), layer_idx, rb.reads[gi], rb.writes[gi], ok + b * row_elems,
                         ov + b * row_elems);
    }
    seen_[static_cast<std::size_t>(layer_idx)] = past + q;
    if (fresh_k.size() > 0) {
      out_k_ = std::move(fresh_k);
      out_v_ = std::move(fresh_v);
    }
    return {dense_view(ok, batch, r), dense_view(ov, batch, r)};
  }

  // What layer `layer_idx` holds, [batch, heads, L, head_dim] (full layers: every token; sliding
  // layers: the last sliding_window - 1), gathered into a buffer that the next call overwrites.
  KV<view_type> stored(std::int64_t layer_idx) const {
    if (is_linear_layer(layer_idx)) no_linear_attribute("keys");
    const auto gi = static_cast<std::size_t>(cache_.layer_group(layer_idx).first);  // checks layer_idx
    const std::int64_t past = seen_[static_cast<std::size_t>(layer_idx)];
    if (rows_.empty() || allocated_ == 0) return {};  // (rows early_initialization named hold nothing yet)
    const auto batch = static_cast<std::int64_t>(rows_.size());
    std::vector<std::vector<std::int64_t>> held(rows_.size());
    for (std::size_t b = 0; b < rows_.size(); ++b) {
      PagedIndices reads(static_cast<std::size_t>(cache_.num_groups())), writes(reads.size());
      cache_.extend_read_and_write_indices(rows_[b], past, 0, &reads, writes);
      held[b] = std::move(reads[gi]);
    }
    const auto r = static_cast<std::int64_t>(held.front().size());
    const std::int64_t row_elems = cache_.num_key_value_heads() * r * cache_.row_width();
    T* sk = out_buffer(stored_k_, stored_v_, batch * row_elems);
    for (std::int64_t b = 0; b < batch; ++b)
      cache_.read_rows(layer_idx, held[static_cast<std::size_t>(b)], sk + b * row_elems,
                       stored_v_.data() + b * row_elems);
    return {dense_view(sk, batch, r), dense_view(stored_v_.data(), batch, r)};
  }

  // ---- lengths and masks (DynamicLayer's and DynamicSlidingWindowLayer's) ---------------------------

  // Returns the tokens layer `layer_idx` has seen (0 past the last layer); throws kvc::IndexError
  // for a negative index.
  std::int64_t get_seq_length(std::int64_t layer_idx = 0) const {
    check_index(layer_idx, "get_seq_length");
    if (layer_idx >= size()) return 0;
    return seen_[static_cast<std::size_t>(attention_layer_for("get_seq_length", layer_idx))];
  }
  // Returns the position of the next query token: get_seq_length(layer_idx).
  std::int64_t get_query_offset(std::int64_t layer_idx = 0) const { return get_seq_length(layer_idx); }
  // Returns (kv_length, kv_offset) of the attention mask for `query_length` new tokens, as
  // DynamicLayer or DynamicSlidingWindowLayer does. kvc::IndexError for a negative layer index,
  // kvc::ValueError for a negative query_length.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t query_length, std::int64_t layer_idx) const {
    check_index(layer_idx, "get_mask_sizes");
    detail::check_size("get_mask_sizes: query_length", query_length, 0, max_extent);
    if (layer_idx >= size()) return {query_length, 0};
    layer_idx = attention_layer_for("get_mask_sizes", layer_idx);
    const std::int64_t past = seen_[static_cast<std::size_t>(layer_idx)];
    if (!is_sliding(layer_idx)) return {past + query_length, 0};
    const std::int64_t w = cache_.sliding_window();
    return {std::min(past, w - 1) + query_length, std::max<std::int64_t>(past - w + 1, 0)};
  }
  // Returns the sliding window when every layer with keys and values is a sliding one; -1
  // otherwise (no maximum).
  std::int64_t get_max_length() const {
    std::int64_t out = -1;
    for (std::int64_t i = 0; i < size(); ++i) {
      if (!has_kv(i)) continue;
      if (!is_sliding(i)) return -1;
      out = std::max(out, get_max_length(i));
    }
    return out;
  }
  // Returns the sliding window for a sliding layer, -1 for a full one, a linear-attention one or
  // past the last layer; throws kvc::IndexError for a negative index.
  std::int64_t get_max_length(std::int64_t layer_idx) const {
    check_index(layer_idx, "get_max_length");
    return layer_idx < size() && is_sliding(layer_idx) ? cache_.sliding_window() : -1;
  }

  // ---- the batch ------------------------------------------------------------------------------------

  // Row i becomes old row beam_idx[i] (beam search), moving block tables, not tokens.
  // kvc::IndexError or kvc::ValueError for bad indices, kvc::MemoryError when copies lack blocks;
  // strong guarantee.
  void reorder_cache(std::span<const std::int64_t> beam_idx) { select_rows("reorder_cache", beam_idx); }
  // The same for a braced list of indices.
  void reorder_cache(std::initializer_list<std::int64_t> beam_idx) {
    select_rows("reorder_cache", std::span(beam_idx.begin(), beam_idx.size()));
  }
  // Keeps the rows `indices` names, in that order; as reorder_cache, with its errors.
  void batch_select_indices(std::span<const std::int64_t> indices) { select_rows("batch_select_indices", indices); }
  // The same for a braced list of indices.
  void batch_select_indices(std::initializer_list<std::int64_t> indices) {
    select_rows("batch_select_indices", std::span(indices.begin(), indices.size()));
  }
  // Repeats each row `repeats` times in place (copies are forks); kvc::ValueError for repeats < 1,
  // kvc::MemoryError when the forks' blocks are not free.
  void batch_repeat_interleave(std::int64_t repeats) {
    detail::check_size("batch_repeat_interleave: repeats", repeats, 1, max_batch);
    select_rows("batch_repeat_interleave", detail::repeated_rows(batch_size(), repeats));
  }

  // Frees every row's blocks: the next update starts a new batch.
  void reset() {
    cache_.free_all_requests();
    rows_.clear();
    std::fill(seen_.begin(), seen_.end(), 0);
    allocated_ = 0;
    indices_.clear();
  }
  // Fixes the batch before the first update (the heads and head_dim must be the model's).
  void early_initialization(std::int64_t batch_size, const detail::int_or_list& num_heads,
                            const detail::int_or_list& head_dim) {
    const auto n = static_cast<std::size_t>(size());
    detail::check_early_initialization(n, batch_size, num_heads, head_dim);
    for (std::size_t i = 0; i < n; ++i)  // (linear-attention layers take their shapes from their states)
      if (has_kv(static_cast<std::int64_t>(i)) &&
          (num_heads.at(i) != cache_.num_key_value_heads() || head_dim.at(i) != cache_.head_dim()))
        throw ValueError("kvc::PagedBatchCache::early_initialization: layer " + std::to_string(i) + " has " +
                         std::to_string(cache_.num_key_value_heads()) + " heads of " +
                         std::to_string(cache_.head_dim()) + ", got " + std::to_string(num_heads.at(i)) + " of " +
                         std::to_string(head_dim.at(i)));
    if (!rows_.empty() && static_cast<std::int64_t>(rows_.size()) != batch_size)
      throw ValueError("kvc::PagedBatchCache::early_initialization: the cache already holds a batch of " +
                       std::to_string(rows_.size()));
    if (rows_.empty()) name_rows(batch_size);
  }

  // ---- what the cache is ----------------------------------------------------------------------------

  // Returns the number of layers.
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(seen_.size()); }
  // Returns the number of batch rows (0 before the first update or early_initialization).
  std::int64_t batch_size() const noexcept { return static_cast<std::int64_t>(rows_.size()); }
  // Returns true once the cache holds a batch.
  bool is_initialized() const noexcept { return !rows_.empty(); }
  // Returns false: a paged cache is not compileable.
  bool is_compileable() const noexcept { return false; }
  // Returns, for each layer, whether it is a sliding-window layer.
  std::vector<bool> is_sliding() const {
    std::vector<bool> out(seen_.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = is_sliding(static_cast<std::int64_t>(i));
    return out;
  }
  // Returns true when layer `layer_idx` is a sliding-window layer; kvc::IndexError out of range.
  bool is_sliding(std::int64_t layer_idx) const {
    return !is_linear_layer(layer_idx) &&
           group_is_sliding(static_cast<std::size_t>(cache_.layer_group(layer_idx).first));  // checks layer_idx
  }
  // Returns, for each layer, whether it is a linear-attention layer (states and no keys and
  // values: "linear_attention" and "conv"), as the dynamic cache does.
  std::vector<bool> is_linear() const {
    std::vector<bool> out(seen_.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = !has_kv(static_cast<std::int64_t>(i));
    return out;
  }
  // Returns class_name for every layer.
  std::string_view layer_name(std::int64_t) const noexcept { return class_name; }
  // Returns transformers' repr: PagedAttentionCache(num_blocks=..., block_size=...).
  std::string repr() const {
    return std::string(class_name) + "(num_blocks=" + std::to_string(cache_.num_blocks()) +
           ", block_size=" + std::to_string(cache_.block_size()) + ")";
  }
  // Returns the bytes of the paged cache's K and V pools and state tensors.
  std::int64_t bytes() const noexcept { return cache_.bytes(); }

  // Whether layer `layer_idx` (default: the last layer with linear-attention states) has had an
  // update_conv_state since the rows took their state slots, for state `state_idx` (default:
  // every state), as the dynamic cache answers; false past the last layer or before the batch
  // holds slots. transformers' ValueError for a layer without states or a model with none.
  bool has_previous_state(std::optional<std::int64_t> layer_idx = std::nullopt,
                          std::optional<std::int64_t> state_idx = std::nullopt) const {
    const std::int64_t idx = detail::previous_state_layer(
        layer_idx, size(), [&](std::int64_t i) { return (kinds_[static_cast<std::size_t>(i)] & has_states_bit) != 0; });
    if (idx < 0) return false;
    if (state_idx && *state_idx < 0)
      throw KeyError("has_previous_state: state_idx " + std::to_string(*state_idx) + " is negative");
    if (state_idx && *state_idx >= cache_.states_per_layer())
      throw KeyError("has_previous_state: state_idx " + std::to_string(*state_idx) +
                     " is out of range for a layer with " + std::to_string(cache_.states_per_layer()) + " states");
    if (!holds_slots()) return false;
    // (every row of a dense batch has had the same updates: row 0 answers for all)
    if (state_idx) return cache_.has_previous_state(rows_.front(), idx, *state_idx);
    for (std::int64_t s = 0; s < cache_.states_per_layer(); ++s)
      if (!cache_.has_previous_state(rows_.front(), idx, s)) return false;
    return true;
  }
  // Stores conv states ([batch, channels, time]) in state `state_idx` of linear-attention layer
  // `layer_idx`, each row in its request's slot, and returns them with their left context as
  // LinearAttentionLayer does: on the first call the input (left-padded with zeros to the kernel
  // size), afterwards the kernel's stored columns followed by the new ones, [batch, channels,
  // width], in a buffer of this cache that the next call overwrites. `conv_kernel_size` 0 takes
  // the kernel from the first input's time axis. kvc::ValueError for a bad shape, a batch other
  // than the cache's, or a layer without states; kvc::MemoryError when the rows' first blocks or
  // state slots are not free; strong guarantee.
  template <class X>
  typename S::state_view_type update_conv_state(const X& conv_states, std::int64_t layer_idx,
                                                std::int64_t state_idx = 0, std::int64_t conv_kernel_size = 0) {
    const auto x = detail::checked_state_view<S>(conv_states, "kvc::PagedBatchCache");
    const std::int64_t entry = state_entry(layer_idx, state_idx, "update_conv_state");
    detail::check_conv_input(x, conv_kernel_size);
    check_batch(x.extent(0), "update_conv_state");
    const std::int64_t batch = x.extent(0), c = x.extent(1), t = x.extent(2);
    const auto& made = cache_.state_pools().at(entry);
    if (made.channels > 0 && made.channels != c)
      throw ValueError("update_conv_state: conv states of shape " + shape_string(x) + " do not match state " +
                       std::to_string(state_idx) + ", which holds " + std::to_string(made.channels) + " channels");
    // The width PagedCache::update_conv_state returns for each row, known before anything changes.
    const std::int64_t k = made.channels > 0 ? made.kernel : (conv_kernel_size > 0 ? conv_kernel_size : t);
    const bool first = !holds_slots() || !cache_.has_previous_state(rows_.front(), layer_idx, state_idx);
    const std::int64_t width = first ? std::max(k, t) : k + t;
    typename S::buffer_type fresh;
    T* out = state_buffer(out_conv_, fresh, detail::checked_elements({batch, c, width}, sizeof(T)), x.data());
    for_state_rows(batch, [&](const std::string& row, std::int64_t b) {
      const auto got = cache_.update_conv_state(S::make_state_view(x.data() + b * c * t, 3, {1, c, t, 0}), row,
                                                layer_idx, state_idx, conv_kernel_size);
      S::copy_2d(out + b * c * width, c * width, got.data(), got.size(), c * width, 1);
    });
    if (fresh.size() > 0) out_conv_ = std::move(fresh);  // (the input, read above, may have been the old one)
    return S::make_state_view(out, 3, {batch, c, width, 0});
  }
  // Overwrites recurrent state `state_idx` of linear-attention layer `layer_idx` with
  // `recurrent_states` ([batch, ...], rank 1 to 4), each row in its request's slot, and returns
  // what the rows hold, gathered into a buffer of this cache that the next call overwrites; the
  // errors and guarantee of update_conv_state.
  template <class X>
  typename S::state_view_type update_recurrent_state(const X& recurrent_states, std::int64_t layer_idx,
                                                     std::int64_t state_idx = 0) {
    const auto x = detail::checked_state_view<S>(recurrent_states, "kvc::PagedBatchCache");
    const std::int64_t entry = state_entry(layer_idx, state_idx, "update_recurrent_state");
    if (x.rank < 1 || x.size() < 1)
      throw ValueError("update_recurrent_state: recurrent states must be a non-empty tensor, got " + shape_string(x));
    check_batch(x.extent(0), "update_recurrent_state");
    const std::int64_t batch = x.extent(0), per_row = x.size() / batch;
    auto one = x.extents;
    one[0] = 1;
    if (const auto& made = cache_.state_pools().at(entry);
        made.rank > 0 && (made.rank != x.rank || made.shape != one)) {
      auto held = made.shape;
      held[0] = batch;
      throw ValueError("update_recurrent_state: recurrent states of shape " + shape_string(x) + " do not match state " +
                       std::to_string(state_idx) + ", which holds " +
                       shape_string(S::make_state_view(nullptr, made.rank, held)));
    }
    typename S::buffer_type fresh;
    T* out = state_buffer(out_recurrent_, fresh, x.size(), x.data());
    for_state_rows(batch, [&](const std::string& row, std::int64_t b) {
      const auto got = cache_.update_recurrent_state(S::make_state_view(x.data() + b * per_row, x.rank, one), row,
                                                     layer_idx, state_idx);
      S::copy_2d(out + b * per_row, per_row, got.data(), per_row, per_row, 1);
    });
    if (fresh.size() > 0) out_recurrent_ = std::move(fresh);
    return S::make_state_view(out, x.rank, x.extents);
  }
  // Throws kvc::AttributeError: no layer has an indexer.
  template <class X>
  typename S::state_view_type update_indexer(const X&, std::int64_t) {
    throw AttributeError("'" + std::string(class_name) + "' object has no attribute 'update_indexer'");
  }

  // Nothing is offloaded layer by layer.
  void make_resident(std::int64_t = -1) noexcept {}
  // Does nothing. Past recording keeps what `crop` needs (DynamicSlidingWindowLayer's past tokens,
  // LinearAttentionLayer's every conv column), and a paged cache has no crop: a hybrid model's
  // conv results keep the kernel's window, where a recording dynamic cache returns every column.
  void activate_past_recording() noexcept {}

 private:
  struct step_rows {
    PagedIndices reads, writes;
  };

  static constexpr unsigned char has_kv_bit = 1, has_states_bit = 2;
  bool has_kv(std::int64_t layer_idx) const noexcept {
    return (kinds_[static_cast<std::size_t>(layer_idx)] & has_kv_bit) != 0;
  }
  // A layer in range with states and no keys and values (out of range: false, for the caller's
  // own range check).
  bool is_linear_layer(std::int64_t layer_idx) const noexcept {
    return layer_idx >= 0 && layer_idx < size() && !has_kv(layer_idx);
  }
  // What the dynamic cache's LinearAttentionLayer raises for a K/V method.
  [[noreturn]] static void no_linear_attribute(const char* method) {
    throw AttributeError(std::string("'LinearAttentionLayer' object has no attribute '") + method + "'");
  }
  std::int64_t attention_layer_for(const char* method, std::int64_t idx) const {
    return detail::attention_layer_for(method, idx, size(), [&](std::int64_t i) { return has_kv(i); });
  }
  // Checks layer_idx and state_idx of a state update (the dynamic cache's messages, before
  // anything changes) and returns their entry in the paged cache's state pools.
  std::int64_t state_entry(std::int64_t layer_idx, std::int64_t state_idx, const char* method) const {
    check_existing(layer_idx, method);
    const auto& layers = cache_.state_layers();
    const auto it = std::lower_bound(layers.begin(), layers.end(), layer_idx);
    if (it == layers.end() || *it != layer_idx)
      throw ValueError("Cannot call `" + std::string(method) + "` on a non-LinearAttention layer!");
    if (state_idx < 0 || state_idx >= cache_.states_per_layer())
      throw KeyError(std::string(method) + ": state_idx " + std::to_string(state_idx) +
                     " is out of range for a layer with " + std::to_string(cache_.states_per_layer()) + " states");
    return (it - layers.begin()) * cache_.states_per_layer() + state_idx;
  }
  // Whether the rows hold their blocks, and with them their state slots.
  bool holds_slots() const noexcept { return !rows_.empty() && allocated_ > 0; }
  void check_batch(std::int64_t batch, const char* method) const {
    if (!rows_.empty() && batch != static_cast<std::int64_t>(rows_.size()))
      throw ValueError("kvc::PagedBatchCache::" + std::string(method) + ": the cache holds a batch of " +
                       std::to_string(rows_.size()) + " rows, got " + std::to_string(batch));
  }
  // MemoryError unless `need` blocks are free for a step of `batch` rows.
  void check_free_blocks(std::int64_t need, std::int64_t batch) const {
    if (need > cache_.get_num_free_blocks())
      throw MemoryError("kvc::PagedBatchCache: the step needs " + std::to_string(need) + " more blocks for " +
                        std::to_string(batch) + " rows, " + std::to_string(cache_.get_num_free_blocks()) +
                        " are free (ContinuousBatchingConfig::num_blocks)");
  }
  // MemoryError unless a state slot is free for each of `batch` rows.
  void check_free_slots(std::int64_t batch) const {
    if (cache_.state_slots() > 0 && batch > cache_.free_state_slots())
      throw MemoryError("kvc::PagedBatchCache: the batch needs " + std::to_string(batch) + " state slots, " +
                        std::to_string(cache_.free_state_slots()) +
                        " are free (ContinuousBatchingConfig::max_state_slots)");
  }
  // Where a state update's result of `elems` elements goes: `kept`, unless it is too small or holds
  // the input (the view the last call returned, handed back); then a new buffer, made in `fresh`,
  // which the caller moves into `kept` once the update is done: the input is read until then,
  // and a refused call leaves the last result where it was.
  static T* state_buffer(typename S::buffer_type& kept, typename S::buffer_type& fresh, std::int64_t elems,
                         const T* input) {
    if (holds(kept, input) || kept.size() < elems) fresh = typename S::buffer_type(elems);
    return fresh.size() > 0 ? fresh.data() : kept.data();
  }
  // Runs row(request, b) for every batch row b of a state update. Rows that hold no blocks yet
  // (the batch's first update, or rows early_initialization named) take one block and a state
  // slot each, in one transaction with row 0's call: PagedCache's state updates change nothing
  // when they throw, so a failure there undoes the blocks and changes nothing. The other rows'
  // calls cannot fail (the same checks as row 0's, and nothing left to allocate).
  template <class Row>
  void for_state_rows(std::int64_t batch, Row&& row) {
    std::int64_t b = 0;
    if (!holds_slots()) {
      check_free_blocks(batch * cache_.blocks_needed(1, 0), batch);
      check_free_slots(batch);
      std::vector<std::string> names;
      if (rows_.empty()) names = row_names(batch);
      const std::vector<std::string>& ids = rows_.empty() ? names : rows_;
      cache_.transaction([&] {
        (void)cache_.allocate_blocks(1, ids);  // fits: checked above
        row(ids.front(), 0);
      });
      allocated_ = 1;
      indices_.clear();
      if (rows_.empty()) {
        rows_ = std::move(names);
        next_id_ += batch;
      }
      b = 1;
    }
    for (; b < batch; ++b) row(rows_[static_cast<std::size_t>(b)], b);
  }
  void check_existing(std::int64_t layer_idx, const char* method) const {
    check_index(layer_idx, method);
    if (layer_idx >= size())
      throw IndexError(std::string(method) + ": layer_idx " + std::to_string(layer_idx) +
                       " is out of range for a Cache with " + std::to_string(size()) + " layers");
  }
  static void check_index(std::int64_t layer_idx, const char* method) {
    if (layer_idx < 0)
      throw IndexError(std::string(method) + ": layer_idx " + std::to_string(layer_idx) +
                       " is out of range: layer indices start at 0");
  }
  void check_input(const view_type& k, const view_type& v) const {
    if (k.extents != v.extents)
      throw ValueError("kvc::PagedBatchCache::update: keys " + shape_string(k.extents) + " and values " +
                       shape_string(v.extents) + " differ in shape");
    const std::int64_t h = cache_.num_key_value_heads(), d = cache_.row_width();
    if (k.extent(1) != h || k.extent(3) != d || k.extent(0) < 1)
      throw ValueError("kvc::PagedBatchCache::update: keys and values must be [batch, " + std::to_string(h) +
                       ", tokens, " + std::to_string(d) + "], got " + shape_string(k.extents));
    if (!rows_.empty() && k.extent(0) != static_cast<std::int64_t>(rows_.size()))
      throw ValueError("kvc::PagedBatchCache::update: the cache holds a batch of " + std::to_string(rows_.size()) +
                       " rows, got " + std::to_string(k.extent(0)));
  }
  // Names for `batch` new rows (not yet the cache's).
  std::vector<std::string> row_names(std::int64_t batch) const {
    std::vector<std::string> ids;
    ids.reserve(static_cast<std::size_t>(batch));
    for (std::int64_t b = 0; b < batch; ++b) ids.push_back(std::to_string(next_id_ + b));
    return ids;
  }
  void name_rows(std::int64_t batch) {
    rows_ = row_names(batch);
    next_id_ += batch;
  }
  static view_type row_of(const view_type& x, std::int64_t b) {
    return S::make_view(x.data() + b * x.stride(0), {1, x.extent(1), x.extent(2), x.extent(3)},
                        {x.stride(0), x.stride(1), x.stride(2), x.stride(3)});
  }
  view_type dense_view(const T* p, std::int64_t batch, std::int64_t r) const {
    const std::int64_t h = cache_.num_key_value_heads(), d = cache_.row_width();
    return S::make_view(p, {batch, h, r, d}, {h * r * d, r * d, d, 1});
  }
  // Whether p points into buffer b.
  static bool holds(const typename S::buffer_type& b, const T* p) noexcept {
    return p != nullptr && b.size() > 0 && std::less_equal<const T*>{}(b.data(), p) &&
           std::less<const T*>{}(p, b.data() + b.size());
  }
  static T* out_buffer(typename S::buffer_type& k, typename S::buffer_type& v, std::int64_t elems) {
    if (k.size() < elems) {
      typename S::buffer_type nk(elems), nv(elems);
      k = std::move(nk);
      v = std::move(nv);
    }
    return k.data();
  }
  // Read rows of a step of q tokens after `past` in group g: every position for a full group,
  // the last min(past, sliding_window - 1) and the new ones for a sliding group.
  std::int64_t read_rows(std::size_t g, std::int64_t past, std::int64_t q) const {
    return (group_is_sliding(g) ? std::min(past, cache_.sliding_window() - 1) : past) + q;
  }
  bool group_is_sliding(std::size_t g) const { return cache_.is_sliding_group(static_cast<std::int64_t>(g)); }
  // Index lists for every row, empty, with room for a step of q tokens after `past` (the rows are
  // the same for every layer of a group; update keeps them for the layers that follow).
  std::vector<step_rows> sized_indices(std::size_t rows, std::int64_t past, std::int64_t q) const {
    const auto groups = static_cast<std::size_t>(cache_.num_groups());
    std::vector<step_rows> out(rows, step_rows{PagedIndices(groups), PagedIndices(groups)});
    for (auto& sr : out)
      for (std::size_t g = 0; g < groups; ++g) {
        sr.reads[g].reserve(static_cast<std::size_t>(read_rows(g, past, q)));
        sr.writes[g].reserve(static_cast<std::size_t>(q));
      }
    return out;
  }
  // New row i is old row idx[i]. The first new row of an old row takes its blocks; another copy
  // takes the blocks of an old row nobody keeps (its tokens overwritten by a block copy), else
  // new blocks (a fork); old rows nobody keeps are freed. Strong guarantee: everything that can
  // fail (the checks, the forks) comes before the first change.
  void select_rows(const char* method, std::span<const std::int64_t> idx) {
    const auto batch = static_cast<std::int64_t>(rows_.size());
    if (batch == 0) return;  // nothing stored yet: as a dynamic cache's uninitialized layers
    for (const std::int64_t i : idx)
      if (i < 0 || i >= batch)
        throw IndexError(std::string(method) + ": index " + std::to_string(i) +
                         " is out of bounds for dimension 0 with size " + std::to_string(batch));
    if (idx.empty()) throw ValueError(std::string(method) + ": the batch cannot become empty");

    if (allocated_ == 0) {  // rows without blocks (early_initialization): new names are enough
      rows_.clear();
      name_rows(static_cast<std::int64_t>(idx.size()));
      return;
    }
    std::vector<bool> kept(rows_.size(), false);
    std::vector<std::string> next(idx.size());
    std::vector<std::pair<std::size_t, std::int64_t>> copies;  // (new row, old row) needing its own blocks
    for (std::size_t i = 0; i < idx.size(); ++i) {
      const auto old = static_cast<std::size_t>(idx[i]);
      if (!kept[old]) {
        kept[old] = true;
        next[i] = rows_[old];
      } else {
        copies.emplace_back(i, idx[i]);
      }
    }
    std::vector<std::string> spare;  // dropped rows whose blocks a copy reuses, then the ones freed
    for (std::size_t b = 0; b < rows_.size(); ++b)
      if (!kept[b]) spare.push_back(rows_[b]);
    const std::size_t reused = std::min(spare.size(), copies.size());
    std::vector<std::int64_t> from, to;  // the block copies into the reused rows
    for (std::size_t c = 0; c < reused; ++c) {
      // (every row of a dense batch holds as many blocks, group by group: the lists pair up)
      const std::vector<std::int64_t> a = cache_.request_blocks(rows_[static_cast<std::size_t>(copies[c].second)]);
      const std::vector<std::int64_t> b = cache_.request_blocks(spare[c]);
      from.insert(from.end(), a.begin(), a.end());
      to.insert(to.end(), b.begin(), b.end());
    }

    // The forks: new blocks for the copies no dropped row can take, in one call (all or none).
    std::vector<std::string> forked;
    forked.reserve(copies.size() - reused);
    for (std::size_t c = reused; c < copies.size(); ++c)
      forked.push_back(std::to_string(next_id_ + static_cast<std::int64_t>(forked.size())));
    std::vector<std::pair<std::string, std::span<const std::string>>> forks;
    forks.reserve(forked.size());
    for (std::size_t c = reused; c < copies.size(); ++c)
      forks.emplace_back(rows_[static_cast<std::size_t>(copies[c].second)],
                         std::span<const std::string>(&forked[c - reused], 1));
    if (!forks.empty()) {
      std::int64_t need = 0;
      for (const auto& f : forks) need += cache_.blocks_in_use(f.first);
      if (need > cache_.get_num_free_blocks())
        throw MemoryError(std::string("kvc::PagedBatchCache::") + method + ": copying rows needs " +
                          std::to_string(need) + " free blocks, " + std::to_string(cache_.get_num_free_blocks()) +
                          " are free");
      if (cache_.state_slots() > 0 && std::ssize(forked) > cache_.free_state_slots())
        throw MemoryError(std::string("kvc::PagedBatchCache::") + method + ": copying rows needs " +
                          std::to_string(forked.size()) + " free state slots, " +
                          std::to_string(cache_.free_state_slots()) + " are free");
      (void)cache_.fork_requests(forks);
    }
    // From here nothing fails: the block copies into the reused rows, then the table moves.
    cache_.copy_cache(from, to);
    for (std::size_t c = 0; c < reused; ++c)  // (outside a transaction: a state copy cannot fail)
      cache_.copy_states(rows_[static_cast<std::size_t>(copies[c].second)], spare[c]);
    for (std::size_t c = 0; c < reused; ++c) next[copies[c].first] = spare[c];
    for (std::size_t c = reused; c < copies.size(); ++c) next[copies[c].first] = forked[c - reused];
    for (std::size_t s = reused; s < spare.size(); ++s) cache_.free_blocks(spare[s]);
    next_id_ += static_cast<std::int64_t>(forked.size());
    rows_ = std::move(next);
    indices_.clear();
  }
  PagedCache<S> cache_;
  std::vector<std::int64_t> seen_;    // tokens seen, per layer
  std::vector<unsigned char> kinds_;  // per layer: has_kv_bit, has_states_bit
  std::vector<std::string> rows_;     // request id of each batch row
  std::int64_t allocated_ = 0;        // logical blocks each row holds (its full-group count)
  std::int64_t next_id_ = 0;
  std::vector<step_rows> indices_;
  std::int64_t indices_past_ = -1, indices_q_ = -1;
  typename S::buffer_type out_k_, out_v_, out_conv_, out_recurrent_;
  mutable typename S::buffer_type stored_k_, stored_v_;
};

}  // namespace kvc

#pragma once
// Linear-attention layers (Mamba, gated DeltaNet, LFM2-style short convolutions); the hybrids of a
// linear part with an attention part are in hybrid.hpp. Semantics: transformers' LinearAttentionCacheLayerMixin,
// LinearAttentionLayer and the four LinearAttentionAnd...Layer hybrids
// (src/transformers/cache_utils.py at a597f974); what kvc does differently (hybrids by
// composition, batch operations on the states, crop of uninitialized states): docs/differences.md.
//
// A linear layer has no sequence axis. Each of its `number_of_states` slots holds
//   - a conv state [batch, channels, time] (time last), kept at the kernel size k (or, once
//     `activate_past_recording` was called, every column seen, so that `crop` can roll back);
//   - a recurrent state of any shape (rank 1..4), overwritten by each update.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvc/concepts/cache_layer.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/attention_part.hpp>
#include <kvc/policies/layers/crop_plan.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/static.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// One dense tensor of rank 1..4 in a storage's memory.
template <class S>
struct dense_state {
  using T = typename S::element_type;
  typename S::buffer_type data;
  int rank = 0;
  std::array<std::int64_t, 4> extents{};
  bool initialized = false;

  std::int64_t rows() const noexcept {  // every axis but the last
    std::int64_t n = 1;
    for (int r = 0; r + 1 < rank; ++r) n *= extents[static_cast<std::size_t>(r)];
    return n;
  }
  std::int64_t last() const noexcept { return rank > 0 ? extents[static_cast<std::size_t>(rank - 1)] : 0; }
  typename S::state_view_type view() const noexcept { return S::make_state_view(data.data(), rank, extents); }
  std::int64_t bytes() const noexcept { return static_cast<std::int64_t>(sizeof(T)) * data.size(); }

  // Saved state (docs/state.md): rank, extents, then the elements.
  template <class A>
  void transfer(A& ar) {
    ar.value(initialized);
    ar.value(rank);
    for (std::int64_t& e : extents) ar.value(e);
    std::int64_t n = 0;
    if constexpr (A::loading) {
      ar.check(rank >= 0 && rank <= 4 && (initialized || rank == 0), "a state's rank");
      for (const std::int64_t e : extents) ar.check(e >= 0 && e <= max_extent, "a state's extents");
      ar.check(products_fit({extents[0], extents[1], extents[2], extents[3]}), "a state's size");
    }
    if (initialized) {
      n = 1;
      for (int r = 0; r < rank; ++r) n = checked_elements({n, extents[static_cast<std::size_t>(r)]}, sizeof(T));
    }
    ar.buffer(data, n);
  }

  // A copy whose batch entry i (axis 0) is entry indices[i] of this one.
  dense_state gathered(std::span<const std::int64_t> indices) const {
    dense_state out = *this;
    if (!initialized) return out;
    const std::int64_t per = extents[0] > 0 ? data.size() / extents[0] : 0;
    out.extents[0] = static_cast<std::int64_t>(indices.size());
    out.data = typename S::buffer_type(checked_elements({per, out.extents[0]}, sizeof(T)));
    for (std::size_t i = 0; i < indices.size(); ++i)
      S::copy_2d(out.data.data() + static_cast<std::int64_t>(i) * per, per, data.data() + indices[i] * per, per, per,
                 1);
    return out;
  }
};

}  // namespace detail

// LinearAttentionLayer's layer over storage S (transformers' LinearAttentionLayer):
// number_of_states slots, each a conv state and a recurrent state, and no K/V.
template <class S>
class LinearAttentionLayer::state {
 public:
  // The layer kind this state belongs to.
  using kind_type = LinearAttentionLayer;
  // The element type of the states (S::element_type).
  using T = typename S::element_type;
  // The view type the states are taken and returned as (S::state_view_type).
  using state_view = typename S::state_view_type;
  // False: the layer has no sliding window.
  static constexpr bool is_sliding = false;
  // True (transformers' is_compileable).
  static constexpr bool is_compileable = true;
  // False: the states take their shapes from their first updates.
  static constexpr bool supports_early_init = false;
  static constexpr bool supports_batch_ops = true;  // transformers has none (docs/differences.md)
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "LinearAttentionLayer";

  // number_of_states empty slots. Throws kvc::ValueError unless
  // 1 <= number_of_states <= kvc::max_layers.
  explicit state(const LinearAttentionLayer& kind) : n_(kind.number_of_states) {
    detail::check_size("LinearAttentionLayer: number_of_states", n_, 1, max_layers);
    slots_.resize(static_cast<std::size_t>(n_));
  }

  // Returns the number of state slots.
  std::int64_t number_of_states() const noexcept { return n_; }
  // Whether activate_past_recording was called (the conv states then keep every column).
  bool records_past() const noexcept { return record_past_; }
  // Makes the conv states keep every column from now on, so that `crop` can roll them back.
  void activate_past_recording() noexcept { record_past_ = true; }

  // Whether some state was written.
  bool is_initialized() const noexcept {
    return std::any_of(slots_.begin(), slots_.end(),
                       [](const slot& s) { return s.conv.initialized || s.rec.initialized; });
  }
  // The batch size of the initialized states, -1 when there is none.
  std::int64_t batch() const noexcept {
    for (const slot& s : slots_) {
      if (s.conv.initialized) return s.conv.extents[0];
      if (s.rec.initialized) return s.rec.extents[0];
    }
    return -1;
  }
  // Returns the bytes of every state held, with what the last update_conv_state calls returned.
  std::int64_t bytes() const noexcept {
    std::int64_t total = 0;
    for (const slot& s : slots_) total += s.conv.bytes() + s.rec.bytes() + s.full.bytes();
    return total;
  }

  // Whether slot state_idx had an update_conv_state since the last reset (a negative index:
  // whether every slot had one). Throws kvc::KeyError for an index past the last slot.
  bool has_previous_state(std::int64_t state_idx) const {
    if (state_idx < 0)
      return std::all_of(slots_.begin(), slots_.end(), [](const slot& s) { return s.has_previous_state; });
    return at(state_idx, "has_previous_state").has_previous_state;
  }
  // Returns slot state_idx's conv kernel size, fixed by its first update_conv_state (0 before).
  // Throws kvc::KeyError for an index out of range.
  std::int64_t conv_kernel_size(std::int64_t state_idx) const { return at(state_idx, "conv_kernel_size").kernel; }
  // What the layer holds (transformers' conv_states[i] / recurrent_states[i]); empty if unset.
  state_view conv_state(std::int64_t state_idx) const { return at(state_idx, "conv_state").conv.view(); }
  // Returns slot state_idx's recurrent state (transformers' recurrent_states[i]); empty if unset.
  // Throws kvc::KeyError for an index out of range.
  state_view recurrent_state(std::int64_t state_idx) const { return at(state_idx, "recurrent_state").rec.view(); }

  // Returns the conv input with its left context: on the first call the input itself (left-padded
  // with zeros to the kernel size unless past states are recorded), afterwards the stored columns
  // followed by the new ones. Keeps the last k columns (or all, when recording).
  state_view update_conv_state(const state_view& x, std::int64_t state_idx, std::int64_t conv_kernel_size) {
    const slot& cur = at(state_idx, "update_conv_state");
    if (x.rank != 3 || x.extent(0) < 1 || x.extent(1) < 1 || x.extent(2) < 1)
      throw ValueError(
          "update_conv_state: conv states must have shape [batch, channels, time] with positive sizes, got " +
          shape_string(x));
    if (conv_kernel_size < 0)
      throw ValueError("update_conv_state: conv_kernel_size must be positive, got " + std::to_string(conv_kernel_size));
    detail::check_size("update_conv_state: conv_kernel_size", conv_kernel_size, 0, max_extent);
    check_batch(x.extent(0), "update_conv_state");
    if (cur.conv.initialized && cur.conv.extents[1] != x.extent(1))
      throw ValueError("update_conv_state: conv states of shape " + shape_string(x) + " do not match state " +
                       std::to_string(state_idx) + ", which holds " + std::to_string(cur.conv.extents[1]) +
                       " channels");
    const std::int64_t k = cur.conv.initialized ? cur.kernel : (conv_kernel_size > 0 ? conv_kernel_size : x.extent(2));
    const std::int64_t rows = x.extent(0) * x.extent(1), t = x.extent(2);
    // full = [previous columns | new columns], or the (padded) input on the first call. The new
    // buffers are built aside and moved in at the end (strong guarantee); the recurrent state is
    // not touched.
    const bool first = !cur.has_previous_state;
    const std::int64_t prev = first ? 0 : cur.conv.last();
    const std::int64_t pad = (first && !record_past_ && t < k) ? k - t : 0;
    const std::int64_t width = pad + prev + t;
    detail::dense_state<S> full = make(3, {x.extent(0), x.extent(1), width, 0}, false);
    T* f = full.data.data();
    if (pad > 0) S::zero_2d(f, width, pad, rows);
    if (prev > 0) S::copy_2d(f, width, cur.conv.data.data(), prev, prev, rows);
    S::copy_2d(f + pad + prev, width, x.data(), t, t, rows);
    detail::dense_state<S> conv;
    if (!record_past_) {  // keeps the last k columns; recording keeps them all (conv is full)
      const std::int64_t keep = std::min(k, width);
      conv = make(3, {x.extent(0), x.extent(1), k, 0}, false);
      if (keep < k) S::zero_2d(conv.data.data(), k, k - keep, rows);
      S::copy_2d(conv.data.data() + (k - keep), k, f + (width - keep), width, keep, rows);
    }
    slot& s = slots_[static_cast<std::size_t>(state_idx)];
    s.kernel = k;
    s.has_previous_state = true;
    if (record_past_) {
      s.conv = std::move(full);
      s.full = detail::dense_state<S>();
      return s.conv.view();
    }
    s.conv = std::move(conv);
    s.full = std::move(full);
    return s.full.view();
  }

  // Overwrites the recurrent state and returns it.
  state_view update_recurrent_state(const state_view& x, std::int64_t state_idx) {
    const slot& cur = at(state_idx, "update_recurrent_state");
    if (x.rank < 1 || x.size() < 1)
      throw ValueError("update_recurrent_state: recurrent states must be a non-empty tensor, got " + shape_string(x));
    check_batch(x.extent(0), "update_recurrent_state");
    if (cur.rec.initialized && (cur.rec.rank != x.rank || cur.rec.extents != x.extents))
      throw ValueError("update_recurrent_state: recurrent states of shape " + shape_string(x) + " do not match state " +
                       std::to_string(state_idx) + ", which holds " + shape_string(cur.rec.view()));
    slot& s = slots_[static_cast<std::size_t>(state_idx)];
    if (!s.rec.initialized) s.rec = make(x.rank, x.extents, false);            // the only allocation
    S::copy_2d(s.rec.data.data(), x.size(), x.data(), x.size(), x.size(), 1);  // same shape: in place
    return s.rec.view();
  }

  // How many of its last tokens the layer can drop exactly (docs/rollback.md): 0 before
  // activate_past_recording and once a recurrent state was written (an update overwrites it, so
  // the state before the last tokens is gone); otherwise every token (kvc::unbounded_rollback:
  // recorded conv states keep every column), or, once a crop kept only the kernel's columns before
  // its cut, the columns recorded past those.
  std::int64_t rollback_depth() const noexcept {
    if (!record_past_) return 0;
    std::int64_t depth = unbounded_rollback;
    for (const slot& s : slots_) {
      if (s.rec.initialized) return 0;
      if (s.trimmed) depth = std::min(depth, s.conv.last() - s.kernel);
    }
    return depth;
  }

  // Checks that crop(tokens_to_remove) can run, changing nothing: throws kvc::RuntimeError unless
  // activate_past_recording was called and tokens_to_remove <= 0, and when it would remove more
  // tokens than rollback_depth() (a recurrent state cannot roll back).
  void check_crop(std::int64_t tokens_to_remove) const {
    if (!record_past_)
      throw RuntimeError(
          "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` "
          "before `crop` to be able to rollback the cache.");
    if (tokens_to_remove > 0)
      throw RuntimeError(
          "Linear attention layers can only be cropped by passing a negative int, to specify how many tokens to "
          "remove");
    // A linear layer counts no tokens: crop_count caps -tokens_to_remove at kvc::max_extent.
    detail::check_rollback(name, detail::crop_count(tokens_to_remove, max_extent), rollback_depth(),
                           "its recurrent states hold only the last update");
  }

  // Rolls the recorded conv states back by -tokens_to_remove columns and keeps the kernel size
  // before that point (crop(0) shrinks them to the kernel size). Throws kvc::RuntimeError as
  // check_crop does, changing nothing.
  void crop(std::int64_t tokens_to_remove) { commit_crop(prepare_crop(tokens_to_remove)); }

 private:
  struct slot;

 public:
  // crop in two steps (Cache::crop prepares every layer before it changes any): the new states
  // are built aside by prepare_crop, which changes nothing, and swapped in by commit_crop.
  using crop_plan = std::vector<slot>;
  // Checks the crop (as check_crop) and returns the cropped states, built aside; changes nothing.
  crop_plan prepare_crop(std::int64_t tokens_to_remove) const {
    check_crop(tokens_to_remove);
    std::vector<slot> next = slots_;
    for (slot& s : next) {
      if (!s.conv.initialized) continue;  // transformers fails on None here (docs/differences.md)
      const std::int64_t have = s.conv.last();
      const std::int64_t stop = std::max<std::int64_t>(have + tokens_to_remove, 0);  // tokens_to_remove <= 0
      const std::int64_t start = std::max<std::int64_t>(stop - s.kernel, 0);
      detail::dense_state<S> c = make(3, {s.conv.extents[0], s.conv.extents[1], stop - start, 0}, false);
      S::copy_2d(c.data.data(), stop - start, s.conv.data.data() + start, have, stop - start, s.conv.rows());
      s.conv = std::move(c);
      s.trimmed = s.trimmed || start > 0;
    }
    return next;
  }
  // Swaps in the states prepare_crop built. Cannot throw.
  void commit_crop(crop_plan&& next) noexcept { slots_.swap(next); }

  // Zeroes every state in place; no state has a previous state afterwards.
  void reset() {
    for (slot& s : slots_) {
      for (detail::dense_state<S>* d : {&s.conv, &s.rec, &s.full})
        if (d->data.size() > 0) S::zero_2d(d->data.data(), d->data.size(), d->data.size(), 1);
      s.has_previous_state = false;
      s.trimmed = false;
    }
  }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer, in every state (the
  // Cache checks the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out = *this;
    for (slot& s : out.slots_) {
      s.conv = s.conv.gathered(batch_indices);
      s.rec = s.rec.gathered(batch_indices);
      s.full = detail::dense_state<S>{};
    }
    return out;
  }

  // Calls f(buffer&) on each slot's conv, recurrent and last returned buffers, for offload engines
  // (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    for (slot& s : slots_) {
      f(s.conv.data);
      f(s.rec.data);
      f(s.full.data);
    }
  }

  // Saved state (docs/state.md): every slot's conv and recurrent states. What the last
  // update_conv_state returned is not state (the next call builds it afresh) and is not saved.
  LinearAttentionLayer kind() const noexcept { return {n_}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when number_of_states differs or the saved states are inconsistent.
  template <class A>
  void transfer(A& ar) {
    ar.param("number_of_states", n_);
    ar.value(record_past_);
    for (slot& s : slots_) {
      ar.value(s.kernel);
      ar.value(s.has_previous_state);
      ar.value(s.trimmed);
      s.conv.transfer(ar);
      s.rec.transfer(ar);
      if constexpr (A::loading) {
        s.full = detail::dense_state<S>();
        ar.check(s.kernel >= 0 && s.kernel <= max_extent && (!s.conv.initialized || s.conv.rank == 3) &&
                     (!s.rec.initialized || s.rec.rank >= 1) &&
                     (!s.trimmed || (s.conv.initialized && s.conv.last() >= s.kernel)),
                 "a linear-attention state's shape");
      }
    }
    if constexpr (A::loading) {
      const std::int64_t b = batch();
      for (const slot& s : slots_)
        ar.check((!s.conv.initialized || s.conv.extents[0] == b) && (!s.rec.initialized || s.rec.extents[0] == b),
                 "the states' batch sizes differ");
    }
  }

 private:
  struct slot {
    detail::dense_state<S> conv, rec;
    detail::dense_state<S> full;  // what the last update_conv_state returned (while recording: conv)
    std::int64_t kernel = 0;
    bool has_previous_state = false;
    bool trimmed = false;  // a crop dropped recorded columns: those held are no longer every one seen
  };

  // A tensor of that shape, zeroed unless the caller writes every element itself.
  static detail::dense_state<S> make(int rank, std::array<std::int64_t, 4> extents, bool zeroed = true) {
    detail::dense_state<S> d;
    d.rank = rank;
    d.extents = extents;
    std::int64_t n = 1;
    for (int r = 0; r < rank; ++r) n = detail::checked_elements({n, extents[static_cast<std::size_t>(r)]}, sizeof(T));
    d.data = typename S::buffer_type(n);
    if (zeroed && n > 0) S::zero_2d(d.data.data(), n, n, 1);
    d.initialized = true;
    return d;
  }

  const slot& at(std::int64_t state_idx, const char* method) const {
    if (state_idx < 0 || state_idx >= n_)
      throw KeyError(std::string(method) + ": state_idx " + std::to_string(state_idx) +
                     " is out of range for a layer with " + std::to_string(n_) + " states");
    return slots_[static_cast<std::size_t>(state_idx)];
  }

  void check_batch(std::int64_t b, const char* method) const {
    const std::int64_t have = batch();
    if (have >= 0 && have != b)
      throw ValueError(std::string(method) + ": batch size " + std::to_string(b) +
                       " does not match the layer's other states, which have batch size " + std::to_string(have));
  }

  std::int64_t n_;
  std::vector<slot> slots_;
  bool record_past_ = false;
};

}  // namespace kvc

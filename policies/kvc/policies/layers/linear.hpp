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
#include <optional>
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
  // Whether this tensor can take a copy of `o` without allocating: its buffer has o's size.
  bool fits(const dense_state& o) const noexcept { return data.size() == o.data.size(); }
  // Makes this tensor a copy of `o`, which it fits: no allocation.
  void assign_in_place(const dense_state& o) {
    rank = o.rank;
    extents = o.extents;
    initialized = o.initialized;
    if (o.data.size() > 0) S::copy_2d(data.data(), o.data.size(), o.data.data(), o.data.size(), o.data.size(), 1);
  }

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
    if (!initialized) return *this;
    dense_state out;  // (not a copy of this one: only the gathered rows are allocated)
    out.rank = rank;
    out.extents = extents;
    out.initialized = true;
    const std::int64_t per = extents[0] > 0 ? data.size() / extents[0] : 0;
    out.extents[0] = static_cast<std::int64_t>(indices.size());
    out.data = typename S::buffer_type(checked_elements({per, out.extents[0]}, sizeof(T)));
    for (std::size_t i = 0; i < indices.size(); ++i)
      S::copy_2d(out.data.data() + static_cast<std::int64_t>(i) * per, per, data.data() + indices[i] * per, per, per,
                 1);
    return out;
  }
};

// update_conv_state's checks of its input ([batch, channels, time], positive sizes) and kernel
// size, with LinearAttentionLayer's messages (PagedBatchCache's update_conv_state uses them too).
template <class View>
void check_conv_input(const View& x, std::int64_t conv_kernel_size) {
  if (x.rank != 3 || x.extent(0) < 1 || x.extent(1) < 1 || x.extent(2) < 1)
    throw ValueError(
        "update_conv_state: conv states must have shape [batch, channels, time] with positive sizes, got " +
        shape_string(x));
  if (conv_kernel_size < 0)
    throw ValueError("update_conv_state: conv_kernel_size must be positive, got " + std::to_string(conv_kernel_size));
  check_size("update_conv_state: conv_kernel_size", conv_kernel_size, 0, max_extent);
}

}  // namespace detail

// LinearAttentionLayer's layer over storage S (transformers' LinearAttentionLayer):
// number_of_states slots, each a conv state and a recurrent state, and no K/V. With
// rollback_states R > 0 each slot also keeps a ring of itself as it was before each of its last R
// steps (docs/rollback.md).
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
  // 1 <= number_of_states <= kvc::max_layers and 0 <= rollback_states <= kvc::max_layers.
  explicit state(const LinearAttentionLayer& kind) : n_(kind.number_of_states), ring_size_(kind.rollback_states) {
    detail::check_size("LinearAttentionLayer: number_of_states", n_, 1, max_layers);
    detail::check_size("LinearAttentionLayer: rollback_states", ring_size_, 0, max_layers);
    slots_.resize(static_cast<std::size_t>(n_));
  }

  // Returns the number of state slots.
  std::int64_t number_of_states() const noexcept { return n_; }
  // Returns how many steps back each slot keeps its states (the kind's rollback_states).
  std::int64_t rollback_states() const noexcept { return ring_size_; }
  // Whether activate_past_recording was called (the conv states then keep every column).
  bool records_past() const noexcept { return record_past_; }
  // Makes the conv states keep every column from now on, so that `crop` can roll them back. A conv
  // state written since the last reset counts as trimmed: only the columns recorded from now on can
  // be dropped.
  void activate_past_recording() noexcept {
    if (!record_past_)
      for (slot& s : slots_) s.trimmed = s.trimmed || s.has_previous_state;
    record_past_ = true;
  }

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
  // Returns the bytes of every state held, with what the last update_conv_state calls returned and
  // the rings' states.
  std::int64_t bytes() const noexcept {
    std::int64_t total = 0;
    for (const slot& s : slots_) {
      total += s.conv.bytes() + s.rec.bytes() + s.full.bytes();
      for (const snapshot& e : s.ring) total += e.conv.bytes() + e.rec.bytes();
    }
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
  // followed by the new ones. Keeps the last k columns (or all, when recording). With
  // rollback_states > 0 the call starts a step of x's columns: the slot as it was is kept in its
  // ring (the oldest kept state makes room once the ring is full).
  state_view update_conv_state(const state_view& x, std::int64_t state_idx, std::int64_t conv_kernel_size) {
    const slot& cur = at(state_idx, "update_conv_state");
    detail::check_conv_input(x, conv_kernel_size);
    check_batch(x.extent(0), "update_conv_state");
    if (cur.conv.initialized && cur.conv.extents[1] != x.extent(1))
      throw ValueError("update_conv_state: conv states of shape " + shape_string(x) + " do not match state " +
                       std::to_string(state_idx) + ", which holds " + std::to_string(cur.conv.extents[1]) +
                       " channels");
    const std::int64_t k = cur.conv.initialized ? cur.kernel : (conv_kernel_size > 0 ? conv_kernel_size : x.extent(2));
    const std::int64_t rows = x.extent(0) * x.extent(1), t = x.extent(2);
    // full = [previous columns | new columns], or the (padded) input on the first call. The new
    // buffers (and the ring's copies of the slot) are built aside and moved in at the end (strong
    // guarantee); the recurrent state is not touched.
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
    pending_entry entry = prepare_entry(state_idx);
    slot& s = slots_[static_cast<std::size_t>(state_idx)];
    if (ring_size_ > 0) commit_entry(s, std::move(entry), t);
    s.kernel = k;
    s.has_previous_state = true;
    if (first) s.trimmed = false;  // the columns held are all this step's
    if (record_past_) {
      s.conv = std::move(full);
      s.full = detail::dense_state<S>();
      return s.conv.view();
    }
    s.conv = std::move(conv);
    s.full = std::move(full);
    return s.full.view();
  }

  // Overwrites the recurrent state and returns it. With rollback_states > 0 it ends the step the
  // slot's last update_conv_state began; a recurrent update with no such step covers tokens the
  // layer cannot count, so the slot's ring is emptied (it can no longer roll back).
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
    if (!s.open) {  // no step to end: tokens the layer cannot count
      s.steps = s.first = 0;
      s.uncounted = true;
    }
    s.open = false;
    return s.rec.view();
  }

  // How many of its last tokens the layer can drop exactly (docs/rollback.md), the minimum over
  // its slots. A slot whose recurrent state was written rolls back through its ring: the one-token
  // steps at its end (every token when all its steps since it was empty are kept and took one
  // token each), 0 without a ring. Otherwise, while recording, its conv state rolls back by
  // columns: every one (kvc::unbounded_rollback), or, once a crop kept only the kernel's columns
  // before its cut, the columns recorded past those. 0 without a ring or recording.
  std::int64_t rollback_depth() const noexcept {
    std::int64_t depth = unbounded_rollback;
    for (const slot& s : slots_) depth = std::min(depth, slot_depth(s));
    return depth;
  }

  // Checks that crop(tokens_to_remove) can run, changing nothing: throws kvc::RuntimeError unless
  // past states are recorded or kept (activate_past_recording, rollback_states) and
  // tokens_to_remove <= 0, and when it would remove more tokens than rollback_depth().
  void check_crop(std::int64_t tokens_to_remove) const {
    if (!record_past_ && ring_size_ == 0)
      throw RuntimeError(
          "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` "
          "before `crop` to be able to rollback the cache.");
    if (tokens_to_remove > 0)
      throw RuntimeError(
          "Linear attention layers can only be cropped by passing a negative int, to specify how many tokens to "
          "remove");
    // A linear layer counts no tokens: crop_count caps -tokens_to_remove at kvc::max_extent.
    const std::int64_t n = detail::crop_count(tokens_to_remove, max_extent), depth = rollback_depth();
    if (n <= depth) return;
    detail::check_rollback(name, n, depth,
                           ring_size_ == 0
                               ? std::string("its recurrent states hold only the last update")
                               : "it keeps its states from before each of its last " + std::to_string(ring_size_) +
                                     " steps; only steps of one token each can be undone");
  }

  // Rolls the slots back by -tokens_to_remove tokens: from the ring (a slot whose recurrent state
  // was written, or any slot when not recording), else by cutting the recorded conv columns, keeping
  // the kernel size before the cut (crop(0) shrinks them to the kernel size). Throws
  // kvc::RuntimeError as check_crop does, changing nothing.
  void crop(std::int64_t tokens_to_remove) { commit_crop(prepare_crop(tokens_to_remove)); }

 private:
  struct slot_crop {
    std::int64_t pops = 0;  // ring entries taken back; the oldest of them is the slot restored
    bool cut = false;       // the recorded conv state is replaced by `conv`
    detail::dense_state<S> conv;
    bool trimmed = false;
    bool emptied = false;     // the crop removes every column the slot was given
    bool clear_ring = false;  // columns were cut outside the ring: its entries no longer match
  };

 public:
  // crop in two steps (Cache::crop prepares every layer before it changes any): prepare_crop, which
  // changes nothing, builds the cut conv states aside and finds the ring entries to restore;
  // commit_crop swaps them in.
  using crop_plan = std::vector<slot_crop>;
  // Checks the crop (as check_crop) and returns the plan; changes nothing.
  crop_plan prepare_crop(std::int64_t tokens_to_remove) const {
    check_crop(tokens_to_remove);
    const std::int64_t n = detail::crop_count(tokens_to_remove, max_extent);
    crop_plan plan(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const slot& s = slots_[i];
      slot_crop& p = plan[i];
      if (uses_ring(s))
        p.pops = std::min<std::int64_t>(n, static_cast<std::int64_t>(s.steps));
      else
        p.clear_ring = n > 0;
      if (!record_past_ || !s.conv.initialized || !s.has_previous_state) continue;  // nothing recorded
      if (p.pops > 0 && s.entry(s.steps - static_cast<std::size_t>(p.pops)).conv_captured)
        continue;  // the entry restores the conv state
      p.cut = true;
      const std::int64_t have = s.conv.last();
      p.emptied = p.pops == 0 && !s.trimmed && have <= n;  // every column goes: a slot never written
      if (p.emptied) continue;
      const std::int64_t stop = std::max<std::int64_t>(have - n, 0);
      const std::int64_t start = std::max<std::int64_t>(stop - s.kernel, 0);
      p.conv = make(3, {s.conv.extents[0], s.conv.extents[1], stop - start, 0}, false);
      S::copy_2d(p.conv.data.data(), stop - start, s.conv.data.data() + start, have, stop - start, s.conv.rows());
      p.trimmed = s.trimmed || start > 0;
    }
    return plan;
  }
  // Applies a plan from prepare_crop. Cannot throw.
  void commit_crop(crop_plan&& plan) noexcept {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slot& s = slots_[i];
      slot_crop& p = plan[i];
      if (p.pops > 0) {  // the restored entry takes the slot's buffers, to be reused by later steps
        s.steps -= static_cast<std::size_t>(p.pops);
        snapshot& e = s.entry(s.steps);
        swap_tensors(s.rec, e.rec);
        if (e.conv_captured) {
          swap_tensors(s.conv, e.conv);
          // A conv state from before recording began holds only the kernel's columns.
          s.trimmed = record_past_ && e.has_previous_state;
        }
        s.kernel = e.kernel;
        s.has_previous_state = e.has_previous_state;
        s.open = false;
      }
      if (p.cut) {
        s.conv = std::move(p.conv);
        s.trimmed = p.trimmed;
      }
      if (p.emptied) {
        s.has_previous_state = false;
        s.kernel = 0;
      }
      if (p.clear_ring) {
        s.steps = s.first = 0;
        s.open = false;
      }
    }
  }

  // Zeroes every state in place; no state has a previous state afterwards, and the rings are empty.
  void reset() {
    for (slot& s : slots_) {
      for (detail::dense_state<S>* d : {&s.conv, &s.rec, &s.full})
        if (d->data.size() > 0) S::zero_2d(d->data.data(), d->data.size(), d->data.size(), 1);
      s.has_previous_state = false;
      s.trimmed = false;
      s.steps = s.first = 0;
      s.open = false;
      s.uncounted = false;
    }
  }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer, in every state and
  // every ring entry (the Cache checks the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    // Built from empty slots, so that only the gathered buffers are allocated (a copy of this
    // layer first would hold every buffer twice at the peak).
    state out(LinearAttentionLayer{n_, ring_size_});
    out.record_past_ = record_past_;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slot& o = out.slots_[i];
      const slot& s = slots_[i];
      o.conv = s.conv.gathered(batch_indices);
      o.rec = s.rec.gathered(batch_indices);
      o.kernel = s.kernel;
      o.has_previous_state = s.has_previous_state;
      o.trimmed = s.trimmed;
      o.open = s.open;
      o.uncounted = s.uncounted;
      o.ring.reserve(s.steps);  // the live entries, oldest first
      for (std::size_t j = 0; j < s.steps; ++j) {
        const snapshot& e = s.entry(j);
        snapshot g;
        g.conv = e.conv.gathered(batch_indices);
        g.rec = e.rec.gathered(batch_indices);
        g.tokens = e.tokens;
        g.kernel = e.kernel;
        g.has_previous_state = e.has_previous_state;
        g.conv_captured = e.conv_captured;
        o.ring.push_back(std::move(g));
      }
      o.steps = s.steps;
    }
    return out;
  }

  // Calls f(buffer&) on each slot's conv, recurrent and last returned buffers and on its ring's, for
  // offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    for (slot& s : slots_) {
      f(s.conv.data);
      f(s.rec.data);
      f(s.full.data);
      for (snapshot& e : s.ring) {
        f(e.conv.data);
        f(e.rec.data);
      }
    }
  }

  // Saved state (docs/state.md): every slot's conv and recurrent states and its ring. What the last
  // update_conv_state returned is not state (the next call builds it afresh) and is not saved.
  LinearAttentionLayer kind() const noexcept { return {n_, ring_size_}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when number_of_states or rollback_states differ or the saved states are
  // inconsistent.
  template <class A>
  void transfer(A& ar) {
    ar.param("number_of_states", n_);
    ar.param("rollback_states", ring_size_);
    ar.value(record_past_);
    for (slot& s : slots_) {
      ar.value(s.kernel);
      ar.value(s.has_previous_state);
      ar.value(s.trimmed);
      ar.value(s.open);
      ar.value(s.uncounted);
      s.conv.transfer(ar);
      s.rec.transfer(ar);
      if constexpr (A::loading) {
        s.full = detail::dense_state<S>();
        check_slot(ar, s.conv, s.rec, s.kernel);
        ar.check(!s.trimmed || (s.conv.initialized && s.conv.last() >= s.kernel), "a linear-attention state's shape");
      }
      auto live = static_cast<std::int64_t>(s.steps);
      ar.value(live);
      if constexpr (A::loading) {
        ar.check(live >= 0 && live <= ring_size_, "more ring entries than rollback_states");
        // An entry takes at least 17 values of 8 bytes in the file: none is allocated past its end.
        ar.reserve(static_cast<std::uint64_t>(live) * 17 * 8, "the ring entries");
        s.ring = std::vector<snapshot>(static_cast<std::size_t>(live));
        s.first = 0;
        s.steps = static_cast<std::size_t>(live);
      }
      for (std::size_t j = 0; j < s.steps; ++j) {  // oldest first
        snapshot& e = s.entry(j);
        ar.value(e.tokens);
        ar.value(e.kernel);
        ar.value(e.has_previous_state);
        ar.value(e.conv_captured);
        e.conv.transfer(ar);
        e.rec.transfer(ar);
        if constexpr (A::loading) {
          ar.check(e.tokens >= 1 && e.tokens <= max_extent, "a ring entry's token count");
          check_slot(ar, e.conv, e.rec, e.kernel);
          // An entry is the slot at an earlier step: the same channels and recurrent shape.
          ar.check((!e.conv.initialized || !s.conv.initialized || e.conv.extents[1] == s.conv.extents[1]) &&
                       (!e.rec.initialized || !s.rec.initialized ||
                        (e.rec.rank == s.rec.rank && e.rec.extents == s.rec.extents)),
                   "a ring entry's shape");
        }
      }
    }
    if constexpr (A::loading) {
      const std::int64_t b = batch();
      const auto same_batch = [b](const detail::dense_state<S>& d) { return !d.initialized || d.extents[0] == b; };
      for (const slot& s : slots_) {
        ar.check(same_batch(s.conv) && same_batch(s.rec), "the states' batch sizes differ");
        for (const snapshot& e : s.ring)
          ar.check(same_batch(e.conv) && same_batch(e.rec), "the states' batch sizes differ");
      }
    }
  }

 private:
  // A slot as it was before one of its steps.
  struct snapshot {
    detail::dense_state<S> conv, rec;
    std::int64_t tokens = 0;  // the step's tokens: the columns of its update_conv_state
    std::int64_t kernel = 0;
    bool has_previous_state = false;
    // Whether conv holds the conv state: not when taken while recording after the slot's first step
    // (the recorded columns are cut instead).
    bool conv_captured = false;
  };

  struct slot {
    detail::dense_state<S> conv, rec;
    detail::dense_state<S> full;  // what the last update_conv_state returned (while recording: conv)
    std::int64_t kernel = 0;
    bool has_previous_state = false;
    bool trimmed = false;  // a crop dropped recorded columns: those held are no longer every one seen
    // The ring: entry j (0 = the oldest of the `steps` live ones) is ring[(first + j) % ring.size()];
    // entries past the live ones keep their buffers for the next steps.
    std::vector<snapshot> ring;
    std::size_t first = 0, steps = 0;
    bool open = false;       // the last update was an update_conv_state (its step awaits its recurrent update)
    bool uncounted = false;  // a recurrent update with no step since the last reset: an unknown past

    snapshot& entry(std::size_t j) noexcept { return ring[(first + j) % ring.size()]; }
    const snapshot& entry(std::size_t j) const noexcept { return ring[(first + j) % ring.size()]; }
  };

  // The copies of a slot that a step's ring entry needs and whose buffers do not fit the entry it
  // will fill (the oldest entry once the ring is full, else a spare one, else a new one).
  struct pending_entry {
    std::optional<detail::dense_state<S>> conv, rec;
  };

  bool uses_ring(const slot& s) const noexcept { return ring_size_ > 0 && (s.rec.initialized || !record_past_); }

  // The entry the slot's next step fills: the physical index, ring.size() for a new one.
  std::size_t next_entry(const slot& s) const noexcept {
    if (s.steps < s.ring.size()) return (s.first + s.steps) % s.ring.size();
    if (static_cast<std::int64_t>(s.ring.size()) < ring_size_) return s.ring.size();
    return s.first;
  }

  // Allocates what the slot's next ring entry needs (may throw; changes nothing but the ring's
  // capacity).
  pending_entry prepare_entry(std::int64_t state_idx) {
    pending_entry p;
    if (ring_size_ == 0) return p;
    slot& s = slots_[static_cast<std::size_t>(state_idx)];
    const std::size_t j = next_entry(s);
    if (j == s.ring.size())
      s.ring.reserve(std::min<std::size_t>(static_cast<std::size_t>(ring_size_), std::max<std::size_t>(4, 2 * j)));
    const detail::dense_state<S> none{};
    const detail::dense_state<S>& conv = captures_conv(s) ? std::as_const(s.conv) : none;
    if (j == s.ring.size() || !s.ring[j].conv.fits(conv)) p.conv = conv;
    if (j == s.ring.size() || !s.ring[j].rec.fits(s.rec)) p.rec = s.rec;
    return p;
  }

  // Writes the slot as it is into its next ring entry, as a step of `tokens`: moves and in-place
  // copies only (no allocation).
  void commit_entry(slot& s, pending_entry&& p, std::int64_t tokens) {
    const std::size_t j = next_entry(s);
    // A ring below its full size has first == 0 (first moves only once the ring is full), so a new
    // entry goes at the end; its capacity was reserved.
    if (j == s.ring.size()) s.ring.emplace_back();
    snapshot& e = s.ring[j];
    const detail::dense_state<S> none{};
    const bool captured = captures_conv(s);
    if (p.conv)
      e.conv = std::move(*p.conv);
    else
      e.conv.assign_in_place(captured ? std::as_const(s.conv) : none);
    if (p.rec)
      e.rec = std::move(*p.rec);
    else
      e.rec.assign_in_place(s.rec);
    e.tokens = tokens;
    e.kernel = s.kernel;
    e.has_previous_state = s.has_previous_state;
    e.conv_captured = captured;
    // The copies done (a device copy can throw), the entry joins the live ones.
    if (s.steps == s.ring.size())
      s.first = (s.first + 1) % s.ring.size();  // full: the oldest entry made room
    else
      ++s.steps;
    s.open = true;
  }

  // Whether a ring entry taken now copies the conv state: always, but while recording only before
  // the slot's first step (afterwards a crop cuts the recorded columns instead).
  bool captures_conv(const slot& s) const noexcept { return !record_past_ || !s.has_previous_state; }

  std::int64_t slot_depth(const slot& s) const noexcept {
    const std::int64_t columns = (record_past_ && s.trimmed) ? s.conv.last() - s.kernel : unbounded_rollback;
    if (!uses_ring(s)) return (record_past_ && !s.rec.initialized) ? columns : 0;
    if (!s.has_previous_state && s.steps == 0 && !s.uncounted) return unbounded_rollback;  // no step yet
    // The one-token steps at the ring's end; an entry without its conv state also needs the
    // recorded columns back to it.
    std::size_t ones = 0;
    while (ones < s.steps) {
      const snapshot& e = s.entry(s.steps - 1 - ones);
      if (e.tokens != 1 || (!e.conv_captured && static_cast<std::int64_t>(ones) + 1 > columns)) break;
      ++ones;
    }
    const bool from_empty = ones == s.steps && s.steps > 0 && !s.entry(0).has_previous_state && !s.uncounted;
    return from_empty ? unbounded_rollback : static_cast<std::int64_t>(ones);
  }

  static void swap_tensors(detail::dense_state<S>& a, detail::dense_state<S>& b) noexcept {
    a.data.swap(b.data);
    std::swap(a.rank, b.rank);
    std::swap(a.extents, b.extents);
    std::swap(a.initialized, b.initialized);
  }

  template <class A>
  static void check_slot(A& ar, const detail::dense_state<S>& conv, const detail::dense_state<S>& rec,
                         std::int64_t kernel) {
    ar.check(kernel >= 0 && kernel <= max_extent && (!conv.initialized || conv.rank == 3) &&
                 (!rec.initialized || rec.rank >= 1),
             "a linear-attention state's shape");
  }

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
  std::int64_t ring_size_;
  std::vector<slot> slots_;
  bool record_past_ = false;
};

// SpeculativeLinearAttentionLayer<R>'s layer over storage S: a LinearAttentionLayer state whose
// rollback_states is at least R.
template <std::int64_t R>
template <class S>
class SpeculativeLinearAttentionLayer<R>::state : public LinearAttentionLayer::state<S> {
  using base = LinearAttentionLayer::state<S>;

 public:
  // The layer kind this state belongs to.
  using kind_type = SpeculativeLinearAttentionLayer<R>;

  // Empty slots keeping max(R, rollback_states) steps. Throws kvc::ValueError as
  // LinearAttentionLayer does.
  explicit state(const SpeculativeLinearAttentionLayer& kind) : base(with_ring(kind)) {}

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer.
  state gathered(std::span<const std::int64_t> batch_indices) const { return state(base::gathered(batch_indices)); }
  // The kind with this layer's slots and ring (saved states).
  SpeculativeLinearAttentionLayer kind() const noexcept { return {base::kind()}; }

 private:
  explicit state(base&& b) : base(std::move(b)) {}
  static LinearAttentionLayer with_ring(const SpeculativeLinearAttentionLayer& kind) noexcept {
    return {kind.number_of_states, std::max(kind.rollback_states, R)};
  }
};

}  // namespace kvc

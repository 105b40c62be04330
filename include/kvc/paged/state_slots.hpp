#pragma once
// kvc::paged::StateSlots and StatePools<S>: where a paged cache keeps the linear-attention states
// of a hybrid model (docs/paged.md, "Layers with linear-attention states"). A request's conv and
// recurrent states have a fixed size whatever its length, so they are not paged by tokens: each
// request that holds blocks holds one state slot, and every (layer with states, state index) pair
// keeps one conv tensor [slots, channels, kernel] and one recurrent tensor [slots, ...] indexed by
// slot.
//
// StateSlots is the bookkeeping (which request holds which slot; changes go through an UndoLog, so
// that a transaction undoes them with the block tables'). StatePools holds the data and knows
// nothing of requests. A slot's states are "written" when their mark equals the slot's epoch, a
// number each taking of a slot gets afresh (never reused, also across rollbacks): a slot taken
// again reads as never written without being cleared. A state copy in a transaction saves the
// destination's states and marks first (PagedCache), and the rollback puts them back.

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/request_keys.hpp>
#include <kvc/paged/undo_log.hpp>

namespace kvc::paged {

// Which request holds which state slot: a free list, the slot of each holding request (by key
// index) and each slot's epoch. Changes go through an UndoLog.
class StateSlots {
 public:
  // No slots (a model without linear-attention states).
  StateSlots() = default;
  // `slots` free slots.
  explicit StateSlots(std::int64_t slots) : free_(slots), epoch_(static_cast<std::size_t>(slots), 0) {}

  // Returns the number of slots.
  std::int64_t slots() const noexcept { return free_.capacity(); }
  // Returns the number of slots no request holds.
  std::int64_t free_slots() const noexcept { return free_.size(); }
  // Returns the slot the request (by its key's index) holds, or -1.
  std::int64_t slot_of(RequestKey request) const {
    const auto it = held_.find(request.index);
    return it == held_.end() ? -1 : it->second;
  }
  // Returns the slot's epoch: a number no other taking of any slot had (0: never taken).
  std::uint64_t epoch(std::int64_t slot) const noexcept { return epoch_[static_cast<std::size_t>(slot)]; }

  // The smallest free slot (there must be one) becomes the request's (which must hold none), with
  // a new epoch. Strong guarantee; returns the slot.
  std::int64_t take(UndoLog& log, RequestKey request) {
    free_.keep(log);
    log.room(2, insert_undo_bytes + 2 * sizeof(void*) + sizeof(std::uint64_t));  // the insertion and the epoch
    auto [it, inserted] = held_.emplace(request.index, -1);
    undo_insert(log, held_, *it);
    it->second = free_.take_one(log);  // cannot fail: kept
    // The epoch's undo brings back the last holder's, for a slot given back and taken again in one
    // transaction; the counter is never undone, so no epoch is used twice.
    log.set(epoch_[static_cast<std::size_t>(it->second)], next_epoch_++);
    return it->second;
  }
  // The request's slot, if it holds one, is free again. Outside a transaction it allocates
  // nothing; in one, a std::bad_alloc is undone by the rollback.
  void give_back(UndoLog& log, RequestKey request) {
    const auto it = held_.find(request.index);
    if (it == held_.end()) return;
    const std::int64_t slot = it->second;
    free_.give_back(log, std::span(&slot, 1));
    kept_.erase(log, held_, it);
  }

 private:
  FreeIds free_;
  std::map<std::uint32_t, std::int64_t> held_;  // key index -> slot
  std::vector<std::uint64_t> epoch_;
  std::uint64_t next_epoch_ = 1;
  KeptNodes<std::map<std::uint32_t, std::int64_t>> kept_;
};

// The state data of a paged cache (or of its swap pool): for each of `entries` (layer with states,
// state index) pairs, a conv tensor [slots, channels, kernel] and a recurrent tensor [slots,
// shape...], each made (zeroed) when the entry's first state arrives, with that state's shape;
// and per slot and entry a mark saying whether the slot's state is written (StateSlots' epoch).
template <class S>
class StatePools {
 public:
  // The element type of the states (S's element_type).
  using T = typename S::element_type;

  // One (layer, state index) pair: its two tensors and their shapes (per slot).
  struct entry {
    typename S::buffer_type conv;         // [slots, channels, kernel], once shaped
    std::int64_t channels = 0;            // 0: not shaped yet
    std::int64_t kernel = 0;              // the conv window kept per slot
    typename S::buffer_type recurrent;    // [slots, shape...], once shaped
    int rank = 0;                         // the recurrent state's rank (0: not shaped yet)
    std::array<std::int64_t, 4> shape{};  // one slot's recurrent state, batch axis 1 included
    std::int64_t recurrent_size = 0;      // its elements
    // Returns the elements of one slot's conv state.
    std::int64_t conv_size() const noexcept { return channels * kernel; }
  };

  // No entries.
  StatePools() = default;
  // `entries` unshaped entries of `slots` slots each.
  StatePools(std::int64_t entries, std::int64_t slots)
      : entries_(static_cast<std::size_t>(entries)),
        slots_(slots),
        conv_marks_(static_cast<std::size_t>(kvc::detail::checked_elements({entries, slots}, sizeof(std::uint64_t))),
                    0),
        recurrent_marks_(conv_marks_.size(), 0) {}

  // Returns the number of (layer, state index) entries.
  std::int64_t entries() const noexcept { return static_cast<std::int64_t>(entries_.size()); }
  // Returns the number of slots.
  std::int64_t slots() const noexcept { return slots_; }
  // Returns entry e (its shapes and tensors).
  const entry& at(std::int64_t e) const { return entries_[static_cast<std::size_t>(e)]; }
  // Returns the bytes of every tensor made so far.
  std::int64_t bytes() const noexcept {
    std::int64_t n = 0;
    for (const entry& e : entries_) n += (e.conv_size() + e.recurrent_size) * slots_;
    return n * static_cast<std::int64_t>(sizeof(T));
  }

  // Whether slot s's conv (recurrent) state of entry e is written under `epoch`.
  bool conv_written(std::int64_t e, std::int64_t s, std::uint64_t epoch) const noexcept {
    return conv_marks_[mark(e, s)] == epoch;
  }
  // Whether slot s's recurrent state of entry e is written under `epoch`.
  bool recurrent_written(std::int64_t e, std::int64_t s, std::uint64_t epoch) const noexcept {
    return recurrent_marks_[mark(e, s)] == epoch;
  }
  // Returns the epoch slot s's conv state of entry e was last written under (0: never).
  std::uint64_t conv_mark(std::int64_t e, std::int64_t s) const noexcept { return conv_marks_[mark(e, s)]; }
  // Returns the epoch slot s's recurrent state of entry e was last written under (0: never).
  std::uint64_t recurrent_mark(std::int64_t e, std::int64_t s) const noexcept { return recurrent_marks_[mark(e, s)]; }
  // Marks slot s's conv state of entry e written under `epoch`.
  void mark_conv(std::int64_t e, std::int64_t s, std::uint64_t epoch) noexcept { conv_marks_[mark(e, s)] = epoch; }
  // Marks slot s's recurrent state of entry e written under `epoch`.
  void mark_recurrent(std::int64_t e, std::int64_t s, std::uint64_t epoch) noexcept {
    recurrent_marks_[mark(e, s)] = epoch;
  }
  // Slot s's conv state of entry e ([channels, kernel]) and recurrent state; the entry is shaped.
  T* conv(std::int64_t e, std::int64_t s) noexcept {
    entry& x = entries_[static_cast<std::size_t>(e)];
    return x.conv.data() + s * x.conv_size();
  }
  // The same, read-only.
  const T* conv(std::int64_t e, std::int64_t s) const noexcept { return const_cast<StatePools&>(*this).conv(e, s); }
  // Slot s's recurrent state of entry e; the entry is shaped.
  T* recurrent(std::int64_t e, std::int64_t s) noexcept {
    entry& x = entries_[static_cast<std::size_t>(e)];
    return x.recurrent.data() + s * x.recurrent_size;
  }
  // The same, read-only.
  const T* recurrent(std::int64_t e, std::int64_t s) const noexcept {
    return const_cast<StatePools&>(*this).recurrent(e, s);
  }

  // Entry e's conv tensor for `channels` x `kernel` per slot (zeroed), unless it has one: made
  // (kvc::ValueError past kvc's limit on a size, std::bad_alloc), then put in place, which cannot
  // fail (install). Strong guarantee.
  void shape_conv(std::int64_t e, std::int64_t channels, std::int64_t kernel) {
    if (at(e).channels == 0) install(e, make_conv(channels, kernel));
  }
  // Entry e's recurrent tensor for states of `shape` (rank `rank`) per slot (zeroed), unless it
  // has one. Strong guarantee.
  void shape_recurrent(std::int64_t e, int rank, const std::array<std::int64_t, 4>& shape) {
    if (at(e).rank == 0) install(e, make_recurrent(rank, shape));
  }
  // A conv tensor made for the shape, not yet in place: what install() puts in.
  struct made_conv {
    typename S::buffer_type data;  // [slots, channels, kernel], zeroed
    std::int64_t channels;         // per slot
    std::int64_t kernel;           // columns per channel
  };
  // A recurrent tensor made for the shape, not yet in place.
  struct made_recurrent {
    typename S::buffer_type data;       // [slots, shape...], zeroed
    int rank;                           // of one slot's state
    std::array<std::int64_t, 4> shape;  // one slot's state, batch axis 1 included
    std::int64_t size;                  // its elements
  };
  // Makes a zeroed conv tensor of every slot for `channels` x `kernel`.
  made_conv make_conv(std::int64_t channels, std::int64_t kernel) const {
    return {zeroed(kvc::detail::checked_elements({slots_, channels, kernel}, sizeof(T))), channels, kernel};
  }
  // Makes a zeroed recurrent tensor of every slot for states of `shape` (rank `rank`).
  made_recurrent make_recurrent(int rank, const std::array<std::int64_t, 4>& shape) const {
    std::int64_t per = 1;
    for (int r = 0; r < rank; ++r)
      if (!kvc::detail::mul_fits(per, shape[static_cast<std::size_t>(r)], per))
        throw ValueError("kvc::PagedCache: a recurrent state's elements overflow");
    return {zeroed(kvc::detail::checked_elements({slots_, per}, sizeof(T))), rank, shape, per};
  }
  // Puts a made conv tensor in place as entry e's.
  void install(std::int64_t e, made_conv&& m) noexcept {
    entry& x = entries_[static_cast<std::size_t>(e)];
    x.conv = std::move(m.data);
    x.channels = m.channels;
    x.kernel = m.kernel;
  }
  // Puts a made recurrent tensor in place as entry e's.
  void install(std::int64_t e, made_recurrent&& m) noexcept {
    entry& x = entries_[static_cast<std::size_t>(e)];
    x.recurrent = std::move(m.data);
    x.rank = m.rank;
    x.shape = m.shape;
    x.recurrent_size = m.size;
  }
  // Shapes every entry of this object that `o` has shaped and this one has not (what copies from
  // `o` need). Strong guarantee for each entry; entries shaped before a failure stay shaped (they
  // hold no written state).
  void shape_like(const StatePools& o) {
    for (std::int64_t e = 0; e < entries(); ++e) {
      const entry& x = o.at(e);
      if (x.channels > 0) shape_conv(e, x.channels, x.kernel);
      if (x.rank > 0) shape_recurrent(e, x.rank, x.shape);
    }
  }

  // Slot a of `from` (epoch ea) to slot b of `to` (epoch eb): the states written in a are copied
  // and marked written in b, the others marked unwritten. `to` is shaped like `from` (shape_like).
  // A slot onto itself only changes its marks.
  static void copy_slot(const StatePools& from, std::int64_t a, std::uint64_t ea, StatePools& to, std::int64_t b,
                        std::uint64_t eb) {
    for (std::int64_t e = 0; e < from.entries(); ++e) copy_entry(from, a, ea, to, b, eb, e);
  }
  // copy_slot for entry e alone.
  static void copy_entry(const StatePools& from, std::int64_t a, std::uint64_t ea, StatePools& to, std::int64_t b,
                         std::uint64_t eb, std::int64_t e) {
    const entry& x = from.at(e);
    const bool conv = from.conv_written(e, a, ea), rec = from.recurrent_written(e, a, ea);
    if (&from != &to || a != b) {
      if (conv) S::copy_2d(to.conv(e, b), x.conv_size(), from.conv(e, a), x.conv_size(), x.conv_size(), 1);
      if (rec)
        S::copy_2d(to.recurrent(e, b), x.recurrent_size, from.recurrent(e, a), x.recurrent_size, x.recurrent_size, 1);
    }
    to.mark_conv(e, b, conv ? eb : 0);
    to.mark_recurrent(e, b, rec ? eb : 0);
  }

 private:
  static typename S::buffer_type zeroed(std::int64_t n) {
    typename S::buffer_type b(n);
    S::zero_2d(b.data(), n, n, 1);
    return b;
  }
  std::size_t mark(std::int64_t e, std::int64_t s) const noexcept {
    return static_cast<std::size_t>(s * entries() + e);
  }

  std::vector<entry> entries_;
  std::int64_t slots_ = 0;
  std::vector<std::uint64_t> conv_marks_, recurrent_marks_;  // [slot, entry]
};

}  // namespace kvc::paged

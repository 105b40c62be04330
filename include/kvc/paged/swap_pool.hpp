#pragma once
// kvc::paged::SwapPool<S>: where a paged cache offloads whole requests when its blocks run out,
// one of its three parts (with the block tables and the page pools, docs/paged.md). Pages of the
// cache's geometry in memory of the storage's kind (host memory for HostStorage), a free list and,
// per offloaded request (by its key), the swap blocks it holds in table order and its block count per group.
// It keeps the bookkeeping; the cache copies the pages. Changes go through an UndoLog, so that a
// transaction over the cache undoes them with the rest.

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/page_pools.hpp>
#include <kvc/paged/request_keys.hpp>
#include <kvc/paged/state_slots.hpp>
#include <kvc/paged/undo_log.hpp>

namespace kvc::paged {

// The swap pool of a paged cache: swap pages of the cache's geometry in S's memory, a free list
// and, per offloaded request, the swap blocks it holds. It keeps the bookkeeping; the cache copies
// the pages.
template <class S>
class SwapPool {
 public:
  // An offloaded request's swap blocks and its block count per layer group.
  struct entry {
    std::vector<std::int64_t> swap_ids;      // in table order, group after group
    std::vector<std::int64_t> group_counts;  // blocks per group
  };

  // An empty pool (no blocks until reserve()) for pages of `geo` in `tensors` K and V buffers, and
  // for `state_entries` linear-attention states per request (0 for a model without them).
  SwapPool(const PageGeometry& geo, std::int64_t tensors, std::int64_t state_entries = 0)
      : pages_(geo), tensors_(tensors), state_entries_(state_entries) {}
  // Copies the pages, the states and the bookkeeping. May throw std::bad_alloc.
  SwapPool(const SwapPool& o)
      : pages_(o.pages_),
        tensors_(o.tensors_),
        state_entries_(o.state_entries_),
        free_(o.free_),
        swapped_(o.swapped_),
        slots_(o.slots_),
        states_(o.states_) {}
  // Takes over the other pool's pages and bookkeeping.
  SwapPool(SwapPool&&) noexcept = default;
  // Takes over the other pool's pages and bookkeeping.
  SwapPool& operator=(SwapPool&&) noexcept = default;
  // Copies `o` (copy, then move): may throw std::bad_alloc, leaving this pool unchanged.
  SwapPool& operator=(const SwapPool& o) { return *this = SwapPool(o); }

  // (Re)creates an empty pool of `num_blocks` blocks and `state_slots` state slots (their tensors
  // are made at the first offload of a request with states); refused while requests are
  // offloaded.
  void reserve(std::int64_t num_blocks, std::int64_t state_slots = 0) {
    if (!swapped_.empty())
      throw ValueError("kvc::PagedCache: the swap pool cannot be resized while " + std::to_string(swapped_.size()) +
                       " requests are offloaded to it");
    kvc::detail::check_size("kvc::PagedCache: swap blocks", num_blocks, 0, max_extent);
    kvc::detail::check_size("kvc::PagedCache: swap state slots", state_slots, 0, max_extent);
    const std::int64_t n = state_entries_ > 0 ? state_slots : 0;
    PagePools<S> pages(pages_.geometry(), num_blocks, tensors_, false);
    FreeIds free(num_blocks);
    StateSlots slots(n);
    StatePools<S> states(n > 0 ? state_entries_ : 0, n);
    pages_ = std::move(pages);
    free_ = std::move(free);
    slots_ = std::move(slots);
    states_ = std::move(states);
  }

  // Returns the number of swap blocks (0 before reserve()).
  std::int64_t blocks() const noexcept { return pages_.blocks(); }
  // Returns the number of swap blocks that no offloaded request holds.
  std::int64_t free_blocks() const noexcept { return free_.size(); }
  // Returns true when the request (by its key's index) is offloaded to the pool.
  bool is_offloaded(RequestKey request) const { return swapped_.count(request.index) != 0; }
  // Returns the offloaded request's entry (by its key's index); nullptr when it is not offloaded.
  const entry* find(RequestKey request) const {
    const auto it = swapped_.find(request.index);
    return it == swapped_.end() ? nullptr : &it->second;
  }
  // The swap pages, which the cache copies blocks to and from.
  PagePools<S>& pages() noexcept { return pages_; }
  // The swap pages, read-only.
  const PagePools<S>& pages() const noexcept { return pages_; }
  // Returns the state slots (which offloaded request holds which).
  const StateSlots& state_slots() const noexcept { return slots_; }
  // The states of the offloaded requests, which the cache copies to and from.
  StatePools<S>& states() noexcept { return states_; }
  // The same, read-only.
  const StatePools<S>& states() const noexcept { return states_; }

  // The smallest free swap blocks, as many as the counts add up to (there must be that many free),
  // become the request's, and with `state` the smallest free state slot (there must be one).
  // Strong guarantee; returns its entry.
  const entry& take(UndoLog& log, RequestKey request, std::vector<std::int64_t> group_counts, bool state = false) {
    entry out;
    std::int64_t n = 0;
    for (const std::int64_t c : group_counts) n += c;
    out.swap_ids.reserve(static_cast<std::size_t>(n));
    out.group_counts = std::move(group_counts);
    free_.keep(log);
    if (state) (void)slots_.take(log, request);  // first: nothing else has changed if it throws
    try {
      log.room(1, insert_undo_bytes);
      auto [slot, inserted] = swapped_.emplace(request.index, std::move(out));
      undo_insert(log, swapped_, *slot);
      free_.take(log, n, slot->second.swap_ids);  // cannot fail: kept, and room made
      return slot->second;
    } catch (...) {
      if (state && !log.active()) slots_.give_back(log, request);  // (in a transaction: the rollback)
      throw;
    }
  }
  // The request's swap blocks return to the free list (kept ascending). Outside a transaction it
  // allocates nothing and cannot fail; in one, a std::bad_alloc is undone by the rollback.
  void give_back(UndoLog& log, RequestKey request) {
    const auto it = swapped_.find(request.index);
    if (it == swapped_.end()) return;
    free_.give_back(log, it->second.swap_ids);
    slots_.give_back(log, request);
    kept_.erase(log, swapped_, it);
  }

 private:
  PagePools<S> pages_;
  std::int64_t tensors_;
  std::int64_t state_entries_ = 0;  // linear-attention states per request
  FreeIds free_;                    // the swap blocks no offloaded request holds
  std::map<std::uint32_t, entry> swapped_;
  StateSlots slots_;      // the offloaded requests' state slots
  StatePools<S> states_;  // their states
  // Transactions: the entries erased.
  KeptNodes<std::map<std::uint32_t, entry>> kept_;
};

}  // namespace kvc::paged

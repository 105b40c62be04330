#pragma once
// kvc::paged::BlockTables: the block tables of a paged cache, one of its three parts (with the page
// pools and the swap pool, docs/paged.md). It owns the BlockManager and one allocator per layer
// group, and does every operation that spans the groups all or nothing: allocate for one request
// or several, free, truncate, fork, match a prompt's prefix, and list the rows a step reads and
// writes. It is the only code that knows the allocator kinds (a full-attention table or a
// sliding-window ring); the rest asks it by group index. Requests are keys (request_keys.hpp): the
// tables keep each request's id once, for messages and for the cache's lookups by id.
//
// It moves no data: where an operation needs blocks copied (a fork's private blocks, a truncation's
// private last block) it returns the (source, destination) block ids, and the cache copies the
// pages. Every change goes through the manager's UndoLog (log()), so that one transaction covers
// the tables, the manager and whatever else the caller records there.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/allocators.hpp>
#include <kvc/paged/block_manager.hpp>
#include <kvc/paged/request_keys.hpp>
#include <kvc/paged/state_slots.hpp>
#include <kvc/paged/undo_log.hpp>

namespace kvc::paged {

// Block ids to copy, source[i] to destination[i].
struct BlockCopies {
  // The blocks to copy from.
  std::vector<std::int64_t> source;
  // The block each source block is copied to (same index).
  std::vector<std::int64_t> destination;
};

// The block tables of a paged cache: the BlockManager and one allocator per layer group, with every
// operation that spans the groups done all or nothing. It moves no data: it returns block copies.
class BlockTables {
  using allocator = std::variant<FullAttentionCacheAllocator, SlidingAttentionCacheAllocator>;

  // f(group g's allocator), as whichever kind it is.
  template <class F>
  decltype(auto) visit(std::int64_t g, F&& f) const {
    return std::visit(std::forward<F>(f), allocators_[checked_group(g)]);
  }
  std::size_t checked_group(std::int64_t g) const {
    if (g < 0 || g >= static_cast<std::int64_t>(allocators_.size()))
      throw IndexError("kvc::PagedCache: layer group " + std::to_string(g) + " is out of range for " +
                       std::to_string(allocators_.size()) + " groups");
    return static_cast<std::size_t>(g);
  }

 public:
  // One allocator per group, of the group's attention type ("full_attention" or
  // "sliding_attention"; anything else is refused as transformers refuses it). Blocks num_blocks
  // and num_blocks + 1 are the padding zone no request gets (docs/paged.md). With state_slots > 0
  // (a model with linear-attention states) every request that holds blocks also holds one of that
  // many state slots, and prompts are matched against cached blocks only with `match_states` (the
  // caller keeps state snapshots to resume from: PagedCache).
  BlockTables(std::span<const std::string> group_types, std::int64_t num_blocks, std::int64_t block_size,
              std::optional<std::int64_t> sliding_window, bool allow_block_sharing, std::int64_t state_slots = 0,
              bool match_states = false)
      : manager_(num_blocks, block_size), slots_(state_slots) {
    for (const std::string& type : group_types)
      if (type != "full_attention" && type != "sliding_attention") throw ValueError("Invalid group type: " + type);
    for (std::size_t g = 0; g < group_types.size(); ++g) {
      const auto index = static_cast<std::int64_t>(g);
      if (group_types[g] == "full_attention") {
        allocators_.emplace_back(FullAttentionCacheAllocator(index, block_size, allow_block_sharing, &names_));
      } else {
        if (!sliding_window || *sliding_window < 1)
          throw ValueError("kvc::PagedCache: the model has sliding_attention layers but no sliding_window");
        allocators_.emplace_back(SlidingAttentionCacheAllocator(index, block_size, *sliding_window, sentinel_index(),
                                                                write_trash_index(), &names_));
      }
    }
    use_prefix_sharing_ = allow_block_sharing && group_types.size() == 1 && group_types[0] == "full_attention" &&
                          (state_slots == 0 || match_states);
    reserve_scratch();
  }
  // A copy has its own names: its allocators point at them.
  BlockTables(const BlockTables& o)
      : manager_(o.manager_),
        allocators_(o.allocators_),
        names_(o.names_),
        slots_(o.slots_),
        use_prefix_sharing_(o.use_prefix_sharing_),
        total_prefix_length_(o.total_prefix_length_),
        cut_groups_(o.cut_groups_) {
    reserve_scratch();
    point_at_names();
  }
  // Takes over the other object's manager, tables and names (the allocators point at the new
  // names).
  BlockTables(BlockTables&& o) noexcept
      : manager_(std::move(o.manager_)),
        allocators_(std::move(o.allocators_)),
        names_(std::move(o.names_)),
        slots_(std::move(o.slots_)),
        use_prefix_sharing_(o.use_prefix_sharing_),
        total_prefix_length_(o.total_prefix_length_),
        cut_groups_(std::move(o.cut_groups_)) {
    point_at_names();
  }
  // Copies `o` (copy, then move): may throw std::bad_alloc, leaving this object unchanged.
  BlockTables& operator=(const BlockTables& o) { return *this = BlockTables(o); }
  // Takes over the other object's manager, tables and names (the allocators point at the new
  // names).
  BlockTables& operator=(BlockTables&& o) noexcept {
    manager_ = std::move(o.manager_);
    allocators_ = std::move(o.allocators_);
    names_ = std::move(o.names_);
    slots_ = std::move(o.slots_);
    use_prefix_sharing_ = o.use_prefix_sharing_;
    total_prefix_length_ = o.total_prefix_length_;
    cut_groups_ = std::move(o.cut_groups_);
    point_at_names();
    return *this;
  }

  // ---- geometry -----------------------------------------------------------------------------------

  // Returns the number of tokens per block.
  std::int64_t block_size() const noexcept { return manager_.block_size(); }
  // Returns the number of blocks requests can get (the two padding blocks not counted).
  std::int64_t num_blocks() const noexcept { return manager_.num_blocks(); }
  // Returns the number of layer groups.
  std::int64_t num_groups() const noexcept { return static_cast<std::int64_t>(allocators_.size()); }
  // Returns true when group g is a sliding-window group; throws kvc::IndexError for g out of range.
  bool is_sliding(std::int64_t g) const {
    return visit(g, [](const auto& al) { return std::decay_t<decltype(al)>::is_sliding; });
  }
  // Returns the number of sliding-window groups.
  std::int64_t num_sliding_attention_groups() const noexcept {
    return std::count_if(allocators_.begin(), allocators_.end(),
                         [](const allocator& a) { return std::holds_alternative<SlidingAttentionCacheAllocator>(a); });
  }
  // Returns the number of full-attention groups.
  std::int64_t num_full_attention_groups() const noexcept { return num_groups() - num_sliding_attention_groups(); }
  // The sliding groups' window (every sliding group has the same), 0 without one.
  std::int64_t sliding_window() const noexcept {
    const auto* a = sliding_allocator();
    return a ? a->sliding_window() : 0;
  }
  // Returns the most blocks a sliding group's ring takes per request; 0 without sliding groups.
  std::int64_t max_sliding_window_blocks_per_request() const noexcept {
    const auto* a = sliding_allocator();
    return a ? a->max_blocks_per_request() : 0;
  }
  // Returns true when prompts are matched against cached blocks: block sharing is allowed and the
  // model has one full-attention group only.
  bool use_prefix_sharing() const noexcept { return use_prefix_sharing_; }
  // Whether some full-attention group hashes its complete blocks (allow_block_sharing).
  bool shares_blocks() const noexcept {
    return std::any_of(allocators_.begin(), allocators_.end(), [](const allocator& a) {
      const auto* full = std::get_if<FullAttentionCacheAllocator>(&a);
      return full && full->uses_block_sharing();
    });
  }
  // Returns the read-trash row (num_blocks * block_size, zeros): what padded reads see.
  std::int64_t read_trash_index() const noexcept { return num_blocks() * block_size(); }
  // Returns the sentinel row (the next one): "a new token goes here" in a sliding group's reads.
  std::int64_t sentinel_index() const noexcept { return read_trash_index() + 1; }
  // Returns the write-trash row ((num_blocks + 1) * block_size): where padded and dropped writes
  // go.
  std::int64_t write_trash_index() const noexcept { return (num_blocks() + 1) * block_size(); }
  // Returns the block manager.
  const BlockManager& manager() const noexcept { return manager_; }
  // Returns the state slots (none for a model without linear-attention states).
  const StateSlots& state_slots() const noexcept { return slots_; }
  // Returns the undo log every change goes through (the manager's).
  UndoLog& log() noexcept { return manager_.log(); }
  // Returns true while log() is in a transaction.
  bool in_transaction() const noexcept { return manager_.in_transaction(); }

  // ---- requests: keys and ids ------------------------------------------------------------------
  // Every operation below takes a request's key; the cache turns ids into keys at its interface.

  // Returns the requests' ids and keys.
  const RequestNames& names() const noexcept { return names_; }
  // The key of a request named by id or key: nullopt for an id the tables do not know; a KeyError
  // for a key that names no request.
  std::optional<RequestKey> find(RequestRef r) const {
    if (r.by_key()) return names_.check(r.key());
    return names_.find(r.id());
  }
  // The same, where the request must be known: an unknown id is transformers' "No block table
  // found for request {id}" (it has no table).
  RequestKey find_known(RequestRef r) const {
    if (const auto k = find(r)) return *k;
    throw ValueError("No block table found for request " + std::string(r.id()));
  }
  // The key, made for an id the tables do not know yet (through the log). Strong guarantee.
  RequestKey key(RequestRef r) {
    if (r.by_key()) return names_.check(r.key());
    return names_.add(log(), r.id());
  }
  // The request's id (for a key: the id it was made or opened with).
  std::string id(RequestRef r) const { return r.by_key() ? names_.name(r.key().index) : std::string(r.id()); }
  // Opens a request: its key names it until close(); refused for an id already open.
  RequestKey open(std::string_view id) {
    if (const auto k = names_.find(id); k && names_.opened(*k))
      throw ValueError("kvc::PagedCache::open_request: request " + std::string(id) + " is already open");
    const RequestKey k = names_.add(log(), id);
    names_.set_opened(log(), k, true);
    return k;
  }
  // Whether the request has a table in some group.
  bool has_any_table(RequestKey request) const {
    for (std::int64_t g = 0; g < num_groups(); ++g)
      if (has_table(g, request)) return true;
    return false;
  }
  // Forgets the request's id and key (its tables must be gone). Outside a transaction it
  // allocates nothing.
  void forget(RequestKey request) { names_.remove(log(), request); }

  // ---- the tables ---------------------------------------------------------------------------------

  // Returns true when the request has a table in group g; throws kvc::IndexError for a bad g.
  bool has_table(std::int64_t g, RequestKey request) const {
    return visit(g, [&](const auto& al) { return al.has_request(request); });
  }
  // The request's table in group g (a ValueError when it has none).
  const std::vector<std::int64_t>& table(std::int64_t g, RequestKey request) const {
    return visit(g, [&](const auto& al) -> const std::vector<std::int64_t>& { return al.table(request); });
  }
  // The requests with a table in group g: their keys (in key order), or their ids (in id order).
  std::vector<RequestKey> request_keys(std::int64_t g) const {
    return visit(g, [](const auto& al) { return al.requests(); });
  }
  // Returns the ids of the requests with a table in group g, in id order (IndexError for a bad g).
  std::vector<std::string> requests(std::int64_t g) const {
    std::vector<std::string> out;
    for (const RequestKey k : request_keys(g)) out.push_back(names_.name(k.index));
    std::sort(out.begin(), out.end());
    return out;
  }
  // Blocks the request holds in group g (0 without a table there), and over all groups.
  std::int64_t blocks_in_group(std::int64_t g, RequestKey request) const {
    return visit(g, [&](const auto& al) {
      return al.has_request(request) ? static_cast<std::int64_t>(al.table(request).size()) : std::int64_t{0};
    });
  }
  // Returns the number of blocks the request holds over all groups.
  std::int64_t blocks_in_use(RequestKey request) const {
    std::int64_t n = 0;
    for (std::int64_t g = 0; g < num_groups(); ++g) n += blocks_in_group(g, request);
    return n;
  }
  // The request's blocks, group after group, and (if asked) each group's count.
  std::vector<std::int64_t> request_blocks(RequestKey request, std::vector<std::int64_t>* counts = nullptr) const {
    std::vector<std::int64_t> blocks;
    for (std::int64_t g = 0; g < num_groups(); ++g) {
      const std::int64_t n = blocks_in_group(g, request);
      if (counts) counts->push_back(n);
      if (n > 0) {
        const auto& t = table(g, request);
        blocks.insert(blocks.end(), t.begin(), t.end());
      }
    }
    return blocks;
  }

  // ---- allocation ---------------------------------------------------------------------------------

  // Returns the number of free blocks (uninitialized, plus initialized ones that can be evicted).
  std::int64_t get_num_free_blocks() const noexcept { return manager_.num_free_blocks(); }
  // Blocks an allocation of n (logical) blocks takes over all groups, for a request holding
  // `allocated` logical blocks (its full-group count): n per full group, and per sliding group what
  // its ring still lacks, at most n. Saturated at the int64 limits (any count is accepted).
  std::int64_t blocks_needed(std::int64_t n, std::int64_t allocated) const noexcept {
    const std::int64_t sliding = num_sliding_attention_groups(), max_sliding = max_sliding_window_blocks_per_request();
    std::int64_t need = saturating_mul(n, num_groups() - sliding);
    if (sliding > 0) {
      // min(max(max_sliding - allocated, 0), n), without forming a difference that overflows
      const std::int64_t lack = n <= 0                        ? n
                                : allocated >= max_sliding    ? 0
                                : allocated < max_sliding - n ? n
                                                              : max_sliding - allocated;
      need = saturating_add(need, saturating_mul(lack, sliding));
    }
    return need;
  }

  // n more blocks for each of the requests in every group, all or nothing: nullopt, with nothing
  // changed, when they do not fit (a std::bad_alloc changes nothing either). What each group
  // takes comes from its own table (a sliding ring takes only what it lacks). Returns the most
  // blocks any group took for one request (n for full groups).
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, std::span<const RequestKey> request_ids) {
    std::vector<std::int64_t> takes;  // per request, then group
    takes.reserve(request_ids.size() * allocators_.size());
    std::int64_t total = 0;
    for (const RequestKey id : request_ids)
      for (std::int64_t g = 0; g < num_groups(); ++g) {
        takes.push_back(visit(g, [&](const auto& al) -> std::int64_t {
          if constexpr (std::decay_t<decltype(al)>::is_sliding) {
            return al.blocks_to_take(al.has_request(id) ? std::ssize(al.table(id)) : 0, n);
          } else {
            return n;
          }
        }));
        total = saturating_add(total, takes.back());
      }
    if (total > get_num_free_blocks() || slots_needed(n, request_ids) > slots_.free_slots()) return std::nullopt;
    // Every table and its room first, then the state slots (undone if one cannot be made), so that
    // taking the blocks afterwards allocates nothing.
    std::vector<char> made(takes.size(), 0);
    const std::size_t groups = allocators_.size();
    std::vector<char> took(n > 0 && slots_.slots() > 0 ? request_ids.size() : 0, 0);  // took a state slot
    try {
      for (std::size_t i = 0; i < takes.size(); ++i)
        made[i] = std::visit([&](auto& al) { return al.reserve_table(request_ids[i / groups], takes[i], manager_); },
                             allocators_[i % groups]);
      for (std::size_t i = 0; i < took.size(); ++i)
        if (slots_.slot_of(request_ids[i]) < 0) {
          slots_.take(log(), request_ids[i]);
          took[i] = 1;
        }
    } catch (...) {
      if (!log().active())  // (in a transaction, the rollback gives them back)
        for (std::size_t i = 0; i < took.size(); ++i)
          if (took[i]) slots_.give_back(log(), request_ids[i]);
      for (std::size_t i = 0; i < takes.size(); ++i)
        if (made[i])
          std::visit([&](auto& al) { al.drop_empty_table(request_ids[i / groups], manager_); },
                     allocators_[i % groups]);
      throw;
    }
    std::int64_t most = 0;
    for (std::size_t i = 0; i < takes.size(); ++i) {
      // Cannot come back empty after the checks above (value() would throw bad_optional_access).
      const auto got = std::visit([&](auto& al) { return al.allocate_blocks(n, request_ids[i / groups], manager_); },
                                  allocators_[i % groups]);
      most = std::max(most, got.value());
    }
    return most;
  }

  // Gives the request's blocks back in every group; a group where it has no table warns (as
  // transformers does) and goes on.
  void free_blocks(RequestKey request) {
    for (allocator& a : allocators_) std::visit([&](auto& al) { al.free_blocks(request, manager_); }, a);
    slots_.give_back(log(), request);
  }
  // Frees the request's blocks in every group where it has a table (no warning where it has none).
  void release(RequestKey request) {
    for (allocator& a : allocators_)
      std::visit(
          [&](auto& al) {
            if (al.has_request(request)) al.free_blocks(request, manager_);
          },
          a);
    slots_.give_back(log(), request);
  }
  // Every request's tables go; returns the keys that had one, ascending.
  std::vector<RequestKey> free_all_requests() {
    std::vector<RequestKey> all;
    for (std::int64_t g = 0; g < num_groups(); ++g)
      for (const RequestKey r : request_keys(g)) all.push_back(r);
    std::sort(all.begin(), all.end(), [](RequestKey a, RequestKey b) { return a.index < b.index; });
    all.erase(std::unique(all.begin(), all.end()), all.end());
    for (const RequestKey r : all) release(r);
    return all;
  }

  // Keeps the request's first `tokens` positions and gives back the blocks past them, in every
  // group. A partial last block that another request shares, or that is complete (hashed), is
  // replaced by a fresh block first: `copies` gets (old, fresh) for the caller to copy the pages.
  // False, with nothing changed, when no block is free for a copy. Allocates nothing once the
  // scratch and `copies` have room for one block per group (made here, before anything changes:
  // a caller that keeps them can truncate in the commit half of an all-or-nothing operation).
  bool truncate(RequestKey request, std::int64_t tokens, BlockCopies& copies) {
    const std::int64_t bs = block_size();
    const std::int64_t keep = (tokens + bs - 1) / bs;
    reserve_scratch();
    copies.source.reserve(allocators_.size());
    copies.destination.reserve(allocators_.size());
    std::vector<std::size_t>& copy = cut_groups_;  // groups whose last kept block needs a private copy
    copy.clear();
    copies.source.clear();
    copies.destination.clear();
    if (tokens % bs != 0)
      for (std::size_t g = 0; g < allocators_.size(); ++g) {
        const auto* full = std::get_if<FullAttentionCacheAllocator>(&allocators_[g]);
        if (!full || !full->uses_block_sharing() || blocks_in_group(static_cast<std::int64_t>(g), request) < keep)
          continue;
        const Block* b = manager_.block(full->table(request)[static_cast<std::size_t>(keep - 1)]);
        if (b && (b->is_complete() || b->ref_count > 1)) copy.push_back(g);
      }
    if (static_cast<std::int64_t>(copy.size()) > get_num_free_blocks()) return false;
    const auto at = static_cast<std::size_t>(keep - 1);
    for (const std::size_t g : copy) {  // cannot fail: counted above, room reserved
      const auto& t = std::get<FullAttentionCacheAllocator>(allocators_[g]).table(request);
      const std::optional<std::int64_t> parent = at > 0 ? std::optional(t[at - 1]) : std::nullopt;
      manager_.take_free_blocks(1, parent, true, static_cast<std::int64_t>(g), copies.destination);
      copies.source.push_back(t[at]);
    }
    for (std::size_t i = 0; i < copy.size(); ++i) {  // the old blocks are let go once every fresh one is taken
      auto& t = std::get<FullAttentionCacheAllocator>(allocators_[copy[i]]).mutable_table(request);
      keep_entry(log(), t, at);
      t[at] = copies.destination[i];
      manager_.decrease_ref_count(copies.source[i]);
    }
    for (std::size_t g = 0; g < allocators_.size(); ++g)
      if (blocks_in_group(static_cast<std::int64_t>(g), request) > 0)
        std::visit([&](auto& al) { al.truncate(request, keep, manager_); }, allocators_[g]);
    return true;
  }

  // ---- rows -----------------------------------------------------------------------------------------

  // The request's rows in group g for a step of q tokens after `past`, appended to `out`.
  void get_read_indices(std::int64_t g, RequestKey request, std::int64_t past, std::int64_t q,
                        std::vector<std::int64_t>& out) const {
    visit(g, [&](const auto& al) { al.get_read_indices(request, past, q, out); });
  }
  // The rows group g writes the step's q new tokens after `past` to, appended to `out`. Throws
  // kvc::IndexError for a bad g, kvc::ValueError for a missing or too short table.
  void get_write_indices(std::int64_t g, RequestKey request, std::int64_t past, std::int64_t q,
                         std::vector<std::int64_t>& out) const {
    visit(g, [&](const auto& al) { al.get_write_indices(request, past, q, out); });
  }
  // Group g's row of a decode kernel's block table (a full group's; sliding groups have none).
  void fill_block_table(std::int64_t g, RequestKey request, std::int64_t past, std::int64_t q,
                        std::span<std::int64_t> row) const {
    if (const auto* full = std::get_if<FullAttentionCacheAllocator>(&allocators_[checked_group(g)]))
      full->fill_block_table(request, past, q, row);
    else
      throw NotImplementedError("Sliding window attention layers do not support block table");
  }

  // ---- prefix sharing and forks -------------------------------------------------------------------

  // The prompt's leading whole blocks already in the cache (by hash) become the request's first
  // blocks; returns the number of prompt tokens they hold. 0 unless prefix sharing is on. With
  // state slots a match takes one for the request too (none free: no match, 0). Strong guarantee.
  std::int64_t search_prefix_match(RequestKey request, std::span<const std::int64_t> prompt_ids) {
    if (!use_prefix_sharing_) return 0;
    auto& full = std::get<FullAttentionCacheAllocator>(allocators_[0]);
    const bool slot = slots_.slots() > 0 && slots_.slot_of(request) < 0;
    if (slot) {
      if (slots_.free_slots() == 0) return 0;
      slots_.take(log(), request);
    }
    std::int64_t n = 0;
    try {
      n = full.search_prefix_match(request, prompt_ids, manager_);
      if (n == 0 && slot) slots_.give_back(log(), request);  // (outside a transaction: allocates nothing)
    } catch (...) {
      if (slot && !log().active()) slots_.give_back(log(), request);
      throw;
    }
    log().set(total_prefix_length_, total_prefix_length_ + n);
    return n;
  }
  // Returns the prompt tokens that prefix matches have found in the cache, in total.
  std::int64_t total_prefix_length() const noexcept { return total_prefix_length_; }

  // Hashes the request's newly completed blocks in every group that shares blocks.
  void mark_shareable_blocks_as_complete(RequestKey request, std::int64_t num_complete_blocks,
                                         std::span<const std::int64_t> token_ids) {
    if (num_complete_blocks <= 0) return;
    for (allocator& a : allocators_)
      if (auto* full = std::get_if<FullAttentionCacheAllocator>(&a); full && full->uses_block_sharing())
        manager_.mark_shareable_blocks_as_complete(num_complete_blocks, full->mutable_table(request), token_ids);
  }

  // The blocks of `source` a fork must copy, over all groups: all but the leading run of complete
  // blocks in groups that share blocks, all of them elsewhere.
  std::int64_t blocks_copied_per_fork(RequestKey source) const {
    std::int64_t n = 0;
    for (const allocator& a : allocators_)
      std::visit(
          [&](const auto& al) {
            const auto& t = al.table(source);
            n += static_cast<std::int64_t>(t.size() - (al.uses_block_sharing() ? manager_.complete_prefix(t) : 0));
          },
          a);
    return n;
  }

  // Tables for copies of each source under its destinations in every group, all forks or none;
  // returns the block copies the non-shared blocks need. With state slots each destination takes
  // one (the caller copies the source's states there).
  BlockCopies fork_requests(std::span<const std::pair<RequestKey, std::span<const RequestKey>>> forks) {
    std::int64_t copies = 0;
    std::vector<RequestKey> named;  // every destination so far
    for (const auto& [source, destinations] : forks) {
      copies += blocks_copied_per_fork(source) * static_cast<std::int64_t>(destinations.size());
      for (const RequestKey d : destinations) {
        if (has_any_table(d)) throw ValueError("Block table already exists for request " + names_.name(d.index));
        if (std::find(named.begin(), named.end(), d) != named.end())
          throw ValueError("kvc::paged: fork destination " + names_.name(d.index) + " is named twice");
        named.push_back(d);
      }
    }
    // Each destination of a source holding a state slot takes one (a source given no blocks holds
    // none, and neither will its copies).
    std::vector<RequestKey> slotted;
    if (slots_.slots() > 0)
      for (const auto& [source, destinations] : forks)
        if (slots_.slot_of(source) >= 0) slotted.insert(slotted.end(), destinations.begin(), destinations.end());
    if (copies > get_num_free_blocks() || static_cast<std::int64_t>(slotted.size()) > slots_.free_slots())
      throw ValueError("Failed to fork blocks for request " +
                       (forks.empty() ? std::string() : names_.name(forks.front().first.index)));
    // Every fork of every group is prepared (all the memory it needs), and every destination's
    // state slot taken, before any takes a block.
    std::vector<CacheAllocator::PreparedFork> prepared;  // fork-major, then group
    BlockCopies out;
    const std::size_t groups = allocators_.size();
    std::size_t took = 0;  // slotted[0, took) took a state slot
    try {
      prepared.reserve(forks.size() * groups);
      for (const auto& f : forks)  // (no structured binding: clang 14 lambdas cannot capture one)
        for (allocator& a : allocators_)
          prepared.push_back(std::visit([&](auto& al) { return al.prepare_fork(f.first, f.second, manager_); }, a));
      out.source.reserve(static_cast<std::size_t>(copies));
      out.destination.reserve(static_cast<std::size_t>(copies));
      for (; took < slotted.size(); ++took) (void)slots_.take(log(), slotted[took]);
    } catch (...) {
      if (!log().active())  // (in a transaction, the rollback gives them back)
        for (std::size_t i = 0; i < took; ++i) slots_.give_back(log(), slotted[i]);
      for (std::size_t i = 0; i < prepared.size(); ++i)
        std::visit([&](auto& al) { al.abandon_fork(prepared[i], manager_); }, allocators_[i % groups]);
      throw;
    }
    for (std::size_t i = 0; i < prepared.size(); ++i)  // fits: checked above, and nothing allocates
      std::visit([&](auto& al) { (void)al.commit_fork(forks[i / groups].first, prepared[i], manager_); },
                 allocators_[i % groups]);
    for (const auto& f : prepared) {
      out.source.insert(out.source.end(), f.blocks.copy_src.begin(), f.blocks.copy_src.end());
      out.destination.insert(out.destination.end(), f.blocks.copy_dst.begin(), f.blocks.copy_dst.end());
    }
    return out;
  }

 private:
  const SlidingAttentionCacheAllocator* sliding_allocator() const noexcept {
    for (const allocator& a : allocators_)
      if (const auto* s = std::get_if<SlidingAttentionCacheAllocator>(&a)) return s;
    return nullptr;
  }
  void reserve_scratch() { cut_groups_.reserve(allocators_.size()); }
  // The state slots an allocation of n blocks to the requests takes: one per request holding none
  // (each counted once), none for n <= 0 or a model without states.
  std::int64_t slots_needed(std::int64_t n, std::span<const RequestKey> requests) const {
    if (n <= 0 || slots_.slots() == 0) return 0;
    std::int64_t out = 0;
    for (std::size_t i = 0; i < requests.size(); ++i)
      if (slots_.slot_of(requests[i]) < 0 &&
          std::find(requests.begin(), requests.begin() + static_cast<std::ptrdiff_t>(i), requests[i]) ==
              requests.begin() + static_cast<std::ptrdiff_t>(i))
        ++out;
    return out;
  }
  void point_at_names() noexcept {
    for (allocator& a : allocators_) std::visit([&](auto& al) { al.set_names(&names_); }, a);
  }

  static std::int64_t saturating_mul(std::int64_t a, std::int64_t b) noexcept {
    std::int64_t out = 0;
    if (!__builtin_mul_overflow(a, b, &out)) return out;
    return (a < 0) == (b < 0) ? INT64_MAX : INT64_MIN;
  }
  static std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept {
    std::int64_t out = 0;
    if (!__builtin_add_overflow(a, b, &out)) return out;
    return a < 0 ? INT64_MIN : INT64_MAX;
  }

  BlockManager manager_;
  std::vector<allocator> allocators_;
  RequestNames names_;  // the requests' ids and keys (the allocators point at it)
  StateSlots slots_;    // who holds which linear-attention state slot
  bool use_prefix_sharing_ = false;
  std::int64_t total_prefix_length_ = 0;
  std::vector<std::size_t> cut_groups_;  // truncate's scratch: one entry per group at most
};

}  // namespace kvc::paged

#pragma once
// The per-group block tables of a paged cache and the cache rows each request reads and writes:
// transformers' FullAttentionCacheAllocator and SlidingAttentionCacheAllocator
// (generation/continuous_batching/cache_manager.py at a597f974). One allocator per layer group;
// all of them take blocks from the cache's one BlockManager.
//
// A row is a page: the K (or V) of one token of one layer, `block_size` rows per block, row
// `block * block_size + offset`. Full groups map position p to row
// table[p / block_size] * block_size + p % block_size. Sliding groups keep a ring of
// `sliding_window` slots over at most ceil(sliding_window / block_size) blocks: position p lives in
// slot p % sliding_window. That is the invariant transformers' ring arithmetic breaks at
// a597f974 (its read drops the newest cached token once past >= sliding_window, and a write of more
// than sliding_window tokens rotates the ring); kvc keeps it (docs/differences.md).
// Tables are indexed by the request's key (request_keys.hpp); the ids are only for messages.
// Tables change through the manager's UndoLog (BlockManager::log()), so that a transaction over
// the manager and the tables undoes both.

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/block_manager.hpp>
#include <kvc/paged/request_keys.hpp>
#include <kvc/warnings.hpp>

namespace kvc::paged {

// What both allocators share: the block table of each request of one group.
class CacheAllocator {
 public:
  // Returns the index of the allocator's layer group (part of its blocks' hashes).
  std::int64_t index() const noexcept { return index_; }
  // Returns the number of tokens per block.
  std::int64_t block_size() const noexcept { return block_size_; }
  // Returns true when the group's blocks are shareable (ref-counted, hashed once complete).
  bool uses_block_sharing() const noexcept { return sharing_; }
  // Where the ids of the keys are (the block tables point their allocators at their RequestNames).
  void set_names(const RequestNames* names) noexcept { names_ = names; }

  // Returns true when the request (by its key's index) has a table in the group.
  bool has_request(RequestKey request) const { return tables_.count(request.index) != 0; }
  // The request's blocks, in position order (ValueError for a request without a table).
  const std::vector<std::int64_t>& table(RequestKey request) const { return table_of(request); }
  // The request's blocks, to change in place (ValueError for a request without a table).
  std::vector<std::int64_t>& mutable_table(RequestKey request) { return table_of(request); }
  // Every request that has a table, in key order.
  std::vector<RequestKey> requests() const {
    std::vector<RequestKey> out;
    out.reserve(tables_.size());
    for (const auto& [index, t] : tables_) out.push_back(key_of(index));
    return out;
  }
  // Sets a request's table outright (prefix matches, restored requests).
  void set_table(RequestKey request, std::vector<std::int64_t> blocks) {
    tables_.insert_or_assign(request.index, std::move(blocks));
  }

  // transformers' warning for freeing a request that has no table in group `index`.
  static void warn_no_table(std::int64_t index, const std::string& request_id) {
    warn_once("CacheAllocator " + std::to_string(index) +
              " attempted to free blocks for non-existent request_id: " + request_id);
  }

  // Gives the request's blocks back to the manager and forgets its table; a request without one
  // only warns (transformers' text), as cancelling a request that never got blocks does.
  void free_blocks(RequestKey request, BlockManager& bm) {
    const auto it = tables_.find(request.index);
    if (it == tables_.end()) return warn_no_table(index_, name(request));
    bm.free_blocks(it->second, sharing_);
    kept_.erase(bm.log(), tables_, it);
  }

  // Keeps the first `keep` blocks of the request's table and gives the others back (the table
  // goes when none is kept). Freeing allocates nothing.
  void truncate(RequestKey request, std::int64_t keep, BlockManager& bm) {
    const auto it = tables_.find(request.index);
    if (it == tables_.end()) throw ValueError("No block table found for request " + name(request));
    std::vector<std::int64_t>& t = it->second;
    const auto k = static_cast<std::size_t>(std::clamp<std::int64_t>(keep, 0, std::ssize(t)));
    if (k == 0) {
      bm.free_blocks(t, sharing_);
      kept_.erase(bm.log(), tables_, it);
      return;
    }
    for (std::size_t i = k; i < t.size(); ++i) keep_entry(bm.log(), t, i);
    keep_size(bm.log(), t);
    bm.free_blocks(std::span(t).subspan(k), sharing_);
    t.resize(k);
  }

  // Gives each child a table for a copy of the parent (see BlockManager::fork_blocks) and returns
  // the block copies to make. Nothing changes when it throws.
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_blocks(RequestKey parent_request,
                                                                              std::span<const RequestKey> children,
                                                                              BlockManager& bm) {
    PreparedFork f = prepare_fork(parent_request, children, bm);
    if (!commit_fork(parent_request, f, bm)) {
      abandon_fork(f, bm);
      throw ValueError("Failed to fork blocks for request " + name(parent_request));
    }
    return {std::move(f.blocks.copy_src), std::move(f.blocks.copy_dst)};
  }

  // fork_blocks in steps, for a cache that forks several groups: prepare_fork checks the names and
  // allocates everything (the children's empty tables, the manager's ForkedBlocks) without taking a
  // block; commit_fork takes the blocks and fills the tables without allocating (false: too few
  // free blocks, nothing taken); abandon_fork undoes a prepared fork that is not committed.
  struct PreparedFork {
    // The children's tables prepare_fork made, still empty; cleared once committed or abandoned.
    std::vector<std::map<std::uint32_t, std::vector<std::int64_t>>::iterator> made;
    // The manager's prepared fork: the children's tables and, once committed, the copies to make.
    ForkedBlocks blocks;
  };
  // The first step: throws kvc::ValueError for a parent without a table or a child that has one or
  // is named twice; nothing changes when it throws (std::bad_alloc included).
  PreparedFork prepare_fork(RequestKey parent_request, std::span<const RequestKey> children, BlockManager& bm) {
    const auto parent = tables_.find(parent_request.index);
    if (parent == tables_.end()) throw ValueError("No block table found for request " + name(parent_request));
    for (std::size_t i = 0; i < children.size(); ++i) {
      const RequestKey child = children[i];
      if (tables_.count(child.index) != 0) throw ValueError("Block table already exists for request " + name(child));
      for (std::size_t j = 0; j < i; ++j)
        if (children[j] == child) throw ValueError("kvc::paged: fork destination " + name(child) + " is named twice");
    }
    PreparedFork f;
    try {
      f.made.reserve(children.size());
      for (const RequestKey child : children) f.made.push_back(make_table(child, bm.log()).first);
      f.blocks = bm.prepare_fork(parent->second, static_cast<std::int64_t>(children.size()), sharing_);
    } catch (...) {
      abandon_fork(f, bm);
      throw;
    }
    return f;
  }
  // The second step: returns false, with nothing taken, when the manager has too few free blocks.
  // Throws kvc::ValueError for a parent without a table.
  bool commit_fork(RequestKey parent_request, PreparedFork& f, BlockManager& bm) {
    const auto& parent = table_of(parent_request);
    if (!bm.commit_fork(parent, static_cast<std::int64_t>(f.made.size()), sharing_, index_, f.blocks)) return false;
    for (std::size_t i = 0; i < f.made.size(); ++i) f.made[i]->second = std::move(f.blocks.tables[i]);
    f.made.clear();  // committed: the tables stay
    return true;
  }
  // (In a transaction the tables stay until it is undone: a prepared fork is abandoned only on the
  // way out of a failed call.)
  void abandon_fork(PreparedFork& f, BlockManager& bm) noexcept {
    if (!bm.log().active())
      for (const auto& it : f.made) tables_.erase(it);
    f.made.clear();
  }

 protected:
  // The allocator of layer group `index` (blocks of `block_size` tokens, shareable when `sharing`);
  // `names` gives the requests' ids for messages (null: "#index").
  CacheAllocator(std::int64_t index, std::int64_t block_size, bool sharing, const RequestNames* names)
      : index_(index), block_size_(block_size), sharing_(sharing), names_(names) {}

  // A request's id, for messages ("#index" without a RequestNames).
  std::string name(RequestKey request) const {
    return names_ ? names_->name(request.index) : "#" + std::to_string(request.index);
  }
  // The current key of the request at dense index `index` (generation 0 without a RequestNames).
  RequestKey key_of(std::uint32_t index) const noexcept {
    return names_ ? names_->key_at(index) : RequestKey{index, 0};
  }

  // The request's block table. Throws kvc::ValueError when it has none.
  std::vector<std::int64_t>& table_of(RequestKey request) {
    const auto it = tables_.find(request.index);
    if (it == tables_.end()) throw ValueError("No block table found for request " + name(request));
    return it->second;
  }
  // The request's block table, read-only. Throws kvc::ValueError when it has none.
  const std::vector<std::int64_t>& table_of(RequestKey request) const {
    const auto it = tables_.find(request.index);
    if (it == tables_.end()) throw ValueError("No block table found for request " + name(request));
    return it->second;
  }

  // The cache row of slot s of a table (position for full groups, ring slot for sliding ones).
  std::int64_t row(const std::vector<std::int64_t>& t, std::int64_t s, RequestKey request) const {
    const std::int64_t b = s / block_size_;
    if (b >= static_cast<std::int64_t>(t.size()))
      throw ValueError("kvc::paged: request " + name(request) + " has " + std::to_string(t.size()) +
                       " blocks in group " + std::to_string(index_) + ", too few for slot " + std::to_string(s));
    return t[static_cast<std::size_t>(b)] * block_size_ + s % block_size_;
  }

  // The lengths of a step, checked before any arithmetic on them: >= 0, and within kvc's limit on
  // a size (so that past + q + block_size cannot overflow). `call` names the method for the latter.
  static void check_counts(std::int64_t past, std::int64_t q, std::string_view call) {
    if (past < 0 || q < 0)
      throw ValueError("kvc::paged: past and query lengths must be >= 0, got past " + std::to_string(past) + " and q " +
                       std::to_string(q));
    if (past > max_extent || q > max_extent) {  // (the names are only built for the message)
      kvc::detail::check_size(std::string(call) + ": past", past, 0, max_extent);
      kvc::detail::check_size(std::string(call) + ": q", q, 0, max_extent);
    }
  }
  // Room for `more` rows after `out`'s, refused (ValueError) past kvc::allocation_limit() before
  // anything is allocated: a step's rows grow with its q.
  static void check_rows(const std::vector<std::int64_t>& out, std::int64_t more) {
    (void)kvc::detail::checked_elements({static_cast<std::int64_t>(out.size()) + more}, sizeof(std::int64_t));
  }

 public:
  // Makes the request's table if it has none, and room in it for n more blocks (what a later
  // allocate_blocks of up to n then takes without allocating); true if it made the table.
  bool reserve_table(RequestKey request, std::int64_t n, BlockManager& bm) {
    const auto [it, created] = make_table(request, bm.log());
    try {
      std::vector<std::int64_t>& t = it->second;
      if (t.capacity() - t.size() < static_cast<std::size_t>(n))
        t.reserve(std::max(t.size() + static_cast<std::size_t>(n), 2 * t.capacity()));
    } catch (...) {
      if (created && !bm.log().active()) tables_.erase(it);  // (a transaction's undo erases it)
      throw;
    }
    return created;
  }
  // Forgets a table reserve_table made and nothing filled, on the way out of a failed call (in a
  // transaction its undo does).
  void drop_empty_table(RequestKey request, BlockManager& bm) noexcept {
    if (bm.log().active()) return;
    const auto it = tables_.find(request.index);
    if (it != tables_.end() && it->second.empty()) tables_.erase(it);
  }

 protected:
  // n more blocks at the end of the request's table, all or none (false: too few free). The table
  // and its room are made first: once the manager has handed the blocks out, nothing allocates.
  bool grow_table(RequestKey request, std::int64_t n, bool chained, BlockManager& bm) {
    const bool created = reserve_table(request, n, bm);  // grown geometrically: appends stay amortized O(1)
    const auto it = tables_.find(request.index);
    try {
      std::vector<std::int64_t>& t = it->second;
      const std::optional<std::int64_t> last =
          chained && !t.empty() ? std::optional<std::int64_t>(t.back()) : std::nullopt;
      keep_size(bm.log(), t);
      if (bm.take_free_blocks(n, last, chained && sharing_, index_, t)) return true;
    } catch (...) {
      if (created && !bm.log().active()) tables_.erase(it);
      throw;
    }
    if (created) kept_.erase(bm.log(), tables_, it);
    return false;
  }

  using table_map = std::map<std::uint32_t, std::vector<std::int64_t>>;  // by key index

  // The request's table, made (empty) if it has none; its making goes through the log.
  std::pair<table_map::iterator, bool> make_table(RequestKey request, UndoLog& log) {
    log.room(1, insert_undo_bytes);
    const auto made = tables_.try_emplace(request.index);
    if (made.second) undo_insert(log, tables_, *made.first);
    return made;
  }

  // The layer group this allocator serves.
  std::int64_t index_;
  // Tokens per block.
  std::int64_t block_size_;
  // Whether blocks may be shared between requests (ref counts, prefix reuse).
  bool sharing_;
  const RequestNames* names_;  // the ids of the keys (the block tables': docs/paged.md)
  // Each request's block table, by dense request index.
  table_map tables_;
  KeptNodes<table_map> kept_;  // tables a transaction erased
};

// A full-attention group: the table grows by whole blocks, blocks are shareable (ref counts,
// hashes, prefix reuse) when block sharing is allowed.
class FullAttentionCacheAllocator : public CacheAllocator {
 public:
  // The allocator of full-attention group `index`, its blocks shareable when `allow_block_sharing`;
  // `names` gives the requests' ids for messages.
  FullAttentionCacheAllocator(std::int64_t index, std::int64_t block_size, bool allow_block_sharing,
                              const RequestNames* names = nullptr)
      : CacheAllocator(index, block_size, allow_block_sharing, names) {}

  // False: a full-attention group (how BlockTables tells the kinds apart).
  static constexpr bool is_sliding = false;

  // n more blocks for the request (chained from its last one); nullopt, with nothing changed, if
  // the manager has not enough. Returns n.
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, RequestKey request, BlockManager& bm) {
    if (n < 0) throw ValueError("kvc::paged::BlockManager: cannot take " + std::to_string(n) + " blocks");
    if (!grow_table(request, n, true, bm)) return std::nullopt;
    return n;
  }

  // Prefix sharing (transformers' PagedAttentionCache.search_prefix_match): the leading whole blocks
  // of `prompt_ids` whose chained hashes are registered become the request's table, one more
  // reference each, stopping at the first miss. Returns the number of prompt tokens they hold
  // (hits * block_size). A request that already has blocks is refused (ValueError): the match is
  // where a request's table starts. Only meaningful with block sharing on.
  std::int64_t search_prefix_match(RequestKey request, std::span<const std::int64_t> prompt_ids, BlockManager& bm) {
    if (const auto it = tables_.find(request.index); it != tables_.end() && !it->second.empty())
      throw ValueError("kvc::paged: request " + name(request) + " already has blocks; a prefix match starts a table");
    std::vector<std::int64_t> hits;
    std::optional<std::uint64_t> parent;
    const auto whole = static_cast<std::int64_t>(prompt_ids.size()) / block_size_;
    for (std::int64_t b = 0; b < whole; ++b) {
      const std::uint64_t h = compute_block_hash(
          parent, prompt_ids.subspan(static_cast<std::size_t>(b * block_size_), static_cast<std::size_t>(block_size_)),
          index_);
      const auto id = bm.find_hash(h);
      if (!id) break;
      hits.push_back(*id);
      parent = h;
    }
    if (hits.empty()) return 0;
    // First: making the table is the step that can run out of memory.
    const auto [it, made] = make_table(request, bm.log());
    try {
      keep_size(bm.log(), it->second);
      it->second.assign(hits.begin(), hits.end());
    } catch (...) {
      if (made && !bm.log().active()) tables_.erase(it);
      throw;
    }
    for (const std::int64_t id : hits) bm.increase_ref_count(id);
    return static_cast<std::int64_t>(hits.size()) * block_size_;
  }

  // Rows of positions 0 .. past + q - 1 (the write comes first, so the new tokens are included).
  void get_read_indices(RequestKey request, std::int64_t past, std::int64_t q, std::vector<std::int64_t>& out) const {
    check_counts(past, q, "kvc::paged::FullAttentionCacheAllocator::get_read_indices");
    positions(table_of(request), 0, past + q, request, out);
  }
  // Rows of positions past .. past + q - 1.
  void get_write_indices(RequestKey request, std::int64_t past, std::int64_t q, std::vector<std::int64_t>& out) const {
    check_counts(past, q, "kvc::paged::FullAttentionCacheAllocator::get_write_indices");
    positions(table_of(request), past, past + q, request, out);
  }
  // The rows of positions [from, to), a block's run at a time. The table must hold position to - 1
  // (refused before anything is appended: the first position past the table is named); `out`
  // grows geometrically, so that a step's lists built request by request stay linear.
  void positions(const std::vector<std::int64_t>& t, std::int64_t from, std::int64_t to, RequestKey request,
                 std::vector<std::int64_t>& out) const {
    if (to <= from) return;
    const std::int64_t held = static_cast<std::int64_t>(t.size()) * block_size_;
    if (to > held) (void)row(t, std::max(from, held), request);  // throws, naming the slot
    const auto n = static_cast<std::size_t>(to - from);
    if (out.capacity() - out.size() < n) out.reserve(std::max(out.size() + n, 2 * out.capacity()));
    for (std::int64_t p = from; p < to;) {
      const std::int64_t off = p % block_size_, len = std::min(block_size_ - off, to - p);
      const std::int64_t base = t[static_cast<std::size_t>(p / block_size_)] * block_size_ + off;
      for (std::int64_t i = 0; i < len; ++i) out.push_back(base + i);
      p += len;
    }
  }

  // The first ceil((past + q) / block_size) blocks of the table, into `row` (a block-table row of
  // a paged attention kernel; the rest of it is left as it is).
  void fill_block_table(RequestKey request, std::int64_t past, std::int64_t q, std::span<std::int64_t> out) const {
    check_counts(past, q, "kvc::paged::FullAttentionCacheAllocator::fill_block_table");
    const auto& t = table_of(request);
    const std::int64_t n = (past + q + block_size_ - 1) / block_size_;
    if (n > static_cast<std::int64_t>(t.size()) || n > static_cast<std::int64_t>(out.size()))
      throw ValueError("kvc::paged: a block table row of " + std::to_string(out.size()) + " entries cannot hold the " +
                       std::to_string(n) + " blocks of request " + name(request) + " (it has " +
                       std::to_string(t.size()) + ")");
    std::copy_n(t.begin(), n, out.begin());
  }
};

// A sliding-window group: a ring of `sliding_window` slots in at most
// ceil(sliding_window / block_size) blocks, never shared (forks copy it).
class SlidingAttentionCacheAllocator : public CacheAllocator {
 public:
  // The allocator of sliding-window group `index`; new tokens read as row `sentinel_index`, dropped
  // ones are written to row `write_trash_index`. Throws kvc::ValueError for sliding_window < 1.
  SlidingAttentionCacheAllocator(std::int64_t index, std::int64_t block_size, std::int64_t sliding_window,
                                 std::int64_t sentinel_index, std::int64_t write_trash_index,
                                 const RequestNames* names = nullptr)
      : CacheAllocator(index, block_size, false, names),
        window_(sliding_window),
        sentinel_(sentinel_index),
        write_trash_(write_trash_index) {
    if (sliding_window < 1)
      throw ValueError("kvc::paged: sliding_window must be >= 1, got " + std::to_string(sliding_window));
    max_blocks_ = (sliding_window + block_size - 1) / block_size;
  }

  // True: a sliding-window group.
  static constexpr bool is_sliding = true;
  // Returns the window: the slots of a request's ring.
  std::int64_t sliding_window() const noexcept { return window_; }
  // Returns the most blocks a request's ring takes: ceil(sliding_window / block_size).
  std::int64_t max_blocks_per_request() const noexcept { return max_blocks_; }
  // Returns the row a read list gives each new token (the step reads the token itself there).
  std::int64_t sentinel_index() const noexcept { return sentinel_; }
  // Returns the row a write list gives the new tokens that no query of the step keeps.
  std::int64_t write_trash_index() const noexcept { return write_trash_; }
  // What allocate_blocks(n) takes from a table of `have` blocks: min(n, what the ring lacks), and
  // 0 for n <= 0 (without forming have + n, which a huge n would overflow).
  std::int64_t blocks_to_take(std::int64_t have, std::int64_t n) const noexcept {
    return std::clamp<std::int64_t>(n, 0, std::max<std::int64_t>(max_blocks_ - have, 0));
  }

  // Up to n more blocks, never past the ring's ceil(sliding_window / block_size); returns how many
  // it took (0 once the ring is whole), nullopt with nothing changed if the manager has too few.
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, RequestKey request, BlockManager& bm) {
    const auto it = tables_.find(request.index);
    const std::int64_t have = it == tables_.end() ? 0 : static_cast<std::int64_t>(it->second.size());
    const std::int64_t take = blocks_to_take(have, n);
    if (take == 0) {
      (void)make_table(request, bm.log());
      return 0;
    }
    if (!grow_table(request, take, false, bm)) return std::nullopt;
    return take;
  }

  // The cached part of the window, oldest first: the last min(past, sliding_window - 1) positions
  // (slots (past - len) % window ...), then one sentinel row per new token, which update replaces
  // by the new token (read before write: a new token may overwrite a slot read in this step).
  void get_read_indices(RequestKey request, std::int64_t past, std::int64_t q, std::vector<std::int64_t>& out) const {
    check_counts(past, q, "kvc::paged::SlidingAttentionCacheAllocator::get_read_indices");
    const auto& t = table_of(request);
    const std::int64_t len = std::min(past, window_ - 1);
    check_rows(out, len + q);
    for (std::int64_t p = past - len; p < past; ++p) out.push_back(row(t, p % window_, request));
    out.insert(out.end(), static_cast<std::size_t>(q), sentinel_);
  }
  // Where the new tokens go: the oldest q - min(q, window) of them (which no query of this step
  // keeps after the step) to the write trash, the others to their slots position % window. The
  // slots' rows come first, so that a table without them, or more trash rows than kvc may
  // allocate, is refused before the trash rows are made.
  void get_write_indices(RequestKey request, std::int64_t past, std::int64_t q, std::vector<std::int64_t>& out) const {
    check_counts(past, q, "kvc::paged::SlidingAttentionCacheAllocator::get_write_indices");
    const auto& t = table_of(request);
    const std::int64_t kept = std::min(q, window_);
    const std::int64_t pad = q - kept;
    const std::size_t start = out.size();
    try {
      for (std::int64_t p = past + pad; p < past + q; ++p) out.push_back(row(t, p % window_, request));
      if (pad > 0) {
        check_rows(out, pad);
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(start), static_cast<std::size_t>(pad), write_trash_);
      }
    } catch (...) {
      out.resize(start);
      throw;
    }
  }

 private:
  std::int64_t window_;
  std::int64_t sentinel_;
  std::int64_t write_trash_;
  std::int64_t max_blocks_;
};

}  // namespace kvc::paged

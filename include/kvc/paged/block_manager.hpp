#pragma once
// kvc::paged::BlockManager: who owns which block of a paged cache. transformers' BlockManager
// (generation/continuous_batching/cache_manager.py at a597f974), with its policy kept exactly:
//   - free blocks that hold nothing reusable ("uninitialized") form a FIFO: allocation takes from
//     the front, every block given back goes to the back;
//   - a block of a shareable allocation (full-attention groups with block sharing on) has a ref
//     count and, once complete (its block_size tokens are known), a hash chained over the blocks
//     before it (block_hash.hpp). A complete block whose count drops to 0 stays "initialized":
//     free, but still findable by its hash for prefix sharing, until it is evicted;
//   - eviction takes the most recently freed initialized block first (LIFO), so the tail of the
//     last finished sequence goes first and the shared heads of chains survive longest;
//   - a complete block whose hash is already known is replaced, in the request's table, by the
//     known block (its own KV is discarded).
// Where kvc differs (docs/paged.md, docs/differences.md): the hash is BLAKE2b-64 in every case;
// a failed fork changes nothing (upstream keeps the ref counts and blocks it took before the
// failure); uninitialize_unshared_block checks before it changes anything.
// Block ids are global: 0 .. num_blocks - 1, shared by every layer group of the cache.
// Its storage is sized for num_blocks when it is built (a ring for the FIFO, an intrusive list
// for the initialized blocks, a slot per Block), so taking, sharing and giving back blocks never
// allocates: an allocation failure can only come before a change (docs/paged.md). Registering a
// hash is the one step that allocates.
// Every change goes through the manager's UndoLog (log()): in a transaction (a scheduler step)
// it is recorded first, so that the whole step can be undone; otherwise it is a plain write.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/paged/block_hash.hpp>
#include <kvc/paged/undo_log.hpp>

namespace kvc::paged {

// A block of a shareable allocation. `parent_id` is the block before it in its request's table
// (bookkeeping; the hash chain follows the table).
struct Block {
  // The block's id (global: 0 .. num_blocks - 1).
  std::int64_t id = -1;
  // The block before it in its request's table; unset for a table's first block.
  std::optional<std::int64_t> parent_id;
  // The layer group whose table holds the block (part of its hash).
  std::int64_t group_id = 0;
  std::optional<std::uint64_t> hash;  // set once the block is complete
  // How many tables hold the block; 0 for a complete block nobody holds (initialized, free).
  std::int64_t ref_count = 1;
  // Returns true once the block is complete (its tokens are known and its hash is set).
  bool is_complete() const noexcept { return hash.has_value(); }
};

// transformers' Block.__repr__.
inline std::string block_repr(const Block& b) {
  std::string out = "Block(id=" + std::to_string(b.id) + ", parent_id=";
  out += b.parent_id ? std::to_string(*b.parent_id) : "None";
  out += ", group_id=" + std::to_string(b.group_id) + ", hash=";
  out += b.hash ? std::to_string(*b.hash) : "None";
  out += ", ref_count=" + std::to_string(b.ref_count) + ")";
  return out;
}

// What fork_blocks returns: one block list per fork, and the copies to make (source block i to
// destination block i) for the blocks that could not be shared.
struct ForkedBlocks {
  // One block table per fork: the shared blocks, then the fork's new blocks.
  std::vector<std::vector<std::int64_t>> tables;
  // The blocks to copy from (the parent's), one per copy.
  std::vector<std::int64_t> copy_src;
  // The blocks to copy to, one per entry of copy_src.
  std::vector<std::int64_t> copy_dst;
};

// Who owns which block of a paged cache, as transformers' BlockManager: a FIFO of free blocks,
// ref-counted shareable blocks found by hash for prefix sharing, LIFO eviction. Sized when built,
// so taking and giving back blocks never allocates; every change goes through log().
class BlockManager {
 public:
  // `num_blocks` free blocks of `block_size` tokens, uninitialized, in id order. Throws
  // kvc::ValueError for num_blocks < 0 or block_size < 1; may throw std::bad_alloc.
  BlockManager(std::int64_t num_blocks, std::int64_t block_size) : num_blocks_(num_blocks), block_size_(block_size) {
    if (num_blocks < 0)
      throw ValueError("kvc::paged::BlockManager: num_blocks must be >= 0, got " + std::to_string(num_blocks));
    if (block_size < 1)
      throw ValueError("kvc::paged::BlockManager: block_size must be >= 1, got " + std::to_string(block_size));
    const auto n = static_cast<std::size_t>(num_blocks);
    ring_.resize(n);
    for (std::size_t i = 0; i < n; ++i) ring_[i] = static_cast<std::int64_t>(i);
    uninit_count_ = num_blocks;
    prev_.assign(n, -1);
    next_.assign(n, -1);
    in_init_.assign(n, 0);
    in_uninit_.assign(n, 1);
    listed_.assign(n, 0);
    slots_.resize(n);
    hash_to_id_.reserve(n);
  }

  // Returns the number of blocks it manages.
  std::int64_t num_blocks() const noexcept { return num_blocks_; }
  // Returns the number of tokens per block.
  std::int64_t block_size() const noexcept { return block_size_; }
  // The undo log of the manager and of the tables that use it (allocators.hpp, PagedCache).
  UndoLog& log() noexcept { return log_; }
  // Returns true while log() is in a transaction.
  bool in_transaction() const noexcept { return log_.active(); }
  // Free blocks: never used or given back (uninitialized), plus complete ones nobody holds (initialized).
  std::int64_t num_free_blocks() const noexcept { return uninit_count_ + init_count_; }
  // Returns the number of free blocks that hold nothing reusable (the FIFO's length).
  std::int64_t num_uninitialized_blocks() const noexcept { return uninit_count_; }
  // Returns the number of free complete blocks, still findable by their hash until evicted.
  std::int64_t num_initialized_blocks() const noexcept { return init_count_; }

  // The uninitialized free blocks in allocation order, and the initialized ones from the next to be
  // evicted to the last (tests, debugging).
  std::vector<std::int64_t> uninitialized_blocks() const {
    std::vector<std::int64_t> out(static_cast<std::size_t>(uninit_count_));
    for (std::int64_t i = 0; i < uninit_count_; ++i) out[static_cast<std::size_t>(i)] = uninit_at(i);
    return out;
  }
  // Returns the initialized free blocks, the next to be evicted (the most recently freed) first.
  std::vector<std::int64_t> initialized_blocks() const {
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(init_count_));
    for (std::int64_t id = init_tail_; id >= 0; id = prev_[static_cast<std::size_t>(id)]) out.push_back(id);
    return out;
  }

  // The Block of a shareable allocation, if `id` has one.
  const Block* block(std::int64_t id) const noexcept {
    if (id < 0 || id >= num_blocks_) return nullptr;
    const auto& slot = slots_[static_cast<std::size_t>(id)];
    return slot ? &*slot : nullptr;
  }
  // The block registered under `hash` (complete, in use or initialized), if any.
  std::optional<std::int64_t> find_hash(std::uint64_t hash) const noexcept {
    const auto it = hash_to_id_.find(hash);
    if (it == hash_to_id_.end()) return std::nullopt;
    return it->second;
  }

  // True if n blocks can be taken now. When the uninitialized blocks are not enough but the
  // initialized ones make up for it, the missing number of initialized blocks is evicted (most
  // recently freed first): they lose their hash and join the back of the FIFO.
  bool has_enough_free_blocks(std::int64_t n) {
    const std::int64_t un = uninit_count_;
    if (un >= n) return true;
    if (init_count_ < n - un) return false;
    for (std::int64_t k = 0; k < n - un; ++k) evict_one();
    return true;
  }

  // Takes n blocks from the front of the FIFO (after evicting what is needed), or nothing if there
  // are not enough. For a shareable allocation each gets a Block chained from `last_block_id`.
  std::optional<std::vector<std::int64_t>> get_free_blocks(std::int64_t n, std::optional<std::int64_t> last_block_id,
                                                           bool shareable, std::int64_t group_id) {
    if (n < 0) throw ValueError("kvc::paged::BlockManager: cannot take " + std::to_string(n) + " blocks");
    std::vector<std::int64_t> ids;
    ids.reserve(static_cast<std::size_t>(n));  // before anything changes
    if (!take_free_blocks(n, last_block_id, shareable, group_id, ids)) return std::nullopt;
    return ids;
  }
  // The same into `out`, which must have room for n more ids (reserved: nothing here allocates);
  // false, with nothing changed, if there are not enough.
  bool take_free_blocks(std::int64_t n, std::optional<std::int64_t> last_block_id, bool shareable,
                        std::int64_t group_id, std::vector<std::int64_t>& out) {
    if (n < 0) throw ValueError("kvc::paged::BlockManager: cannot take " + std::to_string(n) + " blocks");
    if (out.capacity() - out.size() < static_cast<std::size_t>(n))
      throw ValueError("kvc::paged::BlockManager: take_free_blocks needs room for " + std::to_string(n) + " ids");
    if (!has_enough_free_blocks(n)) return false;
    std::optional<std::int64_t> parent = last_block_id;
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t id = uninit_at(0);
      log_.set(head_, (head_ + 1) % num_blocks_);
      log_.set(uninit_count_, uninit_count_ - 1);
      log_.set(in_uninit_[static_cast<std::size_t>(id)], char{0});
      if (shareable) {  // a stale evicted Block is replaced
        log_.set(slots_[static_cast<std::size_t>(id)],
                 std::optional<Block>(Block{id, parent, group_id, std::nullopt, 1}));
        parent = id;
      }
      out.push_back(id);
    }
    return true;
  }

  // One more holder of block `id`; a block that was initialized (free) is in use again.
  void increase_ref_count(std::int64_t id) {
    Block& b = block_or_throw(id, "increase_ref_count");
    if (b.ref_count == 0 && in_init_[static_cast<std::size_t>(id)]) unlink_init(id);
    log_.set(b.ref_count, b.ref_count + 1);
  }

  // One holder fewer; at 0 a complete block becomes initialized (keeps its hash), an incomplete one
  // goes back to the FIFO.
  void decrease_ref_count(std::int64_t id) {
    Block& b = block_or_throw(id, "decrease_ref_count");
    if (b.ref_count <= 0)
      throw RuntimeError("kvc::paged::BlockManager: block " + std::to_string(id) + " is not referenced");
    if (b.ref_count > 1) {
      log_.set(b.ref_count, b.ref_count - 1);
      return;
    }
    if (b.is_complete()) {
      link_init(id);
      log_.set(b.ref_count, std::int64_t{0});
    } else {
      push_uninit(id);
      log_.set(slots_[static_cast<std::size_t>(id)], std::optional<Block>());
    }
  }

  // Gives back a request's blocks: shareable ones drop a reference each (table order), the others
  // go straight to the back of the FIFO.
  void free_blocks(std::span<const std::int64_t> blocks, bool shareable) {
    if (shareable) {
      // Every block must be held as often as it is listed: checked first, so that a bad list
      // changes nothing (and a retry cannot drop a reference twice). The counts go in listed_,
      // sized with the manager, so that giving blocks back never allocates.
      for (const std::int64_t id : blocks) (void)block_or_throw(id, "free_blocks");
      for (const std::int64_t id : blocks) ++listed_[static_cast<std::size_t>(id)];
      std::int64_t bad = -1, times = 0;
      for (const std::int64_t id : blocks) {
        auto& n = listed_[static_cast<std::size_t>(id)];
        if (bad < 0 && n > block(id)->ref_count) {
          bad = id;
          times = n;
        }
        n = 0;  // back to zero for the next call
      }
      if (bad >= 0)
        throw RuntimeError("kvc::paged::BlockManager: block " + std::to_string(bad) + " is listed " +
                           std::to_string(times) + " times but held " + std::to_string(block(bad)->ref_count) +
                           " times");
      for (const std::int64_t id : blocks) decrease_ref_count(id);
    } else {
      // Checked first (a block given back twice would overflow the FIFO): each is marked as it
      // passes (in_uninit_ 2), and the marks are undone if a later one fails.
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::int64_t id = blocks[i];
        if (id < 0 || id >= num_blocks_ || is_free(id)) {
          for (std::size_t j = 0; j < i; ++j) log_.set(in_uninit_[static_cast<std::size_t>(blocks[j])], char{0});
          throw RuntimeError("kvc::paged::BlockManager: block " + std::to_string(id) +
                             " is not in use, or is given back twice");
        }
        log_.set(in_uninit_[static_cast<std::size_t>(id)], char{2});
      }
      for (const std::int64_t id : blocks) push_uninit(id);
    }
  }

  // Drops a block nobody else holds back into the FIFO, forgetting its Block. transformers raises
  // after it has already forgotten the Block; kvc checks first and changes nothing on the error.
  void uninitialize_unshared_block(std::int64_t id) {
    if (id < 0 || id >= num_blocks_ || is_free(id))
      throw RuntimeError("kvc::paged::BlockManager: block " + std::to_string(id) +
                         " is not in use, or is given back twice");
    auto& slot = slots_[static_cast<std::size_t>(id)];
    if (slot) {
      if (slot->ref_count > 1)
        throw RuntimeError("Block " + std::to_string(id) +
                           " has more than one reference: block.ref_count = " + std::to_string(slot->ref_count));
      if (slot->hash) {
        const auto h = hash_to_id_.find(*slot->hash);
        if (h != hash_to_id_.end() && h->second == id) kept_hashes_.erase(log_, hash_to_id_, h);
      }
      log_.set(slot, std::optional<Block>());
    }
    push_uninit(id);
  }

  // Hashes up to `num_complete` blocks at the end of a request's table that are not complete yet,
  // from the earliest: block i holds tokens prompt_ids[i * block_size, (i + 1) * block_size). A
  // block whose hash is already registered to another block is replaced in `allocated_blocks` by
  // that block (one more reference to it; the request's own block goes back to the FIFO).
  // Returns the number of blocks replaced that way (kvc's prefix-sharing statistic counts them).
  std::int64_t mark_shareable_blocks_as_complete(std::int64_t num_complete, std::vector<std::int64_t>& allocated_blocks,
                                                 std::span<const std::int64_t> prompt_ids) {
    if (num_complete <= 0) return 0;
    // The incomplete tail of the table, blocks first .. size - 1, and the hash of the last
    // complete block before it (allocates nothing).
    std::size_t first = allocated_blocks.size();
    std::optional<std::uint64_t> parent_hash;
    while (first > 0) {
      const Block& b = block_or_throw(allocated_blocks[first - 1], "mark_shareable_blocks_as_complete");
      if (b.is_complete()) {
        parent_hash = b.hash;
        break;
      }
      --first;
    }
    // Every block to hash must have its tokens, each a C int, checked before anything changes.
    if (const auto k = std::min(static_cast<std::size_t>(num_complete), allocated_blocks.size() - first); k > 0) {
      const std::size_t last = first + k - 1;
      const auto need = (static_cast<std::int64_t>(last) + 1) * block_size_;
      if (need > static_cast<std::int64_t>(prompt_ids.size()))
        throw ValueError("kvc::paged::BlockManager: block " + std::to_string(last) +
                         " of the request needs tokens up to " + std::to_string(need) + ", but only " +
                         std::to_string(prompt_ids.size()) + " are known");
      for (std::size_t b = first; b <= last; ++b)
        check_block_tokens(
            prompt_ids.subspan(b * static_cast<std::size_t>(block_size_), static_cast<std::size_t>(block_size_)));
    }
    std::int64_t done = 0, replaced = 0;
    std::optional<std::int64_t> replacement;  // the id the previous block was replaced by
    for (std::size_t i = first; i < allocated_blocks.size(); ++i) {
      const auto from = static_cast<std::int64_t>(i) * block_size_;
      Block& b = *slots_[static_cast<std::size_t>(allocated_blocks[i])];  // checked above
      // The block after a replaced one takes the replacement as its parent, before the loop may
      // stop: the first block left incomplete is re-pointed too, as in transformers.
      if (replacement) log_.set(b.parent_id, replacement);
      replacement.reset();
      if (done >= num_complete) break;
      const std::uint64_t h = compute_block_hash(
          parent_hash, prompt_ids.subspan(static_cast<std::size_t>(from), static_cast<std::size_t>(block_size_)),
          b.group_id);
      ++done;
      const auto known = hash_to_id_.find(h);
      if (known != hash_to_id_.end() && known->second != b.id) {
        const std::int64_t existing = known->second;
        const std::int64_t own = b.id;
        increase_ref_count(existing);
        keep_entry(log_, allocated_blocks, i);  // (the undo finds the table by its address: a map node's)
        allocated_blocks[i] = existing;
        uninitialize_unshared_block(own);
        replacement = existing;
        ++replaced;
      } else {
        log_.room(1, insert_undo_bytes);
        // the step that allocates, before the block is marked
        if (const auto [at, made] = hash_to_id_.emplace(h, b.id); made) undo_insert(log_, hash_to_id_, *at);
        log_.set(b.hash, std::optional<std::uint64_t>(h));
      }
      parent_hash = h;
    }
    return replaced;
  }

  // How many blocks at the head of `table` are complete (what a fork shares instead of copying).
  std::size_t complete_prefix(std::span<const std::int64_t> table) const noexcept {
    std::size_t n = 0;
    while (n < table.size()) {
      const Block* b = block(table[n]);
      if (!b || !b->is_complete()) break;
      ++n;
    }
    return n;
  }

  // Blocks for num_forks copies of a request whose table is `parent_blocks`. Shareable: the leading
  // run of complete blocks is shared (num_forks more references each), the rest is copied into new
  // blocks of each fork; not shareable: every block is copied. nullopt, with nothing changed, when
  // there are not enough free blocks (upstream keeps what it took before failing).
  std::optional<ForkedBlocks> fork_blocks(std::span<const std::int64_t> parent_blocks, std::int64_t num_forks,
                                          bool shareable, std::int64_t group_id) {
    ForkedBlocks out = prepare_fork(parent_blocks, num_forks, shareable);
    if (!commit_fork(parent_blocks, num_forks, shareable, group_id, out)) return std::nullopt;
    return out;
  }
  // fork_blocks in two steps. prepare_fork allocates everything the result needs (the forks'
  // tables, holding the shared blocks, with room for the rest; the copy lists' room) and changes
  // nothing. commit_fork takes the blocks into it and allocates nothing: false, with nothing
  // changed, when there are not enough free blocks. A caller forking several groups prepares them
  // all before it commits any.
  ForkedBlocks prepare_fork(std::span<const std::int64_t> parent_blocks, std::int64_t num_forks, bool shareable) const {
    if (num_forks < 0)
      throw ValueError("kvc::paged::BlockManager: cannot fork " + std::to_string(num_forks) + " times");
    const std::size_t shared = shareable ? complete_prefix(parent_blocks) : 0;
    ForkedBlocks out;
    const auto n_copies = (parent_blocks.size() - shared) * static_cast<std::size_t>(num_forks);
    out.tables.assign(
        static_cast<std::size_t>(num_forks),
        std::vector<std::int64_t>(parent_blocks.begin(), parent_blocks.begin() + static_cast<std::ptrdiff_t>(shared)));
    for (auto& t : out.tables) t.reserve(parent_blocks.size());
    out.copy_src.reserve(n_copies);
    out.copy_dst.reserve(n_copies);
    return out;
  }
  // The second step of fork_blocks (see prepare_fork()): returns false, with nothing changed, when
  // there are not enough free blocks. Throws kvc::ValueError for an `out` of another fork count.
  bool commit_fork(std::span<const std::int64_t> parent_blocks, std::int64_t num_forks, bool shareable,
                   std::int64_t group_id, ForkedBlocks& out) {
    const std::size_t shared = shareable ? complete_prefix(parent_blocks) : 0;
    const auto to_copy = static_cast<std::int64_t>(parent_blocks.size() - shared);
    if (static_cast<std::int64_t>(out.tables.size()) != num_forks)
      throw ValueError("kvc::paged::BlockManager: commit_fork needs the ForkedBlocks prepare_fork made");
    // All or nothing: the check evicts, which frees nothing anyone holds.
    if (!has_enough_free_blocks(to_copy * num_forks)) return false;
    const std::optional<std::int64_t> last_shared =
        shared > 0 ? std::optional<std::int64_t>(parent_blocks[shared - 1]) : std::nullopt;
    for (auto& table : out.tables) {
      if (to_copy == 0) continue;
      (void)take_free_blocks(to_copy, last_shared, shareable, group_id, table);  // cannot fail after the check
      out.copy_src.insert(out.copy_src.end(), parent_blocks.begin() + static_cast<std::ptrdiff_t>(shared),
                          parent_blocks.end());
      out.copy_dst.insert(out.copy_dst.end(), table.begin() + static_cast<std::ptrdiff_t>(shared), table.end());
    }
    for (std::size_t i = 0; i < shared; ++i) {
      std::int64_t& refs = slots_[static_cast<std::size_t>(parent_blocks[i])]->ref_count;
      log_.set(refs, refs + num_forks);
    }
    return true;
  }

 private:
  Block& block_or_throw(std::int64_t id, const char* what) {
    if (id < 0 || id >= num_blocks_ || !slots_[static_cast<std::size_t>(id)])
      throw RuntimeError(std::string("kvc::paged::BlockManager::") + what + ": block " + std::to_string(id) +
                         " is not a shareable block in use");
    return *slots_[static_cast<std::size_t>(id)];
  }

  // The FIFO of uninitialized blocks: a ring of num_blocks slots, head_ its front.
  std::int64_t uninit_at(std::int64_t i) const noexcept {
    return ring_[static_cast<std::size_t>((head_ + i) % num_blocks_)];
  }
  void push_uninit(std::int64_t id) {
    log_.set(ring_[static_cast<std::size_t>((head_ + uninit_count_) % num_blocks_)], id);
    log_.set(uninit_count_, uninit_count_ + 1);
    log_.set(in_uninit_[static_cast<std::size_t>(id)], char{1});
  }
  // Whether a block is in the FIFO or the initialized list (or marked by free_blocks' check).
  bool is_free(std::int64_t id) const noexcept {
    return in_init_[static_cast<std::size_t>(id)] || in_uninit_[static_cast<std::size_t>(id)];
  }

  // The initialized blocks: a list threaded through prev_/next_, oldest at init_head_, most
  // recently freed at init_tail_ (eviction takes the tail).
  void link_init(std::int64_t id) {
    const auto i = static_cast<std::size_t>(id);
    log_.set(prev_[i], init_tail_);
    log_.set(next_[i], std::int64_t{-1});
    if (init_tail_ >= 0)
      log_.set(next_[static_cast<std::size_t>(init_tail_)], id);
    else
      log_.set(init_head_, id);
    log_.set(init_tail_, id);
    log_.set(in_init_[i], char{1});
    log_.set(init_count_, init_count_ + 1);
  }
  void unlink_init(std::int64_t id) {
    const auto i = static_cast<std::size_t>(id);
    if (prev_[i] >= 0)
      log_.set(next_[static_cast<std::size_t>(prev_[i])], next_[i]);
    else
      log_.set(init_head_, next_[i]);
    if (next_[i] >= 0)
      log_.set(prev_[static_cast<std::size_t>(next_[i])], prev_[i]);
    else
      log_.set(init_tail_, prev_[i]);
    log_.set(prev_[i], std::int64_t{-1});
    log_.set(next_[i], std::int64_t{-1});
    log_.set(in_init_[i], char{0});
    log_.set(init_count_, init_count_ - 1);
  }

  void evict_one() {
    const std::int64_t id = init_tail_;
    unlink_init(id);
    auto& slot = slots_[static_cast<std::size_t>(id)];
    if (slot) {
      if (slot->hash)
        if (const auto h = hash_to_id_.find(*slot->hash); h != hash_to_id_.end())
          kept_hashes_.erase(log_, hash_to_id_, h);
      log_.set(slot, std::optional<Block>());
    }
    push_uninit(id);
  }

  std::int64_t num_blocks_;
  std::int64_t block_size_;
  std::vector<std::int64_t> ring_;  // the FIFO: uninit_count_ ids from head_, wrapping
  std::int64_t head_ = 0, uninit_count_ = 0;
  std::vector<std::int64_t> prev_, next_;  // the initialized list
  std::vector<char> in_init_, in_uninit_;
  std::vector<std::int64_t> listed_;  // free_blocks' counts, zero between calls
  std::int64_t init_head_ = -1, init_tail_ = -1, init_count_ = 0;
  using hash_map = std::unordered_map<std::uint64_t, std::int64_t>;
  hash_map hash_to_id_;
  KeptNodes<hash_map> kept_hashes_;          // hashes a transaction erased
  std::vector<std::optional<Block>> slots_;  // the Block of each id in a shareable allocation, if any
  UndoLog log_;
};

}  // namespace kvc::paged

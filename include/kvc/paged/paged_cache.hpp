#pragma once
// kvc::PagedCache<StoragePolicy>: the paged KV cache of continuous batching, transformers'
// PagedAttentionCache (generation/continuous_batching/cache.py at a597f974), on a kvc storage
// policy (HostStorage here). docs/paged.md describes the model; in short:
//   - the model's layers form groups (layer_groups.hpp); layer j of every group shares pool tensor
//     j: group_size K and group_size V pools of (num_blocks + 2) * block_size rows (pages), laid
//     out head-major, [kv_heads, rows, head_dim] (FlashInfer's HND; transformers keeps
//     [rows, kv_heads, head_dim]): the tokens of a block are one contiguous piece per head, so
//     update gathers them a block at a time;
//   - block ids are global across groups; blocks num_blocks and num_blocks + 1 are the padding
//     zone that no request gets: the read trash (row num_blocks * block_size, zeroed, what padded
//     reads see), the sentinel (the next row, marking "a new token goes here" in sliding reads) and
//     the write trash (row (num_blocks + 1) * block_size, where padded and dropped writes go);
//   - three parts behind this class: the block tables (block_tables.hpp: the BlockManager and one
//     allocator per group, every operation that spans the groups all or nothing), the page pools
//     (page_pools.hpp: the K/V pools over the storage policy; scatter, gather, block copies) and
//     the swap pool (swap_pool.hpp: where whole requests are offloaded). The class keeps them in
//     step: the tables say which blocks change, the pools copy their pages;
//   - update(k, v, layer, read_index, write_index) scatters the new tokens to their rows and gathers
//     what attention reads (full groups: write, then read; sliding groups: read, then write);
//   - a hybrid model's layers with linear-attention states keep them per request in state slots
//     (state_slots.hpp): a request holds one while it holds blocks; update_conv_state and
//     update_recurrent_state take the request.

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvc/concepts/storage_policy.hpp>
#include <kvc/config.hpp>
#include <kvc/detail/checked_state_view.hpp>
#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/block_manager.hpp>
#include <kvc/paged/block_tables.hpp>
#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/paged/layer_groups.hpp>
#include <kvc/paged/memory_planner.hpp>
#include <kvc/paged/page_pools.hpp>
#include <kvc/paged/state_slots.hpp>
#include <kvc/paged/swap_pool.hpp>
#include <kvc/detail/row_code_types.hpp>
#include <kvc/tensor_view.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// What the memory planner needs beyond the model config: the bytes the cache may use (the free
// device or host memory times max_memory_percent, which kvc does not probe), the vocabulary (the
// logits peak) and how the model runs.
struct PagedMemoryBudget {
  // Bytes the cache may use: the free memory times max_memory_percent, measured by the caller.
  std::int64_t available_bytes = 0;
  // The vocabulary size (the logits at the lm_head peak).
  std::int64_t vocab_size = 0;
  // The model runs flash attention: no attention mask to plan for.
  bool flash_attention = false;
  // Two sets of batch IO buffers (use_async_batching, resolved).
  bool async_batching = false;
  // Log-probabilities next to the tokens (two output rows).
  bool return_logprobs = false;
  // A hybrid model: the bytes of one request's linear-attention states, every layer and state
  // index (conv channels x kernel and the recurrent state's elements, times the element size),
  // which the cache only learns from the first states. The planner sets aside max_state_slots
  // (unset: max_requests_per_batch, else 256) times this before it plans the blocks.
  std::int64_t state_bytes_per_request = 0;
};

// Tensor parallelism as the paged cache sees it. kv_is_tp: the K/V projections are sharded
// (transformers: both "layers.*.self_attn.k_proj" and "...v_proj" are in the TP plan).
// min_over_ranks replaces each value of its argument by its minimum over the TP ranks (an
// all-reduce MIN: NCCL or gloo upstream, MPI or anything else here); unset, this rank's values
// stand, as on a single rank.
struct PagedTensorParallel {
  // The number of tensor-parallel ranks (1: no tensor parallelism).
  std::int64_t tp_size = 1;
  // Whether the K/V projections are sharded: each rank then keeps num_key_value_heads / tp_size
  // heads.
  bool kv_is_tp = false;
  // Replaces each value by its minimum over the ranks; unset: this rank's values stand.
  std::function<void(std::span<std::int64_t>)> min_over_ranks;
};

// One int64 row list per layer group: transformers' read_index / write_index.
using PagedIndices = std::vector<std::vector<std::int64_t>>;

// The key lengths of a request's next step per attention type (transformers' get_seqlens_k).
struct PagedSeqlensK {
  // past + q for the full-attention groups; unset when the model has none.
  std::optional<std::int64_t> full_attention;
  // q + min(past, sliding_window - 1) for the sliding groups; unset when the model has none.
  std::optional<std::int64_t> sliding_attention;
};

// What a prompt's prefix match found (PagedCache::match_prefix), in prompt tokens.
struct PagedPrefixMatch {
  // The leading whole blocks whose keys and values the cache holds.
  std::int64_t attention_tokens = 0;
  // The longest prefix the cache holds a state snapshot after (a hybrid model; equal to
  // attention_tokens for a model without linear-attention states).
  std::int64_t state_tokens = 0;
  // What the request reuses: the longest prefix every layer kind can resume from (0: no match).
  std::int64_t tokens = 0;
};

namespace paged {

// A request whose blocks could not be allocated this step, with the blocks it asked for
// (PagedCache::blocks_needed), in scheduling order. `Id` is what the caller names requests by
// (the scheduler: its slots).
template <class Id>
struct BasicStarvedRequest {
  // The request, as the caller names it.
  Id request_id;
  // The blocks it asked for (PagedCache::blocks_needed).
  std::int64_t demand = 0;
};
// A starved request named by its id.
using StarvedRequest = BasicStarvedRequest<std::string>;

// Which requests transformers' offloading manager evicts (offloading_manager.py,
// offload_requests): while the starved requests' demand exceeds the free blocks, the newest
// starved request becomes a victim (its demand leaves, its blocks_in_use(id) blocks count as
// freed), never leaving fewer than one active request. Returns the victims oldest first; empty
// when nothing can help.
template <class Id, class BlocksInUse>
std::vector<Id> select_offload_victims(const std::vector<BasicStarvedRequest<Id>>& starved, std::int64_t free_blocks,
                                       std::int64_t num_active, BlocksInUse&& blocks_in_use) {
  std::int64_t demand = 0;
  for (const auto& s : starved) demand += s.demand;
  std::vector<Id> victims;
  std::size_t left = starved.size();
  while (demand > free_blocks && left > 0 && num_active - static_cast<std::int64_t>(victims.size()) > 1) {
    const auto& v = starved[--left];
    victims.push_back(v.request_id);
    demand -= v.demand;
    free_blocks += blocks_in_use(v.request_id);
  }
  std::reverse(victims.begin(), victims.end());
  return victims;
}

}  // namespace paged

// PagedCache over something that is not a paged storage policy: this one error, and no other.
template <class S>
class PagedCache {
  static_assert(concepts::PagedStoragePolicy<S>,
                "kvc::PagedCache: the StoragePolicy does not model kvc::concepts::PagedStoragePolicy (a "
                "StoragePolicy with scatter_rows). Use kvc::HostStorage or kvc::CudaStorage, or see "
                "docs/concepts/storage_policy.md");

 public:
  // Takes any arguments, so that constructing one adds no second error.
  template <class... Args>
  explicit PagedCache(Args&&...) {}
};

// The paged KV cache of continuous batching, as transformers' PagedAttentionCache, over a paged
// storage policy S: block tables, page pools and a swap pool kept in step. A request is named by
// its id or by the key open_request() returns.
template <class S>
  requires concepts::PagedStoragePolicy<S>
class PagedCache<S> {
 public:
  // The element type of the pages (S's element_type).
  using T = typename S::element_type;
  // S's tensor view: what update() takes and returns.
  using view_type = typename S::view_type;

  // The smallest block size the cache accepts (else a kvc::ValueError, transformers' text).
  static constexpr std::int64_t min_block_size = 4;

  // With cb.num_blocks set (cb.max_batch_tokens is then only recorded).
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb) : PagedCache(config, cb, 1, resolved{}) {}

  // Under tensor parallelism (transformers' PagedAttentionCache with a TP plan): with the K/V
  // projections sharded, this rank keeps num_key_value_heads / tp_size heads (which must divide);
  // num_blocks and max_batch_tokens, planned from `budget` where cb leaves them unset, are then
  // agreed as their minimum over the ranks through tp.min_over_ranks.
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb, const PagedTensorParallel& tp,
             const std::optional<PagedMemoryBudget>& budget = std::nullopt)
      : PagedCache(config, agreed(config, cb, tp, budget), head_divisor(tp), resolved{}) {}

 private:
  struct resolved {};
  // The sizes, checked in this order before anything is made.
  struct checked_sizes {
    paged::PageGeometry page;  // head_dim: the stored row width (detail::stored_row_width)
    std::int64_t head_dim;     // the model's
    std::int64_t num_blocks;
    std::int64_t state_slots;
    std::int64_t snapshots;  // state snapshots kept (0: none)
    std::int64_t rollback;   // state_rollback_tokens (0 for a model without states)
  };
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb, std::int64_t head_divisor, resolved)
      : PagedCache(config, cb, checked(config, cb, head_divisor)) {}
  // The bookkeeping first (it checks the layer types), then the pools: zeroed whole, the read-trash
  // block because padded reads must see zeros, the rest so that no path reads uninitialized memory.
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb, const checked_sizes& sizes)
      : groups_(grouped(config)),
        tables_(groups_.types, sizes.num_blocks, sizes.page.block_size, config.sliding_window, cb.allow_block_sharing,
                groups_.state_layers.empty() ? 0 : sizes.state_slots, sizes.snapshots > 0),
        pages_(sizes.page, sizes.num_blocks + 2, groups_.group_size, true),
        swap_(sizes.page, groups_.group_size,
              static_cast<std::int64_t>(groups_.state_layers.size()) * config.number_of_conv_states),
        states_per_layer_(groups_.state_layers.empty() ? 0 : config.number_of_conv_states),
        states_(static_cast<std::int64_t>(groups_.state_layers.size()) * states_per_layer_,
                groups_.state_layers.empty() ? 0 : state_rows(sizes)),
        rollback_(sizes.rollback),
        rings_(sizes.rollback > 0 ? static_cast<std::size_t>(sizes.state_slots * states_.entries()) : 0),
        snapshots_(static_cast<std::size_t>(sizes.snapshots)),
        snapshot_interval_(sizes.snapshots > 0 ? cb.state_snapshot_interval : 0),
        max_batch_tokens_(cb.max_batch_tokens),
        max_blocks_per_request_(cb.resolved_max_blocks_per_request()),
        head_dim_(sizes.head_dim) {
    cut_.source.reserve(static_cast<std::size_t>(num_groups()));
    cut_.destination.reserve(static_cast<std::size_t>(num_groups()));
  }

 public:
  // num_blocks and max_batch_tokens planned for a memory budget where cb leaves them unset
  // (transformers' PagedAttentionMemoryHandler, memory_planner.hpp); a value cb sets is kept.
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb, const PagedMemoryBudget& budget)
      : PagedCache(config, planned(config, cb, budget, 1), 1, resolved{}) {}

  // The planner's view of `config` run with `cb` and `budget`, for an element type T, on a rank
  // that keeps num_key_value_heads / head_divisor heads (transformers plans with every head even
  // when the heads are sharded, so it plans fewer blocks than fit; docs/differences.md).
  static PagedMemoryModel memory_model(const ModelConfig& config, const ContinuousBatchingConfig& cb,
                                       const PagedMemoryBudget& budget, std::int64_t head_divisor = 1) {
    const paged::LayerGroups groups = paged::group_paged_layers(config);
    PagedMemoryModel m;
    m.hidden_size = config.hidden_size;
    m.vocab_size = budget.vocab_size;
    m.num_attention_heads = config.num_attention_heads;
    m.num_key_value_heads = kv_heads_of(config, head_divisor);
    // A pool of row codes: a row's bytes (for a kv_codes pool, the mean of its key and value rows
    // rounded up: the planner counts a page's K and V at head_dim each).
    const std::int64_t d = head_dim_of(config);
    m.head_dim = (detail::stored_key_width<T>(d) + detail::stored_value_width<T>(d) + 1) / 2;
    m.dtype_bytes = static_cast<std::int64_t>(sizeof(T));
    m.num_groups = static_cast<std::int64_t>(groups.groups.size());
    m.group_size = groups.group_size;
    m.has_sliding_groups =
        std::find(groups.types.begin(), groups.types.end(), "sliding_attention") != groups.types.end();
    m.flash_attention = budget.flash_attention;
    m.async_batching = budget.async_batching;
    m.return_logprobs = budget.return_logprobs;
    m.max_blocks_per_request = cb.resolved_max_blocks_per_request();
    m.block_size = checked_block_size(cb.block_size);
    return m;
  }

  // ---- the parts --------------------------------------------------------------------------------
  // The block tables (the bookkeeping: docs/paged.md), read-only; every change goes through the
  // cache, which keeps the pages in step with them.
  const paged::BlockTables& block_tables() const noexcept { return tables_; }
  // Returns the block manager (free blocks, ref counts, hashes), read-only.
  const paged::BlockManager& manager() const noexcept { return tables_.manager(); }

  // ---- geometry -----------------------------------------------------------------------------------

  // Returns the number of tokens per block.
  std::int64_t block_size() const noexcept { return tables_.block_size(); }
  // Returns the number of blocks requests can get (the two padding blocks not counted).
  std::int64_t num_blocks() const noexcept { return tables_.num_blocks(); }
  // Returns the number of rows requests can get in each pool tensor: num_blocks() * block_size().
  std::int64_t num_pages() const noexcept { return num_blocks() * block_size(); }
  // Returns the key/value heads this rank keeps (the model's / tp_size when they are sharded).
  std::int64_t num_key_value_heads() const noexcept { return pages_.geometry().kv_heads; }
  // Returns the number of values per head (the model's head_dim).
  std::int64_t head_dim() const noexcept { return head_dim_; }
  // Returns the elements one head's row of a token takes in the key pools: head_dim(), or for a
  // pool of row codes (kvc::int8_row, int4_row, int2_row, nvfp4_row, ...: <kvc/row_codes.hpp>) the row's
  // bytes, T::row_bytes(head_dim()). update() takes and returns key rows of this width.
  std::int64_t row_width() const noexcept { return pages_.geometry().head_dim; }
  // Returns the same for the value pools: row_width(), except in a kvc::kv_codes<K, V> pool, whose
  // value rows are V::row_bytes(head_dim()) bytes. update() takes and returns value rows of this
  // width.
  std::int64_t value_row_width() const noexcept { return pages_.geometry().value_width(); }
  // Returns the number of layers per group: the number of K (and of V) pool tensors.
  std::int64_t group_size() const noexcept { return groups_.group_size; }
  // Returns the number of layer groups.
  std::int64_t num_groups() const noexcept { return tables_.num_groups(); }
  // Returns the model's layer groups: each group's layers and attention type.
  const paged::LayerGroups& layer_groups() const noexcept { return groups_; }
  // Returns the number of full-attention groups.
  std::int64_t num_full_attention_groups() const noexcept { return tables_.num_full_attention_groups(); }
  // Returns the number of sliding-window groups.
  std::int64_t num_sliding_attention_groups() const noexcept { return tables_.num_sliding_attention_groups(); }
  // Whether group g is a sliding-window ring (else full attention).
  bool is_sliding_group(std::int64_t g) const { return tables_.is_sliding(g); }
  // The sliding groups' window (every sliding group has the config's), 0 without one.
  std::int64_t sliding_window() const noexcept { return tables_.sliding_window(); }
  // Returns the most blocks a sliding group's ring takes per request; 0 without sliding groups.
  std::int64_t max_sliding_window_blocks_per_request() const noexcept {
    return tables_.max_sliding_window_blocks_per_request();
  }
  // Returns the width of a request's row in the decode block table (0: that path is off).
  std::int64_t max_blocks_per_request() const noexcept { return max_blocks_per_request_; }
  // Returns the query tokens per forward that the config set or the planner chose (only recorded
  // here); nullopt when neither did.
  std::optional<std::int64_t> max_batch_tokens() const noexcept { return max_batch_tokens_; }
  // Returns true when prompts are matched against cached blocks: block sharing is allowed and the
  // model has one full-attention group only.
  bool use_prefix_sharing() const noexcept { return tables_.use_prefix_sharing(); }
  // Whether some full-attention group hashes its complete blocks (allow_block_sharing): forks
  // share them, and a step's completed blocks are worth marking.
  bool shares_blocks() const noexcept { return tables_.shares_blocks(); }
  // Returns the read-trash row (num_blocks * block_size, zeros): what padded reads see.
  std::int64_t read_trash_index() const noexcept { return tables_.read_trash_index(); }
  // Returns the sentinel row (the next one): "a new token goes here" in a sliding group's reads.
  std::int64_t sentinel_index() const noexcept { return tables_.sentinel_index(); }
  // Returns the write-trash row ((num_blocks + 1) * block_size): where padded and dropped writes
  // go.
  std::int64_t write_trash_index() const noexcept { return tables_.write_trash_index(); }
  // (group, index in group) of a layer; kvc::IndexError for a layer out of range, kvc::ValueError
  // for one with linear-attention states only (it has no keys and values).
  std::pair<std::int64_t, std::int64_t> layer_group(std::int64_t layer_idx) const {
    if (const auto at = find_group(layer_idx)) return *at;
    check_layer(layer_idx);
    throw ValueError("kvc::PagedCache: layer " + std::to_string(layer_idx) +
                     " keeps linear-attention states only: it has no keys and values");
  }
  // Returns the model's number of layers: num_groups() * group_size() attention layers, and those
  // with linear-attention states only.
  std::int64_t num_layers() const noexcept { return groups_.num_layers; }
  // Returns the bytes of the K and V pools and of the state tensors made so far.
  std::int64_t bytes() const noexcept { return pages_.bytes() + states_.bytes(); }
  // The request's block table in group g (a ValueError when it has none there).
  const std::vector<std::int64_t>& block_table(std::int64_t g, paged::RequestRef request) const {
    return tables_.table(g, tables_.find_known(request));
  }
  // Pool tensor j, [kv_heads, rows, row_width()] flat, rows = (num_blocks + 2) * block_size (a paged
  // attention kernel reads it through a block table or read indices).
  const T* key_pool(std::int64_t j) const { return pages_.keys(j); }
  // Value pool tensor j, laid out as key_pool(j) with value_row_width() elements a row; throws
  // std::out_of_range for j outside [0, group_size()).
  const T* value_pool(std::int64_t j) const { return pages_.values(j); }

  // ---- allocation -------------------------------------------------------------------------------

  // Blocks an allocation of n (logical) blocks takes over all groups, for a request holding
  // `allocated` logical blocks (its full-group count): n per full group, and per sliding group what
  // its ring still lacks, at most n. Saturated at the int64 limits (any count is accepted).
  std::int64_t blocks_needed(std::int64_t n, std::int64_t allocated) const noexcept {
    return tables_.blocks_needed(n, allocated);
  }
  // Returns true when the blocks_needed(n, allocated) blocks are free.
  bool will_allocation_be_successful(std::int64_t n, std::int64_t allocated) const noexcept {
    return blocks_needed(n, allocated) <= get_num_free_blocks();
  }
  // Returns the number of free blocks (uninitialized, plus initialized ones that can be evicted).
  std::int64_t get_num_free_blocks() const noexcept { return tables_.get_num_free_blocks(); }
  // Blocks the request holds over all groups, and in group g (0 without a table there).
  std::int64_t blocks_in_use(paged::RequestRef request) const {
    const auto k = tables_.find(request);
    return k ? tables_.blocks_in_use(*k) : 0;
  }
  // Returns the blocks the request holds in group g (0 for a request the cache does not know);
  // kvc::IndexError for g out of range, kvc::KeyError for a stale key.
  std::int64_t blocks_in_group(std::size_t g, paged::RequestRef request) const {
    const auto k = tables_.find(request);
    return k ? tables_.blocks_in_group(static_cast<std::int64_t>(g), *k) : 0;
  }

  // The request's blocks, group after group, and (if asked) each group's count; none for a request
  // the cache does not know.
  std::vector<std::int64_t> request_blocks(paged::RequestRef request,
                                           std::vector<std::int64_t>* counts = nullptr) const {
    if (const auto k = tables_.find(request)) return tables_.request_blocks(*k, counts);
    if (counts) counts->assign(static_cast<std::size_t>(num_groups()), 0);
    return {};
  }

  // ---- requests: ids and keys --------------------------------------------------------------------
  // Every call on a request takes its id or its key. The tables and the swap pool are indexed by
  // the key; an id is looked up (and, for a call that gives the request blocks, a key made for
  // it) at the call, and forgotten once the request holds nothing. A caller that makes many calls
  // for a request opens it: the key then names it until close_request, whatever it holds.

  // Opens a request under `id` (one the cache may already hold blocks for) and returns its key.
  // Refused (ValueError) for an id already open. Strong guarantee.
  paged::RequestKey open_request(const std::string& id) { return tables_.open(id); }
  // Gives back everything the request holds (release_request) and forgets its key and id. A key
  // that names no request is a KeyError. Allocates nothing outside a transaction.
  void close_request(paged::RequestRef request) {
    const auto k = tables_.find(request);
    if (!k) return;
    release_request(*k);
    tables_.forget(*k);
  }
  // The key of a request the cache knows (opened, or holding blocks or swap blocks), or nullopt.
  std::optional<paged::RequestKey> find_request(const std::string& id) const { return tables_.names().find(id); }
  // The request's id.
  std::string request_name(paged::RequestRef request) const { return tables_.id(request); }
  // Requests the cache knows.
  std::int64_t num_requests() const noexcept { return static_cast<std::int64_t>(tables_.names().size()); }

  // n more blocks for the request in every group, all or nothing: nullopt, with nothing changed,
  // when they do not fit. Returns the most blocks any group took (n for full groups).
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, paged::RequestRef request, std::int64_t allocated) {
    check_allocation(n);
    detail::check_size("kvc::PagedCache::allocate_blocks: allocated", allocated, 0, max_extent);
    if (!will_allocation_be_successful(n, allocated)) return std::nullopt;
    return with_keys(std::span(&request, 1),
                     [&](std::span<const paged::RequestKey> k) { return tables_.allocate_blocks(n, k); });
  }
  // n more blocks for each of several requests in every group, all or nothing (a dense batch's
  // rows: what each group takes comes from the request's own table).
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, std::span<const std::string> request_ids) {
    check_allocation(n);
    const std::vector<paged::RequestRef> refs(request_ids.begin(), request_ids.end());
    return with_keys(std::span(refs),
                     [&](std::span<const paged::RequestKey> k) { return tables_.allocate_blocks(n, k); });
  }
  // The same for requests named by key (a kvc::KeyError for a key that names no request).
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, std::span<const paged::RequestKey> requests) {
    check_allocation(n);
    for (const paged::RequestKey k : requests) (void)tables_.find(k);  // (a KeyError for a stale key)
    return tables_.allocate_blocks(n, requests);
  }

  // Gives back the request's blocks in every group; a group where it has none only warns (as
  // transformers' allocators do).
  void free_blocks(paged::RequestRef request) {
    const auto k = tables_.find(request);
    if (!k) {
      for (std::int64_t g = 0; g < num_groups(); ++g) paged::CacheAllocator::warn_no_table(g, tables_.id(request));
      return;
    }
    tables_.free_blocks(*k);
    settle(*k);
  }
  // Gives back every request's blocks in every group (swap blocks stay); a request then holding
  // nothing that was not opened is forgotten.
  void free_all_requests() {
    for (const paged::RequestKey k : tables_.free_all_requests()) settle(k);
  }

  // Keeps the request's first `tokens` positions and gives back the blocks past them, in every
  // group (llama.cpp's seq_rm of a suffix; transformers' crop). A partial last block that another
  // request shares, or that is complete (hashed: a later prompt may still find it), is replaced by
  // a private copy first, so the tokens written after the cut change nothing anyone else reads.
  // A sliding group keeps the ring blocks of slots below `tokens`: right only while the ring has
  // not wrapped (the request never passed its window), which the caller checks. False, with
  // nothing changed, when no block is free for a copy, or when the request holds linear-attention
  // states (a recurrent state cannot be cut back to a position: prefill the tokens kept again).
  // Allocates nothing once called once (so a caller can truncate in the commit half of an
  // all-or-nothing operation).
  bool truncate_request(paged::RequestRef request, std::int64_t tokens) {
    if (tokens < 0)
      throw ValueError("kvc::PagedCache::truncate_request: tokens must be >= 0, got " + std::to_string(tokens));
    detail::check_size("kvc::PagedCache::truncate_request: tokens", tokens, 0, max_extent);
    const auto k = tables_.find(request);
    if (!k) return true;  // nothing held: nothing to cut
    if (tables_.state_slots().slot_of(*k) >= 0) return false;
    if (!tables_.truncate(*k, tokens, cut_)) return false;
    move_blocks(pool::pages, cut_.source, pool::pages, cut_.destination);
    settle(*k);
    return true;
  }

  // truncate_request for a request that may hold linear-attention states: keeps its first `tokens`
  // positions, the last `removed` it held past them taken back, its states too: each is put back
  // as it was before its last `removed` one-token steps, from its ring
  // (ContinuousBatchingConfig::state_rollback_tokens; docs/rollback.md). False, with nothing
  // changed, where truncate_request refuses, for an offloaded request, for `tokens` 0 with a state
  // slot (free_blocks gives everything back), or where a state written since the request took its
  // slot has fewer such steps in its ring (none without state_rollback_tokens, or after an
  // update of several tokens). In a transaction a rollback puts the states back (saving them may
  // throw std::bad_alloc: roll back then); outside one it allocates nothing once called once.
  bool rollback_request(paged::RequestRef request, std::int64_t tokens, std::int64_t removed) {
    detail::check_size("kvc::PagedCache::rollback_request: removed", removed, 0, max_extent);
    const auto k = tables_.find(request);
    if (k && swap_.is_offloaded(*k)) return false;  // (its tables and states are in the swap pool)
    const std::int64_t slot = k ? tables_.state_slots().slot_of(*k) : -1;
    if (slot < 0) return truncate_request(request, tokens);
    if (tokens == 0) return false;  // (a slot held with no block would outlive its request's key)
    if (state_rollback_depth(request) < removed) return false;
    const std::uint64_t epoch = tables_.state_slots().epoch(slot);
    detail::check_size("kvc::PagedCache::rollback_request: tokens", tokens, 0, max_extent);
    if (in_transaction() && removed > 0 && rollback_ > 0) save_slot(false, slot);  // (what the restores overwrite)
    if (!tables_.truncate(*k, tokens, cut_)) return false;
    move_blocks(pool::pages, cut_.source, pool::pages, cut_.destination);
    settle(*k);
    for (std::int64_t e = 0; removed > 0 && rollback_ > 0 && e < states_.entries(); ++e) {
      ring& r = ring_of(slot, e);
      const std::int64_t steps = ring_steps(slot, e, epoch);
      if (steps >= removed) {
        const std::int64_t at = (r.head - removed + (rollback_ + 1)) % (rollback_ + 1);
        paged::StatePools<S>::copy_entry(states_, ring_row(slot, at), epoch, states_, slot, epoch, e);
        tables_.log().set(r, ring{epoch, at, steps - removed, false});
      } else if (r.epoch == epoch) {  // never written on the kept tokens: its ring is of the removed ones
        tables_.log().set(r, ring{});
      }
    }
    return true;
  }
  // Returns how many one-token steps each request's states can be taken back by
  // (ContinuousBatchingConfig::state_rollback_tokens; 0 for a model without states).
  std::int64_t state_rollback_tokens() const noexcept { return rollback_; }
  // Returns how many tokens rollback_request can take the request's states back by now: the fewest
  // one-token steps in the rings of its written states (kvc::max_extent when it holds no state slot
  // or has written none; 0 while it is offloaded).
  std::int64_t state_rollback_depth(paged::RequestRef request) const {
    const auto k = tables_.find(request);
    if (k && swap_.is_offloaded(*k)) return 0;
    const std::int64_t slot = k ? tables_.state_slots().slot_of(*k) : -1;
    if (slot < 0) return max_extent;
    const std::uint64_t epoch = tables_.state_slots().epoch(slot);
    std::int64_t depth = max_extent;
    for (std::int64_t e = 0; e < states_.entries(); ++e)
      if (states_.conv_written(e, slot, epoch) || states_.recurrent_written(e, slot, epoch))
        depth = std::min(depth, ring_steps(slot, e, epoch));
    return depth;
  }

  // ---- indices ----------------------------------------------------------------------------------

  // Appends the request's rows for a step of q tokens after `past` to each group's lists; no read
  // rows when read_index is null (a batch where no request has cache takes the write-only path).
  void extend_read_and_write_indices(paged::RequestRef request, std::int64_t past, std::int64_t q,
                                     PagedIndices* read_index, PagedIndices& write_index) const {
    const auto g = static_cast<std::size_t>(num_groups());
    if (write_index.size() != g || (read_index && read_index->size() != g))
      throw ValueError("kvc::PagedCache: index lists need one entry per layer group (" + std::to_string(g) + ")");
    // (negative lengths: the allocators' message)
    detail::check_size("kvc::PagedCache::extend_read_and_write_indices: past", past, INT64_MIN, max_extent);
    detail::check_size("kvc::PagedCache::extend_read_and_write_indices: q", q, INT64_MIN, max_extent);
    const paged::RequestKey key = tables_.find_known(request);
    // Appended in place, group by group (a step allocates nothing once the lists have room). Each
    // group's list is refused or grown before anything is appended to it; when a later group
    // throws, every list is cut back to its length before the call.
    constexpr std::size_t inline_groups = 8;
    std::array<std::size_t, 2 * inline_groups> small{};
    std::vector<std::size_t> large(g > inline_groups ? 2 * g : 0);
    std::size_t* before = g > inline_groups ? large.data() : small.data();
    for (std::size_t i = 0; i < g; ++i) {
      before[2 * i] = write_index[i].size();
      before[2 * i + 1] = read_index ? (*read_index)[i].size() : 0;
    }
    try {
      for (std::size_t i = 0; i < g; ++i) {
        const auto gi = static_cast<std::int64_t>(i);
        tables_.get_write_indices(gi, key, past, q, write_index[i]);
        if (read_index) tables_.get_read_indices(gi, key, past, q, (*read_index)[i]);
      }
    } catch (...) {
      for (std::size_t i = 0; i < g; ++i) {
        write_index[i].resize(before[2 * i]);
        if (read_index) (*read_index)[i].resize(before[2 * i + 1]);
      }
      throw;
    }
  }

  // The request's block table for a decode kernel: `table` is [num_groups, max_blocks_per_request],
  // row g gets the group's first ceil((past + q) / block_size) blocks. Sliding groups have none.
  void fill_block_table(paged::RequestRef request, std::int64_t past, std::int64_t q,
                        std::span<std::int64_t> table) const {
    if (static_cast<std::int64_t>(table.size()) != num_groups() * max_blocks_per_request_)
      throw ValueError("kvc::PagedCache: a block table needs num_groups * max_blocks_per_request = " +
                       std::to_string(num_groups() * max_blocks_per_request_) + " entries, got " +
                       std::to_string(table.size()));
    if (num_sliding_attention_groups() > 0)
      throw NotImplementedError("Sliding window attention layers do not support block table");
    // (negative lengths: the allocator's message)
    detail::check_size("kvc::PagedCache::fill_block_table: past", past, INT64_MIN, max_extent);
    detail::check_size("kvc::PagedCache::fill_block_table: q", q, INT64_MIN, max_extent);
    const auto width = static_cast<std::size_t>(max_blocks_per_request_);
    const paged::RequestKey k = tables_.find_known(request);
    for (std::int64_t g = 0; g < num_groups(); ++g)
      tables_.fill_block_table(g, k, past, q, table.subspan(static_cast<std::size_t>(g) * width, width));
  }

  // (ValueError for a length below 0 or above kvc's limit on a size.)
  PagedSeqlensK get_seqlens_k(std::int64_t past, std::int64_t q) const {
    detail::check_size("kvc::PagedCache::get_seqlens_k: past", past, 0, max_extent);
    detail::check_size("kvc::PagedCache::get_seqlens_k: q", q, 0, max_extent);
    PagedSeqlensK out;
    if (num_full_attention_groups() > 0) out.full_attention = past + q;
    if (num_sliding_attention_groups() > 0) out.sliding_attention = q + std::min(past, sliding_window() - 1);
    return out;
  }

  // ---- prefix sharing and forks ----------------------------------------------------------------

  // The prompt's leading whole blocks already in the cache (by hash) become the request's first
  // blocks; returns the number of prompt tokens they hold (match_prefix(...).tokens). 0 unless
  // prefix sharing is on.
  std::int64_t search_prefix_match(paged::RequestRef request, std::span<const std::int64_t> prompt_ids) {
    return match_prefix(request, prompt_ids).tokens;
  }
  // search_prefix_match, reporting what each layer kind found. A hybrid model (state snapshots
  // on) reuses the longest prefix, short of the prompt's last token, that ends on a snapshot and
  // whose blocks are all cached: the request gets those blocks and a state slot, into which the
  // snapshot is copied (a rollback puts back what it overwrote); no free state slot is no match. The
  // request must hold no blocks yet (kvc::ValueError). Strong guarantee.
  PagedPrefixMatch match_prefix(paged::RequestRef request, std::span<const std::int64_t> prompt_ids) {
    if (!use_prefix_sharing()) return {};
    return with_keys(std::span(&request, 1), [&](std::span<const paged::RequestKey> k) {
      if (state_slots() == 0) {
        const std::int64_t n = tables_.search_prefix_match(k[0], prompt_ids);
        return PagedPrefixMatch{n, n, n};
      }
      return match_with_states(k[0], prompt_ids);
    });
  }
  // Prompt tokens served from shared blocks so far (the prefix-sharing statistic).
  std::int64_t total_prefix_length() const noexcept { return tables_.total_prefix_length(); }

  // Hashes the request's newly completed blocks in every group that shares blocks.
  void mark_shareable_blocks_as_complete(paged::RequestRef request, std::int64_t num_complete_blocks,
                                         std::span<const std::int64_t> token_ids) {
    if (num_complete_blocks <= 0 || !shares_blocks()) return;
    tables_.mark_shareable_blocks_as_complete(tables_.find_known(request), num_complete_blocks, token_ids);
  }

  // How many forks of `source` the free blocks (and, with linear-attention states, the free state
  // slots) allow (2^31 when a fork needs neither).
  std::int64_t compute_max_num_forks(paged::RequestRef source) const {
    const std::int64_t per_fork = tables_.blocks_copied_per_fork(tables_.find_known(source));
    const std::int64_t by_blocks = per_fork == 0 ? (std::int64_t{1} << 31) : get_num_free_blocks() / per_fork;
    return state_slots() > 0 ? std::min(by_blocks, free_state_slots()) : by_blocks;
  }

  // Tables for copies of `source` under `destinations` in every group, then the block copies the
  // non-shared blocks need (copy_cache). All or nothing across groups. The destinations are new
  // ids, or keys opened for them. With linear-attention states each destination gets a state slot
  // and a copy of the source's states.
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_request(
      paged::RequestRef source, std::span<const std::string> destinations) {
    const std::pair<std::string, std::span<const std::string>> one{tables_.id(source), destinations};
    return fork_requests(std::span(&one, 1));
  }
  // The same with the destinations named by key (a kvc::KeyError for a key that names no request).
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_request(
      paged::RequestRef source, std::span<const paged::RequestKey> destinations) {
    for (const paged::RequestKey d : destinations) (void)tables_.find(d);  // (a KeyError for a stale key)
    const std::pair<paged::RequestKey, std::span<const paged::RequestKey>> one{tables_.find_known(source),
                                                                               destinations};
    paged::BlockCopies c = tables_.fork_requests(std::span(&one, 1));
    copy_cache(c.source, c.destination);
    copy_forked_states(std::span(&one, 1));
    return {std::move(c.source), std::move(c.destination)};
  }
  // Several sources at once, each (source, its destinations): all forks or none.
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_requests(
      std::span<const std::pair<std::string, std::span<const std::string>>> forks) {
    std::vector<paged::RequestRef> destinations;  // every fork's, one after the other
    std::vector<paged::RequestKey> sources;
    for (const auto& [source, d] : forks) {
      sources.push_back(tables_.find_known(source));
      destinations.insert(destinations.end(), d.begin(), d.end());
    }
    return with_keys(std::span(destinations), [&](std::span<const paged::RequestKey> keys) {
      std::vector<std::pair<paged::RequestKey, std::span<const paged::RequestKey>>> by_key;
      by_key.reserve(forks.size());
      std::size_t at = 0;
      for (std::size_t i = 0; i < forks.size(); ++i) {
        by_key.emplace_back(sources[i], keys.subspan(at, forks[i].second.size()));
        at += forks[i].second.size();
      }
      paged::BlockCopies c = tables_.fork_requests(by_key);
      copy_cache(c.source, c.destination);
      copy_forked_states(by_key);
      return std::pair(std::move(c.source), std::move(c.destination));
    });
  }

  // Copies the source request's linear-attention states (every state of every layer with states,
  // and whether each is written) into the destination's state slot, as a fork copies them: for a
  // caller that moves rows between requests itself (PagedBatchCache's reorder_cache). Both must
  // hold a state slot (kvc::ValueError otherwise); a model without states has none to copy. In a
  // transaction a rollback puts the destination's states back.
  void copy_states(paged::RequestRef source, paged::RequestRef destination) {
    if (state_slots() == 0) return;
    const paged::StateSlots& slots = tables_.state_slots();
    const paged::RequestKey from = tables_.find_known(source), to = tables_.find_known(destination);
    const std::int64_t a = slots.slot_of(from), b = slots.slot_of(to);
    if (a < 0 || b < 0)
      throw ValueError("kvc::PagedCache::copy_states: request " + tables_.id(a < 0 ? from : to) +
                       " holds no state slot");
    if (a != b) move_states({a, slots.epoch(a), b, slots.epoch(b)});
  }
  // Copies block src[i] to block dst[i] in every pool tensor (in a transaction: when it commits).
  void copy_cache(std::span<const std::int64_t> src, std::span<const std::int64_t> dst) {
    if (src.size() != dst.size()) throw ValueError("kvc::PagedCache::copy_cache: as many sources as destinations");
    for (const std::int64_t b : src) check_block(b);
    for (const std::int64_t b : dst) check_block(b);
    move_blocks(pool::pages, src, pool::pages, dst);
  }

  // ---- transactions ------------------------------------------------------------------------------
  // Several calls as one, all or nothing: between begin_transaction() and commit_transaction(),
  // every change to the bookkeeping (tables, block manager, swap pool) is recorded before it is
  // made, and block copies (forks, offload, restore) wait for the commit; state copies are made at
  // once, each destination slot saved first; rollback_transaction() undoes the changes, newest
  // first, puts the saved slots back and drops the block copies, allocating nothing. Calls in
  // between see the changes as they are made; one that throws may leave part of its work to the
  // rollback, so roll back after an exception. The cache must not be copied or moved while a
  // transaction is open (the undo records point into it). The scheduler runs each schedule() and update() as one, so
  // that a std::bad_alloc anywhere in them leaves the cache as it was.
  bool in_transaction() const noexcept { return tables_.in_transaction(); }
  // Starts a transaction; throws kvc::ValueError when one is already open.
  void begin_transaction() {
    if (in_transaction()) throw ValueError("kvc::PagedCache::begin_transaction: a transaction is already open");
    tables_.log().begin();
  }
  // Makes the waiting copies (on the host they cannot fail) and keeps the changes.
  void commit_transaction() {
    for (const pending_copy& c : pending_)
      copy_between(c.from, std::span(pending_ids_).subspan(c.at, c.n), c.to,
                   std::span(pending_ids_).subspan(c.at + c.n, c.n));
    pending_.clear();
    pending_ids_.clear();
    tables_.log().commit();
    saved_used_ = 0;
  }
  // Undoes every change since begin_transaction(), newest first, and drops the waiting block
  // copies.
  void rollback_transaction() noexcept {
    pending_.clear();
    pending_ids_.clear();
    tables_.log().rollback();  // (puts back the state slots that copies overwrote)
    saved_used_ = 0;
  }
  // f() as one transaction: kept when it returns, rolled back when it throws (the exception goes
  // on to the caller).
  template <class F>
  std::invoke_result_t<F&> transaction(F&& f) {
    begin_transaction();
    try {
      if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
        f();
        commit_transaction();
      } else {
        auto result = f();
        commit_transaction();
        return result;
      }
    } catch (...) {
      rollback_transaction();
      throw;
    }
  }

  // ---- request offload ---------------------------------------------------------------------------
  // When blocks run out, transformers' offloading manager moves whole requests out of the cache
  // into a swap pool (and soft-resets those that do not fit: they free their blocks and prefill
  // again). Here the pool is memory of the storage's kind (host memory for HostStorage), sized in
  // blocks; offload_request copies a request's blocks there and frees them, restore_request copies
  // them back into the blocks the request was given again, in the same table positions (a sliding
  // ring keeps its slot order), so the request continues bit-identically. A request with
  // linear-attention states takes a swap state slot for them too.

  // Bytes of one block in every pool tensor (what one swap block holds).
  std::int64_t bytes_per_block() const noexcept { return pages_.bytes_per_block(); }
  // (Re)creates an empty swap pool of `num_blocks` blocks and, for a model with linear-attention
  // states, `state_slots` swap state slots (unset: num_blocks, at most state_slots(); their
  // tensors are made at the first offload of a request with states); refused while requests are
  // offloaded.
  void reserve_swap_space(std::int64_t num_blocks, std::optional<std::int64_t> state_slots = std::nullopt) {
    if (in_transaction())
      throw ValueError(
          "kvc::PagedCache::reserve_swap_space: not in a transaction (its undo records point into the pool)");
    swap_.reserve(num_blocks, state_slots.value_or(std::min(num_blocks, this->state_slots())));
  }
  // Returns the swap pool's state slots, and how many no offloaded request holds.
  std::int64_t swap_state_slots() const noexcept { return swap_.state_slots().slots(); }
  // Returns the number of swap state slots no offloaded request holds.
  std::int64_t free_swap_state_slots() const noexcept { return swap_.state_slots().free_slots(); }
  // The swap pool transformers' offloading manager would make for this cache's blocks
  // (kvc::plan_swap_blocks, memory_planner.hpp, which probes the available RAM when it is unset).
  std::int64_t plan_swap_blocks(const ContinuousBatchingConfig& cb,
                                std::optional<std::int64_t> available_ram = std::nullopt) const {
    return kvc::plan_swap_blocks(cb, bytes_per_block(), available_ram);
  }
  // The swap pool's size in blocks, and how many are free.
  std::int64_t swap_blocks() const noexcept { return swap_.blocks(); }
  // Returns the number of swap blocks that no offloaded request holds.
  std::int64_t free_swap_blocks() const noexcept { return swap_.free_blocks(); }
  // Returns true when the request is offloaded to the swap pool (false for one the cache does not
  // know); a kvc::KeyError for a stale key.
  bool is_offloaded(paged::RequestRef request) const {
    const auto k = tables_.find(request);
    return k && swap_.is_offloaded(*k);
  }

  // Copies the request's blocks (every group) to the smallest free swap blocks, and its
  // linear-attention states to a swap state slot, and frees them in the cache. False, with nothing
  // changed, when the request holds no block or the pool has too few free blocks or no free state
  // slot (transformers then soft-resets it: free_blocks, and prefill it again).
  bool offload_request(paged::RequestRef request) {
    const auto k = tables_.find(request);
    if (!k) return false;  // it holds nothing
    if (swap_.is_offloaded(*k))
      throw ValueError("kvc::PagedCache: request " + tables_.id(*k) + " is already offloaded");
    std::vector<std::int64_t> counts;
    const std::vector<std::int64_t> blocks = tables_.request_blocks(*k, &counts);
    if (blocks.empty() || static_cast<std::int64_t>(blocks.size()) > free_swap_blocks()) return false;
    const std::int64_t slot = tables_.state_slots().slot_of(*k);
    if (slot >= 0) {
      if (free_swap_state_slots() == 0) return false;
      swap_.states().shape_like(states_);  // the swap's state tensors, made once (nothing observable changes)
    }
    const auto& entry = swap_.take(tables_.log(), *k, std::move(counts), slot >= 0);
    // Outside a transaction: copies and bookkeeping that cannot fail on the host.
    move_blocks(pool::pages, blocks, pool::swap, entry.swap_ids);
    if (slot >= 0) {
      const std::int64_t to = swap_.state_slots().slot_of(*k);
      move_states({slot, tables_.state_slots().epoch(slot), to, swap_.state_slots().epoch(to), false, true});
    }
    tables_.free_blocks(*k);
    return true;
  }

  // Copies an offloaded request back into the first blocks of its new tables (allocate them first:
  // each group needs as many blocks as it had) and returns its swap blocks to the pool.
  void restore_request(paged::RequestRef request) {
    const auto found = tables_.find(request);
    const auto* entry = found ? swap_.find(*found) : nullptr;
    if (!entry) throw ValueError("kvc::PagedCache: request " + tables_.id(request) + " is not offloaded");
    const paged::RequestKey key = *found;
    std::vector<std::int64_t> dst;
    for (std::int64_t g = 0; g < num_groups(); ++g) {
      const std::int64_t n = entry->group_counts[static_cast<std::size_t>(g)];
      if (n == 0) continue;
      const std::int64_t have = tables_.blocks_in_group(g, key);
      if (have < n)
        throw ValueError("kvc::PagedCache: request " + tables_.id(key) + " needs " + std::to_string(n) +
                         " blocks in group " + std::to_string(g) + " to be restored, and has " + std::to_string(have));
      const auto& t = tables_.table(g, key);
      dst.insert(dst.end(), t.begin(), t.begin() + n);
    }
    const std::int64_t from = swap_.state_slots().slot_of(key), to = tables_.state_slots().slot_of(key);
    if (from >= 0 && to < 0)  // (not reached: the blocks checked above came with a state slot)
      throw ValueError("kvc::PagedCache: request " + tables_.id(key) +
                       " holds no state slot to restore its linear-attention states into (allocate its blocks first)");
    move_blocks(pool::swap, entry->swap_ids, pool::pages, dst);
    if (from >= 0)
      move_states({from, swap_.state_slots().epoch(from), to, tables_.state_slots().epoch(to), true, false});
    swap_.give_back(tables_.log(), key);
  }
  // Forgets an offloaded request (cancelled or failed): its swap blocks return to the pool.
  // Allocates nothing outside a transaction.
  void drop_offloaded_request(paged::RequestRef request) {
    const auto k = tables_.find(request);
    if (!k) return;
    swap_.give_back(tables_.log(), *k);
    settle(*k);
  }

  // Gives back everything the request holds: its blocks in every group where it has a table, and
  // its swap blocks. Unlike free_blocks, a request that holds nothing is no warning. Allocates
  // nothing, so a caller can use it in the commit half of an all-or-nothing operation.
  void release_request(paged::RequestRef request) {
    const auto k = tables_.find(request);
    if (!k) return;
    tables_.release(*k);
    swap_.give_back(tables_.log(), *k);
    settle(*k);
  }

  // ---- update -----------------------------------------------------------------------------------

  // The write half of update for every layer at once (vLLM's reshape_and_cache with a slot
  // mapping): layer l's new keys and values, keys[l] and values[l] ([1, kv_heads, T_g, head_dim],
  // T_g the write rows of its group), go to their group's write rows. One storage call for the
  // whole model: on a CUDA device, one kernel launch. Every layer is checked before anything is
  // written; nothing is read or returned (attention reads the pools: paged_attention). The entries
  // of layers with linear-attention states only are not read.
  void write_all_layers(std::span<const view_type> keys, std::span<const view_type> values,
                        const PagedIndices& write_index) {
    const auto layers = static_cast<std::size_t>(num_layers()), groups = static_cast<std::size_t>(num_groups());
    if (keys.size() != layers || values.size() != layers || write_index.size() != groups)
      throw ValueError("kvc::PagedCache::write_all_layers: " + std::to_string(keys.size()) + " keys and " +
                       std::to_string(values.size()) + " values for " + std::to_string(layers) + " layers, and " +
                       std::to_string(write_index.size()) + " write lists for " + std::to_string(groups) +
                       " layer groups");
    std::vector<std::int64_t> rows;  // every group's write rows, one list after the other
    std::vector<std::size_t> first(groups);
    for (std::size_t g = 0; g < groups; ++g) {
      first[g] = rows.size();
      rows.insert(rows.end(), write_index[g].begin(), write_index[g].end());
    }
    std::vector<detail::scatter_job<T>> jobs, value_jobs;  // the key jobs, then the value jobs
    jobs.reserve(2 * layers);
    value_jobs.reserve(layers);
    for (std::size_t l = 0; l < layers; ++l) {
      const auto at = find_group(static_cast<std::int64_t>(l));
      if (!at) continue;  // (in range: a layer with states only)
      const step s = check_step(keys[l], values[l], *at, {}, write_index[static_cast<std::size_t>(at->first)]);
      const std::size_t n = write_index[s.group].size();
      jobs.push_back(pages_.key_job(s.pool, keys[l], first[s.group], n));
      value_jobs.push_back(pages_.value_job(s.pool, values[l], first[s.group], n));
    }
    const std::size_t key_jobs = jobs.size();
    jobs.insert(jobs.end(), value_jobs.begin(), value_jobs.end());
    pages_.scatter(jobs, key_jobs, rows);
  }

  // Stores the step's keys and values of layer `layer_idx` ([1, kv_heads, T, head_dim], the T query
  // tokens of every request of the batch one after the other) at the group's write rows, and
  // returns what attention reads: the group's read rows in order, [1, kv_heads, R, head_dim],
  // each request's cached tokens then its new ones. With no read rows (no request of the batch
  // has cache) it only writes and returns its inputs. The returned views point into a buffer of
  // the cache that the next update overwrites. Every check comes before the first write.
  // Keys and values: any input the storage accepts (a kvc::tensor_input of T in its memory space).
  template <class KeysT, class ValuesT>
  KV<view_type> update(const KeysT& k, const ValuesT& v, std::int64_t layer_idx, const PagedIndices& read_index,
                       const PagedIndices& write_index) {
    constexpr bool accepted = S::template accepts_input<KeysT> && S::template accepts_input<ValuesT>;
    if constexpr (detail::require_inputs<accepted, KeysT, ValuesT>())
      return update(S::input_view(k), S::input_view(v), layer_idx, read_index, write_index);
    else
      return {};
  }
  // update() on views of the storage. Throws, before anything is written, kvc::ValueError for bad
  // shapes, index lists or rows and kvc::IndexError for a layer out of range.
  KV<view_type> update(const view_type& k, const view_type& v, std::int64_t layer_idx, const PagedIndices& read_index,
                       const PagedIndices& write_index) {
    const auto groups = static_cast<std::size_t>(num_groups());
    if (read_index.size() != groups || write_index.size() != groups)
      throw ValueError("kvc::PagedCache::update: index lists need one entry per layer group (" +
                       std::to_string(groups) + ")");
    const auto at = layer_group(layer_idx);
    const auto g = static_cast<std::size_t>(at.first);
    const std::vector<std::int64_t>& reads = read_index[g];
    if (reads.empty()) {  // the write-only path
      update_rows_at(at, k, v, reads, write_index[g], nullptr, nullptr);
      return {k, v};
    }
    const auto r = static_cast<std::int64_t>(reads.size());
    const std::int64_t h = num_key_value_heads(), dk = row_width(), dv = value_row_width();
    const std::int64_t k_elems = detail::checked_elements({h, r, dk}, sizeof(T));
    const std::int64_t v_elems = detail::checked_elements({h, r, dv}, sizeof(T));
    if (out_k_.size() < k_elems || out_v_.size() < v_elems) {
      typename S::buffer_type nk(k_elems), nv(v_elems);
      out_k_ = std::move(nk);
      out_v_ = std::move(nv);
    }
    update_rows_at(at, k, v, reads, write_index[g], out_k_.data(), out_v_.data());
    const auto view_of = [&](const T* p, std::int64_t d) {
      return S::make_view(p, {1, h, r, d}, {h * r * d, r * d, d, 1});
    };
    return {view_of(out_k_.data(), dk), view_of(out_v_.data(), dv)};
  }
  // update for one layer group's rows, into the caller's buffers: k and v ([1, kv_heads, T,
  // head_dim]) go to `writes` (one row per token) of layer `layer_idx`'s pools, and `reads` are
  // gathered into out_k and out_v ([kv_heads, R, head_dim] each, R = reads.size(); nothing is read
  // when out_k is null). Full groups write, then read; sliding groups read (a sentinel row takes the
  // next new token), then write. Every check comes before the first write; nothing is allocated.
  // Keys and values: what update takes.
  template <class KeysT, class ValuesT>
  void update_rows(const KeysT& k, const ValuesT& v, std::int64_t layer_idx, std::span<const std::int64_t> reads,
                   std::span<const std::int64_t> writes, T* out_k, T* out_v) {
    constexpr bool accepted = S::template accepts_input<KeysT> && S::template accepts_input<ValuesT>;
    if constexpr (detail::require_inputs<accepted, KeysT, ValuesT>())
      update_rows_at(layer_group(layer_idx), S::input_view(k), S::input_view(v), reads, writes, out_k, out_v);
  }
  // The rows of layer `layer_idx`'s pools, gathered into out_k and out_v as update_rows does (rows
  // a request holds: no sentinels, no new tokens).
  void read_rows(std::int64_t layer_idx, std::span<const std::int64_t> rows, T* out_k, T* out_v) const {
    const auto j = static_cast<std::size_t>(layer_group(layer_idx).second);
    for (const std::int64_t r : rows) check_row(r, pool_rows(), "read");
    pages_.gather(j, rows, out_k, out_v);
  }

  // ---- linear-attention states (hybrid models) -----------------------------------------------
  // A layer of type "linear_attention" or "conv" (and the attention part of "hybrid" and
  // "hybrid_sliding") keeps, per request, config.number_of_conv_states conv and recurrent states of
  // a fixed size, as transformers' LinearAttentionLayer keeps them per batch row. They live in the
  // request's state slot, which it takes with its first blocks and gives back with them (forks
  // copy it); a slot taken again starts unwritten. Each state tensor is made, for every slot, at
  // its first state, with that state's shape (state_bytes()).

  // Returns the layers with linear-attention states, ascending.
  const std::vector<std::int64_t>& state_layers() const noexcept { return groups_.state_layers; }
  // Returns the conv and recurrent states each of those layers keeps (config.number_of_conv_states).
  std::int64_t states_per_layer() const noexcept { return states_per_layer_; }
  // Returns the number of state slots: the requests that can hold blocks at once (0 for a model
  // without linear-attention states: no limit).
  std::int64_t state_slots() const noexcept { return tables_.state_slots().slots(); }
  // Returns the number of state slots no request holds.
  std::int64_t free_state_slots() const noexcept { return tables_.state_slots().free_slots(); }
  // Returns the slot the request's states are in, -1 when it holds none (or the cache does not
  // know it); a kvc::KeyError for a stale key.
  std::int64_t state_slot(paged::RequestRef request) const {
    const auto k = tables_.find(request);
    return k ? tables_.state_slots().slot_of(*k) : -1;
  }
  // Returns the bytes of the state tensors made so far (each holds every slot and snapshot).
  std::int64_t state_bytes() const noexcept { return states_.bytes(); }

  // ---- state snapshots (prefix sharing for hybrid models) -----------------------------------------
  // Returns every how many tokens states are kept as snapshots (0: the cache keeps none; it keeps
  // them for a model with states whose attention layers form one full-attention group, with block
  // sharing allowed and ContinuousBatchingConfig::state_snapshot_interval set).
  std::int64_t state_snapshot_interval() const noexcept { return snapshot_interval_; }
  // Returns the most state snapshots the cache keeps.
  std::int64_t max_state_snapshots() const noexcept { return static_cast<std::int64_t>(snapshots_.size()); }
  // Returns the state snapshots the cache holds.
  std::int64_t num_state_snapshots() const noexcept {
    return std::count_if(snapshots_.begin(), snapshots_.end(), [](const snapshot& s) { return s.epoch != 0; });
  }
  // Keeps the request's states as the snapshot of `token_ids`, the tokens it has run so far (a
  // positive multiple of state_snapshot_interval()), under the hash of their last block, so that
  // match_prefix can resume a later prompt from there; the least recently used snapshot makes
  // room. Returns false, changing nothing, when the cache keeps no snapshots, the length is not
  // such a multiple or the request holds no state slot; true when the snapshot is held afterwards
  // (it may have been already: same tokens, same states). Refused in a transaction
  // (kvc::ValueError), as is a request the cache does not know; allocates nothing.
  bool save_state_snapshot(paged::RequestRef request, std::span<const std::int64_t> token_ids) {
    if (in_transaction())
      throw ValueError(
          "kvc::PagedCache::save_state_snapshot: not in a transaction (a snapshot is kept outside the undo log)");
    const paged::RequestKey k = tables_.find_known(request);
    const auto n = static_cast<std::int64_t>(token_ids.size());
    if (snapshot_interval_ == 0 || n == 0 || n % snapshot_interval_ != 0) return false;
    const paged::StateSlots& slots = tables_.state_slots();
    const std::int64_t slot = slots.slot_of(k);
    if (slot < 0) return false;
    const std::uint64_t h = snapshot_key(k, token_ids);
    if (const std::int64_t at = find_snapshot(h); at >= 0) {
      snapshots_[static_cast<std::size_t>(at)].used = ++snapshot_tick_;
      return true;
    }
    // The least recently used entry (an empty one, used 0, first).
    const auto victim = std::min_element(snapshots_.begin(), snapshots_.end(),
                                         [](const snapshot& a, const snapshot& b) { return a.used < b.used; });
    const std::uint64_t epoch = ++snapshot_epoch_;
    paged::StatePools<S>::copy_slot(states_, slot, slots.epoch(slot), states_,
                                    state_slots() + (victim - snapshots_.begin()), epoch);
    *victim = {h, epoch, ++snapshot_tick_};
    return true;
  }
  // The state tensors, read-only: entry i * states_per_layer() + s is state s of state_layers()[i],
  // its conv tensor [slots, channels, kernel] and recurrent tensor [slots, ...], where slots is
  // state_slots() + max_state_snapshots() (the snapshots after the request slots), then, with
  // state_rollback_tokens() = R, R + 1 rows per state slot for its rings.
  const paged::StatePools<S>& state_pools() const noexcept { return states_; }

  // Stores the request's conv states ([1, channels, time]) of state `state_idx` of layer
  // `layer_idx` and returns them with their left context, as LinearAttentionLayer does for one
  // batch row: on the request's first call the input itself (left-padded with zeros to the kernel
  // size), afterwards the kernel's stored columns followed by the new ones. `conv_kernel_size` 0
  // takes the kernel size from the first input's time axis; the first call on any request fixes
  // the layer's channels and kernel. The returned view points into a buffer of the cache that the
  // next call overwrites. Every check comes before anything changes.
  template <class X>
  typename S::state_view_type update_conv_state(const X& conv_states, paged::RequestRef request, std::int64_t layer_idx,
                                                std::int64_t state_idx = 0, std::int64_t conv_kernel_size = 0) {
    const auto x = detail::checked_state_view<S>(conv_states, "kvc::PagedCache");
    const state_at at = find_state(request, layer_idx, state_idx, "update_conv_state");
    if (x.rank != 3 || x.extent(0) != 1 || x.extent(1) < 1 || x.extent(2) < 1)
      throw ValueError(
          "kvc::PagedCache::update_conv_state: conv states must have shape [1, channels, time] with positive sizes, "
          "got " +
          shape_string(x));
    if (conv_kernel_size < 0)
      throw ValueError("kvc::PagedCache::update_conv_state: conv_kernel_size must be positive, got " +
                       std::to_string(conv_kernel_size));
    detail::check_size("kvc::PagedCache::update_conv_state: conv_kernel_size", conv_kernel_size, 0, max_extent);
    const auto& made = states_.at(at.entry);
    const std::int64_t c = x.extent(1), t = x.extent(2);
    if (made.channels > 0 && made.channels != c)
      throw ValueError("kvc::PagedCache::update_conv_state: conv states of shape " + shape_string(x) +
                       " do not match state " + std::to_string(state_idx) + " of layer " + std::to_string(layer_idx) +
                       ", which holds " + std::to_string(made.channels) + " channels");
    const std::int64_t k = made.channels > 0 ? made.kernel : (conv_kernel_size > 0 ? conv_kernel_size : t);
    const bool first = !states_.conv_written(at.entry, at.slot, at.epoch);
    const std::int64_t prev = first ? 0 : k, pad = (first && t < k) ? k - t : 0;
    const std::int64_t width = pad + prev + t;  // at least k
    const std::int64_t out_elems = detail::checked_elements({c, width}, sizeof(T));
    // The allocations first (nothing observable changes): a new output buffer when the old one is
    // too small or is the input itself (the view the last call returned, handed back).
    const T* in = x.data();
    const bool aliased = in >= out_conv_.data() && in < out_conv_.data() + out_conv_.size();
    typename S::buffer_type fresh;
    if (aliased || out_conv_.size() < out_elems) fresh = typename S::buffer_type(out_elems);
    states_.shape_conv(at.entry, c, k);
    begin_step(at, t == 1);  // (before the state changes: the ring keeps it as it was)
    T* full = fresh.size() > 0 ? fresh.data() : out_conv_.data();
    T* kept = states_.conv(at.entry, at.slot);
    if (pad > 0) S::zero_2d(full, width, pad, c);
    if (prev > 0) S::copy_2d(full, width, kept, k, k, c);
    S::copy_2d(full + pad + prev, width, in, t, t, c);
    S::copy_2d(kept, k, full + (width - k), width, k, c);  // the last k columns stay
    states_.mark_conv(at.entry, at.slot, at.epoch);
    if (fresh.size() > 0) out_conv_ = std::move(fresh);
    return S::make_state_view(full, 3, {1, c, width, 0});
  }

  // Overwrites the request's recurrent state `state_idx` of layer `layer_idx` (any shape [1, ...]
  // of rank 1..4; the first call on any request fixes the layer's) and returns it (a view of the
  // cache's copy). Every check comes before anything changes.
  template <class X>
  typename S::state_view_type update_recurrent_state(const X& recurrent_states, paged::RequestRef request,
                                                     std::int64_t layer_idx, std::int64_t state_idx = 0) {
    const auto x = detail::checked_state_view<S>(recurrent_states, "kvc::PagedCache");
    const state_at at = find_state(request, layer_idx, state_idx, "update_recurrent_state");
    if (x.rank < 1 || x.extent(0) != 1 || x.size() < 1)
      throw ValueError(
          "kvc::PagedCache::update_recurrent_state: recurrent states must be a non-empty tensor [1, ...], got " +
          shape_string(x));
    const auto& made = states_.at(at.entry);
    if (made.rank > 0 && !same_shape(made.rank, made.shape, x))
      throw ValueError("kvc::PagedCache::update_recurrent_state: recurrent states of shape " + shape_string(x) +
                       " do not match state " + std::to_string(state_idx) + " of layer " + std::to_string(layer_idx) +
                       ", which holds " + shape_string(S::make_state_view(nullptr, made.rank, made.shape)));
    states_.shape_recurrent(at.entry, x.rank, x.extents);
    end_step(at);
    T* r = states_.recurrent(at.entry, at.slot);
    S::copy_2d(r, x.size(), x.data(), x.size(), x.size(), 1);
    states_.mark_recurrent(at.entry, at.slot, at.epoch);
    return S::make_state_view(r, x.rank, made.shape);
  }

  // The request's conv state `state_idx` of layer `layer_idx`, [1, channels, kernel]: the last
  // kernel columns it has seen; empty (rank 0) before its first update_conv_state.
  typename S::state_view_type conv_state(paged::RequestRef request, std::int64_t layer_idx,
                                         std::int64_t state_idx = 0) const {
    const state_at at = find_state(request, layer_idx, state_idx, "conv_state");
    if (!states_.conv_written(at.entry, at.slot, at.epoch)) return S::make_state_view(nullptr, 0, {});
    const auto& made = states_.at(at.entry);
    return S::make_state_view(states_.conv(at.entry, at.slot), 3, {1, made.channels, made.kernel, 0});
  }
  // The request's recurrent state `state_idx` of layer `layer_idx`; empty (rank 0) before its
  // first update_recurrent_state.
  typename S::state_view_type recurrent_state(paged::RequestRef request, std::int64_t layer_idx,
                                              std::int64_t state_idx = 0) const {
    const state_at at = find_state(request, layer_idx, state_idx, "recurrent_state");
    if (!states_.recurrent_written(at.entry, at.slot, at.epoch)) return S::make_state_view(nullptr, 0, {});
    const auto& made = states_.at(at.entry);
    return S::make_state_view(states_.recurrent(at.entry, at.slot), made.rank, made.shape);
  }
  // Whether the request's state `state_idx` of layer `layer_idx` has had an update_conv_state
  // since the request took its slot (transformers' has_previous_state, per request).
  bool has_previous_state(paged::RequestRef request, std::int64_t layer_idx, std::int64_t state_idx = 0) const {
    const state_at at = find_state(request, layer_idx, state_idx, "has_previous_state");
    return states_.conv_written(at.entry, at.slot, at.epoch);
  }

  // ---- one request's saved state (kvc::save_request, kvc::load_request: <kvc/state.hpp>) ---------
  // The payload: "PagedRequest", the element type, the cache's geometry (block size, heads,
  // head_dim, layers per group, each group's attention type), the request's block count per
  // group, then every block's rows, pool after pool (K then V), head after head. The archives and
  // the helpers are kvc::detail's (detail/state_io.hpp), found where the call is made.
  template <class A>
    requires(!A::loading)
  void transfer_request(A& ar, const std::string& request_id) const {
    if (is_offloaded(request_id))
      throw ValueError("kvc::save_request: request " + request_id + " is offloaded: restore_request it first");
    request_header(ar, request_id);
    std::vector<std::int64_t> counts;
    const std::vector<std::int64_t> blocks = request_blocks(request_id, &counts);
    for (const std::int64_t n : counts) ar.value(n);
    request_rows(ar, blocks);
    request_states(ar, tables_.find_known(request_id));
  }

 private:
  // A loaded request's linear-attention states, read aside: they go into its slot (and the state
  // tensors a layer lacks into the cache) only when the load is committed.
  struct loaded_states {
    std::int64_t slot = -1;
    std::uint64_t epoch = 0;
    std::vector<std::vector<T>> conv, rec;  // per entry; empty: not written
    std::vector<std::optional<typename paged::StatePools<S>::made_conv>> new_conv;
    std::vector<std::optional<typename paged::StatePools<S>::made_recurrent>> new_rec;
  };

 public:
  // Reading allocates the request's blocks (the cache must not hold it) and fills them; the
  // returned object's commit() keeps them (and puts the request's states in place), and dropping
  // it without a commit frees them again.
  class loaded_request {
   public:
    // The load of request `id` into `target`, whose blocks it frees unless committed (null: none).
    loaded_request(PagedCache* target, std::string id) : target_(target), id_(std::move(id)) {}
    // Takes over the other object's load; the other frees nothing.
    loaded_request(loaded_request&& o) noexcept
        : target_(std::exchange(o.target_, nullptr)), id_(std::move(o.id_)), states_(std::move(o.states_)) {}
    loaded_request& operator=(loaded_request&&) = delete;
    // Frees the request's blocks unless commit() was called.
    ~loaded_request() {
      if (target_) target_->free_blocks(id_);
    }
    // Keeps the loaded request's blocks and puts its states in place.
    void commit() noexcept {
      if (target_) target_->install_states(states_);
      target_ = nullptr;
    }

   private:
    friend class PagedCache;
    PagedCache* target_;
    std::string id_;
    loaded_states states_;
  };
  // Reads a request saved by the overload above into the cache (kvc::load_request): allocates and
  // fills its blocks and returns the load, which commit() keeps. kvc::StateError when the cache
  // already holds the request, the geometry differs or too few blocks are free.
  template <class A>
    requires A::loading
  [[nodiscard]] loaded_request transfer_request(A& ar, const std::string& request_id) {
    ar.set_context("request " + request_id);
    if (is_offloaded(request_id) || blocks_in_use(request_id) > 0)
      ar.fail("the cache already holds this request; free_blocks it first");
    request_header(ar, request_id);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(num_groups()));
    std::int64_t most = 0, total = 0;
    for (std::int64_t& n : counts) {
      n = ar.size("a group's block count");
      most = std::max(most, n);
      total += n;
    }
    ar.check(total <= num_blocks(), "more blocks than the cache has");
    ar.reserve(static_cast<std::uint64_t>(total) * static_cast<std::uint64_t>(bytes_per_block()),
               "the request's blocks");
    loaded_request out(nullptr, request_id);
    if (most > 0) {
      if (state_slots() > 0 && free_state_slots() == 0)
        ar.fail("the request needs a state slot for its linear-attention states, and none is free");
      if (!allocate_blocks(most, request_id, 0))
        ar.fail("the request needs " + std::to_string(total) + " free blocks and the cache has " +
                std::to_string(get_num_free_blocks()));
      out.target_ = this;
    }
    std::vector<std::int64_t> got;
    const std::vector<std::int64_t> blocks = request_blocks(request_id, &got);
    if (got != counts) ar.fail("the cache's groups would give the request other block counts than the file's");
    request_rows(ar, blocks);
    if (const auto k = tables_.find(request_id))
      load_states(ar, *k, out.states_);
    else
      ar.check(ar.size("whether the request holds states") == 0, "states for a request without blocks");
    return out;
  }

 private:
  // f(keys of the requests), with keys made for ids the cache does not know yet; those that hold
  // nothing afterwards (a request given no block) are forgotten again, also when f throws outside
  // a transaction (in one, the rollback does).
  template <class F>
  auto with_keys(std::span<const paged::RequestRef> requests, F&& f) {
    if (requests.size() == 1) {  // (one request, the common call: no list)
      const paged::RequestKey k = tables_.key(requests[0]);
      if (requests[0].by_key()) return f(std::span(&k, 1));  // (a key: nothing was made)
      return settled(std::span(&k, 1), f);
    }
    std::vector<paged::RequestKey> keys;
    keys.reserve(requests.size());
    try {
      for (const paged::RequestRef r : requests) keys.push_back(tables_.key(r));
    } catch (...) {
      if (!in_transaction())
        for (const paged::RequestKey k : keys) settle(k);
      throw;
    }
    return settled(std::span<const paged::RequestKey>(keys), f);
  }
  // f(keys), then each key settled (also when f throws outside a transaction).
  template <class F>
  auto settled(std::span<const paged::RequestKey> keys, F& f) {
    const auto settle_all = [&] {
      for (const paged::RequestKey k : keys) settle(k);
    };
    try {
      auto out = f(keys);
      settle_all();
      return out;
    } catch (...) {
      if (!in_transaction()) settle_all();
      throw;
    }
  }
  // Forgets a request that holds nothing (no table, no swap blocks) and was not opened. Outside a
  // transaction it allocates nothing.
  void settle(paged::RequestKey k) {
    if (tables_.names().contains(k) && !tables_.names().opened(k) && !swap_.is_offloaded(k) &&
        !tables_.has_any_table(k))
      tables_.forget(k);
  }

  template <class A>
  void request_header(A& ar, const std::string& request_id) const {
    state_header<S>(ar, "PagedRequest");
    ar.set_context("request " + request_id);
    ar.param("block_size", block_size());
    ar.param("kv_heads", num_key_value_heads());
    ar.param("head_dim", head_dim());
    ar.param("layers_per_group", groups_.group_size);
    ar.param("groups", num_groups());
    for (std::size_t g = 0; g < groups_.types.size(); ++g)
      same_text(ar, "group " + std::to_string(g) + "'s attention type", groups_.types[g]);
    ar.param("state_layers", static_cast<std::int64_t>(groups_.state_layers.size()));
    ar.param("states_per_layer", states_per_layer_);
    for (const std::int64_t l : groups_.state_layers) ar.param("state_layer", l);
  }
  // The request's linear-attention states, after its blocks: whether it holds a state slot, then
  // per (layer, state index) whether its conv state is written (then channels, kernel and the
  // elements) and whether its recurrent state is (then rank, shape and the elements).
  template <class A>
    requires(!A::loading)
  void request_states(A& ar, paged::RequestKey k) const {
    const std::int64_t slot = tables_.state_slots().slot_of(k);
    ar.value(slot >= 0);
    if (slot < 0) return;
    const std::uint64_t epoch = tables_.state_slots().epoch(slot);
    for (std::int64_t e = 0; e < states_.entries(); ++e) {
      const auto& x = states_.at(e);
      const bool conv = states_.conv_written(e, slot, epoch), rec = states_.recurrent_written(e, slot, epoch);
      ar.value(conv);
      if (conv) {
        ar.value(x.channels);
        ar.value(x.kernel);
        ar.raw(const_cast<T*>(states_.conv(e, slot)), static_cast<std::size_t>(x.conv_size()) * sizeof(T));
      }
      ar.value(rec);
      if (rec) {
        ar.value(x.rank);
        for (int r = 0; r < x.rank; ++r) ar.value(x.shape[static_cast<std::size_t>(r)]);
        ar.raw(const_cast<T*>(states_.recurrent(e, slot)), static_cast<std::size_t>(x.recurrent_size) * sizeof(T));
      }
    }
  }
  // Reads what request_states wrote for the request (whose new state slot is k's) into `out`: the
  // states and the state tensors a layer still lacks, made aside; install_states puts them in
  // place when the load is committed, so a refused file leaves the cache's tensors as they were.
  template <class A>
    requires A::loading
  void load_states(A& ar, paged::RequestKey k, loaded_states& out) const {
    const std::int64_t slot = tables_.state_slots().slot_of(k);
    const std::int64_t held = ar.size("whether the request holds states");
    ar.check(held <= 1 && (held == 1) == (slot >= 0), "states for a request without a state slot, or none for one");
    if (held == 0) return;
    const auto n = static_cast<std::size_t>(states_.entries());
    out.slot = slot;
    out.epoch = tables_.state_slots().epoch(slot);
    out.conv.assign(n, {});
    out.rec.assign(n, {});
    out.new_conv.assign(n, std::nullopt);
    out.new_rec.assign(n, std::nullopt);
    for (std::size_t e = 0; e < n; ++e) {
      const auto& x = states_.at(static_cast<std::int64_t>(e));
      const auto what = [&] {
        return "state " + std::to_string(static_cast<std::int64_t>(e) % states_per_layer_) + " of layer " +
               std::to_string(groups_.state_layers[e / static_cast<std::size_t>(states_per_layer_)]);
      };
      const std::int64_t c = ar.size("whether a conv state is written");
      ar.check(c <= 1, "a conv state's flag");
      if (c == 1) {
        const std::int64_t channels = ar.size("a conv state's channels"), kernel = ar.size("a conv state's kernel");
        ar.check(channels > 0 && kernel > 0, "a conv state of no columns");
        if (x.channels > 0 && (x.channels != channels || x.kernel != kernel))
          ar.fail(what() + " holds conv states of " + std::to_string(channels) + " channels and kernel " +
                  std::to_string(kernel) + " in the file, and of " + std::to_string(x.channels) +
                  " channels and kernel " + std::to_string(x.kernel) + " in the cache");
        const std::int64_t elems = detail::checked_elements({channels, kernel}, sizeof(T));
        ar.reserve(static_cast<std::uint64_t>(elems) * sizeof(T), "a conv state");
        out.conv[e].resize(static_cast<std::size_t>(elems));
        ar.raw(out.conv[e].data(), out.conv[e].size() * sizeof(T));
        if (x.channels == 0) out.new_conv[e] = states_.make_conv(channels, kernel);
      }
      const std::int64_t r = ar.size("whether a recurrent state is written");
      ar.check(r <= 1, "a recurrent state's flag");
      if (r == 1) {
        const std::int64_t rank = ar.size("a recurrent state's rank");
        ar.check(rank >= 1 && rank <= 4, "a recurrent state's rank");
        std::array<std::int64_t, 4> shape{};
        std::int64_t elems = 1;
        for (std::int64_t i = 0; i < rank; ++i) {
          std::int64_t& d = shape[static_cast<std::size_t>(i)];
          d = ar.size("a recurrent state's shape");
          ar.check(d >= 1 && detail::mul_fits(elems, d, elems), "a recurrent state's shape");
        }
        ar.check(shape[0] == 1, "a request's recurrent state of a batch other than 1");
        const auto file_shape = S::make_state_view(nullptr, static_cast<int>(rank), shape);
        if (x.rank > 0 && !same_shape(x.rank, x.shape, file_shape))
          ar.fail(what() + " holds recurrent states of shape " + shape_string(file_shape) + " in the file, and " +
                  shape_string(S::make_state_view(nullptr, x.rank, x.shape)) + " in the cache");
        elems = detail::checked_elements({elems}, sizeof(T));
        ar.reserve(static_cast<std::uint64_t>(elems) * sizeof(T), "a recurrent state");
        out.rec[e].resize(static_cast<std::size_t>(elems));
        ar.raw(out.rec[e].data(), out.rec[e].size() * sizeof(T));
        if (x.rank == 0) out.new_rec[e] = states_.make_recurrent(static_cast<int>(rank), shape);
      }
    }
  }
  // Puts a committed load's states in place: the tensors made for it (where the cache has made
  // none since), then the states into the request's slot, marked written.
  void install_states(loaded_states& in) noexcept {
    if (in.slot < 0) return;
    for (std::size_t e = 0; e < in.conv.size(); ++e) {
      const auto i = static_cast<std::int64_t>(e);
      if (in.new_conv[e] && states_.at(i).channels == 0) states_.install(i, std::move(*in.new_conv[e]));
      if (in.new_rec[e] && states_.at(i).rank == 0) states_.install(i, std::move(*in.new_rec[e]));
      if (!in.conv[e].empty() && states_.at(i).conv_size() == static_cast<std::int64_t>(in.conv[e].size())) {
        std::copy(in.conv[e].begin(), in.conv[e].end(), states_.conv(i, in.slot));
        states_.mark_conv(i, in.slot, in.epoch);
      }
      if (!in.rec[e].empty() && states_.at(i).recurrent_size == static_cast<std::int64_t>(in.rec[e].size())) {
        std::copy(in.rec[e].begin(), in.rec[e].end(), states_.recurrent(i, in.slot));
        states_.mark_recurrent(i, in.slot, in.epoch);
      }
    }
  }

  // Every block's rows, pool after pool (K then V), each block head after head: written from the
  // pools, or read into them.
  template <class A>
  void request_rows(A& ar, const std::vector<std::int64_t>& blocks) const {
    pages_.for_each_piece(blocks, [&](T* p, std::int64_t n) { ar.raw(p, static_cast<std::size_t>(n) * sizeof(T)); });
  }

  // One layer's step, checked: its group, its pool tensor, and whether the group is sliding.
  struct step {
    std::size_t group;
    std::size_t pool;
    bool sliding;
  };
  // update_rows for the layer at (group, pool tensor) `at`.
  void update_rows_at(std::pair<std::int64_t, std::int64_t> at, const view_type& k, const view_type& v,
                      std::span<const std::int64_t> reads, std::span<const std::int64_t> writes, T* out_k, T* out_v) {
    const step s = check_step(k, v, at, reads, writes);
    if (s.sliding && out_k)  // read, then write: a write may reuse a slot read here
      pages_.gather(s.pool, reads, out_k, out_v, &k, &v, sentinel_index());
    pages_.scatter(s.pool, k, v, writes);
    if (!s.sliding && out_k) pages_.gather(s.pool, reads, out_k, out_v);  // the reads include the new tokens
  }
  // Every check of an update of the layer at (group, pool tensor) `at`: shapes, token counts and
  // rows. Nothing is written before it returns.
  step check_step(const view_type& k, const view_type& v, std::pair<std::int64_t, std::int64_t> at,
                  std::span<const std::int64_t> reads, std::span<const std::int64_t> writes) const {
    const auto [g, j] = at;
    const bool sliding = is_sliding_group(g);
    check_input(k, "keys", row_width());
    check_input(v, "values", value_row_width());
    if (k.extent(2) != v.extent(2))
      throw ValueError("kvc::PagedCache::update: keys and values have " + std::to_string(k.extent(2)) + " and " +
                       std::to_string(v.extent(2)) + " tokens");
    const std::int64_t tokens = k.extent(2);
    if (static_cast<std::int64_t>(writes.size()) != tokens)
      throw ValueError("kvc::PagedCache::update: " + std::to_string(tokens) + " new tokens but " +
                       std::to_string(writes.size()) + " write rows for group " + std::to_string(g));
    const std::int64_t rows = pool_rows();
    for (const std::int64_t r : writes) check_row(r, rows, "write");
    const std::int64_t sentinel = sentinel_index();
    std::int64_t sentinels = 0;
    for (const std::int64_t r : reads) {
      check_row(r, rows, "read");
      sentinels += (sliding && r == sentinel) ? 1 : 0;
    }
    if (sentinels > tokens)
      throw ValueError("kvc::PagedCache::update: " + std::to_string(sentinels) + " sentinel rows but only " +
                       std::to_string(tokens) + " new tokens");
    return {static_cast<std::size_t>(g), static_cast<std::size_t>(j), sliding};
  }

  // The model's layer groups: a model with linear-attention states needs attention layers too
  // (the blocks are what requests are admitted by) and at least one state per layer.
  static paged::LayerGroups grouped(const ModelConfig& config) {
    paged::LayerGroups out = paged::group_paged_layers(config);
    if (!out.state_layers.empty() && out.groups.empty())
      throw ValueError(
          "kvc::PagedCache: the model has no attention layers; a paged cache serves linear-attention layers next "
          "to attention layers only (a model of linear-attention layers alone keeps fixed-size states: use a "
          "dynamic cache)");
    if (!out.state_layers.empty())
      detail::check_size("kvc::PagedCache: number_of_conv_states", config.number_of_conv_states, 1, max_layers);
    return out;
  }

  // Where one state of one request is: its pool entry, its slot and the slot's epoch.
  struct state_at {
    std::int64_t entry, slot;
    std::uint64_t epoch;
  };
  // Every check of a call on the request's state `state_idx` of layer `layer_idx`, with its
  // messages: the layer (kvc::IndexError out of range, ValueError without states), the state
  // index (kvc::KeyError), the request (a ValueError when it holds no state slot).
  state_at find_state(paged::RequestRef request, std::int64_t layer_idx, std::int64_t state_idx,
                      const char* method) const {
    check_layer(layer_idx);
    const auto& layers = groups_.state_layers;
    const auto it = std::lower_bound(layers.begin(), layers.end(), layer_idx);
    if (it == layers.end() || *it != layer_idx)
      throw ValueError("Cannot call `" + std::string(method) + "` on a non-LinearAttention layer!");
    if (state_idx < 0 || state_idx >= states_per_layer_)
      throw KeyError(std::string(method) + ": state_idx " + std::to_string(state_idx) +
                     " is out of range for a layer with " + std::to_string(states_per_layer_) + " states");
    const paged::RequestKey k = tables_.find_known(request);
    const std::int64_t slot = tables_.state_slots().slot_of(k);
    if (slot < 0)
      throw ValueError("kvc::PagedCache::" + std::string(method) + ": request " + tables_.id(k) +
                       " holds no state slot (a request takes one with its first blocks)");
    return {(it - layers.begin()) * states_per_layer_ + state_idx, slot, tables_.state_slots().epoch(slot)};
  }
  void check_layer(std::int64_t layer_idx) const {
    if (layer_idx < 0 || layer_idx >= num_layers())
      throw IndexError("kvc::PagedCache: layer " + std::to_string(layer_idx) + " is out of range for " +
                       std::to_string(num_layers()) + " layers");
  }
  // (group, index in group) of layer l, nullopt when it is in no group.
  std::optional<std::pair<std::int64_t, std::int64_t>> find_group(std::int64_t l) const noexcept {
    for (std::size_t g = 0; g < groups_.groups.size(); ++g)
      for (std::size_t j = 0; j < groups_.groups[g].size(); ++j)
        if (groups_.groups[g][j] == l) return std::pair{static_cast<std::int64_t>(g), static_cast<std::int64_t>(j)};
    return std::nullopt;
  }
  static bool same_shape(int rank, const std::array<std::int64_t, 4>& shape, const typename S::state_view_type& x) {
    if (x.rank != rank) return false;
    for (int r = 0; r < rank; ++r)
      if (x.extent(r) != shape[static_cast<std::size_t>(r)]) return false;
    return true;
  }
  // match_prefix for a model with state slots: the prompt's whole blocks short of its last token,
  // hashed once; the cached run of them (attention), the last boundary with a snapshot (states),
  // and the last boundary with a snapshot within the cached run (what is reused).
  PagedPrefixMatch match_with_states(paged::RequestKey k, std::span<const std::int64_t> prompt_ids) {
    if (tables_.has_any_table(k))
      throw ValueError("kvc::paged: request " + tables_.id(k) + " already has blocks; a prefix match starts a table");
    if (swap_.is_offloaded(k))
      throw ValueError("kvc::paged: request " + tables_.id(k) +
                       " is offloaded; a prefix match starts a table (restore or drop it first)");
    PagedPrefixMatch out;
    if (prompt_ids.empty()) return out;
    const std::int64_t bs = block_size();
    const auto whole = (static_cast<std::int64_t>(prompt_ids.size()) - 1) / bs;
    std::optional<std::uint64_t> parent;
    bool cached = true;
    std::int64_t from = -1;  // the snapshot the reused prefix ends on
    for (std::int64_t b = 0; b < whole; ++b) {
      const std::uint64_t h = paged::compute_block_hash(
          parent, prompt_ids.subspan(static_cast<std::size_t>(b * bs), static_cast<std::size_t>(bs)), 0);
      parent = h;
      cached = cached && manager().find_hash(h).has_value();
      const std::int64_t end = (b + 1) * bs;
      if (cached) out.attention_tokens = end;
      if (end % snapshot_interval_ != 0) continue;
      if (const std::int64_t at = find_snapshot(h); at >= 0) {
        out.state_tokens = end;
        if (cached) {
          out.tokens = end;
          from = at;
        }
      }
    }
    if (from < 0 || tables_.search_prefix_match(k, prompt_ids.first(static_cast<std::size_t>(out.tokens))) == 0) {
      out.tokens = 0;  // (no free state slot)
      return out;
    }
    const paged::StateSlots& slots = tables_.state_slots();
    const std::int64_t slot = slots.slot_of(k);
    snapshot& used = snapshots_[static_cast<std::size_t>(from)];
    move_states({state_slots() + from, used.epoch, slot, slots.epoch(slot)});
    tables_.log().set(used.used, ++snapshot_tick_);  // (a rollback forgets the use)
    return out;
  }
  // The key of a snapshot after `tokens` (whole blocks): the hash of the request's group-0 block
  // ending there where the block is complete (the scheduler marks a step's complete blocks before
  // it saves, so a save costs O(1) there, not O(prefix)), else the hash computed from the tokens.
  std::uint64_t snapshot_key(paged::RequestKey k, std::span<const std::int64_t> tokens) const {
    const auto last = tokens.size() / static_cast<std::size_t>(block_size()) - 1;
    if (tables_.has_table(0, k))
      if (const auto& t = tables_.table(0, k); last < t.size())
        if (const paged::Block* b = manager().block(t[last]); b != nullptr && b->hash) return *b->hash;
    return prefix_hash(tokens);
  }
  // The hash of the last block of `tokens` (whole blocks), chained as group 0 chains its blocks.
  std::uint64_t prefix_hash(std::span<const std::int64_t> tokens) const {
    const auto bs = static_cast<std::size_t>(block_size());
    std::optional<std::uint64_t> parent;
    for (std::size_t at = 0; at < tokens.size(); at += bs)
      parent = paged::compute_block_hash(parent, tokens.subspan(at, bs), 0);
    return *parent;
  }
  // The snapshot entry holding `hash`, or -1.
  std::int64_t find_snapshot(std::uint64_t hash) const noexcept {
    for (std::size_t i = 0; i < snapshots_.size(); ++i)
      if (snapshots_[i].epoch != 0 && snapshots_[i].hash == hash) return static_cast<std::int64_t>(i);
    return -1;
  }
  // Each fork destination's slot gets its source's states (a rollback puts back what they overwrote).
  template <class Forks>
  void copy_forked_states(const Forks& forks) {
    if (state_slots() == 0) return;
    const paged::StateSlots& slots = tables_.state_slots();
    for (const auto& [source, destinations] : forks) {
      const std::int64_t a = slots.slot_of(source);
      for (const paged::RequestKey d : destinations) {
        const std::int64_t b = slots.slot_of(d);
        if (a >= 0) move_states({a, slots.epoch(a), b, slots.epoch(b)});  // (none: b reads as unwritten)
      }
    }
  }
  static std::int64_t head_divisor(const PagedTensorParallel& tp) {
    detail::check_size("kvc::PagedCache: tp_size", tp.tp_size, 1, max_layers);
    return tp.tp_size > 1 && tp.kv_is_tp ? tp.tp_size : 1;
  }
  static ContinuousBatchingConfig agreed(const ModelConfig& config, const ContinuousBatchingConfig& cb,
                                         const PagedTensorParallel& tp,
                                         const std::optional<PagedMemoryBudget>& budget) {
    ContinuousBatchingConfig out = budget ? planned(config, cb, *budget, head_divisor(tp)) : cb;
    if (tp.tp_size > 1 && tp.min_over_ranks && out.num_blocks) {
      // An unset max_batch_tokens enters the MIN as "no bound" and stays unset.
      std::array<std::int64_t, 2> v{out.max_batch_tokens.value_or(INT64_MAX), *out.num_blocks};
      tp.min_over_ranks(v);
      if (v[0] != INT64_MAX) out.max_batch_tokens = v[0];
      out.num_blocks = v[1];
    }
    return out;
  }
  static ContinuousBatchingConfig planned(const ModelConfig& config, ContinuousBatchingConfig cb,
                                          const PagedMemoryBudget& budget, std::int64_t head_divisor) {
    const PagedAttentionMemoryHandler handler(memory_model(config, cb, budget, head_divisor));
    const auto [m, nb] = handler.infer_max_batch_tokens_and_num_blocks(
        cb.max_batch_tokens, cb.num_blocks, budget.available_bytes - planned_state_bytes(config, cb, budget));
    cb.max_batch_tokens = m;
    cb.num_blocks = nb;
    return cb;
  }
  // What the planner sets aside for the state slots of a hybrid model: the most slots the cache
  // can have (the blocks it plans only lower it) times a request's states.
  static std::int64_t planned_state_bytes(const ModelConfig& config, const ContinuousBatchingConfig& cb,
                                          const PagedMemoryBudget& budget) {
    if (paged::group_paged_layers(config).state_layers.empty()) return 0;
    detail::check_size("kvc::PagedMemoryBudget: state_bytes_per_request", budget.state_bytes_per_request, 0,
                       max_extent);
    const std::int64_t n = cb.max_state_slots.value_or(cb.max_requests_per_batch.value_or(256));
    detail::check_size("kvc::PagedCache: max_state_slots", n, 1, max_extent);
    const paged::LayerGroups groups = paged::group_paged_layers(config);
    const std::int64_t snapshots = snapshots_for(groups, cb, n), rollback = rollback_for(groups, cb, n, snapshots);
    const std::int64_t slots = n * (rollback > 0 ? rollback + 2 : 1) + snapshots;
    std::int64_t out = 0;
    if (!detail::mul_fits(slots, budget.state_bytes_per_request, out) || out > budget.available_bytes)
      throw MemoryError("kvc::PagedCache: the state slots and snapshots need " + std::to_string(slots) + " x " +
                        std::to_string(budget.state_bytes_per_request) + " bytes, more than the " +
                        std::to_string(budget.available_bytes) + " available");
    return out;
  }
  static checked_sizes checked(const ModelConfig& config, const ContinuousBatchingConfig& cb,
                               std::int64_t head_divisor) {
    checked_sizes out;
    out.page.block_size = checked_block_size(cb.block_size);
    out.page.kv_heads = kv_heads_of(config, head_divisor);
    out.head_dim = head_dim_of(config);
    out.page.head_dim = detail::stored_key_width<T>(out.head_dim);
    out.page.value_dim = detail::stored_value_width<T>(out.head_dim);
    out.num_blocks = checked_num_blocks(cb, out.page.kv_heads, std::max(out.page.head_dim, out.page.value_dim));
    out.state_slots = cb.resolved_max_state_slots(out.num_blocks);
    const paged::LayerGroups groups = paged::group_paged_layers(config);
    if constexpr (is_row_code_v<T>)
      if (!groups.state_layers.empty())
        throw ValueError("kvc::PagedCache: a pool of " + std::string(T::name) +
                         " holds keys and values only; a model with linear-attention states needs a pool of "
                         "float, double, half or bfloat16");
    if (!groups.state_layers.empty())
      detail::check_size("kvc::PagedCache: max_state_slots", out.state_slots, 1, max_extent);
    out.snapshots = snapshots_for(groups, cb, out.state_slots);
    out.rollback = rollback_for(groups, cb, out.state_slots, out.snapshots);
    return out;
  }
  // The state rollback ring of a cache of `groups` with `slots` state slots and `snapshots`
  // snapshots: cb.state_rollback_tokens for a model with states (checked for every model).
  static std::int64_t rollback_for(const paged::LayerGroups& groups, const ContinuousBatchingConfig& cb,
                                   std::int64_t slots, std::int64_t snapshots) {
    detail::check_size("kvc::PagedCache: state_rollback_tokens", cb.state_rollback_tokens, 0, max_layers);
    if (groups.state_layers.empty() || cb.state_rollback_tokens == 0) return 0;
    std::int64_t ring = 0;
    if (!detail::mul_fits(slots, cb.state_rollback_tokens + 1, ring) || ring > max_extent - slots - snapshots)
      throw ValueError(
          "kvc::PagedCache: max_state_slots x (state_rollback_tokens + 1) state rows are above kvc's limit");
    return cb.state_rollback_tokens;
  }
  // The rows of the state tensors: the request slots, the snapshots, then each slot's ring.
  static std::int64_t state_rows(const checked_sizes& sizes) noexcept {
    return sizes.state_slots * (sizes.rollback > 0 ? sizes.rollback + 2 : 1) + sizes.snapshots;
  }
  // The state snapshots a cache of `groups` keeps with `slots` state slots: for a model with states
  // whose attention layers form one full-attention group, with block sharing allowed. Checks
  // state_snapshot_interval and max_state_snapshots for every model.
  static std::int64_t snapshots_for(const paged::LayerGroups& groups, const ContinuousBatchingConfig& cb,
                                    std::int64_t slots) {
    const std::int64_t bs = checked_block_size(cb.block_size), every = cb.state_snapshot_interval;
    if (every < 0 || every % bs != 0)
      throw ValueError("kvc::PagedCache: state_snapshot_interval must be 0 or a positive multiple of block_size (" +
                       std::to_string(bs) + "), got " + std::to_string(every));
    if (cb.max_state_snapshots)
      detail::check_size("kvc::PagedCache: max_state_snapshots", *cb.max_state_snapshots, 0, max_extent);
    const bool one_full = groups.types.size() == 1 && groups.types[0] == "full_attention";
    if (groups.state_layers.empty() || !cb.allow_block_sharing || !one_full) return 0;
    const std::int64_t n = cb.resolved_max_state_snapshots(slots);
    detail::check_size("kvc::PagedCache: max_state_slots + max_state_snapshots", slots + n, 1, max_extent);
    return n;
  }
  static std::int64_t kv_heads_of(const ModelConfig& config, std::int64_t divisor) {
    const std::int64_t n = config.num_key_value_heads.value_or(config.num_attention_heads);
    if (n <= 0)
      throw ValueError("kvc::PagedCache: num_key_value_heads or num_attention_heads could not be found in the config");
    detail::check_size("kvc::PagedCache: the number of key/value heads", n, 1, max_extent);
    if (n % divisor != 0)
      throw ValueError("Number of key value heads " + std::to_string(n) +
                       " must be divisible by tensor parallel size " + std::to_string(divisor) + ".");
    return n / divisor;
  }
  static std::int64_t head_dim_of(const ModelConfig& config) {
    std::int64_t d = 0;
    if (config.head_dim)
      d = *config.head_dim;
    else if (config.num_attention_heads > 0)
      d = config.hidden_size / config.num_attention_heads;
    if (d <= 0)
      throw ValueError(
          "kvc::PagedCache: head_dim or (hidden_size and num_attention_heads) could not be found in the config");
    detail::check_size("kvc::PagedCache: head_dim", d, 1, max_extent);
    return d;
  }

  static std::int64_t checked_block_size(std::int64_t bs) {
    if (bs < min_block_size)
      throw ValueError("Block size must be at least " + std::to_string(min_block_size) + ", but got " +
                       std::to_string(bs));
    detail::check_size("kvc::PagedCache: block_size", bs, 1, max_extent);
    return bs;
  }
  static std::int64_t checked_num_blocks(const ContinuousBatchingConfig& cb, std::int64_t kv_heads,
                                         std::int64_t head_dim) {
    if (!cb.num_blocks)
      throw ValueError(
          "kvc::PagedCache: num_blocks is not set: set it, or give the cache a memory budget "
          "(kvc::PagedMemoryBudget) to plan it from");
    detail::check_size("kvc::PagedCache: num_blocks", *cb.num_blocks, 1, max_extent);
    // The pools' size, before anything is allocated for the blocks (kvc::allocation_limit).
    (void)detail::checked_elements({*cb.num_blocks + 2, cb.block_size, kv_heads, head_dim}, sizeof(T));
    return *cb.num_blocks;
  }
  static void check_allocation(std::int64_t n) {
    if (n < 0) throw ValueError("kvc::PagedCache: cannot allocate " + std::to_string(n) + " blocks");
    detail::check_size("kvc::PagedCache::allocate_blocks: n", n, 0, max_extent);
  }

  void check_input(const view_type& x, const char* what, std::int64_t d) const {
    const std::int64_t h = num_key_value_heads();
    if (x.extent(0) != 1 || x.extent(1) != h || x.extent(3) != d)
      throw ValueError(std::string("kvc::PagedCache::update: ") + what + " must be [1, " + std::to_string(h) +
                       ", tokens, " + std::to_string(d) + "], got " + shape_string(x.extents));
    if (x.stride(3) != 1 || x.stride(2) < x.extent(3) || x.stride(1) < 0)
      throw ValueError(std::string("kvc::PagedCache::update: ") + what +
                       " must have contiguous head_dim rows, got strides [" + std::to_string(x.stride(0)) + ", " +
                       std::to_string(x.stride(1)) + ", " + std::to_string(x.stride(2)) + ", " +
                       std::to_string(x.stride(3)) + "]");
  }
  static void check_row(std::int64_t r, std::int64_t rows, const char* what) {
    if (r < 0 || r >= rows)
      throw ValueError(std::string("kvc::PagedCache::update: ") + what + " row " + std::to_string(r) +
                       " is outside the cache's " + std::to_string(rows) + " rows");
  }
  void check_block(std::int64_t b) const {
    if (b < 0 || b >= num_blocks())
      throw ValueError("kvc::PagedCache::copy_cache: block " + std::to_string(b) + " is not one of the " +
                       std::to_string(num_blocks()) + " blocks");
  }
  std::int64_t pool_rows() const noexcept { return pages_.rows(); }

  // A copy of slot a's states (those written under epoch ea) to slot b (marked under epoch eb),
  // each slot the cache's or the swap pool's.
  struct state_copy {
    std::int64_t a;
    std::uint64_t ea;
    std::int64_t b;
    std::uint64_t eb;
    bool from_swap = false, to_swap = false;
  };
  void copy_states_now(const state_copy& c) noexcept {
    paged::StatePools<S>::copy_slot(c.from_swap ? swap_.states() : states_, c.a, c.ea,
                                    c.to_swap ? swap_.states() : states_, c.b, c.eb);
  }
  // Copies states at once. In a transaction the destination slot's states and marks are saved
  // first (std::bad_alloc possible, with nothing changed), and a rollback puts them back: the slot
  // may have been given back earlier in the transaction, and what its holder had must survive.
  void move_states(const state_copy& c) {
    if (in_transaction()) save_slot(c.to_swap, c.b);
    if (!c.to_swap && c.b < state_slots()) forget_rings(c.b);  // its states are another's now
    copy_states_now(c);
  }

  // ---- the state rollback rings (ContinuousBatchingConfig::state_rollback_tokens) -----------------
  // One state's ring of a slot: rows ring_row(slot, 0 .. rollback_) of states_ hold the state as it
  // was before each of its last `steps` one-token steps, the newest at head - 1; valid while
  // `epoch` is the slot's (a slot taken again starts with none). `open`: update_conv_state began a
  // step that update_recurrent_state has not ended. One row more than steps: a step writes the row
  // past the newest, never one the ring counts (in a transaction it saves the row first, for a
  // rollback that brings back a ring counting it).
  struct ring {
    std::uint64_t epoch = 0;
    std::int64_t head = 0, steps = 0;
    bool open = false;
  };
  ring& ring_of(std::int64_t slot, std::int64_t entry) noexcept {
    return rings_[static_cast<std::size_t>(slot * states_.entries() + entry)];
  }
  const ring& ring_of(std::int64_t slot, std::int64_t entry) const noexcept {
    return const_cast<PagedCache&>(*this).ring_of(slot, entry);
  }
  std::int64_t ring_row(std::int64_t slot, std::int64_t j) const noexcept {
    return state_slots() + max_state_snapshots() + slot * (rollback_ + 1) + j;
  }
  // The one-token steps the state's ring holds (0 for a ring of an earlier holder of the slot).
  std::int64_t ring_steps(std::int64_t slot, std::int64_t entry, std::uint64_t epoch) const noexcept {
    if (rollback_ == 0) return 0;
    const ring& r = ring_of(slot, entry);
    return r.epoch == epoch ? r.steps : 0;  // (a step counts from its conv update: a conv-only state's too)
  }
  // update_conv_state starts a step of the state: of one token, the state as it is goes into the
  // ring's next row; of several, the ring is emptied (it counts one-token steps only).
  void begin_step(const state_at& at, bool one_token) {
    if (rollback_ == 0) return;
    ring& r = ring_of(at.slot, at.entry);
    ring next = r.epoch == at.epoch ? r : ring{at.epoch, 0, 0, false};
    if (one_token) {
      // In a transaction the row is saved first: a rollback may bring back a ring that counts it.
      if (in_transaction()) save_slot(false, ring_row(at.slot, next.head));
      paged::StatePools<S>::copy_entry(states_, at.slot, at.epoch, states_, ring_row(at.slot, next.head), at.epoch,
                                       at.entry);
      next.head = (next.head + 1) % (rollback_ + 1);
      next.steps = std::min(next.steps + 1, rollback_);
      next.open = true;
    } else {
      next.steps = 0;
      next.open = false;
    }
    tables_.log().set(r, next);
  }
  // update_recurrent_state ends the step update_conv_state began; one that began none cannot be
  // counted in tokens, so the ring is emptied.
  void end_step(const state_at& at) {
    if (rollback_ == 0) return;
    ring& r = ring_of(at.slot, at.entry);
    if (r.epoch != at.epoch) return;
    ring next = r;
    if (!r.open) next.steps = 0;
    next.open = false;
    tables_.log().set(r, next);
  }
  // The slot's rings hold nothing (its states were replaced wholesale).
  void forget_rings(std::int64_t slot) {
    if (rollback_ == 0) return;
    for (std::int64_t e = 0; e < states_.entries(); ++e)
      if (ring& r = ring_of(slot, e); r.epoch != 0) tables_.log().set(r, ring{});
  }
  // A state slot as a transaction found it before a copy overwrote it.
  struct saved_slot {
    bool swap = false;  // the swap pool's slot, else the cache's
    std::int64_t slot = 0;
    std::vector<std::int64_t> sizes;   // each entry's conv then recurrent elements, as saved
    std::vector<std::uint64_t> marks;  // each entry's conv then recurrent mark
    typename S::buffer_type data;      // the states, in that order
  };
  // Saves the slot's states and marks in the next record and registers their undo. A record of an
  // earlier transaction is used again with its memory, so a steady state of forks, offloads and
  // matches allocates nothing here. Strong guarantee: what fails leaves the record unused.
  void save_slot(bool swap, std::int64_t slot) {
    const paged::StatePools<S>& p = swap ? swap_.states() : states_;
    const auto entries = static_cast<std::size_t>(p.entries());
    std::int64_t n = 0;
    for (std::int64_t e = 0; e < p.entries(); ++e) n += p.at(e).conv_size() + p.at(e).recurrent_size;
    if (saved_used_ == saved_states_.size()) {
      if (saved_states_.size() == saved_states_.capacity())
        saved_states_.reserve(std::max<std::size_t>(8, 2 * saved_states_.capacity()));
      saved_states_.emplace_back();
    }
    saved_slot& saved = saved_states_[saved_used_];
    if (saved.data.size() < n) saved.data = typename S::buffer_type(n);
    saved.sizes.resize(2 * entries);
    saved.marks.resize(2 * entries);
    saved.swap = swap;
    saved.slot = slot;
    T* out = saved.data.data();
    for (std::size_t e = 0; e < entries; ++e) {
      const auto i = static_cast<std::int64_t>(e);
      const std::int64_t c = p.at(i).conv_size(), r = p.at(i).recurrent_size;
      saved.sizes[2 * e] = c;
      saved.sizes[2 * e + 1] = r;
      saved.marks[2 * e] = p.conv_mark(i, slot);
      saved.marks[2 * e + 1] = p.recurrent_mark(i, slot);
      if (c > 0) S::copy_2d(out, c, p.conv(i, slot), c, c, 1);
      if (r > 0) S::copy_2d(out + c, r, p.recurrent(i, slot), r, r, 1);
      out += c + r;
    }
    tables_.log().on_undo(&restore_slot, this, saved_used_);
    ++saved_used_;
  }
  static void restore_slot(void* self, const std::byte* data) noexcept {
    auto& me = *static_cast<PagedCache*>(self);
    const saved_slot& s = me.saved_states_[paged::UndoLog::load<std::size_t>(data)];
    paged::StatePools<S>& p = s.swap ? me.swap_.states() : me.states_;
    const T* in = s.data.data();
    for (std::size_t e = 0; e < s.sizes.size() / 2; ++e) {
      const auto i = static_cast<std::int64_t>(e);
      const std::int64_t c = s.sizes[2 * e], r = s.sizes[2 * e + 1];
      if (c > 0) S::copy_2d(p.conv(i, s.slot), c, in, c, c, 1);
      if (r > 0) S::copy_2d(p.recurrent(i, s.slot), r, in + c, r, r, 1);
      in += c + r;
      p.mark_conv(i, s.slot, s.marks[2 * e]);
      p.mark_recurrent(i, s.slot, s.marks[2 * e + 1]);
    }
  }

  // Where block copies go: the pools or the swap pool.
  enum class pool : unsigned char { pages, swap };
  struct pending_copy {
    pool from, to;
    std::size_t at, n;  // sources pending_ids_[at, at + n), destinations the n after them
  };
  void copy_between(pool from, std::span<const std::int64_t> src, pool to, std::span<const std::int64_t> dst) {
    paged::PagePools<S>::copy_blocks(from == pool::pages ? pages_ : swap_.pages(), src,
                                     to == pool::pages ? pages_ : swap_.pages(), dst);
  }
  // Copies blocks now, or in a transaction when it commits (a block taken in it may have been a
  // free one still holding a prefix: its rows must not change before the transaction is kept).
  void move_blocks(pool from, std::span<const std::int64_t> src, pool to, std::span<const std::int64_t> dst) {
    if (!in_transaction()) return copy_between(from, src, to, dst);
    const std::size_t at = pending_ids_.size();
    if (pending_.size() == pending_.capacity()) pending_.reserve(std::max<std::size_t>(8, 2 * pending_.capacity()));
    if (at + 2 * src.size() > pending_ids_.capacity())
      pending_ids_.reserve(std::max(at + 2 * src.size(), 2 * pending_ids_.capacity()));
    pending_ids_.insert(pending_ids_.end(), src.begin(), src.end());
    pending_ids_.insert(pending_ids_.end(), dst.begin(), dst.end());
    pending_.push_back({from, to, at, src.size()});
  }

  paged::LayerGroups groups_;
  paged::BlockTables tables_;
  paged::PagePools<S> pages_;  // (num_blocks + 2) blocks: the padding zone is the last two
  paged::SwapPool<S> swap_;
  std::int64_t states_per_layer_ = 0;  // 0: the model has no linear-attention states
  paged::StatePools<S> states_;        // every slot's states
  typename S::buffer_type out_conv_;   // what the last update_conv_state returned
  // What a transaction's state copies overwrote: the first saved_used_ records (the others are kept
  // for their memory).
  std::vector<saved_slot> saved_states_;
  std::size_t saved_used_ = 0;
  // A state snapshot: slot state_slots() + i of states_ for entry i.
  struct snapshot {
    std::uint64_t hash = 0;   // of the prefix's last block (group 0's chain)
    std::uint64_t epoch = 0;  // its marks in states_ (0: the entry is empty)
    std::uint64_t used = 0;   // when it was last saved or matched (0: never)
  };
  // The state rollback: how many one-token steps each slot's ring keeps (0: none), and per (slot,
  // entry) the ring's bookkeeping, slot-major.
  std::int64_t rollback_ = 0;
  std::vector<ring> rings_;
  std::vector<snapshot> snapshots_;
  std::int64_t snapshot_interval_ = 0;
  // Snapshot epochs: above every slot epoch StateSlots gives out, so that no mark is ambiguous.
  std::uint64_t snapshot_epoch_ = std::uint64_t{1} << 63;
  std::uint64_t snapshot_tick_ = 0;
  std::optional<std::int64_t> max_batch_tokens_;
  std::int64_t max_blocks_per_request_ = 0;
  std::int64_t head_dim_ = 0;              // the model's (the pools' rows are row_width() wide)
  paged::BlockCopies cut_;                 // truncate_request's scratch, kept between calls
  typename S::buffer_type out_k_, out_v_;  // what the last update with reads returned
  // Transactions: the copies waiting for the commit.
  std::vector<pending_copy> pending_;
  std::vector<std::int64_t> pending_ids_;
};

}  // namespace kvc

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
//   - one allocator per group keeps each request's block table (allocators.hpp); allocation is all
//     or nothing across groups;
//   - update(k, v, layer, read_index, write_index) scatters the new tokens to their rows and gathers
//     what attention reads (full groups: write, then read; sliding groups: read, then write).
// What this version does not do yet (docs/paged.md): device storage, the runtime path
// (make_cache("paged")).

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <kvc/concepts/storage_policy.hpp>
#include <kvc/config.hpp>
#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/allocators.hpp>
#include <kvc/paged/block_manager.hpp>
#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/paged/layer_groups.hpp>
#include <kvc/paged/memory_planner.hpp>
#include <kvc/tensor_view.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// What the memory planner needs beyond the model config: the bytes the cache may use (the free
// device or host memory times max_memory_percent, which kvc does not probe), the vocabulary (the
// logits peak) and how the model runs.
struct PagedMemoryBudget {
  std::int64_t available_bytes = 0;
  std::int64_t vocab_size = 0;
  bool flash_attention = false;
  bool async_batching = false;
  bool return_logprobs = false;
};

// Tensor parallelism as the paged cache sees it. kv_is_tp: the K/V projections are sharded
// (transformers: both "layers.*.self_attn.k_proj" and "...v_proj" are in the TP plan).
// min_over_ranks replaces each value of its argument by its minimum over the TP ranks (an
// all-reduce MIN: NCCL or gloo upstream, MPI or anything else here); unset, this rank's values
// stand, as on a single rank.
struct PagedTensorParallel {
  std::int64_t tp_size = 1;
  bool kv_is_tp = false;
  std::function<void(std::span<std::int64_t>)> min_over_ranks;
};

// One int64 row list per layer group: transformers' read_index / write_index.
using PagedIndices = std::vector<std::vector<std::int64_t>>;

// The key lengths of a request's next step per attention type (transformers' get_seqlens_k).
struct PagedSeqlensK {
  std::optional<std::int64_t> full_attention;
  std::optional<std::int64_t> sliding_attention;
};

namespace paged {

// A request whose blocks could not be allocated this step, with the blocks it asked for
// (PagedCache::blocks_needed), in scheduling order.
struct StarvedRequest {
  std::string request_id;
  std::int64_t demand = 0;
};

// Which requests transformers' offloading manager evicts (offloading_manager.py,
// offload_requests): while the starved requests' demand exceeds the free blocks, the newest
// starved request becomes a victim (its demand leaves, its blocks_in_use(id) blocks count as
// freed), never leaving fewer than one active request. Returns the victims oldest first; empty
// when nothing can help.
template <class BlocksInUse>
std::vector<std::string> select_offload_victims(std::span<const StarvedRequest> starved, std::int64_t free_blocks,
                                                std::int64_t num_active, BlocksInUse&& blocks_in_use) {
  std::int64_t demand = 0;
  for (const StarvedRequest& s : starved) demand += s.demand;
  std::vector<std::string> victims;
  std::size_t left = starved.size();
  while (demand > free_blocks && left > 0 && num_active - static_cast<std::int64_t>(victims.size()) > 1) {
    const StarvedRequest& v = starved[--left];
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

template <class S>
  requires concepts::PagedStoragePolicy<S>
class PagedCache<S> {
 public:
  using T = typename S::element_type;
  using view_type = typename S::view_type;
  using allocator = std::variant<paged::FullAttentionCacheAllocator, paged::SlidingAttentionCacheAllocator>;

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
  PagedCache(const ModelConfig& config, const ContinuousBatchingConfig& cb, std::int64_t head_divisor, resolved)
      : block_size_(checked_block_size(cb.block_size)),
        kv_heads_(kv_heads_of(config, head_divisor)),
        head_dim_(head_dim_of(config)),
        manager_(checked_num_blocks(cb, kv_heads_, head_dim_), block_size_) {
    groups_ = paged::group_layers_by_attn_type(config);
    for (const std::string& type : groups_.types)
      if (type != "full_attention" && type != "sliding_attention") throw ValueError("Invalid group type: " + type);
    const std::int64_t layers = static_cast<std::int64_t>(paged::paged_layer_types(config).size());
    layer_map_.assign(static_cast<std::size_t>(layers), {-1, -1});
    for (std::size_t g = 0; g < groups_.groups.size(); ++g)
      for (std::size_t j = 0; j < groups_.groups[g].size(); ++j)
        layer_map_[static_cast<std::size_t>(groups_.groups[g][j])] = {static_cast<std::int64_t>(g),
                                                                      static_cast<std::int64_t>(j)};

    max_batch_tokens_ = cb.max_batch_tokens;
    max_blocks_per_request_ = cb.resolved_max_blocks_per_request();

    for (std::size_t g = 0; g < groups_.types.size(); ++g) {
      const auto index = static_cast<std::int64_t>(g);
      if (groups_.types[g] == "full_attention") {
        allocators_.emplace_back(paged::FullAttentionCacheAllocator(index, block_size_, cb.allow_block_sharing));
      } else {
        if (!config.sliding_window || *config.sliding_window < 1)
          throw ValueError("kvc::PagedCache: the model has sliding_attention layers but no sliding_window");
        allocators_.emplace_back(paged::SlidingAttentionCacheAllocator(index, block_size_, *config.sliding_window,
                                                                       sentinel_index(), write_trash_index()));
      }
    }
    use_prefix_sharing_ = cb.allow_block_sharing && groups_.types == std::vector<std::string>{"full_attention"};
    cut_groups_.reserve(allocators_.size());
    cut_fresh_.reserve(allocators_.size());
    cut_old_.reserve(allocators_.size());

    // The pools, zeroed whole: the read-trash block must be (padded reads see zeros), and the rest
    // is zeroed too (a one-time cost) so that no path ever reads uninitialized memory.
    const std::int64_t elems =
        detail::checked_elements({num_blocks() + 2, block_size_, kv_heads_, head_dim_}, sizeof(T));
    keys_.reserve(static_cast<std::size_t>(groups_.group_size));
    values_.reserve(static_cast<std::size_t>(groups_.group_size));
    for (std::int64_t j = 0; j < groups_.group_size; ++j) {
      keys_.emplace_back(elems);
      values_.emplace_back(elems);
      S::zero_2d(keys_.back().data(), elems, elems, 1);
      S::zero_2d(values_.back().data(), elems, elems, 1);
    }
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
    const paged::LayerGroups groups = paged::group_layers_by_attn_type(config);
    PagedMemoryModel m;
    m.hidden_size = config.hidden_size;
    m.vocab_size = budget.vocab_size;
    m.num_attention_heads = config.num_attention_heads;
    m.num_key_value_heads = kv_heads_of(config, head_divisor);
    m.head_dim = head_dim_of(config);
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

  // ---- geometry -----------------------------------------------------------------------------------

  std::int64_t block_size() const noexcept { return block_size_; }
  std::int64_t num_blocks() const noexcept { return manager_.num_blocks(); }
  std::int64_t num_pages() const noexcept { return num_blocks() * block_size_; }
  std::int64_t num_key_value_heads() const noexcept { return kv_heads_; }
  std::int64_t head_dim() const noexcept { return head_dim_; }
  std::int64_t group_size() const noexcept { return groups_.group_size; }
  std::int64_t num_groups() const noexcept { return static_cast<std::int64_t>(groups_.groups.size()); }
  const paged::LayerGroups& layer_groups() const noexcept { return groups_; }
  std::int64_t num_full_attention_groups() const noexcept {
    return std::count_if(allocators_.begin(), allocators_.end(), [](const allocator& a) {
      return std::holds_alternative<paged::FullAttentionCacheAllocator>(a);
    });
  }
  std::int64_t num_sliding_attention_groups() const noexcept {
    return static_cast<std::int64_t>(allocators_.size()) - num_full_attention_groups();
  }
  // The sliding groups' window (every sliding group has the config's), 0 without one.
  std::int64_t sliding_window() const noexcept {
    const auto* a = sliding_allocator();
    return a ? a->sliding_window() : 0;
  }
  std::int64_t max_sliding_window_blocks_per_request() const noexcept {
    const auto* a = sliding_allocator();
    return a ? a->max_blocks_per_request() : 0;
  }
  std::int64_t max_blocks_per_request() const noexcept { return max_blocks_per_request_; }
  std::optional<std::int64_t> max_batch_tokens() const noexcept { return max_batch_tokens_; }
  bool use_prefix_sharing() const noexcept { return use_prefix_sharing_; }
  // Whether some full-attention group hashes its complete blocks (allow_block_sharing): forks
  // share them, and a step's completed blocks are worth marking.
  bool shares_blocks() const noexcept {
    for (const allocator& a : allocators_)
      if (const auto* full = std::get_if<paged::FullAttentionCacheAllocator>(&a); full && full->uses_block_sharing())
        return true;
    return false;
  }
  std::int64_t read_trash_index() const noexcept { return num_blocks() * block_size_; }
  std::int64_t sentinel_index() const noexcept { return read_trash_index() + 1; }
  std::int64_t write_trash_index() const noexcept { return (num_blocks() + 1) * block_size_; }
  // (group, index in group) of a layer.
  std::pair<std::int64_t, std::int64_t> layer_group(std::int64_t layer_idx) const {
    if (layer_idx < 0 || layer_idx >= static_cast<std::int64_t>(layer_map_.size()))
      throw IndexError("kvc::PagedCache: layer " + std::to_string(layer_idx) + " is out of range for " +
                       std::to_string(layer_map_.size()) + " layers");
    return layer_map_[static_cast<std::size_t>(layer_idx)];
  }
  // Bytes of the K and V pools.
  std::int64_t bytes() const noexcept {
    return 2 * groups_.group_size * (num_blocks() + 2) * block_size_ * row_elems() *
           static_cast<std::int64_t>(sizeof(T));
  }
  const paged::BlockManager& manager() const noexcept { return manager_; }
  const allocator& group_allocator(std::int64_t g) const { return allocators_.at(static_cast<std::size_t>(g)); }
  // Pool tensor j, [kv_heads, rows, head_dim] flat, rows = (num_blocks + 2) * block_size (a paged
  // attention kernel reads it through a block table or read indices).
  const T* key_pool(std::int64_t j) const { return keys_.at(static_cast<std::size_t>(j)).data(); }
  const T* value_pool(std::int64_t j) const { return values_.at(static_cast<std::size_t>(j)).data(); }

  // ---- allocation -------------------------------------------------------------------------------

  // Blocks an allocation of n (logical) blocks takes over all groups, for a request holding
  // `allocated` logical blocks (its full-group count): n per full group, and per sliding group what
  // its ring still lacks, at most n. Saturated at the int64 limits (any count is accepted).
  std::int64_t blocks_needed(std::int64_t n, std::int64_t allocated) const noexcept {
    const std::int64_t full = num_full_attention_groups(), sliding = num_sliding_attention_groups(),
                       max_sliding = max_sliding_window_blocks_per_request();
    std::int64_t need = saturating_mul(n, full);
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
  bool will_allocation_be_successful(std::int64_t n, std::int64_t allocated) const noexcept {
    return blocks_needed(n, allocated) <= get_num_free_blocks();
  }
  std::int64_t get_num_free_blocks() const noexcept { return manager_.num_free_blocks(); }
  // Blocks the request holds over all groups.
  std::int64_t blocks_in_use(const std::string& request_id) const {
    std::int64_t n = 0;
    for (std::size_t g = 0; g < allocators_.size(); ++g) n += blocks_in_group(g, request_id);
    return n;
  }

  // n more blocks for the request in every group, all or nothing: nullopt, with nothing changed,
  // when they do not fit. Returns the most blocks any group took (n for full groups).
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, const std::string& request_id, std::int64_t allocated) {
    if (n < 0) throw ValueError("kvc::PagedCache: cannot allocate " + std::to_string(n) + " blocks");
    detail::check_size("kvc::PagedCache::allocate_blocks: n", n, 0, max_extent);
    detail::check_size("kvc::PagedCache::allocate_blocks: allocated", allocated, 0, max_extent);
    if (!will_allocation_be_successful(n, allocated)) return std::nullopt;
    // What each group will really take (a sliding group from its own table, which a wrong
    // `allocated` could misstate): all of it must fit, or nothing is taken.
    std::vector<std::int64_t> takes;  // per group
    takes.reserve(allocators_.size());
    for (const allocator& a : allocators_)
      takes.push_back(std::visit(
          [&](const auto& al) -> std::int64_t {
            if constexpr (std::decay_t<decltype(al)>::is_sliding) {
              return al.blocks_to_take(al.has_request(request_id) ? std::ssize(al.table(request_id)) : 0, n);
            } else {
              return n;
            }
          },
          a));
    if (std::accumulate(takes.begin(), takes.end(), std::int64_t{0}) > get_num_free_blocks()) return std::nullopt;
    // Every group's table and its room first (undone if one cannot be made), so that taking the
    // blocks afterwards allocates nothing: an allocation failure changes nothing.
    std::vector<char> made(allocators_.size(), 0);
    try {
      for (std::size_t g = 0; g < allocators_.size(); ++g)
        made[g] =
            std::visit([&](auto& al) { return al.reserve_table(request_id, takes[g], manager_); }, allocators_[g]);
    } catch (...) {
      for (std::size_t g = 0; g < allocators_.size(); ++g)
        if (made[g]) std::visit([&](auto& al) { al.drop_empty_table(request_id, manager_); }, allocators_[g]);
      throw;
    }
    std::int64_t most = 0;
    for (allocator& a : allocators_) {
      // Cannot come back empty after the check above (value() would throw bad_optional_access).
      const auto got = std::visit([&](auto& al) { return al.allocate_blocks(n, request_id, manager_); }, a);
      most = std::max(most, got.value());
    }
    return most;
  }

  // Blocks the request holds in group g (0 without a table there).
  std::int64_t blocks_in_group(std::size_t g, const std::string& request_id) const {
    return std::visit(
        [&](const auto& al) {
          return al.has_request(request_id) ? static_cast<std::int64_t>(al.table(request_id).size()) : std::int64_t{0};
        },
        allocators_.at(g));
  }

  void free_blocks(const std::string& request_id) {
    for (allocator& a : allocators_) std::visit([&](auto& al) { al.free_blocks(request_id, manager_); }, a);
  }
  void free_all_requests() {
    std::vector<std::string> all;
    for (const allocator& a : allocators_)
      std::visit(
          [&](const auto& al) {
            for (auto& r : al.requests()) all.push_back(std::move(r));
          },
          a);
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    for (const std::string& r : all)
      for (allocator& a : allocators_)
        std::visit(
            [&](auto& al) {
              if (al.has_request(r)) al.free_blocks(r, manager_);
            },
            a);
  }

  // Keeps the request's first `tokens` positions and gives back the blocks past them, in every
  // group (llama.cpp's seq_rm of a suffix; transformers' crop). A partial last block that another
  // request shares, or that is complete (hashed: a later prompt may still find it), is replaced by
  // a private copy first, so the tokens written after the cut change nothing anyone else reads.
  // A sliding group keeps the ring blocks of slots below `tokens`: right only while the ring has
  // not wrapped (the request never passed its window), which the caller checks. False, with
  // nothing changed, when no block is free for a copy.
  bool truncate_request(const std::string& request_id, std::int64_t tokens) {
    if (tokens < 0)
      throw ValueError("kvc::PagedCache::truncate_request: tokens must be >= 0, got " + std::to_string(tokens));
    detail::check_size("kvc::PagedCache::truncate_request: tokens", tokens, 0, max_extent);
    const std::int64_t keep = (tokens + block_size_ - 1) / block_size_;
    // Scratch with room for every group, kept between calls (made once per cache; a copied cache
    // makes it here, before anything changes): a truncation then allocates nothing, so a caller
    // can truncate in the commit half of an all-or-nothing operation.
    cut_groups_.reserve(allocators_.size());
    cut_fresh_.reserve(allocators_.size());
    cut_old_.reserve(allocators_.size());
    std::vector<std::size_t>& copy = cut_groups_;  // groups whose last kept block needs a private copy
    std::vector<std::int64_t>& fresh = cut_fresh_;
    std::vector<std::int64_t>& old = cut_old_;
    copy.clear();
    fresh.clear();
    old.clear();
    if (tokens % block_size_ != 0)
      for (std::size_t g = 0; g < allocators_.size(); ++g) {
        const auto* full = std::get_if<paged::FullAttentionCacheAllocator>(&allocators_[g]);
        if (!full || !full->uses_block_sharing() || blocks_in_group(g, request_id) < keep) continue;
        const paged::Block* b = manager_.block(full->table(request_id)[static_cast<std::size_t>(keep - 1)]);
        if (b && (b->is_complete() || b->ref_count > 1)) copy.push_back(g);
      }
    if (static_cast<std::int64_t>(copy.size()) > get_num_free_blocks()) return false;
    for (const std::size_t g : copy) {  // cannot fail: counted above, room reserved
      const auto& full = std::get<paged::FullAttentionCacheAllocator>(allocators_[g]);
      const auto& t = full.table(request_id);
      const auto at = static_cast<std::size_t>(keep - 1);
      const std::optional<std::int64_t> parent = at > 0 ? std::optional(t[at - 1]) : std::nullopt;
      manager_.take_free_blocks(1, parent, true, full.index(), fresh);
      old.push_back(t[at]);
    }
    move_blocks(pool::pages, old, pool::pages, fresh);
    for (std::size_t i = 0; i < copy.size(); ++i) {
      auto& t = std::get<paged::FullAttentionCacheAllocator>(allocators_[copy[i]]).mutable_table(request_id);
      paged::keep_entry(manager_.log(), t, static_cast<std::size_t>(keep - 1));
      t[static_cast<std::size_t>(keep - 1)] = fresh[i];
      manager_.decrease_ref_count(old[i]);
    }
    for (std::size_t g = 0; g < allocators_.size(); ++g)
      if (blocks_in_group(g, request_id) > 0)
        std::visit([&](auto& al) { al.truncate(request_id, keep, manager_); }, allocators_[g]);
    return true;
  }

  // ---- indices ----------------------------------------------------------------------------------

  // Appends the request's rows for a step of q tokens after `past` to each group's lists; no read
  // rows when read_index is null (a batch where no request has cache takes the write-only path).
  void extend_read_and_write_indices(const std::string& request_id, std::int64_t past, std::int64_t q,
                                     PagedIndices* read_index, PagedIndices& write_index) const {
    const auto g = static_cast<std::size_t>(num_groups());
    if (write_index.size() != g || (read_index && read_index->size() != g))
      throw ValueError("kvc::PagedCache: index lists need one entry per layer group (" + std::to_string(g) + ")");
    // (negative lengths: the allocators' message)
    detail::check_size("kvc::PagedCache::extend_read_and_write_indices: past", past, INT64_MIN, max_extent);
    detail::check_size("kvc::PagedCache::extend_read_and_write_indices: q", q, INT64_MIN, max_extent);
    PagedIndices reads(read_index ? g : 0), writes(g);  // appended only once every group succeeded
    for (std::size_t i = 0; i < g; ++i)
      std::visit(
          [&](const auto& al) {
            al.get_write_indices(request_id, past, q, writes[i]);
            if (read_index) al.get_read_indices(request_id, past, q, reads[i]);
          },
          allocators_[i]);
    for (std::size_t i = 0; i < g; ++i) write_index[i].reserve(write_index[i].size() + writes[i].size());
    if (read_index)
      for (std::size_t i = 0; i < g; ++i) (*read_index)[i].reserve((*read_index)[i].size() + reads[i].size());
    for (std::size_t i = 0; i < g; ++i) {
      write_index[i].insert(write_index[i].end(), writes[i].begin(), writes[i].end());
      if (read_index) (*read_index)[i].insert((*read_index)[i].end(), reads[i].begin(), reads[i].end());
    }
  }

  // The request's block table for a decode kernel: `table` is [num_groups, max_blocks_per_request],
  // row g gets the group's first ceil((past + q) / block_size) blocks. Sliding groups have none.
  void fill_block_table(const std::string& request_id, std::int64_t past, std::int64_t q,
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
    for (std::size_t g = 0; g < allocators_.size(); ++g) {
      const auto* full = std::get_if<paged::FullAttentionCacheAllocator>(&allocators_[g]);
      full->fill_block_table(request_id, past, q,
                             table.subspan(g * static_cast<std::size_t>(max_blocks_per_request_),
                                           static_cast<std::size_t>(max_blocks_per_request_)));
    }
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
  // blocks; returns the number of prompt tokens they hold. 0 unless prefix sharing is on.
  std::int64_t search_prefix_match(const std::string& request_id, std::span<const std::int64_t> prompt_ids) {
    if (!use_prefix_sharing_) return 0;
    auto& full = std::get<paged::FullAttentionCacheAllocator>(allocators_[0]);
    const std::int64_t n = full.search_prefix_match(request_id, prompt_ids, manager_);
    manager_.log().set(total_prefix_length_, total_prefix_length_ + n);
    return n;
  }
  // Prompt tokens served from shared blocks so far (the prefix-sharing statistic).
  std::int64_t total_prefix_length() const noexcept { return total_prefix_length_; }

  // Hashes the request's newly completed blocks in every group that shares blocks.
  void mark_shareable_blocks_as_complete(const std::string& request_id, std::int64_t num_complete_blocks,
                                         std::span<const std::int64_t> token_ids) {
    if (num_complete_blocks <= 0) return;
    for (allocator& a : allocators_)
      if (auto* full = std::get_if<paged::FullAttentionCacheAllocator>(&a); full && full->uses_block_sharing())
        manager_.mark_shareable_blocks_as_complete(num_complete_blocks, full->mutable_table(request_id), token_ids);
  }

  // How many forks of `source` the free blocks allow (2^31 when a fork needs no new block).
  std::int64_t compute_max_num_forks(const std::string& source) const {
    const std::int64_t per_fork = blocks_copied_per_fork(source);
    return per_fork == 0 ? (std::int64_t{1} << 31) : get_num_free_blocks() / per_fork;
  }

  // Tables for copies of `source` under `destinations` in every group, then the block copies the
  // non-shared blocks need (copy_cache). All or nothing across groups.
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_request(
      const std::string& source, std::span<const std::string> destinations) {
    const std::pair<std::string, std::span<const std::string>> one{source, destinations};
    return fork_requests(std::span(&one, 1));
  }
  // Several sources at once, each (source, its destinations): all forks or none.
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> fork_requests(
      std::span<const std::pair<std::string, std::span<const std::string>>> forks) {
    std::int64_t copies = 0;
    std::vector<const std::string*> named;  // every destination so far
    for (const auto& [source, destinations] : forks) {
      copies += blocks_copied_per_fork(source) * static_cast<std::int64_t>(destinations.size());
      for (const std::string& d : destinations) {
        for (const allocator& a : allocators_)
          if (std::visit([&](const auto& al) { return al.has_request(d); }, a))
            throw ValueError("Block table already exists for request " + d);
        for (const std::string* e : named)
          if (*e == d) throw ValueError("kvc::paged: fork destination " + d + " is named twice");
        named.push_back(&d);
      }
    }
    if (copies > get_num_free_blocks())
      throw ValueError("Failed to fork blocks for request " + (forks.empty() ? std::string() : forks.front().first));
    // Every fork of every group is prepared (all the memory it needs) before any takes a block, so
    // that an allocation failure changes nothing.
    std::vector<paged::CacheAllocator::PreparedFork> prepared;  // fork-major, then group
    std::vector<std::int64_t> src, dst;
    try {
      prepared.reserve(forks.size() * allocators_.size());
      for (const auto& f : forks)  // (no structured binding: clang 14 lambdas cannot capture one)
        for (allocator& a : allocators_)
          prepared.push_back(std::visit([&](auto& al) { return al.prepare_fork(f.first, f.second, manager_); }, a));
      src.reserve(static_cast<std::size_t>(copies));
      dst.reserve(static_cast<std::size_t>(copies));
    } catch (...) {
      for (std::size_t i = 0; i < prepared.size(); ++i)
        std::visit([&](auto& al) { al.abandon_fork(prepared[i], manager_); }, allocators_[i % allocators_.size()]);
      throw;
    }
    for (std::size_t i = 0; i < prepared.size(); ++i)  // fits: checked above, and nothing allocates
      std::visit([&](auto& al) { (void)al.commit_fork(forks[i / allocators_.size()].first, prepared[i], manager_); },
                 allocators_[i % allocators_.size()]);
    for (const auto& f : prepared) {
      src.insert(src.end(), f.blocks.copy_src.begin(), f.blocks.copy_src.end());
      dst.insert(dst.end(), f.blocks.copy_dst.begin(), f.blocks.copy_dst.end());
    }
    copy_cache(src, dst);
    return {std::move(src), std::move(dst)};
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
  // made, and block copies (forks, offload, restore) wait for the commit; rollback_transaction()
  // undoes the changes, newest first, and drops the copies, allocating nothing. Calls in between
  // see the changes as they are made; one that throws may leave part of its work to the rollback,
  // so roll back after an exception. The scheduler runs each schedule() and update() as one, so
  // that a std::bad_alloc anywhere in them leaves the cache as it was.
  bool in_transaction() const noexcept { return manager_.in_transaction(); }
  void begin_transaction() {
    if (in_transaction()) throw ValueError("kvc::PagedCache::begin_transaction: a transaction is already open");
    manager_.log().begin();
  }
  // Makes the waiting copies (on the host they cannot fail) and keeps the changes.
  void commit_transaction() {
    for (const pending_copy& c : pending_)
      copy_between(c.from, std::span(pending_ids_).subspan(c.at, c.n), c.to,
                   std::span(pending_ids_).subspan(c.at + c.n, c.n));
    pending_.clear();
    pending_ids_.clear();
    manager_.log().commit();
  }
  void rollback_transaction() noexcept {
    pending_.clear();
    pending_ids_.clear();
    manager_.log().rollback();
  }

  // ---- request offload ---------------------------------------------------------------------------
  // When blocks run out, transformers' offloading manager moves whole requests out of the cache
  // into a swap pool (and soft-resets those that do not fit: they free their blocks and prefill
  // again). Here the pool is memory of the storage's kind (host memory for HostStorage), sized in
  // blocks; offload_request copies a request's blocks there and frees them, restore_request copies
  // them back into the blocks the request was given again, in the same table positions (a sliding
  // ring keeps its slot order), so the request continues bit-identically.

  // Bytes of one block in every pool tensor (what one swap block holds).
  std::int64_t bytes_per_block() const noexcept {
    return 2 * groups_.group_size * block_size_ * row_elems() * static_cast<std::int64_t>(sizeof(T));
  }
  // (Re)creates an empty swap pool of `num_blocks` blocks; refused while requests are offloaded.
  void reserve_swap_space(std::int64_t num_blocks) {
    if (!swapped_.empty())
      throw ValueError("kvc::PagedCache: the swap pool cannot be resized while " + std::to_string(swapped_.size()) +
                       " requests are offloaded to it");
    detail::check_size("kvc::PagedCache: swap blocks", num_blocks, 0, max_extent);
    const std::int64_t elems = detail::checked_elements({num_blocks, block_size_, kv_heads_, head_dim_}, sizeof(T));
    std::vector<typename S::buffer_type> k, v;
    k.reserve(keys_.size());
    v.reserve(keys_.size());
    for (std::size_t j = 0; j < keys_.size(); ++j) {
      k.emplace_back(elems);
      v.emplace_back(elems);
    }
    std::vector<std::int64_t> free(static_cast<std::size_t>(num_blocks));
    for (std::int64_t i = 0; i < num_blocks; ++i) free[static_cast<std::size_t>(i)] = i;
    swap_k_ = std::move(k);
    swap_v_ = std::move(v);
    swap_free_ = std::move(free);
  }
  // The swap pool transformers' offloading manager would make for this cache's blocks
  // (kvc::plan_swap_blocks, memory_planner.hpp, which probes the available RAM when it is unset).
  std::int64_t plan_swap_blocks(const ContinuousBatchingConfig& cb,
                                std::optional<std::int64_t> available_ram = std::nullopt) const {
    return kvc::plan_swap_blocks(cb, bytes_per_block(), available_ram);
  }
  // The swap pool's size in blocks (what its buffers hold).
  std::int64_t swap_blocks() const noexcept {
    return swap_k_.empty() ? 0 : static_cast<std::int64_t>(swap_k_.front().size()) / (block_size_ * row_elems());
  }
  std::int64_t free_swap_blocks() const noexcept { return static_cast<std::int64_t>(swap_free_.size()); }
  bool is_offloaded(const std::string& request_id) const { return swapped_.count(request_id) != 0; }

  // Copies the request's blocks (every group) to the smallest free swap blocks and frees them in
  // the cache. False, with nothing changed, when the request holds no block or the pool has too
  // few free blocks (transformers then soft-resets it: free_blocks, and prefill it again).
  bool offload_request(const std::string& request_id) {
    if (is_offloaded(request_id)) throw ValueError("kvc::PagedCache: request " + request_id + " is already offloaded");
    swapped_request out;
    std::vector<std::int64_t> blocks;
    for (const allocator& a : allocators_)
      std::visit(
          [&](const auto& al) {
            const std::int64_t n =
                al.has_request(request_id) ? static_cast<std::int64_t>(al.table(request_id).size()) : 0;
            out.group_counts.push_back(n);
            if (n > 0) blocks.insert(blocks.end(), al.table(request_id).begin(), al.table(request_id).end());
          },
          a);
    if (blocks.empty() || static_cast<std::int64_t>(blocks.size()) > free_swap_blocks()) return false;
    out.swap_ids.assign(swap_free_.begin(), swap_free_.begin() + static_cast<std::ptrdiff_t>(blocks.size()));
    keep_swap_free();
    manager_.log().room(1, paged::insert_undo_bytes);
    auto [slot, inserted] = swapped_.emplace(request_id, std::move(out));
    paged::undo_insert(manager_.log(), swapped_, *slot);
    // Committed: copies and bookkeeping that cannot fail on the host (outside a transaction).
    move_blocks(pool::pages, blocks, pool::swap, slot->second.swap_ids);
    swap_free_.erase(swap_free_.begin(), swap_free_.begin() + static_cast<std::ptrdiff_t>(blocks.size()));
    free_blocks(request_id);
    return true;
  }

  // Copies an offloaded request back into the first blocks of its new tables (allocate them first:
  // each group needs as many blocks as it had) and returns its swap blocks to the pool.
  void restore_request(const std::string& request_id) {
    const auto it = swapped_.find(request_id);
    if (it == swapped_.end()) throw ValueError("kvc::PagedCache: request " + request_id + " is not offloaded");
    std::vector<std::int64_t> dst;
    for (std::size_t g = 0; g < allocators_.size(); ++g) {
      const std::int64_t n = it->second.group_counts[g];
      if (n == 0) continue;
      const std::int64_t have = blocks_in_group(g, request_id);
      if (have < n)
        throw ValueError("kvc::PagedCache: request " + request_id + " needs " + std::to_string(n) +
                         " blocks in group " + std::to_string(g) + " to be restored, and has " + std::to_string(have));
      const auto& t = std::visit([&](const auto& al) -> const auto& { return al.table(request_id); }, allocators_[g]);
      dst.insert(dst.end(), t.begin(), t.begin() + n);
    }
    std::vector<std::int64_t> freed = with_swap_ids_returned(it->second);
    keep_swap_free();
    move_blocks(pool::swap, it->second.swap_ids, pool::pages, dst);
    swap_free_ = std::move(freed);
    kept_swapped_.erase(manager_.log(), swapped_, it);
  }
  // Forgets an offloaded request (cancelled or failed): its swap blocks return to the pool.
  // Allocates nothing: the free list always has room for every swap block.
  void drop_offloaded_request(const std::string& request_id) {
    const auto it = swapped_.find(request_id);
    if (it == swapped_.end()) return;
    keep_swap_free();
    swap_free_.insert(swap_free_.end(), it->second.swap_ids.begin(), it->second.swap_ids.end());
    std::sort(swap_free_.begin(), swap_free_.end());
    kept_swapped_.erase(manager_.log(), swapped_, it);
  }

  // Gives back everything the request holds: its blocks in every group where it has a table, and
  // its swap blocks. Unlike free_blocks, a request that holds nothing is no warning. Allocates
  // nothing, so a caller can use it in the commit half of an all-or-nothing operation.
  void release_request(const std::string& request_id) {
    for (allocator& a : allocators_)
      std::visit(
          [&](auto& al) {
            if (al.has_request(request_id)) al.free_blocks(request_id, manager_);
          },
          a);
    drop_offloaded_request(request_id);
  }

  // ---- update -----------------------------------------------------------------------------------

  // The write half of update for every layer at once (vLLM's reshape_and_cache with a slot
  // mapping): layer l's new keys and values, keys[l] and values[l] ([1, kv_heads, T_g, head_dim],
  // T_g the write rows of its group), go to their group's write rows. One storage call for the
  // whole model: on a CUDA device, one kernel launch. Every layer is checked before anything is
  // written; nothing is read or returned (attention reads the pools: paged_attention).
  void write_all_layers(std::span<const view_type> keys, std::span<const view_type> values,
                        const PagedIndices& write_index) {
    const auto layers = layer_map_.size();
    if (keys.size() != layers || values.size() != layers || write_index.size() != allocators_.size())
      throw ValueError("kvc::PagedCache::write_all_layers: " + std::to_string(keys.size()) + " keys and " +
                       std::to_string(values.size()) + " values for " + std::to_string(layers) + " layers, and " +
                       std::to_string(write_index.size()) + " write lists for " + std::to_string(allocators_.size()) +
                       " layer groups");
    const PagedIndices no_reads(allocators_.size());
    std::vector<std::int64_t> rows;  // every group's write rows, one list after the other
    std::vector<std::size_t> first(allocators_.size());
    for (std::size_t g = 0; g < allocators_.size(); ++g) {
      first[g] = rows.size();
      rows.insert(rows.end(), write_index[g].begin(), write_index[g].end());
    }
    std::vector<detail::scatter_job<T>> jobs;
    jobs.reserve(2 * layers);
    for (std::size_t l = 0; l < layers; ++l) {
      const step s = check_step(keys[l], values[l], static_cast<std::int64_t>(l), no_reads, write_index);
      const std::size_t n = write_index[s.group].size();
      jobs.push_back(job(keys_[s.pool].data(), keys[l], first[s.group], n));
      jobs.push_back(job(values_[s.pool].data(), values[l], first[s.group], n));
    }
    S::scatter_rows(jobs, rows, kv_heads_, head_dim_, pool_rows() * head_dim_);
  }

  // Stores the step's keys and values of layer `layer_idx` ([1, kv_heads, T, head_dim], the T query
  // tokens of every request of the batch one after the other) at the group's write rows, and
  // returns what attention reads: the group's read rows in order, [1, kv_heads, R, head_dim],
  // each request's cached tokens then its new ones. With no read rows (no request of the batch
  // has cache) it only writes and returns its inputs. The returned views point into a buffer of
  // the cache that the next update overwrites. Every check comes before the first write.
  KV<view_type> update(const view_type& k, const view_type& v, std::int64_t layer_idx, const PagedIndices& read_index,
                       const PagedIndices& write_index) {
    if (read_index.size() != allocators_.size() || write_index.size() != allocators_.size())
      throw ValueError("kvc::PagedCache::update: index lists need one entry per layer group (" +
                       std::to_string(allocators_.size()) + ")");
    const step s = check_step(k, v, layer_idx, read_index, write_index);
    const std::vector<std::int64_t>& reads = read_index[s.group];
    if (reads.empty()) {  // the write-only path
      write_and_read(s, k, v, read_index, write_index, nullptr, nullptr);
      return {k, v};
    }
    const auto r = static_cast<std::int64_t>(reads.size());
    const std::int64_t out_elems = detail::checked_elements({kv_heads_, r, head_dim_}, sizeof(T));
    if (out_k_.size() < out_elems) {
      typename S::buffer_type nk(out_elems), nv(out_elems);
      out_k_ = std::move(nk);
      out_v_ = std::move(nv);
    }
    write_and_read(s, k, v, read_index, write_index, out_k_.data(), out_v_.data());
    const std::array<std::int64_t, 4> e{1, kv_heads_, r, head_dim_};
    const std::array<std::int64_t, 4> st{kv_heads_ * r * head_dim_, r * head_dim_, head_dim_, 1};
    return {S::make_view(out_k_.data(), e, st), S::make_view(out_v_.data(), e, st)};
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
  }
  // Reading allocates the request's blocks (the cache must not hold it) and fills them; the
  // returned object's commit() keeps them, and dropping it without a commit frees them again.
  class loaded_request {
   public:
    loaded_request(PagedCache* target, std::string id) : target_(target), id_(std::move(id)) {}
    loaded_request(loaded_request&& o) noexcept : target_(std::exchange(o.target_, nullptr)), id_(std::move(o.id_)) {}
    loaded_request& operator=(loaded_request&&) = delete;
    ~loaded_request() {
      if (target_) target_->free_blocks(id_);
    }
    void commit() noexcept { target_ = nullptr; }

   private:
    friend class PagedCache;
    PagedCache* target_;
    std::string id_;
  };
  template <class A>
    requires A::loading
  [[nodiscard]] loaded_request transfer_request(A& ar, const std::string& request_id) {
    ar.set_context("request " + request_id);
    if (is_offloaded(request_id) || blocks_in_use(request_id) > 0)
      ar.fail("the cache already holds this request; free_blocks it first");
    request_header(ar, request_id);
    std::vector<std::int64_t> counts(allocators_.size());
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
      if (!allocate_blocks(most, request_id, 0))
        ar.fail("the request needs " + std::to_string(total) + " free blocks and the cache has " +
                std::to_string(get_num_free_blocks()));
      out.target_ = this;
    }
    std::vector<std::int64_t> got;
    const std::vector<std::int64_t> blocks = request_blocks(request_id, &got);
    if (got != counts) ar.fail("the cache's groups would give the request other block counts than the file's");
    request_rows(ar, blocks);
    return out;
  }

 private:
  template <class A>
  void request_header(A& ar, const std::string& request_id) const {
    state_header<S>(ar, "PagedRequest");
    ar.set_context("request " + request_id);
    ar.param("block_size", block_size_);
    ar.param("kv_heads", kv_heads_);
    ar.param("head_dim", head_dim_);
    ar.param("layers_per_group", static_cast<std::int64_t>(keys_.size()));
    ar.param("groups", static_cast<std::int64_t>(groups_.types.size()));
    for (std::size_t g = 0; g < groups_.types.size(); ++g)
      same_text(ar, "group " + std::to_string(g) + "'s attention type", groups_.types[g]);
  }
  // Every block's rows, pool after pool (K then V), each block head after head: written from the
  // pools, or read into them.
  template <class A>
  void request_rows(A& ar, const std::vector<std::int64_t>& blocks) const {
    const std::int64_t piece = block_size_ * head_dim_, pitch = pool_rows() * head_dim_;
    for (auto* pools : {&keys_, &values_})
      for (const auto& pool : *pools)
        for (const std::int64_t b : blocks)
          for (std::int64_t h = 0; h < kv_heads_; ++h)
            ar.raw(const_cast<T*>(pool.data()) + h * pitch + b * piece, static_cast<std::size_t>(piece) * sizeof(T));
  }
  // The request's blocks, group after group, and (if asked) each group's count.
  std::vector<std::int64_t> request_blocks(const std::string& request_id, std::vector<std::int64_t>* counts) const {
    std::vector<std::int64_t> blocks;
    for (const allocator& a : allocators_)
      std::visit(
          [&](const auto& al) {
            const std::int64_t n = al.has_request(request_id) ? std::ssize(al.table(request_id)) : 0;
            if (counts) counts->push_back(n);
            if (n > 0) blocks.insert(blocks.end(), al.table(request_id).begin(), al.table(request_id).end());
          },
          a);
    return blocks;
  }

  template <class>
  friend class PagedBatchCache;  // runs a dense batch's rows through check_step and write_and_read

  // One layer's step, checked: its group, its pool tensor, and whether the group is sliding.
  struct step {
    std::size_t group;
    std::size_t pool;
    bool sliding;
  };
  // Every check of update() (the index lists have one entry per group): shapes, token counts and
  // rows. Nothing is written before it returns.
  step step_of(std::int64_t layer_idx) const {
    const auto [g, j] = layer_group(layer_idx);
    return {static_cast<std::size_t>(g), static_cast<std::size_t>(j),
            std::holds_alternative<paged::SlidingAttentionCacheAllocator>(allocators_[static_cast<std::size_t>(g)])};
  }
  step check_step(const view_type& k, const view_type& v, std::int64_t layer_idx, const PagedIndices& read_index,
                  const PagedIndices& write_index) const {
    const step s = step_of(layer_idx);
    const auto g = static_cast<std::int64_t>(s.group);
    const auto gi = s.group;
    const std::vector<std::int64_t>& reads = read_index[gi];
    const std::vector<std::int64_t>& writes = write_index[gi];
    check_input(k, "keys");
    check_input(v, "values");
    if (k.extent(2) != v.extent(2))
      throw ValueError("kvc::PagedCache::update: keys and values have " + std::to_string(k.extent(2)) + " and " +
                       std::to_string(v.extent(2)) + " tokens");
    const std::int64_t tokens = k.extent(2);
    if (static_cast<std::int64_t>(writes.size()) != tokens)
      throw ValueError("kvc::PagedCache::update: " + std::to_string(tokens) + " new tokens but " +
                       std::to_string(writes.size()) + " write rows for group " + std::to_string(g));
    const std::int64_t rows = pool_rows();
    for (const std::int64_t r : writes) check_row(r, rows, "write");
    const bool sliding = s.sliding;
    const std::int64_t sentinel = sentinel_index();
    std::int64_t sentinels = 0;
    for (const std::int64_t r : reads) {
      check_row(r, rows, "read");
      sentinels += (sliding && r == sentinel) ? 1 : 0;
    }
    if (sentinels > tokens)
      throw ValueError("kvc::PagedCache::update: " + std::to_string(sentinels) + " sentinel rows but only " +
                       std::to_string(tokens) + " new tokens");
    return s;
  }
  // Writes a checked step and gathers its read rows into out_k and out_v ([kv_heads, R, head_dim],
  // R the group's read rows; nothing is read when they are null). Host copies cannot fail.
  void write_and_read(const step& s, const view_type& k, const view_type& v, const PagedIndices& read_index,
                      const PagedIndices& write_index, T* out_k, T* out_v) {
    const std::vector<std::int64_t>& reads = read_index[s.group];
    const std::vector<std::int64_t>& writes = write_index[s.group];
    T* kp = keys_[s.pool].data();
    T* vp = values_[s.pool].data();
    if (s.sliding && out_k) {  // read (new tokens at the sentinels), then write: a write may reuse a slot read here
      gather(out_k, kp, reads, &k);
      gather(out_v, vp, reads, &v);
    }
    const detail::scatter_job<T> jobs[2] = {job(kp, k, 0, writes.size()), job(vp, v, 0, writes.size())};
    S::scatter_rows(jobs, writes, kv_heads_, head_dim_, pool_rows() * head_dim_);
    if (!s.sliding && out_k) {  // write, then read: the read rows include the new tokens
      gather(out_k, kp, reads, nullptr);
      gather(out_v, vp, reads, nullptr);
    }
  }
  // The rows of layer `layer_idx`'s pools, gathered into out_k and out_v as write_and_read does
  // (rows without sentinels: what a request holds, no new tokens).
  void read_rows(std::int64_t layer_idx, const std::vector<std::int64_t>& rows, T* out_k, T* out_v) const {
    const auto j = static_cast<std::size_t>(layer_map_[static_cast<std::size_t>(layer_idx)].second);
    gather(out_k, keys_[j].data(), rows, nullptr);
    gather(out_v, values_[j].data(), rows, nullptr);
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
    const auto [m, nb] =
        handler.infer_max_batch_tokens_and_num_blocks(cb.max_batch_tokens, cb.num_blocks, budget.available_bytes);
    cb.max_batch_tokens = m;
    cb.num_blocks = nb;
    return cb;
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

  void check_input(const view_type& x, const char* what) const {
    if (x.extent(0) != 1 || x.extent(1) != kv_heads_ || x.extent(3) != head_dim_)
      throw ValueError(std::string("kvc::PagedCache::update: ") + what + " must be [1, " + std::to_string(kv_heads_) +
                       ", tokens, " + std::to_string(head_dim_) + "], got " + shape_string(x.extents));
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
  // The blocks of `source` a fork must copy, over all groups: all but the leading run of complete
  // blocks in groups that share blocks, all of them elsewhere.
  std::int64_t blocks_copied_per_fork(const std::string& source) const {
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

  struct swapped_request {
    std::vector<std::int64_t> swap_ids;      // in table order, group after group
    std::vector<std::int64_t> group_counts;  // blocks per group
  };

  // The free swap blocks with r's given back, ascending (built aside: committed by the caller).
  std::vector<std::int64_t> with_swap_ids_returned(const swapped_request& r) const {
    std::vector<std::int64_t> freed;
    freed.reserve(static_cast<std::size_t>(swap_blocks()));  // room for all: see drop_offloaded_request
    freed.assign(swap_free_.begin(), swap_free_.end());
    freed.insert(freed.end(), r.swap_ids.begin(), r.swap_ids.end());
    std::sort(freed.begin(), freed.end());
    return freed;
  }

  // Block src_ids[i] of (sk, sv) to block dst_ids[i] of (dk, dv), in every pool tensor; the
  // buffers hold src_rows and dst_rows rows per head ([heads, rows, head_dim]).
  void copy_blocks(const std::vector<typename S::buffer_type>& sk, const std::vector<typename S::buffer_type>& sv,
                   std::int64_t src_rows, std::span<const std::int64_t> src_ids,
                   std::vector<typename S::buffer_type>& dk, std::vector<typename S::buffer_type>& dv,
                   std::int64_t dst_rows, std::span<const std::int64_t> dst_ids) {
    const std::int64_t block = block_size_ * head_dim_;  // one head's part of a block
    for (std::size_t j = 0; j < dk.size(); ++j)
      for (std::size_t i = 0; i < src_ids.size(); ++i) {
        S::copy_2d(dk[j].data() + dst_ids[i] * block, dst_rows * head_dim_, sk[j].data() + src_ids[i] * block,
                   src_rows * head_dim_, block, kv_heads_);
        S::copy_2d(dv[j].data() + dst_ids[i] * block, dst_rows * head_dim_, sv[j].data() + src_ids[i] * block,
                   src_rows * head_dim_, block, kv_heads_);
      }
  }

  // Where block copies go: the pools or the swap pool.
  enum class pool : unsigned char { pages, swap };
  struct pending_copy {
    pool from, to;
    std::size_t at, n;  // sources pending_ids_[at, at + n), destinations the n after them
  };
  void copy_between(pool from, std::span<const std::int64_t> src, pool to, std::span<const std::int64_t> dst) {
    const std::int64_t swap_rows = swap_blocks() * block_size_;
    copy_blocks(from == pool::pages ? keys_ : swap_k_, from == pool::pages ? values_ : swap_v_,
                from == pool::pages ? pool_rows() : swap_rows, src, to == pool::pages ? keys_ : swap_k_,
                to == pool::pages ? values_ : swap_v_, to == pool::pages ? pool_rows() : swap_rows, dst);
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
  // The free swap list as it is, once per transaction, for its undo (every swap-pool change
  // comes after it).
  void keep_swap_free() {
    paged::UndoLog& log = manager_.log();
    if (!log.active() || swap_free_kept_) return;
    log.at_end([](void* self) noexcept { static_cast<PagedCache*>(self)->swap_free_kept_ = false; }, this);
    swap_free_saved_.reserve(static_cast<std::size_t>(swap_blocks()));  // room for all, as swap_free_ has
    swap_free_saved_.assign(swap_free_.begin(), swap_free_.end());
    log.on_undo(
        [](void* self) noexcept {
          auto* c = static_cast<PagedCache*>(self);
          c->swap_free_.swap(c->swap_free_saved_);
        },
        this);
    swap_free_kept_ = true;
  }

  void check_block(std::int64_t b) const {
    if (b < 0 || b >= num_blocks())
      throw ValueError("kvc::PagedCache::copy_cache: block " + std::to_string(b) + " is not one of the " +
                       std::to_string(num_blocks()) + " blocks");
  }

  std::int64_t pool_rows() const noexcept { return (num_blocks() + 2) * block_size_; }
  std::int64_t row_elems() const noexcept { return kv_heads_ * head_dim_; }  // one token's row, every head
  const paged::SlidingAttentionCacheAllocator* sliding_allocator() const noexcept {
    for (const allocator& a : allocators_)
      if (const auto* s = std::get_if<paged::SlidingAttentionCacheAllocator>(&a)) return s;
    return nullptr;
  }

  // The write of x's tokens to a pool at rows first_row .. first_row + tokens - 1 of a rows list.
  static detail::scatter_job<T> job(T* pool, const view_type& x, std::size_t first_row, std::size_t tokens) {
    return {pool,
            x.data(),
            x.stride(2),
            x.stride(1),
            static_cast<std::int64_t>(first_row),
            static_cast<std::int64_t>(tokens)};
  }
  // out[h, i, :] = pool[h, rows[i], :]; the i-th sentinel row takes token i of `fresh`. The pools
  // are head-major, so a run of consecutive rows (the tokens of one block) is one contiguous piece
  // per head: one copy per run and head instead of one per token and head.
  void gather(T* out, const T* pool, const std::vector<std::int64_t>& rows, const view_type* fresh) const {
    const auto r = static_cast<std::int64_t>(rows.size());
    const std::int64_t out_pitch = r * head_dim_, pool_pitch = pool_rows() * head_dim_, sentinel = sentinel_index();
    std::int64_t next_fresh = 0;
    for (std::int64_t i = 0; i < r;) {
      const std::int64_t row = rows[static_cast<std::size_t>(i)];
      if (fresh && row == sentinel) {
        S::copy_2d(out + i * head_dim_, out_pitch, fresh->data() + next_fresh++ * fresh->stride(2), fresh->stride(1),
                   head_dim_, kv_heads_);
        ++i;
        continue;
      }
      std::int64_t n = 1;
      while (i + n < r && rows[static_cast<std::size_t>(i + n)] == row + n && !(fresh && row + n == sentinel)) ++n;
      S::copy_2d(out + i * head_dim_, out_pitch, pool + row * head_dim_, pool_pitch, n * head_dim_, kv_heads_);
      i += n;
    }
  }

  std::int64_t block_size_;
  std::int64_t kv_heads_;
  std::int64_t head_dim_;
  paged::BlockManager manager_;  // after the head sizes: its block count is checked against the pools
  std::optional<std::int64_t> max_batch_tokens_;
  std::int64_t max_blocks_per_request_ = 0;
  paged::LayerGroups groups_;
  std::vector<std::pair<std::int64_t, std::int64_t>> layer_map_;  // (group, slot) of each layer: groups_ inverted
  std::vector<allocator> allocators_;
  bool use_prefix_sharing_ = false;
  std::int64_t total_prefix_length_ = 0;
  std::vector<std::size_t> cut_groups_;  // truncate_request's scratch: one entry per group at most
  std::vector<std::int64_t> cut_fresh_, cut_old_;
  std::vector<typename S::buffer_type> keys_, values_;
  typename S::buffer_type out_k_, out_v_;                 // what the last update with reads returned
  std::vector<typename S::buffer_type> swap_k_, swap_v_;  // the swap pool, [heads, swap rows, dim] like the pools
  std::vector<std::int64_t> swap_free_;                   // free swap blocks, ascending
  std::map<std::string, swapped_request> swapped_;
  // Transactions: the copies waiting for the commit, the free swap list as it was, the swapped
  // requests erased.
  std::vector<pending_copy> pending_;
  std::vector<std::int64_t> pending_ids_;
  std::vector<std::int64_t> swap_free_saved_;
  bool swap_free_kept_ = false;
  paged::KeptNodes<std::map<std::string, swapped_request>> kept_swapped_;
};

}  // namespace kvc

#pragma once
// kvc::ContinuousBatchingConfig: the fields of transformers' ContinuousBatchingConfig
// (generation/configuration_utils.py at a597f974) that shape the paged cache, with transformers'
// defaults. Like transformers' dataclass it checks nothing itself: each value is checked where it
// is used (PagedCache's constructor for block_size, with transformers' message). Unset optionals
// are the fields transformers resolves later (`None`).

#include <cstdint>
#include <optional>
#include <string>

namespace kvc {

// The paged-cache fields of transformers' ContinuousBatchingConfig, with its defaults: what
// PagedCache, the memory planner and the scheduler are configured from. Checks nothing itself.
struct ContinuousBatchingConfig {
  // Tokens per block ("Default used to be 32, now it's 256 to be compatible with
  // flash_with_kvcache"); the cache needs at least 4.
  std::int64_t block_size = 256;
  // Allocatable blocks (the cache adds 2 of padding); unset: planned from a memory budget.
  std::optional<std::int64_t> num_blocks;
  // Query tokens per forward (the scheduler's budget); unset: planned.
  std::optional<std::int64_t> max_batch_tokens;
  // Fraction of free device memory the cache may take; unset: 0.9, or 0.8 with logits processing.
  std::optional<double> max_memory_percent;
  // Width of a request's row in the decode block table; 0 turns that path off; unset: 32
  // (fallback_max_blocks_per_request).
  std::optional<std::int64_t> max_blocks_per_request;
  // Ref-counted block sharing (forks) and, for models with only full attention, prefix sharing.
  bool allow_block_sharing = true;
  // Requests per batch; unset: from workload hints, else 1024, then capped by the cache.
  std::optional<std::int64_t> max_requests_per_batch;
  // Two sets of batch IO buffers (a factor 2 in the memory plan); unset: resolved from the run.
  std::optional<bool> use_async_batching;
  // "fifo" or "prefill_first" (transformers warns and uses FIFO for another name).
  std::string scheduler_type = "fifo";
  // Fraction of the blocks kept free before new prefills stop; unset: 0.15 (FIFO), 0.0 (prefill_first).
  std::optional<double> safety_margin;
  // Log-probabilities next to the tokens (two output rows in the memory plan).
  bool return_logprobs = false;
  // GiB of the swap pool for request offload (0: no pool; unset: sized from the safety threshold).
  std::optional<double> cpu_offload_space = 0.0;
  // The pool's cap as a fraction of the available RAM.
  double cpu_offload_space_safety_threshold = 0.8;
  // Size of the input queue (0: unlimited).
  std::int64_t max_queue_size = 0;
  // kvc's own: the requests that can hold linear-attention states at once, for a hybrid model (one
  // state slot each, taken with a request's first blocks); unset: max_requests_per_batch, else
  // 256, at most num_blocks.
  std::optional<std::int64_t> max_state_slots;
  // kvc's own, for a hybrid model whose attention layers form one full-attention group: every how
  // many tokens (a multiple of block_size; 0: never) a request's linear-attention states are kept
  // as a snapshot under the hash of the prefix they follow, so that a later prompt with that prefix
  // resumes from them (prefix sharing for hybrid models, docs/paged.md). 0 keeps such models out of
  // prefix sharing.
  std::int64_t state_snapshot_interval = 0;
  // kvc's own: how many state snapshots the cache keeps (the least recently used one makes room);
  // unset: as many as it has state slots.
  std::optional<std::int64_t> max_state_snapshots;
  // kvc's own, for a hybrid model: how many of a request's last tokens its linear-attention states
  // can be taken back by in place (0: none). Each state slot keeps a ring of its states as they
  // were before each of its last state_rollback_tokens one-token steps (state_rollback_tokens + 1
  // more copies of a request's states), so that the scheduler's seq_rm and rejected draft tokens
  // cut a hybrid request without prefilling it again (docs/rollback.md).
  std::int64_t state_rollback_tokens = 0;

  // transformers' fallback_max_blocks_per_request property.
  static constexpr std::int64_t fallback_max_blocks_per_request() noexcept { return 32; }
  // Returns max_blocks_per_request, or fallback_max_blocks_per_request() (32) when it is unset.
  std::int64_t resolved_max_blocks_per_request() const noexcept {
    return max_blocks_per_request.value_or(fallback_max_blocks_per_request());
  }
  // Returns max_state_slots, or, when it is unset, max_requests_per_batch (else 256) capped at
  // num_blocks (a request that holds states holds a block too).
  std::int64_t resolved_max_state_slots(std::int64_t blocks) const noexcept {
    if (max_state_slots) return *max_state_slots;
    const std::int64_t n = max_requests_per_batch.value_or(256);
    return n < blocks ? n : blocks;
  }
  // Returns max_state_snapshots, or, when it is unset, the state slots `slots`; 0 when
  // state_snapshot_interval is 0.
  std::int64_t resolved_max_state_snapshots(std::int64_t slots) const noexcept {
    return state_snapshot_interval == 0 ? 0 : max_state_snapshots.value_or(slots);
  }
};

}  // namespace kvc

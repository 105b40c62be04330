#pragma once
// kvc::PagedAttentionStep: the layout of one step of a continuous batch, as the scheduler hands it
// out (ScheduledBatch::attention_step()) and kvc::paged_attention reads it
// (<kvc/paged/paged_attention.hpp>).

#include <cstdint>
#include <span>
#include <string>

#include <kvc/paged/request_keys.hpp>

namespace kvc {

// The layout of one step of a continuous batch (transformers' cu_seqlens_q and the cached lengths).
struct PagedAttentionStep {
  std::span<const std::string> requests;       // R request ids
  std::span<const std::int64_t> cu_seqlens_q;  // R + 1 offsets into the packed query rows: 0, ..., T
  std::span<const std::int64_t> past;          // R cached token counts, before this step
  // The requests' keys in the cache (the scheduler's batch has them), or empty: the block tables
  // are then found by id.
  std::span<const paged::RequestKey> keys = {};
};

}  // namespace kvc

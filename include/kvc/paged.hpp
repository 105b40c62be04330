#pragma once
// The paged umbrella header: continuous batching's cache and what runs around it.
//   kvc::PagedCache (block tables, prefix sharing, forks, request offload, the memory planner) and
//   kvc::ContinuousBatchingConfig (and its JSON reader), kvc::ContinuousBatchingScheduler and the
//   sequence operations, kvc::paged_attention (host attention through the block tables, also
//   over fp8 pools), and kvc::PagedBatchCache (one dense batch on a paged cache, read as a
//   dynamic cache is). docs/paged.md, docs/continuous_batching.md.

#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/paged/continuous_batching_config_json.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/paged/paged_batch_cache.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/paged/scheduler.hpp>

#pragma once
// kvc::ContinuousBatchingScheduler: the request scheduler that drives a kvc::PagedCache the way
// transformers' continuous batching drives its PagedAttentionCache (continuous_batching/
// scheduler.py, requests.py and the offloading manager at a597f974), as a library component: the
// user's model loop asks for a batch, runs the model over it, and hands back one token per request
// that produced one.
//
//   while (auto batch = scheduler.schedule()) {
//     ... the model over batch->input_ids at batch->position_ids: each layer stores its new keys
//         and values with cache.update(k, v, layer, batch->read_index, batch->write_index) and
//         attends with kvc::paged_attention(cache, layer, batch->step(), q, k, v) ...
//     scheduler.update(*batch, next_tokens);  // one token per batch->logits_indices entry
//   }
//
// What a step does, as transformers does it: candidates in FIFO order (decoding requests, then
// prefilling ones, then waiting ones) or prefill-first order (prefilling, decoding, waiting);
// per candidate the safety margin (no new prefill once fewer than safety_margin * num_blocks
// blocks are free), prefix matching of a new prompt, the token budget (max_batch_tokens, with
// chunked prefill), the cache-read budget (num_pages), block allocation ahead of the step, and the
// request budget (max_requests_per_batch). When blocks run out, starved requests pick victims
// (paged::select_offload_victims): each is copied to the cache's swap pool when it fits (resumed
// bit for bit later) or soft reset (its blocks freed, its prompt and generated tokens prefilled
// again). Finished requests free their blocks; a request with num_return_sequences > 1 is forked
// after its prompt but the last token is cached (children share the complete blocks), or, where
// the free blocks cannot hold a fork, its extra sequences queue as requests of their own.
//
// Where kvc differs (docs/differences.md): blocks are allocated exactly (transformers asks for
// one block too many when the step's tokens fill a block exactly or leave one slot), restored
// requests come back before victims leave (so a victim can use the swap blocks a restore just
// freed), and a request that cannot fit even in an empty cache fails on its own (its state says
// why) instead of ending every request with "No requests can be scheduled and no requests can be
// offloaded.".

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvc/detail/py_repr.hpp>
#include <kvc/errors.hpp>
#include <kvc/paged/attention_step.hpp>
#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/paged/undo_log.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// transformers' RequestStatus.
enum class RequestStatus : std::uint8_t { pending, prefilling, decoding, finished, failed };

// What a user submits.
struct GenerationRequest {
  // The request's id: unique among the requests the scheduler holds, without `__child#`.
  std::string request_id = {};
  std::vector<std::int64_t> prompt = {};  // token ids, at least one, each a non-negative C int
  // The most tokens to generate (at least 1).
  std::int64_t max_new_tokens = 20;
  // The token that ends the request once generated; unset: none does.
  std::optional<std::int64_t> eos_token_id = std::nullopt;
  // Sequences sampled from the prompt: the request is forked into `{id}__child#{i}`, i = 0..n-2.
  std::int64_t num_return_sequences = 1;
};

// Which request of a scheduler: add_request returns it, and every call on a request takes it (or
// the request's id, looked up once at the call). Dense: `slot` indexes the scheduler's request
// states; a slot is used again after take_finished() has returned its request, under the next
// generation, so the handle of a request that has left is refused, never taken for another one.
struct RequestHandle {
  // The request's slot in the scheduler's request states; the default names no request.
  std::uint32_t slot = std::numeric_limits<std::uint32_t>::max();
  // Which use of the slot: the handle of a request that has left has an older one and is refused.
  std::uint32_t generation = 0;
  // Returns true when slot and generation are both equal.
  friend constexpr bool operator==(RequestHandle, RequestHandle) noexcept = default;
};

// One request as the scheduler tracks it (transformers' RequestState, cache-relevant fields).
struct RequestState {
  // The request's id (a forked child's: `{parent}__child#{i}`).
  std::string request_id;
  RequestHandle handle;              // its handle (a fork's children have their own)
  std::vector<std::int64_t> tokens;  // the prompt, then every generated token
  // The prompt's length: the first prompt_length entries of `tokens`.
  std::int64_t prompt_length = 0;
  std::int64_t position_offset = 0;  // tokens in the cache (sent to the model)
  // The most tokens to generate.
  std::int64_t max_new_tokens = 0;
  // The token that ends the request once generated; unset: none does.
  std::optional<std::int64_t> eos_token_id;
  std::int64_t num_children = 0;  // forks still to make
  // Where the request is: pending (waiting), prefilling, decoding, finished or failed.
  RequestStatus status = RequestStatus::pending;
  std::int64_t preemptions = 0;  // times it was offloaded or soft reset
  // What its last prefix match found, per layer kind, and reused (PagedCache::match_prefix).
  PagedPrefixMatch prefix_match;
  std::string error;  // why it failed

  // Returns the prompt: the first prompt_length tokens.
  std::span<const std::int64_t> prompt() const noexcept {
    return std::span(tokens).first(static_cast<std::size_t>(prompt_length));
  }
  // Returns the generated tokens: those after the prompt.
  std::span<const std::int64_t> generated() const noexcept {
    return std::span(tokens).subspan(static_cast<std::size_t>(prompt_length));
  }
  // Returns true while the request is prefilling or decoding.
  bool is_active() const noexcept { return status == RequestStatus::prefilling || status == RequestStatus::decoding; }
  // Returns true once the request has finished or failed.
  bool has_ended() const noexcept { return status == RequestStatus::finished || status == RequestStatus::failed; }
  // The tokens not yet in the cache, tokens[position_offset:] (the uncached part of the prompt, or
  // the last generated token while decoding); none once the request has ended.
  std::span<const std::int64_t> remaining_prefill_tokens() const noexcept {
    if (has_ended()) return {};
    return std::span(tokens).subspan(static_cast<std::size_t>(position_offset));
  }
  // While decoding: the last generated token, the next one to run; -1 otherwise.
  std::int64_t next_token() const noexcept { return status == RequestStatus::decoding ? tokens.back() : -1; }
};

// One request's share of a step (transformers' FutureRequestState).
struct ScheduledRequest {
  // The request's id.
  std::string request_id;
  // The request's handle.
  RequestHandle handle;
  std::int64_t past = 0;          // tokens cached before the step
  std::int64_t query_length = 0;  // tokens of the step
  // Blocks the step's own tokens complete, hashed for sharing by update() (0 without block sharing;
  // with draft tokens, update() hashes those the kept ones complete too).
  std::int64_t complete_blocks = 0;
  // Its last token's logits give the next token (with draft tokens, its last 1 + k rows' give
  // the next 1 to k + 1).
  bool has_new_token = false;
  // Draft tokens the step verifies (set_draft_tokens): they follow the request's last token in
  // the step, and each of the step's last 1 + draft_tokens.size() tokens gives a logits row.
  std::vector<std::int64_t> draft_tokens;
};

// One step: the requests' tokens packed one request after another.
struct ScheduledBatch {
  // Each request's share of the step, in batch order.
  std::vector<ScheduledRequest> requests;
  std::vector<std::string> request_ids;         // R
  std::vector<paged::RequestKey> request_keys;  // R: the requests' keys in the cache
  std::vector<std::int64_t> input_ids;          // T
  std::vector<std::int64_t> position_ids;       // T
  std::vector<std::int64_t> cu_seqlens_q;       // R + 1
  std::vector<std::int64_t> past;               // R
  // Rows whose logits give a token, in request order: a request's last row, or, with draft
  // tokens, its last 1 + k rows (the choice after its last token and after each draft).
  std::vector<std::int64_t> logits_indices;
  PagedIndices read_index;  // empty lists unless asked for and some request has cache
  // Per layer group, the rows the step's tokens are written to, one per token.
  PagedIndices write_index;
  // The step's number, from 1: update() takes only the batch that schedule() returned last.
  std::int64_t step = 0;

  // Returns T, the number of tokens in the step.
  std::int64_t num_tokens() const noexcept { return static_cast<std::int64_t>(input_ids.size()); }
  // Returns the step's layout for kvc::paged_attention: views of this batch, which must outlive it.
  PagedAttentionStep attention_step() const noexcept { return {request_ids, cu_seqlens_q, past, request_keys}; }
};

// How a ContinuousBatchingScheduler builds its batches, beyond its ContinuousBatchingConfig.
struct SchedulerOptions {
  // Build read indices (transformers' eager/SDPA path gathers through them); kvc::paged_attention
  // reads through the block tables and needs only the write indices.
  bool read_indices = false;
};

// The counters of a scheduler's work since it was made (ContinuousBatchingScheduler::stats()).
struct SchedulerStats {
  // Batches scheduled.
  std::int64_t steps = 0;
  std::int64_t batch_tokens = 0;       // tokens sent to the model
  std::int64_t prefill_tokens = 0;     // of which prefill (prompts, and tokens prefilled again)
  std::int64_t prefix_hit_tokens = 0;  // prefill tokens served from shared blocks instead
  // The prefix-sharing hit rate: of the tokens to prefill, the share found in shared blocks.
  double prefix_hit_rate() const noexcept {
    const std::int64_t all = prefill_tokens + prefix_hit_tokens;
    return all == 0 ? 0.0 : static_cast<double>(prefix_hit_tokens) / static_cast<double>(all);
  }
  // Requests copied to the swap pool when blocks ran out.
  std::int64_t cpu_offloads = 0;
  // Requests whose blocks were freed, to be prefilled again, when blocks ran out.
  std::int64_t soft_resets = 0;
  // Offloaded requests copied back into the cache.
  std::int64_t restores = 0;
  std::int64_t forks = 0;           // children made by forking
  std::int64_t forks_requeued = 0;  // children queued as requests of their own
  // Requests that ended as failed (cancelled, removed, or unable to fit in the cache).
  std::int64_t failed = 0;
  std::int64_t peak_blocks_in_use = 0;  // over every group, after a step
  // Block rows (a token in one group) the active requests' cached tokens needed at that peak:
  // peak_blocks_in_use * block_size / live_rows_at_peak is the paging overhead (below 1 with sharing).
  std::int64_t live_rows_at_peak = 0;
  // Cuts (seq_rm, seq_cp of a prefix, rejected draft tokens) made in place.
  std::int64_t cuts_in_place = 0;
  // Cuts that dropped the request's cache instead, so that it prefills the kept tokens again.
  std::int64_t cuts_prefilled = 0;
  std::int64_t draft_tokens = 0;           // draft tokens run (set_draft_tokens)
  std::int64_t accepted_draft_tokens = 0;  // of which the model chose the same: kept and generated
  // Returns the share of the draft tokens run that were kept (0 with none).
  double draft_acceptance_rate() const noexcept {
    return draft_tokens == 0 ? 0.0 : static_cast<double>(accepted_draft_tokens) / static_cast<double>(draft_tokens);
  }
  // Returns the requests preempted: cpu_offloads + soft_resets.
  std::int64_t preemptions() const noexcept { return cpu_offloads + soft_resets; }
};

// Drives a PagedCache as transformers' continuous batching scheduler (FIFO or prefill-first) does:
// schedule() hands out the next batch, update() takes its tokens back. One batch is in flight at a
// time; both calls are all or nothing.
template <class S>
class ContinuousBatchingScheduler {
 public:
  // A scheduler for `cache` (which must outlive it), configured by cb. kvc::ValueError for a
  // safety_margin outside [0, 1], max_requests_per_batch < 1 or no max_batch_tokens (cache or cb).
  ContinuousBatchingScheduler(PagedCache<S>& cache, const ContinuousBatchingConfig& cb, SchedulerOptions options = {})
      : cache_(&cache), options_(options) {
    prefill_first_ = cb.scheduler_type == "prefill_first";
    if (!prefill_first_ && cb.scheduler_type != "fifo")
      warn("Scheduler '" + cb.scheduler_type + "' not found. Defaulting to FIFO.");
    safety_margin_ = cb.safety_margin.value_or(prefill_first_ ? 0.0 : 0.15);
    if (!(safety_margin_ >= 0.0 && safety_margin_ <= 1.0))
      throw ValueError("Got safety_margin = " + detail::py_float_repr(safety_margin_) +
                       " but expected a value in [0, 1]");
    const std::int64_t requests = cb.max_requests_per_batch.value_or(1024);
    if (requests < 1)
      throw ValueError("Got max_requests_per_batch = " + std::to_string(requests) + " but expected a value >= 1");
    const std::optional<std::int64_t> tokens =
        cache.max_batch_tokens() ? cache.max_batch_tokens() : cb.max_batch_tokens;
    if (!tokens || *tokens < 1)
      throw ValueError(
          "kvc::ContinuousBatchingScheduler: max_batch_tokens must be set (>= 1) in the cache's or the "
          "scheduler's ContinuousBatchingConfig");
    max_batch_tokens_ = *tokens;
    // transformers' update_cb_config_after_cache_creation: a request takes a token of the batch,
    // and without prefix sharing a block too.
    max_requests_per_batch_ = std::min(requests, max_batch_tokens_);
    if (!cache.use_prefix_sharing()) max_requests_per_batch_ = std::min(max_requests_per_batch_, cache.num_blocks());
    fast_path_blocks_ = cache.num_sliding_attention_groups() == 0 ? cache.max_blocks_per_request() : 0;
    sharing_ = cache.shares_blocks();
    for (std::int64_t g = 0; g < cache.num_groups(); ++g)
      if (!cache.is_sliding_group(g)) {
        shared_group_ = g;
        break;
      }
  }

  // Returns the step's token budget: the cache's max_batch_tokens, else cb's.
  std::int64_t max_batch_tokens() const noexcept { return max_batch_tokens_; }
  // Returns the most requests per step: cb's (1024 unset), capped by max_batch_tokens() and,
  // without prefix sharing, by the cache's blocks.
  std::int64_t max_requests_per_batch() const noexcept { return max_requests_per_batch_; }
  // Returns the fraction of the blocks kept free before new prefills stop.
  double safety_margin() const noexcept { return safety_margin_; }
  // Returns true for the prefill-first order, false for FIFO.
  bool prefill_first() const noexcept { return prefill_first_; }
  // Returns the counters of the scheduler's work so far.
  const SchedulerStats& stats() const noexcept { return stats_; }
  // Returns the paged cache the scheduler drives, read-only.
  const PagedCache<S>& cache() const noexcept { return *cache_; }

  // Queues a request (at the back). Refused, with nothing queued: an empty prompt, a token outside
  // [0, 2^31), max_new_tokens or num_return_sequences below 1, an id already known, one that
  // names a child (`__child#`), or the id of a parent whose children the scheduler still holds
  // (until take_finished() has returned them). All or nothing: a std::bad_alloc leaves the
  // scheduler as it was.
  RequestHandle add_request(GenerationRequest request) {
    const std::string where = "kvc::ContinuousBatchingScheduler::add_request: request '" + request.request_id + "' ";
    if (request.prompt.empty()) throw ValueError(where + "has an empty prompt");
    for (const std::int64_t t : request.prompt)
      if (t < 0 || t > std::numeric_limits<std::int32_t>::max())
        throw ValueError(where + "has token " + std::to_string(t) + ", outside [0, 2^31)");
    if (request.max_new_tokens < 1 || request.num_return_sequences < 1)
      throw ValueError(where + "needs max_new_tokens >= 1 and num_return_sequences >= 1, got " +
                       std::to_string(request.max_new_tokens) + " and " + std::to_string(request.num_return_sequences));
    check_new_id(request.request_id, where);
    RequestState st;
    st.request_id = request.request_id;
    st.prompt_length = static_cast<std::int64_t>(request.prompt.size());
    st.tokens = std::move(request.prompt);
    st.max_new_tokens = request.max_new_tokens;
    st.eos_token_id = request.eos_token_id;
    st.num_children = request.num_return_sequences - 1;
    // A one-token prompt leaves nothing cached to fork from: its sequences queue on their own.
    staged s;
    std::vector<RequestState> children;
    if (st.prompt_length == 1) {
      children = requeued_children(st, 0, st.tokens);
      st.num_children = 0;
    }
    stage(s, std::move(st));  // the request first, then its children, in waiting_
    for (RequestState& child : children) stage(s, std::move(child));
    prepare(s);
    const RequestHandle handle = s.states.front().handle;
    commit(s);  // allocates nothing
    stats_.forks_requeued += static_cast<std::int64_t>(children.size());
    return handle;
  }

  // Whether any request is waiting or running.
  bool has_unfinished_requests() const noexcept { return !waiting_.empty() || !active_.empty(); }
  // Returns the number of pending requests: new ones, and preempted ones waiting to run again.
  std::int64_t num_waiting() const noexcept { return static_cast<std::int64_t>(waiting_.size()); }
  // Returns the number of requests prefilling or decoding.
  std::int64_t num_active() const noexcept { return static_cast<std::int64_t>(active_.size()); }

  // The logical blocks the request holds: the longest of its block tables (a full group's, which
  // grows with its tokens; 0 while it holds none, or is offloaded).
  std::int64_t allocated_blocks(const std::string& id) const { return blocks_of(*slots_[slot_of(id)]); }
  // The same by handle (a kvc::KeyError for a handle that names no request).
  std::int64_t allocated_blocks(RequestHandle h) const { return blocks_of(*slots_[slot_of(h)]); }

  // The handle of the request with this id (a KeyError for an id the scheduler does not hold), or
  // nullopt.
  RequestHandle handle(const std::string& id) const { return request(id).handle; }
  // Returns the handle of the request with this id; nullopt when the scheduler does not hold it.
  std::optional<RequestHandle> find(const std::string& id) const {
    const auto it = names_.find(id);
    return it == names_.end() ? std::nullopt : std::optional(it->second);
  }
  // Returns the state of the request with this id; kvc::KeyError when the scheduler does not
  // hold it.
  const RequestState& request(const std::string& id) const { return slots_[slot_of(id)]->state; }
  // Returns the state of the request `h` names; kvc::KeyError when it names none (it has left).
  const RequestState& request(RequestHandle h) const { return slots_[slot_of(h)]->state; }
  // Finished and failed requests, in the order they ended; they leave the scheduler. All or
  // nothing: a std::bad_alloc leaves every ended request to a later call.
  std::vector<RequestState> take_finished() {
    std::vector<RequestState> out;
    out.reserve(ended_.size());
    std::vector<std::unordered_map<std::string, std::int64_t>::iterator> parents;  // of each child, in order
    for (const std::uint32_t e : ended_) {
      const std::string& id = slots_[e]->state.request_id;
      if (id.find(child_mark) != std::string::npos) parents.push_back(live_children_.find(parent_of(id)));
    }
    // Committed: moves and erasures only (the free list has room for every slot). A parent's count
    // reaches 0 at its last child here at the earliest, so no iterator is used after its entry is
    // erased.
    auto parent = parents.begin();
    for (const std::uint32_t e : ended_) {
      slot& sl = *slots_[e];
      names_.erase(sl.state.request_id);
      const bool child = sl.state.request_id.find(child_mark) != std::string::npos;
      out.push_back(std::move(sl.state));
      sl.live = false;
      ++sl.generation;  // the request's handle now names nothing
      free_slots_.push_back(e);
      if (child) {
        if (--(*parent)->second == 0) live_children_.erase(*parent);
        ++parent;
      }
    }
    ended_.clear();
    return out;
  }

  // Cancels a waiting or running request: its blocks and swap blocks are freed, and it ends as
  // failed. All or nothing under std::bad_alloc.
  void cancel_request(const std::string& id) {
    if (in_flight_) throw ValueError(in_flight_message("cancel_request"));
    cancel_live(mutable_state(id));
  }
  // The same by handle. kvc::ValueError while a batch is in flight, kvc::KeyError for a stale
  // handle.
  void cancel_request(RequestHandle h) {
    if (in_flight_) throw ValueError(in_flight_message("cancel_request"));
    cancel_live(slot_state(slot_of(h)));
  }

  // ---- sequence operations (llama.cpp's llama_memory_seq_*; docs/continuous_batching.md) ------
  // A request is a sequence; positions count its tokens from 0. None may run while a batch is in
  // flight, and none applies to a request that has ended.

  // The smallest position whose keys and values every layer still holds: 0 (a sliding group holds
  // the window's, from position - window + 1 of its last cached token); -1 when nothing is cached.
  std::int64_t seq_pos_min(const std::string& id) const { return pos_min(request(id)); }
  // The same by handle (a kvc::KeyError for a handle that names no request).
  std::int64_t seq_pos_min(RequestHandle h) const { return pos_min(request(h)); }
  // The last cached position (get_seq_length() - 1 in transformers' terms); -1 when nothing is.
  std::int64_t seq_pos_max(const std::string& id) const { return request(id).position_offset - 1; }
  // The same by handle (a kvc::KeyError for a handle that names no request).
  std::int64_t seq_pos_max(RequestHandle h) const { return request(h).position_offset - 1; }

  // Each sequence operation below takes the request's handle or its id.

  // Removes the request's tokens at positions [p0, p1) (p0 < 0: from 0; p1 < 0: to the end) with
  // their keys and values. The paged layout has no holes, so only a suffix can go: a range that
  // ends before the request's last token returns false with nothing changed (as llama.cpp's
  // seq_rm does for memory that cannot drop part of a sequence). The request then holds p0
  // tokens and continues from them, its last token computed again for the next one's logits
  // (speculative decoding's rollback; transformers' crop). Removing from 0 ends the request.
  // Where a sliding group's ring has wrapped, no block is free to copy a shared partial block, or
  // the model keeps linear-attention states (they cannot be cut back), the kept tokens are
  // prefilled again (a soft reset) instead of truncated in place: with prefix sharing, from the
  // longest prefix the cache still holds (the request's own blocks, a state snapshot).
  bool seq_rm(const std::string& id, std::int64_t p0, std::int64_t p1) {
    return remove_suffix(live_state(id, "seq_rm"), p0, p1);
  }
  // seq_rm by handle. kvc::ValueError while a batch is in flight or for a request that has ended,
  // kvc::KeyError for a stale handle.
  bool seq_rm(RequestHandle h, std::int64_t p0, std::int64_t p1) {
    return remove_suffix(live_state(h, "seq_rm"), p0, p1);
  }

  // Makes `dst` a copy of the request `src` holding its tokens [p0, p1) (p0 must be 0 or less:
  // false otherwise, since a copy starts at position 0). Where src has cached tokens and the free
  // blocks allow it, dst shares src's complete blocks and copies the rest (a fork, as
  // num_return_sequences does); otherwise it is queued to compute its tokens itself. dst
  // generates on its own from then on, with src's max_new_tokens and eos_token_id.
  bool seq_cp(const std::string& src, const std::string& dst, std::int64_t p0, std::int64_t p1) {
    return copy_request(live_state(src, "seq_cp"), dst, p0, p1);
  }
  // seq_cp with `src` by handle. kvc::ValueError while a batch is in flight, for a source that has
  // ended or a `dst` add_request would refuse; kvc::KeyError for a stale handle.
  bool seq_cp(RequestHandle src, const std::string& dst, std::int64_t p0, std::int64_t p1) {
    return copy_request(live_state(src, "seq_cp"), dst, p0, p1);
  }

  // Keeps the request `id` and ends every other (llama.cpp's seq_keep; transformers'
  // batch_select_indices with one row).
  void seq_keep(const std::string& id) { keep_only(live_state(id, "seq_keep")); }
  // seq_keep by handle, with seq_rm's errors.
  void seq_keep(RequestHandle h) { keep_only(live_state(h, "seq_keep")); }

  // ---- speculative decoding (docs/continuous_batching.md, "Speculative decoding") -------------
  // Draft tokens guessed by a drafter to follow the request's last token (the last generated one,
  // or the prompt's last). They ride along the step that runs that token, after it, in one pass,
  // and the batch's logits_indices has a row for the token and for each draft (1 + k rows for
  // the request). update() takes the token the model chooses at each of those rows, keeps the
  // drafts up to the first the model did not choose, and generates the model's choices up to and
  // including that one: 1 to k + 1 tokens, each checked against eos_token_id and max_new_tokens
  // as one generated token is. The rejected drafts leave the cache as seq_rm removes a suffix: in
  // place where it can, else by prefilling the kept tokens again (a wrapped sliding window, a
  // hybrid model's states without a deep enough ring). Drafts past what max_new_tokens leaves,
  // past the step's token budget or past the free blocks are not run, nor on a prompt chunk that
  // ends on a state snapshot boundary; a step that runs the last token takes the drafts, run or
  // not. Drafts outlive a preemption; seq_rm and the request's end drop them. An empty draft
  // withdraws them. kvc::ValueError while a batch is in flight, for a request that has
  // ended, or for a token outside [0, 2^31); kvc::KeyError for an id or handle that names no
  // request. All or nothing.
  void set_draft_tokens(const std::string& id, std::span<const std::int64_t> draft) {
    propose(live_state(id, "set_draft_tokens"), draft);
  }
  // set_draft_tokens by handle.
  void set_draft_tokens(RequestHandle h, std::span<const std::int64_t> draft) {
    propose(live_state(h, "set_draft_tokens"), draft);
  }
  // The draft tokens the request's next step will verify: as set, none once a step has taken
  // them (kvc::KeyError for an id that names no request).
  std::span<const std::int64_t> draft_tokens(const std::string& id) const { return draft_of(*slots_[slot_of(id)]); }
  // The same by handle (a kvc::KeyError for a handle that names no request).
  std::span<const std::int64_t> draft_tokens(RequestHandle h) const { return draft_of(*slots_[slot_of(h)]); }

  // llama.cpp's seq_add shifts positions, re-rotating the cached keys (its K-shift). kvc does not:
  // a paged request's positions are its slots in the block tables, and its keys were stored after
  // the rotary embedding. A zero shift or an empty range is accepted (true); any other shift is
  // refused with a ValueError that says so.
  bool seq_add(const std::string& id, std::int64_t p0, std::int64_t p1, std::int64_t delta) {
    return shift_positions(live_state(id, "seq_add"), p0, p1, delta);
  }
  // seq_add by handle, with seq_rm's errors (and a kvc::ValueError for a nonzero shift of a
  // non-empty range).
  bool seq_add(RequestHandle h, std::int64_t p0, std::int64_t p1, std::int64_t delta) {
    return shift_positions(live_state(h, "seq_add"), p0, p1, delta);
  }

  // The next step, or nullopt when no request is left. Blocks for the step are allocated; requests
  // offloaded earlier and scheduled now are copied back. Every batch must go to update() before
  // the next schedule().
  //
  // All or nothing: a std::bad_alloc (or any other exception) leaves the scheduler and the cache as
  // they were, and the same call can be made again.
  std::optional<ScheduledBatch> schedule() {
    if (in_flight_) throw ValueError(in_flight_message("schedule"));
    return atomically([&] { return next_batch(); });
  }

  // The step's results: one token per logits row (batch.logits_indices), in order: the token the
  // model chose there. Each request with has_new_token records its token, or with draft tokens
  // the drafts the model chose too and its choice after them (set_draft_tokens), and finishes at
  // its eos_token_id or max_new_tokens (its blocks freed); the blocks the step completed are
  // hashed for sharing; a request whose prompt is cached but for its last token is forked. All or
  // nothing, as schedule(): after a failure the batch is still in flight and can be passed again.
  void update(const ScheduledBatch& batch, std::span<const std::int64_t> next_tokens) {
    if (!in_flight_ || batch.step != stats_.steps)
      throw ValueError("kvc::ContinuousBatchingScheduler::update: this is not the batch schedule() returned last");
    std::size_t rows = 0;  // (what record reads: a batch changed since schedule() is not the batch)
    for (const ScheduledRequest& r : batch.requests) rows += r.has_new_token ? 1 + r.draft_tokens.size() : 0;
    if (rows != batch.logits_indices.size())
      throw ValueError("kvc::ContinuousBatchingScheduler::update: this is not the batch schedule() returned last");
    if (static_cast<std::int64_t>(next_tokens.size()) != static_cast<std::int64_t>(batch.logits_indices.size()))
      throw ValueError("kvc::ContinuousBatchingScheduler::update: the batch needs " +
                       std::to_string(batch.logits_indices.size()) + " next tokens, got " +
                       std::to_string(next_tokens.size()));
    for (const std::int64_t t : next_tokens)
      if (t < 0 || t > std::numeric_limits<std::int32_t>::max())
        throw ValueError("kvc::ContinuousBatchingScheduler::update: token " + std::to_string(t) +
                         " is outside [0, 2^31)");
    atomically([&] {
      record(batch, next_tokens);
      return true;
    });
    save_snapshots(batch);
  }

 private:
  struct slot {
    RequestState state;
    std::uint32_t generation = 0;  // of the handle that names it
    bool live = false;
    paged::RequestKey key;            // the request's key in the cache (opened when it was added, closed when it ends)
    bool rematch = false;             // a cut dropped its cache: its next pass looks for its prefix in the cache again
    std::vector<std::int64_t> draft;  // draft tokens for the next step (set_draft_tokens), while has_draft
    bool has_draft = false;
  };

  static std::span<const std::int64_t> draft_of(const slot& sl) noexcept {
    return sl.has_draft ? std::span<const std::int64_t>(sl.draft) : std::span<const std::int64_t>();
  }
  // set_draft_tokens' work, on a live request: the copy is made before anything changes.
  void propose(RequestState& st, std::span<const std::int64_t> draft) {
    for (const std::int64_t t : draft)
      if (t < 0 || t > std::numeric_limits<std::int32_t>::max())
        throw ValueError("kvc::ContinuousBatchingScheduler::set_draft_tokens: token " + std::to_string(t) +
                         " is outside [0, 2^31)");
    slot& sl = *slots_[st.handle.slot];
    std::vector<std::int64_t> copy(draft.begin(), draft.end());
    sl.draft.swap(copy);
    sl.has_draft = !draft.empty();
  }

  paged::RequestKey key_of(const RequestState& st) const noexcept { return slots_[st.handle.slot]->key; }
  // The logical blocks a request holds (none once it has ended: its key is closed).
  std::int64_t blocks_of(const slot& sl) const {
    if (sl.state.has_ended()) return 0;
    std::int64_t most = 0;
    for (std::int64_t g = 0; g < cache_->num_groups(); ++g)
      most = std::max(most, cache_->blocks_in_group(static_cast<std::size_t>(g), sl.key));
    return most;
  }

  static constexpr const char* child_mark = "__child#";

  // The smallest position whose keys and values every layer still holds: 0 (a sliding group holds
  // the window's, from position - window + 1 of its last cached token); -1 when nothing is cached.
  std::int64_t pos_min(const RequestState& st) const {
    if (st.position_offset == 0) return -1;
    if (cache_->num_sliding_attention_groups() == 0) return 0;
    return std::max<std::int64_t>(st.position_offset - cache_->sliding_window(), 0);
  }
  void cancel_live(RequestState& st) {
    if (!st.has_ended()) end_request(st, RequestStatus::failed, "cancelled");
  }
  // seq_rm's work, on a live request.
  bool remove_suffix(RequestState& st, std::int64_t p0, std::int64_t p1) {
    const auto n = static_cast<std::int64_t>(st.tokens.size());
    p0 = std::max<std::int64_t>(p0, 0);
    if (p1 < 0 || p1 > n) p1 = n;
    if (p0 >= p1) return true;
    if (p1 < n) return false;
    if (p0 == 0) {
      end_request(st, RequestStatus::failed, "removed by seq_rm");
      return true;
    }
    // Sequences not yet forked fork once all but the last token of the kept prompt is cached; a
    // one-token prompt caches nothing before that token, so they queue on their own, as
    // add_request queues them. Made aside first, with everything else that allocates.
    staged s;
    const std::int64_t requeued = st.num_children > 0 && std::min(st.prompt_length, p0) == 1
                                      ? stage_children(s, st, 0, std::span(st.tokens).first(1))
                                      : 0;
    prepare(s);
    // A cache dropped by the cut (a wrapped ring, a hybrid model's states): the kept tokens are
    // prefilled again, from the longest prefix the cache still holds (its own blocks, a snapshot).
    bool& rematch = slots_[st.handle.slot]->rematch;  // (a second cut before the pass keeps the mark)
    rematch = (cut(st, key_of(st), p0) || rematch) && st.is_active();
    slots_[st.handle.slot]->has_draft = false;  // (they followed a token that may be gone)
    if (requeued > 0) {
      st.num_children = 0;
      commit(s);
      stats_.forks_requeued += requeued;
    }
    return true;
  }
  // seq_cp's work, from a live request.
  bool copy_request(RequestState& st, const std::string& dst, std::int64_t p0, std::int64_t p1) {
    check_new_id(dst, "kvc::ContinuousBatchingScheduler::seq_cp: request '" + dst + "' ");
    if (p0 > 0) return false;
    const auto n = static_cast<std::int64_t>(st.tokens.size());
    if (p1 < 0 || p1 > n) p1 = n;
    if (p1 == 0) return true;
    RequestState copy = st;
    copy.request_id = dst;
    copy.num_children = 0;
    copy.preemptions = 0;
    const paged::RequestKey src = key_of(st);
    const bool fork = st.position_offset > 0 && !cache_->is_offloaded(src) && cache_->compute_max_num_forks(src) >= 1;
    if (!fork) {
      copy.position_offset = 0;
      copy.status = RequestStatus::pending;
    }
    staged s;
    stage(s, std::move(copy), !fork);
    prepare(s);
    RequestState& made = s.states.front();  // moved in by commit, after the cut
    const std::uint32_t made_at = made.handle.slot;
    bool dropped = false;  // the copy's cache, by the cut: it looks for its prefix again (remove_suffix)
    if (fork) {
      // The fork and the cut as one transaction of the cache: a failure in the cut (a copied
      // cache's truncation makes its scratch memory first) undoes the fork too.
      cache_->transaction([&] {
        cache_->fork_request(src, std::span(s.keys).first(1));
        if (p1 < n) dropped = cut(made, s.keys[0], p1);
      });
      // Committed: the copy runs right after its source.
      const auto after = std::find(active_.begin(), active_.end(), st.handle.slot);
      active_.insert(after == active_.end() ? after : after + 1, made.handle.slot);
      ++stats_.forks;
    } else {
      if (p1 < n) (void)cut(made, s.keys[0], p1);  // nothing cached: cannot fail
      ++stats_.forks_requeued;
    }
    commit(s);
    slots_[made_at]->rematch = dropped;
    return true;
  }
  // seq_keep's work, for a live request.
  void keep_only(const RequestState& st) {
    // Every ending prepared (its message made) before the first is committed: all or nothing.
    std::vector<std::pair<RequestState*, std::string>> others;
    for (const auto* queue : {&active_, &waiting_})
      for (const std::uint32_t other : *queue)
        if (other != st.handle.slot) {
          RequestState& o = slot_state(other);
          others.emplace_back(&o, failure_message(o, "removed by seq_keep"));
        }
    for (auto& [o, message] : others) commit_end(*o, RequestStatus::failed, std::move(message));
  }
  // seq_add's answer, for a live request.
  bool shift_positions(const RequestState& st, std::int64_t p0, std::int64_t p1, std::int64_t delta) {
    const auto n = static_cast<std::int64_t>(st.tokens.size());
    p0 = std::max<std::int64_t>(p0, 0);
    if (p1 < 0 || p1 > n) p1 = n;
    if (delta == 0 || p0 >= p1) return true;
    throw ValueError(
        "kvc::ContinuousBatchingScheduler::seq_add: positions cannot shift: a paged request's positions "
        "are its slots in the block tables and its cached keys carry their rotary position (kvc does not "
        "re-rotate them); remove the suffix with seq_rm and let the request compute it again");
  }

  // Runs f as one step: every change to the scheduler and the cache is recorded (undo_ and the
  // cache's transaction), and undone if f throws, so that the caller can retry the same call. The
  // statistics and flags are saved whole.
  template <class F>
  auto atomically(F&& f) {
    const SchedulerStats stats = stats_;
    const bool block = block_new_requests_, in_flight = in_flight_;
    cache_->begin_transaction();
    undo_.begin();
    try {
      auto result = f();
      cache_->commit_transaction();
      undo_.commit();
      return result;
    } catch (...) {
      undo_.rollback();
      cache_->rollback_transaction();
      stats_ = stats;
      block_new_requests_ = block;
      in_flight_ = in_flight;
      throw;
    }
  }

  std::optional<ScheduledBatch> next_batch() {
    for (;;) {
      pass p = run_pass();
      if (!p.scheduled.empty()) {
        std::optional<ScheduledBatch> batch = build(p);
        if (!p.starved.empty()) offload(p.starved);
        return batch;
      }
      if (!p.allocation_failed) {
        if (block_new_requests_ && active_.empty() && !waiting_.empty()) {
          block_new_requests_ = false;
          continue;
        }
        return std::nullopt;
      }
      if (offload(p.starved) > 0) continue;
      // Nothing runs and nothing can leave: the request that failed first cannot fit at all.
      RequestState& st = slot_state(*p.first_failed);
      end_request(st, RequestStatus::failed,
                  "needs " + std::to_string(p.first_failed_need) + " more blocks for " +
                      std::to_string(st.position_offset + p.first_failed_tokens) +
                      " tokens, more than the cache can free (" + std::to_string(cache_->num_blocks()) + " blocks of " +
                      std::to_string(cache_->block_size()) + " tokens)");
    }
  }

  // update's changes (checked by the caller).
  void record(const ScheduledBatch& batch, std::span<const std::int64_t> next_tokens) {
    in_flight_ = false;
    std::size_t next = 0;
    for (const ScheduledRequest& r : batch.requests) {
      RequestState& st = slot_state(r.handle.slot);
      std::int64_t complete = r.complete_blocks;
      if (r.has_new_token) {
        // The drafts the model chose too are kept (m of k); its choices up to the first it did not
        // share are generated, the next one only once the one before is cached.
        const auto k = static_cast<std::int64_t>(r.draft_tokens.size());
        const std::span<const std::int64_t> chosen = next_tokens.subspan(next, static_cast<std::size_t>(k + 1));
        next += static_cast<std::size_t>(k + 1);
        std::int64_t m = 0;
        while (m < k && chosen[static_cast<std::size_t>(m)] == r.draft_tokens[static_cast<std::size_t>(m)]) ++m;
        stats_.draft_tokens += k;
        set_status(st, RequestStatus::decoding);
        bool ended = false;
        for (std::int64_t i = 0; i <= m && !ended; ++i) {
          if (i > 0) {  // the kept draft i - 1
            undo_.set(st.position_offset, st.position_offset + 1);
            ++stats_.accepted_draft_tokens;
          }
          const std::int64_t token = chosen[static_cast<std::size_t>(i)];
          push_token(st, token);
          const auto made = static_cast<std::int64_t>(st.generated().size());
          ended = made >= st.max_new_tokens || (st.eos_token_id && token == *st.eos_token_id);
        }
        if (ended) {
          end_request(st, RequestStatus::finished, {});
          continue;
        }
        if (k > 0) {  // the rejected drafts leave the cache; the blocks the kept ones complete are hashed too
          if (cut_cache(st, key_of(st), st.position_offset, r.past + r.query_length)) {
            set_status(st, RequestStatus::prefilling);
            undo_.set(slots_[st.handle.slot]->rematch, true);
            continue;
          }
          const std::int64_t bs = cache_->block_size(), own = r.past % bs + r.query_length - k;
          if (sharing_) complete += (own + m) / bs - own / bs;
        }
      }
      cache_->mark_shareable_blocks_as_complete(key_of(st), complete, st.tokens);
    }
    for (const ScheduledRequest& r : batch.requests) maybe_fork(slot_state(r.handle.slot));
  }

  // A hybrid model's states, where a step ended on a snapshot boundary, are kept for later prompts
  // with the same prefix (PagedCache::save_state_snapshot). After the step's transaction: a
  // snapshot is what a prefix leads to whatever becomes of the step, and keeping one allocates
  // nothing and cannot fail here (the tokens were checked when they came in).
  void save_snapshots(const ScheduledBatch& batch) {
    const std::int64_t every = cache_->state_snapshot_interval();
    if (every == 0) return;
    for (const ScheduledRequest& r : batch.requests) {
      const std::int64_t end = r.past + r.query_length;
      const RequestState& st = slot_state(r.handle.slot);
      if (end % every != 0 || end > st.prompt_length || st.has_ended() || st.position_offset != end) continue;
      (void)cache_->save_state_snapshot(key_of(st), std::span(st.tokens).first(static_cast<std::size_t>(end)));
    }
  }

  struct pass {
    std::vector<ScheduledRequest> scheduled;
    std::vector<paged::BasicStarvedRequest<std::uint32_t>> starved;  // by slot
    bool allocation_failed = false;
    std::optional<std::uint32_t> first_failed;  // its slot
    std::int64_t first_failed_need = 0, first_failed_tokens = 0;
  };

  // Refuses an id for a new request: one the scheduler knows, one that names a child, or the id
  // of a parent whose children the scheduler still holds (a new request under it would fork
  // children of the same names).
  void check_new_id(const std::string& id, const std::string& where) const {
    if (names_.count(id) != 0 || id.find(child_mark) != std::string::npos)
      throw ValueError(where + "is already known, or names a child sequence (" + child_mark + ")");
    if (live_children_.count(id) != 0)
      throw ValueError(where + "still has child sequences (" + id + child_mark +
                       "...) in the scheduler; the id can be used again once take_finished() has returned them");
  }

  // The parent's id of a child `{parent}__child#{i}` (user ids cannot contain the mark).
  static std::string parent_of(const std::string& child) { return child.substr(0, child.find(child_mark)); }

  // ---- all-or-nothing insertions -----------------------------------------------------------------
  // New requests are made aside (stage), then given their slots and room (prepare), both of which
  // may throw with the scheduler unchanged; commit moves them in and allocates nothing. The queues
  // always have room for every request the scheduler knows, so that moving a request from one to
  // another never allocates either, and the free list has room for every slot.
  struct staged {
    std::vector<RequestState> states;                       // the new requests, in stage order
    std::vector<char> to_waiting;                           // whether commit queues it (else the caller does)
    std::unordered_map<std::string, RequestHandle> names;   // names_ entries to make
    std::vector<std::unique_ptr<slot>> fresh;               // slots made for them where no free one is left
    std::unordered_map<std::string, std::int64_t> parents;  // live_children_ entries to make
    std::vector<std::string> child_parents;                 // the parent of each new child, in stage order
    // Their keys in the cache, opened by prepare; closed again unless commit takes them (in a
    // transaction of the cache its rollback closes them).
    std::vector<paged::RequestKey> keys;
    PagedCache<S>* cache = nullptr;
    staged() = default;
    staged(const staged&) = delete;
    staged& operator=(const staged&) = delete;
    ~staged() {
      if (cache && !cache->in_transaction())
        for (const paged::RequestKey k : keys) cache->close_request(k);  // allocates nothing: cannot fail
    }
  };

  void stage(staged& s, RequestState st, bool to_waiting = true) {
    s.to_waiting.push_back(to_waiting);
    if (st.request_id.find(child_mark) != std::string::npos) {
      std::string parent = parent_of(st.request_id);
      if (live_children_.count(parent) == 0) s.parents.try_emplace(parent, 0);
      s.child_parents.push_back(std::move(parent));
    }
    s.names.try_emplace(st.request_id);
    s.states.push_back(std::move(st));
  }

  // Slots for the staged requests (free ones first, from the back of the free list: commit pops
  // them in that order), their handles, and room everywhere commit puts something.
  void prepare(staged& s) {
    if (s.states.empty()) return;
    const std::size_t n = s.states.size(), reuse = std::min(n, free_slots_.size()), make = n - reuse;
    s.fresh.reserve(make);
    for (std::size_t i = 0; i < make; ++i) s.fresh.push_back(std::make_unique<slot>());
    if (slots_.size() + make > slots_.capacity()) slots_.reserve(std::max(slots_.size() + make, 2 * slots_.capacity()));
    if (slots_.size() + make > free_slots_.capacity())
      free_slots_.reserve(std::max(slots_.size() + make, 2 * free_slots_.capacity()));
    // (unordered_map::reserve rehashes only when the bucket count changes, to a prime of a
    // geometric list: amortized O(1) per request)
    names_.reserve(names_.size() + n);
    live_children_.reserve(live_children_.size() + s.parents.size());
    reserve_queues(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto at =
          static_cast<std::uint32_t>(i < reuse ? free_slots_[free_slots_.size() - 1 - i] : slots_.size() + (i - reuse));
      const RequestHandle h{at, i < reuse ? slots_[at]->generation : 0};
      s.states[i].handle = h;
      s.names.find(s.states[i].request_id)->second = h;
    }
    // Last: their keys in the cache (the staged object closes them if commit does not come).
    s.keys.reserve(n);
    s.cache = cache_;
    for (const RequestState& st : s.states) s.keys.push_back(cache_->open_request(st.request_id));
  }

  // Room for n entries, grown geometrically: adding requests one by one must not reallocate every
  // time (quadratic over many requests).
  static void room_for(std::vector<std::uint32_t>& queue, std::size_t n) {
    if (n > queue.capacity()) queue.reserve(std::max(n, 2 * queue.capacity()));
  }

  // Moves the staged requests into their slots (outside a transaction, allocates nothing after
  // prepare); those whose to_waiting is set go to the back of waiting_, in stage order.
  void commit(staged& s) {
    const std::size_t reuse = s.states.size() - s.fresh.size();
    for (std::size_t i = 0; i < s.states.size(); ++i) {
      const std::uint32_t at = s.states[i].handle.slot;
      if (i < reuse) {
        undo_.on_undo(
            [](void* self, const std::byte* data) noexcept {
              auto* me = static_cast<ContinuousBatchingScheduler*>(self);
              const auto freed = paged::UndoLog::load<std::uint32_t>(data);
              slot& sl = *me->slots_[freed];
              sl.live = false;
              sl.state = RequestState{};
              me->free_slots_.push_back(freed);
            },
            this, at);
        free_slots_.pop_back();
      } else {
        undo_.on_undo([](void* self) noexcept { static_cast<ContinuousBatchingScheduler*>(self)->slots_.pop_back(); },
                      this);
        slots_.push_back(std::move(s.fresh[i - reuse]));  // within the room made
      }
      slot& sl = *slots_[at];
      sl.state = std::move(s.states[i]);
      sl.rematch = false;
      sl.has_draft = false;
      sl.live = true;
      sl.key = s.keys[i];
      if (s.to_waiting[i]) insert_id(waiting_, waiting_.end(), at);
    }
    while (!s.parents.empty()) {
      undo_.room(1, paged::insert_undo_bytes);
      const auto made = live_children_.insert(s.parents.extract(s.parents.begin()));
      paged::undo_insert(undo_, live_children_, *made.position);
    }
    for (const std::string& parent : s.child_parents) {
      std::int64_t& n = live_children_.find(parent)->second;
      undo_.set(n, n + 1);
    }
    while (!s.names.empty()) {
      undo_.room(1, paged::insert_undo_bytes);
      const auto made = names_.insert(s.names.extract(s.names.begin()));
      paged::undo_insert(undo_, names_, *made.position);
    }
    s.cache = nullptr;  // the slots have the keys
  }

  // Room in each queue for every known request and `more`.
  void reserve_queues(std::size_t more) {
    const std::size_t n = names_.size() + more;
    room_for(active_, n);
    room_for(waiting_, n);
    room_for(ended_, n);
  }

  // ---- changes through undo_ (recorded in a step's transaction, plain writes otherwise) ----------
  // Outside a transaction none of them allocates: the queues always have room.

  // Moves the request's entry from one queue to the back of another.
  void move_id(std::vector<std::uint32_t>& from, std::vector<std::uint32_t>& to, std::uint32_t at) {
    const auto it = std::find(from.begin(), from.end(), at);
    if (it == from.end()) return;
    struct moved {
      std::vector<std::uint32_t>*from, *to;
      std::ptrdiff_t at;
    };
    undo_.on_undo(
        [](void*, const std::byte* data) noexcept {
          const auto m = paged::UndoLog::load<moved>(data);
          m.from->insert(m.from->begin() + m.at, m.to->back());
          m.to->pop_back();
        },
        nullptr, moved{&from, &to, it - from.begin()});
    to.push_back(*it);
    from.erase(it);
  }
  // Puts a request into a queue at `at`.
  void insert_id(std::vector<std::uint32_t>& queue, std::vector<std::uint32_t>::iterator at, std::uint32_t id) {
    struct put {
      std::vector<std::uint32_t>* queue;
      std::ptrdiff_t at;
    };
    undo_.on_undo(
        [](void*, const std::byte* data) noexcept {
          const auto p = paged::UndoLog::load<put>(data);
          p.queue->erase(p.queue->begin() + p.at);
        },
        nullptr, put{&queue, at - queue.begin()});
    queue.insert(at, id);
  }
  // Appends a generated token (its room made first: the undo record cannot then outlive a failed
  // append).
  void push_token(RequestState& st, std::int64_t token) {
    if (st.tokens.size() == st.tokens.capacity()) st.tokens.reserve(2 * st.tokens.capacity() + 1);
    undo_.on_undo([](void* state) noexcept { static_cast<RequestState*>(state)->tokens.pop_back(); }, &st);
    st.tokens.push_back(token);
  }

  static std::string in_flight_message(const char* call) {
    return std::string("kvc::ContinuousBatchingScheduler::") + call +
           ": the last batch is still in flight; pass it to update() first";
  }

  // A request that has not ended, for a sequence operation (by id or by handle).
  template <class Key>
  RequestState& live_state(const Key& key, const char* call) {
    if (in_flight_) throw ValueError(in_flight_message(call));
    RequestState& st = slot_state(slot_of(key));
    if (st.has_ended())
      throw ValueError(std::string("kvc::ContinuousBatchingScheduler::") + call + ": request '" + st.request_id +
                       "' has ended");
    return st;
  }

  // Forgets the request's cached tokens (blocks and swap blocks): it computes them again.
  // Allocates nothing.
  void drop_cache(paged::RequestKey key, RequestState& st) {
    cache_->release_request(key);
    undo_.set(st.position_offset, std::int64_t{0});
  }

  RequestState& mutable_state(const std::string& id) { return slot_state(slot_of(id)); }
  RequestState& slot_state(std::uint32_t at) noexcept { return slots_[at]->state; }
  // The slot of a request the scheduler holds (a KeyError otherwise), by id or by handle.
  std::uint32_t slot_of(const std::string& id) const {
    const auto it = names_.find(id);
    if (it == names_.end()) throw KeyError("kvc::ContinuousBatchingScheduler: no request '" + id + "'");
    return it->second.slot;
  }
  std::uint32_t slot_of(RequestHandle h) const {
    if (h.slot >= slots_.size() || !slots_[h.slot]->live || slots_[h.slot]->generation != h.generation)
      throw KeyError("kvc::ContinuousBatchingScheduler: no request with handle " + std::to_string(h.slot) + "." +
                     std::to_string(h.generation) + " (it has left, or was never added)");
    return h.slot;
  }

  // Candidates in the scheduler's order; waiting ones interleave offloaded and fresh requests
  // (offloaded first), as transformers' _get_waiting_candidates does.
  std::vector<std::uint32_t> candidates() const {
    std::vector<std::uint32_t> out;
    out.reserve(active_.size() + waiting_.size());
    const auto with = [&](RequestStatus s) {
      for (const std::uint32_t at : active_)
        if (slots_[at]->state.status == s) out.push_back(at);
    };
    with(prefill_first_ ? RequestStatus::prefilling : RequestStatus::decoding);
    with(prefill_first_ ? RequestStatus::decoding : RequestStatus::prefilling);
    if (block_new_requests_) return out;
    std::vector<std::uint32_t> off, fresh;
    for (const std::uint32_t at : waiting_) (cache_->is_offloaded(slots_[at]->key) ? off : fresh).push_back(at);
    for (std::size_t i = 0; i < std::max(off.size(), fresh.size()); ++i) {
      if (i < off.size()) out.push_back(off[i]);
      if (i < fresh.size()) out.push_back(fresh[i]);
    }
    return out;
  }

  void activate(RequestState& st) {
    if (!st.is_active()) set_status(st, RequestStatus::prefilling);
  }

  // The queue of a status: pending requests wait, prefilling and decoding ones are active, ended
  // ones wait for take_finished.
  std::vector<std::uint32_t>& queue_of(RequestStatus s) noexcept {
    if (s == RequestStatus::pending) return waiting_;
    return s == RequestStatus::prefilling || s == RequestStatus::decoding ? active_ : ended_;
  }
  // A request's status, and with it its queue (to the back of the new one when it changes): the
  // one place a request changes queue, so that its queue is always its status's.
  void set_status(RequestState& st, RequestStatus to) {
    std::vector<std::uint32_t>&from = queue_of(st.status), &into = queue_of(to);
    if (&from != &into) move_id(from, into, st.handle.slot);
    undo_.set(st.status, to);
  }

  // The logical blocks the request holds, from its own position (no table lookup): a full group's
  // table is exactly as long as its cached tokens need (allocations, prefix matches, forks,
  // restores and cuts all keep it so), a sliding ring is capped and allocate_blocks reads its own
  // table; none while it is offloaded. allocated_blocks(id) asks the tables.
  std::int64_t held_blocks(const RequestState& st) const {
    if (!st.is_active() && cache_->is_offloaded(key_of(st))) return 0;
    return (st.position_offset + cache_->block_size() - 1) / cache_->block_size();
  }

  // Blocks for `q` more tokens of a request holding `held` logical blocks: exactly the logical
  // blocks past + q needs (transformers asks for ((q - free + 1) // bs) + 1). Returns the blocks
  // asked for, 0 when none were needed, or -n when n blocks did not fit.
  std::int64_t allocate(const RequestState& st, std::int64_t q, std::int64_t held) {
    const std::int64_t bs = cache_->block_size();
    const std::int64_t want = (st.position_offset + q + bs - 1) / bs - held;
    if (want <= 0 && held > 0) return 0;
    const std::int64_t n = std::max<std::int64_t>(want, 1);
    return cache_->allocate_blocks(n, key_of(st), held) ? n : -n;
  }

  pass run_pass() {
    pass p;
    std::int64_t token_budget = max_batch_tokens_, cache_budget = cache_->num_pages(),
                 request_budget = max_requests_per_batch_;
    bool fast_path = true;
    const std::int64_t bs = cache_->block_size();
    const auto margin = static_cast<double>(cache_->num_blocks()) * safety_margin_;
    // The cache computes these from its groups: once per pass, not per candidate.
    const bool all_sliding = cache_->num_full_attention_groups() == 0;
    const std::int64_t window = cache_->sliding_window();
    const std::int64_t snapshot_every = cache_->state_snapshot_interval();
    for (const std::uint32_t at : candidates()) {
      RequestState& st = slot_state(at);
      const paged::RequestKey key = slots_[at]->key;
      if (!p.scheduled.empty() && st.status != RequestStatus::decoding &&
          static_cast<double>(cache_->get_num_free_blocks()) < margin)
        break;
      bool& rematch = slots_[at]->rematch;
      if ((st.status == RequestStatus::pending || rematch) && cache_->use_prefix_sharing() &&
          !cache_->is_offloaded(key)) {
        if (rematch) undo_.set(rematch, false);
        PagedPrefixMatch m = cache_->match_prefix(key, st.remaining_prefill_tokens());
        const std::int64_t k = m.tokens;
        // At least one token is left to compute: its logits start the generation.
        const std::int64_t keep = std::min<std::int64_t>(k, std::ssize(st.remaining_prefill_tokens()) - 1);
        m.tokens = keep;  // what the request reuses
        undo_.set(st.prefix_match, m);
        if (k > 0) {
          activate(st);
          undo_.set(st.position_offset, st.position_offset + keep);
          stats_.prefix_hit_tokens += keep;
        }
      }
      maybe_fork(st);  // a prompt matched up to its last token is forked before that token runs
      const bool decoding = st.status == RequestStatus::decoding;
      const std::int64_t available = decoding ? 1 : std::ssize(st.remaining_prefill_tokens());
      std::int64_t q = std::min(available, token_budget);
      if (!decoding && st.num_children > 0 && available > 1) q = std::min(q, available - 1);  // fork first
      // A hybrid model's prefill chunk ends at the last snapshot boundary it reaches, where its
      // states are kept (save_snapshots); one that reaches none runs whole. A prompt whose match
      // found more cached blocks than snapshots stops first at the last boundary within those
      // blocks: other prompts share that prefix, and the snapshot there serves them all.
      if (!decoding && snapshot_every > 0) {
        const std::int64_t from = st.position_offset;
        std::int64_t end = (from + q) / snapshot_every * snapshot_every;
        const std::int64_t shared = st.prefix_match.attention_tokens / snapshot_every * snapshot_every;
        if (shared > from && shared < from + q) end = shared;
        if (end > from) q = end - from;
      }
      // Draft tokens ride along the step that runs the request's last token: as many as the budget
      // and what it may still generate after its next token allow.
      const bool new_token = decoding || q == available;
      std::int64_t drafts = 0;
      // (not on a prompt chunk that ends where its states are kept as a snapshot: drafts would
      // move the states past it; they ride the request's next step)
      const bool snapshot_end = !decoding && snapshot_every > 0 && (st.position_offset + q) % snapshot_every == 0;
      if (new_token && slots_[at]->has_draft && !snapshot_end)
        drafts =
            std::clamp<std::int64_t>(std::min(st.max_new_tokens - std::ssize(st.generated()) - 1, token_budget - q), 0,
                                     std::ssize(slots_[at]->draft));
      q += drafts;
      std::int64_t need = st.position_offset;
      if (all_sliding) need = std::min(need, window);
      const bool fast = q == 1 && st.position_offset < fast_path_blocks_ * bs;
      if (!(fast_path && fast) && cache_budget < need) continue;
      const std::int64_t cur = st.position_offset;
      const std::int64_t held = held_blocks(st);
      std::int64_t got = allocate(st, q, held);
      if (got < 0 && drafts > 0) {  // the drafts' blocks do not fit: the step runs without them
        q -= drafts;
        drafts = 0;
        got = allocate(st, q, held);
      }
      if (got < 0) {
        p.allocation_failed = true;
        if (!p.first_failed) {
          p.first_failed = at;
          p.first_failed_need = -got;
          p.first_failed_tokens = q;
        }
        if (st.is_active())
          p.starved.push_back({at, cache_->blocks_needed(-got, held)});
        else if (cache_->get_num_free_blocks() == 0)
          break;
        continue;
      }
      activate(st);
      // (the blocks its own tokens complete; update adds those its kept drafts complete)
      p.scheduled.push_back({st.request_id, st.handle, cur, q, completed_blocks(key, cur, q - drafts), new_token, {}});
      const auto& draft = slots_[at]->draft;
      p.scheduled.back().draft_tokens.assign(draft.begin(), draft.begin() + drafts);
      fast_path = fast_path && fast;
      token_budget -= q;
      cache_budget -= need;
      request_budget -= 1;
      if (token_budget == 0 || request_budget == 0 || (!fast_path && cache_budget <= 0)) break;
    }
    return p;
  }

  std::optional<ScheduledBatch> build(pass& p) {
    ScheduledBatch b;
    const auto groups = static_cast<std::size_t>(cache_->num_groups());
    b.read_index.resize(groups);
    b.write_index.resize(groups);
    b.cu_seqlens_q.push_back(0);
    const bool reads = options_.read_indices && std::any_of(p.scheduled.begin(), p.scheduled.end(),
                                                            [](const ScheduledRequest& r) { return r.past > 0; });
    for (ScheduledRequest& r : p.scheduled) {
      RequestState& st = slot_state(r.handle.slot);
      const paged::RequestKey key = key_of(st);
      if (cache_->is_offloaded(key)) {  // its new blocks are allocated: copy it back into them
        cache_->restore_request(key);
        if (sharing_) r.complete_blocks += st.position_offset / cache_->block_size();
        ++stats_.restores;
      }
      cache_->extend_read_and_write_indices(key, r.past, r.query_length, reads ? &b.read_index : nullptr,
                                            b.write_index);
      // The request's own tokens, then its drafts: position_offset counts only the former until
      // update() knows which drafts stay.
      const auto drafts = static_cast<std::int64_t>(r.draft_tokens.size());
      if (st.status != RequestStatus::decoding) stats_.prefill_tokens += r.query_length - drafts;
      const std::span<const std::int64_t> run =
          st.remaining_prefill_tokens().first(static_cast<std::size_t>(r.query_length - drafts));
      b.input_ids.insert(b.input_ids.end(), run.begin(), run.end());
      b.input_ids.insert(b.input_ids.end(), r.draft_tokens.begin(), r.draft_tokens.end());
      for (std::int64_t i = 0; i < r.query_length; ++i) b.position_ids.push_back(r.past + i);
      undo_.set(st.position_offset, st.position_offset + r.query_length - drafts);
      if (r.has_new_token && slots_[r.handle.slot]->has_draft) undo_.set(slots_[r.handle.slot]->has_draft, false);
      b.cu_seqlens_q.push_back(b.cu_seqlens_q.back() + r.query_length);
      if (r.has_new_token)
        for (std::int64_t i = drafts; i >= 0; --i) b.logits_indices.push_back(b.cu_seqlens_q.back() - 1 - i);
      b.request_ids.push_back(r.request_id);
      b.request_keys.push_back(key);
      b.past.push_back(r.past);
    }
    b.requests = std::move(p.scheduled);
    b.step = ++stats_.steps;
    stats_.batch_tokens += b.num_tokens();
    note_peaks();
    in_flight_ = true;
    return b;
  }

  // The most blocks in use after a step, and the rows (token slots, over the groups) the active
  // requests' cached tokens needed then: a sliding group needs a token only while it is in the window.
  void note_peaks() {
    const std::int64_t in_use = cache_->num_blocks() - cache_->get_num_free_blocks();
    if (in_use < stats_.peak_blocks_in_use) return;
    const std::int64_t full = cache_->num_full_attention_groups(), sliding = cache_->num_sliding_attention_groups(),
                       window = cache_->sliding_window();
    std::int64_t rows = 0;
    for (const std::uint32_t at : active_) {
      const std::int64_t n = slots_[at]->state.position_offset;
      rows += full * n + sliding * std::min(n, window);
    }
    stats_.peak_blocks_in_use = in_use;
    stats_.live_rows_at_peak = rows;
  }

  // transformers' offload_requests: victims among the starved requests leave the cache, to the
  // swap pool where they fit, else by a soft reset. Returns how many left.
  std::int64_t offload(const std::vector<paged::BasicStarvedRequest<std::uint32_t>>& starved) {
    const std::vector<std::uint32_t> victims =
        paged::select_offload_victims(starved, cache_->get_num_free_blocks(), num_active(),
                                      [&](std::uint32_t at) { return cache_->blocks_in_use(slots_[at]->key); });
    for (const std::uint32_t at : victims) {
      RequestState& st = slot_state(at);
      const paged::RequestKey key = slots_[at]->key;
      if (cache_->swap_blocks() > 0 && cache_->offload_request(key)) {
        ++stats_.cpu_offloads;  // a decoding request runs its last token again when it is back
      } else {                  // soft reset: everything known so far is prefilled again
        cache_->free_blocks(key);
        undo_.set(st.position_offset, std::int64_t{0});
        ++stats_.soft_resets;
      }
      set_status(st, RequestStatus::pending);
      undo_.set(st.preemptions, st.preemptions + 1);
    }
    if (!victims.empty()) block_new_requests_ = true;
    return static_cast<std::int64_t>(victims.size());
  }

  static std::string failure_message(const RequestState& st, std::string_view why) {
    return "kvc::ContinuousBatchingScheduler: request " + st.request_id + " " + std::string(why);
  }

  // Ends the request: its blocks and swap blocks are freed, and take_finished() returns it. A
  // failed one says why. All or nothing: the message is made before anything changes.
  void end_request(RequestState& st, RequestStatus status, std::string_view why) {
    commit_end(st, status, status == RequestStatus::failed ? failure_message(st, why) : std::string());
  }
  void commit_end(RequestState& st, RequestStatus status, std::string error) {
    if (slots_[st.handle.slot]->has_draft) undo_.set(slots_[st.handle.slot]->has_draft, false);
    cache_->close_request(key_of(st));
    undo_.set(st.position_offset, std::int64_t{0});
    set_status(st, status);
    if (status == RequestStatus::failed) {
      undo_.on_undo([](void* state) noexcept { static_cast<RequestState*>(state)->error.clear(); }, &st);
      st.error = std::move(error);
      ++stats_.failed;
    }
    block_new_requests_ = false;
  }

  // Cuts the request to its first p0 tokens (0 < p0 < its token count), for seq_rm and seq_cp: its
  // blocks past them are given back (truncate_request), or, where a sliding group's ring has
  // wrapped or no block is free to copy a shared partial block, the kept tokens are prefilled
  // again (a soft reset). Returns true when it dropped the cache so. Allocates nothing.
  bool cut(RequestState& st, paged::RequestKey key, std::int64_t p0) {
    std::int64_t cached = std::min(st.position_offset, p0 - 1);  // the last kept token runs again
    const bool dropped = cut_cache(st, key, cached, st.position_offset);
    if (dropped) cached = 0;
    st.tokens.resize(static_cast<std::size_t>(p0));
    st.prompt_length = std::min(st.prompt_length, p0);
    st.position_offset = cached;
    if (st.is_active()) st.status = RequestStatus::prefilling;
    return dropped;
  }

  // Keeps the first `keep` of the `written` rows the request wrote to the cache: its blocks past them
  // are given back and its linear-attention states taken back (rollback_request), or, where that
  // cannot be exact (a sliding group's ring that wrapped: positions beyond `keep` overwrote rows
  // the window still reads; states whose rings hold too few steps; no block free to copy a shared
  // partial block; an offloaded request), its cache is dropped (position_offset 0). Returns true
  // when it dropped it. Allocates nothing outside a transaction.
  bool cut_cache(RequestState& st, paged::RequestKey key, std::int64_t keep, std::int64_t written) {
    if (keep >= written) return false;
    const bool wrapped = cache_->num_sliding_attention_groups() > 0 && written > cache_->sliding_window();
    if (!cache_->is_offloaded(key) && !wrapped && cache_->rollback_request(key, keep, written - keep)) {
      ++stats_.cuts_in_place;
      return false;
    }
    drop_cache(key, st);
    ++stats_.cuts_prefilled;
    return true;
  }

  // The blocks a step of q tokens after `from` completes, for update() to hash: those its positions
  // fill up, less the one holding `from` where that one was complete before (a prompt found whole
  // in the cache runs its last token again there). 0 without block sharing.
  std::int64_t completed_blocks(paged::RequestKey key, std::int64_t from, std::int64_t q) const {
    if (!sharing_) return 0;
    const std::int64_t bs = cache_->block_size();
    const auto& table = cache_->block_table(shared_group_, key);
    const auto at = static_cast<std::size_t>(from / bs);
    const paged::Block* b = at < table.size() ? cache_->manager().block(table[at]) : nullptr;
    return (from % bs + q) / bs - (b && b->is_complete() ? 1 : 0);
  }

  // A request forks once its prompt is cached but for its last token.
  void maybe_fork(RequestState& st) {
    if (st.num_children > 0 && st.status == RequestStatus::prefilling && st.position_offset > 0 &&
        st.remaining_prefill_tokens().size() == 1)
      fork(st);
  }

  std::string child_id(const RequestState& parent, std::int64_t i) const {
    return parent.request_id + child_mark + std::to_string(i);
  }

  // Copies of `parent` under the child ids, sharing its complete blocks (copy-on-write for the
  // rest), as many as the free blocks allow; the others queue as new requests with its prompt.
  void fork(RequestState& parent) {  // references into states_ survive its growth
    const auto forks =
        static_cast<std::size_t>(std::min(parent.num_children, cache_->compute_max_num_forks(key_of(parent))));
    if (forks == 0) return requeue_children(parent);
    staged s;
    for (std::size_t i = 0; i < forks; ++i) {
      RequestState child = parent;
      child.request_id = child_id(parent, static_cast<std::int64_t>(i));
      child.num_children = 0;
      stage(s, std::move(child), false);
    }
    prepare(s);
    cache_->fork_request(key_of(parent), s.keys);
    undo_.set(parent.num_children, parent.num_children - static_cast<std::int64_t>(forks));
    // Committed: the children run right after their parent, in order.
    auto at = std::find(active_.begin(), active_.end(), parent.handle.slot) + 1;
    for (const RequestState& child : s.states) {
      const std::ptrdiff_t i = at - active_.begin();
      insert_id(active_, at, child.handle.slot);
      at = active_.begin() + i + 1;
    }
    commit(s);
    stats_.forks += static_cast<std::int64_t>(forks);
    requeue_children(parent, static_cast<std::int64_t>(forks));
  }

  // New waiting requests for the parent's children from `first` on, each with the prompt given.
  std::vector<RequestState> requeued_children(const RequestState& parent, std::int64_t first,
                                              std::span<const std::int64_t> prompt) const {
    std::vector<RequestState> out;
    out.reserve(static_cast<std::size_t>(parent.num_children));
    for (std::int64_t i = first; i < first + parent.num_children; ++i) {
      RequestState child;
      child.request_id = child_id(parent, i);
      child.tokens.assign(prompt.begin(), prompt.end());
      child.prompt_length = static_cast<std::int64_t>(prompt.size());
      child.max_new_tokens = parent.max_new_tokens;
      child.eos_token_id = parent.eos_token_id;
      out.push_back(std::move(child));
    }
    return out;
  }

  // Stages the parent's children from `first` on as new waiting requests with `prompt` (see
  // requeued_children); returns how many. The caller commits, then sets the parent's num_children
  // to 0 and counts them in stats_.forks_requeued.
  std::int64_t stage_children(staged& s, const RequestState& parent, std::int64_t first,
                              std::span<const std::int64_t> prompt) {
    std::vector<RequestState> children = requeued_children(parent, first, prompt);
    for (RequestState& child : children) stage(s, std::move(child));
    return static_cast<std::int64_t>(children.size());
  }

  // The parent's children from `first` on, as new waiting requests with its prompt.
  void requeue_children(RequestState& parent, std::int64_t first = 0) {
    staged s;
    const std::int64_t n = stage_children(s, parent, first, parent.prompt());
    prepare(s);
    undo_.set(parent.num_children, std::int64_t{0});
    commit(s);
    stats_.forks_requeued += n;
  }

  PagedCache<S>* cache_;
  SchedulerOptions options_;
  bool prefill_first_ = false;
  double safety_margin_ = 0.15;
  std::int64_t max_batch_tokens_ = 0, max_requests_per_batch_ = 0, fast_path_blocks_ = 0;
  // The requests' states, one slot each (a slot on the heap: a reference to a state survives the
  // vector's growth); the free slots, with room for all; every held request's id, the one lookup
  // by name (at the API boundary: the step works on slots).
  std::vector<std::unique_ptr<slot>> slots_;
  std::vector<std::uint32_t> free_slots_;
  std::unordered_map<std::string, RequestHandle> names_;
  std::unordered_map<std::string, std::int64_t> live_children_;  // parent id -> its children held
  std::vector<std::uint32_t> active_;                            // prefilling and decoding, in the order they started
  std::vector<std::uint32_t> waiting_;                           // pending, in arrival order
  std::vector<std::uint32_t> ended_;
  bool sharing_ = false;           // some group hashes its complete blocks
  std::int64_t shared_group_ = 0;  // the first such group (each full group does, when one does)
  bool block_new_requests_ = false;
  bool in_flight_ = false;
  SchedulerStats stats_;
  paged::UndoLog undo_;  // schedule()'s and update()'s changes, until they return
};

}  // namespace kvc

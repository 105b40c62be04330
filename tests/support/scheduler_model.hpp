#pragma once
// Model-checked runs of kvc::ContinuousBatchingScheduler over a kvc::PagedCache: a byte string (a
// seeded generator's, or a fuzzer's) picks the cache's layout and sizes, then a sequence of
// operations (add_request with forks, shared prefixes and one-token prompts, a step of the toy
// model of toy_model.hpp, take_finished, cancel_request, the sequence operations, draft tokens for
// a request's next step (partly the model's own continuation, so that some are kept and the rest
// rolled back), and misuse: a stale batch, a second schedule, a wrong token count, a cancel or a
// draft while a batch is in flight).
// After every operation the run checks what must always hold:
//   - the blocks: each shareable block's ref count equals the tables holding it (another block
//     has at most one holder), the free lists are disjoint and hold no block in use, and
//     free + used = num_blocks;
//   - no group has a table, and the swap pool holds no request, that the scheduler does not run;
//   - every request's generated tokens are the model's;
//   - every cached position of every request in the cache holds that request's own K/V row;
//   - a call that throws changes nothing the caller can observe; with inject() on, every call
//     also fails allocations at random and must then change nothing.
// At the end every request has ended and every block and swap block is free again. A broken
// invariant throws kvc_model::violation (the unit test fails, the fuzz target aborts).

#include <bit>
#include <cstdint>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "toy_model.hpp"

namespace kvc_model {

struct violation : std::logic_error {
  using std::logic_error::logic_error;
};

// Small numbers drawn from a byte string; past its end every draw is 0 (and the run stops adding
// work, so that it ends).
class source {
 public:
  explicit source(std::span<const std::uint8_t> bytes) : bytes_(bytes.begin(), bytes.end()) {}
  source(std::uint64_t seed, std::size_t n) {
    std::mt19937_64 g(seed);
    bytes_.resize(n);
    for (auto& b : bytes_) b = static_cast<std::uint8_t>(g());
  }
  // A number in [0, n).
  std::int64_t pick(std::int64_t n) {
    if (at_ >= bytes_.size()) return 0;
    const std::uint8_t b = bytes_[at_++];
    return n <= 1 ? 0 : b % n;
  }
  bool exhausted() const noexcept { return at_ >= bytes_.size(); }

 private:
  std::vector<std::uint8_t> bytes_;
  std::size_t at_ = 0;
};

struct counts {
  std::int64_t operations = 0, steps = 0, refusals = 0, rows_checked = 0, finished = 0;
  std::int64_t state_prefix_hits = 0;  // prompt tokens a hybrid model resumed from state snapshots
  std::int64_t draft_tokens = 0, accepted_draft_tokens = 0;  // draft tokens run, and kept
  std::int64_t state_rollbacks = 0;  // cuts of a hybrid model's requests made in place (state rings)
};

class run {
 public:
  explicit run(source& src) : src_(src) {
    static const std::vector<std::vector<std::string>> layouts = {
        {"full_attention", "full_attention"},
        {"full_attention", "sliding_attention"},
        {"sliding_attention", "sliding_attention"},
        {"sliding_attention", "full_attention", "full_attention"},
        {"linear_attention", "full_attention", "full_attention"},  // prefix sharing through state snapshots
        {"full_attention", "linear_attention", "sliding_attention"}};
    types_ = layouts[static_cast<std::size_t>(src_.pick(std::ssize(layouts)))];
    kvc::ContinuousBatchingConfig cb;
    cb.block_size = 4;
    cb.num_blocks = 6 + src_.pick(19);
    cb.max_batch_tokens = 1 + src_.pick(24);
    cb.allow_block_sharing = src_.pick(2) == 0;
    cb.scheduler_type = src_.pick(2) == 0 ? "fifo" : "prefill_first";
    cb.state_snapshot_interval = 4 * src_.pick(3);  // (a model with states only)
    cb.max_state_snapshots = 1 + src_.pick(4);
    cb.state_rollback_tokens = 2 * src_.pick(3);  // (a model with states only: its rings)
    cache_.emplace(kvc_toy::model(types_, 5 + src_.pick(6)), cb);
    if (const std::int64_t swap = src_.pick(10); swap > 0) cache_->reserve_swap_space(swap);
    if (*cb.num_blocks % 2 == 1) {  // half the runs serve from a copy (its scratch memory starts empty)
      const kvc_toy::Cache built = *cache_;
      cache_.reset();
      cache_.emplace(built);
    }
    sched_.emplace(*cache_, cb);
    for (int i = 0; i < 3; ++i) {  // system prompts that requests may start with
      std::vector<std::int64_t> p;
      for (std::int64_t n = 1 + src_.pick(9); n > 0; --n) p.push_back(src_.pick(kvc_toy::VOCAB));
      prefixes_.push_back(std::move(p));
    }
  }

  // Makes the calls (add_request, schedule, update, cancel_request, take_finished, seq_rm, seq_cp,
  // seq_keep, set_draft_tokens) fail an allocation now and then: `arm(n)` fails the n-th allocation from then on,
  // `disarm()` stops and says whether one failed (tests/unit/alloc_failure.cpp replaces operator
  // new for this). A failed call must change nothing; it is then made again, unarmed.
  void inject(std::function<void(std::int64_t)> arm, std::function<bool()> disarm) {
    arm_ = std::move(arm);
    disarm_ = std::move(disarm);
  }
  std::int64_t injected() const noexcept { return injected_; }

  // Runs operations until the source is spent, then to the end; returns what it did.
  counts go(std::int64_t max_operations = 400) {
    check("the start");
    while (!src_.exhausted() && c_.operations < max_operations) {
      ++c_.operations;
      operation();
    }
    finish();
    if (cache_->state_snapshot_interval() > 0) c_.state_prefix_hits += sched_->stats().prefix_hit_tokens;
    c_.draft_tokens += sched_->stats().draft_tokens;
    c_.accepted_draft_tokens += sched_->stats().accepted_draft_tokens;
    if (!cache_->state_layers().empty()) c_.state_rollbacks += sched_->stats().cuts_in_place;
    return c_;
  }

 private:
  using Scheduler = kvc_toy::Scheduler;

  std::int64_t layers() const { return static_cast<std::int64_t>(types_.size()); }

  [[noreturn]] void fail(const std::string& what) const {
    throw violation("operation " + std::to_string(c_.operations) + ": " + what);
  }

  // What the caller can observe of every request the scheduler knows, and of the cache.
  std::string observed() const {
    std::string s = std::to_string(sched_->num_waiting()) + "/" + std::to_string(sched_->num_active()) + "/" +
                    std::to_string(sched_->stats().steps) + "/" + std::to_string(cache_->get_num_free_blocks()) + "/" +
                    std::to_string(cache_->free_swap_blocks()) + ";";
    // The free lists in order (which blocks the next allocations take) and the swap pool's.
    for (const std::int64_t b : cache_->manager().uninitialized_blocks()) s += std::to_string(b) + " ";
    s += "|";
    for (const std::int64_t b : cache_->manager().initialized_blocks()) s += std::to_string(b) + " ";
    s += ";";
    // Every shareable block's holders, hash and parent (which prefixes a later request finds).
    for (std::int64_t b = 0; b < cache_->num_blocks(); ++b)
      if (const kvc::paged::Block* blk = cache_->manager().block(b))
        s += std::to_string(b) + ":" + std::to_string(blk->ref_count) + "," +
             (blk->hash ? std::to_string(*blk->hash) : "-") + "," +
             (blk->parent_id ? std::to_string(*blk->parent_id) : "-") + " ";
    // The pools' contents (a failed call copies no block: its copies wait for the commit).
    std::uint64_t rows = 0;
    const std::int64_t n = (cache_->num_blocks() + 2) * cache_->block_size() * kvc_toy::KVH * kvc_toy::D;
    for (std::int64_t j = 0; j < cache_->group_size(); ++j)
      for (std::int64_t i = 0; i < n; ++i) {
        rows = kvc_toy::mix(rows, std::bit_cast<std::uint32_t>(cache_->key_pool(j)[i]));
        rows = kvc_toy::mix(rows, std::bit_cast<std::uint32_t>(cache_->value_pool(j)[i]));
      }
    s += ";" + std::to_string(rows);
    const kvc::SchedulerStats& t = sched_->stats();
    s += ";" + std::to_string(t.batch_tokens) + "," + std::to_string(t.prefill_tokens) + "," +
         std::to_string(t.prefix_hit_tokens) + "," + std::to_string(t.cpu_offloads) + "," +
         std::to_string(t.soft_resets) + "," + std::to_string(t.restores) + "," + std::to_string(t.forks) + "," +
         std::to_string(t.forks_requeued) + "," + std::to_string(t.failed) + "," + std::to_string(t.draft_tokens) +
         "," + std::to_string(t.accepted_draft_tokens) + "," + std::to_string(t.cuts_in_place) + "," +
         std::to_string(t.cuts_prefilled) + "," + std::to_string(cache_->total_prefix_length()) + ";";
    for (const std::string& id : known_) {
      const kvc::RequestState& st = sched_->request(id);
      s += id + "@" + std::to_string(st.handle.slot) + "." + std::to_string(st.handle.generation) + ":" +
           std::to_string(static_cast<int>(st.status)) + "," + std::to_string(st.position_offset) + "," +
           std::to_string(st.prompt_length) + "," + std::to_string(st.num_children) + "," +
           std::to_string(cache_->is_offloaded(id)) + "," + std::to_string(st.remaining_prefill_tokens().size()) + "," +
           std::to_string(st.preemptions) + "," + st.error + ",";
      for (const std::int64_t token : st.tokens) s += std::to_string(token) + " ";
      s += "drafts ";
      for (const std::int64_t token : sched_->draft_tokens(id)) s += std::to_string(token) + " ";
      for (std::int64_t g = 0; g < cache_->num_groups(); ++g)
        s += "|" + std::to_string(cache_->blocks_in_group(static_cast<std::size_t>(g), id));
      s += "|" + std::to_string(cache_->state_rollback_depth(id));  // the rings' bookkeeping
      s += ";";
    }
    return s;
  }

  // A call that must be refused with a ValueError and change nothing.
  template <class F>
  void refused(const char* what, F&& f) {
    const std::string before = observed();
    try {
      f();
    } catch (const kvc::ValueError&) {
      ++c_.refusals;
      if (observed() != before) fail(std::string(what) + " was refused but changed the scheduler or the cache");
      return;
    }
    fail(std::string(what) + " was not refused");
  }

  bool exists(const std::string& id) const {
    try {
      (void)sched_->request(id);
      return true;
    } catch (const kvc::KeyError&) {
      return false;
    }
  }
  // An all-or-nothing call: with injection on, its n-th allocation may fail first (n drawn from
  // the source); the failure must change nothing, and the call is made again.
  template <class F>
  void attempt(const char* what, F&& call, std::int64_t within = 24) {
    if (arm_) {
      const std::string before = observed();
      arm_(src_.pick(within));
      try {
        call();
        disarm_();
        return;
      } catch (const std::bad_alloc&) {
        if (!disarm_()) throw;
      }
      ++injected_;
      if (observed() != before)
        fail(std::string(what) + " failed an allocation and changed the scheduler or the cache");
    }
    call();
  }

  // Children the scheduler made (by a fork, or queued on their own) join the known ids.
  void learn_children() {
    for (const auto& [parent, n] : children_)
      for (std::int64_t i = 0; i < n; ++i) {
        const std::string id = parent + "__child#" + std::to_string(i);
        if (known_.count(id) == 0 && taken_.count(id) == 0 && exists(id)) known_.insert(id);
      }
  }
  // The scheduler still holds a child of `parent`: its id cannot be used again yet.
  bool children_alive(const std::string& parent) const {
    const std::string mark = parent + "__child#";
    const auto it = known_.lower_bound(mark);
    return it != known_.end() && it->compare(0, mark.size(), mark) == 0;
  }

  std::string any_known() {
    if (known_.empty()) return "nobody";
    auto it = known_.begin();
    std::advance(it, src_.pick(std::ssize(known_)));
    return *it;
  }
  // Every other call on a request is made by handle (what add_request returned, or the handle a
  // child or a copy has), the others by id: both paths meet the same checks. Drawn from no byte.
  bool by_handle() { return (++calls_ & 1) != 0; }
  kvc::RequestHandle handle_of(const std::string& id) const {
    const auto it = handles_.find(id);
    return it != handles_.end() ? it->second : sched_->handle(id);
  }
  bool live(const std::string& id) const {
    if (known_.count(id) == 0) return false;
    const auto s = sched_->request(id).status;
    return s != kvc::RequestStatus::finished && s != kvc::RequestStatus::failed;
  }

  void operation() {
    switch (src_.pick(18)) {
      case 0:
      case 1:
      case 2:
        return add();
      case 3:
      case 4:
      case 5:
      case 6:
      case 7:
        return step(src_.pick(4) != 0);
      case 8:
        return take();
      case 9:
        return cancel();
      case 10:
      case 11:
        return seq_rm();
      case 12:
        return seq_cp();
      case 13:
        if (src_.pick(4) == 0 && !in_flight_) {
          const std::string id = any_known();
          if (live(id) && by_handle()) {
            const kvc::RequestHandle h = handle_of(id);
            attempt("seq_keep", [&] { sched_->seq_keep(h); });
          } else if (live(id)) {
            attempt("seq_keep", [&] { sched_->seq_keep(id); });
          }
        }
        return check("seq_keep");
      case 14:
      case 15:
        return draft();
      default:
        return misuse();
    }
  }

  void add() {
    kvc::GenerationRequest r;
    r.request_id = "r" + std::to_string(src_.pick(4) == 0 && next_id_ > 0 ? src_.pick(next_id_) : next_id_++);
    if (src_.pick(2) == 0) r.prompt = prefixes_[static_cast<std::size_t>(src_.pick(3))];
    for (std::int64_t n = (r.prompt.empty() ? 1 : 0) + src_.pick(8); n > 0; --n)
      r.prompt.push_back(src_.pick(kvc_toy::VOCAB));
    r.max_new_tokens = 1 + src_.pick(6);
    if (src_.pick(3) == 0) r.eos_token_id = src_.pick(kvc_toy::VOCAB);
    r.num_return_sequences = 1 + src_.pick(3);
    learn_children();
    const bool taken = known_.count(r.request_id) != 0 || children_alive(r.request_id);
    if (taken) {
      refused("add_request of a known id", [&] { sched_->add_request(r); });
      return check("add_request (refused)");
    }
    kvc::RequestHandle& added = handles_[r.request_id];  // made here: the call allocates only in add_request
    attempt("add_request", [&] { added = sched_->add_request(r); });
    known_.insert(r.request_id);
    taken_.erase(r.request_id);
    children_[r.request_id] = r.num_return_sequences - 1;
    for (std::int64_t i = 0; i + 1 < r.num_return_sequences; ++i)
      taken_.erase(r.request_id + "__child#" + std::to_string(i));
    check("add_request");
  }
  // schedule (unless a batch is in flight) and the model over the batch; then update, unless
  // `complete` is false: the batch stays in flight for the next operations.
  void step(bool complete) {
    if (!in_flight_) {
      std::optional<kvc::ScheduledBatch> b;
      attempt(
          "schedule", [&] { b = sched_->schedule(); }, 96);
      if (!b) return check("schedule (nothing)");
      ++c_.steps;
      kvc_toy::write_batch(*cache_, *sched_, *b, layers());
      in_flight_ = std::move(b);
      check_batch();
      if (!complete) return check("schedule");
    }
    const std::vector<std::int64_t> next = kvc_toy::next_tokens(*sched_, *in_flight_);
    attempt(
        "update", [&] { sched_->update(*in_flight_, next); }, 96);
    stale_ = std::move(in_flight_);
    in_flight_.reset();
    check("update");
  }

  // The batch's inputs are its requests' own tokens at their positions, then any draft tokens,
  // which follow a decoding request's last token; each draft gives a logits row too.
  void check_batch() {
    const kvc::ScheduledBatch& b = *in_flight_;
    std::size_t logits = 0;
    for (std::size_t r = 0; r < b.requests.size(); ++r) {
      const kvc::RequestState& st = sched_->request(b.request_ids[r]);
      const auto& tokens = st.tokens;
      const std::vector<std::int64_t>& drafts = b.requests[r].draft_tokens;
      const std::int64_t own = b.cu_seqlens_q[r + 1] - std::ssize(drafts);
      if (!drafts.empty() && std::ssize(tokens) != b.past[r] + (own - b.cu_seqlens_q[r]))
        fail("request " + b.request_ids[r] + " runs draft tokens before its last token");
      for (std::int64_t t = b.cu_seqlens_q[r]; t < b.cu_seqlens_q[r + 1]; ++t) {
        const auto pos = static_cast<std::size_t>(b.position_ids[static_cast<std::size_t>(t)]);
        const std::int64_t want =
            t >= own ? drafts[static_cast<std::size_t>(t - own)] : (pos < tokens.size() ? tokens[pos] : -1);
        if (b.input_ids[static_cast<std::size_t>(t)] != want)
          fail("request " + b.request_ids[r] + "'s input at position " + std::to_string(pos) + " is not its token");
      }
      if (b.requests[r].has_new_token)
        for (std::int64_t i = std::ssize(drafts); i >= 0; --i)
          if (logits >= b.logits_indices.size() || b.logits_indices[logits++] != b.cu_seqlens_q[r + 1] - 1 - i)
            fail("request " + b.request_ids[r] + "'s logits rows are not its last tokens'");
    }
    if (logits != b.logits_indices.size()) fail("the batch has logits rows no request gives");
  }
  // The draft tokens the batch in flight runs for the request (0 without one).
  std::int64_t drafts_in_flight(const std::string& id) const {
    if (!in_flight_) return 0;
    for (const kvc::ScheduledRequest& r : in_flight_->requests)
      if (r.request_id == id) return std::ssize(r.draft_tokens);
    return 0;
  }

  void take() {
    learn_children();
    std::vector<kvc::RequestState> ended;
    attempt("take_finished", [&] { ended = sched_->take_finished(); });
    for (kvc::RequestState& st : ended) {
      if (known_.erase(st.request_id) == 0) fail("take_finished returned " + st.request_id + ", not known");
      const auto h = handles_.find(st.request_id);
      if (h != handles_.end() && h->second != st.handle) fail(st.request_id + " came back under another handle");
      if (h != handles_.end()) handles_.erase(h);
      try {  // its handle now names nothing, whatever holds its slot
        (void)sched_->request(st.handle);
        fail("the handle of " + st.request_id + " still names a request after take_finished");
      } catch (const kvc::KeyError&) {
      }
      taken_.insert(st.request_id);
      check_tokens(st);
      if (st.status == kvc::RequestStatus::finished) ++c_.finished;
    }
    check("take_finished");
  }

  void cancel() {
    const std::string id = any_known();
    if (in_flight_) {
      if (live(id)) refused("cancel_request in flight", [&] { sched_->cancel_request(id); });
      return check("cancel_request (refused)");
    }
    if (known_.count(id) != 0) {
      if (by_handle()) {
        const kvc::RequestHandle h = handle_of(id);
        attempt("cancel_request", [&] { sched_->cancel_request(h); });
      } else {
        attempt("cancel_request", [&] { sched_->cancel_request(id); });
      }
    }
    check("cancel_request");
  }

  void seq_rm() {
    const std::string id = any_known();
    if (!live(id)) return;
    const auto n = std::ssize(sched_->request(id).tokens);
    const std::int64_t p0 = src_.pick(n + 2) - 1, p1 = src_.pick(3) == 0 ? src_.pick(n + 2) - 1 : -1;
    if (in_flight_) {
      refused("seq_rm in flight", [&] { sched_->seq_rm(id, p0, p1); });
      return check("seq_rm (refused)");
    }
    if (by_handle()) {
      const kvc::RequestHandle h = handle_of(id);
      attempt("seq_rm", [&] { (void)sched_->seq_rm(h, p0, p1); });
    } else {
      attempt("seq_rm", [&] { (void)sched_->seq_rm(id, p0, p1); });
    }
    check("seq_rm");
  }

  // Draft tokens for a request (set_draft_tokens): the model's own continuation for a drawn number
  // of them, then drawn tokens (none withdraws them). Refused while a batch is in flight.
  void draft() {
    const std::string id = any_known();
    if (!live(id)) return;
    const kvc::RequestState& st = sched_->request(id);
    const std::int64_t k = src_.pick(5), right = src_.pick(k + 1);
    std::vector<std::int64_t> seq = st.tokens, tokens;
    for (std::int64_t i = 0; i < k; ++i) {
      tokens.push_back(i < right ? kvc_toy::next_token(seq) : src_.pick(kvc_toy::VOCAB));
      seq.push_back(tokens.back());
    }
    if (in_flight_) {
      refused("set_draft_tokens", [&] { sched_->set_draft_tokens(id, tokens); });
      return check("set_draft_tokens (refused)");
    }
    if (by_handle()) {
      const kvc::RequestHandle h = handle_of(id);
      attempt("set_draft_tokens", [&] { sched_->set_draft_tokens(h, tokens); });
    } else {
      attempt("set_draft_tokens", [&] { sched_->set_draft_tokens(id, tokens); });
    }
    const std::span<const std::int64_t> held = sched_->draft_tokens(id);
    if (!std::equal(held.begin(), held.end(), tokens.begin(), tokens.end()))
      fail("request " + id + " holds other draft tokens than set");
    check("set_draft_tokens");
  }

  void seq_cp() {
    const std::string src = any_known();
    if (!live(src) || in_flight_) return;
    const std::string dst = "c" + std::to_string(next_id_++);
    const auto n = std::ssize(sched_->request(src).tokens);
    const std::int64_t p1 = src_.pick(2) == 0 ? -1 : src_.pick(n + 1);
    const std::int64_t p0 = src_.pick(2) - 1;
    bool copied = false;
    if (by_handle()) {
      const kvc::RequestHandle h = handle_of(src);
      attempt("seq_cp", [&] { copied = sched_->seq_cp(h, dst, p0, p1); });
    } else {
      attempt("seq_cp", [&] { copied = sched_->seq_cp(src, dst, p0, p1); });
    }
    if (copied && exists(dst)) known_.insert(dst);
    check("seq_cp");
  }

  void misuse() {
    switch (src_.pick(3)) {
      case 0:
        if (stale_)
          refused("update with a stale batch", [&] {
            const std::vector<std::int64_t> tokens(stale_->logits_indices.size(), 1);
            sched_->update(*stale_, tokens);
          });
        break;
      case 1:
        if (in_flight_) refused("a second schedule", [&] { (void)sched_->schedule(); });
        break;
      default:
        if (in_flight_)
          refused("update with a wrong token count", [&] {
            const std::vector<std::int64_t> tokens(in_flight_->logits_indices.size() + 1, 1);
            sched_->update(*in_flight_, tokens);
          });
    }
    check("misuse");
  }

  // Generated tokens are the model's: each one after the prompt follows from the tokens before it.
  void check_tokens(const kvc::RequestState& st) {
    for (std::size_t i = static_cast<std::size_t>(st.prompt_length); i < st.tokens.size(); ++i)
      if (st.tokens[i] != kvc_toy::next_token(std::span(st.tokens).first(i)))
        fail("request " + st.request_id + "'s token " + std::to_string(i) + " is not the model's");
  }

  void check(const char* after) {
    learn_children();
    const std::string where = std::string(" after ") + after;
    // Handles: each known request's is the one its id finds and add_request returned.
    for (const std::string& id : known_) {
      const kvc::RequestHandle h = sched_->request(id).handle;
      if (sched_->find(id) != h || &sched_->request(h) != &sched_->request(id))
        fail("request " + id + "'s handle does not find it" + where);
      const auto added = handles_.find(id);
      if (added != handles_.end() && added->second != h) fail("request " + id + "'s handle changed" + where);
    }
    const auto& m = cache_->manager();
    // Blocks: ref counts, free lists, totals.
    std::map<std::int64_t, std::int64_t> holders;
    std::set<std::string> in_tables;
    for (std::int64_t g = 0; g < cache_->num_groups(); ++g)
      for (const std::string& r : cache_->block_tables().requests(g)) {
        in_tables.insert(r);
        for (const std::int64_t b : cache_->block_table(g, r)) ++holders[b];
      }
    const std::vector<std::int64_t> uninit = m.uninitialized_blocks(), init = m.initialized_blocks();
    std::set<std::int64_t> free(uninit.begin(), uninit.end());
    for (const std::int64_t b : init)
      if (!free.insert(b).second) fail("block " + std::to_string(b) + " is on both free lists" + where);
    if (std::ssize(free) != std::ssize(uninit) + std::ssize(init)) fail("a free list repeats a block" + where);
    for (std::int64_t b = 0; b < cache_->num_blocks(); ++b) {
      // A shareable block counts its holders; another has at most one.
      const kvc::paged::Block* block = m.block(b);
      const std::int64_t held = holders.count(b) ? holders[b] : 0,
                         refs = block ? block->ref_count : std::min<std::int64_t>(held, 1);
      if (refs != held)
        fail("block " + std::to_string(b) + " has ref count " + std::to_string(refs) + " and " + std::to_string(held) +
             " holders" + where);
      if ((free.count(b) != 0) == (held > 0))
        fail("block " + std::to_string(b) + (held > 0 ? " is free and held" : " is neither free nor held") + where);
    }
    if (cache_->get_num_free_blocks() + std::ssize(holders) != cache_->num_blocks())
      fail("free + used blocks is not num_blocks" + where);
    // Tables and swap only for requests the scheduler runs.
    for (const std::string& r : in_tables)
      if (!live(r)) fail("group tables hold " + r + ", which the scheduler does not run" + where);
    std::int64_t offloaded = 0;
    for (const std::string& id : known_) {
      if (!cache_->is_offloaded(id)) continue;
      ++offloaded;
      if (!live(id)) fail("the swap pool holds " + id + ", which the scheduler does not run" + where);
    }
    if (offloaded == 0 && cache_->free_swap_blocks() != cache_->swap_blocks())
      fail("swap blocks are used with no request offloaded" + where);
    // The cache knows exactly the requests the scheduler runs, each opened under its id (its key
    // names it whatever it holds), and nothing else.
    std::int64_t running = 0;
    for (const std::string& id : known_) {
      if (!live(id)) {
        if (cache_->find_request(id)) fail("the cache still knows " + id + ", which has ended" + where);
        continue;
      }
      ++running;
      const auto key = cache_->find_request(id);
      if (!key || !cache_->block_tables().names().opened(*key) || cache_->request_name(*key) != id)
        fail("request " + id + " is not open in the cache under its id" + where);
    }
    // The queues hold the requests of their status: pending ones wait, prefilling and decoding
    // ones are active.
    std::int64_t waiting = 0, active = 0;
    for (const std::string& id : known_) {
      const kvc::RequestState& st = sched_->request(id);
      waiting += st.status == kvc::RequestStatus::pending ? 1 : 0;
      active += st.is_active() ? 1 : 0;
    }
    if (sched_->num_waiting() != waiting || sched_->num_active() != active)
      fail("the queues hold " + std::to_string(sched_->num_waiting()) + " waiting and " +
           std::to_string(sched_->num_active()) + " active requests, their statuses say " + std::to_string(waiting) +
           " and " + std::to_string(active) + where);
    if (cache_->num_requests() != running)
      fail("the cache knows " + std::to_string(cache_->num_requests()) + " requests, the scheduler runs " +
           std::to_string(running) + where);
    // Tokens, and the rows of every request in the cache (not while a batch is in flight: its
    // rows are written, but its requests already count the step's tokens as cached only after
    // update, when they are checked).
    for (const std::string& id : known_) {
      const kvc::RequestState& st = sched_->request(id);
      check_tokens(st);
      // The scheduler takes a request's block count from its position (held_blocks): the tables
      // must agree (a full group holds exactly what the cached tokens need, a sliding ring at most
      // its blocks).
      if (live(id) && !cache_->is_offloaded(id)) {
        const std::int64_t bs = cache_->block_size();
        std::int64_t held = (st.position_offset + drafts_in_flight(id) + bs - 1) / bs;
        if (cache_->num_full_attention_groups() == 0)
          held = std::min(held, cache_->max_sliding_window_blocks_per_request());
        if (sched_->allocated_blocks(id) != held)
          fail("request " + id + " holds " + std::to_string(sched_->allocated_blocks(id)) + " blocks, its " +
               std::to_string(st.position_offset) + " cached tokens " + std::to_string(held) + where);
      }
      if (!live(id) || in_flight_ || cache_->is_offloaded(id) || st.position_offset == 0) continue;
      const std::string wrong =
          kvc_toy::wrong_row(*cache_, id, st.tokens, st.position_offset, layers(), &c_.rows_checked);
      if (!wrong.empty()) fail("request " + id + " " + wrong + " holds another row" + where);
      const std::string state = kvc_toy::wrong_state(*cache_, id, st.tokens, st.position_offset);
      if (!state.empty()) fail("request " + id + " " + state + " is not its tokens'" + where);
    }
  }

  // Every request runs to its end; everything is free again.
  void finish() {
    if (in_flight_) step(true);
    for (int guard = 0; sched_->has_unfinished_requests(); ++guard) {
      if (guard > 20000) fail("the requests do not end");
      step(true);
      if (!in_flight_ && !sched_->has_unfinished_requests()) break;
    }
    take();
    if (!known_.empty()) fail("request " + *known_.begin() + " never ended");
    if (cache_->get_num_free_blocks() != cache_->num_blocks()) fail("blocks are still in use at the end");
    if (cache_->free_swap_blocks() != cache_->swap_blocks()) fail("swap blocks are still in use at the end");
  }

  source& src_;
  std::vector<std::string> types_;
  std::optional<kvc_toy::Cache> cache_;
  std::optional<Scheduler> sched_;
  std::vector<std::vector<std::int64_t>> prefixes_;
  std::set<std::string> known_;                        // ids the scheduler knows, not yet taken
  std::set<std::string> taken_;                        // ids take_finished returned
  std::map<std::string, std::int64_t> children_;       // a request's child count at its last add
  std::map<std::string, kvc::RequestHandle> handles_;  // what add_request returned, until taken
  std::int64_t calls_ = 0;                             // by handle on odd calls, by id on even ones
  std::optional<kvc::ScheduledBatch> in_flight_, stale_;
  std::int64_t next_id_ = 0;
  counts c_;
  std::function<void(std::int64_t)> arm_;
  std::function<bool()> disarm_;
  std::int64_t injected_ = 0;
};

}  // namespace kvc_model

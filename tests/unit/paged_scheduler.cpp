// kvc::ContinuousBatchingScheduler driving a kvc::PagedCache: budgets, chunked prefill, prefix
// sharing, forks, preemption by offload and by soft reset, and the requests' cached keys and values
// checked after every step against what each request alone would hold.
//
// The model is the toy of tests/support/toy_model.hpp: its key and value at position p are a
// function of the sequence's tokens 0..p (identical prefixes give identical rows, as a real
// model's would, so prefix sharing and forks are exact) and its next token a function of every
// token so far.

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <kvc/paged/scheduler.hpp>

#include "../support/kvc_test.hpp"
#include "../support/toy_model.hpp"

namespace {

using kvc_toy::Cache;
using kvc_toy::model;
using kvc_toy::next_token;
using kvc_toy::Scheduler;
using kvc_toy::VOCAB;

// What a request alone generates.
std::vector<std::int64_t> alone(std::vector<std::int64_t> seq, std::int64_t max_new, std::optional<std::int64_t> eos) {
  const std::size_t prompt = seq.size();
  while (static_cast<std::int64_t>(seq.size() - prompt) < max_new) {
    seq.push_back(next_token(seq));
    if (eos && seq.back() == *eos) break;
  }
  return {seq.begin() + static_cast<std::ptrdiff_t>(prompt), seq.end()};
}

struct Run {
  std::int64_t steps = 0, checked_rows = 0, max_tokens = 0, max_requests = 0;
  std::map<std::string, kvc::RequestState> ended;
};

// One step of the toy model, checking afterwards that every request of the batch holds its own
// rows at every cached position (the window's for sliding groups) and that its inputs are its own
// tokens. False when nothing was left to schedule.
bool step(Cache& cache, Scheduler& s, std::int64_t layers, Run& run) {
  auto batch = s.schedule();
  for (auto& st : s.take_finished()) run.ended.emplace(st.request_id, std::move(st));  // failed in schedule()
  if (!batch) return false;
  {
    ++run.steps;
    REQUIRE(run.steps < 5000);
    const std::int64_t T = batch->num_tokens();
    run.max_tokens = std::max(run.max_tokens, T);
    run.max_requests = std::max(run.max_requests, static_cast<std::int64_t>(batch->requests.size()));
    std::size_t logits = 0;
    for (std::size_t r = 0; r < batch->requests.size(); ++r) {
      REQUIRE(batch->requests[r].query_length >= 1);
      // A request's draft tokens follow its own last token; each gives a logits row too.
      const auto drafts = static_cast<std::int64_t>(batch->requests[r].draft_tokens.size());
      if (batch->requests[r].has_new_token)
        for (std::int64_t i = drafts; i >= 0; --i)
          REQUIRE(batch->logits_indices.at(logits++) == batch->cu_seqlens_q[r + 1] - 1 - i);
      const auto& tokens = s.request(batch->request_ids[r]).tokens;
      const std::int64_t own = batch->cu_seqlens_q[r + 1] - drafts;  // its own tokens' inputs end here
      if (drafts > 0)
        REQUIRE(batch->past[r] + own - batch->cu_seqlens_q[r] == static_cast<std::int64_t>(tokens.size()));
      for (std::int64_t t = batch->cu_seqlens_q[r]; t < batch->cu_seqlens_q[r + 1]; ++t) {
        const std::int64_t pos = batch->position_ids[static_cast<std::size_t>(t)];
        REQUIRE(pos == batch->past[r] + t - batch->cu_seqlens_q[r]);
        if (t < own)
          REQUIRE(batch->input_ids[static_cast<std::size_t>(t)] == tokens.at(static_cast<std::size_t>(pos)));
        else
          REQUIRE(batch->input_ids[static_cast<std::size_t>(t)] ==
                  batch->requests[r].draft_tokens[static_cast<std::size_t>(t - own)]);
      }
    }
    kvc_toy::write_batch(cache, s, *batch, layers);
    // Every request of the batch now holds positions 0 .. past + q (a sliding group the last W).
    for (std::size_t r = 0; r < batch->requests.size(); ++r) {
      const std::string& id = batch->request_ids[r];
      const std::int64_t end = batch->past[r] + batch->requests[r].query_length;
      const std::string wrong =
          kvc_toy::wrong_row(cache, id, kvc_toy::batch_sequence(s, *batch, r), end, layers, &run.checked_rows);
      if (!wrong.empty()) FAIL("request " << id << " " << wrong << " holds another row");
    }
    const std::vector<std::int64_t> next = kvc_toy::next_tokens(s, *batch);
    s.update(*batch, next);
    for (auto& st : s.take_finished()) run.ended.emplace(st.request_id, std::move(st));
  }
  return true;
}

// Steps to the end.
Run drive(Cache& cache, Scheduler& s, std::int64_t layers) {
  Run run;
  while (step(cache, s, layers, run)) {
  }
  return run;
}

struct Workload {
  std::vector<kvc::GenerationRequest> requests;
  std::map<std::string, std::vector<std::int64_t>> expected;  // every sequence's generated tokens
};

// n requests, half with a shared 12-token system prefix, two with three sequences.
Workload workload(unsigned seed, int n) {
  std::mt19937 rng(seed);
  auto draw = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  std::vector<std::int64_t> system;
  for (int i = 0; i < 12; ++i) system.push_back(draw(0, VOCAB - 1));
  Workload w;
  for (int i = 0; i < n; ++i) {
    kvc::GenerationRequest r;
    r.request_id = "req" + std::to_string(i);
    if (i % 2 == 0) r.prompt = system;
    for (std::int64_t t = draw(1, 20); t > 0; --t) r.prompt.push_back(draw(0, VOCAB - 1));
    r.max_new_tokens = draw(1, 14);
    if (i % 5 == 3) r.eos_token_id = draw(0, VOCAB - 1);
    if (i == 1 || i == 4) r.num_return_sequences = 3;
    const auto gen = alone(r.prompt, r.max_new_tokens, r.eos_token_id);
    w.expected[r.request_id] = gen;
    for (std::int64_t c = 0; c + 1 < r.num_return_sequences; ++c)
      w.expected[r.request_id + "__child#" + std::to_string(c)] = gen;
    w.requests.push_back(std::move(r));
  }
  return w;
}

struct Setup {
  std::vector<std::string> types;
  std::int64_t block_size, num_blocks, max_batch_tokens, swap_blocks;
  std::string scheduler;
};

Run serve(const Setup& setup, const Workload& w, Cache*& out_cache, std::optional<Cache>& holder,
          std::optional<Scheduler>& sched) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = setup.block_size;
  cb.num_blocks = setup.num_blocks;
  cb.max_batch_tokens = setup.max_batch_tokens;
  cb.scheduler_type = setup.scheduler;
  holder.emplace(model(setup.types), cb);
  if (setup.swap_blocks > 0) holder->reserve_swap_space(setup.swap_blocks);
  sched.emplace(*holder, cb);
  for (const auto& r : w.requests) sched->add_request(r);
  out_cache = &*holder;
  return drive(*holder, *sched, static_cast<std::int64_t>(setup.types.size()));
}

// A cache config with blocks of 4 tokens.
kvc::ContinuousBatchingConfig small(std::int64_t num_blocks, std::optional<std::int64_t> max_batch_tokens) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = num_blocks;
  cb.max_batch_tokens = max_batch_tokens;
  return cb;
}

}  // namespace

TEST_CASE("scheduler: every request ends as it would alone, under preemption, sharing and forks") {
  const std::vector<std::string> full = {"full_attention", "full_attention"};
  const std::vector<std::string> hybrid = {"full_attention", "sliding_attention", "full_attention"};
  const std::vector<Setup> setups = {
      {full, 4, 400, 64, 0, "fifo"},           // room for everyone
      {full, 4, 20, 24, 0, "fifo"},            // soft resets
      {full, 4, 20, 24, 200, "fifo"},          // offload to the swap pool
      {full, 4, 20, 24, 12, "prefill_first"},  // a small pool: some of each
      {hybrid, 4, 24, 16, 0, "fifo"},          // sliding groups, no prefix sharing
      {hybrid, 8, 14, 32, 200, "prefill_first"},
  };
  for (unsigned seed : {1u, 2u, 3u})
    for (const Setup& setup : setups) {
      CAPTURE(seed);
      CAPTURE(setup.num_blocks);
      CAPTURE(setup.swap_blocks);
      CAPTURE(setup.scheduler);
      CAPTURE(setup.types.size());
      const Workload w = workload(seed, 24);
      Cache* cache = nullptr;
      std::optional<Cache> holder;
      std::optional<Scheduler> s;
      const Run run = serve(setup, w, cache, holder, s);
      // Every sequence ended, none failed, each with the tokens it makes alone.
      REQUIRE(run.ended.size() == w.expected.size());
      for (const auto& expected : w.expected) {
        CAPTURE(expected.first);
        const kvc::RequestState& st = run.ended.at(expected.first);
        CHECK(st.status == kvc::RequestStatus::finished);
        CHECK(std::vector<std::int64_t>(st.generated().begin(), st.generated().end()) == expected.second);
      }
      CHECK(run.checked_rows > 1000);
      // Budgets held, and nothing leaked: every block and swap block is free again.
      CHECK(run.max_tokens <= setup.max_batch_tokens);
      CHECK(run.max_requests <= s->max_requests_per_batch());
      CHECK(cache->get_num_free_blocks() == cache->num_blocks());
      CHECK(cache->free_swap_blocks() == cache->swap_blocks());
      CHECK_FALSE(s->has_unfinished_requests());
      const kvc::SchedulerStats& st = s->stats();
      CHECK(st.failed == 0);
      CHECK(st.forks + st.forks_requeued == 4);
      CHECK(st.peak_blocks_in_use <= cache->num_blocks());
      if (setup.num_blocks < 100) CHECK(st.preemptions() > 0);
      if (setup.num_blocks < 100 && setup.swap_blocks == 0) CHECK(st.soft_resets > 0);
      if (setup.swap_blocks >= 200) {
        CHECK(st.cpu_offloads > 0);
        CHECK(st.restores == st.cpu_offloads);
      }
      if (setup.types == full) CHECK(st.prefix_hit_tokens > 0);
      if (setup.types == hybrid) CHECK(st.prefix_hit_tokens == 0);
    }
}

TEST_CASE("scheduler: exact allocation, chunked prefill, one forward per step's budget") {
  kvc::ContinuousBatchingConfig cb = small(100, 8);
  cb.allow_block_sharing = false;
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  CHECK(s.max_requests_per_batch() == 8);  // min(1024, max_batch_tokens)
  CHECK(s.safety_margin() == doctest::Approx(0.15));
  s.add_request({.request_id = "long", .prompt = std::vector<std::int64_t>(19, 3), .max_new_tokens = 2});
  s.add_request({.request_id = "short", .prompt = {1, 2, 3}, .max_new_tokens = 3});
  // Step 1: 8 of the 19 prompt tokens (the token budget), nothing for "short".
  auto b = s.schedule();
  REQUIRE(b);
  CHECK(b->request_ids == std::vector<std::string>{"long"});
  CHECK(b->num_tokens() == 8);
  CHECK(b->logits_indices.empty());
  CHECK(s.request("long").status == kvc::RequestStatus::prefilling);
  CHECK(s.allocated_blocks("long") == 2);  // exactly ceil(8 / 4): transformers asks for 3
  CHECK(cache.get_num_free_blocks() == 98);
  CHECK(s.stats().peak_blocks_in_use == 2);
  CHECK(s.stats().live_rows_at_peak == 8);
  s.update(*b, {});
  b = s.schedule();
  CHECK(b->num_tokens() == 8);
  CHECK(b->past == std::vector<std::int64_t>{8});
  s.update(*b, {});
  // Step 3: the last 3 prompt tokens (and its first token), then "short" with the 5 left.
  b = s.schedule();
  CHECK(b->request_ids == std::vector<std::string>{"long", "short"});
  CHECK(b->cu_seqlens_q == std::vector<std::int64_t>{0, 3, 6});
  CHECK(b->logits_indices == std::vector<std::int64_t>{2, 5});
  CHECK(b->position_ids == std::vector<std::int64_t>{16, 17, 18, 0, 1, 2});
  CHECK(s.allocated_blocks("long") == 5);
  CHECK(s.allocated_blocks("short") == 1);
  s.update(*b, std::vector<std::int64_t>{7, 8});
  CHECK(s.request("long").status == kvc::RequestStatus::decoding);
  CHECK(s.request("long").generated().size() == 1);
  // Decodes: one token each; "long" ends after its second token and frees its blocks.
  b = s.schedule();
  CHECK(b->input_ids == std::vector<std::int64_t>{7, 8});
  CHECK(b->position_ids == std::vector<std::int64_t>{19, 3});
  s.update(*b, std::vector<std::int64_t>{9, 10});
  const auto done = s.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(done[0].request_id == "long");
  CHECK(std::vector<std::int64_t>(done[0].generated().begin(), done[0].generated().end()) ==
        std::vector<std::int64_t>{7, 9});
  CHECK(cache.get_num_free_blocks() == 99);  // only "short"'s block (4 tokens) is held
  CHECK_THROWS_AS(s.request("long"), kvc::KeyError);
}

TEST_CASE("scheduler: a request too long for the whole cache fails alone") {
  kvc::ContinuousBatchingConfig cb = small(6, 64);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "big", .prompt = std::vector<std::int64_t>(30, 1), .max_new_tokens = 1});
  s.add_request({.request_id = "small", .prompt = {1, 2}, .max_new_tokens = 2});
  Run run = drive(cache, s, 1);
  REQUIRE(run.ended.size() == 2);
  CHECK(run.ended.at("small").status == kvc::RequestStatus::finished);
  const kvc::RequestState& big = run.ended.at("big");
  CHECK(big.status == kvc::RequestStatus::failed);
  CHECK(big.error ==
        "kvc::ContinuousBatchingScheduler: request big needs 8 more blocks for 30 tokens, more than the cache can "
        "free (6 blocks of 4 tokens)");
  CHECK(s.stats().failed == 1);
  CHECK(cache.get_num_free_blocks() == 6);
}

TEST_CASE("scheduler: cancelling frees a request's blocks and swap blocks") {
  kvc::ContinuousBatchingConfig cb = small(20, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "a", .prompt = {1, 2, 3, 4, 5}, .max_new_tokens = 9});
  auto b = s.schedule();
  CHECK_THROWS_WITH_AS(s.schedule(),
                       "kvc::ContinuousBatchingScheduler::schedule: the last batch is still in flight; pass it to "
                       "update() first",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.cancel_request("a"),
                       "kvc::ContinuousBatchingScheduler::cancel_request: the last batch is still in flight; pass it "
                       "to update() first",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.update(*b, {}),
                       "kvc::ContinuousBatchingScheduler::update: the batch needs 1 next tokens, got 0",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.update(*b, std::vector<std::int64_t>{-1}),
                       "kvc::ContinuousBatchingScheduler::update: token -1 is outside [0, 2^31)", kvc::ValueError);
  s.update(*b, std::vector<std::int64_t>{6});
  CHECK_THROWS_WITH_AS(s.update(*b, std::vector<std::int64_t>{6}),
                       "kvc::ContinuousBatchingScheduler::update: this is not the batch schedule() returned last",
                       kvc::ValueError);
  CHECK(cache.get_num_free_blocks() == 18);
  s.cancel_request("a");
  CHECK(cache.get_num_free_blocks() == 20);
  const auto done = s.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(done[0].status == kvc::RequestStatus::failed);
  CHECK(done[0].error == "kvc::ContinuousBatchingScheduler: request a cancelled");
  CHECK_FALSE(s.schedule());
}

TEST_CASE("scheduler: configuration and request errors, with transformers' messages where it has them") {
  kvc::ContinuousBatchingConfig cb = small(20, std::nullopt);
  Cache unsized(model({"full_attention"}), cb);
  CHECK_THROWS_WITH_AS(Scheduler(unsized, cb),
                       "kvc::ContinuousBatchingScheduler: max_batch_tokens must be set (>= 1) in the cache's or the "
                       "scheduler's ContinuousBatchingConfig",
                       kvc::ValueError);
  cb.max_batch_tokens = 16;
  Cache cache(model({"full_attention"}), cb);
  cb.safety_margin = 1.5;
  CHECK_THROWS_WITH_AS(Scheduler(cache, cb), "Got safety_margin = 1.5 but expected a value in [0, 1]", kvc::ValueError);
  cb.safety_margin.reset();
  cb.max_requests_per_batch = 0;
  CHECK_THROWS_WITH_AS(Scheduler(cache, cb), "Got max_requests_per_batch = 0 but expected a value >= 1",
                       kvc::ValueError);
  cb.max_requests_per_batch.reset();
  cb.scheduler_type = "lifo";
  std::vector<std::string> warnings;
  const auto previous = kvc::set_warning_handler([&](std::string_view m) { warnings.emplace_back(m); });
  Scheduler s(cache, cb);
  kvc::set_warning_handler(previous);
  CHECK(warnings == std::vector<std::string>{"Scheduler 'lifo' not found. Defaulting to FIFO."});
  CHECK_FALSE(s.prefill_first());

  s.add_request({.request_id = "x", .prompt = {1}});
  const std::string where = "kvc::ContinuousBatchingScheduler::add_request: request ";
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "e", .prompt = {}}), (where + "'e' has an empty prompt").c_str(),
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "t", .prompt = {1, -2}}),
                       (where + "'t' has token -2, outside [0, 2^31)").c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "m", .prompt = {1}, .max_new_tokens = 0}),
                       (where + "'m' needs max_new_tokens >= 1 and num_return_sequences >= 1, got 0 and 1").c_str(),
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "x", .prompt = {1}}),
                       (where + "'x' is already known, or names a child sequence (__child#)").c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "y__child#0", .prompt = {1}}),
                       (where + "'y__child#0' is already known, or names a child sequence (__child#)").c_str(),
                       kvc::ValueError);
  CHECK(s.num_waiting() == 1);
  CHECK_THROWS_WITH_AS(s.request("nope"), "kvc::ContinuousBatchingScheduler: no request 'nope'", kvc::KeyError);
}

TEST_CASE("scheduler: a one-token prompt's sequences run as requests of their own") {
  kvc::ContinuousBatchingConfig cb = small(20, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "one", .prompt = {5}, .max_new_tokens = 3, .num_return_sequences = 3});
  CHECK(s.num_waiting() == 3);
  const Run run = drive(cache, s, 1);
  const auto expected = alone({5}, 3, std::nullopt);
  for (const std::string id : {"one", "one__child#0", "one__child#1"}) {
    const auto& st = run.ended.at(id);
    CHECK(std::vector<std::int64_t>(st.generated().begin(), st.generated().end()) == expected);
  }
  CHECK(s.stats().forks_requeued == 2);
}

TEST_CASE("scheduler: a prompt found whole in the cache computes its last token again") {
  kvc::ContinuousBatchingConfig cb = small(20, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  const std::vector<std::int64_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  s.add_request({.request_id = "first", .prompt = prompt, .max_new_tokens = 2});
  drive(cache, s, 1);
  s.add_request({.request_id = "again", .prompt = prompt, .max_new_tokens = 2});
  const auto b = s.schedule();
  REQUIRE(b);
  CHECK(b->input_ids == std::vector<std::int64_t>{8});  // both blocks shared, the last token recomputed
  CHECK(b->past == std::vector<std::int64_t>{7});
  CHECK(s.stats().prefix_hit_tokens == 7);
  CHECK(s.stats().prefill_tokens == 8 + 1);  // "first" computed its 8, "again" its last one
  CHECK(s.stats().prefix_hit_rate() == doctest::Approx(7.0 / 16.0));
  CHECK(s.allocated_blocks("again") == 2);
}

namespace {

// What a sequence holding `tokens` (its prompt the first `prompt` of them) ends as alone.
std::vector<std::int64_t> extend(std::vector<std::int64_t> tokens, std::size_t prompt, std::size_t max_new) {
  while (tokens.size() - prompt < max_new) tokens.push_back(next_token(tokens));
  return tokens;
}

// Steps until the request has `cached` tokens in the cache.
void run_until(Cache& cache, Scheduler& s, std::int64_t layers, Run& run, const std::string& id, std::int64_t cached) {
  while (s.request(id).position_offset < cached) REQUIRE(step(cache, s, layers, run));
}

std::int64_t block_at(const Cache& cache, const std::string& id, std::size_t i) {
  return cache.block_table(0, id).at(i);
}

}  // namespace

TEST_CASE("sequence operations: seq_rm rolls a request back, seq_cp copies one, each exact") {
  kvc::ContinuousBatchingConfig cb = small(60, 32);
  Cache cache(model({"full_attention", "full_attention"}), cb);
  Scheduler s(cache, cb);
  std::vector<std::int64_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
  s.add_request({.request_id = "r0", .prompt = prompt, .max_new_tokens = 12});
  Run run;
  run_until(cache, s, 2, run, "r0", 14);
  CHECK(s.seq_pos_min("r0") == 0);
  CHECK(s.seq_pos_max("r0") == 13);
  const std::vector<std::int64_t> at_copy = s.request("r0").tokens;  // 15 tokens, the last not cached
  // A copy shares the three complete blocks and copies the fourth.
  CHECK(s.seq_cp("r0", "c", -1, -1));
  CHECK(block_at(cache, "c", 1) == block_at(cache, "r0", 1));
  CHECK(s.seq_pos_max("c") == 13);
  // A hole cannot be made; a suffix can. Cutting into the prompt at 6: 5 tokens stay cached, and
  // the block holding positions 4..7, shared with c, is copied before r0 writes into it.
  CHECK_FALSE(s.seq_rm("r0", 3, 7));
  CHECK(s.request("r0").tokens == at_copy);
  CHECK(s.seq_rm("r0", 6, -1));
  CHECK(s.seq_pos_max("r0") == 4);
  CHECK(s.request("r0").prompt_length == 6);
  CHECK(s.request("r0").status == kvc::RequestStatus::prefilling);
  CHECK(block_at(cache, "r0", 0) == block_at(cache, "c", 0));
  CHECK(block_at(cache, "r0", 1) != block_at(cache, "c", 1));
  CHECK(cache.blocks_in_group(0, "r0") == 2);
  // A copy of the first 4 tokens: a fork of r0 cut at 4, which keeps 3 tokens cached in block 0,
  // shared with r0 and c, so d gets a copy of it.
  CHECK(s.seq_cp("r0", "d", 0, 4));
  CHECK(s.request("d").tokens == std::vector<std::int64_t>(prompt.begin(), prompt.begin() + 4));
  CHECK(block_at(cache, "d", 0) != block_at(cache, "r0", 0));
  CHECK_FALSE(s.seq_cp("r0", "e", 2, -1));
  CHECK(s.seq_add("r0", 0, -1, 0));
  CHECK_THROWS_WITH_AS(s.seq_add("r0", 2, -1, -2),
                       "kvc::ContinuousBatchingScheduler::seq_add: positions cannot shift: a paged request's "
                       "positions are its slots in the block tables and its cached keys carry their rotary position "
                       "(kvc does not re-rotate them); remove the suffix with seq_rm and let the request compute it "
                       "again",
                       kvc::ValueError);
  while (step(cache, s, 2, run)) {
  }
  const auto tokens = [&](const std::string& id) { return run.ended.at(id).tokens; };
  CHECK(tokens("r0") == extend({prompt.begin(), prompt.begin() + 6}, 6, 12));
  CHECK(tokens("c") == extend(at_copy, 10, 12));
  CHECK(tokens("d") == extend({prompt.begin(), prompt.begin() + 4}, 4, 12));
  CHECK(tokens("r0") != tokens("c"));
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
}

TEST_CASE("sequence operations: a cut inside the last block of the table copies it when it is shared") {
  kvc::ContinuousBatchingConfig cb = small(30, 32);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "a", .prompt = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, .max_new_tokens = 4});
  Run run;
  run_until(cache, s, 1, run, "a", 12);  // three complete blocks
  REQUIRE(cache.blocks_in_group(0, "a") == 3);
  CHECK(s.seq_cp("a", "b", 0, -1));
  CHECK(block_at(cache, "b", 2) == block_at(cache, "a", 2));
  CHECK(s.seq_rm("a", 11, -1));  // keeps 10 cached: block 2 is the last one a holds, and b's too
  CHECK(cache.blocks_in_group(0, "a") == 3);
  CHECK(block_at(cache, "a", 2) != block_at(cache, "b", 2));
  CHECK(block_at(cache, "a", 1) == block_at(cache, "b", 1));
  while (step(cache, s, 1, run)) {
  }
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
}

TEST_CASE("sequence operations: a wrapped sliding window is computed again; bounds; seq_keep") {
  kvc::ContinuousBatchingConfig cb = small(60, 32);
  const std::vector<std::string> types = {"full_attention", "sliding_attention"};
  Cache cache(model(types, 6), cb);
  Scheduler s(cache, cb);
  const std::vector<std::int64_t> prompt = {7, 7, 1, 2, 8};
  s.add_request({.request_id = "a", .prompt = prompt, .max_new_tokens = 10});
  s.add_request({.request_id = "b", .prompt = {1, 2, 3}, .max_new_tokens = 10});
  s.add_request({.request_id = "c", .prompt = {4}, .max_new_tokens = 10});
  CHECK(s.seq_pos_min("a") == -1);
  CHECK(s.seq_pos_max("a") == -1);
  Run run;
  run_until(cache, s, 2, run, "a", 9);
  CHECK(s.seq_pos_min("a") == 3);  // the window of 6 ends at position 8
  CHECK(s.seq_pos_max("a") == 8);
  // Positions 0..5 of the ring were overwritten: the 7 tokens kept are prefilled again.
  CHECK(s.seq_rm("a", 7, -1));
  CHECK(s.seq_pos_max("a") == -1);
  CHECK(s.request("a").remaining_prefill_tokens().size() == 7);
  CHECK(cache.blocks_in_use("a") == 0);
  const std::vector<std::int64_t> kept = s.request("a").tokens;
  // b alone is kept.
  s.seq_keep("b");
  CHECK(s.num_active() + s.num_waiting() == 1);
  while (step(cache, s, 2, run)) {
  }
  CHECK(run.ended.at("b").tokens == extend({1, 2, 3}, 3, 10));
  CHECK(run.ended.at("a").status == kvc::RequestStatus::failed);
  CHECK(run.ended.at("a").error == "kvc::ContinuousBatchingScheduler: request a removed by seq_keep");
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());

  // The same request kept this time: it ends as it would alone from its 7 tokens.
  Scheduler s2(cache, cb);
  s2.add_request({.request_id = "a", .prompt = prompt, .max_new_tokens = 10});
  Run run2;
  run_until(cache, s2, 2, run2, "a", 9);
  CHECK(s2.seq_rm("a", 7, -1));
  while (step(cache, s2, 2, run2)) {
  }
  CHECK(run2.ended.at("a").tokens == extend(kept, 5, 10));
}

TEST_CASE("sequence operations: refusals, and removing a whole request") {
  kvc::ContinuousBatchingConfig cb = small(30, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "a", .prompt = {1, 2, 3}, .max_new_tokens = 1});
  s.add_request({.request_id = "b", .prompt = {1, 2, 3}, .max_new_tokens = 5});
  auto batch = s.schedule();
  CHECK_THROWS_WITH_AS(s.seq_rm("a", 1, -1),
                       "kvc::ContinuousBatchingScheduler::seq_rm: the last batch is still in flight; pass it to "
                       "update() first",
                       kvc::ValueError);
  s.update(*batch, std::vector<std::int64_t>{4, 4});
  CHECK(s.request("a").status == kvc::RequestStatus::finished);
  CHECK_THROWS_WITH_AS(s.seq_pos_max("zz"), "kvc::ContinuousBatchingScheduler: no request 'zz'", kvc::KeyError);
  CHECK_THROWS_WITH_AS(s.seq_rm("a", 1, -1), "kvc::ContinuousBatchingScheduler::seq_rm: request 'a' has ended",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.seq_cp("b", "a", 0, -1),
                       "kvc::ContinuousBatchingScheduler::seq_cp: request 'a' is already known, or names a child "
                       "sequence (__child#)",
                       kvc::ValueError);
  CHECK(s.seq_rm("b", 5, 9));  // nothing there
  CHECK(s.seq_rm("b", -1, -1));
  CHECK(s.request("b").status == kvc::RequestStatus::failed);
  CHECK(s.request("b").error == "kvc::ContinuousBatchingScheduler: request b removed by seq_rm");
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
  CHECK_FALSE(s.schedule());
  CHECK_THROWS_WITH_AS(cache.truncate_request("b", -1),
                       "kvc::PagedCache::truncate_request: tokens must be >= 0, got -1", kvc::ValueError);
}

TEST_CASE("scheduler: a parent's id is refused while its children are still known") {
  kvc::ContinuousBatchingConfig cb = small(20, 1);  // one token a step: the child waits for "a"
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  const std::int64_t eos = alone({5}, 1, std::nullopt)[0];
  s.add_request(
      {.request_id = "a", .prompt = {5}, .max_new_tokens = 4, .eos_token_id = eos, .num_return_sequences = 2});
  Run run;
  while (!run.ended.count("a")) REQUIRE(step(cache, s, 1, run));  // step() takes what finished
  REQUIRE(s.request("a__child#0").status == kvc::RequestStatus::pending);
  const std::string refused =
      "request 'a' still has child sequences (a__child#...) in the scheduler; the id can be "
      "used again once take_finished() has returned them";
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "a", .prompt = {5}}),
                       ("kvc::ContinuousBatchingScheduler::add_request: " + refused).c_str(), kvc::ValueError);
  CHECK(s.num_waiting() + s.num_active() == 1);
  while (step(cache, s, 1, run)) {
  }
  CHECK(run.ended.at("a__child#0").generated().size() == 1);
  // Every child returned: the id is free again, and the new "a" forks children of its own.
  s.add_request({.request_id = "a", .prompt = {5, 6, 7}, .max_new_tokens = 3, .num_return_sequences = 2});
  run.ended.clear();
  while (step(cache, s, 1, run)) {
  }
  const auto expected = extend({5, 6, 7}, 3, 3);
  CHECK(run.ended.at("a").tokens == expected);
  CHECK(run.ended.at("a__child#0").tokens == expected);
  CHECK(s.stats().forks == 1);
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
}

TEST_CASE("scheduler: a forked parent's id is refused until its child is taken, in add_request and seq_cp") {
  kvc::ContinuousBatchingConfig cb = small(20, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({.request_id = "a", .prompt = {1, 2, 3, 4, 5}, .max_new_tokens = 6, .num_return_sequences = 2});
  s.add_request({.request_id = "b", .prompt = {9, 9}, .max_new_tokens = 6});
  Run run;
  run_until(cache, s, 1, run, "a", 5);  // forked after 4
  s.cancel_request("a");
  CHECK(s.take_finished().size() == 1);
  CHECK_THROWS_WITH_AS(s.add_request({.request_id = "a", .prompt = {1, 2, 3, 4, 5}, .num_return_sequences = 2}),
                       "kvc::ContinuousBatchingScheduler::add_request: request 'a' still has child sequences "
                       "(a__child#...) in the scheduler; the id can be used again once take_finished() has returned "
                       "them",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(s.seq_cp("b", "a", 0, -1),
                       "kvc::ContinuousBatchingScheduler::seq_cp: request 'a' still has child sequences "
                       "(a__child#...) in the scheduler; the id can be used again once take_finished() has returned "
                       "them",
                       kvc::ValueError);
  while (step(cache, s, 1, run)) {
  }
  CHECK(run.ended.at("a__child#0").tokens == extend({1, 2, 3, 4, 5}, 5, 6));
  CHECK(run.ended.at("b").tokens == extend({9, 9}, 2, 6));
}

TEST_CASE("sequence operations: seq_rm before the fork keeps the sequences still to fork") {
  kvc::ContinuousBatchingConfig cb = small(20, 2);
  Cache cache(model({"full_attention"}), cb);
  Scheduler s(cache, cb);
  s.add_request({"p", {1, 2, 3, 4, 5, 6}, 3, std::nullopt, 3});
  Run run;
  REQUIRE(step(cache, s, 1, run));
  REQUIRE(s.request("p").position_offset == 2);
  CHECK(s.seq_rm("p", 1, -1));  // a one-token prompt: nothing cached to fork from
  while (step(cache, s, 1, run)) {
  }
  const auto expected = extend({1}, 1, 3);
  for (const std::string id : {"p", "p__child#0", "p__child#1"}) CHECK(run.ended.at(id).tokens == expected);

  // Cut to three tokens: the children fork from the two cached ones.
  Scheduler s2(cache, cb);
  s2.add_request({"q", {1, 2, 3, 4, 5, 6}, 3, std::nullopt, 3});
  Run run2;
  REQUIRE(step(cache, s2, 1, run2));
  REQUIRE(step(cache, s2, 1, run2));
  CHECK(s2.seq_rm("q", 3, -1));
  while (step(cache, s2, 1, run2)) {
  }
  const auto expected2 = extend({1, 2, 3}, 3, 3);
  for (const std::string id : {"q", "q__child#0", "q__child#1"}) CHECK(run2.ended.at(id).tokens == expected2);
  CHECK(s2.stats().forks == 2);
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
}

TEST_CASE("ContinuousBatchingScheduler: request handles") {
  kvc::ContinuousBatchingConfig cb = small(20, 16);
  Cache cache(model({"full_attention"}), cb);
  Scheduler scheduler(cache, cb);
  // [snippet:request_handles]
  const kvc::RequestHandle a = scheduler.add_request({"a", {1, 2, 3}, 2});
  CHECK(scheduler.handle("a") == a);
  CHECK(scheduler.request(a).request_id == "a");
  scheduler.cancel_request(a);
  CHECK(scheduler.take_finished().front().handle == a);
  const kvc::RequestHandle b = scheduler.add_request({"b", {4, 5}, 2});
  CHECK(b.slot == a.slot);  // a's slot, under the next generation
  CHECK_THROWS_AS((void)scheduler.request(a), kvc::KeyError);
  // [/snippet]
  CHECK(b.generation == a.generation + 1);
  CHECK(!scheduler.find("a"));
  CHECK(scheduler.find("b") == b);

  // Every call by handle refuses a handle whose request has left, word for word.
  const std::string stale = "kvc::ContinuousBatchingScheduler: no request with handle " + std::to_string(a.slot) + "." +
                            std::to_string(a.generation) + " (it has left, or was never added)";
  CHECK_THROWS_WITH_AS(scheduler.cancel_request(a), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.seq_rm(a, 1, -1), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.seq_cp(a, "x", 0, -1), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS(scheduler.seq_keep(a), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.seq_add(a, 0, -1, 0), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.seq_pos_max(a), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.allocated_blocks(a), stale.c_str(), kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)scheduler.request(kvc::RequestHandle{}),
                       "kvc::ContinuousBatchingScheduler: no request with handle 4294967295.0 (it has left, or was "
                       "never added)",
                       kvc::KeyError);
  scheduler.cancel_request(b);
  (void)scheduler.take_finished();

  // A fork's children have handles of their own, and the same run by handles and by ids ends the
  // same: the sequence operations are one operation under two keys.
  Cache other_cache(model({"full_attention"}), cb);
  Scheduler by_id(other_cache, cb);
  const kvc::RequestHandle p = scheduler.add_request({"p", {1, 2, 3, 4, 5, 6}, 4, std::nullopt, 3});
  by_id.add_request({"p", {1, 2, 3, 4, 5, 6}, 4, std::nullopt, 3});
  const auto step = [](Scheduler& s) {
    auto batch = s.schedule();
    REQUIRE(batch);
    std::vector<std::int64_t> next;
    for (const kvc::ScheduledRequest& r : batch->requests) {
      CHECK(s.request(r.handle).request_id == r.request_id);
      if (r.has_new_token) next.push_back(7 + static_cast<std::int64_t>(next.size()));
    }
    s.update(*batch, next);
  };
  step(scheduler);
  step(by_id);
  const kvc::RequestHandle child = scheduler.handle("p__child#0");
  CHECK(child.slot != p.slot);
  CHECK(scheduler.request(child).handle == child);
  CHECK(scheduler.seq_cp(p, "q", 0, -1));
  CHECK(by_id.seq_cp("p", "q", 0, -1));
  CHECK(scheduler.seq_rm(child, 4, -1));
  CHECK(by_id.seq_rm("p__child#0", 4, -1));
  CHECK(scheduler.seq_pos_max(child) == by_id.seq_pos_max("p__child#0"));
  CHECK(scheduler.allocated_blocks(child) == by_id.allocated_blocks("p__child#0"));
  scheduler.seq_keep(scheduler.handle("q"));
  by_id.seq_keep("q");
  while (scheduler.has_unfinished_requests()) step(scheduler);
  while (by_id.has_unfinished_requests()) step(by_id);
  const auto ended = scheduler.take_finished(), ended_by_id = by_id.take_finished();
  REQUIRE(ended.size() == ended_by_id.size());
  for (std::size_t i = 0; i < ended.size(); ++i) {
    CHECK(ended[i].request_id == ended_by_id[i].request_id);
    CHECK(ended[i].tokens == ended_by_id[i].tokens);
    CHECK(ended[i].status == ended_by_id[i].status);
  }

  // Slots are used again: many requests one after the other keep as many slots as were ever held
  // at once.
  for (int i = 0; i < 50; ++i) {
    const kvc::RequestHandle h = scheduler.add_request({"r" + std::to_string(i), {1, 2}, 1});
    CHECK(h.slot < 4);
    scheduler.cancel_request(h);
    (void)scheduler.take_finished();
  }
}

TEST_CASE("scheduler: a hybrid model's prompts resume from state snapshots, reported per request") {
  // Linear-attention and full layers; snapshots every 8 tokens (two blocks).
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  cb.max_batch_tokens = 10;
  cb.state_snapshot_interval = 8;
  Cache cache(model({"linear_attention", "full_attention"}), cb);
  Scheduler s(cache, cb);
  std::vector<std::int64_t> prompt_a;
  for (std::int64_t t = 0; t < 13; ++t) prompt_a.push_back(t + 1);
  kvc::GenerationRequest a;
  a.request_id = "a";
  a.prompt = prompt_a;
  a.max_new_tokens = 3;
  (void)s.add_request(a);
  // a's first chunk ends at the boundary 8, not at the budget's 10; its states there are kept.
  auto batch = s.schedule();
  REQUIRE(batch);
  CHECK(batch->requests[0].query_length == 8);
  kvc_toy::write_batch(cache, s, *batch, 2);
  s.update(*batch, kvc_toy::next_tokens(s, *batch));
  CHECK(cache.num_state_snapshots() == 1);
  CHECK(s.request("a").prefix_match.tokens == 0);
  // b shares a's first 11 tokens: it resumes from 8, with a's states there.
  kvc::GenerationRequest b = a;
  b.request_id = "b";
  b.prompt.resize(11);
  b.prompt.insert(b.prompt.end(), {30, 31, 32});
  (void)s.add_request(b);
  std::vector<kvc::RequestState> done;
  while (auto next = s.schedule()) {
    kvc_toy::write_batch(cache, s, *next, 2);
    s.update(*next, kvc_toy::next_tokens(s, *next));
    for (const std::string id : {"a", "b"}) {
      if (std::any_of(done.begin(), done.end(), [&](const auto& d) { return d.request_id == id; })) continue;
      if (!s.request(id).is_active()) continue;
      const kvc::RequestState& st = s.request(id);
      CHECK(kvc_toy::wrong_row(cache, id, st.tokens, st.position_offset, 2) == "");
      CHECK(kvc_toy::wrong_state(cache, id, st.tokens, st.position_offset) == "");
    }
    for (auto& st : s.take_finished()) done.push_back(std::move(st));
  }
  REQUIRE(done.size() == 2);
  const kvc::RequestState& got = done[0].request_id == "b" ? done[0] : done[1];
  CHECK(got.prefix_match.attention_tokens == 8);
  CHECK(got.prefix_match.state_tokens == 8);
  CHECK(got.prefix_match.tokens == 8);
  CHECK(s.stats().prefix_hit_tokens == 8);
  CHECK(std::vector<std::int64_t>(got.generated().begin(), got.generated().end()) == alone(b.prompt, 3, std::nullopt));
}

TEST_CASE("scheduler: seq_rm on a hybrid request prefills again from its last snapshot, not from 0") {
  // A hybrid request's states cannot be cut back: seq_rm drops its cache. Its next pass looks for
  // its prefix in the cache again and finds its own blocks and the snapshot its prompt left at 12.
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  cb.max_batch_tokens = 20;
  cb.state_snapshot_interval = 4;
  Cache cache(model({"linear_attention", "full_attention"}), cb);
  Scheduler s(cache, cb);
  kvc::GenerationRequest a;
  a.request_id = "a";
  for (std::int64_t t = 0; t < 13; ++t) a.prompt.push_back(t + 1);
  a.max_new_tokens = 8;
  (void)s.add_request(a);
  const auto run = [&] {
    auto batch = s.schedule();
    REQUIRE(batch);
    kvc_toy::write_batch(cache, s, *batch, 2);
    s.update(*batch, kvc_toy::next_tokens(s, *batch));
    if (s.request("a").is_active()) {
      const kvc::RequestState& st = s.request("a");
      CHECK(kvc_toy::wrong_row(cache, "a", st.tokens, st.position_offset, 2) == "");
      CHECK(kvc_toy::wrong_state(cache, "a", st.tokens, st.position_offset) == "");
    }
  };
  while (s.request("a").generated().size() < 4) run();  // [0, 12), [12, 13), then decode steps
  CHECK(cache.num_state_snapshots() >= 1);
  const std::int64_t hits = s.stats().prefix_hit_tokens;
  REQUIRE(s.seq_rm("a", 16, -1));  // 13 prompt tokens and 3 generated stay
  CHECK(s.request("a").position_offset == 0);
  REQUIRE(s.seq_rm("a", 15, -1));  // a second cut before the next pass: 2 generated stay
  CHECK(s.request("a").tokens.size() == 15);
  run();
  const kvc::RequestState& st = s.request("a");
  CHECK(st.prefix_match.attention_tokens == 12);
  CHECK(st.prefix_match.state_tokens == 12);
  CHECK(st.prefix_match.tokens == 12);
  CHECK(s.stats().prefix_hit_tokens == hits + 12);
  while (!s.request("a").has_ended()) run();
  const std::vector<kvc::RequestState> done = s.take_finished();
  REQUIRE(done.size() == 1);
  CHECK(std::vector<std::int64_t>(done[0].generated().begin(), done[0].generated().end()) ==
        alone(a.prompt, 8, std::nullopt));
}

TEST_CASE("scheduler: a prompt that shares cached blocks but no snapshot stops at the shared boundary") {
  // Snapshots every block (4 tokens). a runs its 11 tokens as [0, 8) and [8, 11): a snapshot at 8
  // only. b shares a's first 6 tokens: one cached block, no snapshot there, so b computes from 0,
  // but stops at 4, the boundary it shares with a; c, sharing the same 6 tokens, resumes there.
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  cb.max_batch_tokens = 20;
  cb.state_snapshot_interval = 4;
  Cache cache(model({"linear_attention", "full_attention"}), cb);
  Scheduler s(cache, cb);
  const auto add = [&](const std::string& id, std::vector<std::int64_t> prompt) {
    kvc::GenerationRequest r;
    r.request_id = id;
    r.prompt = std::move(prompt);
    r.max_new_tokens = 2;
    (void)s.add_request(r);
  };
  std::vector<kvc::RequestState> done;
  std::map<std::string, std::vector<std::int64_t>> chunks;
  const auto run_all = [&] {
    while (auto next = s.schedule()) {
      for (const kvc::ScheduledRequest& r : next->requests)
        if (!r.has_new_token || r.past + r.query_length < s.request(r.request_id).prompt_length)
          chunks[r.request_id].push_back(r.query_length);
      kvc_toy::write_batch(cache, s, *next, 2);
      s.update(*next, kvc_toy::next_tokens(s, *next));
      for (auto& st : s.take_finished()) done.push_back(std::move(st));
    }
  };
  add("a", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  run_all();
  add("b", {1, 2, 3, 4, 5, 6, 20, 21, 22, 23});
  run_all();
  add("c", {1, 2, 3, 4, 5, 6, 30, 31, 32});
  run_all();
  REQUIRE(done.size() == 3);
  CHECK(chunks["a"] == std::vector<std::int64_t>{8});  // then [8, 11): its last chunk gives a token
  CHECK(chunks["b"] == std::vector<std::int64_t>{4, 4});
  CHECK(done[1].prefix_match.attention_tokens == 4);
  CHECK(done[1].prefix_match.tokens == 0);
  CHECK(done[2].prefix_match.tokens == 4);
  for (const kvc::RequestState& st : done)
    CHECK(std::vector<std::int64_t>(st.generated().begin(), st.generated().end()) ==
          alone(std::vector<std::int64_t>(st.prompt().begin(), st.prompt().end()), 2, std::nullopt));
}

TEST_CASE("scheduler: a prompt resumed from a snapshot and offloaded in the same pass keeps its states") {
  // A matches W's snapshot at 8, starves and is offloaded, C fails (it cannot fit) and A is
  // restored, all in one schedule(): the copies chained in that pass must give A the snapshot.
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 8;
  cb.max_batch_tokens = 12;
  cb.scheduler_type = "prefill_first";
  cb.max_state_slots = 4;
  cb.state_snapshot_interval = 4;
  Cache cache(model({"linear_attention", "full_attention"}), cb);
  cache.reserve_swap_space(8);
  Scheduler s(cache, cb);
  const std::vector<std::int64_t> system = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<std::int64_t> w = system, c, a = system;
  w.push_back(9);
  for (std::int64_t i = 0; i < 40; ++i) c.push_back(20 + i % 17);
  for (std::int64_t i = 0; i < 12; ++i) a.push_back(30 + i);
  const auto add = [&](const char* id, const std::vector<std::int64_t>& prompt, std::int64_t n) {
    kvc::GenerationRequest r;
    r.request_id = id;
    r.prompt = prompt;
    r.max_new_tokens = n;
    (void)s.add_request(r);
  };
  const auto step = [&] {
    auto batch = s.schedule();
    if (!batch) return false;
    for (const kvc::ScheduledRequest& r : batch->requests) {
      CAPTURE(r.request_id);
      const kvc::RequestState& st = s.request(r.request_id);
      CHECK(kvc_toy::wrong_state(cache, r.request_id, st.tokens, r.past) == "");
    }
    kvc_toy::write_batch(cache, s, *batch, 2);
    s.update(*batch, kvc_toy::next_tokens(s, *batch));
    return true;
  };
  add("W", w, 1);
  add("C", c, 5);
  for (int i = 0; i < 3; ++i) (void)step();
  add("A", a, 3);
  bool resumed = false;
  for (int i = 0; i < 12 && step(); ++i) resumed = resumed || s.request("A").prefix_match.tokens == 8;
  CHECK(resumed);
  CHECK(s.stats().cpu_offloads >= 1);
}

namespace {

// The tokens a request generates next after `tokens`: the model's continuation, n of them.
std::vector<std::int64_t> continuation(std::vector<std::int64_t> tokens, std::size_t n) {
  const std::size_t from = tokens.size();
  while (tokens.size() - from < n) tokens.push_back(next_token(tokens));
  return {tokens.begin() + static_cast<std::ptrdiff_t>(from), tokens.end()};
}

// Runs `ids` to their end with draft tokens before every step: each request gets k drafts, the first `right` of them the model's own continuation and the rest wrong ones, (right
// and k cycling through the values), and after every step each request's rows and states are
// checked. Returns the ended requests.
std::map<std::string, kvc::RequestState> speculate(Cache& cache, Scheduler& s, std::int64_t layers,
                                                   const std::vector<std::string>& ids, Run& run) {
  std::int64_t turn = 0;
  for (;;) {
    for (const std::string& id : ids) {
      if (!s.find(id) || s.request(id).has_ended()) continue;
      const auto k = static_cast<std::size_t>(1 + turn % 4);
      const auto right = static_cast<std::size_t>(turn++ % 5);
      std::vector<std::int64_t> draft = continuation(s.request(id).tokens, k);  // after its last token
      for (std::size_t i = right; i < k; ++i) draft[i] = (draft[i] + 1 + static_cast<std::int64_t>(i)) % VOCAB;
      s.set_draft_tokens(id, draft);
      CHECK(std::vector<std::int64_t>(s.draft_tokens(id).begin(), s.draft_tokens(id).end()) == draft);
    }
    if (!step(cache, s, layers, run)) break;
    for (const std::string& id : ids) {
      if (!s.find(id) || !s.request(id).is_active()) continue;
      const kvc::RequestState& st = s.request(id);
      if (st.position_offset == 0) continue;  // dropped by the rollback: it prefills again
      CHECK(kvc_toy::wrong_row(cache, id, st.tokens, st.position_offset, layers) == "");
      CHECK(kvc_toy::wrong_state(cache, id, st.tokens, st.position_offset) == "");
    }
  }
  return run.ended;
}

}  // namespace

TEST_CASE("scheduler: draft tokens verified in one step, the rejected ones rolled back exactly") {
  // Full attention: the rejected drafts leave in place (their blocks are given back), and so do
  // linear-attention states with a ring of 4 steps (state_rollback_tokens). Sliding layers whose
  // ring wrapped, states without a ring or with a shorter one than the drafts rejected, cannot be
  // cut back: the request prefills its kept tokens again (from a state snapshot where the cache has one). Every layout generates what
  // each request generates alone.
  struct layout {
    std::vector<std::string> types;
    std::int64_t snapshot_interval, rollback;
    bool in_place;  // every rollback in place: nothing prefilled but the prompts
  };
  for (const layout& l : {layout{{"full_attention", "full_attention"}, 0, 0, true},
                          layout{{"sliding_attention", "full_attention"}, 0, 0, false},
                          layout{{"linear_attention", "full_attention"}, 4, 0, false},
                          layout{{"linear_attention", "full_attention"}, 4, 4, true},
                          layout{{"full_attention", "linear_attention"}, 0, 3, false},  // 4 drafts rejected
                          layout{{"full_attention", "linear_attention", "sliding_attention"}, 0, 4, false}}) {
    CAPTURE(l.types.front());
    CAPTURE(l.types.size());
    CAPTURE(l.rollback);
    kvc::ContinuousBatchingConfig cb = small(48, 24);
    cb.state_snapshot_interval = l.snapshot_interval;
    cb.state_rollback_tokens = l.rollback;
    Cache cache(model(l.types), cb);
    Scheduler s(cache, cb);
    std::vector<std::string> ids;
    std::map<std::string, std::vector<std::int64_t>> want;
    std::int64_t prompts = 0;
    for (std::int64_t i = 0; i < 3; ++i) {
      kvc::GenerationRequest r;
      r.request_id = "r" + std::to_string(i);
      for (std::int64_t t = 0; t < 5 + 3 * i; ++t) r.prompt.push_back((7 * t + i) % VOCAB);
      r.max_new_tokens = 18 + i;
      if (i == 2) r.eos_token_id = alone(r.prompt, r.max_new_tokens, std::nullopt).at(12);
      want[r.request_id] = alone(r.prompt, r.max_new_tokens, r.eos_token_id);
      prompts += std::ssize(r.prompt);
      ids.push_back(r.request_id);
      (void)s.add_request(r);
    }
    Run run;
    const auto ended = speculate(cache, s, static_cast<std::int64_t>(l.types.size()), ids, run);
    for (const std::string& id : ids) {
      CAPTURE(id);
      REQUIRE(ended.count(id) == 1);
      const kvc::RequestState& st = ended.at(id);
      CHECK(st.status == kvc::RequestStatus::finished);
      CHECK(std::vector<std::int64_t>(st.generated().begin(), st.generated().end()) == want.at(id));
    }
    const kvc::SchedulerStats& t = s.stats();
    CHECK(t.draft_tokens > 20);
    CHECK(t.accepted_draft_tokens > 5);
    CHECK(t.accepted_draft_tokens < t.draft_tokens);
    CHECK(t.draft_acceptance_rate() ==
          static_cast<double>(t.accepted_draft_tokens) / static_cast<double>(t.draft_tokens));
    // Fewer steps than one token per step needs: 18 + 19 + 13 generated tokens.
    CHECK(t.steps < 18 + 1 + 3);
    if (l.in_place)
      CHECK(t.prefill_tokens == prompts);
    else
      CHECK(t.prefill_tokens > prompts);
    CHECK(cache.get_num_free_blocks() == cache.num_blocks());
  }
}

TEST_CASE("scheduler: a step with draft tokens, what update keeps and what it gives back") {
  kvc::ContinuousBatchingConfig cb = small(32, 32);
  Cache cache(model({"full_attention", "full_attention"}), cb);
  Scheduler s(cache, cb);
  const std::vector<std::int64_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  const kvc::RequestHandle h = s.add_request({.request_id = "a", .prompt = prompt, .max_new_tokens = 8});
  Run run;
  REQUIRE(step(cache, s, 2, run));  // the prompt; one token generated
  REQUIRE(s.request(h).status == kvc::RequestStatus::decoding);
  CHECK_THROWS_WITH_AS(s.set_draft_tokens("a", std::vector<std::int64_t>{1, -2}),
                       "kvc::ContinuousBatchingScheduler::set_draft_tokens: token -2 is outside [0, 2^31)",
                       kvc::ValueError);
  CHECK(s.draft_tokens(h).empty());
  // Drafts: the model's next two tokens, then a wrong one, then one more.
  const std::vector<std::int64_t> truth = continuation(s.request(h).tokens, 4);
  std::vector<std::int64_t> draft = {truth[0], truth[1], (truth[2] + 1) % VOCAB, truth[3]};
  s.set_draft_tokens(h, draft);
  s.set_draft_tokens(h, {});  // withdrawn
  CHECK(s.draft_tokens(h).empty());
  s.set_draft_tokens(h, draft);
  auto batch = s.schedule();
  REQUIRE(batch);
  REQUIRE(batch->requests.size() == 1);
  CHECK(batch->requests[0].query_length == 5);
  CHECK(batch->requests[0].draft_tokens == draft);
  CHECK(batch->logits_indices == std::vector<std::int64_t>{0, 1, 2, 3, 4});
  CHECK(std::vector<std::int64_t>(batch->input_ids.begin() + 1, batch->input_ids.end()) == draft);
  CHECK(batch->position_ids == std::vector<std::int64_t>{8, 9, 10, 11, 12});
  CHECK(s.draft_tokens(h).empty());                                // the step took them
  CHECK(s.request(h).position_offset == 9);                        // the drafts count once update keeps them
  CHECK(cache.blocks_in_group(0, "a") == 4);                       // rows for all 13 positions
  CHECK_THROWS_AS(s.set_draft_tokens(h, draft), kvc::ValueError);  // in flight
  kvc_toy::write_batch(cache, s, *batch, 2);
  const std::vector<std::int64_t> next = kvc_toy::next_tokens(s, *batch);
  REQUIRE(next.size() == 5);
  CHECK(std::vector<std::int64_t>(next.begin(), next.begin() + 3) ==
        std::vector<std::int64_t>(truth.begin(), truth.begin() + 3));
  CHECK_THROWS_AS(s.update(*batch, std::span(next).first(1)), kvc::ValueError);  // one token per row
  kvc::ScheduledBatch changed = *batch;  // its drafts no longer add up to its logits rows
  changed.requests[0].draft_tokens.pop_back();
  CHECK_THROWS_WITH_AS(s.update(changed, next),
                       "kvc::ContinuousBatchingScheduler::update: this is not the batch schedule() returned last",
                       kvc::ValueError);
  s.update(*batch, next);
  // Two drafts kept, the model's third choice generated: 3 new tokens, 11 positions cached.
  const kvc::RequestState& st = s.request(h);
  CHECK(std::vector<std::int64_t>(st.generated().begin() + 1, st.generated().end()) ==
        std::vector<std::int64_t>(truth.begin(), truth.begin() + 3));
  CHECK(st.position_offset == 11);
  CHECK(cache.blocks_in_group(0, "a") == 3);  // the block of positions 12.. is given back
  CHECK(kvc_toy::wrong_row(cache, "a", st.tokens, st.position_offset, 2) == "");
  CHECK(s.stats().draft_tokens == 4);
  CHECK(s.stats().accepted_draft_tokens == 2);
  // Drafts past max_new_tokens are not run: 4 generated, 4 left, so at most 3 drafts ride along.
  s.set_draft_tokens(h, std::vector<std::int64_t>{1, 2, 3, 4, 5, 6});
  batch = s.schedule();
  REQUIRE(batch);
  CHECK(batch->requests[0].draft_tokens == std::vector<std::int64_t>{1, 2, 3});
  kvc_toy::write_batch(cache, s, *batch, 2);
  s.update(*batch, kvc_toy::next_tokens(s, *batch));
  while (step(cache, s, 2, run)) {
  }
  REQUIRE(run.ended.count("a") == 1);
  CHECK(std::vector<std::int64_t>(run.ended.at("a").generated().begin(), run.ended.at("a").generated().end()) ==
        alone(prompt, 8, std::nullopt));
  CHECK_THROWS_AS(s.set_draft_tokens(h, draft), kvc::KeyError);  // it has left
  CHECK(cache.get_num_free_blocks() == cache.num_blocks());
  // Drafts set before the prompt runs ride along its last token: both right ones are kept, and
  // the step generates three tokens. The prompt is found whole in the cache (a's blocks): its last
  // token runs again in a complete block, and the drafts go into the next one.
  const kvc::RequestHandle b = s.add_request({.request_id = "b", .prompt = prompt, .max_new_tokens = 8});
  const std::vector<std::int64_t> first = alone(prompt, 3, std::nullopt);
  s.set_draft_tokens(b, std::span(first).first(2));
  batch = s.schedule();
  REQUIRE(batch);
  CHECK(batch->requests[0].past == 7);
  CHECK(batch->requests[0].query_length == 3);
  CHECK(batch->logits_indices == std::vector<std::int64_t>{0, 1, 2});
  kvc_toy::write_batch(cache, s, *batch, 2);
  s.update(*batch, kvc_toy::next_tokens(s, *batch));
  CHECK(std::vector<std::int64_t>(s.request(b).generated().begin(), s.request(b).generated().end()) == first);
  CHECK(s.request(b).position_offset == 10);
  CHECK(kvc_toy::wrong_row(cache, "b", s.request(b).tokens, 10, 2) == "");
  s.cancel_request(b);
  CHECK_THROWS_WITH_AS(s.set_draft_tokens(b, draft),
                       "kvc::ContinuousBatchingScheduler::set_draft_tokens: request 'b' has ended", kvc::ValueError);
}

TEST_CASE("scheduler: draft tokens never cost a request its blocks, its hashes or its snapshot") {
  Run run;
  SUBCASE("drafts whose blocks do not fit run without them") {
    // 16 rows; a 13-token prompt with 4 drafts needs 17: the step runs the prompt alone.
    kvc::ContinuousBatchingConfig cb = small(4, 32);
    Cache cache(model({"full_attention", "full_attention"}), cb);
    Scheduler s(cache, cb);
    std::vector<std::int64_t> prompt;
    for (std::int64_t t = 0; t < 13; ++t) prompt.push_back((5 * t + 1) % VOCAB);
    const std::vector<std::int64_t> want = alone(prompt, 10, std::nullopt);
    (void)s.add_request({.request_id = "a", .prompt = prompt, .max_new_tokens = 10, .eos_token_id = want[1]});
    s.set_draft_tokens("a", std::vector<std::int64_t>{1, 2, 3, 4});
    auto batch = s.schedule();
    REQUIRE(batch);
    CHECK(batch->requests[0].draft_tokens.empty());
    CHECK(batch->requests[0].query_length == 13);
    kvc_toy::write_batch(cache, s, *batch, 2);
    s.update(*batch, kvc_toy::next_tokens(s, *batch));
    while (step(cache, s, 2, run)) {
    }
    REQUIRE(run.ended.count("a") == 1);
    CHECK(run.ended.at("a").status == kvc::RequestStatus::finished);
    CHECK(std::vector<std::int64_t>(run.ended.at("a").generated().begin(), run.ended.at("a").generated().end()) ==
          std::vector<std::int64_t>(want.begin(), want.begin() + 2));
  }
  SUBCASE("a request restored from the swap pool in a step with drafts hashes its restored blocks") {
    kvc::ContinuousBatchingConfig cb = small(8, 64);
    cb.safety_margin = 0.0;
    Cache cache(model({"full_attention", "full_attention"}), cb);
    cache.reserve_swap_space(8);
    Scheduler s(cache, cb);
    std::vector<std::int64_t> pa, pb;
    for (std::int64_t t = 0; t < 12; ++t) {
      pa.push_back((5 * t + 1) % VOCAB);
      pb.push_back((3 * t + 2) % VOCAB);
    }
    (void)s.add_request({.request_id = "a", .prompt = pa, .max_new_tokens = 30});
    (void)s.add_request({.request_id = "b", .prompt = pb, .max_new_tokens = 30});
    while (!cache.is_offloaded("b")) REQUIRE(step(cache, s, 2, run));
    s.cancel_request("a");
    s.set_draft_tokens("b", continuation(s.request("b").tokens, 2));
    REQUIRE(step(cache, s, 2, run));
    CHECK(s.stats().restores == 1);
    const kvc::RequestState& st = s.request("b");
    std::int64_t hashed = 0;
    for (const std::int64_t b : cache.block_table(0, "b")) hashed += cache.manager().block(b)->is_complete() ? 1 : 0;
    CHECK(hashed == st.position_offset / cache.block_size());
  }
  SUBCASE("a hybrid prompt's last chunk on a snapshot boundary runs without drafts") {
    kvc::ContinuousBatchingConfig cb = small(48, 64);
    cb.state_snapshot_interval = 4;
    Cache cache(model({"linear_attention", "full_attention"}), cb);
    Scheduler s(cache, cb);
    std::vector<std::int64_t> prompt;
    for (std::int64_t t = 0; t < 12; ++t) prompt.push_back((5 * t + 1) % VOCAB);
    (void)s.add_request({.request_id = "a", .prompt = prompt, .max_new_tokens = 6});
    s.set_draft_tokens("a", continuation(prompt, 3));
    REQUIRE(step(cache, s, 2, run));
    CHECK(cache.num_state_snapshots() == 1);
    CHECK(s.draft_tokens("a").empty());  // taken: they guessed what the step generated
    std::vector<std::int64_t> longer = prompt;
    longer.push_back(7);
    (void)s.add_request({.request_id = "b", .prompt = longer, .max_new_tokens = 2});
    while (step(cache, s, 2, run)) {
    }
    CHECK(run.ended.at("b").prefix_match.state_tokens == 12);
    CHECK(std::vector<std::int64_t>(run.ended.at("a").generated().begin(), run.ended.at("a").generated().end()) ==
          alone(prompt, 6, std::nullopt));
  }
}

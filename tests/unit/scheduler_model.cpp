// Model-checked random operation sequences over kvc::ContinuousBatchingScheduler and its
// kvc::PagedCache (tests/support/scheduler_model.hpp: what is drawn, what is checked after every
// operation). Each seed is one run: a layout (full, full + sliding, all sliding, and two with
// linear-attention layers: with state snapshots, and with a sliding group), a small pool,
// block sharing on or off, either schedule order, a swap pool of 0 to 9 blocks, then up to 400
// operations and every request to its end. The fuzz target runs the same model on its inputs
// (mode 'M', tests/fuzz/fuzz_kvc.cpp).

#include <cstdint>
#include <string>
#include <string_view>

#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"
#include "../support/scheduler_model.hpp"

TEST_CASE("scheduler model: random operation sequences keep every invariant") {
  // (The paged cache warns, as transformers does, when a request without blocks in a group is
  // freed there; expected here.)
  const auto previous = kvc::set_warning_handler([](std::string_view) {});
  kvc_model::counts total;
  // Under the sanitizers (where this is one of the slowest tests), the first half of the sequences:
  // the g++ build runs all of them, natively and under valgrind. The floors below are for 100.
  const std::uint64_t sequences = kvc_test::sanitized ? 100 : 200;
  for (std::uint64_t seed = 0; seed < sequences; ++seed) {
    CAPTURE(seed);
    kvc_model::source src(seed, 700);
    try {
      const kvc_model::counts c = kvc_model::run(src).go();
      total.operations += c.operations;
      total.steps += c.steps;
      total.refusals += c.refusals;
      total.rows_checked += c.rows_checked;
      total.finished += c.finished;
      total.state_prefix_hits += c.state_prefix_hits;
      total.draft_tokens += c.draft_tokens;
      total.accepted_draft_tokens += c.accepted_draft_tokens;
      total.state_rollbacks += c.state_rollbacks;
    } catch (const kvc_model::violation& v) {
      kvc::set_warning_handler(previous);
      FAIL(std::string(v.what()));
    }
  }
  kvc::set_warning_handler(previous);
  // The runs did what they are for: many steps, refused misuse, requests to their end.
  CHECK(total.steps > 5000);
  CHECK(total.refusals > 300);
  CHECK(total.finished > 1000);
  CHECK(total.rows_checked > 100000);
  CHECK(total.state_prefix_hits > 50);       // hybrid models resumed prompts from state snapshots
  CHECK(total.accepted_draft_tokens > 100);  // draft tokens were verified, some kept and some rolled back
  CHECK(total.draft_tokens > total.accepted_draft_tokens + 100);
  CHECK(total.state_rollbacks > 20);  // hybrid requests cut in place, their states from their rings
  MESSAGE("operations " << total.operations << ", steps " << total.steps << ", refusals " << total.refusals
                        << ", finished " << total.finished << ", rows checked " << total.rows_checked
                        << ", prompt tokens resumed from state snapshots " << total.state_prefix_hits
                        << ", draft tokens run " << total.draft_tokens << " (kept " << total.accepted_draft_tokens
                        << "), hybrid cuts in place " << total.state_rollbacks);
}

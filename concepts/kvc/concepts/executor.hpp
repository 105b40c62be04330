#pragma once
// kvc::concepts::Executor: how kvc's attention spreads its work over threads.
//
// Required of an executor E (docs/attention.md, "Threads and workspace"):
//   e.concurrency()            int >= 1: how many work items may run at once
//   e.parallel_for(n, body)    runs body(item, worker) once for each item in [0, n), with worker
//                              in [0, concurrency()) and no two concurrent calls on one worker,
//                              and returns when every call has returned
// kvc splits a call into items fixed by the problem alone and merges their results in a fixed
// order, so the results do not depend on which executor runs them or on how many threads it has.

#include <concepts>
#include <cstdint>

namespace kvc::concepts {

// A body of the shape kvc passes to parallel_for.
struct executor_body_probe {
  // Takes (item, worker) and does nothing.
  void operator()(std::int64_t, int) const noexcept {}
};

// E spreads work over threads for kvc: concurrency() and parallel_for(n, body), as the top of
// this header describes.
template <class E>
concept Executor = requires(const E& e, std::int64_t n, executor_body_probe body) {
  { e.concurrency() } -> std::convertible_to<int>;
  e.parallel_for(n, body);
};

}  // namespace kvc::concepts

#pragma once
// A replacement of the global operator new that fails on request: arm(n) makes the n-th allocation
// from then on throw std::bad_alloc (one failure per arming), disarm() stops and says whether it
// did; count_allocations(fn) counts fn's allocations. For tests/unit/alloc_failure.cpp, the fuzz
// target's scheduler runs with failures and tests/unit/execution.cpp. It
// defines the replaceable allocation functions: include it in one translation unit of a program.
// Every thread's allocations count (off_thread counts those of other threads than the first).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <thread>

namespace {

std::atomic<std::int64_t> countdown{-1};  // allocations left before the failing one; -1: disarmed
std::atomic<bool> fired{false};
std::atomic<std::int64_t> off_thread{0};  // allocations made by threads other than the test's
const std::thread::id test_thread = std::this_thread::get_id();

void arm(std::int64_t n) {
  fired = false;
  countdown = n;
}
// Disarms; whether the armed failure happened.
bool disarm() {
  countdown = -1;
  return fired;
}

void* allocate(std::size_t n, std::size_t alignment) {
  if (std::this_thread::get_id() != test_thread) off_thread.fetch_add(1);
  if (countdown.load() >= 0 && countdown.fetch_sub(1) == 0) {
    countdown = -1;  // one failure per arming: what runs after it (messages, unwinding) may allocate
    fired = true;
    throw std::bad_alloc();
  }
  void* p = nullptr;
  if (alignment <= alignof(std::max_align_t))
    p = std::malloc(n ? n : 1);
  else if (::posix_memalign(&p, alignment, n ? n : 1) != 0)
    p = nullptr;
  if (!p) throw std::bad_alloc();
  return p;
}

// How many allocations fn() makes, on every thread (none fails).
template <class F>
std::int64_t count_allocations(F&& fn) {
  constexpr std::int64_t lots = std::int64_t{1} << 62;
  arm(lots);
  fn();
  const std::int64_t left = countdown.load();
  disarm();
  return lots - left;
}

}  // namespace

void* operator new(std::size_t n) { return allocate(n, 0); }
void* operator new[](std::size_t n) { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n, 0);
  } catch (...) {
    return nullptr;
  }
}
// These pair with the operators new above, which allocate with malloc. g++ 12 at -O1 inlines a
// delete into its caller and then warns that free() gets what operator new returned
// (-Wmismatched-new-delete): a false positive for replaced operators.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

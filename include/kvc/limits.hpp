#pragma once
// The sizes kvc accepts, and the checks every allocation and every size taken from outside goes
// through (docs/limits.md). Values from a caller or a file are checked against the documented
// limits where they enter (a layer kind's constructor, Cache's methods, the JSON readers); the
// element count of every buffer is computed by detail::checked_elements, which refuses a product
// that overflows or a buffer above allocation_limit() before anything is allocated. A host
// allocation that the system refuses is a kvc::MemoryError (a std::bad_alloc).

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include <kvc/errors.hpp>

namespace kvc {

// Layers in a cache (and so layer indices); also the layer and head counts of a model config.
inline constexpr std::int64_t max_layers = std::int64_t{1} << 20;
// Batch entries of a cache, including what batch_repeat_interleave and beams multiply it to.
inline constexpr std::int64_t max_batch = std::int64_t{1} << 20;
// Any single size: tokens in an update, positions, max_cache_len, windows, head_dim, group sizes,
// residual_length, kernel sizes.
inline constexpr std::int64_t max_extent = std::int64_t{1} << 40;
// The default of allocation_limit(): the bytes of one buffer (1 TiB).
inline constexpr std::int64_t default_allocation_limit = std::int64_t{1} << 40;

namespace detail {
inline std::atomic<std::int64_t>& allocation_limit_storage() noexcept {
  static std::atomic<std::int64_t> limit{default_allocation_limit};
  return limit;
}
}  // namespace detail

// The largest buffer, in bytes, kvc allocates (process-wide). A buffer that would be larger is
// refused with a ValueError before anything is allocated. A service that builds caches from files
// it does not trust lowers it to what it can afford.
inline std::int64_t allocation_limit() noexcept { return detail::allocation_limit_storage().load(); }
// Sets allocation_limit() and returns the previous limit; bytes must be positive.
inline std::int64_t set_allocation_limit(std::int64_t bytes) {
  if (bytes < 1)
    throw ValueError(detail::join_message(
        {"set_allocation_limit: the limit must be a positive number of bytes, got ", std::to_string(bytes)}));
  return detail::allocation_limit_storage().exchange(bytes);
}

// Python's MemoryError: the system refused a host allocation kvc asked for. A std::bad_alloc, so
// handlers of that keep working; its message names the bytes and is built without allocating.
class MemoryError : public std::bad_alloc {
 public:
  // The system refused `bytes` bytes; the message names them.
  explicit MemoryError(std::int64_t bytes) noexcept {
    std::snprintf(what_, sizeof what_, "kvc: the system cannot allocate %lld bytes (out of memory)",
                  static_cast<long long>(bytes));
  }
  // Another out-of-memory condition, in its own words (the paged cache's memory planner: a
  // footprint above the budget). Kept without allocating, cut at 159 characters.
  explicit MemoryError(std::string_view message) noexcept {
    const std::size_t n = std::min(message.size(), sizeof what_ - 1);
    std::memcpy(what_, message.data(), n);
    what_[n] = '\0';
  }
  // The message, kept in the exception itself.
  const char* what() const noexcept override { return what_; }

 private:
  char what_[160] = {};
};

namespace detail {

// a * b, or false when it does not fit in int64 (or a factor is negative).
constexpr bool mul_fits(std::int64_t a, std::int64_t b, std::int64_t& out) noexcept {
  if (a < 0 || b < 0) return false;
  return !__builtin_mul_overflow(a, b, &out);
}

[[noreturn]] inline void throw_allocation_limit(std::initializer_list<std::int64_t> extents,
                                                std::size_t element_bytes) {
  throw ValueError(join_message({"kvc: a buffer of ", py_list(std::vector<std::int64_t>(extents)), " elements of ",
                                 std::to_string(element_bytes), " bytes is larger than kvc's allocation limit of ",
                                 std::to_string(allocation_limit()), " bytes (kvc::set_allocation_limit)"}));
}

// The number of elements of a buffer of `extents`, checked: ValueError when a factor is negative,
// the product overflows, or the buffer's bytes exceed allocation_limit(). Every kvc buffer takes
// its size from here.
inline std::int64_t checked_elements(std::initializer_list<std::int64_t> extents, std::size_t element_bytes) {
  std::int64_t n = 1, bytes = 0;
  for (const std::int64_t e : extents)
    if (e < 0)
      throw ValueError(join_message(
          {"kvc: a buffer of ", py_list(std::vector<std::int64_t>(extents)), " elements has a negative dimension"}));
  for (const std::int64_t e : extents)
    if (!mul_fits(n, e, n)) throw_allocation_limit(extents, element_bytes);
  if (!mul_fits(n, static_cast<std::int64_t>(element_bytes), bytes) || bytes > allocation_limit())
    throw_allocation_limit(extents, element_bytes);
  return n;
}

// Whether the extents are non-negative and every product of them, with the zeros counted as ones,
// fits 64 bits 16 times over: what a loaded state's strides and loops multiply (checked_elements
// alone lets a zero hide the overflow of the others' product).
inline bool products_fit(std::initializer_list<std::int64_t> extents) noexcept {
  std::int64_t n = 1;
  for (const std::int64_t e : extents)
    if (e < 0 || !mul_fits(n, std::max<std::int64_t>(e, 1), n)) return false;
  return mul_fits(n, 16, n);
}

// Allocates `bytes` (> 0) aligned to `alignment` with operator new; MemoryError when refused.
inline void* allocate_bytes(std::int64_t bytes, std::size_t alignment) {
  try {
    return ::operator new(static_cast<std::size_t>(bytes), std::align_val_t{alignment});
  } catch (const std::bad_alloc&) {
    throw MemoryError(bytes);
  }
}

// A size from a caller: ValueError naming `what` unless minimum <= value <= maximum.
inline void check_size(std::string_view what, std::int64_t value, std::int64_t minimum, std::int64_t maximum) {
  if (value < minimum) {
    const std::string bound = minimum == 0   ? std::string("0 or more")
                              : minimum == 1 ? std::string("a positive integer")
                                             : "at least " + std::to_string(minimum);
    throw ValueError(join_message({what, " must be ", bound, ", got ", std::to_string(value)}));
  }
  if (value > maximum)
    throw ValueError(
        join_message({what, " is ", std::to_string(value), ", above kvc's limit of ", std::to_string(maximum)}));
}

}  // namespace detail
}  // namespace kvc

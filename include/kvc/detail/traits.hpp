#pragma once
// Small traits shared across the layers of kvc (standard headers only): a dependent false for
// static_assert, membership of a type in a list, and the paged write's unit of work. Element
// conversions have their own header, <kvc/detail/element_conversion.hpp>.

#include <cstdint>
#include <type_traits>

namespace kvc::detail {

// False, but only once T is known: static_assert(always_false<T>, ...) in a branch that must not
// be instantiated.
template <class>
inline constexpr bool always_false = false;

template <class T, class... Ts>
inline constexpr bool is_any_of = (std::is_same_v<T, Ts> || ...);

// One tensor of a paged write (kvc::PagedCache, the storages' scatter_rows): token t's rows of
// every head go from src + t * src_token + h * src_head to dst at row rows[first_row + t].
template <class T>
struct scatter_job {
  T* dst;
  const T* src;
  std::int64_t src_token, src_head;
  std::int64_t first_row;  // into the rows list
  std::int64_t tokens;
};

}  // namespace kvc::detail

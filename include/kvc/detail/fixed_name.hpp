#pragma once
// detail::fixed_name: a string literal as a template argument (the rows of kvc's tables).

#include <array>
#include <cstddef>
#include <string_view>

namespace kvc::detail {

template <std::size_t N>
struct fixed_name {
  char chars[N]{};
  constexpr fixed_name(const char (&s)[N]) {  // NOLINT(google-explicit-constructor): a literal
    for (std::size_t i = 0; i < N; ++i) chars[i] = s[i];
  }
  constexpr std::string_view view() const { return {chars, N - 1}; }
};

// The names of a list of rows, in order.
template <template <class...> class List, class... Rows>
constexpr auto row_names(List<Rows...>) {
  return std::array<std::string_view, sizeof...(Rows)>{Rows::name...};
}

}  // namespace kvc::detail

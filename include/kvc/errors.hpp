#pragma once
// kvc's exception types. Each mirrors the Python exception that transformers raises in the same
// situation, so that a message and its type read the same in both worlds. `what()` is the
// documented message exactly (docs/errors.md lists every one).

#include <cstdint>
#include <stdexcept>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <kvc/detail/py_repr.hpp>

namespace kvc {

// Python's ValueError: an argument of the right type with a wrong value (a size, a shape, an
// option, a name the cache does not accept).
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Python's TypeError: a value of the wrong type (another element type than the cache holds, an
// operation only a dynamic cache defines).
struct TypeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Python's AttributeError: an operation reached a layer kind that does not have it (for example
// `crop` on a StaticLayer in a cache whose layer kinds are only known at run time).
struct AttributeError : std::logic_error {
  using std::logic_error::logic_error;
};
// Python's RuntimeError: a failure outside the arguments (reading a file, an MPI call).
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Python's NotImplementedError, a RuntimeError there too.
struct NotImplementedError : RuntimeError {
  using RuntimeError::RuntimeError;
};
// Python's IndexError: a layer, batch row or position out of range.
struct IndexError : std::out_of_range {
  using std::out_of_range::out_of_range;
};
// Python's KeyError: an unknown key (a layer type or kind the table does not name, a request).
struct KeyError : std::out_of_range {
  using std::out_of_range::out_of_range;
};
// Python's AssertionError: a precondition transformers asserts (StaticCacheExport's generation
// config).
struct AssertionError : std::logic_error {
  using std::logic_error::logic_error;
};
// kvc's own: a saved state (kvc::load, kvc::mpi) that cannot be loaded into the given cache: not
// kvc's format, another version, a type or shape that differs, a truncated or corrupted file.
struct StateError : RuntimeError {
  using RuntimeError::RuntimeError;
};

namespace detail {

// Joins message pieces one append at a time (a chain of operator+ trips GCC 12's -Wrestrict).
inline std::string join_message(std::initializer_list<std::string_view> parts) {
  std::string out;
  std::size_t n = 0;
  for (std::string_view p : parts) n += p.size();
  out.reserve(n);
  for (std::string_view p : parts) out.append(p);
  return out;
}

}  // namespace detail
}  // namespace kvc

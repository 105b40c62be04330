#pragma once
// One replaceable warning handler with transformers' `logger.warning_once` semantics: a given
// message reaches the handler once per process (until `reset_warnings_seen()`), while `warn`
// always forwards. The default handler writes `kvc warning: <message>` to stderr.

#include <functional>
#include <iostream>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <utility>

namespace kvc {

// What receives kvc's warnings: called with each message (default: printed to std::cerr).
using WarningHandler = std::function<void(std::string_view)>;

namespace detail {
struct warning_state {
  std::mutex mutex;
  WarningHandler handler = [](std::string_view msg) { std::cerr << "kvc warning: " << msg << '\n'; };
  std::set<std::string, std::less<>> seen;
};
inline warning_state& warnings() {
  static warning_state state;
  return state;
}
}  // namespace detail

// Installs `handler` (an empty one silences warnings) and returns the previous handler.
inline WarningHandler set_warning_handler(WarningHandler handler) {
  auto& s = detail::warnings();
  std::lock_guard lock(s.mutex);
  return std::exchange(s.handler, std::move(handler));
}

// Out of memory while bookkeeping (copying the handler, remembering a message) drops the warning
// instead of throwing: kvc warns from inside operations that must not fail half-way (crop).
inline void warn(std::string_view message) {
  auto& s = detail::warnings();
  WarningHandler h;
  try {
    std::lock_guard lock(s.mutex);
    h = s.handler;
  } catch (const std::bad_alloc&) {
    return;
  }
  if (h) h(message);
}

// Sends `message` to the handler the first time it is seen in the process; later identical
// messages are dropped. Out of memory drops the warning instead of throwing.
inline void warn_once(std::string_view message) {
  auto& s = detail::warnings();
  try {
    std::lock_guard lock(s.mutex);
    if (!s.seen.emplace(message).second) return;
  } catch (const std::bad_alloc&) {
    return;
  }
  warn(message);
}

// Forgets which messages `warn_once` has already delivered (tests use this).
inline void reset_warnings_seen() {
  auto& s = detail::warnings();
  std::lock_guard lock(s.mutex);
  s.seen.clear();
}

}  // namespace kvc

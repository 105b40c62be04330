#pragma once
// Reporting helpers shared by the demos: number formatting and a progress line on a terminal.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include <unistd.h>

namespace examples {

using clock_type = std::chrono::steady_clock;

inline std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

inline std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024 && u < 3) {
    bytes /= 1024;
    ++u;
  }
  return fmt(u == 0 ? "%.0f" : "%.1f", bytes) + " " + units[u];
}

// A progress line on stderr.

// A `\r` line of tokens done / total and tokens/s, only when stderr is a terminal and the run has
// lasted more than a second.
class Progress {
 public:
  explicit Progress(clock_type::time_point start) : enabled_(isatty(STDERR_FILENO) == 1), start_(start) {}
  void update(const std::string& what, std::int64_t done, std::int64_t total, const char* unit,
              clock_type::time_point since) {
    if (!enabled_) return;
    const std::lock_guard lock(mutex_);
    const auto now = clock_type::now();
    if (now - start_ < std::chrono::seconds(1) || (now - last_ < std::chrono::milliseconds(100) && done < total))
      return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - since).count();
    const std::string line = what + " " + std::to_string(done) + "/" + std::to_string(total) + " " + unit + ", " +
                             fmt("%.1f", seconds > 0 ? static_cast<double>(done) / seconds : 0.0) + " " + unit + "/s";
    std::fprintf(stderr, "\r%-70s", line.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  // A line shown at once (a step known to take seconds, e.g. the weights of a large config).
  void note(const std::string& text) {
    if (!enabled_) return;
    const std::lock_guard lock(mutex_);
    std::fprintf(stderr, "\r%-70s", text.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (!shown_) return;
    std::fprintf(stderr, "\r%70s\r", "");
    std::fflush(stderr);
    shown_ = false;
  }

 private:
  bool enabled_;
  clock_type::time_point start_, last_{};
  bool shown_ = false;
  std::mutex mutex_;
};

inline double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

}  // namespace examples

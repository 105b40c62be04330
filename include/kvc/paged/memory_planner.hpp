#pragma once
// kvc::PagedAttentionMemoryHandler: how many blocks and query tokens per batch fit a memory
// budget, transformers' PagedAttentionMemoryHandler (generation/continuous_batching/cache.py at
// a597f974), its arithmetic kept exactly: Python's floats are doubles, computed in the same order
// (the 10%-fill bound squares 0.1 as 0.1 ** 2, 0.010000000000000002), floored like Python's int().
// Python's ints are exact; kvc keeps them exact in 128 bits where they decide a printed value (the
// quadratic on ints, when num_blocks is given: its discriminant prints as an int) and in doubles
// elsewhere, which are exact below 2^53 bytes. Values far beyond any model (a product of operands
// of 2^63 or more) fall back to doubles.
//
// With M = max_batch_tokens and N = num_blocks * block_size (pages), the memory at each activation
// peak is   cm * M + cn * N + cmn * M * N + cmm * M^2,   for two peaks:
//   lm_head:    delta_m = hidden_size * a + vocab_size * 4 (fp32 logits), delta_n = 0
//   attention:  delta_m = a * (hidden_size + num_attention_heads * head_dim + 2 * page_size),
//               delta_n = 2 * page_size * a ("worst case: the whole cache is read")
// with a the element size, page_size = head_dim * num_key_value_heads, and
//   cn  = delta_n + 2 * group_size * page_size * a + k * G * 8          (pools; read index)
//   cm  = delta_m + k * (7 * 4 + rows * 4 + G * mbpr * 4 + G * 8 + G * 8) (inputs, outputs,
//                                                                          block table, indices)
//   cmn = cmm = k * masks * a                                            (the attention mask)
// where k = 2 with async batching (two IO sets), rows = 2 with log-probs, G the number of layer
// groups, mbpr the decode block-table width, masks 0 with flash attention, else 2 if the model has
// sliding groups, else 1. What is not modelled (as upstream): the 2 padding blocks and the exact
// IO shapes. docs/paged.md works an example through.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <kvc/detail/py_repr.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

namespace detail {

__extension__ using planner_int128 = __int128;

// A Python int of the planner's integer arithmetic, in 128 bits: `exact` turns false (and stays
// false) once an operand is too large for the result to be certain to fit (a factor of 2^63 or
// more, a term of 2^125 or more); the planner then computes that value in doubles.
struct py_int {
  planner_int128 v = 0;
  bool exact = true;
  py_int() = default;
  template <std::integral I>
  explicit py_int(I x) : v(static_cast<planner_int128>(x)) {}
  static bool below(planner_int128 x, int bits) noexcept {
    const planner_int128 limit = planner_int128{1} << bits;
    return -limit < x && x < limit;
  }
  friend py_int operator*(py_int x, py_int y) noexcept {
    py_int out;
    out.exact = x.exact && y.exact && below(x.v, 63) && below(y.v, 63);
    out.v = out.exact ? x.v * y.v : 0;
    return out;
  }
  friend py_int operator+(py_int x, py_int y) noexcept {
    py_int out;
    out.exact = x.exact && y.exact && below(x.v, 125) && below(y.v, 125);
    out.v = out.exact ? x.v + y.v : 0;
    return out;
  }
  friend py_int operator-(py_int x, py_int y) noexcept {
    py_int out;
    out.exact = x.exact && y.exact && below(x.v, 125) && below(y.v, 125);
    out.v = out.exact ? x.v - y.v : 0;
    return out;
  }
};

// float(x) of a Python int: the nearest double (the 128-bit conversion rounds to nearest, as
// Python does).
inline double py_int_float(planner_int128 x) noexcept { return static_cast<double>(x); }

// str(x) of a Python int.
inline std::string py_int_str(planner_int128 x) {
  __extension__ using magnitude = unsigned __int128;
  magnitude m = x < 0 ? magnitude{0} - static_cast<magnitude>(x) : static_cast<magnitude>(x);
  char buf[48];
  char* p = buf + sizeof buf;
  do {
    *--p = static_cast<char>('0' + static_cast<int>(m % 10));
    m /= 10;
  } while (m != 0);
  if (x < 0) *--p = '-';
  return std::string(p, buf + sizeof buf);
}

}  // namespace detail

// What the planner needs to know of the model and of the way it will run.
struct PagedMemoryModel {
  // The model's hidden size (activations at both peaks).
  std::int64_t hidden_size = 0;
  // The vocabulary size (the fp32 logits at the lm_head peak).
  std::int64_t vocab_size = 0;
  // Query heads (the query activations at the attention peak).
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // of the whole model (transformers does not divide by TP here)
  // Elements per attention head.
  std::int64_t head_dim = 0;
  // Bytes per element of the activations and the cache (`a` above).
  std::int64_t dtype_bytes = 2;
  std::int64_t num_groups = 1;  // G
  std::int64_t group_size = 1;  // layers per group: pool tensors of each of K and V
  // Whether some layer group uses sliding-window attention (two attention masks instead of one).
  bool has_sliding_groups = false;
  bool flash_attention = false;  // no attention mask
  // Two sets of batch IO buffers (k = 2).
  bool async_batching = false;
  // Log-probabilities next to the tokens (two output rows).
  bool return_logprobs = false;
  std::int64_t max_blocks_per_request = 32;  // 0 when the decode fast path is off
  // Tokens per block: N = num_blocks * block_size.
  std::int64_t block_size = 256;
};

// transformers' PagedAttentionMemoryHandler, with its arithmetic: how many blocks and query
// tokens per batch fit a memory budget, from the memory at two activation peaks (lm_head and
// attention).
class PagedAttentionMemoryHandler {
 public:
  // The most query tokens per batch the planner picks when it solves for them.
  static constexpr std::int64_t default_max_batch_tokens = 8192;
  // The fewest query tokens per batch the planner picks when it solves for them.
  static constexpr std::int64_t min_max_batch_tokens = 256;

  // The polynomial's coefficients at one activation peak (transformers computes them on ints).
  template <class N>
  struct basic_coefficients {
    // The coefficient of M (M query tokens).
    N cm{};
    // The coefficient of N (N pages).
    N cn{};
    // The coefficient of M * N.
    N cmn{};
    // The coefficient of M^2.
    N cmm{};
  };
  // The coefficients in doubles, as the planner computes the footprint.
  using coefficients = basic_coefficients<double>;

  // The planner for `m`: computes the coefficients of both peaks.
  explicit PagedAttentionMemoryHandler(const PagedMemoryModel& m)
      : m_(m), peaks_(peaks_of<double>(m)), exact_peaks_(peaks_of<detail::py_int>(m)) {}

  // Returns the coefficients at the lm_head peak.
  const coefficients& lm_head() const noexcept { return peaks_[0]; }
  // Returns the coefficients at the attention peak.
  const coefficients& attention() const noexcept { return peaks_[1]; }

  // The memory at the worse peak for M query tokens and `num_blocks` blocks.
  // (Saturated at INT64_MAX: sizes from outside can make it larger than any budget.)
  std::int64_t compute_memory_footprint(std::int64_t max_batch_tokens, std::int64_t num_blocks) const noexcept {
    return saturate(footprint(max_batch_tokens, num_blocks));
  }

  // (max_batch_tokens, num_blocks) for `available_memory` bytes: each value given is kept, each one
  // missing is solved for (both missing: M first, from the cache filling 10% per batch, clamped to
  // [256, 8192]); then the footprint is checked (MemoryError, then ValueError, transformers' texts).
  std::pair<std::int64_t, std::int64_t> infer_max_batch_tokens_and_num_blocks(
      std::optional<std::int64_t> max_batch_tokens, std::optional<std::int64_t> num_blocks,
      std::int64_t available_memory) const {
    const double avail = static_cast<double>(available_memory);
    std::int64_t m = 0, nb = 0;
    if (max_batch_tokens && num_blocks) {
      m = *max_batch_tokens;
      nb = *num_blocks;
    } else if (num_blocks) {
      // transformers' coefficients, N and the budget are ints here: the quadratic is solved on ints.
      nb = *num_blocks;
      const detail::py_int n = detail::py_int(nb) * detail::py_int(m_.block_size);
      m = INT64_MAX;
      for (std::size_t p = 0; p < peaks_.size(); ++p) {
        const basic_coefficients<detail::py_int>& e = exact_peaks_[p];
        const detail::py_int b = e.cm + e.cmn * n, c = e.cn * n - detail::py_int(available_memory);
        if (e.cmm.exact && b.exact && c.exact) {
          m = std::min(m, solve_int(e.cmm, b, c));
        } else {
          const coefficients& d = peaks_[p];
          const double nn = static_cast<double>(nb) * static_cast<double>(m_.block_size);
          m = std::min(m, solve_quadratic(d.cmm, d.cm + d.cmn * nn, d.cn * nn - avail));
        }
      }
    } else {
      if (max_batch_tokens) {
        m = *max_batch_tokens;
      } else {
        // The cache filling 10% of itself per batch: M = fill * N, and transformers' quadratic
        // coefficient cmn * fill + cmm * fill ** 2, where fill ** 2 is 0.010000000000000002.
        constexpr double fill = 0.1;
        constexpr double fill_squared = fill * fill;
        std::int64_t upper = INT64_MAX;
        for (const coefficients& c : peaks_) {
          const std::int64_t pages = solve_quadratic(c.cmn * fill + c.cmm * fill_squared, c.cn + c.cm * fill, -avail);
          upper = std::min(upper, saturate(static_cast<double>(pages) * fill));
        }
        m = std::max(std::min(default_max_batch_tokens, upper), min_max_batch_tokens);
      }
      const double mm = static_cast<double>(m);
      nb = INT64_MAX;
      for (const coefficients& c : peaks_) {
        const auto pages = saturate(std::floor((avail - c.cm * mm - c.cmm * mm * mm) / (c.cn + c.cmn * mm)));
        nb = std::min(nb, floor_div(pages, m_.block_size));
      }
    }
    if (footprint(m, nb) > avail)
      throw MemoryError("Memory footprint " + std::to_string(compute_memory_footprint(m, nb)) +
                        " is more than available memory " + std::to_string(available_memory));
    if (m <= 0 || nb <= 0)
      throw ValueError("Invalid values: max_batch_tokens = " + std::to_string(m) +
                       ", num_blocks = " + std::to_string(nb));
    return {m, nb};
  }

  // The largest root of a x^2 + b x + c, floored (x = -c / b when a is 0), as transformers'
  // _solve_quadratic on floats; its errors in its words (the values as Python prints a float).
  static std::int64_t solve_quadratic(double a, double b, double c) {
    if (a == 0) return saturate(-c / b);
    const double discriminant = b * b - 4 * a * c;
    if (discriminant < 0)
      throw ValueError("No real solution (discriminant = " + detail::py_float_repr(discriminant) + ")");
    return root_of(b, discriminant, 2 * a);
  }
  // The same on ints, as Python computes it: the discriminant exactly, printed as an int (-3 where
  // floats give -3.0), then float(-b) + sqrt(float(discriminant)) over float(2 * a).
  template <std::integral I>
    requires(!std::same_as<I, bool>)
  static std::int64_t solve_quadratic(I a, I b, I c) {
    return solve_int(detail::py_int(a), detail::py_int(b), detail::py_int(c));
  }

 private:
  template <class N>
  static std::array<basic_coefficients<N>, 2> peaks_of(const PagedMemoryModel& m) {
    const N a = N(m.dtype_bytes), page = N(m.head_dim) * N(m.num_key_value_heads);
    const N k(m.async_batching ? 2 : 1), rows(m.return_logprobs ? 2 : 1);
    const N g = N(m.num_groups), s = N(m.group_size), mbpr = N(m.max_blocks_per_request);
    const N masks(m.flash_attention ? 0 : m.has_sliding_groups ? 2 : 1);
    const N i(4), two(2), seven(7), eight(8);
    const auto make = [&](N delta_m, N delta_n) {
      basic_coefficients<N> c;
      c.cn = delta_n + two * s * page * a + k * g * eight;
      c.cm = delta_m + k * seven * i + k * rows * i + k * g * mbpr * i + k * g * eight + k * g * eight;
      c.cmn = k * masks * a;
      c.cmm = k * masks * a;
      return c;
    };
    const N hidden = N(m.hidden_size);
    return {make(hidden * a + N(m.vocab_size) * i, N(0)),                                                 // lm_head
            make(a * (hidden + N(m.num_attention_heads) * N(m.head_dim) + two * page), two * page * a)};  // attention
  }

  // (-b + sqrt(discriminant)) / two_a, refused when negative, floored.
  static std::int64_t root_of(double b, double discriminant, double two_a) {
    const double root = (-b + std::sqrt(discriminant)) / two_a;
    if (root < 0) throw ValueError("No positive solution (root = " + detail::py_float_repr(root) + ")");
    return saturate(std::floor(root));
  }
  static std::int64_t solve_int(detail::py_int a, detail::py_int b, detail::py_int c) {
    using detail::py_int_float;
    if (a.v == 0) return saturate(py_int_float(-c.v) / py_int_float(b.v));  // int(-c / b)
    const detail::py_int d = b * b - detail::py_int(4) * a * c;
    if (!d.exact) return solve_quadratic(py_int_float(a.v), py_int_float(b.v), py_int_float(c.v));
    if (d.v < 0) throw ValueError("No real solution (discriminant = " + detail::py_int_str(d.v) + ")");
    return root_of(py_int_float(b.v), py_int_float(d.v), py_int_float(2 * a.v));
  }

  double footprint(std::int64_t max_batch_tokens, std::int64_t num_blocks) const noexcept {
    const double mm = static_cast<double>(max_batch_tokens);
    const double n = static_cast<double>(num_blocks) * static_cast<double>(m_.block_size);
    double worst = 0;
    for (const coefficients& c : peaks_)
      worst = std::max(worst, c.cm * mm + c.cn * n + c.cmn * mm * n + c.cmm * mm * mm);
    return worst;
  }
  // Python's int() of a double, clamped to int64 (the planner's values come from outside).
  static std::int64_t saturate(double x) noexcept {
    if (x != x) return 0;
    if (x <= -9.2e18) return INT64_MIN;
    if (x >= 9.2e18) return INT64_MAX;
    return static_cast<std::int64_t>(x);
  }
  static std::int64_t floor_div(std::int64_t a, std::int64_t b) noexcept {
    const std::int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
  }

  PagedMemoryModel m_;
  std::array<coefficients, 2> peaks_;                              // lm_head, attention
  std::array<basic_coefficients<detail::py_int>, 2> exact_peaks_;  // the same as Python's ints
};

namespace detail {

// printf("%.*f"): what Python's format(value, ".Nf") prints for the values messages use.
inline std::string format_fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

// MemAvailable of /proc/meminfo in bytes (Linux), else nullopt.
inline std::optional<std::int64_t> mem_available_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return std::nullopt;
  char line[256];
  std::optional<std::int64_t> out;
  while (std::fgets(line, sizeof line, f)) {
    long long kib = 0;
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) {
      out = static_cast<std::int64_t>(kib) * 1024;
      break;
    }
  }
  std::fclose(f);
  return out;
}

}  // namespace detail

// The swap pool transformers' offloading manager would make, in blocks of `bytes_per_block`
// (>= 1): cpu_offload_space GiB (unset: the whole cap) capped at
// cpu_offload_space_safety_threshold of the available RAM, in whole blocks, with its warnings (at
// each call, as transformers' logger.warning: not once per process). available_ram: the bytes
// free now (unset: /proc/meminfo's MemAvailable, psutil.virtual_memory().available's source; a
// negative value: unknown, as where there is none). PagedCache::plan_swap_blocks calls it with
// the cache's block size in bytes.
inline std::int64_t plan_swap_blocks(const ContinuousBatchingConfig& cb, std::int64_t bytes_per_block,
                                     std::optional<std::int64_t> available_ram = std::nullopt) {
  // The RAM in bytes, -1 where unknown. One read of each optional: g++ -O1 inlines this into a
  // caller passing nullopt and cannot follow a re-assigned optional (-Wmaybe-uninitialized).
  std::int64_t ram_bytes = available_ram.value_or(-1);
  if (!available_ram) ram_bytes = detail::mem_available_bytes().value_or(-1);
  const bool ram_known = ram_bytes >= 0;
  const auto ram = static_cast<double>(ram_bytes);
  std::optional<std::int64_t> offload;
  if (cb.cpu_offload_space) {
    if (!(*cb.cpu_offload_space >= 0 && *cb.cpu_offload_space <= 1e9))
      throw ValueError("kvc::PagedCache: cpu_offload_space must be between 0 and 1e9 GiB, got " +
                       detail::py_float_repr(*cb.cpu_offload_space));
    offload = static_cast<std::int64_t>(*cb.cpu_offload_space * 1073741824.0);
  }
  std::optional<std::int64_t> cap;
  if (ram_known) cap = static_cast<std::int64_t>(ram * cb.cpu_offload_space_safety_threshold);
  const auto gib = [](double bytes, int digits) { return detail::format_fixed(bytes / 1073741824.0, digits); };
  if (offload && cap && *offload > *cap) {
    warn("cpu_offload_space=" + gib(static_cast<double>(*offload), 1) + " GiB exceeds " +
         detail::format_fixed(cb.cpu_offload_space_safety_threshold * 100, 0) + "% of total RAM (" + gib(ram, 1) +
         " GiB). Clamping to " + gib(static_cast<double>(*cap), 1) + " GiB.");
    offload = cap;
  } else if (offload && !cap) {
    warn("kvc::PagedCache: the available RAM is unknown, so cpu_offload_space_safety_threshold cannot be enforced");
  } else if (!offload) {
    if (!cap)
      throw ValueError(
          "kvc::PagedCache: cpu_offload_space is None, which sizes the swap pool from the available RAM, and the "
          "available RAM is unknown: pass it, or an explicit cpu_offload_space in GiB");
    warn("Auto-sizing CPU swap pool from safety threshold: " + gib(static_cast<double>(*cap), 2) + " GiB.");
    offload = cap;
  }
  const std::int64_t blocks = *offload / bytes_per_block;
  if (blocks == 0 && cb.cpu_offload_space && *cb.cpu_offload_space > 0)
    warn("cpu_offload_space=" + detail::format_fixed(*cb.cpu_offload_space, 1) +
         " GiB is too small for even one block. No CPU offloading.");
  return blocks;
}

}  // namespace kvc

#pragma once
// kvc::PagedAttentionMemoryHandler: how many blocks and query tokens per batch fit a memory
// budget, transformers' PagedAttentionMemoryHandler (generation/continuous_batching/cache.py at
// a597f974), its arithmetic kept exactly (doubles, floored like Python's int()).
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
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <kvc/detail/py_repr.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>

namespace kvc {

// What the planner needs to know of the model and of the way it will run.
struct PagedMemoryModel {
  std::int64_t hidden_size = 0;
  std::int64_t vocab_size = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // of the whole model (transformers does not divide by TP here)
  std::int64_t head_dim = 0;
  std::int64_t dtype_bytes = 2;
  std::int64_t num_groups = 1;  // G
  std::int64_t group_size = 1;  // layers per group: pool tensors of each of K and V
  bool has_sliding_groups = false;
  bool flash_attention = false;  // no attention mask
  bool async_batching = false;
  bool return_logprobs = false;
  std::int64_t max_blocks_per_request = 32;  // 0 when the decode fast path is off
  std::int64_t block_size = 256;
};

class PagedAttentionMemoryHandler {
 public:
  static constexpr std::int64_t default_max_batch_tokens = 8192;
  static constexpr std::int64_t min_max_batch_tokens = 256;

  // The polynomial's coefficients at one activation peak.
  struct coefficients {
    double cm = 0, cn = 0, cmn = 0, cmm = 0;
  };

  explicit PagedAttentionMemoryHandler(const PagedMemoryModel& m) : m_(m) {
    const double a = static_cast<double>(m.dtype_bytes);
    const double page = static_cast<double>(m.head_dim * m.num_key_value_heads);
    const double k = m.async_batching ? 2 : 1, rows = m.return_logprobs ? 2 : 1;
    const double g = static_cast<double>(m.num_groups), s = static_cast<double>(m.group_size);
    const double mbpr = static_cast<double>(m.max_blocks_per_request);
    const double masks = m.flash_attention ? 0 : m.has_sliding_groups ? 2 : 1;
    const double i = 4;
    auto make = [&](double delta_m, double delta_n) {
      coefficients c;
      c.cn = delta_n + 2 * s * page * a + k * g * 8;
      c.cm = delta_m + k * 7 * i + k * rows * i + k * g * mbpr * i + k * g * 8 + k * g * 8;
      c.cmn = k * masks * a;
      c.cmm = k * masks * a;
      return c;
    };
    const double hidden = static_cast<double>(m.hidden_size);
    peaks_[0] = make(hidden * a + static_cast<double>(m.vocab_size) * 4, 0);  // lm_head
    peaks_[1] = make(a * (hidden + static_cast<double>(m.num_attention_heads * m.head_dim) + 2 * page),
                     2 * page * a);  // attention
  }

  const coefficients& lm_head() const noexcept { return peaks_[0]; }
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
      nb = *num_blocks;
      const double n = static_cast<double>(nb) * static_cast<double>(m_.block_size);
      m = INT64_MAX;
      for (const coefficients& c : peaks_) m = std::min(m, solve_quadratic(c.cmm, c.cm + c.cmn * n, c.cn * n - avail));
    } else {
      if (max_batch_tokens) {
        m = *max_batch_tokens;
      } else {
        std::int64_t upper = INT64_MAX;  // the cache filling 10% of itself per batch: M = 0.1 N
        for (const coefficients& c : peaks_) {
          const std::int64_t pages = solve_quadratic(c.cmn * 0.1 + c.cmm * 0.01, c.cn + c.cm * 0.1, -avail);
          upper = std::min(upper, saturate(static_cast<double>(pages) * 0.1));
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
  // _solve_quadratic; its errors in its words.
  static std::int64_t solve_quadratic(double a, double b, double c) {
    if (a == 0) return saturate(-c / b);
    const double discriminant = b * b - 4 * a * c;
    if (discriminant < 0)
      throw ValueError("No real solution (discriminant = " + detail::py_float_repr(discriminant) + ")");
    const double root = (-b + std::sqrt(discriminant)) / (2 * a);
    if (root < 0) throw ValueError("No positive solution (root = " + detail::py_float_repr(root) + ")");
    return saturate(std::floor(root));
  }

 private:
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
  coefficients peaks_[2];
};

}  // namespace kvc

#pragma once
// kvc::hadamard_rotate: the Walsh-Hadamard rotation that low-bit KV caches apply to keys (and
// values) before quantizing them (llama.cpp rotates every quantized K/V this way, vLLM's
// TurboQuant presets too). An outlier channel, a few key dimensions 10 to 100 times larger than the
// rest, is spread evenly over the rotated row, so a scale per row or per group no longer has to
// cover it; the rotation is orthonormal, so rotating queries the same way leaves every attention
// score as it was, and rotating values is undone on the attention output by rotating it again.
//
// A row of head_dim values is rotated in blocks of hadamard_block(head_dim) values, the largest
// power of two that divides head_dim, at most 1024 (the whole row for 64 or 128; two blocks of 64
// for 192). Each block x becomes H x / sqrt(b), H the b x b Hadamard matrix in Sylvester's order
// (H[i][j] = (-1)^popcount(i & j)): symmetric and, scaled so, its own inverse. Cost: b log2(b)
// additions and b multiplications per block, in place, no allocation; the butterflies run on
// contiguous runs of values, which the compiler vectorizes.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <kvc/detail/element_conversion.hpp>

namespace kvc {

// The widest block a row is rotated in: 1024 values.
inline constexpr std::int64_t hadamard_max_block = 1024;

// The width of the blocks a row of head_dim values is rotated in: the largest power of two that
// divides head_dim, at most hadamard_max_block (1 for an odd head_dim, which the rotation leaves
// unchanged; 0 for 0 or less).
constexpr std::int64_t hadamard_block(std::int64_t head_dim) noexcept {
  return head_dim > 0 ? (head_dim & -head_dim) < hadamard_max_block ? head_dim & -head_dim : hadamard_max_block : 0;
}

// Rotates `rows` rows of head_dim values in place, row r at x + r * head_dim (see the top of
// <kvc/rotation.hpp>). A second call undoes the first, to rounding. A is float or double.
template <class A>
void hadamard_rotate(A* x, std::int64_t rows, std::int64_t head_dim) noexcept {
  static_assert(std::is_floating_point_v<A>, "kvc::hadamard_rotate: rows of float or double");
  const std::int64_t b = hadamard_block(head_dim);
  if (b < 2) return;
  const A norm = static_cast<A>(1.0 / std::sqrt(static_cast<double>(b)));
  const std::int64_t blocks = rows * (head_dim / b);
  for (std::int64_t k = 0; k < blocks; ++k) {
    A* v = x + k * b;
    // The stages of the fast transform: pairs h apart, within runs of 2h.
    for (std::int64_t h = 1; h < b; h *= 2)
      for (std::int64_t i = 0; i < b; i += 2 * h)
        for (std::int64_t j = i; j < i + h; ++j) {
          const A a = v[j], c = v[j + h];
          v[j] = a + c;
          v[j + h] = a - c;
        }
    for (std::int64_t j = 0; j < b; ++j) v[j] *= norm;
  }
}

namespace detail {

// hadamard_rotate for rows of any element type: float and double in place; other types (half,
// bfloat16) one block at a time through float, each value rounded to T once. No allocation.
template <class T>
void hadamard_rotate_any(T* x, std::int64_t rows, std::int64_t head_dim) noexcept {
  if constexpr (std::is_floating_point_v<T>) {
    hadamard_rotate(x, rows, head_dim);
  } else {
    const std::int64_t b = hadamard_block(head_dim);
    if (b < 2) return;
    float block[hadamard_max_block];
    for (std::int64_t k = 0, blocks = rows * (head_dim / b); k < blocks; ++k) {
      T* v = x + k * b;
      for (std::int64_t j = 0; j < b; ++j) block[j] = to_float(v[j]);
      hadamard_rotate(block, 1, b);
      for (std::int64_t j = 0; j < b; ++j) v[j] = from_float<T>(block[j]);
    }
  }
}

}  // namespace detail

}  // namespace kvc

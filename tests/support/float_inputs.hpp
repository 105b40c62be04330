#pragma once
// Inputs for checking a float -> small-float encoder against a brute-force one (tests/unit/float8.cpp,
// tests/unit/nvfp4.cpp): the midpoints between a format's values, where rounding decides, and the
// floats that take the special paths.

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvc_test {

// Every midpoint between neighbours of `values` (the format's non-negative values, ascending,
// followed by one virtual value a step past the largest), and the floats just either side of it,
// of both signs. The midpoints of these formats are exact floats.
inline void push_midpoints(std::vector<float>& inputs, const std::vector<double>& values) {
  for (std::size_t i = 0; i + 1 < values.size(); ++i) {
    const auto mid = static_cast<float>((values[i] + values[i + 1]) / 2);
    for (const float m : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      inputs.push_back(m);
      inputs.push_back(-m);
    }
  }
}

// Zeros, infinities, NaNs of both signs, the largest, smallest normal and smallest subnormal
// floats, and a sweep over the float bit patterns (every 65537th: subnormals, huge values and
// NaNs included).
inline void push_special_floats(std::vector<float>& inputs) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x :
       {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
        std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::min()})
    inputs.push_back(x);
  for (std::uint64_t b = 0; b <= 0xFFFFFFFFu; b += 65537)
    inputs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
}

}  // namespace kvc_test

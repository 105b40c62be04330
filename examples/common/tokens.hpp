#pragma once
// Helpers shared by the examples: tiny tensors whose values are token numbers, so that what a
// cache returns can be read at a glance, and a check that counts failures.
#include <kvc/kvc.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <vector>

namespace examples {

// [snippet:tokens_helper]
// A [1, 1, n, 1] tensor (one batch row, one head, head_dim 1) holding the values `ids`.
inline kvc::HostTensor<float> tokens(std::initializer_list<float> ids) {
  kvc::HostTensor<float> t(1, 1, static_cast<Eigen::Index>(ids.size()), 1);
  std::copy(ids.begin(), ids.end(), t.data());
  return t;
}

// The values a view holds along its seq axis (batch 0, head 0, element 0).
inline std::vector<float> seq(const kvc::TensorView<float>& view) {
  std::vector<float> out;
  for (std::int64_t s = 0; s < view.extent(2); ++s) out.push_back(view(0, 0, s, 0));
  return out;
}
// [/snippet]

inline int failures = 0;

inline void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

inline bool same(const std::vector<float>& got, std::initializer_list<float> want) {
  return std::equal(got.begin(), got.end(), want.begin(), want.end());
}

}  // namespace examples

// kvc::hadamard_rotate (<kvc/rotation.hpp>): the fast transform against the Hadamard matrix
// multiplied out, its own inverse, an outlier spread over the row, and attention unchanged when
// queries and keys are rotated (and, with values rotated too, once the output is rotated back).

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <kvc/attention.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

#include <doctest/doctest.h>

namespace {

kvc::HostTensor<float> gaussian(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  kvc::HostTensor<float> t(b, h, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = normal(rng);
  return t;
}

double max_diff(const kvc::HostTensor<float>& a, const kvc::HostTensor<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::int64_t i = 0; i < a.size(); ++i)
    m = std::fmax(m, std::fabs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
  return m;
}

}  // namespace

TEST_CASE("hadamard_rotate: the Hadamard matrix multiplied out, block by block, and its own inverse") {
  CHECK(kvc::hadamard_block(128) == 128);
  CHECK(kvc::hadamard_block(192) == 64);
  CHECK(kvc::hadamard_block(96) == 32);
  CHECK(kvc::hadamard_block(7) == 1);
  CHECK(kvc::hadamard_block(4096) == kvc::hadamard_max_block);  // blocks of at most 1024 values
  CHECK(kvc::hadamard_block(3 * 2048) == 1024);
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const std::int64_t d : {1, 2, 8, 64, 96, 128, 192}) {
    CAPTURE(d);
    const std::int64_t rows = 3, b = kvc::hadamard_block(d);
    std::vector<double> x(static_cast<std::size_t>(rows * d));
    for (auto& v : x) v = normal(rng);
    std::vector<double> want(x.size());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < d / b; ++k)
        for (std::int64_t i = 0; i < b; ++i) {
          double sum = 0;
          for (std::int64_t j = 0; j < b; ++j) {
            const double h = std::popcount(static_cast<std::uint64_t>(i & j)) % 2 ? -1.0 : 1.0;
            sum += h * x[static_cast<std::size_t>(r * d + k * b + j)];
          }
          want[static_cast<std::size_t>(r * d + k * b + i)] = sum / std::sqrt(static_cast<double>(b));
        }
    std::vector<double> y = x;
    kvc::hadamard_rotate(y.data(), rows, d);
    double err = 0, back_err = 0;
    for (std::size_t i = 0; i < y.size(); ++i) err = std::fmax(err, std::fabs(y[i] - want[i]));
    CHECK(err < 1e-12);
    kvc::hadamard_rotate(y.data(), rows, d);
    for (std::size_t i = 0; i < y.size(); ++i) back_err = std::fmax(back_err, std::fabs(y[i] - x[i]));
    CHECK(back_err < 1e-12);
  }
}

TEST_CASE("detail::hadamard_rotate_any: 16-bit rows through float, each value rounded once") {
  // 3 rows of 2048 values: blocks of 1024 (kvc::hadamard_max_block), through the stack buffer.
  const std::int64_t rows = 3, d = 2048;
  std::mt19937 rng(4);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::vector<float> exact(static_cast<std::size_t>(rows * d));
  std::vector<Eigen::half> half(exact.size());
  std::vector<Eigen::bfloat16> bf16(exact.size());
  for (std::size_t i = 0; i < exact.size(); ++i) {
    exact[i] = static_cast<float>(dist(rng)) / 8.0f;  // exact in both 16-bit types
    half[i] = Eigen::half(exact[i]);
    bf16[i] = Eigen::bfloat16(exact[i]);
  }
  std::vector<float> rotated = exact;
  kvc::hadamard_rotate(rotated.data(), rows, d);
  kvc::detail::hadamard_rotate_any(half.data(), rows, d);
  kvc::detail::hadamard_rotate_any(bf16.data(), rows, d);
  for (std::size_t i = 0; i < exact.size(); ++i) {  // the float result, rounded once
    CHECK(half[i] == Eigen::half(rotated[i]));
    CHECK(bf16[i] == Eigen::bfloat16(rotated[i]));
  }
  kvc::detail::hadamard_rotate_any(rotated.data(), rows, d);  // float: in place, its own inverse
  for (std::size_t i = 0; i < exact.size(); ++i) CHECK(rotated[i] == doctest::Approx(exact[i]).epsilon(1e-5));
}

TEST_CASE("hadamard_rotate spreads an outlier channel over the whole row, keeping its norm") {
  std::vector<float> row(128, 0.0f);
  row[5] = 100.0f;
  kvc::hadamard_rotate(row.data(), 1, 128);
  double norm = 0;
  for (const float v : row) {
    CHECK(std::fabs(v) == doctest::Approx(100.0 / std::sqrt(128.0)).epsilon(1e-6));
    norm += static_cast<double>(v) * v;
  }
  CHECK(std::sqrt(norm) == doctest::Approx(100.0).epsilon(1e-6));
}

TEST_CASE("attention with rotated queries and keys equals attention without, to float rounding") {
  std::mt19937 rng(5);
  for (const std::int64_t d : {64, 128, 192}) {
    CAPTURE(d);
    const auto q = gaussian(1, 4, 3, d, rng);
    auto k = gaussian(1, 2, 40, d, rng);
    const auto v = gaussian(1, 2, 40, d, rng);
    for (std::int64_t i = 0; i < k.size(); ++i)  // outlier channels, as real keys have
      if (i % d == 3 || i % d == 17) k.data()[i] *= 30.0f;
    const kvc::AttentionMask mask{40, 0, 37};
    const kvc::HostTensor<float> plain = kvc::scaled_dot_product_attention(q, k, v, mask);

    kvc::HostTensor<float> rq = q, rk = k, rv = v;
    kvc::hadamard_rotate(rq.data(), rq.size() / d, d);
    kvc::hadamard_rotate(rk.data(), rk.size() / d, d);
    const kvc::HostTensor<float> rotated = kvc::scaled_dot_product_attention(rq, rk, v, mask);
    CHECK(max_diff(rotated, plain) < 2e-5);

    // Values rotated too: the output is rotated; rotating it again gives the plain output.
    kvc::hadamard_rotate(rv.data(), rv.size() / d, d);
    kvc::HostTensor<float> out = kvc::scaled_dot_product_attention(rq, rk, rv, mask);
    CHECK(max_diff(out, plain) > 1e-2);  // (rotated, so not equal before it is undone)
    kvc::hadamard_rotate(out.data(), out.size() / d, d);
    CHECK(max_diff(out, plain) < 2e-5);
  }
}

// kvc::paged_attention: one step of a continuous batch (prefill chunks and decodes of requests of
// different lengths, packed) read straight from the paged pools, against a double-precision
// reference computed per request from a plain record of its tokens.

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <kvc/fp8_attention.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/row_codes.hpp>

#include "../support/kvc_test.hpp"

namespace {

kvc::ModelConfig model(const std::vector<std::string>& types, std::int64_t kv_heads, std::int64_t heads,
                       std::int64_t window, std::int64_t head_dim = 8) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(types.size());
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.hidden_size = heads * head_dim;
  c.sliding_window = window;
  c.layer_types = types;
  return c;
}

// Every key and value a request has given a layer, [position][kv head][d].
using history = std::vector<std::vector<std::vector<double>>>;

// The attention of one query row of request `r` in double: keys are the history, then the step's.
std::vector<double> reference(const history& k, const history& v, std::int64_t qpos, std::int64_t hk,
                              const std::vector<double>& query, std::int64_t window) {
  const auto n = static_cast<std::int64_t>(k.size());
  std::vector<double> w;
  std::vector<std::int64_t> seen;
  double max = -INFINITY;
  for (std::int64_t p = 0; p < n; ++p) {
    if (p > qpos || (window > 0 && p <= qpos - window)) continue;
    double dot = 0;
    for (std::size_t d = 0; d < query.size(); ++d) dot += query[d] * k[p][hk][d];
    dot /= std::sqrt(static_cast<double>(query.size()));
    w.push_back(dot);
    seen.push_back(p);
    max = std::max(max, dot);
  }
  std::vector<double> out(query.size(), 0.0);
  double sum = 0;
  for (double& x : w) sum += (x = std::exp(x - max));
  for (std::size_t i = 0; i < w.size(); ++i)
    for (std::size_t d = 0; d < out.size(); ++d) out[d] += w[i] / sum * v[seen[i]][hk][d];
  return out;
}

template <class T>
kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
  return kvc::HostStorage<T>::input_view(t);
}

// Random steps over `requests` requests of a model with these layer types: every output of every
// layer against the reference. Returns the largest difference seen. With an fp8 Pool, the pool
// holds the codes of K and V made with `scales`, and the reference reads what they stand for; with
// a row-code Pool (int8_row, int4_row, int2_row, nvfp4_row: its tensor scales scales.keys[0] and
// scales.values[0]), the rows kvc::to_row_codes made, and the reference reads their values.
template <class T, class Pool = T>
double run_stream(const std::vector<std::string>& types, std::int64_t kv_heads, std::int64_t heads, std::int64_t window,
                  std::int64_t block_size, unsigned seed, const kvc::Fp8Scales& scales = {}, std::int64_t D = 8) {
  using Cache = kvc::PagedCache<kvc::HostStorage<Pool>>;
  constexpr bool fp8 = kvc::is_float8_v<Pool>, rows = kvc::is_row_code_v<Pool>;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = block_size;
  cb.num_blocks = 400;
  Cache cache(model(types, kv_heads, heads, window, D), cb);
  const std::int64_t layers = static_cast<std::int64_t>(types.size());
  std::mt19937 rng(seed);
  const std::vector<std::string> ids = {"r0", "r1", "r2", "r3"};
  std::map<std::string, std::int64_t> past, allocated;
  std::map<std::string, std::vector<std::pair<history, history>>> kv;  // per request, per layer
  for (const auto& id : ids) kv[id].resize(static_cast<std::size_t>(layers));
  double worst = 0;
  for (int step = 0; step < 14; ++step) {
    // Each request takes part with a prefill chunk, a decode token, or not at all.
    std::vector<std::string> reqs;
    std::vector<std::int64_t> cu = {0}, pasts;
    for (const auto& id : ids) {
      const int pick = std::uniform_int_distribution<int>(0, 5)(rng);
      if (pick == 0) continue;
      const std::int64_t q = pick == 1 ? std::uniform_int_distribution<std::int64_t>(2, 11)(rng) : 1;
      const std::int64_t need = (past[id] + q + block_size - 1) / block_size - allocated[id];
      if (need > 0) allocated[id] += cache.allocate_blocks(need, id, allocated[id]).value();
      reqs.push_back(id);
      pasts.push_back(past[id]);
      cu.push_back(cu.back() + q);
    }
    if (reqs.empty()) continue;
    const std::int64_t tokens = cu.back();
    kvc::PagedIndices none(static_cast<std::size_t>(cache.num_groups())), writes(none.size());
    for (std::size_t r = 0; r < reqs.size(); ++r)
      cache.extend_read_and_write_indices(reqs[r], pasts[r], cu[r + 1] - cu[r], nullptr, writes);
    const kvc::PagedAttentionStep layout{reqs, cu, pasts};
    std::vector<kvc::paged::RequestKey> keys;  // the same step by the requests' keys
    for (const std::string& r : reqs) keys.push_back(cache.find_request(r).value());
    const kvc::PagedAttentionStep by_key{reqs, cu, pasts, keys};
    for (std::int64_t layer = 0; layer < layers; ++layer) {
      const auto q = kvc_test::random_tensor<T>(1, heads, tokens, D, rng);
      const auto k = kvc_test::random_tensor<T>(1, kv_heads, tokens, D, rng);
      const auto v = kvc_test::random_tensor<T>(1, kv_heads, tokens, D, rng);
      kvc::HostTensor<Pool> kp, vp;  // what the pool holds
      kvc::HostTensor<T> out;
      kvc::HostTensor<float> kd, vd;  // what row codes stand for
      if constexpr (kvc::detail::is_kv_codes<Pool>) {
        // Each side in its own format; a side that keeps its scales in the rows takes tensor scale 1.
        const kvc::Nvfp4TensorScales g{Pool::key_codes::tensor_scaled ? scales.keys[0] : 1.0f,
                                       Pool::value_codes::tensor_scaled ? scales.values[0] : 1.0f};
        auto codes = kvc::to_kv_codes<Pool>(view(k), view(v), g);
        kp = std::move(codes.keys);
        vp = std::move(codes.values);
        CHECK(kp.dimension(3) == cache.row_width());
        CHECK(vp.dimension(3) == cache.value_row_width());
        if constexpr (kvc::detail::takes_scale_lists<Pool>)
          out = kvc::paged_attention(cache, layer, layout, view(q), view(kp), view(vp), g);
        else
          out = kvc::paged_attention(cache, layer, layout, view(q), view(kp), view(vp));
        auto values = kvc::from_kv_codes<Pool>(view(kp), view(vp), D, g);
        kd = std::move(values.keys);
        vd = std::move(values.values);
      } else if constexpr (rows) {
        const kvc::Nvfp4TensorScales g{scales.keys[0], scales.values[0]};
        if constexpr (Pool::tensor_scaled) {
          kp = kvc::to_row_codes<Pool>(view(k), g.keys);
          vp = kvc::to_row_codes<Pool>(view(v), g.values);
          out = kvc::paged_attention(cache, layer, layout, view(q), view(kp), view(vp), g);
        } else {
          kp = kvc::to_row_codes<Pool>(view(k));
          vp = kvc::to_row_codes<Pool>(view(v));
          out = kvc::paged_attention(cache, layer, layout, view(q), view(kp), view(vp));
        }
        kd = kvc::from_row_codes<Pool>(view(kp), D, g.keys);
        vd = kvc::from_row_codes<Pool>(view(vp), D, g.values);
      } else if constexpr (fp8) {
        kp = kvc::to_fp8_keys<Pool>(view(k), scales);
        vp = kvc::to_fp8_values<Pool>(view(v), scales);
        out = kvc::paged_attention(cache, layer, layout, view(q), view(kp), view(vp), scales);
      } else {
        kp = k;
        vp = v;
        out = kvc::paged_attention(cache, layer, layout, view(q), view(k), view(v));
        // By key: the same tables, so the same output bit for bit.
        const kvc::HostTensor<T> again = kvc::paged_attention(cache, layer, by_key, view(q), view(k), view(v));
        CHECK(std::equal(out.data(), out.data() + out.size(), again.data()));
        const kvc::PagedAttentionStep short_keys{reqs, cu, pasts, std::span(keys).first(keys.size() - 1)};
        if (keys.size() > 1)  // (no keys at all is the step by id)
          CHECK_THROWS_WITH_AS(kvc::paged_attention(cache, layer, short_keys, view(q), view(k), view(v)),
                               ("kvc::paged_attention: a step of " + std::to_string(reqs.size()) + " requests has " +
                                std::to_string(keys.size() - 1) + " keys (give none, or one per request)")
                                   .c_str(),
                               kvc::ValueError);
      }
      const bool sliding = types[static_cast<std::size_t>(layer)] == "sliding_attention";
      for (std::size_t r = 0; r < reqs.size(); ++r) {
        auto& [hk_hist, hv_hist] = kv[reqs[r]][static_cast<std::size_t>(layer)];
        history keys = hk_hist, values = hv_hist;  // plus this step's tokens of the request
        for (std::int64_t t = cu[r]; t < cu[r + 1]; ++t) {
          std::vector<std::vector<double>> kr(static_cast<std::size_t>(kv_heads)), vr(kr.size());
          for (std::int64_t h = 0; h < kv_heads; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              if constexpr (rows) {
                kr[static_cast<std::size_t>(h)].push_back(static_cast<double>(kd(0, h, t, d)));
                vr[static_cast<std::size_t>(h)].push_back(static_cast<double>(vd(0, h, t, d)));
              } else {
                kr[static_cast<std::size_t>(h)].push_back(static_cast<double>(kp(0, h, t, d)) *
                                                          (fp8 ? scales.key_scale(h) : 1.0));
                vr[static_cast<std::size_t>(h)].push_back(static_cast<double>(vp(0, h, t, d)) *
                                                          (fp8 ? scales.value_scale(h) : 1.0));
              }
            }
          if constexpr (fp8) {  // rows of rotated codes: what they stand for, rotated back
            for (auto [part, on] : {std::pair{&kr, scales.rotation.keys}, std::pair{&vr, scales.rotation.values}})
              for (auto& row : *part)
                if (on) kvc::hadamard_rotate(row.data(), 1, D);
          }
          keys.push_back(kr);
          values.push_back(vr);
        }
        for (std::int64_t t = cu[r]; t < cu[r + 1]; ++t)
          for (std::int64_t h = 0; h < heads; ++h) {
            std::vector<double> query;
            for (std::int64_t d = 0; d < D; ++d) query.push_back(static_cast<double>(q(0, h, t, d)));
            const auto want =
                reference(keys, values, pasts[r] + t - cu[r], h / (heads / kv_heads), query, sliding ? window : 0);
            for (std::int64_t d = 0; d < D; ++d)
              worst =
                  std::max(worst, std::abs(static_cast<double>(out(0, h, t, d)) - want[static_cast<std::size_t>(d)]));
          }
        hk_hist = std::move(keys);
        hv_hist = std::move(values);
      }
      cache.update(view(kp), view(vp), layer, none, writes);  // the write-only path
    }
    for (std::size_t r = 0; r < reqs.size(); ++r) past[reqs[r]] += cu[r + 1] - cu[r];
  }
  return worst;
}

}  // namespace

TEST_CASE("paged_attention: packed prefill chunks and decodes, each request against a double reference") {
  // GQA (4 query heads on 2 KV heads) and MQA (1 KV head); windows that are and are not a multiple
  // of the block size, shorter and longer than a prefill chunk.
  for (const std::int64_t window : {4, 5, 9}) {
    CAPTURE(window);
    CHECK(run_stream<float>({"sliding_attention", "full_attention"}, 2, 4, window, 4, 1) < 1e-5);
    CHECK(run_stream<float>({"full_attention", "sliding_attention", "sliding_attention"}, 1, 4, window, 4, 2) < 1e-5);
    CHECK(run_stream<double>({"sliding_attention", "full_attention"}, 2, 2, window, 8, 3) < 1e-12);
  }
  CHECK(run_stream<float>({"full_attention"}, 2, 6, 0, 16, 4) < 1e-5);
}

TEST_CASE("paged_attention: half and bfloat16 pools, float accumulation") {
  // The inputs are multiples of 1/8 in [-8, 8], exact in both types; what differs is the rounding
  // of the output, at most half an ulp of each type at |x| < 8.
  CHECK(run_stream<Eigen::half>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 5) < 8.0 / 1024);
  CHECK(run_stream<Eigen::bfloat16>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 6) < 8.0 / 128);
}

TEST_CASE("paged_attention over fp8 pools (per-tensor and per-head scales) reads what the codes stand for") {
  const kvc::Fp8Scales per_tensor{{0.03f}, {0.02f}}, per_head{{0.02f, 0.05f}, {0.01f, 0.04f}};
  CHECK(run_stream<float, kvc::float8_e4m3>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 7, per_tensor) < 1e-5);
  CHECK(run_stream<float, kvc::float8_e4m3>({"full_attention", "sliding_attention"}, 2, 4, 9, 8, 8, per_head) < 1e-5);
  CHECK(run_stream<double, kvc::float8_e5m2>({"sliding_attention", "full_attention"}, 2, 2, 4, 4, 9, per_head) < 1e-12);
  // Codes of rotated rows (Fp8Scales::rotation): queries rotated as the keys, each tile's output back
  // (in float: the rotated queries and outputs carry float's rounding of sums of values up to 8).
  const kvc::Fp8Scales rotated_keys{{0.03f}, {0.02f}, {.keys = true}},
      rotated_both{{0.02f, 0.05f}, {0.01f, 0.04f}, {.keys = true, .values = true}};
  CHECK(run_stream<float, kvc::float8_e4m3>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 7, rotated_keys) <
        5e-5);
  CHECK(run_stream<float, kvc::float8_e4m3>({"full_attention", "sliding_attention"}, 2, 4, 9, 8, 8, rotated_both) <
        5e-5);
  CHECK(run_stream<double, kvc::float8_e5m2>({"sliding_attention", "full_attention"}, 2, 2, 4, 4, 9, rotated_both) <
        1e-12);
  // A decode over 700 cached keys, cut into key splits: each split's output rotated back before the
  // merge.
  {
    kvc::ContinuousBatchingConfig big;
    big.block_size = 16;
    big.num_blocks = 64;
    kvc::PagedCache<kvc::HostStorage<kvc::float8_e4m3>> pool(model({"full_attention"}, 2, 4, 0), big);
    std::mt19937 rng(11);
    REQUIRE(pool.allocate_blocks(45, "r", 0).value() == 45);
    history hk, hv;
    double worst = 0;
    for (const std::int64_t n : {700, 1}) {
      const std::int64_t past = static_cast<std::int64_t>(hk.size());
      const auto q = kvc_test::random_tensor<float>(1, 4, n, 8, rng);
      const auto k = kvc_test::random_tensor<float>(1, 2, n, 8, rng);
      const auto v = kvc_test::random_tensor<float>(1, 2, n, 8, rng);
      const auto kp = kvc::to_fp8_keys<kvc::float8_e4m3>(view(k), rotated_both),
                 vp = kvc::to_fp8_values<kvc::float8_e4m3>(view(v), rotated_both);
      const std::vector<std::string> ids{"r"};
      const std::vector<std::int64_t> cu{0, n}, pasts{past};
      const kvc::HostTensor<float> out = kvc::paged_attention(pool, 0, kvc::PagedAttentionStep{ids, cu, pasts}, view(q),
                                                              view(kp), view(vp), rotated_both);
      for (std::int64_t t = 0; t < n; ++t) {  // what the codes stand for, rotated back
        std::vector<std::vector<double>> kr(2, std::vector<double>(8)), vr = kr;
        for (std::int64_t h = 0; h < 2; ++h) {
          for (std::int64_t d = 0; d < 8; ++d) {
            kr[static_cast<std::size_t>(h)][static_cast<std::size_t>(d)] =
                static_cast<double>(kp(0, h, t, d)) * rotated_both.key_scale(h);
            vr[static_cast<std::size_t>(h)][static_cast<std::size_t>(d)] =
                static_cast<double>(vp(0, h, t, d)) * rotated_both.value_scale(h);
          }
          kvc::hadamard_rotate(kr[static_cast<std::size_t>(h)].data(), 1, 8);
          kvc::hadamard_rotate(vr[static_cast<std::size_t>(h)].data(), 1, 8);
        }
        hk.push_back(kr);
        hv.push_back(vr);
      }
      if (n == 1)  // the decode row (the prompt's rows are tiles, not splits)
        for (std::int64_t h = 0; h < 4; ++h) {
          std::vector<double> query;
          for (std::int64_t d = 0; d < 8; ++d) query.push_back(static_cast<double>(q(0, h, 0, d)));
          const auto want = reference(hk, hv, past, h / 2, query, 0);
          for (std::int64_t d = 0; d < 8; ++d)
            worst = std::max(worst, std::abs(static_cast<double>(out(0, h, 0, d)) - want[static_cast<std::size_t>(d)]));
        }
      kvc::PagedIndices none(1), writes(1);
      pool.extend_read_and_write_indices("r", past, n, nullptr, writes);
      pool.update(view(kp), view(vp), 0, none, writes);
    }
    CAPTURE(worst);
    CHECK(worst < 5e-5);
  }
  // Row codes rotate by their format (kvc::rotated<C>): scales that say otherwise are refused.
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 4;
  const kvc::PagedCache<kvc::HostStorage<kvc::nvfp4_row>> nvfp4(model({"full_attention"}, 2, 4, 0), cb);
  std::mt19937 rng(1);
  const auto q = kvc_test::random_tensor<float>(1, 4, 0, 8, rng);
  const kvc::HostTensor<kvc::nvfp4_row> none(1, 2, 0, nvfp4.row_width());
  const std::vector<std::string> ids;
  const std::vector<std::int64_t> cu{0}, past;
  CHECK_THROWS_WITH_AS(kvc::paged_attention(nvfp4, 0, kvc::PagedAttentionStep{ids, cu, past}, view(q), view(none),
                                            view(none), rotated_keys),
                       "kvc::paged_attention: Fp8Scales::rotation is for pools of fp8 codes; rotate row codes with "
                       "kvc::rotated<C>",
                       kvc::ValueError);
}

TEST_CASE(
    "paged_attention over row-code pools (int8, int4, int2, NVFP4 rows, rotated or not) reads what the codes stand "
    "for") {
  // Float accumulation against double; half and bfloat16 outputs: their rounding, as above.
  CHECK(run_stream<float, kvc::int8_row>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 11) < 5e-5);
  CHECK(run_stream<Eigen::half, kvc::int4_row>({"full_attention", "sliding_attention"}, 2, 4, 9, 8, 12) < 8.0 / 1024);
  CHECK(run_stream<float, kvc::nvfp4_row>({"sliding_attention", "full_attention"}, 2, 2, 4, 4, 13, {{0.01f}, {0.02f}}) <
        5e-5);
  CHECK(run_stream<Eigen::bfloat16, kvc::nvfp4_row>({"full_attention"}, 1, 2, 0, 16, 14) < 8.0 / 128);
  CHECK(run_stream<float, kvc::int2_row>({"full_attention", "sliding_attention"}, 2, 4, 9, 4, 18) < 5e-5);
  // Rotated rows: the queries rotated as the keys were, the output rotated back.
  CHECK(run_stream<float, kvc::rotated<kvc::int4_row>>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 15) < 5e-5);
  CHECK(run_stream<Eigen::half, kvc::rotated<kvc::int8_row>>({"full_attention"}, 2, 4, 0, 8, 16) < 8.0 / 1024);
  CHECK(run_stream<float, kvc::rotated<kvc::nvfp4_row>>({"full_attention", "sliding_attention"}, 2, 2, 9, 4, 17,
                                                        {{0.01f}, {0.02f}}) < 5e-5);
}

TEST_CASE("paged_attention over kv_codes pools: keys and values each read from their own format") {
  using e4m3 = kvc::fp8_row<kvc::float8_e4m3>;
  using e5m2 = kvc::fp8_row<kvc::float8_e5m2>;
  // fp8 keys with int4 values, int8 keys with NVFP4 values, 16-bit keys with int4 values, and
  // rotation on one side only (queries rotated for rotated keys, outputs back for rotated values).
  CHECK(run_stream<float, kvc::kv_codes<e4m3, kvc::int4_row>>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 21) <
        5e-5);
  CHECK(run_stream<float, kvc::kv_codes<kvc::int8_row, kvc::nvfp4_row>>({"full_attention", "sliding_attention"}, 2, 4,
                                                                        9, 8, 22, {{1.0f}, {0.02f}}) < 5e-5);
  CHECK(run_stream<Eigen::half, kvc::kv_codes<kvc::bfloat16_row, kvc::int4_row>>({"full_attention"}, 2, 4, 0, 16, 23) <
        8.0 / 1024);
  CHECK(run_stream<float, kvc::kv_codes<kvc::rotated<kvc::int4_row>, kvc::int8_row>>(
            {"sliding_attention", "full_attention"}, 2, 2, 4, 4, 24) < 5e-5);
  CHECK(run_stream<float, kvc::kv_codes<kvc::nvfp4_row, kvc::rotated<e5m2>>>({"full_attention"}, 1, 2, 0, 8, 25,
                                                                             {{0.01f}, {1.0f}}) < 5e-5);
  CHECK(run_stream<Eigen::bfloat16, kvc::kv_codes<kvc::rotated<e4m3>, kvc::rotated<kvc::nvfp4_row>>>(
            {"sliding_attention", "full_attention"}, 2, 4, 5, 4, 26, {{1.0f}, {0.03f}}) < 8.0 / 128);
  // int8 keys with 2-bit values (KIVI's pairing), and int2 rows rotated on both sides.
  CHECK(run_stream<float, kvc::kv_codes<kvc::int8_row, kvc::int2_row>>({"sliding_attention", "full_attention"}, 2, 4, 5,
                                                                       4, 29) < 5e-5);
  CHECK(run_stream<Eigen::half, kvc::rotated<kvc::int2_row>>({"full_attention"}, 2, 4, 0, 8, 30) < 8.0 / 1024);
  // Rows of 72 values: two whole groups of 32 (widened with AVX2 where the CPU has it) and a short one.
  CHECK(run_stream<float, kvc::kv_codes<kvc::int8_row, kvc::int2_row>>({"full_attention", "sliding_attention"}, 2, 4, 9,
                                                                       4, 31, {}, 72) < 5e-5);
  // A single fp8 row format is a pool of its own (vLLM's fp8_per_token_head), rotated or not.
  CHECK(run_stream<float, e4m3>({"sliding_attention", "full_attention"}, 2, 4, 5, 4, 27) < 5e-5);
  CHECK(run_stream<float, kvc::rotated<e5m2>>({"full_attention"}, 2, 4, 0, 8, 28) < 5e-5);
}

TEST_CASE("paged_attention refuses a step it cannot read, before computing anything") {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 8;
  const kvc::PagedCache<kvc::HostStorage<float>> cache(model({"full_attention"}, 2, 4, 0), cb);
  kvc::PagedCache<kvc::HostStorage<float>> grown = cache;
  REQUIRE(grown.allocate_blocks(1, "a", 0));
  const std::vector<std::string> reqs = {"a"};
  const std::vector<std::int64_t> cu = {0, 2}, past = {3}, bad_cu = {0, 3}, no_past = {};
  std::mt19937 rng(1);
  const auto q = kvc_test::random_tensor<float>(1, 4, 2, 8, rng), k = kvc_test::random_tensor<float>(1, 2, 2, 8, rng);
  const auto q3 = kvc_test::random_tensor<float>(1, 3, 2, 8, rng);
  const auto k1 = kvc_test::random_tensor<float>(1, 2, 1, 8, rng);
  CHECK_THROWS_WITH_AS(kvc::paged_attention(grown, 0, {reqs, cu, past}, view(q3), view(k), view(k)),
                       "kvc::paged_attention: queries must be [1, a multiple of 2 heads, tokens, 8], got [1, 3, 2, 8]",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::paged_attention(grown, 0, {reqs, cu, past}, view(q), view(k1), view(k)),
                       "kvc::paged_attention: keys must be [1, 2, 2, 8] like the queries' tokens, got "
                       "[1, 2, 1, 8]",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::paged_attention(grown, 0, {reqs, bad_cu, past}, view(q), view(k), view(k)),
                       "kvc::paged_attention: a step of 1 requests needs 2 non-decreasing cu_seqlens_q from 0 to the "
                       "2 query tokens, and 1 cached lengths >= 0",
                       kvc::ValueError);
  CHECK_THROWS_AS(kvc::paged_attention(grown, 0, {reqs, cu, no_past}, view(q), view(k), view(k)), kvc::ValueError);
  // 5 cached tokens need 2 blocks; "a" has 1.
  const std::vector<std::int64_t> long_past = {5};
  CHECK_THROWS_WITH_AS(kvc::paged_attention(grown, 0, {reqs, cu, long_past}, view(q), view(k), view(k)),
                       "kvc::paged_attention: request a has 1 blocks, too few for its cached position 4",
                       kvc::ValueError);
  CHECK_THROWS_AS(kvc::paged_attention(cache, 0, {reqs, cu, past}, view(q), view(k), view(k)),
                  kvc::ValueError);  // no table for "a": the allocator's message
  CHECK_THROWS_AS(kvc::paged_attention(grown, 1, {reqs, cu, past}, view(q), view(k), view(k)), kvc::IndexError);
  // An fp8 pool's scale lists: one, or one per KV head (2 here), each positive.
  kvc::PagedCache<kvc::HostStorage<kvc::float8_e4m3>> fp8(model({"full_attention"}, 2, 4, 0), cb);
  REQUIRE(fp8.allocate_blocks(1, "a", 0));
  const auto k8 = kvc::to_fp8<kvc::float8_e4m3>(view(k), std::vector<float>{1.0f});
  const auto fp8_view = kvc::HostStorage<kvc::float8_e4m3>::input_view(k8);
  const std::vector<std::int64_t> none_past = {0};
  CHECK_THROWS_WITH_AS(kvc::paged_attention(fp8, 0, {reqs, cu, none_past}, view(q), fp8_view, fp8_view,
                                            kvc::Fp8Scales{{1.0f, 1.0f, 1.0f}, {1.0f}}),
                       "kvc fp8: key scales: 3 given; one per tensor or one per KV head (2) expected", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::paged_attention(fp8, 0, {reqs, cu, none_past}, view(q), fp8_view, fp8_view,
                                            kvc::Fp8Scales{{1.0f}, {1.0f, -1.0f}}),
                       "kvc fp8: value scales must be positive and finite, got -1.000000", kvc::ValueError);
  CHECK(kvc::paged_attention(fp8, 0, {reqs, cu, none_past}, view(q), fp8_view, fp8_view,
                             kvc::Fp8Scales{{1.0f, 2.0f}, {1.0f}})
            .size() == 64);
}

#pragma once
// The per-row step of kvc's device attention (kvc::detail; host and device code). One query row
// (a query token of one query head) attends over a range of its keys with an online softmax
// (running maximum m, running sum l, running weighted sum of value rows). On a CUDA device the
// row's dims are spread over the 32 lanes of a warp (lane i holds dims i, i + 32, ...) and each
// key's score is summed across the lanes; on the host one lane holds every dim. The kernels in
// <kvc/detail/cuda_attention.cuh> and attention_rows_host below run exactly these functions, so the
// host tests check the device's arithmetic, addressing and masks (tests/cuda/conformance.hpp, and
// host_conformance.cpp with 32 emulated lanes).
//
// Long contexts are split over the keys (split-KV, FlashDecoding): split s of a row covers keys
// [lo + s * chunk, lo + (s + 1) * chunk) of its visible range [lo, hi), gives a partial (m, l, acc),
// and merge_partials combines a row's partials. A problem describes every row of one call:
//   dense_problem  queries [B, Hq, q, D] over a contiguous layer's keys [B, Hkv, S, D] (the views a
//                  cache's update returns), with AttentionMask's rules as ints;
//   paged_problem  a continuous-batching step: packed queries [1, Hq, T, D] over a PagedCache's
//                  pools through each request's block table, plus the step's own keys; pools of
//                  values, fp8 codes or row codes (<kvc/row_codes.hpp>, read a value at a time by
//                  the formats' value_at).
// Rows are numbered so that the query heads of one KV head (GQA) are neighbours: a CUDA block's
// warps then read the same key rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <math.h>  // expf: one name in host and device code

#include <kvc/attention.hpp>
#include <kvc/detail/element_conversion.hpp>
#include <kvc/detail/row_code_types.hpp>
#include <kvc/float8.hpp>
#include <kvc/tensor.hpp>

namespace kvc::detail {

// The largest head_dim the device kernels take: 32 lanes of 8 dims.
inline constexpr std::int64_t max_device_head_dim = 256;

// Value d of a row of n: an element's value, or a row format's value_at (a row of codes and
// scales, kvc::int4_row and the others), without NVFP4's tensor scale: an attention_row's sk and
// sv carry it, as they carry fp8's scales.
template <class KV>
KVC_HOST_DEVICE float value_of(const KV* row, std::int64_t d, std::int64_t n) noexcept {
  if constexpr (is_row_format<KV>)
    return KV::value_at(row, d, n);
  else
    return to_float(row[d]);
}

// The host's single lane (the device's warp lanes are in cuda_attention.cuh). Lanes: `count`,
// index(), sum(x) over the lanes, and sync() (host runners: all lanes reached this point).
struct one_lane {
  static constexpr int count = 1;
  KVC_HOST_DEVICE static constexpr int index() noexcept { return 0; }
  KVC_HOST_DEVICE static constexpr float sum(float x) noexcept { return x; }
  static constexpr void sync() noexcept {}
};

// One row's running softmax over the keys seen so far: maximum score m (-inf before any), sum
// l of exp(score - m), and this lane's dims of sum exp(score - m) * value.
template <int PerLane>
struct row_partial {
  float m;
  float l;
  float acc[static_cast<std::size_t>(PerLane)];
};

// One row of a problem: its query and output rows, its visible key range [lo, hi) (key indices of
// `keys`), where its keys are, and its scales (sk: softmax scale times the KV head's key scale,
// folded into the query; sv: the value scale, applied to the output).
template <class T, class Keys>
struct attention_row {
  const T* q;
  T* out;
  std::int64_t lo, hi;
  Keys keys;
  float sk, sv;
};

// Keys of one (batch, KV head) block of a contiguous layer: key j at k + j * kpitch. pad: the batch
// row's key_padding_mask entries from key 0 on (null: none), 0 = padding.
template <class KV>
struct dense_keys {
  const KV* k;
  const KV* v;
  std::int64_t kpitch, vpitch;
  const std::uint8_t* pad;
  KVC_HOST_DEVICE const KV* key(std::int64_t j) const noexcept { return k + j * kpitch; }
  KVC_HOST_DEVICE const KV* value(std::int64_t j) const noexcept { return v + j * vpitch; }
  KVC_HOST_DEVICE bool keep(std::int64_t j) const noexcept { return pad == nullptr || pad[j] != 0; }
};

// Keys of one request and KV head in a paged step: key index = absolute position p. Cached
// positions (p < past) live in the pools at the request's block table (a sliding group's ring
// slot p % window); the step's own tokens (p >= past) in the step's keys at row p - past. A pool
// of row codes gives rows of its key format and of its value format (a kvc::kv_codes pool's two).
template <class KV>
struct paged_keys {
  using key_row = key_format_t<KV>;
  using value_row = value_format_t<KV>;
  const KV* kpool;   // this KV head's rows of the pool: [pool rows, kwidth]
  const KV* vpool;   // [pool rows, vwidth]
  const KV* kfresh;  // this request's first new token of this KV head
  const KV* vfresh;
  std::int64_t kfresh_pitch, vfresh_pitch;
  const std::int64_t* table;  // the request's blocks, in table order
  std::int64_t block_size, window, past;
  std::int64_t kwidth, vwidth;  // a row's elements in the pools: head_dim, or row codes' bytes
  KVC_HOST_DEVICE std::int64_t pool_row(std::int64_t p) const noexcept {
    const std::int64_t slot = window > 0 ? p % window : p;
    return table[slot / block_size] * block_size + slot % block_size;
  }
  KVC_HOST_DEVICE const key_row* key(std::int64_t p) const noexcept {
    return reinterpret_cast<const key_row*>(p >= past ? kfresh + (p - past) * kfresh_pitch
                                                      : kpool + pool_row(p) * kwidth);
  }
  KVC_HOST_DEVICE const value_row* value(std::int64_t p) const noexcept {
    return reinterpret_cast<const value_row*>(p >= past ? vfresh + (p - past) * vfresh_pitch
                                                        : vpool + pool_row(p) * vwidth);
  }
  KVC_HOST_DEVICE static constexpr bool keep(std::int64_t) noexcept { return true; }
};

// A per-KV-head scale list (null: every scale is 1), one entry (per tensor) or one per head.
struct head_scales {
  const float* values = nullptr;
  bool per_head = false;
  KVC_HOST_DEVICE float at(std::int64_t h) const noexcept {
    return values == nullptr ? 1.0f : values[per_head ? h : 0];
  }
};

// Shared by the two problems: sizes, softmax scale and the K/V scales.
struct problem_base {
  std::int64_t Hq, Hkv, D, Dv;
  float scale;  // softmax scale
  head_scales key_scales, value_scales;
  KVC_HOST_DEVICE std::int64_t group() const noexcept { return Hq / Hkv; }

  // The sizes, with the softmax scale defaulting to 1 / sqrt(D) as attention's does.
  static problem_base of(std::int64_t Hq, std::int64_t Hkv, std::int64_t D, std::int64_t Dv,
                         std::optional<double> scale, head_scales key_scales, head_scales value_scales) {
    return {
        Hq,         Hkv,         D, Dv, static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D))),
        key_scales, value_scales};
  }
};

// scaled_dot_product_attention's problem (AttentionMask's rules, attention.hpp). Row
// ((b * Hkv + hk) * q + t) * group + g is query token t of head hk * group + g in batch entry b.
template <class T, class KV>
struct dense_problem : problem_base {
  using value_type = T;
  const T* q;
  const KV* k;
  const KV* v;
  T* out;  // dense [B, Hq, q, Dv]
  std::int64_t B, Q, S;
  std::int64_t qs[3], ks[3], vs[3];                       // strides of batch, head and token
  std::int64_t kv_offset, query_position, window, chunk;  // window, chunk: 0 for none
  bool causal;
  const std::uint8_t* pad;  // key_padding_mask [B, pad_width], or null
  std::int64_t pad_width;

  KVC_HOST_DEVICE std::int64_t rows() const noexcept { return B * Hkv * Q * group(); }
  KVC_HOST_DEVICE attention_row<T, dense_keys<KV>> row(std::int64_t i) const noexcept {
    const std::int64_t G = group();
    const std::int64_t g = i % G, t = (i / G) % Q, hk = (i / (G * Q)) % Hkv, b = i / (G * Q * Hkv);
    const std::int64_t h = hk * G + g, qp = query_position + t;
    const std::int64_t hi = causal ? std::clamp<std::int64_t>(qp - kv_offset + 1, 0, S) : S;
    const std::int64_t lo = std::clamp<std::int64_t>(first_visible_position(qp, window, chunk) - kv_offset, 0, S);
    return {q + b * qs[0] + h * qs[1] + t * qs[2],
            out + ((b * Hq + h) * Q + t) * Dv,
            lo,
            hi > lo ? hi : lo,
            {k + b * ks[0] + hk * ks[1], v + b * vs[0] + hk * vs[1], ks[2], vs[2],
             pad != nullptr ? pad + b * pad_width + kv_offset : nullptr},
            scale * key_scales.at(hk),
            value_scales.at(hk)};
  }
};

// paged_attention's problem (paged_attention.hpp): R requests packed in T query tokens. Row
// (hk * T + t) * group + g is token t of head hk * group + g; token t belongs to the request r with
// cu[r] <= t < cu[r + 1] and sits at position past[r] + t - cu[r].
template <class T, class KV>
struct paged_problem : problem_base {
  using value_type = T;
  const T* q;   // [1, Hq, T, D]
  const KV* k;  // the step's keys [1, Hkv, T, D]
  const KV* v;
  T* out;                                             // dense [1, Hq, T, D]
  const KV* kpool;                                    // [Hkv, pool_rows, W]
  const KV* vpool;                                    // [Hkv, pool_rows, Wv]
  std::int64_t Tq, R, pool_rows, block_size, window;  // window: 0 for a full-attention group
  std::int64_t W, Wv;  // a key and a value row's elements in the pools and the step (D, or row codes' bytes)
  std::int64_t qs[2], ks[2], vs[2];  // strides of head and token
  const std::int64_t* cu;            // R + 1
  const std::int64_t* past;          // R
  const std::int64_t* tables;        // [R, table_width]
  std::int64_t table_width;

  KVC_HOST_DEVICE std::int64_t rows() const noexcept { return Hkv * Tq * group(); }
  KVC_HOST_DEVICE attention_row<T, paged_keys<KV>> row(std::int64_t i) const noexcept {
    const std::int64_t G = group();
    const std::int64_t g = i % G, t = (i / G) % Tq, hk = i / (G * Tq), h = hk * G + g;
    std::int64_t lo_r = 0, hi_r = R;  // the request of token t: the last r with cu[r] <= t
    while (hi_r - lo_r > 1) {
      const std::int64_t mid = (lo_r + hi_r) / 2;
      (cu[mid] <= t ? lo_r : hi_r) = mid;
    }
    const std::int64_t r = lo_r, qp = past[r] + t - cu[r];
    const std::int64_t lo = window > 0 && qp - window + 1 > 0 ? qp - window + 1 : 0;
    return {
        q + h * qs[0] + t * qs[1],
        out + (h * Tq + t) * D,
        lo,
        qp + 1,
        {kpool + hk * pool_rows * W, vpool + hk * pool_rows * Wv, k + hk * ks[0] + cu[r] * ks[1],
         v + hk * vs[0] + cu[r] * vs[1], ks[1], vs[1], tables + r * table_width, block_size, window, past[r], W, Wv},
        scale * key_scales.at(hk),
        value_scales.at(hk)};
  }
};

// The device kernels' problem for scaled_dot_product_attention's arguments (checked as it checks
// them): out a dense [B, Hq, q, Dv]; pad the key_padding_mask in the memory the kernels read (null
// when the mask has none).
template <class QView, class KVView, class T = std::remove_const_t<typename QView::element_type>,
          class KV = std::remove_const_t<typename KVView::element_type>>
dense_problem<T, KV> make_dense_problem(const QView& q, const KVView& k, const KVView& v, const AttentionMask& mask,
                                        std::optional<double> scale, T* out, head_scales key_scales,
                                        head_scales value_scales, const std::uint8_t* pad) {
  check_attention_views(q, k, v, mask);
  dense_problem<T, KV> p{};
  static_cast<problem_base&>(p) =
      problem_base::of(q.extent(1), k.extent(1), q.extent(3), v.extent(3), scale, key_scales, value_scales);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.out = out;
  p.B = q.extent(0);
  p.Q = q.extent(2);
  p.S = k.extent(2);
  for (int r = 0; r < 3; ++r) {
    p.qs[r] = q.stride(r);
    p.ks[r] = k.stride(r);
    p.vs[r] = v.stride(r);
  }
  p.kv_offset = mask.kv_offset;
  p.query_position = mask.query_position;
  p.window = mask.sliding_window.value_or(0);
  p.chunk = mask.attention_chunk_size.value_or(0);
  p.causal = mask.causal;
  p.pad = mask.key_padding_mask.empty() ? nullptr : pad;
  p.pad_width = p.B > 0 ? static_cast<std::int64_t>(mask.key_padding_mask.size()) / p.B : 0;
  return p;
}

// Row `row`'s keys [j0, j1) (within its visible range) into `part`, for this lane's dims of the
// query, which q holds already multiplied by row.sk.
template <int PerLane, class Lanes, class T, class Keys>
KVC_HOST_DEVICE void attend_range(const attention_row<T, Keys>& row,
                                  const float (&q)[static_cast<std::size_t>(PerLane)], std::int64_t D, std::int64_t Dv,
                                  std::int64_t j0, std::int64_t j1, const Lanes& lanes, row_partial<PerLane>& part) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int lane = lanes.index();
  part.m = neg_inf;
  part.l = 0.0f;
  for (int i = 0; i < PerLane; ++i) part.acc[i] = 0.0f;
  for (std::int64_t j = j0; j < j1; ++j) {
    if (!row.keys.keep(j)) continue;
    const auto* kr = row.keys.key(j);
    float dot = 0.0f;
    for (int i = 0; i < PerLane; ++i) {
      const std::int64_t d = lane + std::int64_t{i} * Lanes::count;
      if (d < D) dot += q[i] * value_of(kr, d, D);
    }
    const float score = lanes.sum(dot);
    const float m = score > part.m ? score : part.m;
    const float correction = expf(part.m - m);  // 0 for the first key (m was -inf)
    const float p = expf(score - m);
    part.l = part.l * correction + p;
    part.m = m;
    const auto* vr = row.keys.value(j);
    for (int i = 0; i < PerLane; ++i) {
      const std::int64_t d = lane + std::int64_t{i} * Lanes::count;
      if (d < Dv) part.acc[i] = part.acc[i] * correction + p * value_of(vr, d, Dv);
    }
  }
}

// The keys of split s of a row whose visible range is [lo, hi): [first, last).
KVC_HOST_DEVICE inline void split_range(std::int64_t lo, std::int64_t hi, std::int64_t chunk, std::int64_t s,
                                        std::int64_t& first, std::int64_t& last) noexcept {
  first = lo + s * chunk < hi ? lo + s * chunk : hi;
  last = first + chunk < hi ? first + chunk : hi;
}

// The weight of a partial whose maximum is m in a merge whose maximum is top (0 for an empty one).
KVC_HOST_DEVICE inline float partial_weight(float m, float top) noexcept {
  return m == -std::numeric_limits<float>::infinity() ? 0.0f : expf(m - top);
}

// Split-KV sizing: keys per split for rows whose widest visible range is max_width, so that about
// `target` (row, split) items keep the device busy, and splits of fewer than 256 keys are not
// made. Returns the chunk (>= 1); splits = ceil(max_width / chunk).
inline std::int64_t split_chunk(std::int64_t rows, std::int64_t max_width, std::int64_t target) noexcept {
  if (max_width <= 0) return 1;
  const std::int64_t wanted = std::max<std::int64_t>(1, target / std::max<std::int64_t>(rows, 1));
  const std::int64_t chunk = (max_width + wanted - 1) / wanted;
  return std::max<std::int64_t>(std::min<std::int64_t>(256, max_width), chunk);
}

// The problem's widest visible key range (host code, for split_chunk).
template <class Problem>
std::int64_t max_row_width(const Problem& p) {
  std::int64_t w = 0;
  for (std::int64_t i = 0; i < p.rows(); i += p.group()) {  // the rows of a group share their range
    const auto r = p.row(i);
    w = std::max(w, r.hi - r.lo);
  }
  return w;
}

// The kernels' bodies. attention_row_split: this lane's part of row i's split s; with one split it
// writes the output row, else the partial (m, l, acc) at row_partials + s * (2 + Dv).
template <int PerLane, class Problem, class Lanes>
KVC_HOST_DEVICE void attention_row_split(const Problem& p, std::int64_t i, std::int64_t s, std::int64_t chunk,
                                         std::int64_t splits, float* row_partials, const Lanes& lanes) {
  const auto row = p.row(i);
  const int lane = lanes.index();
  float q[static_cast<std::size_t>(PerLane)];
  for (int k = 0; k < PerLane; ++k) {
    const std::int64_t d = lane + std::int64_t{k} * Lanes::count;
    q[k] = d < p.D ? to_float(row.q[d]) * row.sk : 0.0f;
  }
  std::int64_t first = 0, last = 0;
  split_range(row.lo, row.hi, chunk, s, first, last);
  row_partial<PerLane> part;
  attend_range(row, q, p.D, p.Dv, first, last, lanes, part);
  if (splits == 1) {
    for (int k = 0; k < PerLane; ++k) {
      const std::int64_t d = lane + std::int64_t{k} * Lanes::count;
      if (d < p.Dv)
        row.out[d] = from_float<typename Problem::value_type>(part.l > 0.0f ? part.acc[k] / part.l * row.sv : 0.0f);
    }
    return;
  }
  float* slot = row_partials + s * (2 + p.Dv);
  if (lane == 0) {
    slot[0] = part.m;
    slot[1] = part.l;
  }
  for (int k = 0; k < PerLane; ++k) {
    const std::int64_t d = lane + std::int64_t{k} * Lanes::count;
    if (d < p.Dv) slot[2 + d] = part.acc[k];
  }
}

// attention_row_merge: row i's partials (row_partials, `splits` of them) merged into its output
// row; this lane writes dims lane, lane + count, ...
template <class Problem, class Lanes>
KVC_HOST_DEVICE void attention_row_merge(const Problem& p, std::int64_t i, std::int64_t splits,
                                         const float* row_partials, const Lanes& lanes) {
  const auto row = p.row(i);
  const std::int64_t pitch = 2 + p.Dv;
  float top = -std::numeric_limits<float>::infinity(), l = 0.0f;
  for (std::int64_t s = 0; s < splits; ++s) top = row_partials[s * pitch] > top ? row_partials[s * pitch] : top;
  for (std::int64_t s = 0; s < splits; ++s)
    l += row_partials[s * pitch + 1] * partial_weight(row_partials[s * pitch], top);
  for (std::int64_t d = lanes.index(); d < p.Dv; d += Lanes::count) {
    float acc = 0.0f;
    for (std::int64_t s = 0; s < splits; ++s)
      acc += row_partials[s * pitch + 2 + d] * partial_weight(row_partials[s * pitch], top);
    row.out[d] = from_float<typename Problem::value_type>(l > 0.0f ? acc / l * row.sv : 0.0f);
  }
}

// The number of splits of `chunk` keys a problem whose widest row sees max_width keys takes.
inline std::int64_t split_count(std::int64_t max_width, std::int64_t chunk) noexcept {
  return max_width > chunk ? (max_width + chunk - 1) / chunk : 1;
}

// The problem computed on the host by the kernels' bodies with `lanes` (one_lane: PerLane must
// cover head_dim; emulated warp lanes in the tests, which share `partials`), split as the device
// would split it with `chunk` keys per split: split_count(max_row_width(p), chunk) splits, whose
// partials (2 + Dv floats each) one row at a time uses. Rows with no visible key get zeros.
template <int PerLane, class Problem, class Lanes>
void attention_rows_host(const Problem& p, std::int64_t chunk, const Lanes& lanes, float* partials) {
  const std::int64_t splits = split_count(max_row_width(p), chunk);
  for (std::int64_t i = 0; i < p.rows(); ++i) {
    for (std::int64_t s = 0; s < splits; ++s) attention_row_split<PerLane>(p, i, s, chunk, splits, partials, lanes);
    if (splits > 1) {
      lanes.sync();  // every lane's partial is written before any lane merges
      attention_row_merge(p, i, splits, partials, lanes);
      lanes.sync();  // and read before the next row overwrites them
    }
  }
}

// The same with one lane holding every dim.
template <class Problem>
void attention_rows_host(const Problem& p, std::int64_t chunk) {
  std::vector<float> partials(static_cast<std::size_t>(split_count(max_row_width(p), chunk) * (2 + p.Dv)));
  attention_rows_host<static_cast<int>(max_device_head_dim)>(p, chunk, one_lane{}, partials.data());
}

}  // namespace kvc::detail

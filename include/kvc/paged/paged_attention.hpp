#pragma once
// kvc::paged_attention: attention for one step of a continuous batch, reading the cached keys and
// values straight from a kvc::PagedCache's pools through each request's block table (no gather of
// a request's history into a contiguous copy).
//
// The step packs R requests one after another: request r has q_r = cu_seqlens_q[r + 1] -
// cu_seqlens_q[r] new tokens (its query rows in `queries`, its new keys and values at the same
// rows of `keys` and `values`) after past[r] cached tokens. A query at absolute position qp of
// request r sees that request's keys at positions kp <= qp (causal, within the request: no
// request sees another), and in a sliding layer of window W only kp > qp - W. Cached keys
// (kp < past[r]) come from the pools; the step's own keys from `keys`/`values`, as
// flash_attn_with_kvcache takes k_new. Nothing is written: store the step with the cache's update
// (a write-only update when nothing else needs the gathered keys) after this call: a sliding
// group writes a new token into the ring slot of a key the step's earlier queries still see.
//
// A full-attention group keeps position p at block table[p / block_size], row p % block_size; a
// sliding group keeps it in ring slot p % W (docs/paged.md). The pools are head-major, so the
// keys of one head in one block are one contiguous [rows, head_dim] piece, read in place (widened
// to float first for half and bfloat16). A decode step scores each key row against the few query
// rows with plain dot products while the row is in cache, takes an exact softmax, then adds each
// value row the same way; a prefill chunk multiplies whole blocks with an online softmax (running
// maximum and sum). Scores accumulate in float (double for double). Grouped-query and multi-query
// attention: query head h reads KV head h / (Hq / Hkv), and the query heads of one KV head share
// each block read.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include <kvc/attention.hpp>
#include <kvc/detail/attention_rows.hpp>
#include <kvc/errors.hpp>
#include <kvc/paged/attention_step.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// A run of consecutive key positions whose rows in one head's pool are consecutive too.
struct pool_run {
  std::int64_t position;  // absolute position of the first key
  std::int64_t row;       // its pool row
  std::int64_t count;
};

// The runs covering positions [lo, hi) of a request's cached keys in a group: cut at block
// boundaries, and for a sliding group (window > 0) at the ring's wrap.
inline void cached_runs(const std::vector<std::int64_t>& table, std::int64_t block_size, std::int64_t window,
                        std::int64_t lo, std::int64_t hi, const std::string& request, std::vector<pool_run>& out) {
  out.clear();
  for (std::int64_t p = lo; p < hi;) {
    const std::int64_t slot = window > 0 ? p % window : p;
    const std::int64_t block = slot / block_size, offset = slot % block_size;
    if (block >= static_cast<std::int64_t>(table.size()))
      throw ValueError("kvc::paged_attention: request " + request + " has " + std::to_string(table.size()) +
                       " blocks, too few for its cached position " + std::to_string(p));
    std::int64_t n = std::min(block_size - offset, hi - p);
    if (window > 0) n = std::min(n, window - slot);  // the ring wraps to slot 0
    out.push_back({p, table[static_cast<std::size_t>(block)] * block_size + offset, n});
    p += n;
  }
}

// The checked geometry of one paged_attention call (host or device views): the layer's group and
// pool tensor, sizes, and the group's window (0: full attention).
struct paged_call {
  std::int64_t group, pool, Hkv, D, block_size, Hq, T, R, window, pool_rows;
};

// Every check of paged_attention on shapes and the step's layout: ValueError.
template <class S, class QView, class KVView>
paged_call check_paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                                 const QView& queries, const KVView& keys, const KVView& values) {
  const auto [group, pool] = cache.layer_group(layer_idx);
  const std::int64_t Hkv = cache.num_key_value_heads(), D = cache.head_dim(), bs = cache.block_size();
  const std::int64_t Hq = queries.extent(1), T_ = queries.extent(2);
  const auto R = static_cast<std::int64_t>(step.requests.size());
  if (queries.extent(0) != 1 || queries.extent(3) != D || Hq < 1 || Hq % Hkv != 0)
    throw ValueError("kvc::paged_attention: queries must be [1, a multiple of " + std::to_string(Hkv) +
                     " heads, tokens, " + std::to_string(D) + "], got " + shape_string(queries.extents));
  for (const KVView* x : {&keys, &values})
    if (x->extents != std::array<std::int64_t, 4>{1, Hkv, T_, D})
      throw ValueError("kvc::paged_attention: keys and values must be [1, " + std::to_string(Hkv) + ", " +
                       std::to_string(T_) + ", " + std::to_string(D) + "] like the queries' tokens, got " +
                       shape_string(x->extents));
  if (queries.stride(3) != 1 || keys.stride(3) != 1 || values.stride(3) != 1)
    throw ValueError("kvc::paged_attention: tensors must have contiguous head_dim rows");
  const auto cu = step.cu_seqlens_q;
  bool layout_ok = static_cast<std::int64_t>(cu.size()) == R + 1 && static_cast<std::int64_t>(step.past.size()) == R &&
                   !cu.empty() && cu.front() == 0 && cu.back() == T_;
  for (std::int64_t r = 0; layout_ok && r < R; ++r)
    layout_ok = cu[static_cast<std::size_t>(r + 1)] >= cu[static_cast<std::size_t>(r)] &&
                step.past[static_cast<std::size_t>(r)] >= 0;
  if (!layout_ok)
    throw ValueError("kvc::paged_attention: a step of " + std::to_string(R) + " requests needs " +
                     std::to_string(R + 1) + " non-decreasing cu_seqlens_q from 0 to the " + std::to_string(T_) +
                     " query tokens, and " + std::to_string(R) + " cached lengths >= 0");
  if (!step.keys.empty() && static_cast<std::int64_t>(step.keys.size()) != R)
    throw ValueError("kvc::paged_attention: a step of " + std::to_string(R) + " requests has " +
                     std::to_string(step.keys.size()) + " keys (give none, or one per request)");
  const bool sliding = cache.is_sliding_group(group);
  return {group, pool, Hkv, D, bs, Hq, T_, R, sliding ? cache.sliding_window() : 0, (cache.num_blocks() + 2) * bs};
}

// Request i's block table in `group`, by its key where the step has keys.
template <class S>
const std::vector<std::int64_t>& step_table(const PagedCache<S>& cache, std::int64_t group,
                                            const PagedAttentionStep& step, std::size_t i) {
  if (step.keys.empty()) return cache.block_table(group, step.requests[i]);
  return cache.block_table(group, step.keys[i]);
}

// The block tables of a step's requests for a kernel: [R, width] (row r: request r's table, padded
// with block 0), checked to cover every cached key a query sees (cached_runs' error otherwise).
// Requests without query tokens get a padding row only.
template <class S>
std::vector<std::int64_t> paged_tables(const PagedCache<S>& cache, const paged_call& call,
                                       const PagedAttentionStep& step, std::int64_t& width) {
  std::vector<const std::vector<std::int64_t>*> tables(static_cast<std::size_t>(call.R), nullptr);
  std::vector<pool_run> runs;
  width = 1;
  for (std::int64_t r = 0; r < call.R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (step.cu_seqlens_q[i + 1] == step.cu_seqlens_q[i]) continue;
    const std::int64_t past = step.past[i];
    const auto& table = step_table(cache, call.group, step, i);
    cached_runs(table, call.block_size, call.window,
                call.window > 0 ? std::max<std::int64_t>(past - call.window + 1, 0) : 0, past, step.requests[i], runs);
    tables[i] = &table;
    width = std::max(width, static_cast<std::int64_t>(table.size()));
  }
  std::vector<std::int64_t> out(static_cast<std::size_t>(call.R * width), 0);
  for (std::int64_t r = 0; r < call.R; ++r)
    if (tables[static_cast<std::size_t>(r)])
      std::copy(tables[static_cast<std::size_t>(r)]->begin(), tables[static_cast<std::size_t>(r)]->end(),
                out.begin() + r * width);
  return out;
}

// The device kernels' problem for a checked call: q, k, v the step's views, out a dense
// [1, Hq, T, D]; cu, past and tables (paged_tables, `width` wide) in the memory the kernels read.
template <class S, class QView, class KVView, class T = typename QView::element_type,
          class KV = typename KVView::element_type>
paged_problem<std::remove_const_t<T>, std::remove_const_t<KV>> make_paged_problem(
    const PagedCache<S>& cache, const paged_call& call, const QView& q, const KVView& k, const KVView& v,
    std::remove_const_t<T>* out, const std::int64_t* cu, const std::int64_t* past, const std::int64_t* tables,
    std::int64_t width, std::optional<double> scale, head_scales key_scales, head_scales value_scales) {
  paged_problem<std::remove_const_t<T>, std::remove_const_t<KV>> p{};
  static_cast<problem_base&>(p) = problem_base::of(call.Hq, call.Hkv, call.D, call.D, scale, key_scales, value_scales);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.out = out;
  p.kpool = cache.key_pool(call.pool);
  p.vpool = cache.value_pool(call.pool);
  p.Tq = call.T;
  p.R = call.R;
  p.pool_rows = call.pool_rows;
  p.block_size = call.block_size;
  p.window = call.window;
  p.qs[0] = q.stride(1);
  p.qs[1] = q.stride(2);
  p.ks[0] = k.stride(1);
  p.ks[1] = k.stride(2);
  p.vs[0] = v.stride(1);
  p.vs[1] = v.stride(2);
  p.cu = cu;
  p.past = past;
  p.tables = tables;
  p.table_width = width;
  return p;
}
}  // namespace detail

namespace detail {

// paged_attention with queries of type T over a pool of S::element_type (T, or fp8 codes) whose
// KV head hk's keys and values stand for scales.key_scale(hk) and value_scale(hk) times their
// values (detail::unit_scales: themselves).
template <class S, class T, class Scales>
HostTensor<T> paged_attention_impl(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                                   const TensorView<T>& queries, const TensorView<typename S::element_type>& keys,
                                   const TensorView<typename S::element_type>& values, std::optional<double> scale,
                                   const Scales& scales) {
  using KV = typename S::element_type;
  using A = accum_t<T>;
  const paged_call call = check_paged_attention(cache, layer_idx, step, queries, keys, values);
  const std::int64_t Hkv = call.Hkv, D = call.D, bs = call.block_size, Hq = call.Hq, R = call.R, T_ = call.T;
  const bool sliding = call.window > 0;
  const std::int64_t window = call.window, pool_rows = call.pool_rows;
  const auto cu = step.cu_seqlens_q;
  const KV* kpool = cache.key_pool(call.pool);
  const KV* vpool = cache.value_pool(call.pool);
  const A s = static_cast<A>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const std::int64_t heads_per_kv = Hq / Hkv;

  // The runs of every request first: a table too short is refused before anything is computed.
  std::vector<std::vector<pool_run>> runs(static_cast<std::size_t>(R));
  for (std::int64_t r = 0; r < R; ++r) {
    const std::string& id = step.requests[static_cast<std::size_t>(r)];
    const std::int64_t past = step.past[static_cast<std::size_t>(r)];
    const std::int64_t q = cu[static_cast<std::size_t>(r + 1)] - cu[static_cast<std::size_t>(r)];
    // The cached keys any of its queries sees: all of them, or the window's for a sliding group.
    const std::int64_t lo = sliding ? std::max<std::int64_t>(past - window + 1, 0) : 0;
    if (q > 0) {
      const auto& table = step_table(cache, call.group, step, static_cast<std::size_t>(r));
      cached_runs(table, bs, window, lo, past, id, runs[static_cast<std::size_t>(r)]);
    }
  }

  HostTensor<T> out(1, Hq, T_, D);
  out.setZero();
  // A tile of query rows (the query heads of one KV head, `tile` positions each) makes one pass
  // over the keys. A decode tile (few rows) scores every visible key first, then takes an exact
  // softmax and one pass over the values: per key (value) row, one dot product (one scaled add)
  // per query row, which costs less than a matrix product's packing on blocks this small. A
  // larger tile runs matrix products block by block with an online softmax, so its scores never
  // outgrow one block.
  constexpr std::int64_t tile = 64, decode_rows = 16;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const std::int64_t head_pitch = pool_rows * D;
  struct chunk {
    const KV* k;
    const KV* v;
    std::int64_t kpitch, vpitch, position, count;
  };
  std::vector<chunk> chunks;
  row_matrix<A> qbuf, kbuf, vbuf, scores, acc;
  Eigen::Matrix<A, Eigen::Dynamic, 1> m, l, corr;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t past = step.past[static_cast<std::size_t>(r)];
    const std::int64_t t0 = cu[static_cast<std::size_t>(r)], q = cu[static_cast<std::size_t>(r + 1)] - t0;
    for (std::int64_t hk = 0; hk < Hkv; ++hk) {
      const A sk = s * static_cast<A>(scales.key_scale(hk)), sv = static_cast<A>(scales.value_scale(hk));
      // The keys of this request and head in position order: the cached runs, then the step's own.
      chunks.clear();
      for (const pool_run& run : runs[static_cast<std::size_t>(r)])
        chunks.push_back({kpool + hk * head_pitch + run.row * D, vpool + hk * head_pitch + run.row * D, D, D,
                          run.position, run.count});
      chunks.push_back({keys.data() + hk * keys.stride(1) + t0 * keys.stride(2),
                        values.data() + hk * values.stride(1) + t0 * values.stride(2), keys.stride(2), values.stride(2),
                        past, q});
      for (std::int64_t i0 = 0; i0 < q; i0 += tile) {
        const std::int64_t per_head = std::min(tile, q - i0), rows = heads_per_kv * per_head;
        const std::int64_t first_q = past + i0, last_q = first_q + per_head - 1;
        // Keys any row of the tile sees: positions [lo, last_q].
        const std::int64_t lo = sliding ? std::max<std::int64_t>(first_q - window + 1, 0) : 0;
        qbuf.resize(rows, D);
        for (std::int64_t g = 0; g < heads_per_kv; ++g) {
          const std::int64_t h = hk * heads_per_kv + g;
          for (std::int64_t i = 0; i < per_head; ++i) {
            const T* qp = queries.data() + h * queries.stride(1) + (t0 + i0 + i) * queries.stride(2);
            for (std::int64_t d = 0; d < D; ++d) qbuf(g * per_head + i, d) = static_cast<A>(qp[d]);
          }
        }
        // Row `row`'s visible columns [jlo, jhi) of keys at positions p0 .. p0 + n - 1.
        auto visible = [&](std::int64_t row, std::int64_t p0, std::int64_t n) {
          const std::int64_t qpos = first_q + row % per_head;
          const std::int64_t jhi = std::clamp<std::int64_t>(qpos - p0 + 1, 0, n);
          const std::int64_t jlo = sliding ? std::clamp<std::int64_t>(qpos - window + 1 - p0, 0, n) : 0;
          return std::pair<std::int64_t, std::int64_t>{jlo, std::max(jlo, jhi)};
        };
        // fn(keys, values, p0, n) for each chunk's part in [lo, last_q]: the keys and values at
        // positions p0 .. p0 + n - 1, each an [n, D] block read as A (in place, or widened) on call.
        auto for_each_chunk = [&](auto&& fn) {
          for (const chunk& c : chunks) {
            const std::int64_t p0 = std::max(c.position, lo), p1 = std::min(c.position + c.count, last_q + 1);
            if (p1 <= p0) continue;
            const KV* kp = c.k + (p0 - c.position) * c.kpitch;
            const KV* vp = c.v + (p0 - c.position) * c.vpitch;
            fn([&, kp, c, p0, p1] { return as_accum<A>(kp, p1 - p0, D, c.kpitch, kbuf); },
               [&, vp, c, p0, p1] { return as_accum<A>(vp, p1 - p0, D, c.vpitch, vbuf); }, p0, p1 - p0);
          }
        };
        if (rows <= decode_rows) {
          const std::int64_t width = last_q + 1 - lo;
          scores.resize(rows, width);
          for_each_chunk([&](auto keys_of, auto, std::int64_t p0, std::int64_t n) {
            const auto K = keys_of();
            for (std::int64_t j = 0; j < n; ++j) {
              const Eigen::Map<const Eigen::Matrix<A, 1, Eigen::Dynamic>> key(K.data() + j * K.outerStride(), D);
              for (std::int64_t row = 0; row < rows; ++row) scores(row, p0 - lo + j) = qbuf.row(row).dot(key);
            }
          });
          scores *= sk;
          for (std::int64_t row = 0; row < rows; ++row) {
            const auto [jlo, jhi] = visible(row, lo, width);
            auto sr = scores.row(row);
            sr.head(jlo).setZero();
            sr.tail(width - jhi).setZero();
            if (jhi == jlo) continue;  // nothing visible: a zero output row
            auto seg = sr.segment(jlo, jhi - jlo);
            const A max = seg.maxCoeff();
            seg = (seg.array() - max).exp().matrix();
            seg /= seg.sum();
          }
          acc.setZero(rows, D);
          for_each_chunk([&](auto, auto values_of, std::int64_t p0, std::int64_t n) {
            const auto V = values_of();
            for (std::int64_t j = 0; j < n; ++j) {
              const Eigen::Map<const Eigen::Matrix<A, 1, Eigen::Dynamic>> value(V.data() + j * V.outerStride(), D);
              for (std::int64_t row = 0; row < rows; ++row) acc.row(row) += scores(row, p0 - lo + j) * value;
            }
          });
          l.setOnes(rows);
        } else {
          acc.setZero(rows, D);
          m.setConstant(rows, neg_inf);
          l.setZero(rows);
          corr.resize(rows);
          for_each_chunk([&](auto keys_of, auto values_of, std::int64_t p0, std::int64_t n) {
            scores.noalias() = (qbuf * keys_of().transpose()) * sk;
            for (std::int64_t row = 0; row < rows; ++row) {
              const auto [jlo, jhi] = visible(row, p0, n);
              auto sr = scores.row(row);
              sr.head(jlo).setConstant(neg_inf);
              sr.tail(n - jhi).setConstant(neg_inf);
              const A next = jhi > jlo ? std::max(m(row), sr.segment(jlo, jhi - jlo).maxCoeff()) : m(row);
              if (next == neg_inf) {  // nothing visible yet
                corr(row) = A(1);
                sr.setZero();
                continue;
              }
              corr(row) = std::exp(m(row) - next);
              sr = (sr.array() - next).exp().matrix();
              m(row) = next;
            }
            l = l.cwiseProduct(corr) + scores.rowwise().sum();
            acc = corr.asDiagonal() * acc;
            acc.noalias() += scores * values_of();
          });
        }
        for (std::int64_t g = 0; g < heads_per_kv; ++g) {
          const std::int64_t h = hk * heads_per_kv + g;
          for (std::int64_t i = 0; i < per_head; ++i) {
            const std::int64_t row = g * per_head + i;
            const A inv = l(row) > A(0) ? sv / l(row) : A(0);
            for (std::int64_t d = 0; d < D; ++d) out(0, h, t0 + i0 + i, d) = static_cast<T>(acc(row, d) * inv);
          }
        }
      }
    }
  }
  return out;
}

}  // namespace detail

// Attention of layer `layer_idx` for the step: queries [1, Hq, T, head_dim], keys and values
// [1, Hkv, T, head_dim] (the step's new tokens, packed as the queries), Hkv the cache's KV heads
// and Hq a multiple of it. Returns [1, Hq, T, head_dim]. `scale` defaults to 1 / sqrt(head_dim).
template <class S>
HostTensor<typename S::element_type> paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx,
                                                     const PagedAttentionStep& step,
                                                     const TensorView<typename S::element_type>& queries,
                                                     const TensorView<typename S::element_type>& keys,
                                                     const TensorView<typename S::element_type>& values,
                                                     std::optional<double> scale = std::nullopt) {
  return detail::paged_attention_impl(cache, layer_idx, step, queries, keys, values, scale, detail::unit_scales{});
}

// The same over a pool of fp8 codes (PagedCache<HostStorage<float8_e4m3>> or <float8_e5m2>,
// <kvc/fp8_attention.hpp>): queries of the model's type T; keys and values the step's tokens as
// the codes kvc::to_fp8 made with `scales` (kvc::Fp8Scales: per tensor or per KV head), which the
// pool's codes share. Returns [1, Hq, T, head_dim] in T.
template <class S, class T, class Scales>
  requires requires(const Scales& sc) {
    { sc.key_scale(std::int64_t{0}) } -> std::convertible_to<float>;
    { sc.value_scale(std::int64_t{0}) } -> std::convertible_to<float>;
  }
HostTensor<T> paged_attention(const PagedCache<S>& cache, std::int64_t layer_idx, const PagedAttentionStep& step,
                              const TensorView<T>& queries, const TensorView<typename S::element_type>& keys,
                              const TensorView<typename S::element_type>& values, const Scales& scales,
                              std::optional<double> scale = std::nullopt) {
  return detail::paged_attention_impl(cache, layer_idx, step, queries, keys, values, scale, scales);
}

}  // namespace kvc

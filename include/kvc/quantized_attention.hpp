#pragma once
// kvc::attend_quantized: attention straight from a quantized layer's codes.
//
// kvc::attend on a QuantizedLayer follows transformers: the layer's update returns the whole
// history dequantized (into a workspace the layer keeps, 1.34x an fp16 cache per token with int4)
// and attention reads that. attend_quantized reads the layer as it is stored instead: the
// quantized history a tile of rows at a time, dequantized into a small per-thread buffer and
// used at once (online softmax: a running maximum and sum per query row), then the full-precision
// residual, then the step's own keys and values; the step is stored afterwards with the layer's
// append, which quantizes at the same moments as update (the same codes) but keeps no workspace.
// Attention sees the numbers update returns (the history dequantized, the residual, the new
// tokens), except that the dequantized history stays in float where update's workspace rounds it
// to a 16-bit element type (a pass that cost a fifth of the step): for float and double the two
// paths agree to float rounding; the layer holds its codes and residual only. A difference from transformers by choice
// (docs/differences.md).
//
// Host storage; a Cache whose layer `layer_idx` is a QuantizedLayer. Masking as kvc::attend:
// causal, with the model's sliding window or chunk if given; no padding mask. Scores accumulate in
// float (double for double).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include <kvc/attention.hpp>
#include <kvc/errors.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

template <class St, class View>
concept quantized_layer_state = requires(St& s, const St& c, const View& x) {
  s.append(x, x);
  c.quantized_keys();
  c.quantized_values();
  c.residual_kv();
};

// The attention of one (batch row, KV head) block: the `group` query heads that read it, q query
// rows each at positions past .. past + q - 1, over the quantized history (its chunks in order),
// then `resid` and `fresh` full-precision rows. Every source becomes a float tile of up to `tile` rows; scores and
// the weighted values are matrix products on those tiles (Eigen), with an online softmax between.
template <class T, class A, class QH>
void attend_block(const QH& qk, const QH& qv, std::int64_t blk, const T* rk, const T* rv, std::int64_t resid,
                  const T* nk, const T* nv, std::int64_t fresh, const T* queries, std::int64_t group, std::int64_t dim,
                  std::int64_t past, const AttentionMask& mask, A scale, T* outputs) {
  using Mat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Vec = Eigen::Matrix<A, Eigen::Dynamic, 1>;
  constexpr std::int64_t tile = 64, decode_rows = 16;
  const std::int64_t rows = group * fresh;
  // Reused across calls on this thread: the tiles (float rows, as dequantized) and the state.
  thread_local std::vector<float> kt, vt;
  kt.resize(static_cast<std::size_t>(tile * dim));
  vt.resize(static_cast<std::size_t>(tile * dim));
  Mat qm(rows, dim);  // the queries, scaled
  for (std::int64_t h = 0; h < group; ++h)
    for (std::int64_t i = 0; i < fresh; ++i)
      for (std::int64_t d = 0; d < dim; ++d)
        qm(h * fresh + i, d) = static_cast<A>(queries[(h * fresh + i) * dim + d]) * scale;
  Mat acc = Mat::Zero(rows, dim), sc(rows, tile);
  Vec m = Vec::Constant(rows, -std::numeric_limits<A>::infinity()), l = Vec::Zero(rows);
  const A minus_inf = -std::numeric_limits<A>::infinity();
  // Folds the n rows of the tiles, at absolute positions p0 .., into every query row.
  const auto fold = [&](std::int64_t p0, std::int64_t n) {
    const Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> kf(kt.data(), n, dim),
        vf(vt.data(), n, dim);
    auto s = sc.leftCols(n);
    if constexpr (std::is_same_v<A, float>) {
      if (rows <= decode_rows)  // a decode step: row by row, without the product's packing copy
        for (std::int64_t r = 0; r < rows; ++r) s.row(r).noalias() = qm.row(r) * kf.transpose();
      else
        s.noalias() = qm * kf.transpose();
    } else {
      s.noalias() = qm * kf.template cast<A>().transpose();
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      // The row's visible keys are one range [jlo, jhi) of the tile (AttentionMask::visible:
      // causal, then the window or chunk), so the mask costs two bounds, not a test per key.
      const std::int64_t qp = past + r % fresh;
      const std::int64_t jhi = std::clamp<std::int64_t>(qp - p0 + 1, 0, n);
      const std::int64_t jlo = std::clamp<std::int64_t>(mask.first_visible(qp) - p0, 0, n);
      if (jhi <= jlo) {
        s.row(r).setZero();
        continue;
      }
      auto seg = s.row(r).segment(jlo, jhi - jlo);
      const A new_m = std::max(m(r), seg.maxCoeff());
      const A shrink = m(r) == minus_inf ? A(0) : std::exp(m(r) - new_m);
      seg = (seg.array() - new_m).exp().matrix();
      s.row(r).head(jlo).setZero();
      s.row(r).tail(n - jhi).setZero();
      l(r) = l(r) * shrink + seg.sum();
      acc.row(r) *= shrink;
      m(r) = new_m;
    }
    if constexpr (std::is_same_v<A, float>) {
      if (rows <= decode_rows)
        for (std::int64_t r = 0; r < rows; ++r) acc.row(r).noalias() += s.row(r) * vf;
      else
        acc.noalias() += s * vf;
    } else {
      acc.noalias() += s * vf.template cast<A>();
    }
  };
  const auto load = [&](float* dst, const T* src, std::int64_t n) {
    for (std::int64_t i = 0; i < n * dim; ++i) dst[i] = static_cast<float>(src[i]);
  };
  const std::int64_t first = mask.first_visible(past);  // no query sees a key before it
  std::int64_t start = 0;                               // where the chunk starts
  for (std::size_t c = 0; c < qk.chunks(); start += qk.chunk(c++).tokens()) {
    const auto &ck = qk.chunk(c), &cv = qv.chunk(c);
    const std::int64_t len = ck.tokens();
    for (std::int64_t t0 = std::clamp<std::int64_t>(first - start, 0, len) / tile * tile; t0 < len; t0 += tile) {
      const std::int64_t n = std::min(tile, len - t0);
      ck.decode_rows(blk, t0, n, kt.data());
      cv.decode_rows(blk, t0, n, vt.data());
      fold(start + t0, n);
    }
  }
  const std::int64_t history = start;
  for (std::int64_t t0 = 0; t0 < resid; t0 += tile) {
    const std::int64_t n = std::min(tile, resid - t0);
    load(kt.data(), rk + t0 * dim, n);
    load(vt.data(), rv + t0 * dim, n);
    fold(history + t0, n);
  }
  for (std::int64_t t0 = 0; t0 < fresh; t0 += tile) {
    const std::int64_t n = std::min(tile, fresh - t0);
    load(kt.data(), nk + t0 * dim, n);
    load(vt.data(), nv + t0 * dim, n);
    fold(history + resid + t0, n);
  }
  for (std::int64_t h = 0; h < group; ++h)
    for (std::int64_t i = 0; i < fresh; ++i) {
      const std::int64_t r = h * fresh + i;
      T* out = outputs + (h * fresh + i) * dim;
      for (std::int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(l(r) > A(0) ? acc(r, d) / l(r) : A(0));
    }
}

}  // namespace detail

// Attention of layer `layer_idx` for queries [batch, Hq, q, head_dim] over the layer's quantized
// history, its residual and the step's keys and values [batch, Hkv, q, head_dim], which are then
// stored (append). Returns [batch, Hq, q, head_dim] (empty for a step of q = 0 tokens).
template <class Cache>
HostTensor<typename Cache::storage_policy::element_type> attend_quantized(
    Cache& cache, std::int64_t layer_idx, const TensorView<typename Cache::storage_policy::element_type>& queries,
    const TensorView<typename Cache::storage_policy::element_type>& keys,
    const TensorView<typename Cache::storage_policy::element_type>& values, const AttendOptions& options = {}) {
  using S = typename Cache::storage_policy;
  using T = typename S::element_type;
  using A = detail::accum_t<T>;
  static_assert(S::space == memory_space::host, "kvc::attend_quantized: host storage only");
  if (!options.key_padding_mask.empty())
    throw ValueError("kvc::attend_quantized: a key_padding_mask is not supported (use kvc::attend)");
  return cache.update_with(keys, values, layer_idx, [&](auto& st) -> HostTensor<T> {
    using St = std::remove_cvref_t<decltype(st)>;
    if constexpr (!detail::quantized_layer_state<St, typename S::view_type>) {
      throw ValueError("kvc::attend_quantized: layer " + std::to_string(layer_idx) + " is a " +
                       std::string(cache.layer_name(layer_idx)) + ", not a quantized layer");
    } else {
      const std::int64_t B = queries.extent(0), Hq = queries.extent(1), q = queries.extent(2), D = queries.extent(3);
      const std::int64_t past = st.get_seq_length();
      if (keys.extents != values.extents || keys.extent(0) != B || keys.extent(2) != q || keys.extent(3) != D ||
          keys.extent(1) < 1 || Hq % keys.extent(1) != 0 || D > 256 ||
          (past > 0 && (keys.extent(1) != st.shape().heads || D != st.shape().key_head_dim)))
        throw ValueError("kvc::attend_quantized: queries " + shape_string(queries.extents) + ", keys " +
                         shape_string(keys.extents) + " and values " + shape_string(values.extents) +
                         " do not fit each other or the layer (head_dim at most 256)");
      const std::int64_t Hkv = keys.extent(1), group = Hq / Hkv;
      const AttentionMask mask{past + q, 0, past, options.sliding_window, true, options.attention_chunk_size, {}};
      const A scale = static_cast<A>(options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(D)));
      HostTensor<T> out(B, Hq, q, D);
      if (q == 0) {
        // A step of no tokens: kvc::attend's empty [B, Hq, 0, D] (the loop below would take the
        // address of row 0 of empty tensors). The append still runs, as update would.
      } else if (past > 0) {
        // Contiguous copies of the step's inputs (views may be strided).
        const HostTensor<T> qc = queries.to_tensor(), kc = keys.to_tensor(), vc = values.to_tensor();
        const auto r = st.residual_kv();
        const std::int64_t resid = st.residual_tokens();
        // One item per (batch row, KV head), each on its own rows: the executor's choice of threads
        // does not change the results.
        options.context.executor.parallel_for(B * Hkv, [&](std::int64_t i, int) {
          const std::int64_t b = i / Hkv, hk = i % Hkv;
          const T* rk = resid > 0 ? &r.keys(b, hk, 0, 0) : nullptr;
          const T* rv = resid > 0 ? &r.values(b, hk, 0, 0) : nullptr;
          detail::attend_block<T, A>(st.quantized_keys(), st.quantized_values(), b * Hkv + hk, rk, rv, resid,
                                     &kc(b, hk, 0, 0), &vc(b, hk, 0, 0), q, &qc(b, hk * group, 0, 0), group, D, past,
                                     mask, scale, &out(b, hk * group, 0, 0));
        });
      } else {  // nothing stored yet: attention over the step itself
        out = scaled_dot_product_attention(queries, keys, values, mask, options.context, options.scale);
      }
      st.append(keys, values);
      return out;
    }
  });
}

}  // namespace kvc

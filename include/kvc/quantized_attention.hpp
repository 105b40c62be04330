#pragma once
// kvc::attend_quantized: attention straight from a quantized layer's codes.
//
// kvc::attend on a QuantizedLayer follows transformers: the layer's update returns the whole
// history dequantized (into a workspace the layer keeps, 1.34x an fp16 cache per token with int4)
// and attention reads that. attend_quantized reads the layer as it is stored instead: the
// quantized history a tile of rows at a time, dequantized into a small buffer of the attention
// workspace (AttentionContext; the call makes its own without one) and
// used at once (online softmax: a running maximum and sum per query row), then the full-precision
// residual, then the step's own keys and values; the step is stored afterwards with the layer's
// append, which quantizes at the same moments as update (the same codes) but keeps no workspace.
// Attention sees the numbers update returns (the history dequantized, the residual, the new
// tokens), except that the dequantized history stays in float where update's workspace rounds it
// to a 16-bit element type (a pass that cost a fifth of the step): for float and double the two
// paths agree to float rounding; the layer holds its codes and residual only. A difference from transformers by choice
// (docs/differences.md).
//
// A layer with rotate_keys / rotate_values holds codes of rotated rows: attention rotates the
// step's queries and own rows, reads the residual from the layer's rotated copy, and rotates the
// output back when the values are rotated (scores and outputs are those of the rows as given).
//
// Host storage; a Cache whose layer `layer_idx` is a QuantizedLayer. Masking as kvc::attend:
// causal, with the model's sliding window or chunk if given; no padding mask. Scores accumulate in
// float (double for double).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include <kvc/attention.hpp>
#include <kvc/errors.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

template <class St, class View>
concept quantized_layer_state = requires(St& s, const St& c, const View& x) {
  s.append(x, x);
  c.quantized_keys();
  c.quantized_values();
  c.residual_kv();
  c.options().rotate_keys;
  s.rotated_residual();
};

// Whether every layer state of a cache's variant is a quantized layer's.
template <class Variant, class View>
inline constexpr bool all_quantized = false;
template <class... St, class View>
inline constexpr bool all_quantized<std::variant<St...>, View> = (quantized_layer_state<St, View> && ...);

// Which of a layer's quantized K and V histories hold codes of rotated rows, and the block's
// residual rows rotated (QuantizedLayer::rotated_residual) for each that does.
struct kv_rotation {
  bool keys = false, values = false;
  const float* residual_keys = nullptr;
  const float* residual_values = nullptr;
};

// The scratch of one attend_block call, carved from a workspace area (aligned, as
// AttentionWorkspace's areas are): float tiles of `tile` key and value rows as dequantized (and
// the same widened to A when A is not float), then in A the scaled queries, the unnormalised
// outputs and a tile of scores per query row, the running maximum and sum per row, and for more
// than decode_rows rows the packing buffers of the tile's matrix products.
template <class A>
struct quantized_scratch {
  static constexpr std::int64_t tile = 64, decode_rows = 16;
  static constexpr bool widened = !std::is_same_v<A, float>;
  float *kt, *vt;
  A *ka, *va, *qm, *acc, *sc, *m, *l, *pack;
  static constexpr std::int64_t pack_values(std::int64_t rows, std::int64_t dim) noexcept {
    return rows > decode_rows ? std::max(packed_product<A>::pack_values(rows, tile, dim),
                                         packed_product<A>::pack_values(rows, dim, tile))
                              : 0;
  }
  static constexpr std::size_t bytes(std::int64_t rows, std::int64_t dim) noexcept {
    return sizeof(float) * static_cast<std::size_t>(2 * aligned_values<float>(tile * dim)) +
           sizeof(A) * static_cast<std::size_t>((widened ? 2 * aligned_values<A>(tile * dim) : 0) +
                                                2 * aligned_values<A>(rows * dim) + aligned_values<A>(rows * tile) +
                                                2 * aligned_values<A>(rows) + pack_values(rows, dim));
  }
  static quantized_scratch carve(std::byte* area, std::int64_t rows, std::int64_t dim) noexcept {
    quantized_scratch t{};
    auto* f = reinterpret_cast<float*>(area);
    t.kt = f;
    t.vt = f + aligned_values<float>(tile * dim);
    A* a = reinterpret_cast<A*>(t.vt + aligned_values<float>(tile * dim));
    if constexpr (widened) {
      t.ka = a;
      t.va = a + aligned_values<A>(tile * dim);
      a += 2 * aligned_values<A>(tile * dim);
    } else {
      t.ka = t.kt;
      t.va = t.vt;
    }
    for (auto [field, n] : {std::pair{&t.qm, rows * dim},
                            {&t.acc, rows * dim},
                            {&t.sc, rows * tile},
                            {&t.m, rows},
                            {&t.l, rows},
                            {&t.pack, pack_values(rows, dim)}}) {
      *field = a;
      a += aligned_values<A>(n);
    }
    return t;
  }
};

// A matrix of rows of T: `rows` rows `row` elements apart, element d of a row `inner` apart.
template <class T>
struct strided_rows {
  const T* data;
  std::int64_t row, inner;
  T at(std::int64_t r, std::int64_t d) const noexcept { return data[r * row + d * inner]; }
};

// The attention of one (batch row, KV head) block: the `group` query heads that read it (head h's
// rows at queries + h * q_head), q query rows each at positions past .. past + q - 1, over the
// quantized history (its chunks in order), then `resid` and `fresh` full-precision rows. Every
// source becomes a float tile of up to `tile` rows; scores and the weighted values are matrix
// products on those tiles (packed_product), with an online softmax between. Only the keys at
// absolute positions [lo, hi) are read: from the first any query sees to past + fresh, or a split
// of that range.
// Scratch from `area` (quantized_scratch<A>::bytes(group * fresh, dim) bytes); outputs contiguous,
// [group, fresh, dim], or with `partials` each row's partial result there (m, l and the
// unnormalised output: 2 + dim values a row, rows contiguous) for merge_partials.
// With `rotation`, the history's keys (values) are codes of rotated rows (QuantizedLayer's
// rotate_keys, rotate_values): the queries are rotated once, the residual's rows are read from the
// layer's rotated copy, the step's own rows rotated as they are loaded, and with rotated values the
// output is rotated back once (before any merge: the merge is linear in it).
template <class T, class A, class QH>
void attend_block(const QH& qk, const QH& qv, std::int64_t blk, const T* rk, const T* rv, std::int64_t resid,
                  strided_rows<T> nk, strided_rows<T> nv, std::int64_t fresh, strided_rows<T> queries,
                  std::int64_t q_head, std::int64_t group, std::int64_t dim, std::int64_t past,
                  const AttentionMask& mask, A scale, std::int64_t lo, std::int64_t hi, std::byte* area, T* outputs,
                  A* partials, kv_rotation rotation = {}) {
  using Mat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Vec = Eigen::Matrix<A, Eigen::Dynamic, 1>;
  constexpr std::int64_t tile = quantized_scratch<A>::tile, decode_rows = quantized_scratch<A>::decode_rows;
  const std::int64_t rows = group * fresh;
  const quantized_scratch<A> t = quantized_scratch<A>::carve(area, rows, dim);
  const auto kt = std::span(t.kt, static_cast<std::size_t>(tile * dim)),
             vt = std::span(t.vt, static_cast<std::size_t>(tile * dim));
  Eigen::Map<Mat> qm(t.qm, rows, dim);  // the queries, scaled
  for (std::int64_t h = 0; h < group; ++h)
    for (std::int64_t i = 0; i < fresh; ++i)
      for (std::int64_t d = 0; d < dim; ++d)
        qm(h * fresh + i, d) =
            static_cast<A>(strided_rows<T>{queries.data + h * q_head, queries.row, queries.inner}.at(i, d)) * scale;
  if (rotation.keys) hadamard_rotate(t.qm, rows, dim);
  Eigen::Map<Mat> acc(t.acc, rows, dim), sc(t.sc, rows, tile);
  Eigen::Map<Vec> m(t.m, rows), l(t.l, rows);
  acc.setZero();
  m.setConstant(-std::numeric_limits<A>::infinity());
  l.setZero();
  const A minus_inf = -std::numeric_limits<A>::infinity();
  // Folds the n rows of the tiles, at absolute positions p0 .., into every query row.
  const auto fold = [&](std::int64_t p0, std::int64_t n) {
    if constexpr (quantized_scratch<A>::widened)
      for (std::int64_t i = 0; i < n * dim; ++i) {
        t.ka[i] = static_cast<A>(t.kt[i]);
        t.va[i] = static_cast<A>(t.vt[i]);
      }
    const Eigen::Map<const Mat> kf(t.ka, n, dim), vf(t.va, n, dim);
    auto s = sc.leftCols(n);
    if (rows <= decode_rows) {  // a decode step: row by row, without the product's packing copy
      for (std::int64_t r = 0; r < rows; ++r) s.row(r).noalias() = qm.row(r) * kf.transpose();
    } else {  // on this thread, packing in the scratch (packed_product)
      s.setZero();
      packed_product<A>::template run<true>(rows, n, dim, t.qm, dim, t.ka, dim, t.sc, tile, A(1), t.pack);
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
    if (rows <= decode_rows)
      for (std::int64_t r = 0; r < rows; ++r) acc.row(r).noalias() += s.row(r) * vf;
    else
      packed_product<A>::template run<false>(rows, dim, n, t.sc, tile, t.va, dim, t.acc, dim, A(1), t.pack);
  };
  const auto load = [&](float* dst, strided_rows<T> src, std::int64_t r0, std::int64_t n, bool rotate) {
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t d = 0; d < dim; ++d) dst[i * dim + d] = static_cast<float>(src.at(r0 + i, d));
    if (rotate) hadamard_rotate(dst, n, dim);
  };
  // Rows [t0, t0 + n) of a source whose row 0 sits at absolute position p0, cut to [lo, hi):
  // read(first row, count) loads them into the tiles, then they are folded.
  const auto visit = [&](std::int64_t p0, std::int64_t t0, std::int64_t n, auto&& read) {
    const std::int64_t a = std::max(p0 + t0, lo), b = std::min(p0 + t0 + n, hi);
    if (a >= b) return;
    read(a - p0, b - a);
    fold(a, b - a);
  };
  std::int64_t start = 0;  // where the chunk starts
  for (std::size_t c = 0; c < qk.chunks(); start += qk.chunk(c++).tokens()) {
    const auto &ck = qk.chunk(c), &cv = qv.chunk(c);
    const std::int64_t len = ck.tokens();
    for (std::int64_t t0 = std::clamp<std::int64_t>(lo - start, 0, len) / tile * tile; t0 < len && start + t0 < hi;
         t0 += tile)
      visit(start, t0, std::min(tile, len - t0), [&](std::int64_t r0, std::int64_t n) {
        ck.decode_rows(blk, r0, n, kt.data());
        cv.decode_rows(blk, r0, n, vt.data());
      });
  }
  const std::int64_t history = start;
  for (std::int64_t t0 = 0; t0 < resid; t0 += tile)
    visit(history, t0, std::min(tile, resid - t0), [&](std::int64_t r0, std::int64_t n) {
      if (rotation.keys)
        std::copy_n(rotation.residual_keys + r0 * dim, n * dim, kt.data());
      else
        load(kt.data(), {rk, dim, 1}, r0, n, false);
      if (rotation.values)
        std::copy_n(rotation.residual_values + r0 * dim, n * dim, vt.data());
      else
        load(vt.data(), {rv, dim, 1}, r0, n, false);
    });
  for (std::int64_t t0 = 0; t0 < fresh; t0 += tile)
    visit(history + resid, t0, std::min(tile, fresh - t0), [&](std::int64_t r0, std::int64_t n) {
      load(kt.data(), nk, r0, n, rotation.keys);
      load(vt.data(), nv, r0, n, rotation.values);
    });
  if (rotation.values) hadamard_rotate(t.acc, rows, dim);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (partials != nullptr) {
      store_partial(m(r), l(r), t.acc + r * dim, dim, partials + r * (2 + dim));
    } else {
      T* out = outputs + r * dim;
      for (std::int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(l(r) > A(0) ? acc(r, d) / l(r) : A(0));
    }
  }
}

// attend_quantized over host views of the cache's element type.
template <class Cache>
void attend_quantized_views(Cache& cache, std::int64_t layer_idx,
                            const TensorView<typename Cache::storage_policy::element_type>& queries,
                            const TensorView<typename Cache::storage_policy::element_type>& keys,
                            const TensorView<typename Cache::storage_policy::element_type>& values,
                            HostTensor<typename Cache::storage_policy::element_type>& out,
                            const AttendOptions& options) {
  using S = typename Cache::storage_policy;
  using T = typename S::element_type;
  using A = detail::accum_t<T>;
  static_assert(S::space == memory_space::host, "kvc::attend_quantized: host storage only");
  if (!options.key_padding_mask.empty())
    throw ValueError("kvc::attend_quantized: a key_padding_mask is not supported (use kvc::attend)");
  // A layer that keeps its tokens in full precision (a QuantizedCache's skipped layers, or any
  // other kind; a layer a replicated cache appends is its prototype's kind) is kvc::attend's.
  if constexpr (!detail::all_quantized<typename Cache::layer_variant, typename S::view_type>) {
    using first_state = std::variant_alternative_t<0, typename Cache::layer_variant>;
    const auto quantized = [](const auto& l) {
      return detail::quantized_layer_state<std::remove_cvref_t<decltype(l)>, typename S::view_type>;
    };
    if (layer_idx >= 0 && layer_idx < cache.size()
            ? !std::as_const(cache).visit_layer(layer_idx, quantized)
            : !detail::quantized_layer_state<first_state, typename S::view_type>) {
      kvc::attend(cache, layer_idx, queries, keys, values, out, options);
      return;
    }
  }
  cache.update_with(keys, values, layer_idx, [&](auto& st) -> HostTensor<T>& {
    using St = std::remove_cvref_t<decltype(st)>;
    if constexpr (!detail::quantized_layer_state<St, typename S::view_type>) {
      throw ValueError("kvc::attend_quantized: layer " + std::to_string(layer_idx) + " is a " +
                       std::string(cache.layer_name(layer_idx)) + ", not a quantized layer");  // (sent to attend above)
    } else {
      const std::int64_t B = queries.extent(0), Hq = queries.extent(1), q = queries.extent(2), D = queries.extent(3);
      const std::int64_t past = st.get_seq_length();
      if (keys.extents != values.extents || keys.extent(0) != B || keys.extent(2) != q || keys.extent(3) != D ||
          keys.extent(1) < 1 || Hq % keys.extent(1) != 0 || D > 256 ||
          (past > 0 &&
           (keys.extent(1) != st.shape().heads || D != st.shape().key_head_dim || D != st.shape().value_head_dim)))
        throw ValueError("kvc::attend_quantized: queries " + shape_string(queries.extents) + ", keys " +
                         shape_string(keys.extents) + " and values " + shape_string(values.extents) +
                         " do not fit each other or the layer (head_dim at most 256)");
      const std::int64_t Hkv = keys.extent(1), group = Hq / Hkv;
      const AttentionMask mask{past + q, 0, past, options.sliding_window, true, options.attention_chunk_size, {}};
      const A scale = static_cast<A>(options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(D)));
      if (q == 0) {
        // A step of no tokens: kvc::attend's empty [B, Hq, 0, D] (the loop below would take the
        // address of row 0 of empty tensors). The append still runs, as update would.
        out.resize(B, Hq, q, D);
      } else if (past > 0) {
        const auto r = st.residual_kv();
        const std::int64_t resid = st.residual_tokens();
        const auto rotated = st.rotated_residual();  // null parts where nothing is rotated
        // A decode step over many keys with few (batch row, KV head) blocks is cut into key
        // splits of the dense attention's plan, merged in split order: the cuts depend on the
        // problem alone, so the executor's choice of threads does not change the results.
        // (A window longer than the context starts before position 0: the keys start there.)
        const std::int64_t first = std::max<std::int64_t>(0, mask.first_visible(past)), keys_seen = past + q - first;
        const std::int64_t splits =
            detail::tile_plan::splits(group * q <= detail::quantized_scratch<A>::decode_rows, keys_seen, B * Hkv);
        const std::int64_t split_length = detail::tile_plan::split_length(keys_seen, splits);
        const std::int64_t items = B * Hkv * splits, rows = group * q, pitch = 2 + D;
        // Scratch first (the only allocation, none with a kept workspace of the size), then the output.
        const AttentionContext& context = options.context;
        AttentionWorkspace local;
        AttentionWorkspace& ws = context.workspace != nullptr ? *context.workspace : local;
        ws.reserve(items > 1 ? context.executor.concurrency() : 1, detail::quantized_scratch<A>::bytes(rows, D),
                   splits > 1 ? sizeof(A) * static_cast<std::size_t>(items * rows * pitch) : 0);
        out.resize(B, Hq, q, D);
        A* partials = reinterpret_cast<A*>(ws.shared());
        context.executor.parallel_for(items, [&](std::int64_t i, int worker) {
          const std::int64_t split = i % splits, b = i / splits / Hkv, hk = i / splits % Hkv;
          const T* rk = resid > 0 ? &r.keys(b, hk, 0, 0) : nullptr;
          const T* rv = resid > 0 ? &r.values(b, hk, 0, 0) : nullptr;
          const std::int64_t rotated_block = (b * Hkv + hk) * rotated.capacity * D;
          const kv_rotation rotation{st.options().rotate_keys, st.options().rotate_values,
                                     rotated.keys ? rotated.keys + rotated_block : nullptr,
                                     rotated.values ? rotated.values + rotated_block : nullptr};
          const auto rows_of = [&](const TensorView<T>& x, std::int64_t head) {
            return detail::strided_rows<T>{x.data() + b * x.stride(0) + head * x.stride(1), x.stride(2), x.stride(3)};
          };
          // One split: split_length covers every key, so [lo, hi) is [first, past + q).
          const std::int64_t lo = first + split * split_length, hi = std::min(past + q, lo + split_length);
          detail::attend_block<T, A>(st.quantized_keys(), st.quantized_values(), b * Hkv + hk, rk, rv, resid,
                                     rows_of(keys, hk), rows_of(values, hk), q, rows_of(queries, hk * group),
                                     queries.stride(1), group, D, past, mask, scale, lo, hi, ws.worker(worker),
                                     &out(b, hk * group, 0, 0), splits > 1 ? partials + i * rows * pitch : nullptr,
                                     rotation);
        });
        if (splits > 1)  // each block's rows merged over its splits, in split order
          context.executor.parallel_for(B * Hkv, [&](std::int64_t bh, int) {
            for (std::int64_t row = 0; row < rows; ++row)
              detail::merge_partials(partials + (bh * splits * rows + row) * pitch, splits, rows * pitch, D, A(1),
                                     &out(bh / Hkv, bh % Hkv * group + row / q, row % q, 0));
          });
      } else {  // nothing stored yet: attention over the step itself
        scaled_dot_product_attention(queries, keys, values, mask, out, options.context, options.scale);
      }
      st.append(keys, values);
      return out;
    }
  });
}

}  // namespace detail

// Attention of layer `layer_idx` for queries [batch, Hq, q, head_dim] over the layer's quantized
// history, its residual and the step's keys and values [batch, Hkv, q, head_dim], which are then
// stored (append), into `out` (resized to [batch, Hq, q, head_dim]; no allocation when it holds that
// many elements already). The work, one item per (batch row, KV head), runs on
// options.context's executor, its scratch in the context's workspace when it has one (else in one
// of the call's own); the results are the same on any executor and thread count.
// Queries, keys and values: any kvc::tensor_input of the cache's element type on the host.
// A layer that is not quantized (full precision) is kvc::attend's. Throws kvc::ValueError for
// shapes that do not fit the layer, or a key_padding_mask; the cache is then unchanged.
template <class Cache, class QT, class KT, class VT>
void attend_quantized(Cache& cache, std::int64_t layer_idx, const QT& queries, const KT& keys, const VT& values,
                      HostTensor<typename Cache::storage_policy::element_type>& out,
                      const AttendOptions& options = {}) {
  using T = typename Cache::storage_policy::element_type;
  if constexpr (detail::check_inputs<T, memory_space::host, QT, KT, VT>())
    detail::attend_quantized_views(cache, layer_idx, input_view(queries), input_view(keys), input_view(values), out,
                                   options);
}

// attend_quantized's result as a new tensor. Returns [batch, Hq, q, head_dim] (empty for a step of
// q = 0 tokens).
template <class Cache, class QT, class KT, class VT>
HostTensor<typename Cache::storage_policy::element_type> attend_quantized(Cache& cache, std::int64_t layer_idx,
                                                                          const QT& queries, const KT& keys,
                                                                          const VT& values,
                                                                          const AttendOptions& options = {}) {
  HostTensor<typename Cache::storage_policy::element_type> out;
  attend_quantized(cache, layer_idx, queries, keys, values, out, options);
  return out;
}

}  // namespace kvc

#pragma once
// Scaled-dot-product attention over the views a cache returns (host, Eigen).
//
// Masks follow transformers' mask code: for a query of q new tokens at absolute positions
// query_position .. query_position + q - 1 (cache_position), a layer's `get_mask_sizes(q)`, asked
// before its update, gives (kv_length, kv_offset): the keys the update returns are kv_length long
// and key j sits at absolute position kv_offset + j. Key j is visible to query i when it is not in
// the future (causal) and, for a sliding layer of window W, when it is one of the W latest
// positions up to the query (kv_pos > q_pos - W). Unwritten slots of a static buffer lie in the
// future of every query, so causality hides them.
//
// Grouped-query and multi-query attention: query head h reads KV head h / (Hq / Hkv); the K/V
// blocks are read in place, once per KV head, for all the query heads of its group. Scores and
// the softmax accumulate in float for Eigen::half and Eigen::bfloat16 (double stays double).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {
// The first absolute key position a query at qp sees with a sliding window (0: none) and an
// attention chunk size (0: none); host and device code (the device kernels take the mask as ints).
KVC_HOST_DEVICE constexpr std::int64_t first_visible_position(std::int64_t qp, std::int64_t window,
                                                              std::int64_t chunk) noexcept {
  std::int64_t first = window > 0 ? qp - window + 1 : std::int64_t{0};
  if (chunk > 0 && qp / chunk * chunk > first) first = qp / chunk * chunk;
  return first;
}
}  // namespace detail

// How queries see keys (see the header comment).
struct AttentionMask {
  std::int64_t kv_length = 0;       // from get_mask_sizes(q), asked before the update
  std::int64_t kv_offset = 0;       // from get_mask_sizes(q)
  std::int64_t query_position = 0;  // absolute position of the first query (tokens seen before it)
  std::optional<std::int64_t> sliding_window = std::nullopt;  // none: full causal attention
  bool causal = true;
  // Chunked attention (transformers' chunked_attention layers): a query sees only keys of its own
  // chunk, kv_pos / chunk == q_pos / chunk.
  std::optional<std::int64_t> attention_chunk_size = std::nullopt;
  // Ragged batches (transformers' 2-D attention_mask): empty, or [batch, width] row-major, one
  // entry per absolute position 0 .. width - 1 of each batch row, 0 for padding. A key at a
  // padded position is seen by no query of its row; width must cover every key
  // (kv_offset + kv_length). A query that sees no key gets a zero row.
  std::span<const std::uint8_t> key_padding_mask = {};

  // The first absolute key position the query at qp may see.
  constexpr std::int64_t first_visible(std::int64_t qp) const noexcept {
    return detail::first_visible_position(qp, sliding_window.value_or(0), attention_chunk_size.value_or(0));
  }
  // Whether the query at absolute position qp sees the key at absolute position kp.
  constexpr bool visible(std::int64_t qp, std::int64_t kp) const noexcept {
    if (causal && kp > qp) return false;
    return kp >= first_visible(qp);
  }
};

namespace detail {

// The type scores and the softmax are computed in: float for the 16-bit types, else T.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
using row_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The [rows, cols] block at `ptr` (row pitch `pitch`) as a matrix of A: a zero-copy map when T is
// A, else converted into `scratch`.
template <class A, class T>
Eigen::Map<const row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>> as_accum(const T* ptr, std::int64_t rows,
                                                                                 std::int64_t cols, std::int64_t pitch,
                                                                                 row_matrix<A>& scratch) {
  using map = Eigen::Map<const row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;
  if constexpr (std::is_same_v<A, T>) {
    return map(ptr, rows, cols, Eigen::OuterStride<>(pitch));
  } else {
    scratch.resize(rows, cols);
    if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<A, float>) {
      // A bfloat16 is the upper half of a float: widening is a shift, which vectorises.
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* src = ptr + r * pitch;
        A* dst = scratch.data() + r * cols;
        for (std::int64_t c = 0; c < cols; ++c) {
          const std::uint32_t bits = static_cast<std::uint32_t>(src[c].value) << 16;
          std::memcpy(dst + c, &bits, sizeof bits);
        }
      }
    } else if constexpr (std::is_same_v<A, float> && requires(const T* x, float* y) { T::widen(x, y, rows); }) {
      // One-byte codes (kvc::float8_e4m3, float8_e5m2), widened a row at a time.
      for (std::int64_t r = 0; r < rows; ++r) T::widen(ptr + r * pitch, scratch.data() + r * cols, cols);
    } else {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < cols; ++c) scratch(r, c) = static_cast<A>(ptr[r * pitch + c]);
    }
    return map(scratch.data(), rows, cols, Eigen::OuterStride<>(cols));
  }
}

inline std::string shape_pair(const char* a, const std::array<std::int64_t, 4>& x, const char* b,
                              const std::array<std::int64_t, 4>& y) {
  return std::string(a) + " of shape " + shape_string(x) + " and " + b + " of shape " + shape_string(y);
}

// The checks of scaled_dot_product_attention that need only shapes and the mask (attend runs them
// before it updates the cache, with the shapes the update will return): ValueError.
inline void check_attention(const std::array<std::int64_t, 4>& q, const std::array<std::int64_t, 4>& k,
                            const std::array<std::int64_t, 4>& v, const AttentionMask& mask) {
  for (const auto* e : {&q, &k, &v})
    for (const std::int64_t x : *e)
      if (x < 0 || x > max_extent)
        throw ValueError("scaled_dot_product_attention: " + shape_pair("queries", q, "keys", k) + " (values " +
                         shape_string(v) + ") must have dimensions between 0 and kvc's limit of " +
                         std::to_string(max_extent));
  if (k[0] != q[0] || v[0] != q[0] || v[1] != k[1] || v[2] != k[2] || k[3] != q[3])
    throw ValueError("scaled_dot_product_attention: " + shape_pair("queries", q, "keys", k) + " (values " +
                     shape_string(v) + ") must agree on batch and head_dim, and keys and values on heads and length");
  if (k[1] < 1 || q[1] % k[1] != 0)
    throw ValueError("scaled_dot_product_attention: " + std::to_string(q[1]) + " query heads are not a multiple of " +
                     std::to_string(k[1]) + " key/value heads");
  if (k[2] != mask.kv_length)
    throw ValueError("scaled_dot_product_attention: keys hold " + std::to_string(k[2]) +
                     " positions but the mask's kv_length is " + std::to_string(mask.kv_length));
  if (mask.sliding_window && *mask.sliding_window < 1)
    throw ValueError("scaled_dot_product_attention: sliding_window must be positive, got " +
                     std::to_string(*mask.sliding_window));
  if (mask.attention_chunk_size && *mask.attention_chunk_size < 1)
    throw ValueError("scaled_dot_product_attention: attention_chunk_size must be positive, got " +
                     std::to_string(*mask.attention_chunk_size));
  // Positions and windows are sizes too: bounded, the mask arithmetic cannot overflow.
  check_size("scaled_dot_product_attention: the mask's kv_offset", mask.kv_offset, 0, max_extent);
  check_size("scaled_dot_product_attention: the mask's query_position", mask.query_position, 0, max_extent);
  if (mask.sliding_window)
    check_size("scaled_dot_product_attention: sliding_window", *mask.sliding_window, 1, max_extent);
  if (mask.attention_chunk_size)
    check_size("scaled_dot_product_attention: attention_chunk_size", *mask.attention_chunk_size, 1, max_extent);
  (void)checked_elements({q[0], q[1], q[2], v[3]}, 8);  // the output, in the widest element type
  if (!mask.key_padding_mask.empty()) {
    const auto n = static_cast<std::int64_t>(mask.key_padding_mask.size());
    if (q[0] < 1 || n % q[0] != 0 || n / q[0] < mask.kv_offset + mask.kv_length)
      throw ValueError("scaled_dot_product_attention: key_padding_mask has " + std::to_string(n) +
                       " entries; it needs one row per batch row (" + std::to_string(q[0]) +
                       ") of at least kv_offset + kv_length = " + std::to_string(mask.kv_offset + mask.kv_length) +
                       " positions");
  }
}

// check_attention, and the layout attention reads (host or device views): ValueError.
template <class QView, class KVView>
void check_attention_views(const QView& queries, const KVView& keys, const KVView& values, const AttentionMask& mask) {
  check_attention(queries.extents, keys.extents, values.extents, mask);
  const auto contiguous = [](const auto& t) { return t.stride(3) == 1 && t.stride(2) == t.extent(3); };
  if (!contiguous(queries) || !contiguous(keys) || !contiguous(values))
    throw ValueError("scaled_dot_product_attention: tensors must have contiguous [seq, head_dim] blocks");
}

}  // namespace detail

namespace detail {

// The dequantization scales of K and V stored as codes (fp8 KV, <kvc/fp8_attention.hpp>):
// key_scale(h) and value_scale(h) of KV head h. unit_scales: the stored values themselves.
struct unit_scales {
  static constexpr float key_scale(std::int64_t) noexcept { return 1.0f; }
  static constexpr float value_scale(std::int64_t) noexcept { return 1.0f; }
};

// scaled_dot_product_attention with K/V of element type KV (T, or codes that `as_accum` widens)
// and KV head hk's keys and values multiplied by scales.key_scale(hk) and value_scale(hk): the key
// scale joins the softmax scale, the value scale multiplies the output rows.
template <class T, class KV, class Scales>
HostTensor<T> attention_impl(const TensorView<T>& queries, const TensorView<KV>& keys, const TensorView<KV>& values,
                             const AttentionMask& mask, std::optional<double> scale, const Scales& scales) {
  using A = accum_t<T>;
  const std::int64_t B = queries.extent(0), Hq = queries.extent(1), q = queries.extent(2), D = queries.extent(3);
  const std::int64_t Hkv = keys.extent(1), S = keys.extent(2), Dv = values.extent(3);
  check_attention_views(queries, keys, values, mask);

  const A s = static_cast<A>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const std::int64_t group = Hq / Hkv;
  HostTensor<T> out(B, Hq, q, Dv);
  out.setZero();

  // Rows of one (batch, kv head) problem: the q queries of each of the `group` query heads.
  // Query rows are processed in tiles so that the score matrix stays small during a prefill.
  // A decode step has few rows (group * q <= decode_rows): it streams K and V once, in blocks
  // that stay in cache while every row reads them (matrix-vector products, no packing copy of K
  // and V, and a 16-bit block widened to float only when it is read). A prefill has many rows and
  // uses matrix-matrix products over the visible range.
  constexpr std::int64_t tile = 64, decode_rows = 16, block = 64;
  row_matrix<A> kbuf, vbuf, qbuf, scores, ctx;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t hk = 0; hk < Hkv; ++hk) {
      const KV* kp = keys.data() + b * keys.stride(0) + hk * keys.stride(1);
      const KV* vp = values.data() + b * values.stride(0) + hk * values.stride(1);
      const A sk = s * static_cast<A>(scales.key_scale(hk)), sv = static_cast<A>(scales.value_scale(hk));
      for (std::int64_t i0 = 0; i0 < q; i0 += tile) {
        const std::int64_t rows_per_head = std::min(tile, q - i0);
        // Visible key range of this tile: [lo, hi) covers every visible key of its queries.
        const std::int64_t first_q = mask.query_position + i0, last_q = first_q + rows_per_head - 1;
        std::int64_t hi = S;
        if (mask.causal) hi = std::clamp<std::int64_t>(last_q - mask.kv_offset + 1, 0, S);
        const std::int64_t lo = std::clamp<std::int64_t>(mask.first_visible(first_q) - mask.kv_offset, 0, S);
        const std::int64_t width = std::max<std::int64_t>(hi - lo, 0);
        const std::int64_t rows = group * rows_per_head;
        qbuf.resize(rows, D);
        for (std::int64_t g = 0; g < group; ++g) {
          const std::int64_t h = hk * group + g;
          const T* qp = queries.data() + b * queries.stride(0) + h * queries.stride(1) + i0 * D;
          for (std::int64_t r = 0; r < rows_per_head; ++r)
            for (std::int64_t d = 0; d < D; ++d) qbuf(g * rows_per_head + r, d) = static_cast<A>(qp[r * D + d]);
        }
        const bool decode = rows <= decode_rows;
        if (decode) {
          scores.resize(rows, width);
          for (std::int64_t j0 = 0; j0 < width; j0 += block) {
            const std::int64_t n = std::min(block, width - j0);
            const auto Kb = as_accum<A>(kp + (lo + j0) * D, n, D, D, kbuf);
            for (std::int64_t r = 0; r < rows; ++r)
              scores.row(r).segment(j0, n).noalias() = qbuf.row(r) * Kb.transpose();
          }
          scores *= sk;
        } else {
          const auto K = as_accum<A>(kp + lo * D, width, D, D, kbuf);
          scores.noalias() = (qbuf * K.transpose()) * sk;
        }
        // Each row's visible keys are one contiguous range [jlo, jhi) of the tile's columns (the
        // same rule as AttentionMask::visible), so the softmax runs vectorised on that segment.
        for (std::int64_t row = 0; row < rows; ++row) {
          const std::int64_t qpos = mask.query_position + i0 + row % rows_per_head;
          const std::int64_t first = mask.kv_offset + lo;  // absolute position of column 0
          const std::int64_t jhi = mask.causal ? std::clamp<std::int64_t>(qpos - first + 1, 0, width) : width;
          const std::int64_t jlo = std::clamp<std::int64_t>(mask.first_visible(qpos) - first, 0, width);
          auto r = scores.row(row);
          if (jhi <= jlo) {  // nothing visible: a zero output row
            r.setZero();
            continue;
          }
          auto seg = r.segment(jlo, jhi - jlo);
          if (!mask.key_padding_mask.empty()) {  // padded keys of this batch row drop out
            const std::uint8_t* keep = mask.key_padding_mask.data() +
                                       b * static_cast<std::int64_t>(mask.key_padding_mask.size()) / B + first + jlo;
            for (std::int64_t j = 0; j < jhi - jlo; ++j)
              if (!keep[j]) seg(j) = -std::numeric_limits<A>::infinity();
          }
          const A max = seg.maxCoeff();
          r.head(jlo).setZero();
          r.tail(width - jhi).setZero();
          if (max == -std::numeric_limits<A>::infinity()) {  // every visible key is padding
            seg.setZero();
            continue;
          }
          seg = (seg.array() - max).exp().matrix();
          seg /= seg.sum();
        }
        if (decode) {
          ctx.setZero(rows, Dv);
          for (std::int64_t j0 = 0; j0 < width; j0 += block) {
            const std::int64_t n = std::min(block, width - j0);
            const auto Vb = as_accum<A>(vp + (lo + j0) * Dv, n, Dv, Dv, vbuf);
            for (std::int64_t r = 0; r < rows; ++r) ctx.row(r).noalias() += scores.row(r).segment(j0, n) * Vb;
          }
        } else {
          const auto V = as_accum<A>(vp + lo * Dv, width, Dv, Dv, vbuf);
          ctx.noalias() = scores * V;
        }
        if (sv != A(1)) ctx *= sv;
        for (std::int64_t g = 0; g < group; ++g) {
          const std::int64_t h = hk * group + g;
          for (std::int64_t r = 0; r < rows_per_head; ++r)
            for (std::int64_t d = 0; d < Dv; ++d) out(b, h, i0 + r, d) = static_cast<T>(ctx(g * rows_per_head + r, d));
        }
      }
    }
  }
  return out;
}

}  // namespace detail

// out[b, h, i, :] = softmax(scale * q[b, h, i, :] . K[b, h / group, j, :] over visible j) V[b, h / group, :, :]
// queries: [B, Hq, q, D]; keys: [B, Hkv, kv_length, D]; values: [B, Hkv, kv_length, Dv]; Hq a
// multiple of Hkv. `scale` defaults to 1 / sqrt(D). Returns [B, Hq, q, Dv].
template <class T>
HostTensor<T> scaled_dot_product_attention(const TensorView<T>& queries, const TensorView<T>& keys,
                                           const TensorView<T>& values, const AttentionMask& mask,
                                           std::optional<double> scale = std::nullopt) {
  return detail::attention_impl(queries, keys, values, mask, scale, detail::unit_scales{});
}

// Accepts what Cache::update accepts (HostTensor, TensorMap, TensorView) for the queries.
template <class Q, class T>
  requires detail::tensor_input<std::remove_cvref_t<Q>>::valid
HostTensor<T> scaled_dot_product_attention(const Q& queries, const TensorView<T>& keys, const TensorView<T>& values,
                                           const AttentionMask& mask, std::optional<double> scale = std::nullopt) {
  return scaled_dot_product_attention<T>(detail::tensor_input<std::remove_cvref_t<Q>>::view(queries), keys, values,
                                         mask, scale);
}

// How `attend` masks one layer. transformers builds the mask from the model's config, not from
// the cache: pass the model's window (or chunk size) for the layer. When neither is given, a
// sliding layer of the cache masks with its own window (get_max_length) and any other layer is
// full causal. That is right for a cache built from the model's config except for
// chunked_attention layers, which are sliding layers of the chunk size in the cache but need a
// chunk mask: pass attention_chunk_size for them. A DynamicCache() keeps every token in every
// layer, so with it the model's window must always be given.
struct AttendOptions {
  std::optional<std::int64_t> sliding_window = std::nullopt;
  std::optional<std::int64_t> attention_chunk_size = std::nullopt;
  std::optional<double> scale = std::nullopt;  // default 1 / sqrt(head_dim)
  // AttentionMask::key_padding_mask: [batch, width] over absolute positions, width at least the
  // tokens seen after this step (get_seq_length + q), 0 for padding.
  std::span<const std::uint8_t> key_padding_mask = {};
};

namespace detail {

// The [batch, heads, seq, head_dim] shape of an input attend takes: host inputs (tensor_input) here,
// device tensors and views in <kvc/detail/cuda_attention.cuh>.
template <class X>
struct input_extents {
  static constexpr bool valid = tensor_input<X>::valid;
  static std::array<std::int64_t, 4> of(const X& x) { return tensor_input<X>::view(x).extents; }
};

// attend's steps, with `finish(kv, mask)` attending over what the update returned (kvc::attend:
// scaled_dot_product_attention; kvc::attend_fp8: with its scales).
template <class Cache, class Q, class KT, class VT, class Finish>
auto attend_impl(Cache& cache, std::int64_t layer_idx, const Q& queries, const KT& new_keys, const VT& new_values,
                 const AttendOptions& options, Finish&& finish) {
  const std::array<std::int64_t, 4> qe = input_extents<std::remove_cvref_t<Q>>::of(queries);
  const std::int64_t q = qe[2];
  const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, layer_idx);
  AttentionMask mask{kv_length,
                     kv_offset,
                     cache.get_seq_length(layer_idx),
                     options.sliding_window,
                     true,
                     options.attention_chunk_size,
                     options.key_padding_mask};
  if constexpr (input_extents<std::remove_cvref_t<KT>>::valid && input_extents<std::remove_cvref_t<VT>>::valid) {
    const std::array<std::int64_t, 4> kv_in = input_extents<std::remove_cvref_t<KT>>::of(new_keys);
    if (kv_in[2] != q)  // the mask sizes were asked for q new tokens
      throw ValueError("attend: queries of shape " + shape_string(qe) + " and new keys of shape " +
                       shape_string(kv_in) + " must have the same seq length");
    // What the update will return: [batch, kv heads, kv_length, head_dim] of the new keys/values.
    // (A copy of kv_length: clang 14 lambdas cannot capture a structured binding.)
    auto returned = [length = mask.kv_length](const auto& x) {
      auto e = input_extents<std::remove_cvref_t<decltype(x)>>::of(x);
      e[2] = length;
      return e;
    };
    detail::check_attention(qe, returned(new_keys), returned(new_values), mask);
  }
  const auto kv = cache.update(new_keys, new_values, layer_idx);
  if (!options.sliding_window && !options.attention_chunk_size && cache.is_sliding(layer_idx))
    mask.sliding_window = cache.get_max_length(layer_idx);
  return finish(kv, mask);
}

}  // namespace detail

// One attention layer's step through a cache: asks the mask sizes and the position, stores the
// new keys/values in layer `layer_idx`, and attends over what the layer returns.
// Queries that attention would refuse (their shape against the new keys, or a bad option) are
// refused before the update, so a throwing attend leaves the cache as it was.
template <class Cache, class Q, class KT, class VT>
auto attend(Cache& cache, std::int64_t layer_idx, const Q& queries, const KT& new_keys, const VT& new_values,
            const AttendOptions& options = {}) {
  return detail::attend_impl(cache, layer_idx, queries, new_keys, new_values, options,
                             [&](const auto& kv, const AttentionMask& mask) {
                               return scaled_dot_product_attention(queries, kv.keys, kv.values, mask, options.scale);
                             });
}

}  // namespace kvc

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
#include <functional>
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
#include <kvc/execution.hpp>
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
  // Whether a query is hidden from keys after its own position (false: bidirectional, an encoder).
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
// A, else converted into `scratch` (room for rows * cols values).
template <class A, class T>
Eigen::Map<const row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>> as_accum(const T* ptr, std::int64_t rows,
                                                                                 std::int64_t cols, std::int64_t pitch,
                                                                                 A* scratch) {
  using map = Eigen::Map<const row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;
  if constexpr (std::is_same_v<A, T>) {
    return map(ptr, rows, cols, Eigen::OuterStride<>(pitch));
  } else {
    if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<A, float>) {
      // A bfloat16 is the upper half of a float: widening is a shift, which vectorises.
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* src = ptr + r * pitch;
        A* dst = scratch + r * cols;
        for (std::int64_t c = 0; c < cols; ++c) {
          const std::uint32_t bits = static_cast<std::uint32_t>(src[c].value) << 16;
          std::memcpy(dst + c, &bits, sizeof bits);
        }
      }
    } else if constexpr (std::is_same_v<A, float> && requires(const T* x, float* y) { T::widen(x, y, rows); }) {
      // One-byte codes (kvc::float8_e4m3, float8_e5m2), widened a row at a time.
      for (std::int64_t r = 0; r < rows; ++r) T::widen(ptr + r * pitch, scratch + r * cols, cols);
    } else {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < cols; ++c) scratch[r * cols + c] = static_cast<A>(ptr[r * pitch + c]);
    }
    return map(scratch, rows, cols, Eigen::OuterStride<>(cols));
  }
}

// The same block copied into dst as A (a plain copy when T is A).
template <class A, class T>
void widen_rows(const T* ptr, std::int64_t rows, std::int64_t cols, std::int64_t pitch, A* dst) {
  if constexpr (std::is_same_v<A, T>) {
    for (std::int64_t r = 0; r < rows; ++r) std::copy(ptr + r * pitch, ptr + r * pitch + cols, dst + r * cols);
  } else {
    (void)as_accum<A>(ptr, rows, cols, pitch, dst);
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

// How host attention cuts its work (dense and paged): a tile is the query rows of one KV head that
// read the keys together (the query heads of its group, `tile_rows` positions each). A tile reads
// its keys in blocks of block_keys rows: a decode tile (at most decode_rows rows) with
// matrix-vector products (no packing copy), a prefill tile with matrix products. A decode tile
// that sees more than split_keys keys in a problem of few tiles is cut into splits (at most
// max_splits, of a multiple of block_keys keys each) that are separate work items, merged
// afterwards in split order. Every tile keeps an online softmax (running maximum m, sum l and
// unnormalised output acc per row). The cuts depend on the problem only, never on the executor,
// so the results do not depend on the thread count.
struct tile_plan {
  static constexpr std::int64_t tile_rows = 64, decode_rows = 16, block_keys = 256, split_keys = 512, max_splits = 8;
  // Splits are made only where the problem has few tiles of its own: enough for about
  // target_items items in all.
  static constexpr std::int64_t target_items = 16;
  // The splits of a tile that sees `width` keys in a problem of `tiles` decode tiles.
  static constexpr std::int64_t splits(bool decode, std::int64_t width, std::int64_t tiles) noexcept {
    if (!decode || width <= split_keys) return 1;
    const std::int64_t wanted =
        (target_items + std::max<std::int64_t>(tiles, 1) - 1) / std::max<std::int64_t>(tiles, 1);
    return std::min({(width + split_keys - 1) / split_keys, max_splits, wanted});
  }
  // The keys of each split of a tile that sees `width` keys.
  static constexpr std::int64_t split_length(std::int64_t width, std::int64_t splits) noexcept {
    const std::int64_t n = (width + splits - 1) / splits;
    return (n + block_keys - 1) / block_keys * block_keys;
  }
};

// n values of A rounded up to whole units of the workspace's alignment: scratch arrays carved one
// after another from an aligned area each start aligned.
template <class A>
constexpr std::int64_t aligned_values(std::int64_t n) noexcept {
  constexpr auto unit = static_cast<std::int64_t>(AttentionWorkspace::alignment / sizeof(A));
  return (n + unit - 1) / unit * unit;
}

// A row-major product dst[m, n] += alpha * lhs[m, k] * rhs, by Eigen's blocked product kernel on
// the calling thread, its packing buffers at `pack` (aligned, pack_values(m, n, k) values). lhs is
// row-major (pitch ldl); rhs is [k, n] row-major (pitch ldr), or with RhsTransposed the transpose
// of a row-major [n, k] (pitch ldr). Eigen's own product allocates those buffers on the heap at
// every call and, in a program built with OpenMP, runs itself on every core when called outside a
// parallel region: a serial attention call would then use threads the caller did not give it.
template <class A>
class packed_product {
  // Eigen's blocking sizes for a product of dst' [m', n'] over depth k in Eigen's column-major
  // view (the row-major product is computed as its transpose), with buffers at `pack`.
  class blocking : public Eigen::internal::level3_blocking<A, A> {
   public:
    blocking(A* pack, Eigen::Index m, Eigen::Index n, Eigen::Index k) {
      Eigen::Index kc = k, mc = m, nc = n;
      Eigen::internal::computeProductBlockingSizes<A, A, 1>(kc, mc, nc, Eigen::Index{1});
      this->m_kc = std::clamp<Eigen::Index>(kc, 1, std::max<Eigen::Index>(k, 1));
      this->m_mc = std::clamp<Eigen::Index>(mc, 1, std::max<Eigen::Index>(m, 1));
      this->m_nc = std::clamp<Eigen::Index>(nc, 1, std::max<Eigen::Index>(n, 1));
      this->m_blockA = pack;
      this->m_blockB = pack + aligned_values<A>(this->m_kc * this->m_mc);
    }
  };

 public:
  // The buffer values a product of these sizes needs at most.
  static constexpr std::int64_t pack_values(std::int64_t m, std::int64_t n, std::int64_t k) noexcept {
    return aligned_values<A>(std::max<std::int64_t>(k, 1) * std::max<std::int64_t>(n, 1)) +
           aligned_values<A>(std::max<std::int64_t>(k, 1) * std::max<std::int64_t>(m, 1));
  }
  template <bool RhsTransposed>
  static void run(std::int64_t m, std::int64_t n, std::int64_t k, const A* lhs, std::int64_t ldl, const A* rhs,
                  std::int64_t ldr, A* dst, std::int64_t ldd, A alpha, A* pack) {
    if (m == 0 || n == 0 || k == 0) return;
    blocking b(pack, n, m, k);
    Eigen::internal::general_matrix_matrix_product<Eigen::Index, A, Eigen::RowMajor, false, A,
                                                   RhsTransposed ? Eigen::ColMajor : Eigen::RowMajor, false,
                                                   Eigen::RowMajor, 1>::run(m, n, k, lhs, ldl, rhs, ldr, dst, 1, ldd,
                                                                            alpha, b, nullptr);
  }
};

// Eigen's packet types carry alignment attributes that a template argument drops (PacketBlock of
// them is how Eigen transposes in registers); Eigen silences the warning in its own headers.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
// Prefill tiles on Eigen's register kernel (gebp) with operands laid out by kvc, where the
// build's kernel has the layout this code writes (4-column right-hand panels and row strips of
// whole packets; otherwise `available` is false and tiles use packed_product). A tile's
// queries are packed once, each key block's keys and values once per tile (once per call in a
// prompt), and the softmax writes its weights straight in the layout the second product reads, so
// the scores are never repacked.
//
// Layouts (as Eigen's packing functions write them): a left operand of `rows` rows (a multiple of
// row_step) and depth k is a run of row strips, strip_width(i, rows) rows starting at row i, the
// strip at i * k holding element (r, p) at p * width + (r - i). A right operand of `cols` columns
// and depth k is a run of 4-column panels (column c, depth p at c * k + p * 4 + c % 4) and then
// single columns (at c * k + p).
template <class A>
struct panel_kernel {
  using traits = Eigen::internal::gebp_traits<A, A>;
  using packet = typename Eigen::internal::packet_traits<A>::type;
  static constexpr std::int64_t row_step = traits::LhsProgress, mr = traits::mr, nr = traits::nr,
                                lanes = Eigen::internal::unpacket_traits<packet>::size;
  // A square of row_step packets, transposed in registers.
  using block = Eigen::internal::PacketBlock<packet, static_cast<int>(row_step)>;
  static constexpr bool available = nr == 4 && row_step > 1 &&
                                    (lanes == row_step) && Eigen::internal::packet_traits<A>::HasExp &&
                                    sizeof(packet) <= AttentionWorkspace::alignment &&
                                    (mr == row_step || mr == 2 * row_step || mr == 3 * row_step);
  using out_map = Eigen::internal::blas_data_mapper<A, Eigen::Index, Eigen::ColMajor, Eigen::Unaligned, 1>;
  template <int Order>
  using in_map = Eigen::internal::const_blas_data_mapper<A, Eigen::Index, Order>;
  using kernel = Eigen::internal::gebp_kernel<A, A, Eigen::Index, out_map, traits::mr, traits::nr, false, false>;

  // `rows` rounded up to whole strips.
  static constexpr std::int64_t padded_rows(std::int64_t rows) noexcept {
    return (rows + row_step - 1) / row_step * row_step;
  }
  // The width of the strip at row i of a left operand of `rows` rows (both multiples of row_step):
  // strips of three packets while three fit, then of two, then of one.
  static constexpr std::int64_t strip_width(std::int64_t i, std::int64_t rows) noexcept {
    for (const std::int64_t w : {3 * row_step, 2 * row_step})
      if (w <= mr && rows - i >= w) return w;
    return row_step;
  }
  // Packs, as a right operand of depth k and `cols` columns, the row-major [cols, k] matrix at src
  // (pitch ld; Transposed) or the row-major [k, cols] one.
  template <bool Transposed>
  static void pack_right(A* dst, const A* src, std::int64_t ld, std::int64_t k, std::int64_t cols) {
    constexpr int order = Transposed ? Eigen::ColMajor : Eigen::RowMajor;
    Eigen::internal::gemm_pack_rhs<A, Eigen::Index, in_map<order>, traits::nr, order>()(dst, in_map<order>(src, ld), k,
                                                                                        cols);
  }
  // dst[rows, cols] (column-major, pitch ld) += alpha * left * right over depth k: left packed with
  // depth left_depth, right with depth right_depth from depth `offset` (offset + k <= right_depth).
  static void run(A* dst, std::int64_t ld, const A* left, std::int64_t left_depth, const A* right,
                  std::int64_t right_depth, std::int64_t offset, std::int64_t rows, std::int64_t k, std::int64_t cols,
                  A alpha) {
    if (rows == 0 || cols == 0 || k == 0) return;
    kernel()(out_map(dst, ld), left, right, rows, k, cols, alpha, left_depth, right_depth, 0, offset);
  }
};

// One prefill item's scratch on panel_kernel (rows padded to whole strips): its queries packed
// (q), a key block's keys and values packed (k, v; `copies` rows of each widened to A first in
// `wide` where the cache stores another type), the block's scores and then weights in the layout
// of the second product's left operand (s), and the online softmax (acc column-major [rows, Dv],
// m, l, corr).
template <class A>
struct panel_scratch {
  A *q, *k, *v, *wide, *s, *acc, *m, *l, *corr;
  static constexpr std::size_t values(std::int64_t rows, std::int64_t D, std::int64_t Dv, std::int64_t block,
                                      std::int64_t copies) noexcept {
    const std::int64_t rp = panel_kernel<A>::padded_rows(rows);
    return static_cast<std::size_t>(aligned_values<A>(rp * D) + aligned_values<A>(block * D) +
                                    aligned_values<A>(block * Dv) + aligned_values<A>(copies * std::max(D, Dv)) +
                                    aligned_values<A>(rp * block) + aligned_values<A>(rp * Dv) +
                                    3 * aligned_values<A>(rp));
  }
  static panel_scratch carve(std::byte* area, std::int64_t rows, std::int64_t D, std::int64_t Dv, std::int64_t block,
                             std::int64_t copies) noexcept {
    const std::int64_t rp = panel_kernel<A>::padded_rows(rows);
    A* p = reinterpret_cast<A*>(area);
    panel_scratch t{};
    for (auto [field, n] : {std::pair{&t.q, rp * D},
                            {&t.k, block * D},
                            {&t.v, block * Dv},
                            {&t.wide, copies * std::max(D, Dv)},
                            {&t.s, rp * block},
                            {&t.acc, rp * Dv},
                            {&t.m, rp},
                            {&t.l, rp},
                            {&t.corr, rp}}) {
      *field = p;
      p += aligned_values<A>(n);
    }
    return t;
  }
  // Packs the item's queries, row r (below rows) from query_row(r) (D values of T), as the left
  // operand of its scores; rows from `rows` to the padded count are zeros. An empty online softmax.
  template <class T, class Row>
  void start(std::int64_t rows, std::int64_t D, std::int64_t Dv, const Row& query_row) const {
    using kernel = panel_kernel<A>;
    const std::int64_t rp = kernel::padded_rows(rows), lanes = kernel::row_step;
    for (std::int64_t i = 0, w; i < rp; i += w) {
      w = kernel::strip_width(i, rp);
      for (std::int64_t r0 = i; r0 < i + w; r0 += lanes) {  // a packet of rows
        A* dst = q + i * D + (r0 - i);
        std::int64_t d = 0;
        if constexpr (std::is_same_v<T, A>) {  // lanes x lanes blocks transposed in registers
          typename kernel::block tile;
          const A* src[static_cast<std::size_t>(kernel::row_step)];
          for (std::int64_t j = 0; j < lanes; ++j) src[j] = r0 + j < rows ? query_row(r0 + j) : nullptr;
          for (; d + lanes <= D; d += lanes) {
            for (std::int64_t j = 0; j < lanes; ++j)
              tile.packet[j] = src[j] != nullptr ? Eigen::internal::ploadu<typename kernel::packet>(src[j] + d)
                                                 : Eigen::internal::pset1<typename kernel::packet>(A(0));
            Eigen::internal::ptranspose(tile);
            for (std::int64_t j = 0; j < lanes; ++j) Eigen::internal::pstore(dst + (d + j) * w, tile.packet[j]);
          }
        }
        for (std::int64_t r = r0; r < r0 + lanes; ++r) {
          const T* src = r < rows ? query_row(r) : nullptr;
          for (std::int64_t e = d; e < D; ++e) dst[e * w + (r - r0)] = src != nullptr ? static_cast<A>(src[e]) : A(0);
        }
      }
    }
    std::fill(m, m + rp, -std::numeric_limits<A>::infinity());
    std::fill(l, l + rp, A(0));
    std::fill(acc, acc + rp * Dv, A(0));
  }
  // Writes row r's output (acc / l times the value scale sv; zeros when it saw nothing) at
  // out_row(r) (Dv values of T), for r below rows; corr holds the rows' factors afterwards.
  template <class T, class Out>
  void finish(std::int64_t rows, std::int64_t Dv, A sv, const Out& out_row) const {
    using kernel = panel_kernel<A>;
    const std::int64_t rp = kernel::padded_rows(rows), lanes = kernel::row_step;
    for (std::int64_t r = 0; r < rp; ++r) corr[r] = r < rows && l[r] > A(0) ? sv / l[r] : A(0);
    for (std::int64_t r0 = 0; r0 < rows; r0 += lanes) {
      std::int64_t d = 0;
      if constexpr (std::is_same_v<T, A>) {  // lanes x lanes blocks transposed in registers
        typename kernel::block tile;
        for (; d + lanes <= Dv; d += lanes) {
          for (std::int64_t j = 0; j < lanes; ++j)
            tile.packet[j] =
                Eigen::internal::pmul(Eigen::internal::pload<typename kernel::packet>(acc + (d + j) * rp + r0),
                                      Eigen::internal::pload<typename kernel::packet>(corr + r0));
          Eigen::internal::ptranspose(tile);
          for (std::int64_t j = 0; j < lanes && r0 + j < rows; ++j)
            Eigen::internal::pstoreu(out_row(r0 + j) + d, tile.packet[j]);
        }
      }
      for (std::int64_t r = r0; r < std::min(rows, r0 + lanes); ++r) {
        T* o = out_row(r);
        for (std::int64_t e = d; e < Dv; ++e) o[e] = static_cast<T>(acc[r + e * rp] * corr[r]);
      }
    }
  }
};

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// Packs keys and values 0 .. n - 1 (key rows at kp, pitch kpitch; value rows at vp, pitch vpitch)
// for fold_panels: the keys at kdst as a right operand of depth D and n columns, the values at
// vdst as one of depth n and Dv columns; rows of another type than A are widened in `wide` first
// (room for n rows of max(D, Dv) values).
template <class A, class KV>
void pack_panels(const KV* kp, std::int64_t kpitch, const KV* vp, std::int64_t vpitch, std::int64_t n, std::int64_t D,
                 std::int64_t Dv, A* kdst, A* vdst, A* wide) {
  constexpr bool in_place = std::is_same_v<A, KV>;
  panel_kernel<A>::template pack_right<true>(kdst, as_accum<A>(kp, n, D, kpitch, wide).data(), in_place ? kpitch : D, D,
                                             n);
  panel_kernel<A>::template pack_right<false>(vdst, as_accum<A>(vp, n, Dv, vpitch, wide).data(), in_place ? vpitch : Dv,
                                              n, Dv);
}

// fold_keys for a prefill item on panel_kernel: folds keys j0 .. j0 + n - 1, packed by
// pack_panels (the values with depth vdepth >= n: a block's first n keys), into the online softmax
// of its `rows` rows. vis and pad as for fold_keys. Each strip of rows multiplies only the keys
// some of its rows see (from a multiple of 4 to one, or to n), so that the keys past the causal
// edge of a strip's last row cost nothing; the padding rows up to whole strips see no key.
template <class A, class Vis>
void fold_panels(const panel_scratch<A>& t, std::int64_t rows, std::int64_t D, std::int64_t Dv, const A* kpacked,
                 const A* vpacked, std::int64_t vdepth, std::int64_t j0, std::int64_t n, A sk, const Vis& vis,
                 const std::uint8_t* pad) {
  using kernel = panel_kernel<A>;
  using packet = typename kernel::packet;
  using Eigen::internal::padd, Eigen::internal::pexp, Eigen::internal::pload, Eigen::internal::pmax,
      Eigen::internal::pmul, Eigen::internal::pset1, Eigen::internal::pstore, Eigen::internal::psub;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  constexpr std::int64_t lanes = kernel::row_step;
  constexpr auto widest = static_cast<std::size_t>(3 * kernel::row_step);  // rows of a strip, at most
  const std::int64_t rp = kernel::padded_rows(rows);
  for (std::int64_t i = 0, w; i < rp; i += w) {
    w = kernel::strip_width(i, rp);
    // The keys [lo[c], hi[c]) of this block row i + c sees, and [first, last) those of the strip.
    std::int64_t lo[widest], hi[widest], first = n, last = 0;
    for (std::int64_t c = 0; c < w; ++c) {
      lo[c] = hi[c] = 0;
      if (i + c < rows) {
        const auto [from, to] = vis(i + c);
        lo[c] = std::clamp<std::int64_t>(from - j0, 0, n);
        hi[c] = std::max(lo[c], std::clamp<std::int64_t>(to - j0, 0, n));
        if (hi[c] > lo[c]) first = std::min(first, lo[c]), last = std::max(last, hi[c]);
      }
    }
    if (last <= first) {  // no row of the strip sees a key of this block
      std::fill(t.corr + i, t.corr + i + w, A(1));
      continue;
    }
    first = first / 4 * 4;  // a column panel's start, as the packed keys are cut
    last = std::min(n, (last + 3) / 4 * 4);
    const std::int64_t width = last - first;
    A* S = t.s + i * n;  // (key first + p, row i + c) at S[p * w + c]
    std::fill(S, S + width * w, A(0));
    kernel::run(S, w, t.q + i * D, D, kpacked + first * D, D, 0, w, D, width, sk);
    bool masked = false;
    for (std::int64_t c = 0; c < w; ++c) {
      lo[c] = std::clamp<std::int64_t>(lo[c] - first, 0, width);
      hi[c] = std::clamp<std::int64_t>(hi[c] - first, lo[c], width);
      masked |= lo[c] > 0 || hi[c] < width;
    }
    if (pad != nullptr)
      for (std::int64_t p = 0; p < width && !masked; ++p) masked = pad[j0 + first + p] == 0;
    const auto mask_with = [&](A value) {
      for (std::int64_t c = 0; c < w; ++c) {
        for (std::int64_t p = 0; p < lo[c]; ++p) S[p * w + c] = value;
        for (std::int64_t p = hi[c]; p < width; ++p) S[p * w + c] = value;
      }
      if (pad != nullptr)
        for (std::int64_t p = 0; p < width; ++p)
          if (pad[j0 + first + p] == 0) std::fill(S + p * w, S + (p + 1) * w, value);
    };
    if (masked) mask_with(neg_inf);
    // The rows' new maxima, their rescaling and the weights exp(score - maximum) with their sums,
    // a packet of rows at a time (w is a whole number of packets).
    alignas(AttentionWorkspace::alignment) A top[widest], sub[widest];
    for (std::int64_t c = 0; c < w; c += lanes) {
      packet x = pload<packet>(t.m + i + c);
      for (std::int64_t p = 0; p < width; ++p) x = pmax(x, pload<packet>(S + p * w + c));
      pstore(top + c, x);
    }
    bool empty = false;
    for (std::int64_t c = 0; c < w; ++c) {
      A& m = t.m[i + c];
      // As in fold_keys: weights below e^-87 are floored there (dropped for the rescaling).
      t.corr[i + c] = top[c] == neg_inf ? A(1) : m - top[c] < A(-87) ? A(0) : std::exp(m - top[c]);
      sub[c] = top[c] == neg_inf ? A(0) : top[c];
      if (top[c] != neg_inf) m = top[c];
      empty |= top[c] == neg_inf;
    }
    const packet floor = pset1<packet>(A(-87));
    packet sums[3] = {pset1<packet>(A(0)), pset1<packet>(A(0)), pset1<packet>(A(0))};
    for (std::int64_t p = 0; p < width; ++p)
      for (std::int64_t c = 0; c < w; c += lanes) {
        const packet e = pexp(pmax(psub(pload<packet>(S + p * w + c), pload<packet>(sub + c)), floor));
        pstore(S + p * w + c, e);
        sums[c / lanes] = padd(sums[c / lanes], e);
      }
    if (masked || empty) {  // hidden keys weigh nothing: zeroed, and the sums taken again
      mask_with(A(0));
      for (std::int64_t c = 0; c < w; ++c)
        if (top[c] == neg_inf)  // a row that has seen nothing yet (only hidden keys so far)
          for (std::int64_t p = 0; p < width; ++p) S[p * w + c] = A(0);
      for (std::int64_t c = 0; c < w; c += lanes) {
        sums[c / lanes] = pset1<packet>(A(0));
        for (std::int64_t p = 0; p < width; ++p) sums[c / lanes] = padd(sums[c / lanes], pload<packet>(S + p * w + c));
      }
    }
    for (std::int64_t c = 0; c < w; c += lanes) pstore(top + c, sums[c / lanes]);
    for (std::int64_t c = 0; c < w; ++c) t.l[i + c] = t.l[i + c] * t.corr[i + c] + top[c];
    // The strip's outputs rescaled, then their weighted values added.
    for (std::int64_t d = 0; d < Dv; ++d)
      for (std::int64_t c = 0; c < w; c += lanes)
        pstore(t.acc + d * rp + i + c, pmul(pload<packet>(t.acc + d * rp + i + c), pload<packet>(t.corr + i + c)));
    kernel::run(t.acc + i, rp, S, width, vpacked, vdepth, first, w, width, Dv, A(1));
  }
}

// One work item's scratch, carved from its worker's workspace area: `copies` rows of keys and of
// values for blocks that are widened or gathered (0 where blocks are read in place), and with
// `products` (prefill tiles) the packing buffers of the tile's matrix products. Each array starts
// at a multiple of the workspace's alignment from the area's (aligned) start.
template <class A>
struct tile_scratch {
  A *q, *k, *v, *s, *acc, *m, *l, *corr, *pack;
  // The packing values of a tile's two products, scores [rows, block] over D and outputs
  // [rows, Dv] over block keys.
  static constexpr std::int64_t pack_values(bool products, std::int64_t rows, std::int64_t D, std::int64_t Dv,
                                            std::int64_t block) noexcept {
    return products ? std::max(packed_product<A>::pack_values(rows, block, D),
                               packed_product<A>::pack_values(rows, Dv, block))
                    : 0;
  }
  static constexpr std::size_t values(std::int64_t rows, std::int64_t D, std::int64_t Dv, std::int64_t block,
                                      std::int64_t copies, bool products) noexcept {
    return static_cast<std::size_t>(aligned_values<A>(rows * D) + aligned_values<A>(copies * D) +
                                    aligned_values<A>(copies * Dv) + aligned_values<A>(rows * block) +
                                    aligned_values<A>(rows * Dv) + 3 * aligned_values<A>(rows) +
                                    pack_values(products, rows, D, Dv, block));
  }
  static tile_scratch carve(std::byte* area, std::int64_t rows, std::int64_t D, std::int64_t Dv, std::int64_t block,
                            std::int64_t copies, bool products) noexcept {
    A* p = reinterpret_cast<A*>(area);
    tile_scratch t{};
    for (auto [field, n] : {std::pair{&t.q, rows * D},
                            {&t.k, copies * D},
                            {&t.v, copies * Dv},
                            {&t.s, rows * block},
                            {&t.acc, rows * Dv},
                            {&t.m, rows},
                            {&t.l, rows},
                            {&t.corr, rows},
                            {&t.pack, pack_values(products, rows, D, Dv, block)}}) {
      *field = p;
      p += aligned_values<A>(n);
    }
    return t;
  }
  // An empty online softmax for `rows` rows.
  void start(std::int64_t rows, std::int64_t Dv) const noexcept {
    std::fill(m, m + rows, -std::numeric_limits<A>::infinity());
    std::fill(l, l + rows, A(0));
    std::fill(acc, acc + rows * Dv, A(0));
  }
};

// Folds keys j0 .. j0 + n - 1 (key rows at kp, pitch kpitch; value rows at vp, pitch vpitch) into
// the online softmax of a tile of `rows` rows whose queries t.q holds, the scores scaled by sk.
// vis(row) gives the keys row `row` sees, [lo, hi) in the same key numbering; pad (null:
// none) is 0 at key j when key j is padding.
template <class A, class KV, class Vis>
void fold_keys(const tile_scratch<A>& t, std::int64_t rows, std::int64_t D, std::int64_t Dv, bool decode, const KV* kp,
               std::int64_t kpitch, const KV* vp, std::int64_t vpitch, std::int64_t j0, std::int64_t n, A sk,
               const Vis& vis, const std::uint8_t* pad) {
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const Eigen::Map<const row_matrix<A>> Q(t.q, rows, D);
  Eigen::Map<row_matrix<A>> S(t.s, rows, n);
  Eigen::Map<row_matrix<A>> acc(t.acc, rows, Dv);
  Eigen::Map<Eigen::Matrix<A, Eigen::Dynamic, 1>> corr(t.corr, rows);
  const auto K = as_accum<A>(kp, n, D, kpitch, t.k);
  if (decode) {
    for (std::int64_t r = 0; r < rows; ++r) S.row(r).noalias() = Q.row(r) * K.transpose();
    S *= sk;  // after the products, as the scores' definition has it
  } else {    // the product's sums times sk (per depth panel where head_dim exceeds Eigen's kc)
    S.setZero();
    packed_product<A>::template run<true>(rows, n, D, t.q, D, K.data(), K.outerStride(), t.s, n, sk, t.pack);
  }
  bool any = false;
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto [lo, hi] = vis(r);
    const std::int64_t jlo = std::clamp<std::int64_t>(lo - j0, 0, n), jhi = std::clamp<std::int64_t>(hi - j0, 0, n);
    auto sr = S.row(r);
    auto seg = sr.segment(jlo, std::max<std::int64_t>(jhi - jlo, 0));
    if (pad != nullptr)
      for (std::int64_t j = jlo; j < jhi; ++j)
        if (pad[j0 + j] == 0) sr(j) = neg_inf;
    const A top = jhi > jlo ? std::max(t.m[r], seg.maxCoeff()) : neg_inf;
    if (jhi <= jlo || top == neg_inf) {  // nothing visible in this block (or only padding)
      corr(r) = A(1);
      sr.setZero();
      continue;
    }
    // Weights far below the row's largest (e^-87: the float range's edge) are floored there, or
    // for the rescaling dropped, rather than left subnormal: subnormal numbers would slow every
    // product they enter many times over, and a weight that small changes no result.
    corr(r) = t.m[r] - top < A(-87) ? A(0) : std::exp(t.m[r] - top);  // 0 while the row saw nothing
    sr.head(jlo).setZero();
    sr.tail(n - jhi).setZero();
    seg = (seg.array() - top).max(A(-87)).exp().matrix();
    if (pad != nullptr)
      for (std::int64_t j = jlo; j < jhi; ++j)
        if (pad[j0 + j] == 0) sr(j) = A(0);
    t.l[r] = t.l[r] * corr(r) + seg.sum();
    t.m[r] = top;
    any = true;
  }
  if (!any) return;
  acc = corr.asDiagonal() * acc;
  const auto V = as_accum<A>(vp, n, Dv, vpitch, t.v);
  if (decode)
    for (std::int64_t r = 0; r < rows; ++r) acc.row(r).noalias() += S.row(r) * V;
  else
    packed_product<A>::template run<false>(rows, Dv, n, t.s, n, V.data(), V.outerStride(), t.acc, Dv, A(1), t.pack);
}

// A tile's row r: its output (acc / l times the value scale sv; zeros when it saw nothing), or its
// partial (m, l, acc: 2 + Dv values) for a merge.
template <class A, class T>
void finish_row(const tile_scratch<A>& t, std::int64_t r, std::int64_t Dv, A sv, T* out) noexcept {
  const A inv = t.l[r] > A(0) ? sv / t.l[r] : A(0);
  for (std::int64_t d = 0; d < Dv; ++d) out[d] = static_cast<T>(t.acc[r * Dv + d] * inv);
}
// A row's partial from its running maximum m, sum l and unnormalised output acc (Dv values).
template <class A>
void store_partial(A m, A l, const A* acc, std::int64_t Dv, A* slot) noexcept {
  slot[0] = m;
  slot[1] = l;
  std::copy(acc, acc + Dv, slot + 2);
}
// The partials of `splits` splits of one row (`pitch` values apart, at most tile_plan::max_splits),
// merged in split order.
template <class A, class T>
void merge_partials(const A* first, std::int64_t splits, std::int64_t pitch, std::int64_t Dv, A sv, T* out) noexcept {
  A top = -std::numeric_limits<A>::infinity(), l = A(0);
  for (std::int64_t s = 0; s < splits; ++s) top = std::max(top, first[s * pitch]);
  for (std::int64_t d = 0; d < Dv; ++d) out[d] = T(0);
  if (top == -std::numeric_limits<A>::infinity()) return;
  A weight[tile_plan::max_splits];  // each split's rescaling to the row's maximum
  for (std::int64_t s = 0; s < splits; ++s) {
    weight[s] = std::exp(first[s * pitch] - top);
    l += first[s * pitch + 1] * weight[s];
  }
  for (std::int64_t d = 0; d < Dv; ++d) {
    A acc = A(0);
    for (std::int64_t s = 0; s < splits; ++s) acc += first[s * pitch + 2 + d] * weight[s];
    out[d] = static_cast<T>(l > A(0) ? acc / l * sv : A(0));
  }
}

// The workspace of a call (the context's, or one of its own in `local`), reserved for items of at
// most `rows` rows reading blocks of at most `block` keys (`copies` of them copied), and `shared`
// values of A shared by the workers.
template <class A>
AttentionWorkspace& reserve_workspace(const AttentionContext& context, AttentionWorkspace& local, std::int64_t items,
                                      std::int64_t rows, std::int64_t D, std::int64_t Dv, std::int64_t block,
                                      std::int64_t copies, bool products, std::size_t shared, bool panels = false) {
  AttentionWorkspace& ws = context.workspace != nullptr ? *context.workspace : local;
  // An item may run on any of the executor's workers, however few the items.
  const int workers = items > 1 ? context.executor.concurrency() : 1;
  // A kept workspace gets whole blocks of the plan even when this call's keys are fewer, so that a
  // later call over more keys (the same chunk further on) finds its room.
  if (context.workspace != nullptr) {
    if (copies > 0) copies = tile_plan::block_keys;
    block = tile_plan::block_keys;
  }
  ws.reserve(workers,
             sizeof(A) * (panels ? panel_scratch<A>::values(rows, D, Dv, block, copies)
                                 : tile_scratch<A>::values(rows, D, Dv, block, copies, products)),
             sizeof(A) * shared);
  return ws;
}

// How attention_into cuts a call into work items and what scratch they take: every number that
// sizes its workspace, from the shapes and the mask alone (so that a caller can reserve the
// workspace before it has the keys: reserve_attention).
struct attention_layout {
  bool decode, panels;
  std::int64_t per_tile, tiles, splits, split_length, items, rows_max, pitch, block, copies;
  // A prefill's packed key blocks: keys [g0, g1), grid_blocks blocks of block_values each per KV head.
  std::int64_t g0, g1, grid_blocks, block_values;
  std::size_t shared;
  // Tile i's keys [lo, hi): every key any of its rows sees.
  std::pair<std::int64_t, std::int64_t> tile_keys(std::int64_t i, const AttentionMask& mask, std::int64_t S,
                                                  std::int64_t Q) const noexcept {
    const std::int64_t first_q = mask.query_position + i * per_tile;
    const std::int64_t last_q = first_q + std::min(per_tile, Q - i * per_tile) - 1;
    const std::int64_t hi = mask.causal ? std::clamp<std::int64_t>(last_q - mask.kv_offset + 1, 0, S) : S;
    const std::int64_t lo = std::clamp<std::int64_t>(mask.first_visible(first_q) - mask.kv_offset, 0, S);
    return {lo, std::max(lo, hi)};
  }
};

template <class A, class KV>
attention_layout layout_attention(std::int64_t B, std::int64_t Hq, std::int64_t Q, std::int64_t D, std::int64_t Hkv,
                                  std::int64_t S, std::int64_t Dv, const AttentionMask& mask) {
  using plan = tile_plan;
  attention_layout L{};
  const std::int64_t group = Hq / Hkv;
  L.decode = group * Q <= plan::decode_rows;
  L.per_tile = L.decode ? Q : std::min(plan::tile_rows, Q);
  L.tiles = (Q + L.per_tile - 1) / L.per_tile;
  const auto [lo0, hi0] = L.tile_keys(0, mask, S, Q);
  const std::int64_t width = hi0 - lo0;
  L.splits = L.decode ? plan::splits(true, width, B * Hkv) : 1;
  L.split_length = plan::split_length(width, L.splits);
  L.items = B * Hkv * L.tiles * L.splits;
  L.rows_max = group * L.per_tile;
  L.pitch = 2 + Dv;
  // Blocks of the plan's size, or of every key when there are fewer (scratch sized to the call).
  L.block = std::min(plan::block_keys, std::max<std::int64_t>(S, 1));
  L.copies = std::is_same_v<A, KV> ? 0 : L.block;  // blocks of A are read in place
  // Prefill tiles on panel_kernel where the build's kernel allows (else on packed_product).
  L.panels = !L.decode && panel_kernel<A>::available;
  // A prompt's prefill (keys [g0, g1) read in all, no more than the queries) packs each block of
  // keys once, for every tile that reads it, into the shared area: grid_blocks blocks of `block`
  // keys from g0 per KV head, block_values each. Other calls pack the blocks per tile.
  L.g0 = S;
  L.g1 = 0;
  L.grid_blocks = 0;
  L.block_values = aligned_values<A>(L.block * D) + aligned_values<A>(L.block * Dv);
  if (L.panels) {
    for (std::int64_t i = 0; i < L.tiles; ++i)
      if (const auto [l, h] = L.tile_keys(i, mask, S, Q); h > l) L.g0 = std::min(L.g0, l), L.g1 = std::max(L.g1, h);
    if (L.g1 > L.g0 && L.g1 - L.g0 <= Q) L.grid_blocks = (L.g1 - L.g0 + L.block - 1) / L.block;
  }
  L.shared = L.splits > 1 ? static_cast<std::size_t>(L.items * L.rows_max * L.pitch)
                          : static_cast<std::size_t>(B * Hkv * L.grid_blocks * L.block_values);
  return L;
}

// Reserves, in context.workspace (which must be set), what attention_into over queries of shape
// q and keys of shape k (values Dv wide) with `mask` takes, so that the call then allocates
// nothing: kvc::attend reserves it before the cache's update, so that no allocation can fail
// after the update.
template <class T, class KV>
void reserve_attention(const std::array<std::int64_t, 4>& q, const std::array<std::int64_t, 4>& k, std::int64_t Dv,
                       const AttentionMask& mask, const AttentionContext& context) {
  using A = accum_t<T>;
  if (q[0] * q[1] * q[2] * Dv == 0 || k[1] < 1) return;  // attention_into returns before its scratch
  const attention_layout L = layout_attention<A, KV>(q[0], q[1], q[2], q[3], k[1], k[2], Dv, mask);
  AttentionWorkspace unused;
  (void)reserve_workspace<A>(context, unused, L.items, L.rows_max, q[3], Dv, L.block, L.copies, !L.decode, L.shared,
                             L.panels);
}

// scaled_dot_product_attention into `out` (resized to [B, Hq, q, Dv]; no allocation when it holds
// that many elements already), with K/V of element type KV (T, or codes that `as_accum` widens)
// and KV head hk's keys and values multiplied by scales.key_scale(hk) and value_scale(hk): the key
// scale joins the softmax scale, the value scale multiplies the output rows.
template <class T, class KV, class Scales>
void attention_into(HostTensor<T>& out, const TensorView<T>& queries, const TensorView<KV>& keys,
                    const TensorView<KV>& values, const AttentionMask& mask, std::optional<double> scale,
                    const Scales& scales, const AttentionContext& context) {
  using A = accum_t<T>;
  check_attention_views(queries, keys, values, mask);
  const std::int64_t B = queries.extent(0), Hq = queries.extent(1), Q = queries.extent(2), D = queries.extent(3);
  const std::int64_t Hkv = keys.extent(1), S = keys.extent(2), Dv = values.extent(3), group = Hq / Hkv;
  out.resize(B, Hq, Q, Dv);
  if (out.size() == 0) return;
  const A s = static_cast<A>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const attention_layout L = layout_attention<A, KV>(B, Hq, Q, D, Hkv, S, Dv, mask);
  const bool decode = L.decode, panels = L.panels;
  const std::int64_t per_tile = L.per_tile, tiles = L.tiles, splits = L.splits, split_length = L.split_length;
  const std::int64_t items = L.items, rows_max = L.rows_max, pitch = L.pitch, block = L.block, copies = L.copies;
  const std::int64_t g0 = L.g0, g1 = L.g1, grid_blocks = L.grid_blocks, block_values = L.block_values;
  const auto tile_keys = [&](std::int64_t i) { return L.tile_keys(i, mask, S, Q); };
  AttentionWorkspace local;
  AttentionWorkspace& ws =
      reserve_workspace<A>(context, local, items, rows_max, D, Dv, block, copies, !decode, L.shared, panels);
  const std::int64_t pad_width = B > 0 ? static_cast<std::int64_t>(mask.key_padding_mask.size()) / B : 0;

  A* const grid = reinterpret_cast<A*>(ws.shared());
  if (grid_blocks > 0)
    context.executor.parallel_for(B * Hkv * grid_blocks, [&](std::int64_t item, int worker) {
      const std::int64_t bh = item / grid_blocks, j0 = g0 + item % grid_blocks * block;
      const std::int64_t b = bh / Hkv, hk = bh % Hkv;
      const auto t = panel_scratch<A>::carve(ws.worker(worker), rows_max, D, Dv, block, copies);
      pack_panels(keys.data() + b * keys.stride(0) + hk * keys.stride(1) + j0 * keys.stride(2), keys.stride(2),
                  values.data() + b * values.stride(0) + hk * values.stride(1) + j0 * values.stride(2),
                  values.stride(2), std::min(block, g1 - j0), D, Dv, grid + item * block_values,
                  grid + item * block_values + aligned_values<A>(block * D), t.wide);
    });
  context.executor.parallel_for(items, [&](std::int64_t item, int worker) {
    // Tiles latest first: a causal tile sees more keys than the tiles before it, and an executor
    // that hands out items in order then ends on the short ones.
    const std::int64_t split = item % splits, tile = tiles - 1 - (item / splits) % tiles, bh = item / (splits * tiles);
    const std::int64_t b = bh / Hkv, hk = bh % Hkv, i0 = tile * per_tile, per_head = std::min(per_tile, Q - i0);
    const std::int64_t rows = group * per_head;
    const A sk = s * static_cast<A>(scales.key_scale(hk)), sv = static_cast<A>(scales.value_scale(hk));
    // Row r of the item is query head hk * group + r / per_head at position i0 + r % per_head;
    // on panels, head hk * group + r % group at position i0 + r / group (a strip's rows are then
    // few positions, and see nearly the same keys).
    const auto position = [&](std::int64_t r) { return panels ? r / group : r % per_head; };
    const auto head = [&](std::int64_t r) { return hk * group + (panels ? r % group : r / per_head); };
    const auto vis = [&](std::int64_t r) {
      const std::int64_t qpos = mask.query_position + i0 + position(r);
      const std::int64_t hi = mask.causal ? std::clamp<std::int64_t>(qpos - mask.kv_offset + 1, 0, S) : S;
      return std::pair<std::int64_t, std::int64_t>{
          std::clamp<std::int64_t>(mask.first_visible(qpos) - mask.kv_offset, 0, S), hi};
    };
    const std::uint8_t* pad =
        mask.key_padding_mask.empty() ? nullptr : mask.key_padding_mask.data() + b * pad_width + mask.kv_offset;
    const KV* kp = keys.data() + b * keys.stride(0) + hk * keys.stride(1);
    const KV* vp = values.data() + b * values.stride(0) + hk * values.stride(1);
    const T* qh = queries.data() + b * queries.stride(0);
    auto [lo, hi] = tile_keys(tile);
    if (panels) {
      const auto t = panel_scratch<A>::carve(ws.worker(worker), rows, D, Dv, block, copies);
      t.template start<T>(rows, D, Dv, [&](std::int64_t r) {
        return qh + head(r) * queries.stride(1) + (i0 + position(r)) * queries.stride(2);
      });
      if (grid_blocks > 0) {
        // The packed blocks from the one that holds lo (fold_panels skips the keys no row sees).
        for (std::int64_t gi = (lo - g0) / block, j0 = g0 + gi * block; j0 < hi; ++gi, j0 += block) {
          const std::int64_t length = std::min(block, g1 - j0);
          const A* packed = grid + (bh * grid_blocks + gi) * block_values;
          fold_panels(t, rows, D, Dv, packed, packed + aligned_values<A>(block * D), length, j0, length, sk, vis, pad);
        }
      } else {
        for (std::int64_t j0 = lo; j0 < hi; j0 += block) {
          const std::int64_t n = std::min(block, hi - j0);
          pack_panels(kp + j0 * keys.stride(2), keys.stride(2), vp + j0 * values.stride(2), values.stride(2), n, D, Dv,
                      t.k, t.v, t.wide);
          fold_panels(t, rows, D, Dv, t.k, t.v, n, j0, n, sk, vis, pad);
        }
      }
      t.template finish<T>(rows, Dv, sv, [&](std::int64_t r) { return &out(b, head(r), i0 + position(r), 0); });
      return;
    }
    const tile_scratch<A> t = tile_scratch<A>::carve(ws.worker(worker), rows, D, Dv, block, copies, !decode);
    for (std::int64_t g = 0; g < group; ++g)
      for (std::int64_t r = 0; r < per_head; ++r)
        for (std::int64_t d = 0; d < D; ++d)
          t.q[(g * per_head + r) * D + d] =
              static_cast<A>(qh[(hk * group + g) * queries.stride(1) + (i0 + r) * queries.stride(2) + d]);
    t.start(rows, Dv);
    lo = std::min(hi, lo + split * split_length);
    if (splits > 1) hi = std::min(hi, lo + split_length);
    for (std::int64_t j0 = lo; j0 < hi; j0 += block) {
      const std::int64_t n = std::min(block, hi - j0);
      fold_keys(t, rows, D, Dv, decode, kp + j0 * keys.stride(2), keys.stride(2), vp + j0 * values.stride(2),
                values.stride(2), j0, n, sk, vis, pad);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      if (splits == 1)
        finish_row(t, r, Dv, sv, &out(b, head(r), i0 + position(r), 0));
      else
        store_partial(t.m[r], t.l[r], t.acc + r * Dv, Dv,
                      reinterpret_cast<A*>(ws.shared()) + (item * rows_max + r) * pitch);
    }
  });
  if (splits == 1) return;
  // Each (batch, KV head)'s rows merged over its splits, in split order.
  context.executor.parallel_for(B * Hkv, [&](std::int64_t bh, int) {
    const std::int64_t b = bh / Hkv, hk = bh % Hkv;
    const A sv = static_cast<A>(scales.value_scale(hk));
    for (std::int64_t r = 0; r < group * Q; ++r)
      merge_partials(reinterpret_cast<const A*>(ws.shared()) + (bh * splits * rows_max + r) * pitch, splits,
                     rows_max * pitch, Dv, sv, &out(b, hk * group + r / Q, r % Q, 0));
  });
}

// attention_into's result as a new tensor.
template <class T, class KV, class Scales>
HostTensor<T> attention_impl(const TensorView<T>& queries, const TensorView<KV>& keys, const TensorView<KV>& values,
                             const AttentionMask& mask, std::optional<double> scale, const Scales& scales,
                             const AttentionContext& context = {}) {
  HostTensor<T> out;
  attention_into(out, queries, keys, values, mask, scale, scales, context);
  return out;
}

}  // namespace detail

namespace detail {

// Queries, keys and values all in device memory: a call for the overloads of <kvc/cuda.hpp>. Every
// other call goes to the host overloads, which take host inputs and refuse the rest.
template <class... X>
inline constexpr bool device_call = (input_in<X, memory_space::device> && ...);

}  // namespace detail

// scaled_dot_product_attention (below) over views of T: what the other overloads call, and what a
// call with explicit template arguments or an explicit instantiation names
// (scaled_dot_product_attention<T>).
template <class T>
HostTensor<T> scaled_dot_product_attention(const TensorView<T>& queries, const TensorView<T>& keys,
                                           const TensorView<T>& values, const AttentionMask& mask,
                                           std::optional<double> scale = std::nullopt) {
  return detail::attention_impl(queries, keys, values, mask, scale, detail::unit_scales{});
}

// out[b, h, i, :] = softmax(scale * q[b, h, i, :] . K[b, h / group, j, :] over visible j) V[b, h / group, :, :]
// queries: [B, Hq, q, D]; keys: [B, Hkv, kv_length, D]; values: [B, Hkv, kv_length, Dv]; Hq a
// multiple of Hkv; each any kvc::tensor_input of one element type T on the host. `scale` defaults
// to 1 / sqrt(D). Returns [B, Hq, q, Dv]. Throws kvc::ValueError for shapes that do not fit.
template <class Q, class K, class V>
  requires(!detail::device_call<Q, K, V>)
HostTensor<detail::input_element_or_t<K>> scaled_dot_product_attention(const Q& queries, const K& keys, const V& values,
                                                                       const AttentionMask& mask,
                                                                       std::optional<double> scale = std::nullopt) {
  using T = detail::input_element_or_t<K>;
  if constexpr (detail::check_inputs<T, memory_space::host, Q, K, V>())
    return scaled_dot_product_attention<T>(input_view(queries), input_view(keys), input_view(values), mask, scale);
  else
    return {};
}

// The same into `out`, resized to [B, Hq, q, Dv] (no allocation when it holds that many elements
// already), run by `context`: its executor's threads (default: serial) in its workspace (default:
// one of the call's own). With a workspace that has served a call of the same sizes, the call
// allocates nothing. The results are the same on any executor and any number of threads.
template <class Q, class K, class V, class T>
  requires(!detail::device_call<Q, K, V>)
void scaled_dot_product_attention(const Q& queries, const K& keys, const V& values, const AttentionMask& mask,
                                  HostTensor<T>& out, const AttentionContext& context = {},
                                  std::optional<double> scale = std::nullopt) {
  if constexpr (detail::check_inputs<T, memory_space::host, Q, K, V>())
    detail::attention_into<T, T>(out, input_view(queries), input_view(keys), input_view(values), mask, scale,
                                 detail::unit_scales{}, context);
}

// A new tensor, run by `context`.
template <class Q, class K, class V>
  requires(!detail::device_call<Q, K, V>)
HostTensor<detail::input_element_or_t<K>> scaled_dot_product_attention(const Q& queries, const K& keys, const V& values,
                                                                       const AttentionMask& mask,
                                                                       const AttentionContext& context,
                                                                       std::optional<double> scale = std::nullopt) {
  HostTensor<detail::input_element_or_t<K>> out;
  scaled_dot_product_attention(queries, keys, values, mask, out, context, scale);
  return out;
}

// How `attend` masks one layer. transformers builds the mask from the model's config, not from
// the cache: pass the model's window (or chunk size) for the layer. When neither is given, a
// sliding layer of the cache masks with its own window (get_max_length) and any other layer is
// full causal. That is right for a cache built from the model's config except for
// chunked_attention layers, which are sliding layers of the chunk size in the cache but need a
// chunk mask: pass attention_chunk_size for them. A DynamicCache() keeps every token in every
// layer, so with it the model's window must always be given.
struct AttendOptions {
  // The model's sliding window for this layer; with neither this nor attention_chunk_size, a
  // sliding layer of the cache masks with its own window.
  std::optional<std::int64_t> sliding_window = std::nullopt;
  // The model's attention chunk size for this layer (chunked_attention layers need it).
  std::optional<std::int64_t> attention_chunk_size = std::nullopt;
  std::optional<double> scale = std::nullopt;  // default 1 / sqrt(head_dim)
  // AttentionMask::key_padding_mask: [batch, width] over absolute positions, width at least the
  // tokens seen after this step (get_seq_length + q), 0 for padding.
  std::span<const std::uint8_t> key_padding_mask = {};
  // The executor and workspace of the attention (host caches; default: serial, a workspace of its
  // own per call).
  AttentionContext context = {};
};

namespace detail {

// What attend takes: queries a tensor_input of the cache's element type in its memory space, keys
// and values what the cache's storage accepts (`accepts`, `view`). AnyCache, which has no storage
// policy, takes host tensor_inputs of the queries' element type.
template <class Cache, class Q>
struct attend_inputs {
  using element_type = input_element_or_t<Q>;
  static constexpr memory_space space = memory_space::host;
  template <class X>
  static constexpr bool accepts = input_of<X, element_type, space>;
  template <class X>
  static auto view(const X& x) {
    return input_view(x);
  }
};
template <class Cache, class Q>
  requires requires { typename Cache::storage_policy; }
struct attend_inputs<Cache, Q> {
  using S = typename Cache::storage_policy;
  using element_type = typename S::element_type;
  static constexpr memory_space space = S::space;
  template <class X>
  static constexpr bool accepts = S::template accepts_input<X>;
  template <class X>
  static auto view(const X& x) {
    return S::input_view(x);
  }
};

// A prepare step that does nothing (attend_impl's default).
struct no_preparation {
  void operator()(const AttentionMask&, const std::array<std::int64_t, 4>&, const std::array<std::int64_t, 4>&) const {}
};

// attend's steps, with `finish(kv, mask)` attending over what the update returned (kvc::attend:
// scaled_dot_product_attention; kvc::attend_fp8: with its scales). `prepare(mask, k, v)`, given
// the mask and the shapes the update will return, runs before the update: what it allocates
// cannot fail after the cache has changed.
template <class Cache, class Q, class KT, class VT, class Finish, class Prepare = no_preparation>
auto attend_impl(Cache& cache, std::int64_t layer_idx, const Q& queries, const KT& new_keys, const VT& new_values,
                 const AttendOptions& options, Finish&& finish, Prepare&& prepare = {}) {
  const std::array<std::int64_t, 4> qe = input_view(queries).extents;
  const std::int64_t q = qe[2];
  const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, layer_idx);
  AttentionMask mask{kv_length,
                     kv_offset,
                     cache.get_seq_length(layer_idx),
                     options.sliding_window,
                     true,
                     options.attention_chunk_size,
                     options.key_padding_mask};
  {
    using in = attend_inputs<Cache, Q>;
    const std::array<std::int64_t, 4> kv_in = in::view(new_keys).extents;
    if (kv_in[2] != q)  // the mask sizes were asked for q new tokens
      throw ValueError("attend: queries of shape " + shape_string(qe) + " and new keys of shape " +
                       shape_string(kv_in) + " must have the same seq length");
    // What the update will return: [batch, kv heads, kv_length, head_dim] of the new keys/values.
    // (A copy of kv_length: clang 14 lambdas cannot capture a structured binding.)
    auto returned = [length = mask.kv_length](const auto& x) {
      auto e = in::view(x).extents;
      e[2] = length;
      return e;
    };
    detail::check_attention(qe, returned(new_keys), returned(new_values), mask);
    // A sliding layer's window: asked before the update where the layer exists already (a layer a
    // replicated cache appends is asked after it).
    bool exists = false;
    if constexpr (requires { cache.size(); }) exists = layer_idx >= 0 && layer_idx < cache.size();
    if (exists && !options.sliding_window && !options.attention_chunk_size && cache.is_sliding(layer_idx))
      mask.sliding_window = cache.get_max_length(layer_idx);
    prepare(mask, returned(new_keys), returned(new_values));
  }
  const auto kv = cache.update(new_keys, new_values, layer_idx);
  if (!mask.sliding_window && !options.attention_chunk_size && cache.is_sliding(layer_idx))
    mask.sliding_window = cache.get_max_length(layer_idx);
  return finish(kv, mask);
}

}  // namespace detail

// The same into `out` (host caches), as scaled_dot_product_attention's `out` overload: a step
// with a workspace in options.context that has served a step of the same sizes, through a cache
// with room for the tokens (reserve), allocates nothing.
template <class Cache, class Q, class KT, class VT, class T>
void attend(Cache& cache, std::int64_t layer_idx, const Q& queries, const KT& new_keys, const VT& new_values,
            HostTensor<T>& out, const AttendOptions& options = {}) {
  using in = detail::attend_inputs<Cache, Q>;
  constexpr bool accepted = detail::input_of<Q, T, memory_space::host> && in::template accepts<KT> &&
                            in::template accepts<VT> && in::space == memory_space::host;
  if constexpr (detail::require_inputs<accepted, Q, KT, VT>()) {
    const auto q = input_view(queries);  // (views from here on: instantiated once per cache)
    // The output and the scratch are made before the update (in the caller's workspace, or in one
    // of the call's own): a failed allocation leaves the cache as it was.
    AttentionWorkspace local;
    AttentionContext context = options.context;
    if (context.workspace == nullptr) context.workspace = &local;
    detail::attend_impl(
        cache, layer_idx, q, in::view(new_keys), in::view(new_values), options,
        [&](const auto& kv, const AttentionMask& mask) {
          scaled_dot_product_attention(q, kv.keys, kv.values, mask, out, context, options.scale);
          return 0;
        },
        [&](const AttentionMask& mask, const std::array<std::int64_t, 4>& k, const std::array<std::int64_t, 4>& v) {
          detail::reserve_attention<T, T>(q.extents, k, v[3], mask, context);
          // (not when `out` holds the step's inputs: resizing it would free what the update reads)
          const auto holds = [&](const auto* p) {
            return out.size() > 0 && std::less_equal<const T*>{}(out.data(), p) &&
                   std::less<const T*>{}(p, out.data() + out.size());
          };
          if (!holds(q.data()) && !holds(in::view(new_keys).data()) && !holds(in::view(new_values).data()))
            out.resize(q.extents[0], q.extents[1], q.extents[2], v[3]);
        });
  }
}

// One attention layer's step through a cache: asks the mask sizes and the position, stores the
// new keys/values in layer `layer_idx`, and attends over what the layer returns.
// Queries that attention would refuse (their shape against the new keys, or a bad option) are
// refused before the update, so a throwing attend leaves the cache as it was.
// Queries, keys and values: any kvc::tensor_input of the cache's element type in its memory space.
// Returns [batch, Hq, q, head_dim] (a HostTensor, or a DeviceTensor for a device cache).
template <class Cache, class Q, class KT, class VT>
auto attend(Cache& cache, std::int64_t layer_idx, const Q& queries, const KT& new_keys, const VT& new_values,
            const AttendOptions& options = {}) {
  using in = detail::attend_inputs<Cache, Q>;
  constexpr bool accepted =
      detail::input_of<Q, typename in::element_type, in::space> && in::template accepts<KT> && in::template accepts<VT>;
  if constexpr (detail::require_inputs<accepted, Q, KT, VT>()) {
    // Views from here on: the step is instantiated once per cache, not once per form of the inputs.
    const auto q = input_view(queries);
    if constexpr (in::space == memory_space::host) {
      HostTensor<typename in::element_type> out;  // (the `out` form: nothing allocated after the update)
      attend(cache, layer_idx, q, in::view(new_keys), in::view(new_values), out, options);
      return out;
    } else {
      return detail::attend_impl(cache, layer_idx, q, in::view(new_keys), in::view(new_values), options,
                                 [&](const auto& kv, const AttentionMask& mask) {
                                   return scaled_dot_product_attention(q, kv.keys, kv.values, mask, options.scale);
                                 });
    }
  } else {
    return HostTensor<typename in::element_type>();
  }
}

}  // namespace kvc

#pragma once
// The two quantization codecs of kvc::QuantizedLayer (docs/quantized.md): kvc::QuantoCodec
// (min/max affine, optimum-quanto's MaxOptimizer idea) and kvc::HqqCodec (affine with the zero
// point refined by half-quadratic proximal iterations, the HQQ method). Both are kvc's own
// implementations; they follow the published methods, not the libraries' code, so the numbers are
// close to but not bit-identical with transformers' backends.
//
// What is quantized. A K or V tensor is [batch, heads, seq, head_dim]; kvc quantizes each
// (batch, head) block, a [seq, head_dim] row-major matrix, on its own: no group ever spans two
// blocks, so a batch row can be copied (reorder_cache, batch_*) without touching the numbers.
// Inside a block, the `axis` argument picks one of two groupings (G = q_group_size):
//   along head_dim (quanto axis 0, HQQ axis 1): the block's seq*head_dim elements in memory order
//       are cut into runs of G consecutive elements (the last run of a block may be shorter).
//       With G dividing head_dim this is "G consecutive channels of one token"; with G > head_dim
//       a group covers G / head_dim consecutive tokens. This is what both libraries do for this
//       axis on a contiguous tensor (reshape to [-1, G]), restricted to one block.
//   along seq (quanto axis -1, HQQ axis 0): each head_dim column of a block is cut into runs of
//       G consecutive tokens (the last run shorter when seq % G != 0): one scale per channel and
//       token chunk. quanto's axis -1 groups G consecutive rows of one channel the same way (but
//       over the flattened batch*heads*seq rows); HQQ's axis 0 reshapes the flattened tensor to
//       [G, -1], which is this grouping only when seq == G, and kvc uses this one for every seq.
// In both libraries the axis names the dimension that keeps one scale per index (axis 0: one per
// row of the [-1, G] reshape; quanto axis -1: one per channel), which is why "axis 0" of quanto
// and "axis 1" of HQQ both mean groups along head_dim.
//
// Numbers. Every group stores `scale` and `offset` (the value of code 0): x ~ offset + scale * q
// with q in [0, 2^nbits - 1]. Both are stored in the element type when it has 16 bits
// (Eigen::half, Eigen::bfloat16), in float for float and double (detail::quant_meta_t). Codes are
// computed with the stored (rounded) scale and offset, so the rounding of the metadata is
// compensated where it can be. A constant group has scale 0 and reconstructs exactly.
//
// Packing. The codes of one block are a little-endian bit stream: code i occupies bits
// [i * nbits, (i + 1) * nbits) of the block's bytes, bit 0 being the least significant bit of byte
// 0. So 8-bit codes are one byte each, two 4-bit codes share a byte (the first in the low nibble),
// four 2-bit and eight 1-bit codes share a byte, and 3-bit codes run across byte boundaries (3
// bits each, nothing wasted). Each block starts on a byte boundary (ceil(n * nbits / 8) bytes).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include <kvc/errors.hpp>

namespace kvc {
namespace detail {

enum class quant_grouping { along_head_dim, along_seq };

// A group's reconstruction: x ~ offset + scale * q.
struct affine_params {
  float scale = 0;
  float offset = 0;
};

// What scales and offsets are stored in for element type T.
template <class T>
using quant_meta_t =
    std::conditional_t<std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>, T, float>;

inline std::int64_t packed_bytes(std::int64_t count, int nbits) noexcept { return (count * nbits + 7) / 8; }

// Writes `count` codes (each < 2^nbits) as a bit stream at the start of `out`, which must hold
// packed_bytes(count, nbits) bytes; those bytes are overwritten.
inline void pack_codes(const std::uint8_t* codes, std::int64_t count, int nbits, std::uint8_t* out) noexcept {
  const std::int64_t nbytes = packed_bytes(count, nbits);
  std::fill(out, out + nbytes, std::uint8_t{0});
  if (nbits == 8) {
    std::copy(codes, codes + count, out);
    return;
  }
  if (nbits == 4 || nbits == 2 || nbits == 1) {
    const int per = 8 / nbits;
    for (std::int64_t i = 0; i < count; ++i)
      out[i / per] = static_cast<std::uint8_t>(out[i / per] | (codes[i] << ((i % per) * nbits)));
    return;
  }
  std::uint64_t bit = 0;
  for (std::int64_t i = 0; i < count; ++i, bit += static_cast<std::uint64_t>(nbits)) {
    const std::uint32_t c = codes[i];
    const std::uint64_t byte = bit >> 3;
    const unsigned shift = static_cast<unsigned>(bit & 7);
    out[byte] = static_cast<std::uint8_t>(out[byte] | (c << shift));
    if (shift + static_cast<unsigned>(nbits) > 8) out[byte + 1] = static_cast<std::uint8_t>(out[byte + 1] | (c >> (8 - shift)));
  }
}

// Reads codes [first, first + count) of a bit stream written by pack_codes.
inline void unpack_codes(const std::uint8_t* in, std::int64_t first, std::int64_t count, int nbits,
                         std::uint8_t* codes) noexcept {
  const auto bit0 = static_cast<std::uint64_t>(first) * static_cast<std::uint64_t>(nbits);
  if ((bit0 & 7) == 0 && (nbits == 8 || nbits == 4 || nbits == 2 || nbits == 1)) {
    const std::uint8_t* p = in + (bit0 >> 3);
    const int per = 8 / nbits;
    const unsigned mask = (1u << nbits) - 1u;
    std::int64_t i = 0;
    if (nbits == 8) {
      std::copy(p, p + count, codes);
      return;
    }
    if (nbits == 4) {
      for (; i + 2 <= count; i += 2, ++p) {
        codes[i] = static_cast<std::uint8_t>(*p & 0xF);
        codes[i + 1] = static_cast<std::uint8_t>(*p >> 4);
      }
    } else {
      for (; i + per <= count; i += per, ++p)
        for (int j = 0; j < per; ++j) codes[i + j] = static_cast<std::uint8_t>((*p >> (j * nbits)) & mask);
    }
    for (int j = 0; i < count; ++i, ++j) codes[i] = static_cast<std::uint8_t>((*p >> (j * nbits)) & mask);
    return;
  }
  const unsigned mask = (1u << nbits) - 1u;
  std::uint64_t bit = bit0;
  for (std::int64_t i = 0; i < count; ++i, bit += static_cast<std::uint64_t>(nbits)) {
    const std::uint64_t byte = bit >> 3;
    const unsigned shift = static_cast<unsigned>(bit & 7);
    std::uint32_t v = static_cast<std::uint32_t>(in[byte]) >> shift;
    if (shift + static_cast<unsigned>(nbits) > 8) v |= static_cast<std::uint32_t>(in[byte + 1]) << (8 - shift);
    codes[i] = static_cast<std::uint8_t>(v & mask);
  }
}

inline float round_code(float v, float qmax) noexcept { return std::clamp(std::floor(v + 0.5f), 0.0f, qmax); }

// The min/max fit both codecs start from: code 0 is the minimum, code qmax the maximum.
inline affine_params minmax_fit(std::span<const float> x, int nbits) noexcept {
  if (x.empty()) return {};
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  const float qmax = static_cast<float>((1 << nbits) - 1);
  return {(*hi - *lo) / qmax, *lo};
}

}  // namespace detail

// optimum-quanto's scheme: group-wise affine quantization, scale = (max - min) / (2^nbits - 1),
// zero point at the group's minimum (MaxOptimizer). nbits 2 or 4; axis 0 (groups along head_dim)
// or -1 (groups along seq).
struct QuantoCodec {
  static constexpr std::string_view backend = "quanto";
  static constexpr std::string_view layer_name = "QuantoQuantizedLayer";

  // transformers' QuantoQuantizedLayer checks, in its order.
  static void validate(std::int64_t nbits, std::int64_t axis_key, std::int64_t axis_value) {
    if (nbits != 2 && nbits != 4)
      throw ValueError("`nbits` for `quanto` backend has to be one of [`2`, `4`] but got " + std::to_string(nbits));
    if (axis_key != 0 && axis_key != -1)
      throw ValueError("`axis_key` for `quanto` backend has to be one of [`0`, `-1`] but got " +
                       std::to_string(axis_key));
    if (axis_value != 0 && axis_value != -1)
      throw ValueError("`axis_value` for `quanto` backend has to be one of [`0`, `-1`] but got " +
                       std::to_string(axis_value));
  }

  static constexpr detail::quant_grouping grouping(std::int64_t axis) noexcept {
    return axis == 0 ? detail::quant_grouping::along_head_dim : detail::quant_grouping::along_seq;
  }

  static detail::affine_params fit(std::span<const float> group, int nbits) noexcept {
    return detail::minmax_fit(group, nbits);
  }
};

// The HQQ scheme (half-quadratic quantization): the min/max fit, then the zero point is refined by
// alternating (1) a generalized soft-threshold of the error W - dequant(W_q) under an lp norm with
// p < 1 (the sparse "outlier" part the reconstruction is allowed to miss) and (2) the closed-form
// zero that best explains the rest; the penalty beta grows by kappa each round, and the rounds stop
// when the mean absolute error stops decreasing (the best zero seen is kept). The scale stays
// the min/max one, as in HQQ. nbits 1, 2, 3, 4 or 8; axis 1 (groups along head_dim) or 0
// (groups along seq).
struct HqqCodec {
  static constexpr std::string_view backend = "hqq";
  static constexpr std::string_view layer_name = "HQQQuantizedLayer";

  // The optimizer's settings (the values the HQQ paper and library use by default).
  static constexpr float lp_norm = 0.7f;
  static constexpr float beta0 = 10.0f;
  static constexpr float kappa = 1.01f;
  static constexpr int iterations = 20;

  // transformers' HQQQuantizedLayer checks, in its order.
  static void validate(std::int64_t nbits, std::int64_t axis_key, std::int64_t axis_value) {
    if (nbits != 1 && nbits != 2 && nbits != 3 && nbits != 4 && nbits != 8)
      throw ValueError("`nbits` for `HQQ` backend has to be one of [`1`, `2`, `3`, `4`, `8`] but got " +
                       std::to_string(nbits));
    if (axis_key != 0 && axis_key != 1)
      throw ValueError("`axis_key` for `HQQ` backend has to be one of [`0`, `1`] but got " + std::to_string(axis_key));
    if (axis_value != 0 && axis_value != 1)
      throw ValueError("`axis_value` for `HQQ` backend has to be one of [`0`, `1`] but got " +
                       std::to_string(axis_value));
  }

  static constexpr detail::quant_grouping grouping(std::int64_t axis) noexcept {
    return axis == 1 ? detail::quant_grouping::along_head_dim : detail::quant_grouping::along_seq;
  }

  static detail::affine_params fit(std::span<const float> w, int nbits) noexcept {
    const detail::affine_params init = detail::minmax_fit(w, nbits);
    if (!(init.scale > 0) || !std::isfinite(init.scale)) return init;
    // Work with the zero in code units: x ~ s * (q - z), so z = -offset / s.
    const float qmax = static_cast<float>((1 << nbits) - 1);
    const float s = init.scale;
    const float inv = 1.0f / s;
    float z = -init.offset * inv;
    float best_z = z;
    float best_err = INFINITY;
    float beta = beta0;
    const auto n = static_cast<float>(w.size());
    for (int it = 0; it < iterations; ++it) {
      float err = 0;
      float zsum = 0;
      for (const float x : w) {
        const float q = detail::round_code(x * inv + z, qmax);
        const float e = x - s * (q - z);
        err += std::fabs(e);
        // Generalized soft-threshold of the error for the lp (p < 1) penalty.
        const float a = std::fabs(e);
        float shrunk = 0;
        if (a > 0) {
          const float t = a - std::pow(a, lp_norm - 1.0f) / beta;
          if (t > 0) shrunk = std::copysign(t, e);
        }
        // The zero that explains W - shrunk best in the least-squares sense: mean(q - (x - e) / s).
        zsum += q - (x - shrunk) * inv;
      }
      err /= n;
      if (err < best_err) {
        best_err = err;
        best_z = z;
      } else {
        break;
      }
      z = zsum / n;
      beta *= kappa;
    }
    return {s, -s * best_z};
  }
};

namespace detail {

// One quantized K or V tensor: `blocks` = batch * heads blocks of `tokens` x `dim` elements, each
// encoded on its own (codes as a bit stream per block, then one scale and one offset per group).
// M is the metadata type (quant_meta_t of the element type).
template <class M>
class quantized_tensor {
 public:
  quantized_tensor() = default;

  // Quantizes `tokens` rows of every (batch, head) block of `src`: block (b, h) starts at
  // src + b * stride_b + h * stride_h and its rows of `dim` elements follow each other.
  template <class Codec, class T>
  static quantized_tensor encode(int nbits, quant_grouping grouping, std::int64_t group_size, const T* src,
                                 std::int64_t batch, std::int64_t heads, std::int64_t tokens, std::int64_t dim,
                                 std::int64_t stride_b, std::int64_t stride_h) {
    quantized_tensor out(nbits, grouping, group_size, batch, heads, tokens, dim);
    const std::int64_t n = tokens * dim;
    if (n == 0) return out;
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
    std::vector<float> buf(static_cast<std::size_t>(std::max(group_size, dim)));
    const float qmax = static_cast<float>((1 << nbits) - 1);
    for (std::int64_t blk = 0; blk < batch * heads; ++blk) {
      const T* x = src + (blk / heads) * stride_b + (blk % heads) * stride_h;
      M* scale = out.scale_.data() + blk * out.groups_;
      M* offset = out.offset_.data() + blk * out.groups_;
      // Fits one group (the values in buf[0, len)), stores its rounded metadata, and returns it.
      auto fit = [&](std::int64_t g, std::int64_t len) {
        const affine_params p = Codec::fit(std::span<const float>(buf.data(), static_cast<std::size_t>(len)), nbits);
        scale[g] = static_cast<M>(p.scale);
        offset[g] = static_cast<M>(p.offset);
        return affine_params{static_cast<float>(scale[g]), static_cast<float>(offset[g])};
      };
      auto code = [&](float v, const affine_params& p, float inv) -> std::uint8_t {
        if (!(p.scale > 0)) return 0;
        return static_cast<std::uint8_t>(round_code((v - p.offset) * inv, qmax));
      };
      if (grouping == quant_grouping::along_head_dim) {
        for (std::int64_t g = 0; g < out.groups_; ++g) {
          const std::int64_t first = g * group_size, len = std::min(group_size, n - first);
          for (std::int64_t i = 0; i < len; ++i) buf[static_cast<std::size_t>(i)] = static_cast<float>(x[first + i]);
          const affine_params p = fit(g, len);
          const float inv = 1.0f / p.scale;
          for (std::int64_t i = 0; i < len; ++i)
            codes[static_cast<std::size_t>(first + i)] = code(buf[static_cast<std::size_t>(i)], p, inv);
        }
      } else {
        for (std::int64_t t = 0; t * group_size < tokens; ++t) {
          const std::int64_t s0 = t * group_size, len = std::min(group_size, tokens - s0);
          for (std::int64_t d = 0; d < dim; ++d) {
            for (std::int64_t i = 0; i < len; ++i)
              buf[static_cast<std::size_t>(i)] = static_cast<float>(x[(s0 + i) * dim + d]);
            const affine_params p = fit(t * dim + d, len);
            const float inv = 1.0f / p.scale;
            for (std::int64_t i = 0; i < len; ++i)
              codes[static_cast<std::size_t>((s0 + i) * dim + d)] = code(buf[static_cast<std::size_t>(i)], p, inv);
          }
        }
      }
      pack_codes(codes.data(), n, nbits, out.codes_.data() + blk * out.block_bytes_);
    }
    return out;
  }

  // Writes the dequantized rows of block (b, h) to dst + b * stride_b + h * stride_h (rows of
  // `dim` elements one after the other). Allocates nothing.
  template <class T>
  void decode(T* dst, std::int64_t stride_b, std::int64_t stride_h) const noexcept {
    constexpr std::int64_t piece = 256;
    std::uint8_t codes[piece];
    const std::int64_t n = tokens_ * dim_;
    for (std::int64_t blk = 0; blk < batch_ * heads_; ++blk) {
      T* y = dst + (blk / heads_) * stride_b + (blk % heads_) * stride_h;
      const std::uint8_t* bits = codes_.data() + blk * block_bytes_;
      const M* scale = scale_.data() + blk * groups_;
      const M* offset = offset_.data() + blk * groups_;
      if (grouping_ == quant_grouping::along_head_dim) {
        for (std::int64_t g = 0; g < groups_; ++g) {
          const float s = static_cast<float>(scale[g]), o = static_cast<float>(offset[g]);
          const std::int64_t end = std::min(n, (g + 1) * group_size_);
          for (std::int64_t i = g * group_size_; i < end; i += piece) {
            const std::int64_t len = std::min(piece, end - i);
            unpack_codes(bits, i, len, nbits_, codes);
            for (std::int64_t j = 0; j < len; ++j) y[i + j] = static_cast<T>(o + s * static_cast<float>(codes[j]));
          }
        }
      } else {
        for (std::int64_t r = 0; r < tokens_; ++r) {
          const M* sr = scale + (r / group_size_) * dim_;
          const M* orow = offset + (r / group_size_) * dim_;
          for (std::int64_t d0 = 0; d0 < dim_; d0 += piece) {
            const std::int64_t len = std::min(piece, dim_ - d0);
            unpack_codes(bits, r * dim_ + d0, len, nbits_, codes);
            for (std::int64_t j = 0; j < len; ++j)
              y[r * dim_ + d0 + j] = static_cast<T>(static_cast<float>(orow[d0 + j]) +
                                                    static_cast<float>(sr[d0 + j]) * static_cast<float>(codes[j]));
          }
        }
      }
    }
  }

  // A copy whose batch entry i is this tensor's batch entry indices[i]: packed bytes and metadata
  // are copied as they are, so the numbers do not change.
  quantized_tensor gathered(std::span<const std::int64_t> indices) const {
    quantized_tensor out(nbits_, grouping_, group_size_, static_cast<std::int64_t>(indices.size()), heads_, tokens_,
                         dim_);
    const std::int64_t cb = heads_ * block_bytes_, mb = heads_ * groups_;
    for (std::size_t i = 0; i < indices.size(); ++i) {
      const auto to = static_cast<std::int64_t>(i);
      std::copy_n(codes_.begin() + indices[i] * cb, cb, out.codes_.begin() + to * cb);
      std::copy_n(scale_.begin() + indices[i] * mb, mb, out.scale_.begin() + to * mb);
      std::copy_n(offset_.begin() + indices[i] * mb, mb, out.offset_.begin() + to * mb);
    }
    return out;
  }

  std::int64_t tokens() const noexcept { return tokens_; }
  // Bytes held: packed codes plus every group's scale and offset.
  std::int64_t bytes() const noexcept {
    return static_cast<std::int64_t>(codes_.size() + sizeof(M) * (scale_.size() + offset_.size()));
  }
  std::int64_t code_bytes() const noexcept { return static_cast<std::int64_t>(codes_.size()); }
  std::int64_t groups_per_block() const noexcept { return groups_; }
  const std::vector<std::uint8_t>& packed() const noexcept { return codes_; }

 private:
  quantized_tensor(int nbits, quant_grouping grouping, std::int64_t group_size, std::int64_t batch, std::int64_t heads,
                   std::int64_t tokens, std::int64_t dim)
      : nbits_(nbits), grouping_(grouping), group_size_(group_size), batch_(batch), heads_(heads), tokens_(tokens),
        dim_(dim) {
    block_bytes_ = packed_bytes(tokens * dim, nbits);
    groups_ = grouping == quant_grouping::along_head_dim ? (tokens * dim + group_size - 1) / group_size
                                                         : (tokens + group_size - 1) / group_size * dim;
    codes_.resize(static_cast<std::size_t>(batch * heads * block_bytes_));
    scale_.resize(static_cast<std::size_t>(batch * heads * groups_));
    offset_.resize(static_cast<std::size_t>(batch * heads * groups_));
  }

  int nbits_ = 4;
  quant_grouping grouping_ = quant_grouping::along_head_dim;
  std::int64_t group_size_ = 1, batch_ = 0, heads_ = 0, tokens_ = 0, dim_ = 0;
  std::int64_t block_bytes_ = 0, groups_ = 0;
  std::vector<std::uint8_t> codes_;
  std::vector<M> scale_, offset_;
};

}  // namespace detail

}  // namespace kvc

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
// Host and device. The arithmetic of fitting, coding and reconstructing is written once, as
// KVC_HOST_DEVICE functions over a loader (a callable returning element i of a group as float),
// and runs unchanged in kvc::QuantizedLayer over HostStorage (quantized_tensor below) and in the
// CUDA kernels over CudaStorage (<kvc/policies/quantization/cuda_codecs.cuh>). Products are
// rounded before they are added (mul_rn), so nvcc cannot fuse them into FMAs: quanto gives the
// same bits on both; HQQ's soft-threshold calls powf, whose last bit may differ on the device.
//
// Packing. The codes of one block are a little-endian bit stream: code i occupies bits
// [i * nbits, (i + 1) * nbits) of the block's bytes, bit 0 being the least significant bit of byte
// 0. So 8-bit codes are one byte each, two 4-bit codes share a byte (the first in the low nibble),
// four 2-bit and eight 1-bit codes share a byte, and 3-bit codes run across byte boundaries (3
// bits each, nothing wasted). Each block starts on a byte boundary (ceil(n * nbits / 8) bytes).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <math.h>  // floorf, fabsf, powf, copysignf: the same names in host and device code
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#endif

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <Eigen/Core>

#include <kvc/detail/element_conversion.hpp>  // float_conversion, to_float, from_float
#include <kvc/detail/host_device.hpp>         // KVC_HOST_DEVICE, mul_rn, add_rn
#include <kvc/detail/simd.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/tensor.hpp>  // KVC_HOST_DEVICE, memory_space

namespace kvc {
namespace detail {

enum class quant_grouping { along_head_dim, along_seq };

// A group's reconstruction: x ~ offset + scale * q.
struct affine_params {
  float scale = 0;
  float offset = 0;
};

// What scales and offsets are stored in for element type T: T itself for the 16-bit floats
// (Eigen::half, Eigen::bfloat16 and their CUDA twins __half, __nv_bfloat16), float otherwise.
template <class T>
using quant_meta_t = std::conditional_t<sizeof(T) == 2, T, float>;

// The reconstruction of code q of a group: offset + scale * q.
KVC_HOST_DEVICE inline float dequant(float offset, float scale, unsigned q) noexcept {
  return add_rn(offset, mul_rn(scale, static_cast<float>(q)));
}

// Code i of a bit stream written by pack_codes (any width, any position).
KVC_HOST_DEVICE inline unsigned code_at(const std::uint8_t* bits, std::int64_t i, int nbits) noexcept {
  const auto bit = static_cast<std::uint64_t>(i) * static_cast<std::uint64_t>(nbits);
  const std::uint64_t byte = bit >> 3;
  const auto shift = static_cast<unsigned>(bit & 7);
  unsigned v = static_cast<unsigned>(bits[byte]) >> shift;
  if (shift + static_cast<unsigned>(nbits) > 8) v |= static_cast<unsigned>(bits[byte + 1]) << (8 - shift);
  return v & ((1u << nbits) - 1u);
}

// Where the elements of group g of a [tokens, dim] block are: element i of the group is element
// first + i * step of the block, for i < len. Groups along head_dim cut the block's elements in
// memory order into runs of group_size; groups along seq are numbered chunk * dim + channel.
struct group_span {
  std::int64_t first = 0, step = 1, len = 0;
};
KVC_HOST_DEVICE inline group_span span_of_group(quant_grouping grouping, std::int64_t g, std::int64_t group_size,
                                                std::int64_t tokens, std::int64_t dim) noexcept {
  if (grouping == quant_grouping::along_head_dim) {
    const std::int64_t first = g * group_size, n = tokens * dim;
    return {first, 1, n - first < group_size ? n - first : group_size};
  }
  const std::int64_t s0 = (g / dim) * group_size;
  return {s0 * dim + g % dim, dim, tokens - s0 < group_size ? tokens - s0 : group_size};
}
// The group of element i of a block (the inverse of span_of_group).
KVC_HOST_DEVICE inline std::int64_t group_of(quant_grouping grouping, std::int64_t i, std::int64_t group_size,
                                             std::int64_t dim) noexcept {
  if (grouping == quant_grouping::along_head_dim) return i / group_size;
  return (i / dim) / group_size * dim + i % dim;
}

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
    if (shift + static_cast<unsigned>(nbits) > 8)
      out[byte + 1] = static_cast<std::uint8_t>(out[byte + 1] | (c >> (8 - shift)));
  }
}

// Reads codes [first, first + count) of a bit stream written by pack_codes.
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
// Sixteen codes of Bits = 4 or 2 bits packed from bit 0 of b (8 or 4 bytes), one a byte, in order.
template <int Bits>
inline __m128i codes16_sse2(const std::uint8_t* b) noexcept {
  const __m128i m = _mm_set1_epi8(static_cast<char>((1 << Bits) - 1));
  if constexpr (Bits == 4) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    return _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
  } else {
    std::int32_t word;
    std::memcpy(&word, b, 4);
    const __m128i x = _mm_cvtsi32_si128(word);
    const __m128i c0 = _mm_and_si128(x, m), c1 = _mm_and_si128(_mm_srli_epi16(x, 2), m);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(x, 6), m);
    return _mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3));
  }
}
#endif

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
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
    if (nbits == 4 || nbits == 2) {  // sixteen at a time
      for (; i + 16 <= count; i += 16, p += 16 / per)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), nbits == 4 ? codes16_sse2<4>(p) : codes16_sse2<2>(p));
    }
#endif
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
  for (std::int64_t i = 0; i < count; ++i) codes[i] = static_cast<std::uint8_t>(code_at(in, first + i, nbits));
}

#if defined(KVC_X86_AVX2_DISPATCH)
// Eight codes (the low 8 bytes of `codes`, one a byte) dequantized to to[0, 8).
KVC_TARGET_AVX2 inline void dequant8_avx2(float* to, __m128i codes, float offset, float scale) noexcept {
  const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  _mm256_storeu_ps(to, _mm256_add_ps(_mm256_set1_ps(offset), _mm256_mul_ps(_mm256_set1_ps(scale), c)));
}

// dequant_packed's AVX2 form, 32 codes at a time; returns how many it did (a multiple of 32).
template <int Bits>
KVC_TARGET_AVX2 inline std::int64_t dequant_packed_avx2(const std::uint8_t* p, std::int64_t count, float offset,
                                                        float scale, float* out) noexcept {
  constexpr int per = 8 / Bits;
  const __m128i m = _mm_set1_epi8(static_cast<char>((1 << Bits) - 1));
  std::int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const std::uint8_t* b = p + i / per;
    __m128i c0, c1;  // codes 0..15 and 16..31, one a byte, in order
    if constexpr (Bits == 4) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
      c0 = _mm_unpacklo_epi8(lo, hi);
      c1 = _mm_unpackhi_epi8(lo, hi);
    } else {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
      const __m128i a0 = _mm_and_si128(x, m), a1 = _mm_and_si128(_mm_srli_epi16(x, 2), m);
      const __m128i a2 = _mm_and_si128(_mm_srli_epi16(x, 4), m), a3 = _mm_and_si128(_mm_srli_epi16(x, 6), m);
      const __m128i l01 = _mm_unpacklo_epi8(a0, a1), l23 = _mm_unpacklo_epi8(a2, a3);
      c0 = _mm_unpacklo_epi16(l01, l23);
      c1 = _mm_unpackhi_epi16(l01, l23);
    }
    dequant8_avx2(out + i, c0, offset, scale);
    dequant8_avx2(out + i + 8, _mm_srli_si128(c0, 8), offset, scale);
    dequant8_avx2(out + i + 16, c1, offset, scale);
    dequant8_avx2(out + i + 24, _mm_srli_si128(c1, 8), offset, scale);
  }
  return i;
}
#endif

// `count` codes of Bits = 4 or 2 bits packed from bit 0 of p (pack_codes' order: the first in
// the lowest bits), dequantized with one scale and offset to out[0, count). Thirty-two at a time
// with AVX2 where the CPU has it (detail::avx2_enabled), then sixteen at a time with SSE2 (every
// x86-64); products and sums rounded separately as dequant does, so every form gives its bits.
template <int Bits>
inline void dequant_packed(const std::uint8_t* p, std::int64_t count, float offset, float scale, float* out) noexcept {
  static_assert(Bits == 4 || Bits == 2);
  constexpr int per = 8 / Bits;
  constexpr unsigned mask = (1u << Bits) - 1u;
  std::int64_t i = 0;
#if defined(KVC_X86_AVX2_DISPATCH)
  if (avx2_enabled()) i = dequant_packed_avx2<Bits>(p, count, offset, scale, out);
#endif
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
  const __m128 vo = _mm_set1_ps(offset), vs = _mm_set1_ps(scale);
  const __m128i zero = _mm_setzero_si128();
  const auto store4 = [&](float* to, __m128i codes32) {
    _mm_storeu_ps(to, _mm_add_ps(vo, _mm_mul_ps(vs, _mm_cvtepi32_ps(codes32))));
  };
  for (; i + 16 <= count; i += 16) {
    const __m128i codes = codes16_sse2<Bits>(p + i / per);  // the 16 codes, one a byte, in order
    const __m128i lo = _mm_unpacklo_epi8(codes, zero), hi = _mm_unpackhi_epi8(codes, zero);
    store4(out + i, _mm_unpacklo_epi16(lo, zero));
    store4(out + i + 4, _mm_unpackhi_epi16(lo, zero));
    store4(out + i + 8, _mm_unpacklo_epi16(hi, zero));
    store4(out + i + 12, _mm_unpackhi_epi16(hi, zero));
  }
#endif
  for (; i < count; ++i)
    out[i] = dequant(offset, scale, (static_cast<unsigned>(p[i / per]) >> ((i % per) * Bits)) & mask);
}

// v rounded to the nearest code in [0, qmax] (halves up).
KVC_HOST_DEVICE inline float round_code(float v, float qmax) noexcept {
  const float r = floorf(v + 0.5f);
  return r < 0.0f ? 0.0f : (r > qmax ? qmax : r);
}

// The code of value v in a group with reconstruction p (inv = 1 / p.scale); 0 in a constant group.
KVC_HOST_DEVICE inline std::uint8_t quant_code(float v, const affine_params& p, float inv, float qmax) noexcept {
  if (!(p.scale > 0)) return 0;
  return static_cast<std::uint8_t>(round_code(mul_rn(v - p.offset, inv), qmax));
}

// The min/max fit both codecs start from: code 0 is the minimum, code qmax the maximum. x(i) is
// element i of the group, i < n.
template <class Load>
KVC_HOST_DEVICE affine_params minmax_fit(const Load& x, std::int64_t n, int nbits) noexcept {
  if (n <= 0) return {};
  float lo = x(0), hi = lo;
  for (std::int64_t i = 1; i < n; ++i) {
    const float v = x(i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const float qmax = static_cast<float>((1 << nbits) - 1);
  return {(hi - lo) / qmax, lo};
}

}  // namespace detail

// optimum-quanto's scheme: group-wise affine quantization, scale = (max - min) / (2^nbits - 1),
// zero point at the group's minimum (MaxOptimizer). nbits 2 or 4; axis 0 (groups along head_dim)
// or -1 (groups along seq).
struct QuantoCodec {
  // The backend name QuantizedCache selects this codec by (transformers' backend argument).
  static constexpr std::string_view backend = "quanto";
  // The name of the layer kind that uses this codec (QuantizedLayer::state::name).
  static constexpr std::string_view layer_name = "QuantoQuantizedLayer";

  // The bits per code the backend takes, as its messages list them.
  static constexpr std::string_view nbits_choices = "[`2`, `4`]";
  // Whether the backend takes `nbits` bits per code.
  static constexpr bool valid_nbits(std::int64_t nbits) noexcept { return nbits == 2 || nbits == 4; }
  // transformers' QuantoQuantizedLayer checks, in its order.
  static void validate(std::int64_t nbits, std::int64_t axis_key, std::int64_t axis_value) {
    if (!valid_nbits(nbits))
      throw ValueError("`nbits` for `quanto` backend has to be one of [`2`, `4`] but got " + std::to_string(nbits));
    if (axis_key != 0 && axis_key != -1)
      throw ValueError("`axis_key` for `quanto` backend has to be one of [`0`, `-1`] but got " +
                       std::to_string(axis_key));
    if (axis_value != 0 && axis_value != -1)
      throw ValueError("`axis_value` for `quanto` backend has to be one of [`0`, `-1`] but got " +
                       std::to_string(axis_value));
  }

  // Returns the grouping an `axis` option names: 0 along head_dim, -1 along seq.
  static constexpr detail::quant_grouping grouping(std::int64_t axis) noexcept {
    return axis == 0 ? detail::quant_grouping::along_head_dim : detail::quant_grouping::along_seq;
  }

  // The fit of one group: x(i) is element i, i < n.
  template <class Load>
  KVC_HOST_DEVICE static detail::affine_params fit(const Load& x, std::int64_t n, int nbits) noexcept {
    return detail::minmax_fit(x, n, nbits);
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
  // The backend name QuantizedCache selects this codec by (transformers' backend argument).
  static constexpr std::string_view backend = "hqq";
  // The name of the layer kind that uses this codec (QuantizedLayer::state::name).
  static constexpr std::string_view layer_name = "HQQQuantizedLayer";

  // The optimizer's settings (the values the HQQ paper and library use by default).
  static constexpr float lp_norm = 0.7f;
  // The penalty beta of the first round.
  static constexpr float beta0 = 10.0f;
  // The factor beta grows by after each round.
  static constexpr float kappa = 1.01f;
  // The most rounds the refinement runs.
  static constexpr int iterations = 20;

  // The bits per code the backend takes, as its messages list them.
  static constexpr std::string_view nbits_choices = "[`1`, `2`, `3`, `4`, `8`]";
  // Whether the backend takes `nbits` bits per code.
  static constexpr bool valid_nbits(std::int64_t nbits) noexcept {
    return nbits == 1 || nbits == 2 || nbits == 3 || nbits == 4 || nbits == 8;
  }
  // transformers' HQQQuantizedLayer checks, in its order.
  static void validate(std::int64_t nbits, std::int64_t axis_key, std::int64_t axis_value) {
    if (!valid_nbits(nbits))
      throw ValueError("`nbits` for `HQQ` backend has to be one of [`1`, `2`, `3`, `4`, `8`] but got " +
                       std::to_string(nbits));
    if (axis_key != 0 && axis_key != 1)
      throw ValueError("`axis_key` for `HQQ` backend has to be one of [`0`, `1`] but got " + std::to_string(axis_key));
    if (axis_value != 0 && axis_value != 1)
      throw ValueError("`axis_value` for `HQQ` backend has to be one of [`0`, `1`] but got " +
                       std::to_string(axis_value));
  }

  // Returns the grouping an `axis` option names: 1 along head_dim, 0 along seq.
  static constexpr detail::quant_grouping grouping(std::int64_t axis) noexcept {
    return axis == 1 ? detail::quant_grouping::along_head_dim : detail::quant_grouping::along_seq;
  }

  // The fit of one group: w(i) is element i, i < n.
  template <class Load>
  KVC_HOST_DEVICE static detail::affine_params fit(const Load& w, std::int64_t n, int nbits) noexcept {
    const detail::affine_params init = detail::minmax_fit(w, n, nbits);
    // A constant group, or a non-finite scale (s - s is 0 only for finite s), keeps the min/max fit.
    if (!(init.scale > 0) || !(init.scale - init.scale == 0.0f)) return init;
    // Work with the zero in code units: x ~ s * (q - z), so z = -offset / s.
    const float qmax = static_cast<float>((1 << nbits) - 1);
    const float s = init.scale;
    const float inv = 1.0f / s;
    float z = -init.offset * inv;
    float best_z = z;
    float best_err = INFINITY;
    float beta = beta0;
    const auto count = static_cast<float>(n);
    for (int it = 0; it < iterations; ++it) {
      float err = 0;
      float zsum = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const float x = w(i);
        const float q = detail::round_code(detail::add_rn(detail::mul_rn(x, inv), z), qmax);
        const float e = x - detail::mul_rn(s, q - z);
        // Generalized soft-threshold of the error for the lp (p < 1) penalty.
        const float a = fabsf(e);
        err += a;
        float shrunk = 0;
        if (a > 0) {
          const float t = a - powf(a, lp_norm - 1.0f) / beta;
          if (t > 0) shrunk = copysignf(t, e);
        }
        // The zero that explains W - shrunk best in the least-squares sense: mean(q - (x - e) / s).
        zsum += q - detail::mul_rn(x - shrunk, inv);
      }
      err /= count;
      if (err < best_err) {
        best_err = err;
        best_z = z;
      } else {
        break;
      }
      z = zsum / count;
      beta *= kappa;
    }
    return {s, -s * best_z};
  }
};

namespace detail {

// The geometry of one quantized K or V tensor: `blocks` = batch * heads blocks of tokens x dim
// elements, each a bit stream of block_bytes bytes with `groups` (scale, offset) pairs.
struct quant_layout {
  int nbits = 4;
  quant_grouping grouping = quant_grouping::along_head_dim;
  std::int64_t group_size = 1, batch = 0, heads = 0, tokens = 0, dim = 0;
  std::int64_t block_bytes = 0, groups = 0;

  quant_layout() = default;
  quant_layout(int nbits_, quant_grouping grouping_, std::int64_t group_size_, std::int64_t batch_, std::int64_t heads_,
               std::int64_t tokens_, std::int64_t dim_) noexcept
      : nbits(nbits_),
        grouping(grouping_),
        group_size(group_size_),
        batch(batch_),
        heads(heads_),
        tokens(tokens_),
        dim(dim_) {
    block_bytes = packed_bytes(tokens * dim, nbits);
    groups = grouping == quant_grouping::along_head_dim ? (tokens * dim + group_size - 1) / group_size
                                                        : (tokens + group_size - 1) / group_size * dim;
  }
  KVC_HOST_DEVICE std::int64_t blocks() const noexcept { return batch * heads; }
  KVC_HOST_DEVICE std::int64_t elements() const noexcept { return tokens * dim; }  // per block
  KVC_HOST_DEVICE float qmax() const noexcept { return static_cast<float>((1 << nbits) - 1); }
  // The same tensor with `n` batch entries.
  quant_layout with_batch(std::int64_t n) const noexcept {
    quant_layout out = *this;
    out.batch = n;
    return out;
  }
};

// Fits group g of a block (elements x(i), i < span.len) with Codec, stores the metadata rounded to
// M and returns the rounded reconstruction, which the codes are computed with.
template <class Codec, class M, class Load>
KVC_HOST_DEVICE affine_params fit_group(const Load& x, std::int64_t len, int nbits, M* scale, M* offset) noexcept {
  const affine_params p = Codec::fit(x, len, nbits);
  *scale = from_float<M>(p.scale);
  *offset = from_float<M>(p.offset);
  return affine_params{to_float(*scale), to_float(*offset)};
}

// The per-item steps of the device codec (<kvc/policies/quantization/cuda_codecs.cuh>), one
// kernel thread each. They are host code too, so that the host tests run them serially and
// compare with quantized_tensor: the device has no other place to go wrong but the launches.

// Group m (of all blocks' groups) of `src`: fits it, stores its metadata at scale[m] / offset[m]
// and writes its codes unpacked, one byte per element, to codes[block * elements + i].
template <class Codec, class T, class M>
KVC_HOST_DEVICE void fit_group_at(std::int64_t m, const T* src, std::int64_t stride_b, std::int64_t stride_h,
                                  const quant_layout& l, M* scale, M* offset, std::uint8_t* codes) noexcept {
  const std::int64_t blk = m / l.groups, g = m % l.groups;
  const T* x = src + (blk / l.heads) * stride_b + (blk % l.heads) * stride_h;
  const group_span gs = span_of_group(l.grouping, g, l.group_size, l.tokens, l.dim);
  const auto load = [x, gs](std::int64_t i) { return to_float(x[gs.first + i * gs.step]); };
  const affine_params p = fit_group<Codec>(load, gs.len, l.nbits, scale + m, offset + m);
  const float inv = 1.0f / p.scale;
  std::uint8_t* c = codes + blk * l.elements();
  for (std::int64_t i = 0; i < gs.len; ++i) c[gs.first + i * gs.step] = quant_code(load(i), p, inv, l.qmax());
}

// Byte t (of all blocks' packed bytes) from the unpacked codes: the codes whose bits
// [i * nbits, (i + 1) * nbits) meet the byte's bits [8j, 8j + 8) of its block.
KVC_HOST_DEVICE inline std::uint8_t packed_byte_at(std::int64_t t, const std::uint8_t* codes,
                                                   const quant_layout& l) noexcept {
  const std::int64_t blk = t / l.block_bytes, bit0 = 8 * (t % l.block_bytes), n = l.elements();
  const std::uint8_t* c = codes + blk * n;
  unsigned byte = 0;
  for (std::int64_t i = bit0 / l.nbits; i < n && i * l.nbits < bit0 + 8; ++i) {
    const std::int64_t at = i * l.nbits - bit0;  // negative: the code began in the byte before
    const unsigned v = c[i];
    byte |= at >= 0 ? v << at : v >> -at;
  }
  return static_cast<std::uint8_t>(byte & 0xFFu);
}

// Element e (of all blocks' elements), dequantized to its place in dst.
template <class T, class M>
KVC_HOST_DEVICE void decode_at(std::int64_t e, T* dst, std::int64_t stride_b, std::int64_t stride_h,
                               const quant_layout& l, const std::uint8_t* codes, const M* scale,
                               const M* offset) noexcept {
  const std::int64_t n = l.elements(), blk = e / n, i = e % n;
  const std::int64_t m = blk * l.groups + group_of(l.grouping, i, l.group_size, l.dim);
  const unsigned q = code_at(codes + blk * l.block_bytes, i, l.nbits);
  dst[(blk / l.heads) * stride_b + (blk % l.heads) * stride_h + i] =
      from_float<T>(dequant(to_float(offset[m]), to_float(scale[m]), q));
}

// Elements [e, e + V) (of all blocks' elements, e a multiple of V, all in one block) dequantized to
// out[0, V): the vectorised form of decode_at, which the device stores as one 16-byte write.
// Dim > 0 is head_dim known at compile time (it must equal l.dim), which turns the divisions by
// head_dim into shifts and multiplications; 0 reads it from l. The run shares its group, or its
// token row, where the layout allows (groups along head_dim of a multiple of V elements; groups
// along seq with V dividing head_dim), and then divides once per run instead of once per element.
template <int V, std::int64_t Dim = 0, class T, class M>
KVC_HOST_DEVICE void decode_run_at(std::int64_t e, T* out, const quant_layout& l, const std::uint8_t* codes,
                                   const M* scale, const M* offset) noexcept {
  const std::int64_t dim = Dim > 0 ? Dim : l.dim;
  const std::int64_t n = l.tokens * dim, blk = e / n, i0 = e - blk * n;
  const std::uint8_t* bits = codes + blk * l.block_bytes;
  const M* sb = scale + blk * l.groups;
  const M* ob = offset + blk * l.groups;
  if (l.grouping == quant_grouping::along_head_dim && l.group_size % V == 0) {  // one group
    const std::int64_t g = i0 / l.group_size;
    const float o = to_float(ob[g]), sc = to_float(sb[g]);
    for (int j = 0; j < V; ++j) out[j] = from_float<T>(dequant(o, sc, code_at(bits, i0 + j, l.nbits)));
    return;
  }
  if (l.grouping == quant_grouping::along_seq && dim % V == 0) {  // one token row: groups g0 + j
    const std::int64_t t = i0 / dim, g0 = t / l.group_size * dim + (i0 - t * dim);
    for (int j = 0; j < V; ++j)
      out[j] = from_float<T>(dequant(to_float(ob[g0 + j]), to_float(sb[g0 + j]), code_at(bits, i0 + j, l.nbits)));
    return;
  }
  for (int j = 0; j < V; ++j) {
    const std::int64_t i = i0 + j, g = group_of(l.grouping, i, l.group_size, dim);
    out[j] = from_float<T>(dequant(to_float(ob[g]), to_float(sb[g]), code_at(bits, i, l.nbits)));
  }
}

// One quantized K or V tensor in host memory (kvc::QuantizedLayer over HostStorage): the codes as
// a bit stream per block, then one scale and one offset per group. M is the metadata type
// (quant_meta_t of the element type).
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
    quantized_tensor out(quant_layout(nbits, grouping, group_size, batch, heads, tokens, dim));
    const quant_layout& l = out.layout_;
    const std::int64_t n = l.elements();
    if (n == 0) return out;
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(checked_elements({n}, 1)));
    // A group holds at most min(group_size, n) elements (group_size may be far larger than the block).
    std::vector<float> buf(static_cast<std::size_t>(std::min(std::max(group_size, dim), n)));
    const float qmax = l.qmax();
    const auto load = [&buf](std::int64_t i) { return buf[static_cast<std::size_t>(i)]; };
    for (std::int64_t blk = 0; blk < l.blocks(); ++blk) {
      const T* x = src + (blk / heads) * stride_b + (blk % heads) * stride_h;
      for (std::int64_t g = 0; g < l.groups; ++g) {
        const group_span gs = span_of_group(grouping, g, group_size, tokens, dim);
        for (std::int64_t i = 0; i < gs.len; ++i)
          buf[static_cast<std::size_t>(i)] = to_float(x[gs.first + i * gs.step]);
        const std::int64_t m = blk * l.groups + g;
        const affine_params p = fit_group<Codec>(load, gs.len, nbits, &out.scale_[static_cast<std::size_t>(m)],
                                                 &out.offset_[static_cast<std::size_t>(m)]);
        const float inv = 1.0f / p.scale;
        for (std::int64_t i = 0; i < gs.len; ++i)
          codes[static_cast<std::size_t>(gs.first + i * gs.step)] = quant_code(load(i), p, inv, qmax);
      }
      pack_codes(codes.data(), n, nbits, out.codes_.data() + blk * l.block_bytes);
    }
    return out;
  }

  // Writes the dequantized rows of block (b, h) to dst + b * stride_b + h * stride_h (rows of
  // `dim` elements one after the other). Allocates nothing.
  template <class T>
  void decode(T* dst, std::int64_t stride_b, std::int64_t stride_h) const noexcept {
    constexpr std::int64_t piece = 256;
    std::uint8_t codes[piece];
    const quant_layout& l = layout_;
    const std::int64_t n = l.elements();
    for (std::int64_t blk = 0; blk < l.blocks(); ++blk) {
      T* y = dst + (blk / l.heads) * stride_b + (blk % l.heads) * stride_h;
      const std::uint8_t* bits = codes_.data() + blk * l.block_bytes;
      const M* scale = scale_.data() + blk * l.groups;
      const M* offset = offset_.data() + blk * l.groups;
      if (l.grouping == quant_grouping::along_head_dim) {
        for (std::int64_t g = 0; g < l.groups; ++g) {
          const float s = to_float(scale[g]), o = to_float(offset[g]);
          const std::int64_t end = std::min(n, (g + 1) * l.group_size);
          for (std::int64_t i = g * l.group_size; i < end; i += piece) {
            const std::int64_t len = std::min(piece, end - i);
            unpack_codes(bits, i, len, l.nbits, codes);
            for (std::int64_t j = 0; j < len; ++j) y[i + j] = from_float<T>(dequant(o, s, codes[j]));
          }
        }
      } else {  // row r uses groups (r / group_size) * dim + d
        for (std::int64_t r = 0; r < l.tokens; ++r) {
          const M* srow = scale + (r / l.group_size) * l.dim;
          const M* orow = offset + (r / l.group_size) * l.dim;
          for (std::int64_t d0 = 0; d0 < l.dim; d0 += piece) {
            const std::int64_t len = std::min(piece, l.dim - d0);
            unpack_codes(bits, r * l.dim + d0, len, l.nbits, codes);
            for (std::int64_t j = 0; j < len; ++j)
              y[r * l.dim + d0 + j] = from_float<T>(dequant(to_float(orow[d0 + j]), to_float(srow[d0 + j]), codes[j]));
          }
        }
      }
    }
  }

  // A copy whose batch entry i is this tensor's batch entry indices[i]: packed bytes and metadata
  // are copied as they are, so the numbers do not change.
  quantized_tensor gathered(std::span<const std::int64_t> indices) const {
    quantized_tensor out(layout_.with_batch(static_cast<std::int64_t>(indices.size())));
    const std::int64_t cb = layout_.heads * layout_.block_bytes, mb = layout_.heads * layout_.groups;
    for (std::size_t i = 0; i < indices.size(); ++i) {
      const auto to = static_cast<std::int64_t>(i);
      std::copy_n(codes_.begin() + indices[i] * cb, cb, out.codes_.begin() + to * cb);
      std::copy_n(scale_.begin() + indices[i] * mb, mb, out.scale_.begin() + to * mb);
      std::copy_n(offset_.begin() + indices[i] * mb, mb, out.offset_.begin() + to * mb);
    }
    return out;
  }

  // Rows [t0, t0 + count) of block blk (batch * heads + head), dequantized to out in float (decode()
  // rounds the same values to its element type): count rows of dim. For attention over the codes a
  // tile at a time (kvc::attend_quantized); allocates nothing.
  void decode_rows(std::int64_t blk, std::int64_t t0, std::int64_t count, float* out) const noexcept {
    constexpr std::int64_t piece = 256;
    std::uint8_t codes[piece];
    const quant_layout& l = layout_;
    const std::uint8_t* bits = codes_.data() + blk * l.block_bytes;
    const M* scale = scale_.data() + blk * l.groups;
    const M* offset = offset_.data() + blk * l.groups;
    const std::int64_t first = t0 * l.dim, n = count * l.dim;
    if (l.grouping == quant_grouping::along_seq && l.dim <= piece) {
      // Row by row: the row's codes, then one scale and offset per channel, converted to float
      // once per chunk of group_size tokens (the loop over channels vectorises).
      float sf[piece], of[piece];
      std::int64_t converted = -1;
      for (std::int64_t r = t0; r < t0 + count; ++r) {
        if (r / l.group_size != converted) {
          converted = r / l.group_size;
          for (std::int64_t d = 0; d < l.dim; ++d) {
            sf[d] = to_float(scale[converted * l.dim + d]);
            of[d] = to_float(offset[converted * l.dim + d]);
          }
        }
        unpack_codes(bits, r * l.dim, l.dim, l.nbits, codes);
        float* o = out + (r - t0) * l.dim;
        for (std::int64_t d = 0; d < l.dim; ++d) o[d] = dequant(of[d], sf[d], codes[d]);
      }
      return;
    }
    for (std::int64_t i = 0; i < n;) {
      // A run of elements that shares its metadata (groups along head_dim), or one row's piece.
      std::int64_t len = std::min(piece, n - i);
      if (l.grouping == quant_grouping::along_head_dim) {
        const std::int64_t e = first + i;
        len = std::min(len, (e / l.group_size + 1) * l.group_size - e);
        const std::int64_t g = e / l.group_size;
        const float o = to_float(offset[g]), sc = to_float(scale[g]);
        if (l.nbits == 4 && e % 2 == 0) {  // codes read straight from their bytes
          dequant_packed<4>(bits + e / 2, len, o, sc, out + i);
        } else if (l.nbits == 2 && e % 4 == 0) {
          dequant_packed<2>(bits + e / 4, len, o, sc, out + i);
        } else {
          unpack_codes(bits, e, len, l.nbits, codes);
          for (std::int64_t j = 0; j < len; ++j) out[i + j] = dequant(o, sc, codes[j]);
        }
      } else {
        unpack_codes(bits, first + i, len, l.nbits, codes);
        for (std::int64_t j = 0; j < len; ++j) {
          const std::int64_t g = group_of(l.grouping, first + i + j, l.group_size, l.dim);
          out[i + j] = dequant(to_float(offset[g]), to_float(scale[g]), codes[j]);
        }
      }
      i += len;
    }
  }

  std::int64_t tokens() const noexcept { return layout_.tokens; }
  // Bytes held: packed codes plus every group's scale and offset.
  std::int64_t bytes() const noexcept {
    return static_cast<std::int64_t>(codes_.size() + sizeof(M) * (scale_.size() + offset_.size()));
  }
  std::int64_t code_bytes() const noexcept { return static_cast<std::int64_t>(codes_.size()); }
  std::int64_t groups_per_block() const noexcept { return layout_.groups; }
  const std::vector<std::uint8_t>& packed() const noexcept { return codes_; }
  const quant_layout& layout() const noexcept { return layout_; }

  // Saved state (docs/state.md): the layout, then the packed codes, scales and offsets, each
  // checked against the layout on load.
  template <class A>
  void transfer(A& ar) {
    quant_layout& l = layout_;
    ar.value(l.nbits);
    ar.value(l.grouping);
    ar.value(l.group_size);
    ar.value(l.batch);
    ar.value(l.heads);
    ar.value(l.tokens);
    ar.value(l.dim);
    if constexpr (A::loading) {
      const auto in_range = [](std::int64_t x, std::int64_t lo) { return x >= lo && x <= max_extent; };
      ar.check(l.nbits >= 1 && l.nbits <= 8, "a code width outside [1, 8]");
      ar.check(l.grouping == quant_grouping::along_head_dim || l.grouping == quant_grouping::along_seq,
               "an unknown grouping");
      ar.check(in_range(l.group_size, 1) && in_range(l.batch, 0) && in_range(l.heads, 0) && in_range(l.tokens, 0) &&
                   in_range(l.dim, 0),
               "a quantized tensor's extents");
      ar.check(products_fit({l.batch, l.heads, l.tokens, l.dim, 8}), "a quantized tensor's size");
      l = quant_layout(l.nbits, l.grouping, l.group_size, l.batch, l.heads, l.tokens, l.dim);
    }
    ar.array(codes_);
    ar.array(scale_);
    ar.array(offset_);
    const auto n = [](std::int64_t a, std::int64_t b) { return static_cast<std::size_t>(a * b); };
    ar.check(codes_.size() == n(l.blocks(), l.block_bytes) && scale_.size() == n(l.blocks(), l.groups) &&
                 offset_.size() == n(l.blocks(), l.groups),
             "a quantized tensor's sizes do not match its layout");
  }

 private:
  explicit quantized_tensor(const quant_layout& layout)
      : layout_(layout),
        codes_(static_cast<std::size_t>(checked_elements({layout.blocks(), layout.block_bytes}, 1))),
        scale_(static_cast<std::size_t>(checked_elements({layout.blocks(), layout.groups}, sizeof(M)))),
        offset_(static_cast<std::size_t>(checked_elements({layout.blocks(), layout.groups}, sizeof(M)))) {}

  quant_layout layout_;
  std::vector<std::uint8_t> codes_;
  std::vector<M> scale_, offset_;
};

// The quantized tensor type of QuantizedLayer over storage S with metadata M: quantized_tensor
// for host storages. Device storages specialize it (CudaStorage: <kvc/policies/storage/cuda.cuh>);
// a storage that does not is refused at compile time instead of having host code read its memory.
template <class S, class M, class = void>
struct quantized_tensor_for;
template <class S, class M>
struct quantized_tensor_for<S, M, std::enable_if_t<S::space == memory_space::host>> {
  using type = quantized_tensor<M>;
};
template <class S, class M>
using quantized_tensor_t = typename quantized_tensor_for<S, M>::type;

}  // namespace detail

}  // namespace kvc

#pragma once
// kvc::int8_row, kvc::int4_row, kvc::int2_row, kvc::nvfp4_row and kvc::fp8_row<F8>: the element
// types of paged pools whose rows carry their own scales (vLLM's kv_cache_dtype
// int8_per_token_head, int4_per_token_head, nvfp4 and fp8_per_token_head; int2_row is KIVI's
// 2-bit per-token values). A pool of one of them,
// `PagedCache<HostStorage<kvc::int4_row>>`, stores each token's row of each KV head, head_dim
// values, as row_bytes(head_dim) bytes: the codes, then the scales.
//
//   int8_row   head_dim signed 8-bit codes, then one float scale (4 bytes, little-endian as the
//              host's float): scale = max |x_i| / 127, code_i = x_i / scale rounded to nearest
//              (ties to even) in [-127, 127]; value_i = code_i * scale. head_dim + 4 bytes
//              (0.52 of fp16 at head_dim 128).
//   int4_row   signed 4-bit codes two per byte (value 2i in the low 4 bits of byte i, 2i + 1 in the
//              high 4, two's complement), then one float scale: scale = max |x_i| / 7, code_i in
//              [-7, 7]. ceil(head_dim / 2) + 4 bytes (0.27 of fp16 at 128).
//   int2_row   2-bit codes four per byte (value 4i + j in bits 2j and 2j + 1 of byte i), then per
//              group of 32 values (the last may be shorter) its minimum m and step s as bfloat16
//              (2 bytes each, the host's byte order): m = the group's least value rounded down to
//              bfloat16, s = (its greatest value - m) / 3 (in float) rounded up to bfloat16, so
//              that [m, m + 3s] holds the group; code_i = (x_i - m) / s rounded to nearest (ties to
//              even) in [0, 3] (0 where s is 0); value_i = m + code_i * s, within s / 2 of x_i.
//              ceil(head_dim / 4) + 4 * ceil(head_dim / 32) bytes (0.19 of fp16 at 128). A group
//              with a value that is not finite, or whose m, s or m + 3s is not (values near
//              float's limit, 3.4e38), keeps NaN for both and reads back as NaN.
//   nvfp4_row  NVFP4 (<kvc/nvfp4.hpp>): E2M1 codes two per byte, then one E4M3 scale per 16
//              values; the tensor scale is the pool's, given when rows are encoded and to
//              paged_attention. nvfp4_bytes(head_dim) bytes (0.28 of fp16 at 128).
//   fp8_row<F8>  head_dim codes of kvc::float8_e4m3 or float8_e5m2, then one float scale:
//              scale = max |x_i| / 448 (E5M2: 57344), code_i = F8(x_i / scale) (nearest even).
//              head_dim + 4 bytes.
//   bfloat16_row  each value's upper 16 bits, rounded to nearest even: 2 * head_dim bytes (a
//              16-bit side of a kv_codes pair).
//
// kvc::kv_codes<K, V> is a pool whose keys are rows of format K and values rows of format V (any
// two of the above, rotated or not): kvc::to_kv_codes encodes a step's keys and values, each side
// at its own width (PagedCache::row_width(), value_row_width()).
//
// A row of zeros gets scale 0 and codes 0. In the integer and fp8 formats a row with a value that is not
// finite gets a NaN scale: it reads back as NaN. NVFP4 rows are nvfp4_quantize's: a NaN gives its
// 16-value block the NaN scale, an infinity saturates (the block scale 448, the code +-6).
//
// The pool then holds rows of codes: update() and paged_attention take the step's keys and values
// as the codes kvc::to_row_codes made, [1, kv_heads, tokens, row_bytes(head_dim)], and the cache
// moves them as bytes (forks, offload, save and load). paged_attention reads them from the pool
// and widens each block of rows to float as it reads it (docs/paged.md, "Quantized pages").
// kvc::rotated<C> is C made from Walsh-Hadamard-rotated rows (rotation composed with the format).

#include <cstdint>
#include <string>
#include <vector>

#include <kvc/detail/row_code_types.hpp>
#include <kvc/errors.hpp>
#include <kvc/nvfp4.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// x's rows as C codes, in a tensor of O (C itself, or a kv_codes pool holding C on one side).
template <class C, class O = C, class X>
HostTensor<O> row_codes_of(const X& input, float tensor_scale, const char* who) {
  if constexpr (!require_inputs<input_in<X, memory_space::host>, X>()) {
    return {};
  } else {
    if constexpr (C::tensor_scaled) check_nvfp4_tensor_scale(tensor_scale, who);
    const auto x = input_view(input);
    const std::int64_t d = x.extent(3), w = C::row_bytes(d);
    HostTensor<O> out(x.extent(0), x.extent(1), x.extent(2), w);
    std::vector<float> row(static_cast<std::size_t>(d));
    O* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += w) {
          for (std::int64_t i = 0; i < d; ++i) row[static_cast<std::size_t>(i)] = static_cast<float>(x(b, h, s, i));
          if constexpr (is_rotated_row_code<C>) hadamard_rotate(row.data(), 1, d);
          C::encode(row.data(), d, tensor_scale, reinterpret_cast<C*>(o));
        }
    return out;
  }
}

// The values of rows of C codes held in a tensor of O, times tensor_scale.
template <class C, class O, class X>
HostTensor<float> values_of_rows(const X& input, std::int64_t head_dim, float tensor_scale, const char* who) {
  if constexpr (!require_inputs<input_of<X, O, memory_space::host>, X>()) {
    return {};
  } else {
    const auto x = input_view(input);
    if (head_dim < 1 || x.extent(3) != C::row_bytes(head_dim))
      throw ValueError(std::string(who) + ": rows of " + std::to_string(head_dim) + " values are " +
                       std::to_string(head_dim < 1 ? 0 : C::row_bytes(head_dim)) + " " + std::string(C::name) +
                       " bytes wide, got " + std::to_string(x.extent(3)));
    HostTensor<float> out(x.extent(0), x.extent(1), x.extent(2), head_dim);
    std::vector<O> row(static_cast<std::size_t>(x.extent(3)));
    float* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += head_dim) {
          for (std::int64_t i = 0; i < x.extent(3); ++i) row[static_cast<std::size_t>(i)] = x(b, h, s, i);
          C::widen(reinterpret_cast<const C*>(row.data()), o, head_dim);
          if constexpr (is_rotated_row_code<C>) hadamard_rotate(o, 1, head_dim);
          for (std::int64_t i = 0; i < head_dim; ++i) o[i] *= tensor_scale;
        }
    return out;
  }
}

// Whether C is one row format, to_row_codes' one error otherwise (host and device overloads).
template <class C>
constexpr bool encodable_row_format() {
  static_assert(
      is_row_format<C>,
      "kvc::to_row_codes: the code type must be one row format (kvc::int8_row, int4_row, int2_row, nvfp4_row, "
      "fp8_row<F8>, bfloat16_row or kvc::rotated<one>); a kvc::kv_codes pool's rows come from "
      "kvc::to_kv_codes");
  return is_row_format<C>;
}

}  // namespace detail

// x [batch, heads, seq, head_dim] (any kvc::tensor_input on the host, of any element type a float
// converts from) as rows of C codes: [batch, heads, seq, C::row_bytes(head_dim)], each row encoded
// alone (NVFP4 with tensor scale 1).
template <class C, class X>
  requires(!detail::input_in<X, memory_space::device>)  // device tensors: <kvc/cuda.hpp>'s overload
HostTensor<C> to_row_codes(const X& input) {
  if constexpr (detail::encodable_row_format<C>())
    return detail::row_codes_of<C>(input, 1.0f, "kvc::to_row_codes");
  else
    return {};
}
// The same as NVFP4 rows with the tensor scale `tensor_scale` (kvc::nvfp4_tensor_scale picks one
// from the largest magnitude): a ValueError unless it is positive and at most 2^116. The integer
// formats keep one scale per row and take no tensor scale.
template <class C, class X>
  requires(C::tensor_scaled && !detail::input_in<X, memory_space::device>)
HostTensor<C> to_row_codes(const X& input, float tensor_scale) {
  return detail::row_codes_of<C>(input, tensor_scale, "kvc::to_row_codes");
}

// The values of rows of C codes ([batch, heads, seq, C::row_bytes(head_dim)], any tensor_input of C
// on the host) as floats [batch, heads, seq, head_dim], times `tensor_scale` (NVFP4's; 1 for the
// integer formats). A ValueError when the rows are not row_bytes(head_dim) wide.
template <class C, class X>
HostTensor<float> from_row_codes(const X& input, std::int64_t head_dim, float tensor_scale = 1.0f) {
  static_assert(
      detail::is_row_format<C>,
      "kvc::from_row_codes: the code type must be one row format (kvc::int8_row, int4_row, int2_row, nvfp4_row, "
      "fp8_row<F8>, bfloat16_row or kvc::rotated<one>); a kvc::kv_codes pool's rows go to "
      "kvc::from_kv_codes");
  if constexpr (detail::is_row_format<C>)
    return detail::values_of_rows<C, C>(input, head_dim, tensor_scale, "kvc::from_row_codes");
  else
    return {};
}

// A step's keys and values ([batch, heads, seq, head_dim] each, any host tensor_inputs a float
// converts from) as the rows of a kvc::kv_codes<K, V> pool: keys as K codes, values as V codes,
// [batch, heads, seq, K::row_bytes(head_dim)] and [..., V::row_bytes(head_dim)], both tensors of
// P. `scales` are the NVFP4 tensor scales of a side that takes one (kvc::Nvfp4TensorScales; a
// ValueError unless positive and at most 2^116); a side that takes none ignores its scale.
template <class P, class KT, class VT>
  requires(!(detail::input_in<KT, memory_space::device> && detail::input_in<VT, memory_space::device>))
KV<HostTensor<P>> to_kv_codes(const KT& keys, const VT& values, const Nvfp4TensorScales& scales = {}) {
  static_assert(detail::is_kv_codes<P>, "kvc::to_kv_codes: the pool type must be kvc::kv_codes<K, V>");
  if constexpr (detail::is_kv_codes<P>) {
    using K = typename P::key_codes;
    using V = typename P::value_codes;
    HostTensor<P> k = detail::row_codes_of<K, P>(keys, scales.keys, "kvc::to_kv_codes: the keys");
    return {std::move(k), detail::row_codes_of<V, P>(values, scales.values, "kvc::to_kv_codes: the values")};
  } else {
    return {};
  }
}

// The values a kvc::kv_codes<K, V> pool's rows stand for: keys and values (host tensor_inputs of
// P, as to_kv_codes made them) as floats [batch, heads, seq, head_dim], each times its side's
// tensor scale from `scales` where the side takes one. A ValueError when a side's rows are not
// its format's row_bytes(head_dim) wide.
template <class P, class KT, class VT>
KV<HostTensor<float>> from_kv_codes(const KT& keys, const VT& values, std::int64_t head_dim,
                                    const Nvfp4TensorScales& scales = {}) {
  static_assert(detail::is_kv_codes<P>, "kvc::from_kv_codes: the pool type must be kvc::kv_codes<K, V>");
  if constexpr (detail::is_kv_codes<P>) {
    using K = typename P::key_codes;
    using V = typename P::value_codes;
    HostTensor<float> k = detail::values_of_rows<K, P>(keys, head_dim, K::tensor_scaled ? scales.keys : 1.0f,
                                                       "kvc::from_kv_codes: the keys");
    return {std::move(k), detail::values_of_rows<V, P>(values, head_dim, V::tensor_scaled ? scales.values : 1.0f,
                                                       "kvc::from_kv_codes: the values")};
  } else {
    return {};
  }
}

}  // namespace kvc

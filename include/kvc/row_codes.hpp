#pragma once
// kvc::int8_row, kvc::int4_row and kvc::nvfp4_row: the element types of paged pools whose rows
// carry their own scales (vLLM's kv_cache_dtype int8_per_token_head, int4_per_token_head and
// nvfp4). A pool of one of them, `PagedCache<HostStorage<kvc::int4_row>>`, stores each token's
// row of each KV head, head_dim values, as row_bytes(head_dim) bytes: the codes, then the scales.
//
//   int8_row   head_dim signed 8-bit codes, then one float scale (4 bytes, little-endian as the
//              host's float): scale = max |x_i| / 127, code_i = x_i / scale rounded to nearest
//              (ties to even) in [-127, 127]; value_i = code_i * scale. head_dim + 4 bytes
//              (0.52 of fp16 at head_dim 128).
//   int4_row   signed 4-bit codes two per byte (value 2i in the low 4 bits of byte i, 2i + 1 in the
//              high 4, two's complement), then one float scale: scale = max |x_i| / 7, code_i in
//              [-7, 7]. ceil(head_dim / 2) + 4 bytes (0.27 of fp16 at 128).
//   nvfp4_row  NVFP4 (<kvc/nvfp4.hpp>): E2M1 codes two per byte, then one E4M3 scale per 16
//              values; the tensor scale is the pool's, given when rows are encoded and to
//              paged_attention. nvfp4_bytes(head_dim) bytes (0.28 of fp16 at 128).
//
// A row of zeros gets scale 0 and codes 0. In the integer formats a row with a value that is not
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

template <class C, class X>
HostTensor<C> row_codes_of(const X& input, float tensor_scale) {
  static_assert(is_row_code_v<C>,
                "kvc::to_row_codes: the code type must be kvc::int8_row, int4_row, nvfp4_row or kvc::rotated<one>");
  if constexpr (!require_inputs<input_in<X, memory_space::host>, X>()) {
    return {};
  } else {
    if constexpr (C::tensor_scaled) check_nvfp4_tensor_scale(tensor_scale, "kvc::to_row_codes");
    const auto x = input_view(input);
    const std::int64_t d = x.extent(3), w = C::row_bytes(d);
    HostTensor<C> out(x.extent(0), x.extent(1), x.extent(2), w);
    std::vector<float> row(static_cast<std::size_t>(d));
    C* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += w) {
          for (std::int64_t i = 0; i < d; ++i) row[static_cast<std::size_t>(i)] = static_cast<float>(x(b, h, s, i));
          if constexpr (C::rotates) hadamard_rotate(row.data(), 1, d);
          C::encode(row.data(), d, tensor_scale, o);
        }
    return out;
  }
}

}  // namespace detail

// x [batch, heads, seq, head_dim] (any kvc::tensor_input on the host, of any element type a float
// converts from) as rows of C codes: [batch, heads, seq, C::row_bytes(head_dim)], each row encoded
// alone (NVFP4 with tensor scale 1).
template <class C, class X>
HostTensor<C> to_row_codes(const X& input) {
  return detail::row_codes_of<C>(input, 1.0f);
}
// The same as NVFP4 rows with the tensor scale `tensor_scale` (kvc::nvfp4_tensor_scale picks one
// from the largest magnitude): a ValueError unless it is positive and at most 2^116. The integer
// formats keep one scale per row and take no tensor scale.
template <class C, class X>
  requires(C::tensor_scaled)
HostTensor<C> to_row_codes(const X& input, float tensor_scale) {
  return detail::row_codes_of<C>(input, tensor_scale);
}

// The values of rows of C codes ([batch, heads, seq, C::row_bytes(head_dim)], any tensor_input of C
// on the host) as floats [batch, heads, seq, head_dim], times `tensor_scale` (NVFP4's; 1 for the
// integer formats). A ValueError when the rows are not row_bytes(head_dim) wide.
template <class C, class X>
HostTensor<float> from_row_codes(const X& input, std::int64_t head_dim, float tensor_scale = 1.0f) {
  static_assert(is_row_code_v<C>,
                "kvc::from_row_codes: the code type must be kvc::int8_row, int4_row, nvfp4_row or kvc::rotated<one>");
  if constexpr (!detail::require_inputs<detail::input_of<X, C, memory_space::host>, X>()) {
    return {};
  } else {
    const auto x = input_view(input);
    if (head_dim < 1 || x.extent(3) != C::row_bytes(head_dim))
      throw ValueError("kvc::from_row_codes: rows of " + std::to_string(head_dim) + " values are " +
                       std::to_string(head_dim < 1 ? 0 : C::row_bytes(head_dim)) + " " + std::string(C::name) +
                       " bytes wide, got " + std::to_string(x.extent(3)));
    HostTensor<float> out(x.extent(0), x.extent(1), x.extent(2), head_dim);
    std::vector<C> row(static_cast<std::size_t>(x.extent(3)));
    float* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h)
        for (std::int64_t s = 0; s < x.extent(2); ++s, o += head_dim) {
          for (std::int64_t i = 0; i < x.extent(3); ++i) row[static_cast<std::size_t>(i)] = x(b, h, s, i);
          C::widen(row.data(), o, head_dim);
          if constexpr (C::rotates) hadamard_rotate(o, 1, head_dim);
          for (std::int64_t i = 0; i < head_dim; ++i) o[i] *= tensor_scale;
        }
    return out;
  }
}

}  // namespace kvc

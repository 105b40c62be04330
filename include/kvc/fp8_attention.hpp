#pragma once
// fp8 KV: caches that store keys and values as 8-bit floats (kvc::float8_e4m3, float8_e5m2) with a
// dequantization scale per tensor or per KV head, as vLLM's and FlashInfer's fp8 KV caches do.
//
// The storage is any host cache whose element type is an 8-bit float: DynamicCache<float8_e4m3>,
// StaticCache<float8_e5m2>, make_dynamic_cache<float8_e4m3>(config), a PagedCache over
// HostStorage<float8_e4m3>, ... Every layer kind that copies its elements holds them (the
// quantized and linear-attention layers do not take them). The model keeps computing in its own
// type T (float, double, Eigen::half, Eigen::bfloat16):
//   - kvc::to_fp8<F8>(x, scales) encodes K or V [batch, heads, seq, head_dim] as x / scale(head),
//     rounded to nearest even and saturated (OFP8);
//   - kvc::attend_fp8(cache, layer, q, k, v, scales) encodes the step's keys and values, stores
//     them with the cache's update, and attends over the stored codes, widened to float
//     (float8::widen) and multiplied by their head's scale (the key scale joins the softmax scale,
//     the value scale multiplies the output), in float (double for double);
//   - kvc::fp8_scales_for<F8>(k, v, granularity) calibrates scales from sample K/V: the largest
//     magnitude per tensor or per head mapped to F8's largest finite value.
// Scales belong to the model's layer (vLLM's k_scale / v_scale), so the caller passes them with
// every step; per tensor, one scale each for K and V (1 by default), per head, one per KV head.
// With Fp8Scales::rotation, keys (values) are rotated (kvc::hadamard_rotate) before they are
// encoded: to_fp8 (to_fp8_keys, to_fp8_values) rotates them, fp8_scales_for calibrates on rotated
// rows, and attend_fp8 and the fp8 pools' paged_attention rotate the queries the same way (the
// scores need no inverse) and the output back (host only). docs/quantized.md, "fp8 KV".

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <kvc/attention.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/rotation.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {
// The scale of head h in a list of one (per tensor) or one per head.
inline float scale_at(std::span<const float> scales, std::int64_t h) noexcept {
  return scales[scales.size() == 1 ? 0 : static_cast<std::size_t>(h)];
}
}  // namespace detail

// Which of a layer's K and V are rotated (kvc::hadamard_rotate, <kvc/rotation.hpp>) before they
// are encoded as fp8: an outlier channel is spread over its row, so one scale covers the row with
// less of the format's range. The model's choice, fixed for the cache's whole life.
struct Fp8Rotation {
  // Keys rotated before encoding; the queries are rotated the same way.
  bool keys = false;
  // Values rotated before encoding; the attention output is rotated back.
  bool values = false;
};

// The dequantization scales of one layer's K and V: x ~ scale * code. One entry: the whole tensor
// (per tensor); Hkv entries: one per KV head (per head). With `rotation`, x is the rotated row.
struct Fp8Scales {
  // The key scales: one for the whole tensor, or one per KV head.
  std::vector<float> keys{1.0f};
  // The value scales: one for the whole tensor, or one per KV head.
  std::vector<float> values{1.0f};
  // Which of K and V the codes hold rotated (none by default). Host attention only: the device's
  // attention refuses rotated scales.
  Fp8Rotation rotation{};

  // The key scale of KV head `head` (the one scale when per tensor); `head` is not checked.
  float key_scale(std::int64_t head) const noexcept { return detail::scale_at(keys, head); }
  // The value scale of KV head `head` (the one scale when per tensor); `head` is not checked.
  float value_scale(std::int64_t head) const noexcept { return detail::scale_at(values, head); }
};

// What fp8_scales_for computes: one scale for each whole tensor, or one per KV head.
enum class Fp8ScaleGranularity { per_tensor, per_head };

namespace detail {

// ValueError unless there is one scale, or one per head, and every scale is positive and finite
// with a finite reciprocal (to_fp8 multiplies by 1 / scale: below about 2.9e-39, a denormal, that
// is infinite, and a zero would encode as NaN).
inline void check_fp8_scales(std::span<const float> scales, std::int64_t heads, const char* what) {
  const auto n = static_cast<std::int64_t>(scales.size());
  if (n != 1 && n != heads)
    throw ValueError(std::string("kvc fp8: ") + what + " scales: " + std::to_string(n) +
                     " given; one per tensor or one per KV head (" + std::to_string(heads) + ") expected");
  for (const float s : scales) {
    if (!(s > 0.0f) || !std::isfinite(s))
      throw ValueError(std::string("kvc fp8: ") + what + " scales must be positive and finite, got " +
                       std::to_string(s));
    if (!std::isfinite(1.0f / s)) {
      // The shortest digits that give s back: std::to_string would print 0.000000.
      char digits[32];
      const auto end = std::to_chars(digits, digits + sizeof digits, s).ptr;
      throw ValueError(std::string("kvc fp8: ") + what + " scales must have a finite reciprocal, got " +
                       std::string(digits, end));
    }
  }
}

// ValueError where scales say the codes are rotated: `who` (a device attention) reads them unrotated.
inline void check_fp8_unrotated(const Fp8Rotation& rotation, const char* who) {
  if (rotation.keys || rotation.values)
    throw ValueError(std::string(who) +
                     ": fp8 codes of rotated rows (Fp8Scales::rotation) are read on the host only; encode "
                     "them unrotated for the device");
}

// Row (b, h, s) of x as floats in `row` (x.extent(3) of them), rotated first when `rotate`: what
// to_fp8 encodes and fp8_scales_for measures.
template <class X>
void fp8_row_of(const X& x, std::int64_t b, std::int64_t h, std::int64_t s, std::vector<float>& row,
                bool rotate) noexcept {
  const std::int64_t D = x.extent(3);
  for (std::int64_t d = 0; d < D; ++d) row[static_cast<std::size_t>(d)] = static_cast<float>(x(b, h, s, d));
  if (rotate) hadamard_rotate(row.data(), 1, D);
}

// The largest finite value of F8 (448 for E4M3, 57344 for E5M2).
template <class F8>
float fp8_max() noexcept {
  if constexpr (is_float8_v<F8>)
    return F8::from_bits(F8::format::max_finite).to_float();
  else
    return 1.0f;  // (after fp8_scales_for's assertion, no second error)
}

}  // namespace detail

// x [batch, heads, seq, head_dim] as F8 codes of x / scale(head); scales: one, or one per head.
// With `rotate`, each row of head_dim values is rotated first (kvc::hadamard_rotate, in float):
// the codes of a part Fp8Scales::rotation names.
// x: any kvc::tensor_input on the host (of any element type a float converts from).
template <class F8, class X>
HostTensor<F8> to_fp8(const X& input, std::span<const float> scales, bool rotate = false) {
  static_assert(is_float8_v<F8>, "kvc fp8: the code type must be kvc::float8_e4m3 or kvc::float8_e5m2");
  if constexpr (!detail::require_inputs<detail::input_in<X, memory_space::host>, X>()) {
    return {};
  } else {
    const auto x = input_view(input);
    detail::check_fp8_scales(scales, x.extent(1), "the");
    const std::int64_t D = x.extent(3);
    HostTensor<F8> out(x.extent(0), x.extent(1), x.extent(2), D);
    std::vector<float> row(static_cast<std::size_t>(D));
    F8* o = out.data();
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h) {
        const float inv = 1.0f / detail::scale_at(scales, h);
        for (std::int64_t s = 0; s < x.extent(2); ++s) {
          detail::fp8_row_of(x, b, h, s, row, rotate);
          for (const float r : row) *o++ = F8(r * inv);
        }
      }
    return out;
  }
}

// The step's keys (values) as the codes `scales` stands for: to_fp8 with its key (value) scales,
// each row rotated first where its rotation names keys (values). What an fp8 pool is given.
template <class F8, class X>
HostTensor<F8> to_fp8_keys(const X& keys, const Fp8Scales& scales) {
  return to_fp8<F8>(keys, scales.keys, scales.rotation.keys);
}
// The values' codes (see to_fp8_keys).
template <class F8, class X>
HostTensor<F8> to_fp8_values(const X& values, const Fp8Scales& scales) {
  return to_fp8<F8>(values, scales.values, scales.rotation.values);
}

namespace detail {

// fp8_scales_for over host views of T.
template <class F8, class T>
Fp8Scales fp8_scales_of(const TensorView<T>& keys, const TensorView<T>& values, Fp8ScaleGranularity granularity,
                        Fp8Rotation rotation) {
  const auto amax = [&](const TensorView<T>& x, bool rotate) {
    std::vector<float> m(granularity == Fp8ScaleGranularity::per_head ? static_cast<std::size_t>(x.extent(1)) : 1, 0.f);
    std::vector<float> row(static_cast<std::size_t>(x.extent(3)));
    for (std::int64_t b = 0; b < x.extent(0); ++b)
      for (std::int64_t h = 0; h < x.extent(1); ++h) {
        float& slot = m[m.size() == 1 ? 0 : static_cast<std::size_t>(h)];
        for (std::int64_t s = 0; s < x.extent(2); ++s) {
          fp8_row_of(x, b, h, s, row, rotate);
          for (const float r : row) slot = std::max(slot, std::abs(r));
        }
      }
    for (float& v : m) v = v > 0.f && std::isfinite(v) ? v / fp8_max<F8>() : 1.0f;
    return m;
  };
  return {amax(keys, rotation.keys), amax(values, rotation.values), rotation};
}

}  // namespace detail

// Scales that map the largest |x| of keys and values (per tensor, or per KV head) to F8's largest
// finite value; an all-zero tensor or head gets 1. With `rotation`, x is the rotated rows of the
// parts it names, and the scales returned carry it. Keys and values: any kvc::tensor_input on the
// host, both of one element type.
template <class F8, class KT, class VT>
Fp8Scales fp8_scales_for(const KT& keys, const VT& values, Fp8ScaleGranularity granularity, Fp8Rotation rotation = {}) {
  static_assert(is_float8_v<F8>, "kvc fp8: the code type must be kvc::float8_e4m3 or kvc::float8_e5m2");
  if constexpr (!detail::check_inputs<detail::input_element_or_t<KT>, memory_space::host, KT, VT>())
    return {};
  else
    return detail::fp8_scales_of<F8>(input_view(keys), input_view(values), granularity, rotation);
}

namespace detail {

// The queries of attention over fp8 codes of rotated rows, in A (float, double for double):
// rotated as the keys were when `rotate`.
template <class A, class T>
HostTensor<A> rotated_fp8_queries(const TensorView<T>& q, bool rotate) {
  const std::int64_t D = q.extent(3);
  HostTensor<A> qa(q.extent(0), q.extent(1), q.extent(2), D);
  for (std::int64_t b = 0; b < q.extent(0); ++b)
    for (std::int64_t h = 0; h < q.extent(1); ++h)
      for (std::int64_t s = 0; s < q.extent(2); ++s)
        for (std::int64_t d = 0; d < D; ++d) qa(b, h, s, d) = static_cast<A>(q(b, h, s, d));
  if (rotate) hadamard_rotate(qa.data(), qa.size() / std::max<std::int64_t>(D, 1), D);
  return qa;
}

}  // namespace detail

// One attention layer's step through an fp8 cache (see the header comment): as kvc::attend, with
// the step's keys and values encoded with `scales` before they are stored. Everything that can be
// refused is refused before the cache changes.
// Queries, keys and values: any kvc::tensor_input on the host of the model's element type T.
// Returns [batch, Hq, q, head_dim] in T.
template <class Cache, class QT, class KT, class VT>
HostTensor<detail::input_element_or_t<QT>> attend_fp8(Cache& cache, std::int64_t layer_idx, const QT& queries,
                                                      const KT& keys, const VT& values, const Fp8Scales& scales,
                                                      const AttendOptions& options = {}) {
  using F8 = typename Cache::storage_policy::element_type;
  using T = detail::input_element_or_t<QT>;
  static_assert(is_float8_v<F8>,
                "kvc::attend_fp8: the cache's element type must be kvc::float8_e4m3 or kvc::float8_e5m2 (e.g. "
                "kvc::DynamicCache<kvc::float8_e4m3>); use kvc::attend for other caches");
  // (only one assertion, not a cascade, when one fails)
  constexpr bool accepted = detail::input_of<QT, T, memory_space::host> && !is_float8_v<T> &&
                            detail::input_of<KT, T, memory_space::host> && detail::input_of<VT, T, memory_space::host>;
  if constexpr (is_float8_v<F8> && detail::require_inputs<accepted, QT, KT, VT>()) {
    const TensorView<T> q = input_view(queries), k = input_view(keys), v = input_view(values);
    detail::check_fp8_scales(scales.keys, k.extent(1), "key");
    detail::check_fp8_scales(scales.values, v.extent(1), "value");
    const HostTensor<F8> k8 = to_fp8_keys<F8>(k, scales), v8 = to_fp8_values<F8>(v, scales);
    // With rotation, the queries in A (float, double for double), rotated as the keys were; the
    // output is computed in A, rotated back where the values were, then rounded to T once.
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const bool rotated = scales.rotation.keys || scales.rotation.values;
    const HostTensor<A> qa = rotated ? detail::rotated_fp8_queries<A>(q, scales.rotation.keys) : HostTensor<A>();
    // The output, its A copy and the scratch are made before the update (in the caller's workspace
    // or the call's own), as kvc::attend does: a failed allocation leaves the cache as it was.
    AttentionWorkspace local;
    AttentionContext context = options.context;
    if (context.workspace == nullptr) context.workspace = &local;
    HostTensor<T> out;
    HostTensor<A> out_a;  // (rotated, T not A)
    HostTensor<A>* rotated_out = nullptr;
    if constexpr (std::is_same_v<T, A>)
      rotated_out = &out;
    else
      rotated_out = &out_a;
    detail::attend_impl(
        cache, layer_idx, q, k8, v8, options,
        [&](const auto& kv, const AttentionMask& mask) {
          if (!rotated) {
            detail::attention_into(out, q, kv.keys, kv.values, mask, options.scale, scales, context);
            return 0;
          }
          detail::attention_into(*rotated_out, input_view(qa), kv.keys, kv.values, mask, options.scale, scales,
                                 context);
          const std::int64_t Dv = rotated_out->dimension(3);
          if (scales.rotation.values)
            hadamard_rotate(rotated_out->data(), rotated_out->size() / std::max<std::int64_t>(Dv, 1), Dv);
          if constexpr (!std::is_same_v<T, A>)
            for (std::int64_t i = 0; i < out.size(); ++i) out.data()[i] = static_cast<T>(out_a.data()[i]);
          return 0;
        },
        [&](const AttentionMask& mask, const std::array<std::int64_t, 4>& ke, const std::array<std::int64_t, 4>& ve) {
          if (rotated)
            detail::reserve_attention<A, F8>(q.extents, ke, ve[3], mask, context);
          else
            detail::reserve_attention<T, F8>(q.extents, ke, ve[3], mask, context);
          out.resize(q.extents[0], q.extents[1], q.extents[2], ve[3]);
          if (rotated) rotated_out->resize(q.extents[0], q.extents[1], q.extents[2], ve[3]);
        });
    return out;
  } else {
    return HostTensor<T>();
  }
}

}  // namespace kvc

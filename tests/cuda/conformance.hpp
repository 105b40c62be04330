#pragma once
// Storage conformance scenarios, written once over a storage "backend" and run for every storage
// policy: HostStorage<float> in host_conformance.cpp (host compiler, every CI stage), and
// HostStorage<U> next to CudaStorage<T> in cuda_conformance.cu, which compares what the device
// returned with what the host returned, element by element.
//
// A backend B provides
//   using storage = <a kvc storage policy>;  using element = <host element type of the references>;
//   B::input(HostTensor<element>)              something storage's update accepts
//   B::state_input(Eigen::Tensor<element, N>)  something update_conv_state / update_recurrent_state accept
//   B::fetch(storage::view_type)               HostTensor<element>, a copy of what the view shows
//   B::fetch_state<N>(storage::state_view_type)  Eigen::Tensor<element, N, RowMajor>
//
// Each scenario checks kvc's semantics against a reference model on the host (doctest CHECKs) and
// writes everything it observed (queries, shapes, capacities, every fetched element) to a Record.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <kvc/detail/attention_rows.hpp>
#include <kvc/kvc.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/row_codes.hpp>

namespace kvc_conformance {

using Ref = kvc::HostTensor<float>;  // reference tensors, always float
template <int N>
using HostState = Eigen::Tensor<float, N, Eigen::RowMajor>;

// What a scenario observed, in order. A tensor recorded with a tolerance (what a quantized layer
// returned) may differ by that much between two storages; every other observation is exact.
struct Record {
  std::vector<std::string> labels;
  std::vector<std::int64_t> numbers;
  std::vector<std::vector<float>> tensors;
  std::vector<float> tolerances;  // one per tensor

  void number(const std::string& label, std::int64_t n) {
    labels.push_back(label);
    numbers.push_back(n);
  }
  template <class Tensor>
  void tensor(const std::string& label, const Tensor& t, float tolerance = 0) {
    labels.push_back(label);
    tolerances.push_back(tolerance);
    std::vector<float> flat(static_cast<std::size_t>(t.size()));
    for (std::int64_t i = 0; i < t.size(); ++i) flat[static_cast<std::size_t>(i)] = static_cast<float>(t.data()[i]);
    for (int r = 0; r < Tensor::NumDimensions; ++r) numbers.push_back(t.dimension(r));
    tensors.push_back(std::move(flat));
  }
};

// ---- reference data ----------------------------------------------------------------------------

// Small integers, exact in float, half and bfloat16; distinct per token, head, batch entry and run.
inline float pattern(int run, std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t d) {
  return static_cast<float>((run * 31 + b * 7 + h * 5 + t * 3 + d) % 61 - 30);
}

// [batch, heads, q, dim] holding tokens t0 .. t0 + q - 1 of `run`.
inline Ref tokens(int run, std::int64_t batch, std::int64_t heads, std::int64_t t0, std::int64_t q, std::int64_t dim) {
  Ref out(batch, heads, q, dim);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t s = 0; s < q; ++s)
        for (std::int64_t d = 0; d < dim; ++d) out(b, h, s, d) = pattern(run, b, h, t0 + s, d);
  return out;
}

inline Ref zeros(std::int64_t batch, std::int64_t heads, std::int64_t len, std::int64_t dim) {
  Ref out(batch, heads, len, dim);
  for (std::int64_t i = 0; i < out.size(); ++i) out.data()[i] = 0.f;
  return out;
}

// Concatenation along the sequence axis.
inline Ref concat(const Ref& a, const Ref& b) {
  Ref out(a.dimension(0), a.dimension(1), a.dimension(2) + b.dimension(2), a.dimension(3));
  for (Eigen::Index i = 0; i < out.dimension(0); ++i)
    for (Eigen::Index h = 0; h < out.dimension(1); ++h)
      for (Eigen::Index s = 0; s < out.dimension(2); ++s)
        for (Eigen::Index d = 0; d < out.dimension(3); ++d)
          out(i, h, s, d) = s < a.dimension(2) ? a(i, h, s, d) : b(i, h, s - a.dimension(2), d);
  return out;
}

// Tokens [from, from + len) along the sequence axis.
inline Ref slice(const Ref& a, std::int64_t from, std::int64_t len) {
  Ref out(a.dimension(0), a.dimension(1), len, a.dimension(3));
  for (Eigen::Index i = 0; i < out.dimension(0); ++i)
    for (Eigen::Index h = 0; h < out.dimension(1); ++h)
      for (Eigen::Index s = 0; s < len; ++s)
        for (Eigen::Index d = 0; d < out.dimension(3); ++d) out(i, h, s, d) = a(i, h, from + s, d);
  return out;
}

// Batch entry i of the result is entry idx[i] of a.
inline Ref gather(const Ref& a, const std::vector<std::int64_t>& idx) {
  Ref out(static_cast<Eigen::Index>(idx.size()), a.dimension(1), a.dimension(2), a.dimension(3));
  for (std::size_t i = 0; i < idx.size(); ++i)
    for (Eigen::Index h = 0; h < out.dimension(1); ++h)
      for (Eigen::Index s = 0; s < out.dimension(2); ++s)
        for (Eigen::Index d = 0; d < out.dimension(3); ++d)
          out(static_cast<Eigen::Index>(i), h, s, d) = a(idx[i], h, s, d);
  return out;
}

template <class E, int N>
Eigen::Tensor<E, N, Eigen::RowMajor> cast_to(const Eigen::Tensor<float, N, Eigen::RowMajor>& t) {
  Eigen::Tensor<E, N, Eigen::RowMajor> out(t.dimensions());
  for (Eigen::Index i = 0; i < t.size(); ++i) out.data()[i] = static_cast<E>(t.data()[i]);
  return out;
}
template <class E, int N>
Eigen::Tensor<float, N, Eigen::RowMajor> to_float(const Eigen::Tensor<E, N, Eigen::RowMajor>& t) {
  Eigen::Tensor<float, N, Eigen::RowMajor> out(t.dimensions());
  for (Eigen::Index i = 0; i < t.size(); ++i) out.data()[i] = static_cast<float>(t.data()[i]);
  return out;
}

// a == b, or |a - b| <= tolerance when the tolerance is positive.
inline bool within(float a, float b, float tolerance) { return tolerance > 0 ? std::fabs(a - b) <= tolerance : a == b; }

// Whether got == want (shape and every element), or within `tolerance` of it element by element;
// the first difference goes to the doctest log.
template <int N>
bool same(const Eigen::Tensor<float, N, Eigen::RowMajor>& got, const Eigen::Tensor<float, N, Eigen::RowMajor>& want,
          const std::string& what, float tolerance = 0) {
  for (int r = 0; r < N; ++r)
    if (got.dimension(r) != want.dimension(r)) {
      MESSAGE(what << ": extent " << r << " is " << got.dimension(r) << ", expected " << want.dimension(r));
      return false;
    }
  for (Eigen::Index i = 0; i < got.size(); ++i)
    if (!within(got.data()[i], want.data()[i], tolerance)) {
      MESSAGE(what << ": flat element " << i << " is " << got.data()[i] << ", expected " << want.data()[i]
                   << (tolerance > 0 ? " (tolerance " + std::to_string(tolerance) + ")" : std::string()));
      return false;
    }
  return true;
}

// ---- the host backend ------------------------------------------------------------------------

template <class T>
struct HostBackend {
  using storage = kvc::HostStorage<T>;
  using element = T;
  static const kvc::HostTensor<T>& input(const kvc::HostTensor<T>& t) { return t; }
  template <int N>
  static const Eigen::Tensor<T, N, Eigen::RowMajor>& state_input(const Eigen::Tensor<T, N, Eigen::RowMajor>& t) {
    return t;
  }
  static kvc::HostTensor<T> fetch(const kvc::TensorView<T>& v) { return v.to_tensor(); }
  // Attention over a cache's views by the device kernels' per-row steps on the host, with splits of
  // `chunk` keys (the device picks its own split: the merge is exercised here with small chunks).
  template <class View>
  static Ref attention(const Ref& q, const View& k, const View& v, const kvc::AttentionMask& mask, double scale,
                       std::int64_t chunk) {
    const kvc::HostTensor<T> hq = cast_to<T>(q);
    kvc::HostTensor<T> out(q.dimension(0), q.dimension(1), q.dimension(2), v.extent(3));
    const auto p = kvc::detail::make_dense_problem(kvc::HostStorage<T>::input_view(hq), k, v, mask, scale, out.data(),
                                                   {}, {}, mask.key_padding_mask.data());
    kvc::detail::attention_rows_host(p, chunk);
    return to_float(out);
  }
  template <class Cache, class View>
  static Ref paged_attention(const Cache& cache, std::int64_t layer, const kvc::PagedAttentionStep& step, const Ref& q,
                             const View& k, const View& v, std::int64_t chunk) {
    const kvc::HostTensor<T> hq = cast_to<T>(q);
    const auto qv = kvc::HostStorage<T>::input_view(hq);
    const auto call = kvc::detail::check_paged_attention(cache, layer, step, qv, k, v);
    std::int64_t width = 0;
    const auto tables = kvc::detail::paged_tables(cache, call, step, width);
    kvc::HostTensor<T> out(1, call.Hq, call.T, call.D);
    const auto p = kvc::detail::make_paged_problem(cache, call, qv, k, v, out.data(), step.cu_seqlens_q.data(),
                                                   step.past.data(), tables.data(), width, std::nullopt, {}, {});
    kvc::detail::attention_rows_host(p, chunk);
    return to_float(out);
  }
  // Not StateView::to_tensor: it sizes the tensor with a std::array, which nvcc's Eigen rejects.
  template <int N>
  static Eigen::Tensor<T, N, Eigen::RowMajor> fetch_state(const kvc::StateView<T>& v) {
    Eigen::DSizes<Eigen::Index, N> dims;
    for (int r = 0; r < N; ++r) dims[r] = r < v.rank ? v.extents[static_cast<std::size_t>(r)] : 1;
    Eigen::Tensor<T, N, Eigen::RowMajor> out(dims);
    for (Eigen::Index i = 0; i < out.size(); ++i) out.data()[i] = v.ptr[i];
    return out;
  }
};

// ---- helpers over a backend ----------------------------------------------------------------------

template <class B>
struct io {
  using E = typename B::element;
  using S = typename B::storage;

  // Updates layer `idx` of `cache` with reference tensors and returns what it returned, as float.
  // (`tolerance`: how far another storage's result may be, see Record.)
  template <class Cache>
  static std::pair<Ref, Ref> update(Cache& cache, const Ref& k, const Ref& v, std::int64_t idx, Record& rec,
                                    const std::string& label, float tolerance = 0) {
    const kvc::HostTensor<E> hk = cast_to<E>(k), hv = cast_to<E>(v);
    auto&& dk = B::input(hk);
    auto&& dv = B::input(hv);
    const auto kv = cache.update(dk, dv, idx);
    return record_kv(kv, rec, label, tolerance);
  }

  template <class KV>
  static std::pair<Ref, Ref> record_kv(const KV& kv, Record& rec, const std::string& label, float tolerance = 0) {
    const Ref k = to_float(B::fetch(kv.keys)), v = to_float(B::fetch(kv.values));
    rec.tensor(label + ".keys", k, tolerance);
    rec.tensor(label + ".values", v, tolerance);
    return {k, v};
  }

  // The capacity of the buffer behind a view (its stride over heads, in tokens).
  template <class View>
  static std::int64_t capacity(const View& v) {
    return v.extent(3) > 0 ? v.stride(1) / v.extent(3) : 0;
  }
};

constexpr std::int64_t kBatch = 2, kHeads = 3, kKeyDim = 8, kValueDim = 4;  // value rows of 4 elements
                                                                            // take the unaligned path

// ---- A. DynamicLayer: appends, geometric growth, lazy layers, deep copies ---------------------------

template <class B>
void dynamic_append_growth(Record& rec) {
  using S = typename B::storage;
  using IO = io<B>;
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, S> cache;
  Ref want_k = tokens(0, kBatch, kHeads, 0, 0, kKeyDim), want_v = tokens(1, kBatch, kHeads, 0, 0, kValueDim);
  std::vector<std::int64_t> capacities;
  std::int64_t len = 0;
  const std::vector<std::int64_t> steps = {5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 13, 1, 1, 20, 0, 1};
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const std::int64_t q = steps[i];
    const Ref k = tokens(0, kBatch, kHeads, len, q, kKeyDim), v = tokens(1, kBatch, kHeads, len, q, kValueDim);
    want_k = concat(want_k, k);
    want_v = concat(want_v, v);
    len += q;
    auto [gk, gv] = IO::update(cache, k, v, 1, rec, "dynamic.step" + std::to_string(i));
    CHECK(same(gk, want_k, "dynamic keys after step " + std::to_string(i)));
    CHECK(same(gv, want_v, "dynamic values after step " + std::to_string(i)));
    const auto stored = cache.stored(1);
    const std::int64_t cap = IO::capacity(stored.keys);
    if (capacities.empty() || capacities.back() != cap) capacities.push_back(cap);
    CHECK(cache.get_seq_length(1) == len);
    rec.number("dynamic.len", cache.get_seq_length(1));
    rec.number("dynamic.capacity", cap);
    rec.number("dynamic.bytes", cache.bytes());
  }
  // 5 tokens start a buffer of 16; when full it grows by a quarter, or to what the step needs:
  // 16 -> 29 (13 tokens at 16) -> 36 -> 51 (20 tokens at 31) -> 63.
  CHECK(capacities == std::vector<std::int64_t>{16, 29, 36, 51, 63});
  CHECK(cache.size() == 2);  // index 1 created index 0 too, empty
  CHECK(cache.get_seq_length(0) == 0);
  CHECK_FALSE(cache.stored(0).keys.data());

  // A copy is deep: appending to the original leaves it unchanged.
  auto copy = cache;
  IO::update(cache, tokens(5, kBatch, kHeads, len, 2, kKeyDim), tokens(6, kBatch, kHeads, len, 2, kValueDim), 1, rec,
             "dynamic.after_copy");
  const auto [ck, cv] = IO::record_kv(copy.stored(1), rec, "dynamic.copy");
  CHECK(copy.get_seq_length(1) == len);
  CHECK(same(ck, want_k, "keys of the copy"));
  CHECK(same(cv, want_v, "values of the copy"));
  CHECK(cache.get_seq_length(1) == len + 2);

  cache.reset();
  CHECK(cache.get_seq_length(1) == 0);
  CHECK(cache.bytes() == 0);
  rec.number("dynamic.bytes_after_reset", cache.bytes());
}

// ---- B. StaticLayer: in-place writes, overflow, write position, reset, early init ---------------------

template <class B>
void static_in_place(Record& rec) {
  using S = typename B::storage;
  using IO = io<B>;
  constexpr std::int64_t max_len = 10;
  kvc::Cache<kvc::Layers<kvc::StaticLayer>, S> cache(kvc::StaticLayer{max_len});
  Ref want_k = zeros(kBatch, kHeads, max_len, kKeyDim), want_v = zeros(kBatch, kHeads, max_len, kValueDim);
  const auto put = [&](std::int64_t at, std::int64_t q, int run) {
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t h = 0; h < kHeads; ++h)
        for (std::int64_t s = 0; s < q; ++s) {
          for (std::int64_t d = 0; d < kKeyDim; ++d) want_k(b, h, at + s, d) = pattern(run, b, h, at + s, d);
          for (std::int64_t d = 0; d < kValueDim; ++d) want_v(b, h, at + s, d) = pattern(run + 1, b, h, at + s, d);
        }
  };
  const auto step = [&](std::int64_t at, std::int64_t q, int run, const std::string& label) {
    return IO::update(cache, tokens(run, kBatch, kHeads, at, q, kKeyDim),
                      tokens(run + 1, kBatch, kHeads, at, q, kValueDim), 0, rec, label);
  };

  auto [k1, v1] = step(0, 4, 0, "static.prefill");
  put(0, 4, 0);
  CHECK(same(k1, want_k, "static keys after prefill"));
  CHECK(same(v1, want_v, "static values after prefill"));
  const auto* buffer = cache.stored(0).keys.data();
  auto [k2, v2] = step(4, 3, 0, "static.second");
  put(4, 3, 0);
  CHECK(same(k2, want_k, "static keys after the second write"));
  CHECK(same(v2, want_v, "static values after the second write"));
  CHECK(cache.stored(0).keys.data() == buffer);  // written in place, never reallocated
  CHECK(cache.get_seq_length() == 7);
  CHECK(cache.get_mask_sizes(1, 0) == std::pair<std::int64_t, std::int64_t>{max_len, 0});

  // 7 + 4 > 10: IndexError, and the layer is exactly as it was.
  const kvc::HostTensor<typename B::element> big_k =
      cast_to<typename B::element>(tokens(9, kBatch, kHeads, 7, 4, kKeyDim));
  const kvc::HostTensor<typename B::element> big_v =
      cast_to<typename B::element>(tokens(9, kBatch, kHeads, 7, 4, kValueDim));
  {
    auto&& dk = B::input(big_k);
    auto&& dv = B::input(big_v);
    bool threw = false;
    try {
      cache.update(dk, dv, 0);
    } catch (const kvc::IndexError&) {
      threw = true;
    }
    CHECK(threw);
    rec.number("static.overflow_threw", threw);
  }
  CHECK(cache.get_seq_length() == 7);
  const auto [k3, v3] = IO::record_kv(cache.stored(0), rec, "static.after_overflow");
  CHECK(same(k3, want_k, "static keys after the overflow"));
  CHECK(same(v3, want_v, "static values after the overflow"));

  // Exactly full is fine.
  step(7, 3, 0, "static.full");
  put(7, 3, 0);
  CHECK(cache.get_seq_length() == max_len);

  // The export path: overwrite slot 2.
  cache.set_write_position(2);
  auto [k4, v4] = step(2, 1, 20, "static.rewrite");
  put(2, 1, 20);
  CHECK(same(k4, want_k, "static keys after set_write_position"));
  CHECK(same(v4, want_v, "static values after set_write_position"));

  // reset zeroes in place.
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.stored(0).keys.data() == buffer);
  const auto [k5, v5] = IO::record_kv(cache.stored(0), rec, "static.after_reset");
  CHECK(same(k5, zeros(kBatch, kHeads, max_len, kKeyDim), "static keys after reset"));
  CHECK(same(v5, zeros(kBatch, kHeads, max_len, kValueDim), "static values after reset"));

  // early_initialization allocates zeroed buffers up front.
  kvc::Cache<kvc::Layers<kvc::StaticLayer>, S> early(kvc::StaticLayer{6}, kvc::StaticLayer{6});
  early.early_initialization(kBatch, kHeads, kKeyDim);
  CHECK(early.is_initialized());
  CHECK(early.bytes() ==
        static_cast<std::int64_t>(sizeof(typename S::element_type)) * 2 * 2 * kBatch * kHeads * 6 * kKeyDim);
  const auto [k6, v6] = IO::record_kv(early.stored(1), rec, "static.early");
  CHECK(same(k6, zeros(kBatch, kHeads, 6, kKeyDim), "early-initialized keys"));
}

// ---- C. StaticSlidingWindowLayer: every path of its update, past the window -----------------------

template <class B>
void static_sliding(Record& rec) {
  using S = typename B::storage;
  using IO = io<B>;
  constexpr std::int64_t window = 6;
  kvc::Cache<kvc::Layers<kvc::StaticSlidingWindowLayer>, S> cache(kvc::StaticSlidingWindowLayer{32, window});
  Ref all_k = tokens(0, kBatch, kHeads, 0, 0, kKeyDim), all_v = tokens(1, kBatch, kHeads, 0, 0, kValueDim);
  std::int64_t seen = 0;
  // fits, fits, becoming full, q == 1 full (many, so the window wraps in its 2W buffer), q > 1 full
  const std::vector<std::int64_t> steps = {2, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1, 7, 1};
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const std::int64_t q = steps[i];
    const auto [mask_len, mask_offset] = cache.get_mask_sizes(q, 0);
    rec.number("static_sliding.kv_length", mask_len);
    rec.number("static_sliding.kv_offset", mask_offset);
    all_k = concat(all_k, tokens(0, kBatch, kHeads, seen, q, kKeyDim));
    all_v = concat(all_v, tokens(1, kBatch, kHeads, seen, q, kValueDim));
    const bool fits = seen + q <= window;
    auto [gk, gv] = IO::update(cache, slice(all_k, seen, q), slice(all_v, seen, q), 0, rec,
                               "static_sliding.step" + std::to_string(i));
    seen += q;
    if (fits) {  // the whole window: the tokens seen, then zeros
      CHECK(gk.dimension(2) == window);
      CHECK(same(slice(gk, 0, seen), all_k, "static sliding keys (fits) step " + std::to_string(i)));
      CHECK(
          same(slice(gk, seen, window - seen), zeros(kBatch, kHeads, window - seen, kKeyDim), "zeros past the tokens"));
    } else {  // the last tokens, as many as the mask advertised
      const std::int64_t n = gk.dimension(2);
      CHECK(n == mask_len);
      CHECK(same(gk, slice(all_k, seen - n, n), "static sliding keys step " + std::to_string(i)));
      CHECK(same(gv, slice(all_v, seen - n, n), "static sliding values step " + std::to_string(i)));
    }
    // stored(): the window, the last W tokens once full
    if (seen >= window) {
      const auto [sk, sv] = IO::record_kv(cache.stored(0), rec, "static_sliding.stored");
      CHECK(same(sk, slice(all_k, seen - window, window), "static sliding window step " + std::to_string(i)));
      CHECK(same(sv, slice(all_v, seen - window, window), "static sliding window values step " + std::to_string(i)));
    }
    CHECK(cache.get_seq_length() == seen);
  }
}

// ---- D. DynamicSlidingWindowLayer: past the window, past recording and crop ---------------------

template <class B>
void dynamic_sliding(Record& rec) {
  using S = typename B::storage;
  using IO = io<B>;
  constexpr std::int64_t window = 5;
  for (const bool recording : {false, true}) {
    const std::string tag = recording ? "dynamic_sliding.recording" : "dynamic_sliding";
    kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>, S> cache(kvc::DynamicSlidingWindowLayer{window});
    if (recording) cache.activate_past_recording();
    Ref all_k = tokens(0, kBatch, kHeads, 0, 0, kKeyDim), all_v = tokens(1, kBatch, kHeads, 0, 0, kValueDim);
    std::int64_t seen = 0;
    const std::vector<std::int64_t> steps = {3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 6, 1, 1, 2, 1};
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const std::int64_t q = steps[i];
      const std::int64_t mask_len = cache.get_mask_sizes(q, 0).first;
      all_k = concat(all_k, tokens(0, kBatch, kHeads, seen, q, kKeyDim));
      all_v = concat(all_v, tokens(1, kBatch, kHeads, seen, q, kValueDim));
      auto [gk, gv] =
          IO::update(cache, slice(all_k, seen, q), slice(all_v, seen, q), 0, rec, tag + ".step" + std::to_string(i));
      seen += q;
      const std::int64_t n = std::min(mask_len, seen);
      CHECK(same(gk, slice(all_k, seen - n, n), tag + " keys step " + std::to_string(i)));
      CHECK(same(gv, slice(all_v, seen - n, n), tag + " values step " + std::to_string(i)));
      const std::int64_t kept = recording ? seen : std::min(seen, window - 1);
      const auto [sk, sv] = IO::record_kv(cache.stored(0), rec, tag + ".stored");
      CHECK(same(sk, slice(all_k, seen - kept, kept), tag + " stored keys step " + std::to_string(i)));
      CHECK(same(sv, slice(all_v, seen - kept, kept), tag + " stored values step " + std::to_string(i)));
      rec.number(tag + ".seq_length", cache.get_seq_length());
      rec.number(tag + ".capacity", IO::capacity(cache.stored(0).keys));
    }
    if (recording) {
      // Roll back 4 tokens: the window before them stays.
      cache.crop(-4);
      seen -= 4;
      CHECK(cache.get_seq_length() == seen);
      const auto [sk, sv] = IO::record_kv(cache.stored(0), rec, tag + ".cropped");
      CHECK(same(sk, slice(all_k, seen - (window - 1), window - 1), "dynamic sliding keys after crop"));
      CHECK(same(sv, slice(all_v, seen - (window - 1), window - 1), "dynamic sliding values after crop"));
    } else {
      bool threw = false;
      try {
        cache.crop(-1);  // past the window without recording: RuntimeError, nothing changes
      } catch (const kvc::RuntimeError&) {
        threw = true;
      }
      CHECK(threw);
      CHECK(cache.get_seq_length() == seen);
    }
  }
}

// ---- E. crop, reorder_cache, batch_repeat_interleave, batch_select_indices ----------------------

template <class B>
void batch_operations(Record& rec) {
  using S = typename B::storage;
  using IO = io<B>;
  constexpr std::int64_t batch = 3;
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, S> cache;
  Ref want_k = tokens(0, batch, kHeads, 0, 7, kKeyDim), want_v = tokens(1, batch, kHeads, 0, 7, kValueDim);
  for (std::int64_t layer = 0; layer < 2; ++layer) IO::update(cache, want_k, want_v, layer, rec, "batch.prefill");

  const auto check_all = [&](const std::string& what) {
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto [k, v] = IO::record_kv(cache.stored(layer), rec, "batch." + what);
      CHECK(same(k, want_k, what + " keys, layer " + std::to_string(layer)));
      CHECK(same(v, want_v, what + " values, layer " + std::to_string(layer)));
    }
  };

  cache.crop(-3);  // drop the last 3 tokens
  want_k = slice(want_k, 0, 4);
  want_v = slice(want_v, 0, 4);
  CHECK(cache.get_seq_length() == 4);
  check_all("crop");

  // New tokens (another run) overwrite the cropped slots.
  const Ref nk = tokens(7, batch, kHeads, 4, 2, kKeyDim), nv = tokens(8, batch, kHeads, 4, 2, kValueDim);
  for (std::int64_t layer = 0; layer < 2; ++layer) IO::update(cache, nk, nv, layer, rec, "batch.after_crop");
  want_k = concat(want_k, nk);
  want_v = concat(want_v, nv);
  check_all("append after crop");

  const std::vector<std::int64_t> beams = {2, 0, 0};
  cache.reorder_cache(beams);
  want_k = gather(want_k, beams);
  want_v = gather(want_v, beams);
  check_all("reorder_cache");

  cache.batch_repeat_interleave(2);
  want_k = gather(want_k, {0, 0, 1, 1, 2, 2});
  want_v = gather(want_v, {0, 0, 1, 1, 2, 2});
  CHECK(cache.batch_size() == 6);
  check_all("batch_repeat_interleave");

  cache.batch_select_indices({5, 1});
  want_k = gather(want_k, {5, 1});
  want_v = gather(want_v, {5, 1});
  CHECK(cache.batch_size() == 2);
  check_all("batch_select_indices");

  // An out-of-range index throws and changes nothing.
  bool threw = false;
  try {
    cache.reorder_cache({0, 2});
  } catch (const kvc::IndexError&) {
    threw = true;
  }
  CHECK(threw);
  check_all("failed reorder");

  // Appending after the batch operations still works.
  const Ref tk = tokens(11, 2, kHeads, 6, 1, kKeyDim), tv = tokens(12, 2, kHeads, 6, 1, kValueDim);
  auto [gk, gv] = IO::update(cache, tk, tv, 0, rec, "batch.final");
  CHECK(same(gk, concat(want_k, tk), "append after batch operations"));
  CHECK(same(gv, concat(want_v, tv), "append values after batch operations"));
}

// ---- F. linear attention: conv and recurrent states, hybrids -------------------------------------

inline HostState<3> conv_input(int run, std::int64_t batch, std::int64_t channels, std::int64_t t0, std::int64_t t) {
  HostState<3> out(batch, channels, t);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t c = 0; c < channels; ++c)
      for (std::int64_t s = 0; s < t; ++s) out(b, c, s) = pattern(run, b, c, t0 + s, 0);
  return out;
}
// Columns [from, from + n) of x, with `pad` zero columns in front.
inline HostState<3> columns(const HostState<3>& x, std::int64_t pad, std::int64_t from, std::int64_t n) {
  HostState<3> out(x.dimension(0), x.dimension(1), pad + n);
  for (Eigen::Index b = 0; b < x.dimension(0); ++b)
    for (Eigen::Index c = 0; c < x.dimension(1); ++c)
      for (Eigen::Index s = 0; s < pad + n; ++s) out(b, c, s) = s < pad ? 0.f : x(b, c, from + s - pad);
  return out;
}

template <class B>
void linear_states(Record& rec) {
  using S = typename B::storage;
  using E = typename B::element;
  using IO = io<B>;
  constexpr std::int64_t batch = 2, channels = 8, kernel = 4;
  using Kinds = kvc::Layers<kvc::LinearAttentionLayer, kvc::LinearAttentionAndFullAttentionLayer>;
  kvc::Cache<Kinds, S> cache(kvc::LinearAttentionLayer{2}, kvc::LinearAttentionAndFullAttentionLayer{{}, 1});

  const auto conv = [&](std::int64_t layer, std::int64_t state, const HostState<3>& x, const std::string& label) {
    const Eigen::Tensor<E, 3, Eigen::RowMajor> hx = cast_to<E>(x);
    auto&& dx = B::template state_input<3>(hx);
    const auto out = cache.update_conv_state(dx, layer, state, kernel);
    const HostState<3> got = to_float(B::template fetch_state<3>(out));
    rec.tensor(label, got);
    return got;
  };
  const auto recurrent = [&](std::int64_t layer, std::int64_t state, const HostState<3>& x, const std::string& label) {
    const Eigen::Tensor<E, 3, Eigen::RowMajor> hx = cast_to<E>(x);
    auto&& dx = B::template state_input<3>(hx);
    const auto out = cache.update_recurrent_state(dx, layer, state);
    const HostState<3> got = to_float(B::template fetch_state<3>(out));
    rec.tensor(label, got);
    return got;
  };

  // conv input of 3 columns, then 1, then 2 (time axis); columns of `all` are the ones seen
  const HostState<3> all = conv_input(0, batch, channels, 0, 6);
  CHECK_FALSE(cache.has_previous_state(0));
  HostState<3> got = conv(0, 0, columns(all, 0, 0, 2), "linear.conv0");
  CHECK(same(got, columns(all, 2, 0, 2), "first conv update: zero-padded to the kernel size"));
  got = conv(0, 0, columns(all, 0, 2, 1), "linear.conv1");
  CHECK(same(got, columns(all, 2, 0, 3), "second conv update: the stored columns, then the new one"));
  got = conv(0, 0, columns(all, 0, 3, 2), "linear.conv2");
  CHECK(same(got, columns(all, 1, 0, 5), "third conv update"));
  const HostState<3> held =
      to_float(B::template fetch_state<3>(cache.visit_layer(0, [](const auto& l) -> typename S::state_view_type {
        if constexpr (requires { l.conv_state(0); })
          return l.conv_state(0);
        else
          return {};
      })));
  rec.tensor("linear.conv_state", held);
  CHECK(same(held, columns(all, 0, 1, kernel), "conv state keeps the last kernel-size columns"));
  CHECK(cache.has_previous_state(0, 0));
  CHECK_FALSE(cache.has_previous_state(0, 1));

  // recurrent states are overwritten
  const HostState<3> r1 = conv_input(3, batch, 4, 0, 5), r2 = conv_input(4, batch, 4, 0, 5);
  CHECK(same(recurrent(0, 1, r1, "linear.rec1"), r1, "first recurrent state"));
  CHECK(same(recurrent(0, 1, r2, "linear.rec2"), r2, "recurrent state overwritten"));

  // the hybrid: K/V and conv state in one layer
  const Ref k = tokens(0, batch, kHeads, 0, 3, kKeyDim), v = tokens(1, batch, kHeads, 0, 3, kValueDim);
  auto [gk, gv] = IO::update(cache, k, v, 1, rec, "linear.hybrid_kv");
  CHECK(same(gk, k, "hybrid keys"));
  const HostState<3> h = conv_input(5, batch, channels, 0, 4);
  CHECK(same(conv(1, 0, h, "linear.hybrid_conv"), h, "hybrid conv state (kernel-size input)"));
  CHECK(cache.get_seq_length(0) == 3);  // index 0 answers for the first attention layer

  // batch ops act on the states too
  cache.batch_select_indices({1});
  got = conv(0, 0, conv_input(9, 1, channels, 0, 1), "linear.after_select");
  CHECK(got.dimension(0) == 1);
  rec.number("linear.batch", cache.batch_size());

  // reset zeroes the states: no previous state any more
  cache.reset();
  CHECK_FALSE(cache.has_previous_state(0, 0));
  rec.number("linear.bytes_after_reset", cache.bytes());
}

// ---- F2. Indexed layers: K/V part plus indexer keys, batch operations, crop ------------------------

// [batch, q, dim] indexer keys of tokens t0 .. t0 + q - 1.
inline HostState<3> indexer_input(int run, std::int64_t batch, std::int64_t t0, std::int64_t q, std::int64_t dim) {
  HostState<3> out(batch, q, dim);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < q; ++s)
      for (std::int64_t d = 0; d < dim; ++d) out(b, s, d) = pattern(run, b, 0, t0 + s, d);
  return out;
}

template <class B>
void indexed(Record& rec) {
  using S = typename B::storage;
  using E = typename B::element;
  using IO = io<B>;
  constexpr std::int64_t index_dim = 16, slots = 12;
  kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer, kvc::StaticIndexedLayer>, S> cache(kvc::DynamicIndexedLayer{},
                                                                                      kvc::StaticIndexedLayer{slots});
  HostState<3> all(kBatch, 0, index_dim);
  std::int64_t len = 0;
  const auto index = [&](std::int64_t layer, const HostState<3>& x, const std::string& label) {
    const Eigen::Tensor<E, 3, Eigen::RowMajor> hx = cast_to<E>(x);
    auto&& dx = B::template state_input<3>(hx);
    const HostState<3> got = to_float(B::template fetch_state<3>(cache.update_indexer(dx, layer)));
    rec.tensor(label, got);
    return got;
  };
  // Sequence-axis concatenation of [batch, seq, dim] states.
  const auto append = [](const HostState<3>& a, const HostState<3>& b) {
    HostState<3> out(a.dimension(0), a.dimension(1) + b.dimension(1), a.dimension(2));
    for (Eigen::Index i = 0; i < out.dimension(0); ++i)
      for (Eigen::Index t = 0; t < out.dimension(1); ++t)
        for (Eigen::Index d = 0; d < out.dimension(2); ++d)
          out(i, t, d) = t < a.dimension(1) ? a(i, t, d) : b(i, t - a.dimension(1), d);
    return out;
  };
  for (const std::int64_t q : {4, 1, 1, 3}) {
    const HostState<3> x = indexer_input(7, kBatch, len, q, index_dim);
    all = append(all, x);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      IO::update(cache, tokens(0, kBatch, kHeads, len, q, kKeyDim), tokens(1, kBatch, kHeads, len, q, kValueDim), layer,
                 rec, "indexed.kv" + std::to_string(layer));
    }
    const HostState<3> dyn = index(0, x, "indexed.dynamic");
    CHECK(same(dyn, all, "dynamic indexer keys: every key so far"));
    const HostState<3> fixed = index(1, x, "indexed.static");
    CHECK(fixed.dimension(1) == slots);
    len += q;
  }
  // Batch operations and crop act on the indexer keys of the dynamic layer too.
  cache.reorder_cache({1, 0});
  const HostState<3> held =
      to_float(B::template fetch_state<3>(cache.visit_layer(0, [](const auto& l) -> typename S::state_view_type {
        if constexpr (requires { l.indexer_keys(); })
          return l.indexer_keys();
        else
          return {};
      })));
  rec.tensor("indexed.after_reorder", held);
  CHECK(held.dimension(1) == len);
  CHECK(held(0, 2, 3) == all(1, 2, 3));
  cache.visit_layer(0, [&](const auto& l) {
    if constexpr (requires { l.indexer_seq_length(); }) rec.number("indexed.seq", l.indexer_seq_length());
  });
  rec.number("indexed.bytes", cache.bytes());
}

// ---- G. QuantizedLayer: both codecs, the flush schedule, batch operations, crop, reset -----------

// One quantized kind over the decode schedule of a generation. What the layer returns is checked
// against the tokens within `bound` (the codec's error on these small integers) and recorded with
// `tolerance`, how far another storage may round differently (0 for quanto, whose arithmetic is
// bit-identical on host and device; HQQ's refinement calls powf, whose last bit may differ).
template <class B, class Kind>
void quantized_kind(Record& rec, const Kind& kind, const std::string& tag, float bound, float tolerance) {
  using S = typename B::storage;
  using IO = io<B>;
  kvc::Cache<kvc::Layers<Kind>, S> cache(kind);
  Ref all_k = tokens(0, kBatch, kHeads, 0, 0, kKeyDim), all_v = tokens(1, kBatch, kHeads, 0, 0, kValueDim);
  std::int64_t len = 0;
  const auto step = [&](std::int64_t q, const std::string& label) {
    const Ref k = tokens(2, all_k.dimension(0), kHeads, len, q, kKeyDim);
    const Ref v = tokens(3, all_v.dimension(0), kHeads, len, q, kValueDim);
    all_k = concat(all_k, k);
    all_v = concat(all_v, v);
    len += q;
    auto [gk, gv] = IO::update(cache, k, v, 0, rec, tag + "." + label, tolerance);
    CHECK(same(gk, all_k, tag + " keys, " + label, bound));
    CHECK(same(gv, all_v, tag + " values, " + label, bound));
    CHECK(cache.get_seq_length() == len);
    cache.visit_layer(0, [&](const auto& l) {
      if constexpr (requires { l.quantized_tokens(); }) {
        CHECK(l.quantized_tokens() + l.residual_tokens() == len);
        rec.number(tag + ".quantized_tokens", l.quantized_tokens());
        rec.number(tag + ".residual_tokens", l.residual_tokens());
      }
    });
    rec.number(tag + ".bytes", cache.bytes());
  };
  // A prefill (quantized whole, returned as given), decode steps through several flushes
  // (residual_length 4), a multi-token step.
  const std::vector<std::int64_t> steps = {6, 1, 1, 1, 1, 1, 1, 1, 5, 1, 1, 1, 2};
  for (std::size_t i = 0; i < steps.size(); ++i) step(steps[i], "step" + std::to_string(i));

  // Batch operations move the quantized rows with their metadata.
  cache.reorder_cache({1, 0});
  all_k = gather(all_k, {1, 0});
  all_v = gather(all_v, {1, 0});
  step(1, "after_reorder");
  cache.batch_repeat_interleave(2);
  all_k = gather(all_k, {0, 0, 1, 1});
  all_v = gather(all_v, {0, 0, 1, 1});
  step(1, "after_repeat");
  cache.batch_select_indices({3, 0});
  all_k = gather(all_k, {3, 0});
  all_v = gather(all_v, {3, 0});
  step(1, "after_select");

  // A crop past the residual is refused, nothing changes (no cut of the quantized history is exact:
  // docs/rollback.md); a crop within it drops the residual's last tokens.
  const std::int64_t residual = cache.rollback_depth();
  CHECK(residual == 3);
  bool threw = false;
  try {
    cache.crop(-(residual + 1));
  } catch (const kvc::RuntimeError&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(cache.get_seq_length() == len);
  cache.crop(-2);
  len -= 2;
  all_k = slice(all_k, 0, len);
  all_v = slice(all_v, 0, len);
  CHECK(cache.get_seq_length() == len);
  step(2, "after_crop");

  // After reset the next update starts afresh and returns its inputs.
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  rec.number(tag + ".bytes_after_reset", cache.bytes());
  len = 0;
  all_k = tokens(0, kBatch, kHeads, 0, 0, kKeyDim);
  all_v = tokens(1, kBatch, kHeads, 0, 0, kValueDim);
  step(3, "after_reset");
}

template <class B>
void quantized(Record& rec) {
  // keys grouped along head_dim, values along seq; int4, groups of 8, residual_length 4
  quantized_kind<B>(rec, kvc::QuantoQuantizedLayer{4, 0, -1, 8, 4}, "quanto", 2.5f, 0.0f);
  quantized_kind<B>(rec, kvc::HQQQuantizedLayer{4, 1, 0, 8, 4}, "hqq", 4.5f, 4.5f);
  // 3-bit codes run across byte boundaries (a step of up to 60 / 7 on this data)
  quantized_kind<B>(rec, kvc::HQQQuantizedLayer{3, 1, 0, 8, 4}, "hqq3", 9.5f, 9.5f);
}

// A model of two layers (types[0], types[1]) of `heads` query heads on `kv_heads` KV heads of `dim`,
// with a sliding window (for a "sliding_attention" layer), for the paged scenarios and tests.
// A step's keys and values as a pool of KV takes them: as they are for float, as rows of codes
// for row codes (kvc::to_row_codes, or to_kv_codes for a pair), each NVFP4 side with its tensor
// scale from `g`.
template <class KV>
kvc::KV<kvc::HostTensor<KV>> pool_step(const Ref& k, const Ref& v, const kvc::Nvfp4TensorScales& g) {
  if constexpr (std::is_same_v<KV, float>)
    return {k, v};
  else if constexpr (kvc::detail::is_kv_codes<KV>)
    return kvc::to_kv_codes<KV>(k, v, g);
  else if constexpr (KV::tensor_scaled)
    return {kvc::to_row_codes<KV>(k, g.keys), kvc::to_row_codes<KV>(v, g.values)};
  else
    return {kvc::to_row_codes<KV>(k), kvc::to_row_codes<KV>(v)};
}

inline kvc::ModelConfig paged_model(std::vector<std::string> types, std::int64_t kv_heads, std::int64_t heads,
                                    std::int64_t dim, std::int64_t window) {
  kvc::ModelConfig config;
  config.num_hidden_layers = static_cast<std::int64_t>(types.size());
  config.num_attention_heads = heads;
  config.num_key_value_heads = kv_heads;
  config.head_dim = dim;
  config.hidden_size = heads * dim;
  config.sliding_window = window;
  config.layer_types = std::move(types);
  return config;
}

// Uniform values in [-1, 1], of element type H.
template <class H>
kvc::HostTensor<H> random_tensor(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  kvc::HostTensor<H> t(b, h, s, d);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<H>(u(rng));
  return t;
}

// The largest |a - b| over two tensors of one shape.
template <class H>
float largest_difference(const kvc::HostTensor<H>& a, const kvc::HostTensor<H>& b) {
  REQUIRE(a.dimensions() == b.dimensions());
  float worst = 0;
  for (Eigen::Index i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<float>(a.data()[i]) - static_cast<float>(b.data()[i])));
  return worst;
}

// ---- I. attention over a cache's views (the device kernels) ---------------------------------------

// One unit in the last place of E at 16..32, the largest |output| here: how far two computations
// rounded to E from nearly equal floats may land apart.
template <class E>
float output_tolerance() {
  if constexpr (std::is_same_v<E, float>)
    return 1e-4f;
  else
    return static_cast<float>(std::ldexp(1.0, 4 - std::numeric_limits<E>::digits + 1));
}

// Queries of small values, so that the softmax spreads over many keys.
inline Ref queries(int run, std::int64_t batch, std::int64_t heads, std::int64_t t0, std::int64_t q, std::int64_t dim) {
  Ref out = tokens(run, batch, heads, t0, q, dim);
  for (Eigen::Index i = 0; i < out.size(); ++i) out.data()[i] *= 0.004f;
  return out;
}

// A DynamicCache over the storage: prefill, decode steps and a long decode (several splits on a
// device), each attended with GQA (4 query heads on 2 KV heads), full causal, a sliding window, a
// chunk mask and a padded batch row, against kvc::scaled_dot_product_attention over the same keys.
template <class B>
void attention(Record& rec) {
  using E = typename B::element;
  using S = typename B::storage;
  constexpr std::int64_t batch = 2, kv_heads = 2, heads = 4, dim = 16;
  const float tol = output_tolerance<E>();
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, S> cache;
  std::vector<std::uint8_t> padding(static_cast<std::size_t>(batch * 700), 1);
  for (std::int64_t p = 0; p < 5; ++p) padding[static_cast<std::size_t>(700 + p)] = 0;  // row 1: 5 pads in front
  std::int64_t past = 0;
  for (const std::int64_t q : {12, 1, 3, 600, 1}) {
    const Ref k = tokens(40, batch, kv_heads, past, q, dim), v = tokens(41, batch, kv_heads, past, q, dim);
    const kvc::HostTensor<E> hk = cast_to<E>(k), hv = cast_to<E>(v);
    auto&& dk = B::input(hk);
    auto&& dv = B::input(hv);
    const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, 0);
    const auto kv = cache.update(dk, dv, 0);
    if (q == 600) {  // a long prefill is stored, not attended (the host path would be slow)
      past += q;
      continue;
    }
    const kvc::HostTensor<E> keys = B::fetch(kv.keys), values = B::fetch(kv.values);
    const Ref qr = queries(42 + static_cast<int>(q), batch, heads, past, q, dim);
    const kvc::HostTensor<E> hq = cast_to<E>(qr);
    struct variant {
      const char* name;
      std::optional<std::int64_t> window, chunk;
      bool pad;
    };
    for (const variant& m : {variant{"causal", {}, {}, false}, variant{"sliding", 5, {}, false},
                             variant{"chunked", {}, 8, false}, variant{"padded", {}, {}, true}}) {
      kvc::AttentionMask mask{kv_length, kv_offset, past, m.window, true, m.chunk, {}};
      if (m.pad) mask.key_padding_mask = std::span<const std::uint8_t>(padding);
      const std::string label = "attention.q" + std::to_string(q) + "." + m.name;
      const Ref got = B::attention(qr, kv.keys, kv.values, mask, 0.25, 7);
      const Ref want = to_float(kvc::scaled_dot_product_attention(kvc::HostStorage<E>::input_view(hq),
                                                                  kvc::HostStorage<E>::input_view(keys),
                                                                  kvc::HostStorage<E>::input_view(values), mask, 0.25));
      CHECK(same(got, want, label, tol));
      rec.tensor(label, got, tol);
    }
    past += q;
  }
  rec.number("attention.tokens", past);
}

// ---- J. the paged cache over the storage: writes of every layer, paged attention -----------------

// Three requests through steps of prefill chunks and decodes over a full and a sliding layer,
// written with write_all_layers and attended with the kernels' steps, against a
// PagedCache<HostStorage> written layer by layer with update and read by kvc::paged_attention.
template <class B>
void paged(Record& rec) {
  using E = typename B::element;
  using S = typename B::storage;
  constexpr std::int64_t kv_heads = 2, heads = 4, dim = 16, window = 6;
  const kvc::ModelConfig config = paged_model({"full_attention", "sliding_attention"}, kv_heads, heads, dim, window);
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 48;
  kvc::PagedCache<S> cache(config, cb);
  kvc::PagedCache<kvc::HostStorage<E>> reference(config, cb);
  const std::vector<std::string> ids = {"a", "b", "c"};
  std::vector<std::int64_t> past(3, 0), held(3, 0);
  const std::vector<std::vector<std::int64_t>> plan = {{5, 9, 3}, {1, 1, 7}, {1, 0, 1}, {2, 1, 1}};
  const float tol = output_tolerance<E>();
  int run = 50;
  for (const auto& sizes : plan) {
    std::vector<std::string> reqs;
    std::vector<std::int64_t> cu = {0}, pasts;
    kvc::PagedIndices none(2), writes(2), ref_writes(2);
    for (std::size_t r = 0; r < ids.size(); ++r) {
      if (sizes[r] == 0) continue;
      const std::int64_t need = (past[r] + sizes[r] + cb.block_size - 1) / cb.block_size - held[r];
      if (need > 0) {
        REQUIRE(cache.allocate_blocks(need, ids[r], held[r]).has_value());
        REQUIRE(reference.allocate_blocks(need, ids[r], held[r]).has_value());
        held[r] += need;
      }
      cache.extend_read_and_write_indices(ids[r], past[r], sizes[r], nullptr, writes);
      reference.extend_read_and_write_indices(ids[r], past[r], sizes[r], nullptr, ref_writes);
      reqs.push_back(ids[r]);
      pasts.push_back(past[r]);
      cu.push_back(cu.back() + sizes[r]);
    }
    CHECK(writes == ref_writes);
    const kvc::PagedAttentionStep step{reqs, cu, pasts};
    const std::int64_t T = cu.back();
    std::vector<kvc::HostTensor<E>> hk, hv;
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      hk.push_back(cast_to<E>(tokens(run++, 1, kv_heads, 0, T, dim)));
      hv.push_back(cast_to<E>(tokens(run++, 1, kv_heads, 0, T, dim)));
    }
    using Input = std::remove_cvref_t<decltype(B::input(hk[0]))>;
    std::vector<Input> dk, dv;  // what the views below point into
    std::vector<typename S::view_type> kviews, vviews;
    for (std::size_t l = 0; l < 2; ++l) {
      dk.push_back(B::input(hk[l]));
      dv.push_back(B::input(hv[l]));
    }
    for (std::size_t l = 0; l < 2; ++l) {
      kviews.push_back(S::input_view(dk[l]));
      vviews.push_back(S::input_view(dv[l]));
    }
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto l = static_cast<std::size_t>(layer);
      const Ref q = queries(run++, 1, heads, 0, T, dim);
      const kvc::HostTensor<E> hq = cast_to<E>(q);
      const std::string label = "paged.T" + std::to_string(T) + ".layer" + std::to_string(layer);
      const Ref got = B::paged_attention(cache, layer, step, q, kviews[l], vviews[l], 3);
      const Ref want = to_float(kvc::paged_attention(reference, layer, step, kvc::HostStorage<E>::input_view(hq),
                                                     kvc::HostStorage<E>::input_view(hk[l]),
                                                     kvc::HostStorage<E>::input_view(hv[l])));
      CHECK(same(got, want, label, tol));
      rec.tensor(label, got, tol);
      reference.update(kvc::HostStorage<E>::input_view(hk[l]), kvc::HostStorage<E>::input_view(hv[l]), layer, none,
                       ref_writes);
    }
    cache.write_all_layers(kviews, vviews, writes);
    for (std::size_t r = 0, i = 0; r < ids.size(); ++r)
      if (sizes[r] > 0) past[r] += cu[i + 1] - cu[i], ++i;
  }
  // The pools after the writes, every block (not the trash rows past them), exactly.
  const std::int64_t rows = (cb.num_blocks.value() + 2) * cb.block_size, pages = cache.num_pages();
  for (std::int64_t j = 0; j < cache.group_size(); ++j) {
    const std::array<std::int64_t, 4> e{1, kv_heads, pages, dim}, st{kv_heads * rows * dim, rows * dim, dim, 1};
    const Ref got = to_float(B::fetch(S::make_view(cache.key_pool(j), e, st)));
    const Ref want = to_float(kvc::HostStorage<E>::make_view(reference.key_pool(j), e, st).to_tensor());
    CHECK(same(got, want, "paged.key_pool" + std::to_string(j)));
    rec.tensor("paged.key_pool" + std::to_string(j), got);
    const Ref vgot = to_float(B::fetch(S::make_view(cache.value_pool(j), e, st)));
    const Ref vwant = to_float(kvc::HostStorage<E>::make_view(reference.value_pool(j), e, st).to_tensor());
    CHECK(same(vgot, vwant, "paged.value_pool" + std::to_string(j)));
    rec.tensor("paged.value_pool" + std::to_string(j), vgot);
  }
  rec.number("paged.blocks_free", cache.manager().num_free_blocks());
}

// Every scenario, in order, into one record each.
template <class B>
std::vector<std::pair<const char*, Record>> run_all() {
  std::vector<std::pair<const char*, Record>> out;
  const auto run = [&](const char* name, void (*scenario)(Record&)) {
    Record r;
    INFO("scenario ", name);
    scenario(r);
    out.emplace_back(name, std::move(r));
  };
  run("dynamic_append_growth", &dynamic_append_growth<B>);
  run("static_in_place", &static_in_place<B>);
  run("static_sliding", &static_sliding<B>);
  run("dynamic_sliding", &dynamic_sliding<B>);
  run("batch_operations", &batch_operations<B>);
  run("linear_states", &linear_states<B>);
  run("indexed", &indexed<B>);
  run("quantized", &quantized<B>);
  run("attention", &attention<B>);
  run("paged", &paged<B>);
  return out;
}

// Whether two records are identical: same labels, numbers and elements.
inline bool same_record(const Record& a, const Record& b, const std::string& what) {
  if (a.labels != b.labels) {
    MESSAGE(what << ": the scenarios observed different sequences of values");
    return false;
  }
  if (a.numbers != b.numbers) {
    for (std::size_t i = 0; i < std::min(a.numbers.size(), b.numbers.size()); ++i)
      if (a.numbers[i] != b.numbers[i]) {
        MESSAGE(what << ": number " << i << " differs: " << a.numbers[i] << " vs " << b.numbers[i]);
        break;
      }
    return false;
  }
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    const auto& x = a.tensors[t];
    const auto& y = b.tensors[t];
    const float tolerance = std::max(a.tolerances[t], b.tolerances[t]);
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!within(x[i], y[i], tolerance)) {
        MESSAGE(what << ": tensor " << t << " element " << i << " differs: " << x[i] << " vs " << y[i]);
        return false;
      }
  }
  return true;
}

}  // namespace kvc_conformance

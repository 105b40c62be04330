// One input convention: every function that takes queries, keys or values takes a HostTensor, an
// Eigen::TensorMap of one and a TensorView alike (kvc::tensor_input), and gives the same result
// bit for bit whichever it is given. Each function is called every way here; the diagnostic for
// anything else is tests/compile_fail/input_not_a_tensor.cpp.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <kvc/caches.hpp>
#include <kvc/fp8_attention.hpp>
#include <kvc/paged.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {

using Map = Eigen::TensorMap<kvc::HostTensor<float>>;
using ConstMap = Eigen::TensorMap<const kvc::HostTensor<float>>;

// The concept, its traits and input_view, at compile time.
static_assert(kvc::tensor_input<kvc::HostTensor<float>>);
static_assert(kvc::tensor_input<const kvc::HostTensor<float>&>);
static_assert(kvc::tensor_input<Map> && kvc::tensor_input<ConstMap>);
static_assert(kvc::tensor_input<kvc::TensorView<float>> && kvc::tensor_input<kvc::DeviceTensorView<float>>);
static_assert(!kvc::tensor_input<Eigen::Tensor<float, 4>>);  // column-major
static_assert(!kvc::tensor_input<Eigen::Tensor<float, 3, Eigen::RowMajor>>);
static_assert(!kvc::tensor_input<std::vector<float>> && !kvc::tensor_input<float*>);
static_assert(!kvc::tensor_input<kvc::StateView<float>>);  // a state, not keys
static_assert(std::is_same_v<kvc::input_element_t<ConstMap>, float>);
static_assert(kvc::input_space_v<kvc::HostTensor<double>> == kvc::memory_space::host);
static_assert(kvc::input_space_v<kvc::DeviceTensorView<float>> == kvc::memory_space::device);
static_assert(std::is_same_v<decltype(kvc::input_view(std::declval<Map>())), kvc::TensorView<float>>);
// input_view of a temporary tensor that owns its memory would dangle: refused. Of a temporary map
// or view (memory held elsewhere) it is fine.
template <class X>
concept viewable = requires(X&& x) { kvc::input_view(std::forward<X>(x)); };
static_assert(!viewable<kvc::HostTensor<float>> && viewable<kvc::HostTensor<float>&>);
static_assert(viewable<Map> && viewable<kvc::TensorView<float>>);
static_assert(kvc::HostStorage<float>::accepts_input<Map> && !kvc::HostStorage<float>::accepts_input<Map*>);
static_assert(!kvc::HostStorage<float>::accepts_input<kvc::HostTensor<double>>);
static_assert(!kvc::HostStorage<float>::accepts_input<kvc::DeviceTensorView<float>>);

template <class T>
bool same_bits(const kvc::HostTensor<T>& a, const kvc::HostTensor<T>& b) {
  return a.dimensions() == b.dimensions() &&
         std::equal(a.data(), a.data() + a.size(), b.data(),
                    [](const T& x, const T& y) { return std::memcmp(&x, &y, sizeof(T)) == 0; });
}
template <class V>
bool same_view(const V& a, const V& b) {
  return same_bits(a.to_tensor(), b.to_tensor());
}

// A view of t's elements copied into `store` with batch and head strides larger than dense ones
// (gaps between the [seq, head_dim] blocks): built by hand, not by input_view, so that a wrong
// conversion of the other forms cannot hide behind the same mistake here.
kvc::TensorView<float> padded(const kvc::HostTensor<float>& t, std::vector<float>& store) {
  const std::array<std::int64_t, 4> e{t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
  const std::int64_t head = e[2] * e[3] + 5, batch = e[1] * head + 3;
  store.assign(static_cast<std::size_t>(e[0] * batch), -1.0f);
  for (std::int64_t b = 0; b < e[0]; ++b)
    for (std::int64_t h = 0; h < e[1]; ++h)
      for (std::int64_t s = 0; s < e[2]; ++s)
        for (std::int64_t d = 0; d < e[3]; ++d)
          store[static_cast<std::size_t>(b * batch + h * head + s * e[3] + d)] = t(b, h, s, d);
  return {store.data(), e, {batch, head, e[3], 1}};
}

// One step's tensors, and the three ways of passing each.
struct step_inputs {
  kvc::HostTensor<float> q, k, v;
  step_inputs(std::int64_t batch, std::int64_t heads, std::int64_t kv_heads, std::int64_t tokens, std::int64_t d,
              std::mt19937& rng)
      : q(kvc_test::random_tensor<float>(batch, heads, tokens, d, rng)),
        k(kvc_test::random_tensor<float>(batch, kv_heads, tokens, d, rng)),
        v(kvc_test::random_tensor<float>(batch, kv_heads, tokens, d, rng)) {}
  static Map map(kvc::HostTensor<float>& t) { return Map(t.data(), t.dimensions()); }
  static ConstMap cmap(const kvc::HostTensor<float>& t) { return ConstMap(t.data(), t.dimensions()); }
};

}  // namespace

TEST_CASE("kvc::input_view: the input's memory, extents and strides, no copy") {
  std::mt19937 rng(1);
  step_inputs x(1, 2, 2, 3, 4, rng);
  const kvc::TensorView<float> from_tensor = kvc::input_view(x.k);
  const kvc::TensorView<float> from_map = kvc::input_view(step_inputs::map(x.k));
  const kvc::TensorView<float> from_view = kvc::input_view(from_map);
  for (const auto& view : {from_tensor, from_map, from_view}) {
    CHECK(view.data() == x.k.data());
    CHECK(view.extents == std::array<std::int64_t, 4>{1, 2, 3, 4});
    CHECK(view.strides == std::array<std::int64_t, 4>{24, 12, 4, 1});
  }
}

TEST_CASE("Cache::update, attend and scaled_dot_product_attention take every input form alike") {
  std::mt19937 rng(2);
  kvc::DynamicCache<float> a, b, c;
  kvc::HostTensor<float> out_b, out_c;
  for (const std::int64_t tokens : {5, 1, 1}) {
    step_inputs x(2, 4, 2, tokens, 8, rng);
    const kvc::AttendOptions opts{.sliding_window = 4};
    std::vector<float> sq, sk, sv;
    const auto want = kvc::attend(a, 0, x.q, x.k, x.v, opts);
    const auto by_view = kvc::attend(b, 0, padded(x.q, sq), padded(x.k, sk), padded(x.v, sv), opts);
    kvc::attend(c, 0, step_inputs::cmap(x.q), step_inputs::map(x.k), kvc::input_view(x.v), out_c, opts);
    CHECK(same_bits(want, by_view));
    CHECK(same_bits(want, out_c));
    // Each layer holds the same; an update of layer 1 by tensor and by view returns the same.
    const auto [ka, va] = a.update(x.k, x.v, 1);
    const auto [kb, vb] = b.update(padded(x.k, sk), step_inputs::cmap(x.v), 1);
    CHECK(same_view(ka, kb));
    CHECK(same_view(va, vb));
    // scaled_dot_product_attention over what layer 1 holds: tensors, views, maps, mixed.
    const kvc::AttentionMask mask{ka.extent(2), 0, a.get_seq_length(1) - tokens};
    const kvc::HostTensor<float> held_k = ka.to_tensor(), held_v = va.to_tensor();
    const auto s1 = kvc::scaled_dot_product_attention(x.q, held_k, held_v, mask);
    std::vector<float> sheld;
    const auto s2 = kvc::scaled_dot_product_attention(padded(x.q, sq), ka, padded(held_v, sheld), mask);
    const auto s3 =
        kvc::scaled_dot_product_attention(step_inputs::cmap(x.q), held_k, vb, mask, kvc::AttentionContext{});
    kvc::scaled_dot_product_attention(x.q, kb, step_inputs::cmap(held_v), mask, out_b);
    CHECK(same_bits(s1, s2));
    CHECK(same_bits(s1, s3));
    CHECK(same_bits(s1, out_b));
  }
  CHECK(a.get_seq_length(0) == 7);
  CHECK(b.get_seq_length(0) == 7);
  CHECK(c.get_seq_length(0) == 7);
}

TEST_CASE("attend through an AnyCache takes every input form alike") {
  std::mt19937 rng(7);
  kvc::AnyCache a = kvc::DynamicCache<float>(), b = kvc::DynamicCache<float>();
  for (const std::int64_t tokens : {4, 1}) {
    step_inputs x(1, 4, 2, tokens, 8, rng);
    std::vector<float> sk;
    const auto want = kvc::attend(a, 0, x.q, x.k, x.v);
    const auto got = kvc::attend(b, 0, step_inputs::cmap(x.q), padded(x.k, sk), kvc::input_view(x.v));
    CHECK(same_bits(want, got));
  }
  CHECK(b.get_seq_length(0) == 5);
}

TEST_CASE("attend_quantized takes every input form alike") {
  std::mt19937 rng(3);
  const kvc::QuantoQuantizedLayer kind{.nbits = 4, .q_group_size = 8, .residual_length = 3};
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  Cache a(kind), b(kind), c(kind);
  kvc::HostTensor<float> out_c;
  for (const std::int64_t tokens : {6, 1, 1, 1, 1}) {
    step_inputs x(1, 4, 2, tokens, 8, rng);
    const auto want = kvc::attend_quantized(a, 0, x.q, x.k, x.v);
    std::vector<float> sk;
    const auto by_view = kvc::attend_quantized(b, 0, kvc::input_view(x.q), padded(x.k, sk), kvc::input_view(x.v));
    kvc::attend_quantized(c, 0, step_inputs::cmap(x.q), x.k, step_inputs::map(x.v), out_c);
    CHECK(same_bits(want, by_view));
    CHECK(same_bits(want, out_c));
  }
  CHECK(a.get_seq_length(0) == 10);
  CHECK(c.get_seq_length(0) == 10);
}

TEST_CASE("attend_fp8, fp8_scales_for and to_fp8 take every input form alike") {
  std::mt19937 rng(4);
  kvc::DynamicCache<kvc::float8_e4m3> a, b;
  for (const std::int64_t tokens : {4, 1}) {
    step_inputs x(1, 2, 2, tokens, 8, rng);
    const kvc::Fp8Scales scales = kvc::fp8_scales_for<kvc::float8_e4m3>(x.k, x.v, kvc::Fp8ScaleGranularity::per_head);
    const kvc::Fp8Scales by_view = kvc::fp8_scales_for<kvc::float8_e4m3>(kvc::input_view(x.k), step_inputs::cmap(x.v),
                                                                         kvc::Fp8ScaleGranularity::per_head);
    CHECK(scales.keys == by_view.keys);
    CHECK(scales.values == by_view.values);
    std::vector<float> sk;
    CHECK(same_bits(kvc::to_fp8<kvc::float8_e4m3>(x.k, scales.keys),
                    kvc::to_fp8<kvc::float8_e4m3>(padded(x.k, sk), scales.keys)));
    CHECK(same_bits(kvc::to_fp8<kvc::float8_e4m3>(x.v, scales.values),
                    kvc::to_fp8<kvc::float8_e4m3>(step_inputs::map(x.v), scales.values)));
    const auto want = kvc::attend_fp8(a, 0, x.q, x.k, x.v, scales);
    const auto got = kvc::attend_fp8(b, 0, kvc::input_view(x.q), step_inputs::map(x.k), kvc::input_view(x.v), scales);
    CHECK(same_bits(want, got));
  }
  CHECK(b.get_seq_length(0) == 5);
}

namespace {

kvc::ModelConfig paged_model() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.hidden_size = 32;
  return c;
}

kvc::ContinuousBatchingConfig paged_blocks() {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  return cb;
}

// Two requests' steps through a PagedCache<HostStorage<Pool>>: paged_attention, then the update,
// with `pass` choosing how each tensor is given. Returns every output, in order.
template <class Pool, class Pass>
std::vector<kvc::HostTensor<float>> paged_run(Pass pass) {
  constexpr bool fp8 = kvc::is_float8_v<Pool>;
  kvc::PagedCache<kvc::HostStorage<Pool>> cache(paged_model(), paged_blocks());
  std::mt19937 rng(5);
  const std::vector<std::string> reqs = {"a", "b"};
  std::vector<std::int64_t> pasts = {0, 0};
  std::vector<kvc::HostTensor<float>> outs;
  for (const std::int64_t q : {5, 1, 1}) {
    for (std::size_t r = 0; r < reqs.size(); ++r) {
      const std::int64_t have = cache.blocks_in_use(reqs[r]), need = (pasts[r] + q + 3) / 4 - have;
      if (need > 0) (void)cache.allocate_blocks(need, reqs[r], have).value();
    }
    kvc::PagedIndices reads(static_cast<std::size_t>(cache.num_groups())), writes(reads.size());
    for (std::size_t r = 0; r < reqs.size(); ++r)
      cache.extend_read_and_write_indices(reqs[r], pasts[r], q, &reads, writes);
    const std::vector<std::int64_t> cu = {0, q, 2 * q};
    const kvc::PagedAttentionStep step{reqs, cu, pasts};
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      step_inputs x(1, 4, 2, 2 * q, 8, rng);
      if constexpr (fp8) {
        const kvc::Fp8Scales scales{{0.5f, 0.25f}, {0.125f, 1.0f}};
        kvc::HostTensor<Pool> k8 = kvc::to_fp8<Pool>(x.k, scales.keys), v8 = kvc::to_fp8<Pool>(x.v, scales.values);
        outs.push_back(kvc::paged_attention(cache, layer, step, pass(x.q), pass(k8), pass(v8), scales));
        kvc::HostTensor<float> into;
        kvc::paged_attention(cache, layer, step, pass(x.q), pass(k8), pass(v8), scales, into);
        outs.push_back(into);
        const auto kv = cache.update(pass(k8), pass(v8), layer, reads, writes);
        outs.push_back(kvc::HostTensor<float>(kv.keys.to_tensor().template cast<float>()));
      } else {
        outs.push_back(kvc::paged_attention(cache, layer, step, pass(x.q), pass(x.k), pass(x.v)));
        kvc::HostTensor<float> into;
        kvc::paged_attention(cache, layer, step, pass(x.q), pass(x.k), pass(x.v), into);
        outs.push_back(into);
        const auto kv = cache.update(pass(x.k), pass(x.v), layer, reads, writes);
        outs.push_back(kv.keys.to_tensor());
      }
    }
    for (std::size_t r = 0; r < reqs.size(); ++r) pasts[r] += q;
  }
  return outs;
}

}  // namespace

TEST_CASE("PagedCache::update and paged_attention take every input form alike") {
  const auto as_is = [](const auto& t) -> const auto& { return t; };
  const auto as_view = [](const auto& t) { return kvc::input_view(t); };
  const auto as_map = [](const auto& t) {
    using T = typename std::remove_cvref_t<decltype(t)>::Scalar;
    return Eigen::TensorMap<const kvc::HostTensor<T>>(t.data(), t.dimensions());
  };
  const auto want = paged_run<float>(as_is);
  REQUIRE(want.size() == 18);
  for (const auto& got : {paged_run<float>(as_view), paged_run<float>(as_map)}) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(same_bits(want[i], got[i]));
  }
  const auto want8 = paged_run<kvc::float8_e5m2>(as_is);
  REQUIRE(want8.size() == 18);
  for (const auto& got8 : {paged_run<kvc::float8_e5m2>(as_view), paged_run<kvc::float8_e5m2>(as_map)}) {
    REQUIRE(got8.size() == want8.size());
    for (std::size_t i = 0; i < want8.size(); ++i) CHECK(same_bits(want8[i], got8[i]));
  }
}

TEST_CASE("PagedBatchCache::update and AnyCache::update take every input form alike") {
  std::mt19937 rng(6);
  kvc::ContinuousBatchingConfig cb = paged_blocks();
  kvc::PagedBatchCache<kvc::HostStorage<float>> a(paged_model(), cb), b(paged_model(), cb);
  kvc::AnyCache c = kvc::DynamicCache<float>(), d = kvc::DynamicCache<float>();
  for (const std::int64_t tokens : {3, 1}) {
    step_inputs x(2, 4, 2, tokens, 8, rng);
    const auto [ka, va] = a.update(x.k, x.v, 0);
    const auto [kb, vb] = b.update(kvc::input_view(x.k), step_inputs::cmap(x.v), 0);
    CHECK(same_view(ka, kb));
    CHECK(same_view(va, vb));
    const auto [kc, vc] = c.update(x.k, step_inputs::map(x.v), 0);
    const auto [kd, vd] = d.update(kvc::input_view(x.k), kvc::input_view(x.v), 0);
    CHECK(same_view(kc, kd));
    CHECK(same_view(vc, vd));
  }
  CHECK(b.get_seq_length(0) == 4);
  CHECK(d.get_seq_length(0) == 4);
}

// The storage conformance scenarios (conformance.hpp) over CudaStorage<float>, <__half> and
// <__nv_bfloat16>, each compared element by element with the same scenario over HostStorage of
// the matching host type; plus the device-only parts: the copy kernels, transfers, views read in a
// kernel, CUDA errors. main() (cuda_main.cpp) exits 77, "skipped", when there is no CUDA device.
#include <kvc/cuda.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <kvc/quantized_cache.hpp>

#include "conformance.hpp"

namespace kc = kvc_conformance;

// ---- compile-time conformance -------------------------------------------------------------------

static_assert(kvc::concepts::StoragePolicy<kvc::CudaStorage<float>>);
static_assert(kvc::concepts::supports_its_element_type<kvc::CudaStorage<__half>>);
static_assert(kvc::concepts::supports_its_element_type<kvc::CudaStorage<__nv_bfloat16>>);
static_assert(!kvc::concepts::supports_its_element_type<kvc::CudaStorage<double>>);
static_assert(kvc::CudaStorage<float>::space == kvc::memory_space::device);
static_assert(std::is_trivially_copyable_v<kvc::DeviceTensorView<__half>>);
static_assert(std::is_trivially_copyable_v<kvc::DeviceStateView<__nv_bfloat16>>);
static_assert(std::is_trivially_copyable_v<kvc::KV<kvc::DeviceTensorView<float>>>);
// Transfers are explicit: device storage takes device data only, host storage host data only.
// (DeviceTensorView<float> itself is checked by updating with one below: nvcc 13's front end
// writes `DevF::accepts_input<DeviceTensorView<float>>`, already instantiated by the concept check,
// to the host compiler as `DevF::accepts_input<>`.)
using DevF = kvc::CudaStorage<float>;
using DevH = kvc::CudaStorage<__half>;
using HostF = kvc::HostStorage<float>;
static_assert(DevF::accepts_input<kvc::DeviceTensor<float>>);
static_assert(!DevF::accepts_input<kvc::HostTensor<float>>);
static_assert(!DevH::accepts_input<kvc::DeviceTensor<float>>);
static_assert(!HostF::accepts_input<kvc::DeviceTensorView<float>>);
static_assert(DevF::accepts_state_input<kvc::DeviceStateView<float>>);
static_assert(!DevF::accepts_state_input<kvc::DeviceTensorView<float>>);
// Device caches are not host caches: AnyCache (TensorView<T> only) does not take them.
static_assert(!std::is_same_v<kvc::CudaStorage<float>::view_type, kvc::TensorView<float>>);

// Every member of the caches the docs name, over device memory.
template class kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::CudaStorage<float>>;
template class kvc::Cache<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer, kvc::DynamicSlidingWindowLayer,
                                      kvc::LinearAttentionLayer>,
                          kvc::CudaStorage<__half>>;
template class kvc::Cache<kvc::ConfiguredDynamicLayers, kvc::CudaStorage<__nv_bfloat16>>;
template class kvc::Cache<kvc::StaticCacheLayers, kvc::CudaStorage<float>>;
template class kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer, kvc::StaticIndexedLayer>, kvc::CudaStorage<__half>>;
// Quantized layers keep their codes on the device and run the codecs as kernels.
template class kvc::QuantizedCache<__half, kvc::CudaStorage<__half>>;
template class kvc::Cache<kvc::Layers<kvc::HQQQuantizedLayer>, kvc::CudaStorage<__nv_bfloat16>>;
static_assert(std::is_same_v<kvc::detail::quantized_tensor_t<kvc::CudaStorage<__half>, __half>,
                             kvc::detail::device_quantized_tensor<__half, kvc::DefaultCudaStream>>);
static_assert(std::is_same_v<kvc::detail::quant_meta_t<__nv_bfloat16>, __nv_bfloat16>);
// The paged cache over device memory: every member (pools, swap pool, forks, offload) compiles.
template class kvc::PagedCache<kvc::CudaStorage<__half>>;
template class kvc::PagedCache<kvc::CudaStorage<kvc::float8_e4m3>>;
template class kvc::PagedCache<kvc::CudaStorage<kvc::kv_codes<kvc::int8_row, kvc::nvfp4_row>>>;
static_assert(kvc::concepts::supports_its_element_type<kvc::CudaStorage<kvc::float8_e5m2>>);

namespace {

// ---- the CUDA backend ---------------------------------------------------------------------------

template <class T>
struct CudaBackend {
  using storage = kvc::CudaStorage<T>;
  using element = kvc::detail::host_element_t<T>;
  static kvc::DeviceTensor<T> input(const kvc::HostTensor<element>& t) { return kvc::to_device(t); }
  template <int N>
  static kvc::DeviceTensor<T> state_input(const Eigen::Tensor<element, N, Eigen::RowMajor>& t) {
    return kvc::to_device(t);
  }
  static kvc::HostTensor<element> fetch(const kvc::DeviceTensorView<T>& v) { return kvc::to_host(v); }
  // Attention by the device kernels (they choose their own split; `chunk` is the host path's).
  static kc::Ref attention(const kc::Ref& q, const kvc::DeviceTensorView<T>& k, const kvc::DeviceTensorView<T>& v,
                           const kvc::AttentionMask& mask, double scale, std::int64_t) {
    const auto dq = kvc::to_device(kc::cast_to<element>(q));
    return kc::to_float(kvc::to_host(kvc::scaled_dot_product_attention(dq, k, v, mask, scale).view()));
  }
  template <class Cache>
  static kc::Ref paged_attention(const Cache& cache, std::int64_t layer, const kvc::PagedAttentionStep& step,
                                 const kc::Ref& q, const kvc::DeviceTensorView<T>& k, const kvc::DeviceTensorView<T>& v,
                                 std::int64_t) {
    const auto dq = kvc::to_device(kc::cast_to<element>(q));
    return kc::to_float(kvc::to_host(kvc::paged_attention(cache, layer, step, dq, k, v).view()));  // (a DeviceTensor)
  }
  template <int N>
  static Eigen::Tensor<element, N, Eigen::RowMajor> fetch_state(const kvc::DeviceStateView<T>& v) {
    return kvc::to_host<N>(v);
  }
};

template <class T>
void device_matches_host() {
  using H = kvc::detail::host_element_t<T>;
  const auto host = kc::run_all<kc::HostBackend<H>>();
  const auto device = kc::run_all<CudaBackend<T>>();
  REQUIRE(host.size() == device.size());
  for (std::size_t i = 0; i < host.size(); ++i) {
    INFO("scenario " << host[i].first);
    CHECK(kc::same_record(device[i].second, host[i].second, host[i].first));
  }
}

}  // namespace

TEST_CASE("conformance: CudaStorage<float> matches HostStorage<float>") { device_matches_host<float>(); }
TEST_CASE("conformance: CudaStorage<__half> matches HostStorage<Eigen::half>") { device_matches_host<__half>(); }
TEST_CASE("conformance: CudaStorage<__nv_bfloat16> matches HostStorage<Eigen::bfloat16>") {
  device_matches_host<__nv_bfloat16>();
}

// ---- the copy kernels against HostStorage's ------------------------------------------------------

namespace {
template <class T>
void copy_kernels_match_host() {
  using H = kvc::detail::host_element_t<T>;
  using DS = kvc::CudaStorage<T>;
  using HS = kvc::HostStorage<H>;
  std::mt19937 rng(1234);
  struct Case {
    std::int64_t width, height, spitch, dpitch, src_offset, dst_offset;
  };
  // aligned (16-byte kernel), unaligned offsets and pitches (cudaMemcpy2DAsync), one row,
  // contiguous, many narrow rows (more than one grid row of blocks)
  const std::vector<Case> cases = {{64, 3, 64, 128, 0, 0}, {8, 40, 24, 16, 8, 0},  {5, 7, 9, 11, 1, 3},
                                   {1000, 1, 0, 0, 0, 0},  {32, 16, 32, 32, 0, 0}, {8, 70000, 8, 16, 0, 8},
                                   {0, 5, 4, 4, 0, 0},     {3, 1, 0, 0, 1, 1}};
  for (const Case& c : cases) {
    INFO("width " << c.width << " height " << c.height << " pitches " << c.spitch << "/" << c.dpitch << " offsets "
                  << c.src_offset << "/" << c.dst_offset);
    const std::int64_t sp = std::max(c.spitch, c.width), dp = std::max(c.dpitch, c.width);
    const std::int64_t n_src = c.src_offset + sp * c.height, n_dst = c.dst_offset + dp * c.height;
    std::vector<H> src(static_cast<std::size_t>(n_src)), dst(static_cast<std::size_t>(n_dst));
    for (auto& x : src) x = static_cast<H>(static_cast<float>(static_cast<int>(rng() % 200) - 100));
    for (auto& x : dst) x = static_cast<H>(static_cast<float>(static_cast<int>(rng() % 200) - 100));
    typename DS::buffer_type dsrc(n_src), ddst(n_dst);
    REQUIRE(cudaMemcpy(dsrc.data(), src.data(), sizeof(H) * src.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(ddst.data(), dst.data(), sizeof(H) * dst.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    DS::copy_2d(ddst.data() + c.dst_offset, dp, dsrc.data() + c.src_offset, sp, c.width, c.height);
    HS::copy_2d(dst.data() + c.dst_offset, dp, src.data() + c.src_offset, sp, c.width, c.height);
    std::vector<H> got(dst.size());
    REQUIRE(cudaMemcpy(got.data(), ddst.data(), sizeof(H) * got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(std::memcmp(got.data(), dst.data(), sizeof(H) * got.size()) == 0);
    // and zero a strided block
    DS::zero_2d(ddst.data() + c.dst_offset, dp, c.width, c.height);
    HS::zero_2d(dst.data() + c.dst_offset, dp, c.width, c.height);
    REQUIRE(cudaMemcpy(got.data(), ddst.data(), sizeof(H) * got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(std::memcmp(got.data(), dst.data(), sizeof(H) * got.size()) == 0);
  }
}
}  // namespace

TEST_CASE("CudaStorage::copy_2d and zero_2d do what HostStorage's do") {
  copy_kernels_match_host<float>();
  copy_kernels_match_host<__half>();
  copy_kernels_match_host<__nv_bfloat16>();
}

// ---- transfers and views -------------------------------------------------------------------------

TEST_CASE("to_device and to_host copy bits, Eigen::half <-> __half and Eigen::bfloat16 <-> __nv_bfloat16") {
  kvc::HostTensor<Eigen::bfloat16> h(2, 3, 5, 7);
  for (Eigen::Index i = 0; i < h.size(); ++i) h.data()[i] = Eigen::bfloat16(0.37f * static_cast<float>(i) - 11.f);
  const kvc::DeviceTensor<__nv_bfloat16> d = kvc::to_device(h);
  CHECK(d.rank() == 4);
  CHECK(d.extent(2) == 5);
  const kvc::HostTensor<Eigen::bfloat16> back = kvc::to_host(d.view());
  CHECK(std::memcmp(back.data(), h.data(), sizeof(Eigen::bfloat16) * static_cast<std::size_t>(h.size())) == 0);

  const kvc::DeviceTensor<__nv_bfloat16> copy = d;  // deep
  CHECK(copy.data() != d.data());
  const kvc::HostTensor<Eigen::bfloat16> back2 = kvc::to_host(copy.view());
  CHECK(std::memcmp(back2.data(), h.data(), sizeof(Eigen::bfloat16) * static_cast<std::size_t>(h.size())) == 0);

  Eigen::Tensor<Eigen::half, 2, Eigen::RowMajor> s(3, 4);
  for (Eigen::Index i = 0; i < s.size(); ++i) s.data()[i] = Eigen::half(static_cast<float>(i) / 8.f);
  const kvc::DeviceTensor<__half> ds = kvc::to_device(s);
  CHECK(ds.rank() == 2);
  const auto sback = kvc::to_host<2>(ds.state_view());
  CHECK(std::memcmp(sback.data(), s.data(), sizeof(Eigen::half) * 12) == 0);
  CHECK_THROWS_AS(ds.view(), kvc::ValueError);  // rank 2 has no [b, h, s, d] view
}

namespace {
// Reads a strided view on the device: out[b, h, s, d] = view(b, h, s, d) * 2.
__global__ void twice(kvc::DeviceTensorView<float> view, float* out) {
  const std::int64_t s = threadIdx.x, d = threadIdx.y, b = blockIdx.x, h = blockIdx.y;
  if (s < view.extent(2) && d < view.extent(3))
    out[((b * view.extent(1) + h) * view.extent(2) + s) * view.extent(3) + d] = 2.f * view(b, h, s, d);
}
}  // namespace

TEST_CASE("the views update returns are read by value in a kernel") {
  kvc::DynamicCache<float, kvc::CudaStorage<float>> cache;
  const kc::Ref k = kc::tokens(0, 2, 3, 0, 5, 8);
  const auto dk = kvc::to_device(k);
  const auto [keys, values] = cache.update(dk, dk, 0);
  CHECK(keys.stride(1) == 16 * 8);  // a [capacity, head_dim] block per head: strided view
  // views are inputs too
  const auto again = cache.update(dk.view(), dk.view(), 1);
  CHECK(kc::same(kc::to_float(kvc::to_host(again.keys)), k, "a cache updated from a device view"));
  float* out = nullptr;
  REQUIRE(cudaMalloc(&out, sizeof(float) * static_cast<std::size_t>(keys.size())) == cudaSuccess);
  twice<<<dim3(2, 3), dim3(5, 8)>>>(keys, out);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  std::vector<float> got(static_cast<std::size_t>(keys.size()));
  REQUIRE(cudaMemcpy(got.data(), out, sizeof(float) * got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(out);
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == 2.f * k.data()[i]);
  (void)values;
}

TEST_CASE("the ready-made caches run over device memory") {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.head_dim = 8;
  c.sliding_window = 3;
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  kvc::StaticCache<__half, kvc::CudaStorage<__half>> cache(c, 8);
  auto dyn = kvc::make_dynamic_cache<__nv_bfloat16, kvc::CudaStorage<__nv_bfloat16>>(c);
  for (std::int64_t t = 0; t < 5; ++t) {
    const auto k = kvc::to_device(kc::cast_to<Eigen::half>(kc::tokens(0, 1, 2, t, 1, 8)));
    const auto kb = kvc::to_device(kc::cast_to<Eigen::bfloat16>(kc::tokens(0, 1, 2, t, 1, 8)));
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      cache.update(k, k, layer);
      dyn.update(kb, kb, layer);
    }
  }
  CHECK(cache.get_seq_length(0) == 5);
  CHECK(cache.get_mask_sizes(1, 1) == std::pair<std::int64_t, std::int64_t>{3, 3});
  const auto window = kc::to_float(kvc::to_host(cache.stored(1).keys));
  CHECK(kc::same(window, kc::tokens(0, 1, 2, 2, 3, 8), "static sliding window on the device"));
  const auto held = kc::to_float(kvc::to_host(dyn.stored(1).keys));
  CHECK(kc::same(held, kc::tokens(0, 1, 2, 3, 2, 8), "dynamic sliding window on the device"));
}

// ---- quantized layers at the sizes of a model ----------------------------------------------------------

namespace {
// A QuantizedCache over device memory decodes after a prefill and returns, at every step, what
// the same cache over host memory returns: bit for bit for quanto. HQQ's zero refinement calls
// powf, which may round differently on the device, moving a group's offset by a few ulps (and,
// rarely, a code by one step, or the refinement's last iteration): there at least 99% of the
// elements agree within 1e-4 of the data's range, and none differs by more than two code steps of
// the widest group.
template <class T>
void quantized_cache_matches_host(std::string_view backend) {
  using H = kvc::detail::host_element_t<T>;
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.head_dim = 128;
  const kvc::QuantizedOptions opts{4, backend == "hqq" ? 1 : 0, 0, 64, 16};
  kvc::QuantizedCache<T, kvc::CudaStorage<T>> device(backend, c, opts);
  kvc::QuantizedCache<H> host(backend, c, opts);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  float lo = 0, hi = 0;
  const auto random = [&](std::int64_t q) {
    kvc::HostTensor<H> t(2, 4, q, 128);
    for (std::int64_t i = 0; i < t.size(); ++i) {
      t.data()[i] = static_cast<H>(dist(rng) * (i % 128 < 2 ? 12.f : 1.f));  // two outlier channels
      lo = std::min(lo, static_cast<float>(t.data()[i]));
      hi = std::max(hi, static_cast<float>(t.data()[i]));
    }
    return t;
  };
  std::int64_t exact = 0, close = 0, total = 0;
  float worst = 0;
  for (const std::int64_t q : {300, 1, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 40, 1}) {
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = random(q), v = random(q);
      const auto want = host.update(k, v, layer);
      const auto got = device.update(kvc::to_device(k), kvc::to_device(v), layer);
      const kc::Ref g[] = {kc::to_float(kvc::to_host(got.keys)), kc::to_float(kvc::to_host(got.values))};
      const kc::Ref w[] = {kc::to_float(want.keys.to_tensor()), kc::to_float(want.values.to_tensor())};
      for (int j = 0; j < 2; ++j) {
        REQUIRE(g[j].dimensions() == w[j].dimensions());
        for (Eigen::Index i = 0; i < g[j].size(); ++i) {
          const float d = std::fabs(g[j].data()[i] - w[j].data()[i]);
          exact += d == 0;
          close += d <= 1e-4f * (hi - lo);
          worst = std::max(worst, d);
        }
        total += g[j].size();
      }
    }
    CHECK(device.get_seq_length() == host.get_seq_length());
    CHECK(device.bytes() == host.bytes());
  }
  INFO("backend " << backend << ": " << exact << " of " << total << " elements bit for bit, " << close
                  << " within 1e-4 of the range, worst difference " << worst << " (range " << hi - lo << ")");
  if (backend == "quanto") {
    CHECK(exact == total);
  } else {
    CHECK(close >= total / 100 * 99);
    CHECK(worst <= 2 * (hi - lo) / 15);  // a code flip plus a shifted zero point
  }
}
}  // namespace

TEST_CASE("QuantizedCache over device memory returns what the host's returns (head_dim 128, group 64)") {
  quantized_cache_matches_host<float>("quanto");
  quantized_cache_matches_host<__half>("quanto");
  quantized_cache_matches_host<__nv_bfloat16>("hqq");
  quantized_cache_matches_host<float>("hqq");
}

TEST_CASE("QuantizedCache over device memory refuses rotation") {
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.head_dim = 64;
  for (const bool keys : {true, false}) {
    const kvc::QuantizedOptions opts{.rotate_keys = keys, .rotate_values = !keys};
    using DeviceQuantized = kvc::QuantizedCache<float, kvc::CudaStorage<float>>;
    CHECK_THROWS_WITH_AS(DeviceQuantized("quanto", config, opts),
                         "QuantoQuantizedLayer: rotate_keys and rotate_values need host storage", kvc::ValueError);
  }
}

// The 16-byte dequantization kernel's entry point (public for kvc_bench_cuda) checks its
// preconditions: a compile-time head_dim other than the tensor's, or an output that is not 16-byte
// aligned, is refused before any launch. Groups along seq: the runs whose head_dim division the
// template turns into a shift.
TEST_CASE("device_quantized_tensor::decode_vec refuses what its kernel cannot write") {
  using Q = kvc::detail::device_quantized_tensor<__half, kvc::DefaultCudaStream>;
  const auto encoded = [](std::int64_t dim) {
    kvc::HostTensor<Eigen::half> x(1, 2, 4, dim);
    for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = Eigen::half(static_cast<float>(i % 13) - 6.f);
    const kvc::DeviceTensor<__half> dx = kvc::to_device(x);
    return Q::encode<kvc::QuantoCodec>(4, kvc::detail::quant_grouping::along_seq, 2, dx.data(), 1, 2, 4, dim,
                                       2 * 4 * dim, 4 * dim);
  };
  const Q q = encoded(128), narrow = encoded(64);
  kvc::DeviceTensor<__half> fixed(1, 2, 4, 128), any(1, 2, 4, 128);
  const std::string text =
      "kvc: the 16-byte dequantization kernel needs a 16-byte aligned output, strides and rows of whole 16-byte "
      "words, and its compile-time head_dim equal to the tensor's";
  CHECK_THROWS_WITH_AS(narrow.decode_vec<128>(fixed.data(), 2 * 4 * 64, 4 * 64), text.c_str(), kvc::AssertionError);
  CHECK_THROWS_WITH_AS(q.decode_vec<128>(fixed.data() + 1, 2 * 4 * 128, 4 * 128), text.c_str(), kvc::AssertionError);
  // What decode() launches at head_dim 128 and the run-time kernel write the same bytes.
  q.decode(fixed.data(), 2 * 4 * 128, 4 * 128);
  q.decode_vec<0>(any.data(), 2 * 4 * 128, 4 * 128);
  const kvc::HostTensor<Eigen::half> a = kvc::to_host(fixed.view()), b = kvc::to_host(any.view());
  CHECK(std::memcmp(a.data(), b.data(), sizeof(Eigen::half) * static_cast<std::size_t>(a.size())) == 0);
}

// ---- the example of docs/cuda.md ------------------------------------------------------------------

TEST_CASE("docs/cuda.md: a dynamic cache in device memory") {
  // [snippet:cuda_usage]
  // Half-precision K/V in device memory. Host data goes in and out through explicit copies.
  kvc::DynamicCache<__half, kvc::CudaStorage<__half>> cache;
  kvc::HostTensor<Eigen::half> k(1, 8, 16, 64);  // [batch, kv_heads, seq, head_dim]
  std::fill_n(k.data(), k.size(), Eigen::half(0.5f));
  const kvc::DeviceTensor<__half> dk = kvc::to_device(k);  // Eigen::half -> __half, bit for bit
  auto [keys, values] = cache.update(dk, dk, 0);           // kvc::DeviceTensorView<__half>, device pointers
  // keys/values go to your kernels by value; queue them on the legacy default stream (or any
  // blocking stream) and they see the copy that update queued.
  kvc::HostTensor<Eigen::half> back = kvc::to_host(keys);  // waits for the copy; [1, 8, 16, 64]
  // [/snippet]
  CHECK(back.dimension(2) == 16);
  CHECK(static_cast<float>(back(0, 7, 15, 63)) == 0.5f);
  CHECK(values.stride(1) == 16 * 64);
}

// ---- a storage with a stream of its own (docs/cuda.md, "Streams") --------------------------------

namespace {
cudaStream_t decode_stream = nullptr;  // created by the test below
}  // namespace

// [snippet:cuda_stream]
struct DecodeStream {  // a stream policy: every copy, fill and transfer of the cache is queued here
  static cudaStream_t get() noexcept { return decode_stream; }
};
using DecodeCache = kvc::DynamicCache<float, kvc::CudaStorage<float, DecodeStream>>;
// [/snippet]

TEST_CASE("a CudaStorage queues its work on its own stream") {
  REQUIRE(cudaStreamCreateWithFlags(&decode_stream, cudaStreamNonBlocking) == cudaSuccess);
  {
    DecodeCache cache;
    const kc::Ref k = kc::tokens(0, 2, 3, 0, 20, 8);  // 20 tokens: the layer grows from 16 to 32 slots
    for (std::int64_t t = 0; t < 20; ++t) {
      const auto step = kvc::to_device(kc::slice(k, t, 1), decode_stream);
      cache.update(step, step, 0);
    }
    const DecodeCache copy = cache;  // a deep copy, queued on the same stream
    const auto keys = kc::to_float(kvc::to_host(copy.stored(0).keys, decode_stream));
    CHECK(kc::same(keys, k, "keys appended on a non-blocking stream"));
  }
  REQUIRE(cudaStreamSynchronize(decode_stream) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(decode_stream) == cudaSuccess);
  decode_stream = nullptr;
}

// ---- errors ----------------------------------------------------------------------------------------

TEST_CASE("CUDA errors become kvc::RuntimeError naming the operation and CUDA's message") {
  try {
    kvc::CudaStorage<float>::buffer_type huge(std::int64_t{1} << 50);  // 4 PiB
    FAIL("cudaMalloc of 4 PiB succeeded");
  } catch (const kvc::RuntimeError& e) {
    const std::string what = e.what();
    CHECK(what.find("cudaMalloc") != std::string::npos);
    CHECK(what.find(cudaGetErrorString(cudaErrorMemoryAllocation)) != std::string::npos);
  }
  // the failure is not sticky: the storage keeps working
  kvc::DynamicCache<float, kvc::CudaStorage<float>> cache;
  const auto k = kvc::to_device(kc::tokens(0, 1, 1, 0, 2, 4));
  CHECK(cache.update(k, k, 0).keys.extent(2) == 2);
}

// ---- kvc::OffloadToHost: device layers in pinned host memory, prefetched on their own stream ------

namespace {

using OffDyn = kvc::DynamicCache<float, kvc::CudaStorage<float>, kvc::OffloadToHost<>>;
using RefDyn = kvc::DynamicCache<float, kvc::CudaStorage<float>>;
using HostDyn = kvc::DynamicCache<float>;

// Every layer of three caches holds the same keys and values (stored() brings offloaded layers back).
template <class A, class B, class H>
void same_stored(const A& off, const B& ref, const H& host, const std::string& what) {
  REQUIRE(off.size() == ref.size());
  for (std::int64_t j = 0; j < off.size(); ++j) {
    const auto o = off.stored(j), r = ref.stored(j);
    const auto h = host.stored(j);
    const std::string at = what + ", layer " + std::to_string(j);
    CHECK(kc::same(kvc::to_host(o.keys), kvc::to_host(r.keys), at + " keys (offloaded vs device)"));
    CHECK(kc::same(kvc::to_host(o.values), kvc::to_host(r.values), at + " values (offloaded vs device)"));
    CHECK(kc::same(kvc::to_host(o.keys), h.keys.to_tensor(), at + " keys (offloaded vs host)"));
    CHECK(kc::same(kvc::to_host(o.values), h.values.to_tensor(), at + " values (offloaded vs host)"));
  }
}

}  // namespace

// The engine for device storage exists only with <kvc/cuda.hpp>; it is a copyable, movable member.
template class kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::CudaStorage<float>, kvc::OffloadToHost<>>;
template class kvc::Cache<kvc::StaticCacheLayers, kvc::CudaStorage<__half>, kvc::OffloadToHost<true>>;
template class kvc::Cache<kvc::ConfiguredDynamicLayers, kvc::CudaStorage<__nv_bfloat16>, kvc::OffloadToHost<>>;
static_assert(std::is_nothrow_move_constructible_v<kvc::OffloadToHost<>::engine<kvc::CudaStorage<float>>>);
static_assert(std::is_copy_constructible_v<OffDyn>);

TEST_CASE("DynamicCache with OffloadToHost: identical decode, one layer on the device, every load prefetched") {
  constexpr std::int64_t layers = 4, batch = 2, heads = 2, dim = 8;
  OffDyn off;
  RefDyn ref;
  HostDyn host;
  kvc::reset_offload_host_stats();
  std::int64_t len = 0;
  for (std::int64_t step = 0; step < 12; ++step) {
    const std::int64_t q = step == 0 ? 5 : 1;  // a prefill, then decode steps
    for (std::int64_t i = 0; i < layers; ++i) {
      const auto k = kc::tokens(static_cast<int>(2 * i), batch, heads, len, q, dim);
      const auto v = kc::tokens(static_cast<int>(2 * i + 1), batch, heads, len, q, dim);
      const auto dk = kvc::to_device(k), dv = kvc::to_device(v);
      const auto o = off.update(dk, dv, i);
      const auto r = ref.update(dk, dv, i);
      const auto h = host.update(k, v, i);
      const std::string at = "step " + std::to_string(step) + ", layer " + std::to_string(i);
      CHECK(kc::same(kvc::to_host(o.keys), kvc::to_host(r.keys), at + " keys (offloaded vs device)"));
      CHECK(kc::same(kvc::to_host(o.values), kvc::to_host(r.values), at + " values (offloaded vs device)"));
      CHECK(kc::same(kvc::to_host(o.keys), h.keys.to_tensor(), at + " keys (offloaded vs host)"));
      CHECK(kc::same(kvc::to_host(o.values), h.values.to_tensor(), at + " values (offloaded vs host)"));
      // Only the layer just updated is on the device (the prefetched one is held by the engine).
      for (std::int64_t j = 0; j < off.size(); ++j)
        CHECK_MESSAGE((kvc::layer_device_bytes(off, j) > 0) == (j == i), at << ": layer " << j << " resident?");
    }
    len += q;
  }
  const kvc::OffloadHostStats s = kvc::offload_host_stats();
  CHECK(s.sync_loads == 0);
  CHECK(s.prefetch_hits == 11 * layers);
  CHECK(s.offloads == 12 * layers - 1);
  CHECK(s.offloaded_layers == layers - 1);
  CHECK(s.pool_reuses > 0);

  // A copy of a cache with offloaded layers is deep; a move is cheap; both hold the same layers.
  OffDyn copy = off;
  same_stored(copy, ref, host, "copy");
  OffDyn moved = std::move(copy);
  same_stored(moved, ref, host, "moved copy");

  // Every operation that reads or rewrites all layers brings them back first.
  off.crop(-3);
  ref.crop(-3);
  host.crop(-3);
  same_stored(off, ref, host, "crop(-3)");
  off.reorder_cache({1, 0});
  ref.reorder_cache({1, 0});
  host.reorder_cache({1, 0});
  same_stored(off, ref, host, "reorder_cache");
  off.batch_repeat_interleave(2);
  ref.batch_repeat_interleave(2);
  host.batch_repeat_interleave(2);
  same_stored(off, ref, host, "batch_repeat_interleave(2)");
  off.batch_select_indices({0, 3});
  ref.batch_select_indices({0, 3});
  host.batch_select_indices({0, 3});
  same_stored(off, ref, host, "batch_select_indices");
  len = ref.get_seq_length(0);
  for (std::int64_t step = 0; step < 3; ++step, ++len)  // decoding goes on after the batch ops
    for (std::int64_t i = 0; i < layers; ++i) {
      const auto k = kc::tokens(7, batch, heads, len, 1, dim);
      const auto dk = kvc::to_device(k);
      off.update(dk, dk, i);
      ref.update(dk, dk, i);
      host.update(k, k, i);
    }
  same_stored(off, ref, host, "decode after batch ops");
  off.reset();
  ref.reset();
  host.reset();
  CHECK(off.get_seq_length(0) == 0);
  same_stored(off, ref, host, "reset");
}

TEST_CASE("StaticCache with OffloadToHost<true>: sliding layers stay on the device, full layers are offloaded") {
  kvc::ModelConfig c;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 2;
  c.head_dim = 8;
  c.sliding_window = 3;
  c.layer_types =
      std::vector<std::string>{"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  kvc::StaticCache<float, kvc::CudaStorage<float>, kvc::OffloadToHost<true>> off(c, 16);
  kvc::StaticCache<float, kvc::CudaStorage<float>> ref(c, 16);
  kvc::StaticCache<float> host(c, 16);
  const std::vector<bool> sliding = off.is_sliding();
  std::int64_t len = 0;
  for (std::int64_t step = 0; step < 10; ++step) {
    const std::int64_t q = step == 0 ? 4 : 1;
    for (std::int64_t i = 0; i < 4; ++i) {
      const auto k = kc::tokens(static_cast<int>(i), 1, 2, len, q, 8);
      const auto dk = kvc::to_device(k);
      const auto o = off.update(dk, dk, i);
      const auto r = ref.update(dk, dk, i);
      const auto h = host.update(k, k, i);
      const std::string at = "step " + std::to_string(step) + ", layer " + std::to_string(i);
      CHECK(kc::same(kvc::to_host(o.keys), kvc::to_host(r.keys), at + " keys (offloaded vs device)"));
      CHECK(kc::same(kvc::to_host(o.keys), h.keys.to_tensor(), at + " keys (offloaded vs host)"));
      for (std::int64_t j = 0; j < 4; ++j)
        // Sliding layers never move (once their first update allocated them); full layers only while in use.
        CHECK_MESSAGE((kvc::layer_device_bytes(off, j) > 0) ==
                          (j == i || (sliding[static_cast<std::size_t>(j)] && (step > 0 || j < i))),
                      at << ": layer " << j << " resident?");
    }
    len += q;
  }
  same_stored(off, ref, host, "static decode");
  off.reorder_cache({0});
  ref.reorder_cache({0});
  host.reorder_cache({0});
  same_stored(off, ref, host, "static reorder_cache");
  off.reset();
  ref.reset();
  host.reset();
  same_stored(off, ref, host, "static reset");
}

// ---- attention on the device, beyond the conformance scenarios --------------------------------------

namespace {

// A long context (several splits of the keys, then the merge), head_dim 128 and 256, a decode
// step and a prefill chunk, against the host's attention over the same keys.
template <class T>
void long_context_matches_host(float tolerance) {
  using H = kvc::detail::host_element_t<T>;
  std::mt19937 rng(7);
  for (const std::int64_t dim : {128, 256}) {
    for (const std::int64_t q : {1, 33}) {
      const std::int64_t seq = 5000;
      const auto k = kc::random_tensor<H>(2, 2, seq, dim, rng), v = kc::random_tensor<H>(2, 2, seq, dim, rng);
      const auto queries = kc::random_tensor<H>(2, 8, q, dim, rng);
      const auto dk = kvc::to_device(k), dv = kvc::to_device(v), dq = kvc::to_device(queries);
      for (const std::optional<std::int64_t> window :
           {std::optional<std::int64_t>{}, std::optional<std::int64_t>{700}}) {
        INFO("head_dim " << dim << ", " << q << " queries, window " << window.value_or(0));
        const kvc::AttentionMask mask{seq, 0, seq - q, window};
        const auto got = kvc::to_host(kvc::scaled_dot_product_attention(dq, dk.view(), dv.view(), mask).view());
        const auto want = kvc::scaled_dot_product_attention(kvc::HostStorage<H>::input_view(queries),
                                                            kvc::HostStorage<H>::input_view(k),
                                                            kvc::HostStorage<H>::input_view(v), mask);
        CHECK(kc::largest_difference(got, want) <= tolerance);
        // The owning tensors as inputs (kvc::tensor_input), on both sides: the same bits.
        const auto owning = kvc::to_host(kvc::scaled_dot_product_attention(dq, dk, dv, mask).view());
        CHECK(kc::largest_difference(owning, got) == 0.0f);
        CHECK(kc::largest_difference(kvc::scaled_dot_product_attention(queries, k, v, mask), want) == 0.0f);
      }
    }
  }
}

}  // namespace

TEST_CASE("device attention: long contexts split over the keys, head_dim 128 and 256") {
  long_context_matches_host<float>(2e-5f);
  long_context_matches_host<__half>(2e-3f);           // an ulp of half below 1
  long_context_matches_host<__nv_bfloat16>(1.6e-2f);  // an ulp of bfloat16 below 1
}

TEST_CASE("device attention over fp8 codes (per-head scales, both formats) matches the host's") {
  std::mt19937 rng(8);
  const auto k = kc::random_tensor<float>(1, 2, 300, 64, rng), v = kc::random_tensor<float>(1, 2, 300, 64, rng);
  const auto q = kc::random_tensor<float>(1, 4, 2, 64, rng);
  const auto check = [&](auto code) {
    using F8 = decltype(code);
    const kvc::Fp8Scales scales =
        kvc::fp8_scales_for<F8>(kvc::HostStorage<float>::input_view(k), kvc::HostStorage<float>::input_view(v),
                                kvc::Fp8ScaleGranularity::per_head);
    const auto k8 = kvc::to_fp8<F8>(kvc::HostStorage<float>::input_view(k), scales.keys);
    const auto v8 = kvc::to_fp8<F8>(kvc::HostStorage<float>::input_view(v), scales.values);
    const kvc::AttentionMask mask{300, 0, 298};
    const auto dk = kvc::to_device(k8), dv = kvc::to_device(v8);
    const auto dq = kvc::to_device(q);
    const auto got = kvc::to_host(kvc::scaled_dot_product_attention(dq, dk.view(), dv.view(), mask, scales).view());
    const auto want =
        kvc::detail::attention_impl(kvc::HostStorage<float>::input_view(q), kvc::HostStorage<F8>::input_view(k8),
                                    kvc::HostStorage<F8>::input_view(v8), mask, std::nullopt, scales);
    CHECK(kc::largest_difference(got, want) <= 1e-5f);
    const auto owning = kvc::to_host(kvc::scaled_dot_product_attention(dq, dk, dv, mask, scales).view());
    CHECK(kc::largest_difference(owning, got) == 0.0f);
    const kvc::Fp8Scales wrong{{1.f, 1.f, 1.f}, {1.f}};
    CHECK_THROWS_AS(kvc::scaled_dot_product_attention(dq, dk.view(), dv.view(), mask, wrong), kvc::ValueError);
  };
  check(kvc::float8_e4m3{});
  check(kvc::float8_e5m2{});
}

namespace {

// One request's steps of 13, 1, 1 and 6 tokens over a two-layer model (a sliding and a full layer)
// in a PagedCache<CudaStorage<KV>> and a PagedCache<HostStorage<KV>>: each layer's step is made by
// encode(keys, values) (host tensors of KV), copied to the device, attended on both sides by
// compare(device, host, layer, step, queries, rows, device keys, device values), then stored (the
// device with write_all_layers, the host layer by layer); at the end every pool is compared byte for
// byte.
template <class KV, class Encode, class Compare>
void paged_steps_on_both(std::int64_t dim, unsigned seed, Encode encode, Compare compare) {
  const kvc::ModelConfig config = kc::paged_model({"sliding_attention", "full_attention"}, 2, 4, dim, 7);
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 32;
  kvc::PagedCache<kvc::CudaStorage<KV>> device(config, cb);
  kvc::PagedCache<kvc::HostStorage<KV>> host(config, cb);
  std::mt19937 rng(seed);
  std::int64_t past = 0, held = 0;
  for (const std::int64_t q : {13, 1, 1, 6}) {
    const std::int64_t need = (past + q + 3) / 4 - held;
    if (need > 0) {
      REQUIRE(device.allocate_blocks(need, "r", held).has_value());
      REQUIRE(host.allocate_blocks(need, "r", held).has_value());
      held += need;
    }
    kvc::PagedIndices none(2), writes(2);
    host.extend_read_and_write_indices("r", past, q, nullptr, writes);
    const std::vector<std::string> reqs = {"r"};
    const std::vector<std::int64_t> cu = {0, q}, pasts = {past};
    const kvc::PagedAttentionStep step{reqs, cu, pasts};
    std::vector<kvc::KV<kvc::HostTensor<KV>>> rows;
    std::vector<kvc::DeviceTensor<KV>> dk, dv;
    std::vector<kvc::DeviceTensorView<KV>> kviews, vviews;
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      rows.push_back(encode(kc::random_tensor<float>(1, 2, q, dim, rng), kc::random_tensor<float>(1, 2, q, dim, rng)));
      dk.push_back(kvc::to_device(rows.back().keys));
      dv.push_back(kvc::to_device(rows.back().values));
    }
    for (std::size_t l = 0; l < 2; ++l) {
      kviews.push_back(dk[l].view());
      vviews.push_back(dv[l].view());
    }
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto l = static_cast<std::size_t>(layer);
      INFO("step at " << past << ", layer " << layer);
      compare(device, host, layer, step, kc::random_tensor<float>(1, 4, q, dim, rng), rows[l], dk[l], dv[l]);
      host.update(kvc::HostStorage<KV>::input_view(rows[l].keys), kvc::HostStorage<KV>::input_view(rows[l].values),
                  layer, none, writes);
    }
    device.write_all_layers(kviews, vviews, writes);
    past += q;
  }
  for (std::int64_t j = 0; j < 2; ++j)
    for (const bool keys : {true, false}) {
      const std::size_t n = sizeof(KV) * static_cast<std::size_t>(2 * (host.num_blocks() + 2) * host.block_size() *
                                                                  (keys ? host.row_width() : host.value_row_width()));
      std::vector<unsigned char> back(n);
      kvc::detail::cuda_check(
          cudaMemcpy(back.data(), keys ? device.key_pool(j) : device.value_pool(j), n, cudaMemcpyDeviceToHost),
          "cudaMemcpy of a pool in a paged test");
      CHECK(std::memcmp(back.data(), keys ? host.key_pool(j) : host.value_pool(j), n) == 0);
    }
}

}  // namespace

TEST_CASE("paged attention over an fp8 device pool matches the host's") {
  using F8 = kvc::float8_e4m3;
  const kvc::Fp8Scales scales{{0.01f, 0.02f}, {0.015f}};
  const auto view = [](const kc::Ref& t) { return kvc::HostStorage<float>::input_view(t); };
  paged_steps_on_both<F8>(
      32, 9,
      [&](const kc::Ref& k, const kc::Ref& v) {
        return kvc::KV<kvc::HostTensor<F8>>{kvc::to_fp8<F8>(view(k), scales.keys),
                                            kvc::to_fp8<F8>(view(v), scales.values)};
      },
      [&](const auto& device, const auto& host, std::int64_t layer, const kvc::PagedAttentionStep& step,
          const kc::Ref& queries, const kvc::KV<kvc::HostTensor<F8>>& rows, const kvc::DeviceTensor<F8>& dk,
          const kvc::DeviceTensor<F8>& dv) {
        const auto dq = kvc::to_device(queries);
        const auto got =
            kvc::to_host(kvc::paged_attention(device, layer, step, dq.view(), dk.view(), dv.view(), scales).view());
        const auto want =
            kvc::paged_attention(host, layer, step, view(queries), kvc::HostStorage<F8>::input_view(rows.keys),
                                 kvc::HostStorage<F8>::input_view(rows.values), scales);
        CHECK(kc::largest_difference(got, want) <= 1e-5f);
        // The owning tensors as inputs (kvc::tensor_input), on both sides: the same bits.
        const auto owning = kvc::to_host(kvc::paged_attention(device, layer, step, dq, dk, dv, scales).view());
        CHECK(kc::largest_difference(owning, got) == 0.0f);
        CHECK(kc::largest_difference(kvc::paged_attention(host, layer, step, queries, rows.keys, rows.values, scales),
                                     want) == 0.0f);
      });
}

TEST_CASE("to_row_codes and to_kv_codes on the device make the host's rows, byte for byte") {
  // head_dim 40 (a short last int2 group and NVFP4 block), strided input (a view of every other
  // token), values with NaN, infinity, ties and both zeros among the random ones, and a row whose
  // least value is 0 of both signs.
  std::mt19937 rng(12);
  auto x = kc::random_tensor<float>(2, 3, 10, 40, rng);
  x(0, 0, 0, 3) = std::numeric_limits<float>::quiet_NaN();
  x(0, 1, 2, 7) = std::numeric_limits<float>::infinity();
  x(1, 2, 4, 0) = -0.0f;
  for (std::int64_t i = 0; i < 40; ++i) x(1, 0, 6, i) = 0.25f * static_cast<float>(i % 8);  // ties
  for (std::int64_t i = 0; i < 40; ++i) x(1, 1, 3, i) = 0.5f * static_cast<float>(i % 4);   // zero minimum...
  x(1, 1, 3, 4) = -0.0f;  // ...of both signs (an int2 group's minimum takes the first)
  const auto dx = kvc::to_device(x);
  const auto every_other = [](const auto& v) {  // tokens 0, 2, 4, ... of a [2, 3, 10, 40] view
    auto w = v;
    w.extents[2] = 5;
    w.strides[2] *= 2;
    return w;
  };
  kvc::HostTensor<float> host_half(2, 3, 5, 40);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 3; ++h)
      for (std::int64_t t = 0; t < 5; ++t)
        for (std::int64_t i = 0; i < 40; ++i) host_half(b, h, t, i) = x(b, h, 2 * t, i);
  const auto same_bytes = [](const auto& device_rows, const auto& host_rows) {
    const auto back = kvc::to_host(device_rows.view());
    REQUIRE(back.size() == host_rows.size());
    return std::memcmp(back.data(), host_rows.data(), static_cast<std::size_t>(back.size())) == 0;
  };
  CHECK(same_bytes(kvc::to_row_codes<kvc::nvfp4_row>(dx, 0.004f), kvc::to_row_codes<kvc::nvfp4_row>(x, 0.004f)));
  CHECK(same_bytes(kvc::to_row_codes<kvc::nvfp4_row>(every_other(dx.view()), 0.004f),
                   kvc::to_row_codes<kvc::nvfp4_row>(host_half, 0.004f)));
  using Pair = kvc::kv_codes<kvc::int8_row, kvc::int2_row>;
  const auto d = kvc::to_kv_codes<Pair>(dx, dx);
  const auto h = kvc::to_kv_codes<Pair>(x, x);
  CHECK(same_bytes(d.keys, h.keys));
  CHECK(same_bytes(d.values, h.values));
  CHECK_THROWS_WITH_AS(kvc::to_row_codes<kvc::nvfp4_row>(dx, 0.0f),
                       "kvc::to_row_codes: the tensor scale must be positive and finite (at most 2^116), got 0",
                       kvc::ValueError);
  const auto wide = kvc::to_device(kc::random_tensor<float>(1, 1, 1, 257, rng));
  CHECK_THROWS_WITH_AS(kvc::to_kv_codes<Pair>(wide, wide),
                       "kvc::to_kv_codes: the keys: head_dim 257 is above the device kernels' limit of 256",
                       kvc::ValueError);
}

namespace {

// Paged attention over a device pool of row codes C against the host's over the same codes, at
// head_dim 128 with float queries (each NVFP4 side with its tensor scale).
template <class C>
void row_code_pool_matches_host() {
  const kvc::Nvfp4TensorScales g{kvc::detail::key_tensor_scaled<C> ? 0.002f : 1.0f,
                                 kvc::detail::value_tensor_scaled<C> ? 0.003f : 1.0f};
  paged_steps_on_both<C>(
      128, 11, [&](const kc::Ref& k, const kc::Ref& v) { return kc::pool_step<C>(k, v, g); },
      [&](const auto& device, const auto& host, std::int64_t layer, const kvc::PagedAttentionStep& step,
          const kc::Ref& queries, const kvc::KV<kvc::HostTensor<C>>& rows, const kvc::DeviceTensor<C>& dk,
          const kvc::DeviceTensor<C>& dv) {
        const auto dq = kvc::to_device(queries);
        const auto q = kvc::HostStorage<float>::input_view(queries);
        const auto hk = kvc::HostStorage<C>::input_view(rows.keys), hv = kvc::HostStorage<C>::input_view(rows.values);
        kvc::HostTensor<float> got, want;
        if constexpr (kvc::detail::takes_scale_lists<C>) {
          got = kvc::to_host(kvc::paged_attention(device, layer, step, dq, dk, dv, g).view());
          want = kvc::paged_attention(host, layer, step, q, hk, hv, g);
        } else {
          got = kvc::to_host(kvc::paged_attention(device, layer, step, dq, dk, dv).view());
          want = kvc::paged_attention(host, layer, step, q, hk, hv);
        }
        INFO(C::name);
        CHECK(kc::largest_difference(got, want) <= 1e-5f);
      });
}

}  // namespace

TEST_CASE("paged attention over device pools of row codes (NVFP4, int8 K + int2 V) matches the host's") {
  row_code_pool_matches_host<kvc::nvfp4_row>();
  row_code_pool_matches_host<kvc::kv_codes<kvc::int8_row, kvc::int2_row>>();
}

TEST_CASE("kvc::attend over a device cache: the host's results, and its checks before the update") {
  kvc::DynamicCache<float, kvc::CudaStorage<float>> device;
  kvc::DynamicCache<float> host;
  std::mt19937 rng(10);
  for (const std::int64_t q : {9, 1, 1}) {
    const auto queries = kc::random_tensor<float>(1, 4, q, 64, rng);
    const auto k = kc::random_tensor<float>(1, 2, q, 64, rng), v = kc::random_tensor<float>(1, 2, q, 64, rng);
    const auto got =
        kvc::to_host(kvc::attend(device, 0, kvc::to_device(queries), kvc::to_device(k), kvc::to_device(v), {4}).view());
    const auto want = kvc::attend(host, 0, queries, k, v, {4});
    CHECK(kc::largest_difference(got, want) <= 1e-5f);
  }
  const auto bad_queries = kvc::to_device(kc::random_tensor<float>(1, 3, 1, 64, rng));
  const auto k = kvc::to_device(kc::random_tensor<float>(1, 2, 1, 64, rng));
  CHECK_THROWS_WITH_AS(kvc::attend(device, 0, bad_queries, k, k),
                       "scaled_dot_product_attention: 3 query heads are not a multiple of 2 key/value heads",
                       kvc::ValueError);
  CHECK(device.get_seq_length(0) == 11);  // unchanged
  const auto wide = kvc::to_device(kc::random_tensor<float>(1, 2, 1, 512, rng));
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(wide, wide.view(), wide.view(), kvc::AttentionMask{1, 0, 0}),
                       "kvc::scaled_dot_product_attention on a device: head_dim 512 is above the device kernels' "
                       "limit of 256",
                       kvc::ValueError);
}

// ---- the CUDA code blocks of docs/cuda.md and docs/offload.md ----------------------------------
// Quoted by docs.snippets and compiled here (never run): each block is the body of a function whose
// parameters are the inputs the page leaves to the reader.
namespace docs_examples {

using Half = kvc::DeviceTensor<__half>;

void offload_to_host(const Half& dk, const Half& dv, std::int64_t layer_idx) {
  // [snippet:offload_to_host]
  kvc::DynamicCache<__half, kvc::CudaStorage<__half>, kvc::OffloadToHost<>> cache;
  auto [k, v] = cache.update(dk, dv, layer_idx);  // valid until the next call on the cache
  // [/snippet]
  (void)k;
  (void)v;
}

void quantized(const kvc::ModelConfig& config, const Half& dk, const Half& dv, std::int64_t layer_idx) {
  // [snippet:quantized]
  kvc::QuantizedCache<__half, kvc::CudaStorage<__half>> cache("quanto", config, {4, 0, 0, 64, 128});
  auto [k, v] = cache.update(dk, dv, layer_idx);  // DeviceTensorViews of the dequantized history + residual
  // [/snippet]
  (void)k;
  (void)v;
}

void attention(kvc::DynamicCache<__half, kvc::CudaStorage<__half>>& cache, const Half& dq, const Half& dk,
               const Half& dv, const kvc::KV<kvc::DeviceTensorView<__half>>& kv,
               const kvc::KV<kvc::DeviceTensorView<kvc::float8_e4m3>>& kv8, const kvc::Fp8Scales& scales,
               const kvc::AttentionMask& mask, const kvc::PagedCache<kvc::CudaStorage<__half>>& paged,
               const kvc::PagedAttentionStep& step, std::int64_t layer_idx) {
  // [snippet:attention]
  // Contiguous layers: the views a device cache's update returned.
  kvc::DeviceTensor<__half> out = kvc::scaled_dot_product_attention(dq, kv.keys, kv.values, mask);
  // kvc::attend works unchanged over a device cache (device queries, keys and values).
  auto out2 = kvc::attend(cache, layer_idx, dq, dk, dv);
  // fp8 codes (a cache of kvc::float8_e4m3 in CudaStorage), with the scales they were made with.
  auto out3 = kvc::scaled_dot_product_attention(dq, kv8.keys, kv8.values, mask, scales);
  // A continuous-batching step over a PagedCache<CudaStorage<T>> (or of fp8 codes, with scales).
  auto out4 = kvc::paged_attention(paged, layer_idx, step, dq.view(), dk.view(), dv.view());
  // [/snippet]
  (void)out2;
  (void)out3;
  (void)out4;
}

void paged_row_codes(kvc::PagedCache<kvc::CudaStorage<kvc::nvfp4_row>>& cache, const kvc::DeviceTensor<float>& dk,
                     const kvc::DeviceTensor<float>& dv, const kvc::DeviceTensor<float>& dq,
                     const kvc::PagedAttentionStep& step, const kvc::PagedIndices& no_reads,
                     const kvc::PagedIndices& write_index, float key_amax, float value_amax, std::int64_t layer) {
  // [snippet:paged_row_codes]
  // kvc::PagedCache<kvc::CudaStorage<kvc::nvfp4_row>> cache(config, cb);  (pools of NVFP4 rows on the device)
  const kvc::Nvfp4TensorScales g{kvc::nvfp4_tensor_scale(key_amax), kvc::nvfp4_tensor_scale(value_amax)};
  const auto k = kvc::to_row_codes<kvc::nvfp4_row>(dk, g.keys);  // encoded on the device (dk, dv: DeviceTensors)
  const auto v = kvc::to_row_codes<kvc::nvfp4_row>(dv, g.values);
  kvc::DeviceTensor<float> out = kvc::paged_attention(cache, layer, step, dq, k, v, g);  // read from the codes
  cache.update(k.view(), v.view(), layer, no_reads, write_index);
  // [/snippet]
  (void)out;
}

void write_all_layers(kvc::PagedCache<kvc::CudaStorage<__half>>& cache, const kvc::PagedIndices& writes) {
  // [snippet:write_all_layers]
  std::vector<kvc::DeviceTensorView<__half>> keys, values;  // layer l's [1, kv_heads, T, head_dim]
  cache.write_all_layers(keys, values, writes);             // writes: from extend_read_and_write_indices
  // [/snippet]
}

// The reader's own attention kernel of docs/offload.md's block.
__global__ void attention(const __half*, kvc::DeviceTensorView<__half>, kvc::DeviceTensorView<__half>, __half*) {}

void offloaded_decode(const kvc::ModelConfig& config, const std::vector<Half>& keys, const std::vector<Half>& values,
                      std::int64_t layers, const __half* q, __half* out, dim3 grid, dim3 block) {
  // [snippet:offloaded_decode]
  // #include <kvc/cuda.hpp>
  // transformers' DynamicCache(offloading=True):
  kvc::DynamicCache<__half, kvc::CudaStorage<__half>, kvc::OffloadToHost<>> cache;
  // transformers' StaticCache(config, 4096, offloading=True):
  kvc::StaticCache<__half, kvc::CudaStorage<__half>, kvc::OffloadToHost<true>> fixed(config, 4096);

  for (std::int64_t i = 0; i < layers; ++i) {
    const auto l = static_cast<std::size_t>(i);
    auto [k, v] = cache.update(keys[l], values[l], i);  // device views, as without offloading
    attention<<<grid, block>>>(q, k, v, out);           // on the storage's stream (here the default one)
  }
  // [/snippet]
  (void)fixed;
}

}  // namespace docs_examples

// The storage conformance scenarios (conformance.hpp) over HostStorage<float>, built by the host
// compiler in every configuration: the semantics the CUDA storage is compared against; and the
// device attention kernels' bodies run on 32 emulated lanes.
#include <barrier>
#include <random>
#include <thread>

#include "conformance.hpp"

namespace kc = kvc_conformance;

TEST_CASE("conformance: HostStorage<float> passes every scenario") {
  const auto records = kc::run_all<kc::HostBackend<float>>();
  CHECK(records.size() == 10);
  for (const auto& scenario : records) {  // no structured binding: clang 14 cannot capture one in INFO
    INFO("scenario " << scenario.first);
    CHECK_FALSE(scenario.second.labels.empty());
  }
}

TEST_CASE("conformance: a run is deterministic, so host and device records can be compared") {
  const auto a = kc::run_all<kc::HostBackend<float>>();
  const auto b = kc::run_all<kc::HostBackend<float>>();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(kc::same_record(a[i].second, b[i].second, a[i].first));
}

TEST_CASE("conformance: HostStorage<Eigen::bfloat16> gives the float results, rounded exactly") {
  const auto f = kc::run_all<kc::HostBackend<float>>();
  const auto h = kc::run_all<kc::HostBackend<Eigen::bfloat16>>();
  REQUIRE(f.size() == h.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    // bytes differ with the element size; everything else (shapes, lengths, elements) is equal,
    // except what the quantized layers return (their metadata is rounded to bfloat16) and attention
    // outputs (rounded to bfloat16)
    CHECK(f[i].second.labels == h[i].second.labels);
    const std::string name = f[i].first;
    if (name != "quantized" && name != "attention" && name != "paged")
      CHECK(f[i].second.tensors == h[i].second.tensors);
  }
}

// ---- the attention kernels' bodies with 32 emulated lanes ------------------------------------------

namespace {

// 32 host threads standing for the lanes of a warp, running the kernels' bodies
// (attention_row_split, attention_row_merge) as the device runs them: each lane holds dims lane,
// lane + 32, ..., and sum() is the device's butterfly of five __shfl_xor_sync steps, each step a
// barrier. So the lane split of the dims, the cross-lane sums and the partials' layout are checked
// here, on every CI stage, without a GPU.
struct emulated_warp {
  static constexpr int count = 32;
  struct shared {
    std::barrier<> barrier{count};
    float slots[count] = {};
  };
  int lane;
  shared* sh;
  int index() const noexcept { return lane; }
  float sum(float x) const {
    for (int offset = 16; offset > 0; offset /= 2) {
      sh->slots[lane] = x;
      sh->barrier.arrive_and_wait();
      const float other = sh->slots[lane ^ offset];
      sh->barrier.arrive_and_wait();
      x += other;
    }
    return x;
  }
  void sync() const { sh->barrier.arrive_and_wait(); }
};

template <int PerLane, class Problem>
void run_on_emulated_warp(const Problem& p, std::int64_t chunk) {
  emulated_warp::shared sh;
  const std::int64_t splits = kvc::detail::split_count(kvc::detail::max_row_width(p), chunk);
  std::vector<float> partials(static_cast<std::size_t>(splits * (2 + p.Dv)));
  std::vector<std::thread> lanes;
  for (int l = 0; l < emulated_warp::count; ++l)
    lanes.emplace_back([&, l] {
      kvc::detail::attention_rows_host<PerLane>(p, chunk, emulated_warp{l, &sh}, partials.data());
    });
  for (auto& t : lanes) t.join();
}

}  // namespace

TEST_CASE("attention kernels' bodies on 32 emulated lanes: dense problems, splits and masks") {
  // head_dim 40 and value head_dim 36: lanes 0-7 hold two key dims, the others one; GQA 4 on 2.
  // (Small: every key costs ten barriers of 32 threads.)
  std::mt19937 rng(21);
  const auto q = kc::random_tensor<float>(2, 4, 2, 40, rng), k = kc::random_tensor<float>(2, 2, 14, 40, rng),
             v = kc::random_tensor<float>(2, 2, 14, 36, rng);
  std::vector<std::uint8_t> pad(2 * 14, 1);
  pad[14 + 2] = pad[14 + 11] = 0;
  const auto view = [](const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); };
  for (const bool sliding : {false, true}) {
    CAPTURE(sliding);
    kvc::AttentionMask mask{14, 0, 12, sliding ? std::optional<std::int64_t>{6} : std::nullopt};
    mask.key_padding_mask = pad;
    kvc::HostTensor<float> out(2, 4, 2, 36);
    out.setConstant(-99.f);
    const auto p =
        kvc::detail::make_dense_problem(view(q), view(k), view(v), mask, std::nullopt, out.data(), {}, {}, pad.data());
    // Causal: three splits of at most 5 keys, then the merge; sliding: one split, the output
    // written directly.
    run_on_emulated_warp<4>(p, sliding ? 64 : 5);
    CHECK(kc::largest_difference(out, kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask)) <= 1e-5f);
  }
}

namespace {

// A paged step on the emulated lanes over a pool of KV (float, or row codes), against the host's
// paged_attention: a prefill of 9 and 5 tokens stored, then a step of 1 and 3 tokens attended, at
// head_dim 40 (lanes 0-7 hold two dims; an int2 row's second group and an NVFP4 row's third block
// are short). The kernels' bodies read pool rows through the block tables and the step's own rows;
// row codes a value at a time with the format's value_at (an NVFP4 side's tensor scale folded into
// the softmax scale for keys and into the output's scale for values), where the host widens blocks
// of rows.
template <class KV>
void paged_step_on_emulated_lanes(unsigned seed) {
  const kvc::ModelConfig config = kc::paged_model({"full_attention", "sliding_attention"}, 2, 4, 40, 6);
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  kvc::PagedCache<kvc::HostStorage<KV>> cache(config, cb);
  std::mt19937 rng(seed);
  const auto view = [](const auto& t) {
    return kvc::HostStorage<typename std::decay_t<decltype(t)>::Scalar>::input_view(t);
  };
  const kvc::Nvfp4TensorScales g{kvc::detail::key_tensor_scaled<KV> ? 0.002f : 1.0f,
                                 kvc::detail::value_tensor_scaled<KV> ? 0.003f : 1.0f};
  const std::vector<std::string> reqs = {"a", "b"};
  REQUIRE(cache.allocate_blocks(4, "a", 0));
  REQUIRE(cache.allocate_blocks(4, "b", 0));
  kvc::PagedIndices none(2), writes(2);
  cache.extend_read_and_write_indices("a", 0, 9, nullptr, writes);
  cache.extend_read_and_write_indices("b", 0, 5, nullptr, writes);
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    const auto rows =
        kc::pool_step<KV>(kc::random_tensor<float>(1, 2, 14, 40, rng), kc::random_tensor<float>(1, 2, 14, 40, rng), g);
    cache.update(view(rows.keys), view(rows.values), layer, none, writes);
  }
  const std::vector<std::int64_t> cu = {0, 1, 4}, past = {9, 5};
  const kvc::PagedAttentionStep step{reqs, cu, past};
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    const auto q = kc::random_tensor<float>(1, 4, 4, 40, rng);
    const auto rows =
        kc::pool_step<KV>(kc::random_tensor<float>(1, 2, 4, 40, rng), kc::random_tensor<float>(1, 2, 4, 40, rng), g);
    const auto k = view(rows.keys), v = view(rows.values);
    const auto call = kvc::detail::check_paged_attention(cache, layer, step, view(q), k, v);
    std::int64_t width = 0;
    const auto tables = kvc::detail::paged_tables(cache, call, step, width);
    kvc::HostTensor<float> out(1, 4, 4, 40);
    out.setConstant(-99.f);
    const auto p =
        kvc::detail::make_paged_problem(cache, call, view(q), k, v, out.data(), cu.data(), past.data(), tables.data(),
                                        width, std::nullopt, {&g.keys, false}, {&g.values, false});
    run_on_emulated_warp<4>(p, 3);
    kvc::HostTensor<float> want;
    if constexpr (kvc::is_row_code_v<KV> && kvc::detail::takes_scale_lists<KV>)
      want = kvc::paged_attention(cache, layer, step, view(q), k, v, g);
    else
      want = kvc::paged_attention(cache, layer, step, view(q), k, v);
    CHECK(kc::largest_difference(out, want) <= 1e-5f);
    CHECK(kc::largest_difference(want, kvc::HostTensor<float>(out.constant(0.0f))) > 0.01f);  // not all zero
  }
}

}  // namespace

TEST_CASE("attention kernels' bodies on 32 emulated lanes: a paged step through block tables") {
  paged_step_on_emulated_lanes<float>(22);
}

TEST_CASE("attention kernels' bodies on 32 emulated lanes: a paged step over row codes (NVFP4, int8 K + int2 V)") {
  paged_step_on_emulated_lanes<kvc::nvfp4_row>(23);
  paged_step_on_emulated_lanes<kvc::kv_codes<kvc::int8_row, kvc::int2_row>>(23);
}

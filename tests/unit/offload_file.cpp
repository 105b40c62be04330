// kvc::OffloadToFile: decode loops give bit-identical results to the same cache kept in memory,
// only the expected layers stay resident, whole-cache operations work on offloaded layers, I/O
// errors throw kvc::RuntimeError and leave the cache usable, the spill file disappears with the
// cache, and the prefetch thread serves the layers before they are needed (docs/offload.md).

#include "../support/kvc_test.hpp"

#include <kvc/policies/offload/file.hpp>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

using kvc_test::flatten;
using kvc_test::random_tensor;

namespace {

template <bool OnlyNonSliding = false>
using File = kvc::OffloadToFile<OnlyNonSliding>;
using Host = kvc::HostStorage<float>;
using Bf16 = Eigen::bfloat16;

using kvc_test::spill_dir;

template <class KV>
std::vector<double> both(const KV& kv) {
  std::vector<double> out = flatten(kv.keys);
  const std::vector<double> v = flatten(kv.values);
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

// Compares two updates' results element by element, and their shapes.
template <class KV1, class KV2>
void check_same(const KV1& a, const KV2& b) {
  CHECK(a.keys.extents == b.keys.extents);
  CHECK(a.values.extents == b.values.extents);
  CHECK(both(a) == both(b));
}

// Every layer's stored K/V of both caches is equal.
template <class C1, class C2>
void check_same_contents(const C1& a, const C2& b) {
  REQUIRE(a.size() == b.size());
  for (std::int64_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(a.get_seq_length(i) == b.get_seq_length(i));
    check_same(a.stored(i), b.stored(i));
  }
}

// One decode step: layer by layer, the same random tokens to both caches; `after(i)` runs after
// layer i's update (the offloaded cache's views are compared first).
template <class T, class C1, class C2, class After>
void step(C1& off, C2& ref, std::int64_t layers, std::int64_t batch, std::int64_t heads, std::int64_t q,
          std::int64_t head_dim, std::mt19937& rng, After&& after) {
  for (std::int64_t i = 0; i < layers; ++i) {
    const auto k = random_tensor<T>(batch, heads, q, head_dim, rng);
    const auto v = random_tensor<T>(batch, heads, q, head_dim, rng);
    const auto a = off.update(k, v, i);
    const auto b = ref.update(k, v, i);
    CAPTURE(i);
    check_same(a, b);
    after(i);
  }
}
constexpr auto nothing = [](std::int64_t) {};

}  // namespace

TEST_CASE("DynamicCache with OffloadToFile: bit-identical decode, one layer resident, every read prefetched") {
  spill_dir dir;
  kvc::reset_offload_file_stats();
  constexpr std::int64_t layers = 5, steps = 12;
  {
    kvc::DynamicCache<float, Host, File<>> off;
    kvc::DynamicCache<float> ref;
    std::mt19937 rng(1);
    for (std::int64_t s = 0; s < steps; ++s) {
      step<float>(off, ref, layers, 2, 3, s == 0 ? 7 : 1, 16, rng, [&](std::int64_t i) {
        // Only the layer just updated is in memory; the others are in the file.
        for (std::int64_t j = 0; j < off.size(); ++j) {
          CAPTURE(j);
          CHECK((kvc::layer_ram_bytes(off, j) > 0) == (j == i));
        }
        CHECK(kvc::ram_bytes(off) == kvc::layer_ram_bytes(ref, i));
        CHECK(off.bytes() == kvc::layer_ram_bytes(ref, i));
        CHECK(kvc::offload_file_stats().spilled_layers == off.size() - 1);
      });
      CHECK(dir.entries() == 0);  // the spill file has no name
      CHECK(dir.open_spill_files() == 1);
    }
    // The queries that read no data work on spilled layers.
    for (std::int64_t i = 0; i < layers; ++i) CHECK(off.get_seq_length(i) == ref.get_seq_length(i));
    CHECK(off.get_mask_sizes(1, 2) == ref.get_mask_sizes(1, 2));
    const auto stats = kvc::offload_file_stats();
    // Every layer came back from a prefetch, none by a synchronous read.
    CHECK(stats.sync_reads == 0);
    CHECK(stats.prefetch_hits == layers * (steps - 1));
    CHECK(stats.spills == layers * steps - 1);
    CHECK(stats.bytes_written > 0);
    // stored() brings a layer back; the contents match.
    check_same_contents(off, ref);
  }
  // The spill file is closed (hence deleted) with the cache, and the counters follow.
  CHECK(dir.open_spill_files() == 0);
  CHECK(dir.entries() == 0);
  CHECK(kvc::offload_file_stats().spilled_layers == 0);
  CHECK(kvc::offload_file_stats().spilled_bytes == 0);
}

TEST_CASE("the prefetch overlaps the caller's work between updates") {
  spill_dir dir;
  kvc::reset_offload_file_stats();
  kvc::DynamicCache<float, Host, File<>> off;
  kvc::DynamicCache<float> ref;
  std::mt19937 rng(2);
  for (int s = 0; s < 4; ++s)
    step<float>(off, ref, 4, 1, 4, s == 0 ? 64 : 1, 64, rng,
                [](std::int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); });  // "attention"
  const auto stats = kvc::offload_file_stats();
  CHECK(stats.sync_reads == 0);
  CHECK(stats.prefetch_hits == 12);
  // With 5 ms of work after each update, the thread has read the next layer before it is needed
  // (a loaded machine may delay it once or twice; most must be ready).
  CHECK(stats.prefetch_waits < stats.prefetch_hits / 2);
}

TEST_CASE("StaticCache with OffloadToFile<true>: sliding layers stay, full layers are spilled") {
  spill_dir dir;
  kvc::reset_offload_file_stats();
  kvc::ModelConfig config;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 2;
  config.head_dim = 8;
  config.sliding_window = 3;
  config.layer_types =
      std::vector<std::string>{"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  kvc::StaticCache<float, Host, File<true>> off(config, 16);
  kvc::StaticCache<float> ref(config, 16);
  const std::int64_t layer_bytes = 2 * 2 * 2 * 16 * 8 * 4;  // K and V, batch 2, 2 heads, 16 slots, dim 8
  CHECK(off.bytes() == 0);
  std::mt19937 rng(3);
  for (int s = 0; s < 10; ++s) {
    step<float>(off, ref, 4, 2, 2, s == 0 ? 4 : 1, 8, rng, [&](std::int64_t i) {
      CHECK(kvc::layer_ram_bytes(off, 1) == kvc::layer_ram_bytes(ref, 1));  // sliding: never offloaded
      CHECK(kvc::layer_ram_bytes(off, 3) == kvc::layer_ram_bytes(ref, 3));
      if (s > 0) CHECK(kvc::layer_ram_bytes(off, 3) > 0);
      const std::int64_t other_full = i == 0 ? 2 : 0;  // full layers: only the current one stays
      CHECK(kvc::layer_ram_bytes(off, other_full) == 0);
      if (i == 0 || i == 2) CHECK(kvc::layer_ram_bytes(off, i) == layer_bytes);
    });
  }
  const auto stats = kvc::offload_file_stats();
  CHECK(stats.sync_reads == 0);
  CHECK(stats.prefetch_hits == 2 * 9);
  check_same_contents(off, ref);
  // reset() after offloading: every layer zeroed and rewound, then decoding goes on alike.
  off.reset();
  ref.reset();
  check_same_contents(off, ref);
  for (int s = 0; s < 3; ++s) step<float>(off, ref, 4, 2, 2, 1, 8, rng, nothing);
  check_same_contents(off, ref);
}

TEST_CASE("no offloadable layer: the first update throws ValueError and changes nothing") {
  spill_dir dir;
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 1;
  config.head_dim = 4;
  config.sliding_window = 2;  // every layer sliding
  kvc::StaticCache<float, Host, File<true>> off(config, 8);
  std::mt19937 rng(4);
  const auto before = kvc_test::take_snapshot(off);
  CHECK_THROWS_WITH_AS(off.update(random_tensor<float>(1, 1, 1, 4, rng), random_tensor<float>(1, 1, 1, 4, rng), 0),
                       kvc::offload::no_offloadable_layer_message, kvc::ValueError);
  CHECK(kvc_test::take_snapshot(off) == before);
  // Offloading the sliding layers too is the fix the message names.
  kvc::StaticCache<float, Host, File<false>> fixed(config, 8);
  kvc::StaticCache<float> ref(config, 8);
  for (int s = 0; s < 3; ++s) step<float>(fixed, ref, 2, 1, 1, 1, 4, rng, nothing);
}

TEST_CASE("full and sliding dynamic layers: whole-cache operations after offloading") {
  spill_dir dir;
  using Kinds = kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>;
  const auto make = [](auto tag) {
    using C = typename decltype(tag)::type;
    return C(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{4}, kvc::DynamicLayer{},
             kvc::DynamicSlidingWindowLayer{4});
  };
  auto off = make(std::type_identity<kvc::Cache<Kinds, Host, File<>>>{});
  auto ref = make(std::type_identity<kvc::Cache<Kinds, Host>>{});
  std::mt19937 rng(5);
  const auto decode = [&](int steps, std::int64_t batch) {
    for (int s = 0; s < steps; ++s)
      step<float>(off, ref, 4, batch, 2, 1, 8, rng, [&](std::int64_t i) {
        for (std::int64_t j = 0; j < i; ++j) CHECK(kvc::layer_ram_bytes(off, j) == 0);
      });
  };
  off.activate_past_recording();
  ref.activate_past_recording();
  for (int s = 0; s < 1; ++s) step<float>(off, ref, 4, 2, 2, 6, 8, rng, nothing);
  decode(5, 2);
  check_same_contents(off, ref);

  off.crop(-2);
  ref.crop(-2);
  check_same_contents(off, ref);
  decode(3, 2);

  off.reorder_cache({1, 0});
  ref.reorder_cache({1, 0});
  check_same_contents(off, ref);
  decode(3, 2);

  off.batch_repeat_interleave(2);
  ref.batch_repeat_interleave(2);
  check_same_contents(off, ref);
  decode(3, 4);

  off.batch_select_indices({3, 0});
  ref.batch_select_indices({3, 0});
  check_same_contents(off, ref);
  decode(3, 2);

  // A failing operation changes nothing, spilled layers included.
  decode(1, 2);
  CHECK_THROWS_AS(off.reorder_cache({0, 5}), kvc::IndexError);
  check_same_contents(off, ref);
  decode(2, 2);

  off.reset();
  ref.reset();
  check_same_contents(off, ref);
  decode(4, 2);
  check_same_contents(off, ref);
}

TEST_CASE("copying and moving a cache with spilled layers") {
  spill_dir dir;
  kvc::DynamicCache<float, Host, File<>> off;
  kvc::DynamicCache<float> ref;
  std::mt19937 rng(6);
  for (int s = 0; s < 4; ++s) step<float>(off, ref, 3, 1, 2, s == 0 ? 5 : 1, 8, rng, nothing);
  {
    auto copy = off;  // the spilled layers are copied into the copy's own spill file
    CHECK(dir.open_spill_files() == 2);
    auto ref_copy = ref;
    for (int s = 0; s < 3; ++s) step<float>(copy, ref_copy, 3, 1, 2, 1, 8, rng, nothing);
    check_same_contents(copy, ref_copy);
    check_same_contents(off, ref);  // the original is untouched
  }
  CHECK(dir.open_spill_files() == 1);
  auto moved = std::move(off);
  for (int s = 0; s < 2; ++s) step<float>(moved, ref, 3, 1, 2, 1, 8, rng, nothing);
  check_same_contents(moved, ref);
  kvc::DynamicCache<float, Host, File<>> assigned;
  kvc::DynamicCache<float> scratch;
  step<float>(assigned, scratch, 2, 1, 2, 1, 8, rng, nothing);  // a cache with its own file...
  step<float>(moved, ref, 3, 1, 2, 1, 8, rng, nothing);         // layers 0 and 1 spilled again
  assigned = moved;                                             // ...replaced by a copy with its own file
  CHECK(dir.open_spill_files() == 2);
  check_same_contents(assigned, ref);
  check_same_contents(moved, ref);
}

TEST_CASE("bfloat16 layers round-trip bit-exactly") {
  spill_dir dir(/*drop_page_cache=*/true);
  kvc::reset_offload_file_stats();
  kvc::DynamicCache<Bf16, kvc::HostStorage<Bf16>, File<>> off;
  kvc::DynamicCache<Bf16> ref;
  std::mt19937 rng(7);
  for (int s = 0; s < 6; ++s) step<Bf16>(off, ref, 3, 1, 2, s == 0 ? 9 : 1, 32, rng, nothing);
  CHECK(kvc::offload_file_stats().sync_reads == 0);
  check_same_contents(off, ref);
  // Bit patterns, not only values.
  for (std::int64_t i = 0; i < off.size(); ++i) {
    const auto a = off.stored(i).keys.to_tensor();
    const auto b = ref.stored(i).keys.to_tensor();
    CHECK(std::memcmp(a.data(), b.data(), sizeof(Bf16) * static_cast<std::size_t>(a.size())) == 0);
  }
}

TEST_CASE("a spill directory that does not exist: RuntimeError, then the cache goes on") {
  spill_dir dir;
  kvc::set_offload_file_options({dir.path + "/missing", false});
  kvc::DynamicCache<float, Host, File<>> off;
  kvc::DynamicCache<float> ref;
  std::mt19937 rng(8);
  step<float>(off, ref, 1, 1, 2, 3, 8, rng, nothing);  // layer 0 updated, to be offloaded next
  step<float>(off, ref, 1, 1, 2, 1, 8, rng, nothing);  // updating layer 0 again keeps it resident
  const auto k = random_tensor<float>(1, 2, 3, 8, rng);
  const std::string expected = "kvc::OffloadToFile: cannot create a spill file in '" + dir.path +
                               "/missing': No such file or directory. Point KVC_OFFLOAD_DIR (or "
                               "kvc::set_offload_file_options) at a writable directory. The cache is unchanged";
  // The next update offloads layer 0 first: that fails before layer 1 is touched.
  CHECK_THROWS_WITH_AS(off.update(k, k, 1), expected.c_str(), kvc::RuntimeError);
  CHECK(off.size() == 1);  // the layer the failed update appended is gone again
  CHECK(kvc::layer_ram_bytes(off, 0) > 0);
  check_same_contents(off, ref);
  // The cache is usable: with the directory fixed, decoding goes on and matches.
  kvc::set_offload_file_options({dir.path, false});
  for (int s = 0; s < 4; ++s) step<float>(off, ref, 2, 1, 2, s == 0 ? 3 : 1, 8, rng, nothing);
  check_same_contents(off, ref);
}

TEST_CASE("a full disk (a file-size limit): RuntimeError, layer kept in memory, the cache goes on") {
  spill_dir dir;
  kvc::reset_offload_file_stats();
  kvc::DynamicCache<float, Host, File<>> off;
  kvc::DynamicCache<float> ref;
  std::mt19937 rng(9);
  for (int s = 0; s < 3; ++s) step<float>(off, ref, 3, 1, 2, s == 0 ? 4 : 1, 16, rng, nothing);

  // A write past the limit would raise SIGXFSZ, whose default action (kept here: `ulimit -f` in a
  // shell that did not ignore it) ends the process; kvc refuses the write first, with EFBIG.
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_DFL);
  rlimit tight = saved;
  tight.rlim_cur = 0;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &tight) == 0);
  const auto k = random_tensor<float>(1, 2, 1, 16, rng);
  std::string message;
  try {
    off.update(k, k, 0);  // offloads layer 2 first
  } catch (const kvc::RuntimeError& e) {
    message = e.what();
  }
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &saved) == 0);
  std::signal(SIGXFSZ, old_handler);
  CHECK(message.starts_with("kvc::OffloadToFile: offloading layer "));
  CHECK(message.find("failed while writing the spill file in '" + dir.path +
                     "': File too large. The layer stays in "
                     "memory and the cache is unchanged") != std::string::npos);
  CHECK(kvc::layer_ram_bytes(off, 2) > 0);  // the layer that could not be written stays in memory
  CHECK(off.size() == 3);
  check_same_contents(off, ref);
  // Usable and correct afterwards.
  for (int s = 0; s < 4; ++s) step<float>(off, ref, 3, 1, 2, 1, 16, rng, nothing);
  check_same_contents(off, ref);
}

TEST_CASE("hybrid layers: both the linear and the attention part are offloaded") {
  spill_dir dir;
  using C = kvc::ConfiguredDynamicCache<float, Host, File<>>;
  using R = kvc::ConfiguredDynamicCache<float>;
  const auto kinds = [](auto tag) {
    using K = typename decltype(tag)::type::kind_variant;
    return std::vector<K>{kvc::LinearAttentionAndFullAttentionLayer{}, kvc::DynamicLayer{},
                          kvc::LinearAttentionAndSlidingWindowAttentionLayer{{4}, 1}, kvc::LinearAttentionLayer{}};
  };
  C off(kinds(std::type_identity<C>{}));
  R ref(kinds(std::type_identity<R>{}));
  std::mt19937 rng(10);
  const auto state_values = [](const auto& view) {
    std::vector<double> out;
    for (std::int64_t i = 0; i < view.size(); ++i) out.push_back(static_cast<double>(view[i]));
    return out;
  };
  for (int s = 0; s < 5; ++s) {
    for (std::int64_t i = 0; i < 4; ++i) {
      CAPTURE(s);
      CAPTURE(i);
      if (i != 1) {
        Eigen::Tensor<float, 3, Eigen::RowMajor> conv(1, 3, 4);
        for (std::int64_t j = 0; j < conv.size(); ++j) conv.data()[j] = static_cast<float>(rng() % 64) / 8.f;
        // The Cache brings an offloaded hybrid back itself before changing its linear states.
        CHECK(state_values(off.update_conv_state(conv, i)) == state_values(ref.update_conv_state(conv, i)));
      }
      if (i == 3) continue;  // pure linear: no K/V
      const auto k = random_tensor<float>(1, 2, s == 0 ? 3 : 1, 8, rng);
      check_same(off.update(k, k, i), ref.update(k, k, i));
      if (i == 2) {
        // Layer 0 (a hybrid) is fully spilled: no buffer of either part is in memory.
        CHECK(kvc::layer_ram_bytes(off, 0) == 0);
        if (s > 0) CHECK(kvc::layer_ram_bytes(off, 3) > 0);  // pure linear: never offloaded
      }
    }
  }
  for (std::int64_t i = 0; i < 3; ++i) check_same(off.stored(i), ref.stored(i));
  CHECK(off.has_previous_state(3) == ref.has_previous_state(3));
}

TEST_CASE("docs/offload.md: using OffloadToFile") {
  spill_dir dir;
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.head_dim = 8;
  kvc::HostTensor<float> keys(1, 2, 3, 8), values(1, 2, 3, 8);
  keys.setConstant(1.f);
  values.setConstant(2.f);
  const std::int64_t layer_idx = 0;
  // [snippet:using_offload_to_file]
  // transformers' DynamicCache(offloading=True), offload_only_non_sliding=False:
  kvc::DynamicCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<>> cache;
  // transformers' StaticCache(config, 4096, offloading=True), offload_only_non_sliding=True:
  kvc::StaticCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<true>> fixed(config, 4096);

  auto [k, v] = cache.update(keys, values, layer_idx);  // as without offloading
  // [/snippet]
  CHECK(k.extent(2) == 3);
  CHECK(v(0, 1, 2, 7) == 2.f);
  CHECK(fixed.update(keys, values, 1).keys.extent(2) == 4096);
}

TEST_CASE("prefetching across linear-attention layers wraps from layer 7 to layer 3") {
  // transformers' test_offloaded_cache_prefetches_across_linear_attention_layers.
  // 8 layers: DynamicLayer where i % 4 == 3, LinearAttentionLayer elsewhere; sliding layers offloaded
  // too (transformers' offload_only_non_sliding=False). The file tier stands in for the accelerator.
  spill_dir dir;
  kvc::reset_offload_file_stats();
  using C = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::LinearAttentionLayer>, Host, File<false>>;
  std::vector<C::kind_variant> kinds;
  for (int i = 0; i < 8; ++i) {
    if (i % 4 == 3)
      kinds.emplace_back(kvc::DynamicLayer{});
    else
      kinds.emplace_back(kvc::LinearAttentionLayer{});
  }
  C cache(kinds);
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::LinearAttentionLayer>> ref(kinds);
  std::mt19937 rng(9);
  for (const std::int64_t q : {5, 1, 1}) {
    for (const std::int64_t layer : {3, 7}) {
      const auto k = random_tensor<float>(1, 4, q, 16, rng);
      const auto got = cache.update(k, k, layer);
      check_same(got, ref.update(k, k, layer));
      // The returned keys are in memory ("on the accelerator"), the other attention layer is not.
      CHECK(kvc::layer_ram_bytes(cache, layer) > 0);
      CHECK(kvc::layer_ram_bytes(cache, layer == 3 ? 7 : 3) == 0);
    }
  }
  // After the prefill, every read was served by the prefetch: layer 7's update prefetched layer 3
  // (wrapping around, past the linear layers), and layer 3's prefetched layer 7.
  const auto stats = kvc::offload_file_stats();
  CHECK(stats.sync_reads == 0);
  CHECK(stats.prefetch_hits == 4);
  for (const std::int64_t layer : {3, 7}) check_same(cache.stored(layer), ref.stored(layer));
}

TEST_CASE("a deep copy that fails on a full disk leaves the spill counters as they were") {
  spill_dir dir;
  kvc::DynamicCache<float, Host, File<>> off;
  kvc::DynamicCache<float> ref;
  std::mt19937 rng(12);
  for (int s = 0; s < 2; ++s) step<float>(off, ref, 4, 1, 2, s == 0 ? 4 : 1, 8, rng, nothing);
  const kvc::OffloadFileStats before = kvc::offload_file_stats();
  REQUIRE(before.spilled_layers >= 3);
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  rlimit tight = saved;
  tight.rlim_cur = 0;  // the copy's spill file cannot take a byte
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &tight) == 0);
  for (int attempt = 0; attempt < 3; ++attempt) {
    CAPTURE(attempt);
    CHECK_THROWS_AS([&] { auto copy = off; }(), kvc::RuntimeError);
    // A failed copy used to uncount every spilled layer of the source: -3 per attempt.
    CHECK(kvc::offload_file_stats().spilled_layers == before.spilled_layers);
    CHECK(kvc::offload_file_stats().spilled_bytes == before.spilled_bytes);
  }
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &saved) == 0);
  check_same_contents(off, ref);
}

TEST_CASE("EncoderDecoderCache::reset when one half cannot be read back changes neither half") {
  using D = kvc::DynamicCache<float, Host, File<>>;
  kvc::EncoderDecoderCache<D, D> pair{D(), D()};
  std::mt19937 rng(13);
  kvc::DynamicCache<float> self_ref, cross_ref;
  spill_dir self_dir;
  for (int s = 0; s < 2; ++s)
    step<float>(pair.self_attention_cache(), self_ref, 2, 1, 2, s == 0 ? 3 : 1, 8, rng, nothing);
  spill_dir cross_dir;  // the cross-attention half's spill file lives here
  // Three layers: after the last update layer 2 is pending, layer 0 is prefetched (read before the
  // file is broken below) and layer 1 can only come back from the file.
  for (int s = 0; s < 2; ++s) step<float>(pair.cross_attention_cache(), cross_ref, 3, 1, 2, 4, 8, rng, nothing);
  REQUIRE(cross_dir.open_spill_files() == 1);
  // Make the cross half's spill file unreadable: its descriptor now refers to a write-only file.
  const std::string prefix = cross_dir.path + "/kvc-spill-";
  int spill_fd = -1;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string().starts_with(prefix))
      spill_fd = std::stoi(e.path().filename().string());
  }
  REQUIRE(spill_fd >= 0);
  const int null_fd = ::open("/dev/null", O_WRONLY);
  REQUIRE(null_fd >= 0);
  REQUIRE(::dup2(null_fd, spill_fd) == spill_fd);
  ::close(null_fd);
  pair.set_is_updated(0);
  // reset used to reset the self-attention half, then fail on the cross half: self 0, cross 8.
  CHECK_THROWS_AS(pair.reset(), kvc::RuntimeError);
  CHECK(pair.self_attention_cache().get_seq_length() == 4);
  CHECK(pair.is_updated(0));
  check_same_contents(pair.self_attention_cache(), self_ref);
  CHECK(pair.cross_attention_cache().size() == 3);
}

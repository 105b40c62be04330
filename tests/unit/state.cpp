// kvc::save / kvc::load and the paged cache's save_request / load_request (docs/state.md): bit-exact
// round trips for every layer kind, the fingerprint's messages, truncated and corrupted files, and
// the strong guarantee (the target unchanged after every failure).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <istream>
#include <random>
#include <streambuf>
#include <sstream>
#include <string>
#include <vector>

#include "../support/kvc_test.hpp"

#include <kvc/state.hpp>

#include <sys/stat.h>
#include <unistd.h>

namespace {

using kvc_test::random_tensor;
using kvc_test::take_snapshot;

// A sink and a source in memory: write_state's payload without the file around it.
struct string_sink {
  std::string bytes;
  void put(const void* p, std::size_t n) { bytes.append(static_cast<const char*>(p), n); }
};
struct string_source {
  std::string bytes;
  std::size_t at = 0;
  void get(void* p, std::size_t n) {
    if (n > bytes.size() - at) throw kvc::StateError("kvc::load: the state is truncated");
    std::memcpy(p, bytes.data() + at, n);
    at += n;
  }
  std::uint64_t available() const { return bytes.size() - at; }
};

std::string saved(const auto& cache) {
  std::ostringstream os(std::ios::binary);
  kvc::save(cache, os);
  return os.str();
}

template <class C>
void load_from(C& cache, const std::string& bytes) {
  std::istringstream is(bytes, std::ios::binary);
  kvc::load(cache, is);
}

// The message of the StateError that loading `bytes` into `cache` throws; checks that the cache
// did not change.
template <class C>
std::string load_error(C& cache, const std::string& bytes) {
  const auto before = take_snapshot(cache);
  std::string message = "(no exception)";
  try {
    load_from(cache, bytes);
  } catch (const kvc::StateError& e) {
    message = e.what();
  }
  CHECK(take_snapshot(cache) == before);
  return message;
}

// A snapshot without the allocated bytes (a loaded layer holds its tokens in a buffer of exactly
// their size, so that number may differ; everything a caller reads must not).
kvc_test::snapshot observed(const auto& cache) {
  auto s = take_snapshot(cache);
  s.bytes = 0;
  return s;
}

// Every element of both views, bit for bit.
template <class View>
bool same_bits(const View& a, const View& b) {
  if (a.extents != b.extents) return false;
  for (std::int64_t i0 = 0; i0 < a.extent(0); ++i0)
    for (std::int64_t i1 = 0; i1 < a.extent(1); ++i1)
      for (std::int64_t i2 = 0; i2 < a.extent(2); ++i2)
        for (std::int64_t i3 = 0; i3 < a.extent(3); ++i3) {
          const auto x = a(i0, i1, i2, i3), y = b(i0, i1, i2, i3);
          if (std::memcmp(&x, &y, sizeof x) != 0) return false;
        }
  return true;
}

// Saves `a`, loads into `b`, and checks: the same observable state, the same bytes when `b` is
// saved again, and the same results bit for bit for `steps` more updates of every layer.
template <class C>
void check_round_trip(C& a, C& b, std::int64_t batch, std::int64_t heads, std::int64_t dim, std::mt19937& rng,
                      int steps = 3) {
  const std::string bytes = saved(a);
  load_from(b, bytes);
  CHECK(observed(b) == observed(a));
  CHECK(saved(b) == bytes);
  using T = typename C::element_type;
  for (int s = 0; s < steps; ++s)
    for (std::int64_t l = 0; l < a.size(); ++l) {
      if (a.is_linear()[static_cast<std::size_t>(l)]) continue;
      const auto k = random_tensor<T>(batch, heads, s == 1 ? 4 : 1, dim, rng);
      const auto v = random_tensor<T>(batch, heads, s == 1 ? 4 : 1, dim, rng);
      const auto x = a.update(k, v, l);
      const auto y = b.update(k, v, l);
      CHECK_MESSAGE(same_bits(x.keys, y.keys), "layer " << l << " step " << s);
      CHECK(same_bits(x.values, y.values));
    }
  CHECK(observed(b) == observed(a));
}

// `n` updates of q tokens to every K/V layer.
// (A replicated cache without layers gets three.)
template <class C>
void fill(C& c, std::int64_t batch, std::int64_t heads, std::int64_t dim, std::int64_t n, std::int64_t q,
          std::mt19937& rng) {
  using T = typename C::element_type;
  const std::int64_t layers = c.size() == 0 ? 3 : c.size();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t l = 0; l < layers; ++l)
      if (l >= c.size() || !c.is_linear()[static_cast<std::size_t>(l)])
        c.update(random_tensor<T>(batch, heads, q, dim, rng), random_tensor<T>(batch, heads, q, dim, rng), l);
}

using Mixed = kvc::Cache<
    kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer, kvc::StaticLayer, kvc::StaticSlidingWindowLayer>>;
Mixed mixed(std::int64_t window = 5, std::int64_t max_cache_len = 24) {
  return Mixed(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{window}, kvc::StaticLayer{max_cache_len},
               kvc::StaticSlidingWindowLayer{max_cache_len, window});
}

kvc::ModelConfig config(std::int64_t layers, std::int64_t kv_heads, std::int64_t head_dim) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = kv_heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.hidden_size = kv_heads * head_dim;
  return c;
}

}  // namespace

TEST_CASE("XXH64 gives the specification's values") {
  CHECK(kvc::detail::xxh64("", 0, 0) == 0xEF46DB3751D8E999ULL);
  CHECK(kvc::detail::xxh64("abc", 3, 0) == 0x44BC2CF5AD770999ULL);
  const std::string long_text = "Nobody inspects the spammish repetition";  // 39 bytes: the 32-byte stripes too
  CHECK(kvc::detail::xxh64(long_text.data(), long_text.size(), 0) == 0xFBCEA83C8A378BF1ULL);
}

TEST_CASE_TEMPLATE("save/load: DynamicCache round trips bit for bit", T, float, double, Eigen::half, Eigen::bfloat16) {
  std::mt19937 rng(7);
  kvc::DynamicCache<T> a, b;
  fill(a, 2, 3, 4, 5, 3, rng);
  a.crop(-2);
  check_round_trip(a, b, 2, 3, 4, rng);
  // A replicated cache takes the file's layer count, more or fewer than it had.
  kvc::DynamicCache<T> more;
  fill(more, 2, 3, 4, 1, 1, rng);
  more.update(random_tensor<T>(2, 3, 1, 4, rng), random_tensor<T>(2, 3, 1, 4, rng), 5);
  load_from(more, saved(a));
  CHECK(observed(more) == observed(a));
  // An empty cache, and a cache whose layers are initialized without tokens.
  kvc::DynamicCache<T> empty, e2;
  load_from(e2, saved(empty));
  CHECK(e2.size() == 0);
  kvc::DynamicCache<T> early;
  early.update(random_tensor<T>(1, 2, 1, 4, rng), random_tensor<T>(1, 2, 1, 4, rng), 2);
  early.reset();
  load_from(e2, saved(early));
  CHECK(observed(e2) == observed(early));
}

TEST_CASE("save/load: dynamic, sliding, static and static sliding layers, before and past the window") {
  for (const std::int64_t tokens : {0, 3, 4, 9, 30}) {
    CAPTURE(tokens);
    std::mt19937 rng(11 + static_cast<unsigned>(tokens));
    Mixed a = mixed(), b = mixed();
    if (tokens == 30) a.activate_past_recording();
    if (tokens > 0) fill(a, 2, 2, 3, 1, tokens % 10 == 0 ? 10 : tokens, rng);
    if (tokens == 30) fill(a, 2, 2, 3, 2, 1, rng);
    check_round_trip(a, b, 2, 2, 3, rng, tokens == 30 ? 0 : 3);
  }
  // Early-initialized static layers: zeros and the write position round trip.
  std::mt19937 rng(3);
  Mixed a = mixed(), b = mixed();
  a.early_initialization(1, 2, 3);
  check_round_trip(a, b, 1, 2, 3, rng);
}

TEST_CASE("save/load: quantized caches (quanto and HQQ, append_only, rotated too) round trip bit for bit") {
  for (const char* backend : {"quanto", "hqq"})
    for (const bool append_only : {false, true})
      for (const int rotate : {0, 1, 2}) {  // none, keys, values
        CAPTURE(backend);
        CAPTURE(append_only);
        CAPTURE(rotate);
        std::mt19937 rng(5);
        const kvc::QuantizedOptions opts{.nbits = 4,
                                         .q_group_size = 8,
                                         .residual_length = 3,
                                         .append_only = append_only,
                                         .rotate_keys = rotate == 1,
                                         .rotate_values = rotate == 2};
        kvc::QuantizedCache<float> a(backend, config(2, 2, 8), opts), b(backend, config(2, 2, 8), opts);
        fill(a, 1, 2, 8, 1, 6, rng);
        fill(a, 1, 2, 8, 5, 1, rng);
        check_round_trip(a, b, 1, 2, 8, rng, 5);
        // Another option: named.
        kvc::QuantizedOptions other = opts;
        other.residual_length = 4;
        kvc::QuantizedCache<float> c(backend, config(2, 2, 8), other);
        CHECK(load_error(c, saved(a)) == "kvc::load: layer 0 (" + std::string(c.layer_name(0)) +
                                             "): residual_length is 3 in the file and 4 in the cache");
        other = opts;
        other.rotate_keys = !opts.rotate_keys;
        kvc::QuantizedCache<float> d(backend, config(2, 2, 8), other);
        CHECK(load_error(d, saved(a)) == "kvc::load: layer 0 (" + std::string(d.layer_name(0)) + "): rotate_keys is " +
                                             (opts.rotate_keys ? "1" : "0") + " in the file and " +
                                             (opts.rotate_keys ? "0" : "1") + " in the cache");
        // Values at their own width: saved, and named when they differ.
        other = opts;
        other.value_nbits = 2;
        kvc::QuantizedCache<float> e(backend, config(2, 2, 8), other), f(backend, config(2, 2, 8), other);
        fill(e, 1, 2, 8, 1, 6, rng);
        fill(e, 1, 2, 8, 5, 1, rng);
        check_round_trip(e, f, 1, 2, 8, rng, 5);
        kvc::QuantizedCache<float> g(backend, config(2, 2, 8), opts);
        CHECK(load_error(g, saved(e)) == "kvc::load: layer 0 (" + std::string(g.layer_name(0)) +
                                             "): value_nbits is 2 in the file and 4 in the cache");
        other.value_nbits = 4;  // the keys' width, spelled out: the same layer as 0
        kvc::QuantizedCache<float> h(backend, config(2, 2, 8), other);
        load_from(h, saved(a));
        CHECK(observed(h) == observed(a));
      }
}

TEST_CASE("save/load: linear-attention layers and hybrids keep their conv and recurrent states") {
  using Linear = kvc::Cache<
      kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer, kvc::LinearAttentionAndSlidingWindowAttentionLayer>>;
  const auto make = [] {
    return Linear(kvc::LinearAttentionLayer{2}, kvc::DynamicLayer{},
                  kvc::LinearAttentionAndSlidingWindowAttentionLayer{{4}, 1});
  };
  std::mt19937 rng(9);
  Linear a = make(), b = make();
  Eigen::Tensor<float, 3, Eigen::RowMajor> conv(2, 3, 5), rec(2, 4, 4);
  conv.setRandom();
  rec.setRandom();
  a.update_conv_state(conv, 0, 0, 3);
  a.update_recurrent_state(rec, 0, 1);
  a.update_conv_state(conv, 2, 0, 4);
  fill(a, 2, 2, 4, 2, 3, rng);
  check_round_trip(a, b, 2, 2, 4, rng);
  // Both go on the same way: the conv window continues from the loaded columns.
  Eigen::Tensor<float, 3, Eigen::RowMajor> more(2, 3, 1);
  more.setConstant(0.5f);
  const auto x = a.update_conv_state(more, 0, 0);
  const auto y = b.update_conv_state(more, 0, 0);
  REQUIRE(x.size() == y.size());
  CHECK(std::memcmp(x.data(), y.data(), sizeof(float) * static_cast<std::size_t>(x.size())) == 0);
  CHECK(observed(b) == observed(a));
}

TEST_CASE("save/load: indexed layers keep their indexer keys") {
  using Indexed = kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer, kvc::StaticIndexedLayer>>;
  const auto make = [] { return Indexed(kvc::DynamicIndexedLayer{}, kvc::StaticIndexedLayer{16}); };
  std::mt19937 rng(13);
  Indexed a = make(), b = make();
  fill(a, 2, 2, 4, 2, 3, rng);
  Eigen::Tensor<float, 3, Eigen::RowMajor> keys(2, 6, 5);
  keys.setRandom();
  a.update_indexer(keys, 0);
  a.update_indexer(keys, 1);
  check_round_trip(a, b, 2, 2, 4, rng);
}

TEST_CASE("save/load: EncoderDecoderCache keeps both caches and is_updated") {
  using Dyn = kvc::DynamicCache<float>;
  std::mt19937 rng(17);
  kvc::EncoderDecoderCache<Dyn, Dyn> a{Dyn(), Dyn()}, b{Dyn(), Dyn()};
  fill(a.self_attention_cache(), 1, 2, 4, 3, 2, rng);
  a.cross_attention_cache().update(random_tensor<float>(1, 2, 7, 4, rng), random_tensor<float>(1, 2, 7, 4, rng), 0);
  a.set_is_updated(0);
  const std::string bytes = saved(a);
  load_from(b, bytes);
  CHECK(b.is_updated() == a.is_updated());
  CHECK(observed(b.self_attention_cache()) == observed(a.self_attention_cache()));
  CHECK(observed(b.cross_attention_cache()) == observed(a.cross_attention_cache()));
  CHECK(saved(b) == bytes);
  // A contiguous cache's file is not an EncoderDecoderCache's, and the other way round.
  CHECK_THROWS_WITH_AS(load_from(b, saved(Dyn())),
                       "kvc::load: the state: the cache type is 'Cache' in the file and 'EncoderDecoderCache' in the "
                       "cache",
                       kvc::StateError);
  Dyn d;
  CHECK(load_error(d, bytes) ==
        "kvc::load: the state: the cache type is 'EncoderDecoderCache' in the file and 'Cache' in the cache");
}

TEST_CASE("kvc::load names what differs, and leaves the cache as it was") {
  std::mt19937 rng(19);
  Mixed a = mixed();
  fill(a, 1, 2, 3, 1, 4, rng);
  const std::string bytes = saved(a);

  Mixed target = mixed();
  fill(target, 1, 2, 3, 1, 2, rng);  // holds something: a failed load must keep it
  SUBCASE("another parameter") {
    Mixed w = mixed(6);
    CHECK(load_error(w, bytes) ==
          "kvc::load: layer 1 (DynamicSlidingWindowLayer): sliding_window is 5 in the "
          "file and 6 in the cache");
    Mixed m = mixed(5, 25);
    CHECK(load_error(m, bytes) ==
          "kvc::load: layer 2 (StaticLayer): max_cache_len is 24 in the file and 25 in the cache");
  }
  SUBCASE("another layer kind, or another layer count") {
    using Two = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>;
    Two kinds(kvc::DynamicLayer{}, kvc::StaticLayer{24}, kvc::DynamicLayer{}, kvc::StaticLayer{24});
    CHECK(load_error(kinds,
                     saved(Two(kvc::DynamicLayer{}, kvc::DynamicLayer{}, kvc::DynamicLayer{}, kvc::DynamicLayer{}))) ==
          "kvc::load: layer 1: the file holds a DynamicLayer and the cache a StaticLayer");
    Two three(kvc::DynamicLayer{}, kvc::StaticLayer{24}, kvc::DynamicLayer{});
    CHECK(load_error(three, saved(kinds)) == "kvc::load: the state: the file has 4 layers and the cache 3");
  }
  SUBCASE("another element type") {
    kvc::DynamicCache<Eigen::half> h;
    CHECK(load_error(h, saved(kvc::DynamicCache<float>())) ==
          "kvc::load: the state: the element type is 'float' in the file and 'half' in the cache");
  }
  SUBCASE("another shape than an initialized layer's") {
    Mixed other = mixed();
    fill(other, 2, 2, 3, 1, 1, rng);
    CHECK(load_error(other, bytes) ==
          "kvc::load: layer 0 (DynamicLayer): the file holds batch 1, 2 heads, key head_dim 3 and value head_dim "
          "3, and the cache batch 2, 2 heads, key head_dim 3 and value head_dim 3");
  }
  SUBCASE("not kvc's, another version, truncated, corrupted") {
    CHECK(load_error(target, "GGUF and more bytes") == "kvc::load: not a kvc state (it does not start with KVCSTATE)");
    CHECK(load_error(target, "") == "kvc::load: not a kvc state (it does not start with KVCSTATE)");
    std::string v3 = bytes;
    v3[8] = 5;  // before quantized layers saved value_nbits
    CHECK(load_error(target, v3) == "kvc::load: the state has format version 5, and this kvc reads version 6");
    const std::string cut = bytes.substr(0, bytes.size() - 100);
    CHECK(load_error(target, cut) == "kvc::load: the file is truncated: it announces " +
                                         std::to_string(bytes.size() - 32) + " bytes of state and a checksum, and " +
                                         std::to_string(bytes.size() - 124) + " bytes follow");
    std::string flipped = bytes;
    flipped[bytes.size() - 20] ^= 0x40;  // a K/V value of the last layer
    CHECK(load_error(target, flipped)
              .starts_with("kvc::load: the checksum does not match: the state is corrupted (stored 0x"));
  }
  SUBCASE("every truncation and every single-byte change of the header fails cleanly") {
    for (std::size_t n = 0; n < bytes.size(); n += 7) {
      std::istringstream is(bytes.substr(0, n), std::ios::binary);
      CHECK_THROWS_AS(kvc::load(target, is), kvc::StateError);
    }
    const auto before = take_snapshot(target);
    for (std::size_t i = 0; i < 200 && i < bytes.size(); ++i) {
      std::string b = bytes;
      b[i] = static_cast<char>(b[i] ^ 0x5a);
      std::istringstream is(b, std::ios::binary);
      CHECK_THROWS(kvc::load(target, is));
    }
    CHECK(take_snapshot(target) == before);
  }
}

TEST_CASE("save/load: files, written whole through a temporary") {
  kvc_test::spill_dir dir;
  std::mt19937 rng(23);
  kvc::DynamicCache<float> a, b;
  fill(a, 1, 2, 4, 2, 3, rng);
  const std::filesystem::path root(dir.path);
  kvc::save(a, root / "cache.kvc");
  CHECK(!std::filesystem::exists(root / "cache.kvc.tmp"));
  kvc::load(b, root / "cache.kvc");
  CHECK(observed(b) == observed(a));
  CHECK_THROWS_WITH_AS(kvc::load(b, root / "missing.kvc"),
                       ("kvc::load: cannot open " + (root / "missing.kvc").string()).c_str(), kvc::StateError);
}

TEST_CASE("StateLoader: layer by layer, each usable as soon as it is loaded") {
  std::mt19937 rng(29);
  kvc::DynamicCache<float> a, b;
  fill(a, 1, 2, 4, 2, 3, rng);
  string_sink s;
  kvc::write_state(a, s);
  const std::string payload = s.bytes;
  string_source src{payload};
  kvc::StateLoader loader(b, src);
  CHECK(loader.layers() == a.size());
  loader.load_through(0);
  CHECK(loader.loaded() == 1);
  CHECK(b.get_seq_length(0) == a.get_seq_length(0));
  loader.load_all();
  CHECK(src.at == payload.size());
  CHECK(observed(b) == observed(a));
  CHECK_THROWS_AS(loader.load_next(), kvc::StateError);
}

TEST_CASE("save_request/load_request: a paged request moves to another cache bit for bit") {
  using Paged = kvc::PagedCache<kvc::HostStorage<float>>;
  const std::int64_t heads = 2, dim = 3;
  kvc::ModelConfig m = config(2, heads, dim);
  m.sliding_window = 6;
  m.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  cb.allow_block_sharing = false;
  Paged a(m, cb), b(m, cb);
  REQUIRE(b.allocate_blocks(2, "other", 0));  // so that the request lands on other blocks in b
  const auto view = [](const kvc::HostTensor<float>& t) {
    return kvc::TensorView<float>{
        t.data(),
        {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)},
        {t.dimension(1) * t.dimension(2) * t.dimension(3), t.dimension(2) * t.dimension(3), t.dimension(3), 1}};
  };
  // One step of request `id` with q tokens after `past`: what attention reads, every layer.
  const auto run = [&](Paged& c, const std::string& id, std::int64_t past, std::int64_t q, std::int64_t& alloc,
                       unsigned seed) {
    std::mt19937 rng(seed);
    const std::int64_t need = (past + q + 3) / 4 - alloc;
    if (need > 0) alloc += *c.allocate_blocks(need, id, alloc);
    kvc::PagedIndices reads(2), writes(2);
    c.extend_read_and_write_indices(id, past, q, past == 0 ? nullptr : &reads, writes);
    std::vector<std::vector<double>> out;
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = random_tensor<float>(1, heads, q, dim, rng), v = random_tensor<float>(1, heads, q, dim, rng);
      const auto got = c.update(view(k), view(v), layer, reads, writes);
      out.push_back(kvc_test::flatten(got.keys));
      out.push_back(kvc_test::flatten(got.values));
    }
    return out;
  };
  std::int64_t alloc_a = 0, past = 0;
  unsigned seed = 1;
  for (const std::int64_t q : {9, 1, 1, 1, 1}) {
    run(a, "r", past, q, alloc_a, seed++);
    past += q;
  }
  std::ostringstream os(std::ios::binary);
  kvc::save_request(a, "r", os);
  const std::string bytes = os.str();
  {
    std::istringstream is(bytes, std::ios::binary);
    kvc::load_request(b, "q", is);
  }
  CHECK(b.blocks_in_use("q") == a.blocks_in_use("r"));
  std::int64_t alloc_b = alloc_a;
  CHECK(run(a, "r", past, 1, alloc_a, 99) == run(b, "q", past, 1, alloc_b, 99));
  CHECK(run(a, "r", past + 1, 1, alloc_a, 100) == run(b, "q", past + 1, 1, alloc_b, 100));

  const auto load_message = [&](Paged& c, const std::string& id, const std::string& file) {
    const std::int64_t free = c.get_num_free_blocks();
    std::string message = "(no exception)";
    try {
      std::istringstream is(file, std::ios::binary);
      kvc::load_request(c, id, is);
    } catch (const kvc::StateError& e) {
      message = e.what();
    }
    CHECK(c.get_num_free_blocks() == free);  // nothing allocated
    return message;
  };
  CHECK(load_message(b, "q", bytes) ==
        "kvc::load: request q: the cache already holds this request; free_blocks it first");
  kvc::ContinuousBatchingConfig other = cb;
  other.block_size = 8;
  Paged c(m, other);
  CHECK(load_message(c, "q", bytes) == "kvc::load: request q: block_size is 4 in the file and 8 in the cache");
  std::string flipped = bytes;
  flipped[bytes.size() - 20] ^= 1;  // (a row's element: the last 8 bytes before the checksum say "no states")
  CHECK(load_message(b, "fresh", flipped).starts_with("kvc::load: the checksum does not match"));
  CHECK(b.blocks_in_use("fresh") == 0);
  Paged small(m, [&] {
    kvc::ContinuousBatchingConfig s = cb;
    s.num_blocks = 6;
    return s;
  }());
  REQUIRE(small.allocate_blocks(3, "x", 0));
  CHECK(load_message(small, "q", bytes) == "kvc::load: request q: the request needs 6 free blocks and the cache has " +
                                               std::to_string(small.get_num_free_blocks()));
}

namespace {

// A payload written value by value in the format of docs/state.md, for the loader's checks.
struct crafted {
  string_sink sink;
  kvc::detail::state_writer<string_sink> w{sink};
  // The header of a float Cache with n layers, and the kind name of the first.
  crafted(std::int64_t layers, std::string_view kind) {
    w.text("Cache");
    w.text("float");
    w.param("element_size", 4);
    w.value(layers);
    w.text(kind);
  }
};
template <class C>
std::string loader_error(C& cache, const std::string& payload) {
  const auto before = take_snapshot(cache);
  string_source src{payload};
  std::string message = "(no exception)";
  try {
    kvc::StateLoader loader(cache, src);
    loader.load_all();
  } catch (const kvc::StateError& e) {
    message = e.what();
  }
  CHECK(take_snapshot(cache) == before);
  return message;
}

}  // namespace

TEST_CASE("kvc::load checks every value of a payload it reads") {
  kvc::DynamicCache<float> dyn;
  {
    crafted c(1, "DynamicLayer");
    c.w.value(2);  // initialized
    CHECK(loader_error(dyn, c.sink.bytes) == "kvc::load: layer 0 (DynamicLayer): a flag is 2, not 0 or 1");
  }
  {
    crafted c(1, "DynamicLayer");
    c.w.value(false);
    c.w.value(5);  // tokens in an uninitialized layer
    CHECK(loader_error(dyn, c.sink.bytes) ==
          "kvc::load: layer 0 (DynamicLayer): the saved state is inconsistent (the token count)");
  }
  {
    crafted c(1, "DynamicLayer");
    c.w.value(true);
    c.w.value(1000);
    for (const std::int64_t x : {1, 1, 4, 4}) c.w.value(x);  // the shape, and no rows after it
    CHECK(loader_error(dyn, c.sink.bytes) ==
          "kvc::load: layer 0 (DynamicLayer): the layer's keys and values would "
          "need 32000 bytes, and only 0 remain");
  }
  {
    crafted c(1, "DynamicLayer");
    c.w.value(true);
    c.w.value(0);
    c.w.value(-1);  // batch
    CHECK(loader_error(dyn, c.sink.bytes) ==
          "kvc::load: layer 0 (DynamicLayer): the batch size is -1, outside [0, 1099511627776]");
  }
  {
    crafted c(kvc::max_layers + 1, "DynamicLayer");
    CHECK(loader_error(dyn, c.sink.bytes) == "kvc::load: the state: the file has " +
                                                 std::to_string(kvc::max_layers + 1) +
                                                 " layers, above kvc's limit of " + std::to_string(kvc::max_layers));
  }
  {
    string_sink s;
    kvc::detail::state_writer<string_sink> w{s};
    w.text("Cache");
    w.text("float");
    w.param("element_size", 4);
    w.value(1);
    w.value(std::int64_t{5000});
    CHECK(loader_error(dyn, s.bytes) == "kvc::load: layer 0: a name of 5000 bytes is longer than any kvc writes");
  }
  using Sliding = kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>>;
  Sliding sliding(kvc::DynamicSlidingWindowLayer{4});
  {
    string_sink s;
    kvc::detail::state_writer<string_sink> w{s};
    w.text("Cache");
    w.text("float");
    w.param("element_size", 4);
    w.value(1);
    w.text("DynamicSlidingWindowLayer");
    w.param("window", 4);
    CHECK(loader_error(sliding, s.bytes) ==
          "kvc::load: layer 0 (DynamicSlidingWindowLayer): the file has a "
          "parameter 'window' where kvc expects 'sliding_window'");
  }
  {
    // A quantized tensor whose arrays do not match its layout.
    auto q =
        kvc::QuantizedCache<float>("quanto", config(1, 1, 4), {.nbits = 4, .q_group_size = 4, .residual_length = 2});
    std::mt19937 rng(2);
    fill(q, 1, 1, 4, 3, 1, rng);  // three tokens: two quantized
    std::string payload;
    {
      string_sink s;
      kvc::write_state(q, s);
      payload = s.bytes;
    }
    kvc::DynamicCache<float> d;
    CHECK(loader_error(d, payload) ==
          "kvc::load: layer 0: the file holds a QuantoQuantizedLayer and the cache a DynamicLayer");
    auto fresh =
        kvc::QuantizedCache<float>("quanto", config(1, 1, 4), {.nbits = 4, .q_group_size = 4, .residual_length = 2});
    string_source ok{payload};
    kvc::StateLoader(fresh, ok).load_all();
    CHECK(observed(fresh) == observed(q));
  }
  {
    string_source src{""};
    kvc::DynamicCache<float> d;
    CHECK_THROWS_WITH_AS(kvc::StateLoader(d, src), "kvc::load: the state is truncated", kvc::StateError);
  }
}

TEST_CASE("kvc::load: a quantized layer's chunks are cut and coded as the layer writes them") {
  // attend_quantized reads chunk c of the keys with chunk c of the values, and every chunk at its
  // part's width, grouping and group size: a file whose chunks differ (token totals equal) is refused
  // before anything is read past a chunk list.
  using QT = kvc::detail::quantized_tensor<kvc::detail::quant_meta_t<float>>;
  constexpr auto grouping = kvc::QuantoCodec::grouping(0);  // axis_key = axis_value = 0
  std::mt19937 rng(61);
  const auto rows = random_tensor<float>(1, 1, 4, 4, rng);
  // A chunk of rows [t0, t0 + n) of `rows` (batch 1, head 1, head_dim 4).
  const auto chunk = [&](std::int64_t t0, std::int64_t n, int nbits = 4,
                         kvc::detail::quant_grouping g = kvc::detail::quant_grouping::along_head_dim,
                         std::int64_t group = 4) {
    return QT::encode<kvc::QuantoCodec>(nbits, g, group, rows.data() + t0 * 4, 1, 1, n, 4, 16, 16);
  };
  // A one-layer payload: the options (value_nbits 0: values at nbits), four quantized tokens, no
  // residual, then K's and V's chunks.
  const auto payload = [](bool append_only, std::vector<QT> k, std::vector<QT> v) {
    crafted c(1, "QuantoQuantizedLayer");
    for (const auto& [name, x] : std::vector<std::pair<std::string_view, std::int64_t>>{{"nbits", 4},
                                                                                        {"axis_key", 0},
                                                                                        {"axis_value", 0},
                                                                                        {"q_group_size", 4},
                                                                                        {"residual_length", 2},
                                                                                        {"append_only", append_only},
                                                                                        {"rotate_keys", 0},
                                                                                        {"rotate_values", 0},
                                                                                        {"value_nbits", 4}})
      c.w.param(name, x);
    c.w.value(true);
    for (const std::int64_t x : {1, 1, 4, 4, 0, 4}) c.w.value(x);  // shape, residual tokens, cumulative
    for (auto* part : {&k, &v}) {
      c.w.value(static_cast<std::int64_t>(part->size()));
      for (QT& q : *part) q.transfer(c.w);
    }
    for (const std::int64_t x : {1, 1, 4, 4}) c.w.value(x);  // the residual's shape, no rows
    return c.sink.bytes;
  };
  const auto make = [](bool append_only) {
    return kvc::QuantizedCache<float>(
        "quanto", config(1, 1, 4), {.nbits = 4, .q_group_size = 4, .residual_length = 2, .append_only = append_only});
  };
  const std::string cut =
      "kvc::load: layer 0 (QuantoQuantizedLayer): the saved state is inconsistent (the "
      "quantized chunks' token counts)";
  const std::string coded =
      "kvc::load: layer 0 (QuantoQuantizedLayer): the saved state is inconsistent (the "
      "quantized chunks' widths and groups)";
  auto kivi = make(true), whole = make(false);
  // As the layer writes them: they load (the payload's format is right), into what a cache holds.
  {
    auto loaded = make(true);
    string_source src{payload(true, {chunk(0, 2), chunk(2, 2)}, {chunk(0, 2), chunk(2, 2)})};
    kvc::StateLoader(loaded, src).load_all();
    CHECK(loaded.get_seq_length(0) == 4);
    string_source one{payload(false, {chunk(0, 4)}, {chunk(0, 4)})};
    kvc::StateLoader(whole, one).load_all();
    CHECK(whole.get_seq_length(0) == 4);
    whole = make(false);
  }
  CHECK(loader_error(kivi, payload(true, {chunk(0, 2), chunk(2, 2)}, {chunk(0, 4)})) == cut);
  CHECK(loader_error(kivi, payload(true, {chunk(0, 1), chunk(1, 3)}, {chunk(0, 3), chunk(3, 1)})) == cut);
  CHECK(loader_error(kivi, payload(true, {chunk(0, 4)}, {chunk(0, 2), chunk(2, 2)})) == cut);
  CHECK(loader_error(whole, payload(false, {chunk(0, 2), chunk(2, 2)}, {chunk(0, 2), chunk(2, 2)})) == cut);
  CHECK(loader_error(kivi, payload(true, {chunk(0, 4)}, {chunk(0, 4, 2)})) == coded);  // values at 2 bits
  CHECK(loader_error(kivi, payload(true, {chunk(0, 4, 8)}, {chunk(0, 4)})) == coded);
  CHECK(loader_error(kivi, payload(true, {chunk(0, 4, 4, kvc::detail::quant_grouping::along_seq)}, {chunk(0, 4)})) ==
        coded);
  CHECK(loader_error(kivi, payload(true, {chunk(0, 4)}, {chunk(0, 4, 4, grouping, 2)})) == coded);
}

TEST_CASE("kvc::load: the lengths a file announces") {
  std::mt19937 rng(37);
  kvc::DynamicCache<float> a, b;
  fill(a, 1, 1, 2, 1, 2, rng);
  const std::string bytes = saved(a);
  std::int64_t length = 0;
  std::memcpy(&length, bytes.data() + 16, 8);
  std::string longer = bytes;
  const std::int64_t more = length + 8;
  std::memcpy(longer.data() + 16, &more, 8);
  longer.insert(24 + static_cast<std::size_t>(length), 8, '\0');
  CHECK(load_error(b, longer) ==
        "kvc::load: the state announces " + std::to_string(more) + " bytes and its contents end 8 bytes earlier");
  std::string negative = bytes;
  const std::int64_t minus = -1;
  std::memcpy(negative.data() + 16, &minus, 8);
  CHECK(load_error(b, negative) == "kvc::load: the state announces a negative length");
  std::string shorter = bytes;
  const std::int64_t less = length - 8;
  std::memcpy(shorter.data() + 16, &less, 8);
  CHECK(load_error(b, shorter) ==
        "kvc::load: layer 2 (DynamicLayer): the layer's keys and values would need 32 "
        "bytes, and only 24 remain");
  const std::int64_t ten = 10;  // inside the first text, "Cache"
  std::memcpy(shorter.data() + 16, &ten, 8);
  CHECK(load_error(b, shorter) == "kvc::load: the state is truncated: its contents run past the announced length");
}

TEST_CASE("StateLoader and save_request refuse what they cannot do") {
  kvc::DynamicCache<float> a, b;
  std::mt19937 rng(41);
  fill(a, 1, 1, 2, 1, 1, rng);
  string_sink s;
  kvc::write_state(a, s);
  string_source src{s.bytes};
  kvc::StateLoader loader(b, src);
  CHECK_THROWS_WITH_AS(loader.load_through(3), "kvc::StateLoader: layer 3 is not one of the 3 layers of the state",
                       kvc::IndexError);
  loader.load_all();
  CHECK_THROWS_WITH_AS(loader.load_next(), "kvc::StateLoader: every layer is loaded already", kvc::StateError);
  // A state without layers empties a replicated cache.
  string_sink empty;
  kvc::write_state(kvc::DynamicCache<float>(), empty);
  string_source from_empty{empty.bytes};
  kvc::StateLoader none(b, from_empty);
  CHECK(none.done());
  CHECK(b.size() == 0);

  using Paged = kvc::PagedCache<kvc::HostStorage<float>>;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 8;
  Paged p(config(1, 1, 2), cb);
  REQUIRE(p.allocate_blocks(1, "r", 0));
  p.reserve_swap_space(2);
  REQUIRE(p.offload_request("r"));
  std::ostringstream os;
  CHECK_THROWS_WITH_AS(kvc::save_request(p, "r", os),
                       "kvc::save_request: request r is offloaded: restore_request it first", kvc::ValueError);
}

namespace {

// A stream that cannot seek (a pipe's), handing out `chunk` bytes at a time.
struct pipe_buf : std::streambuf {
  std::string data;
  std::size_t chunk, at = 0;
  std::vector<char> window;
  pipe_buf(std::string d, std::size_t c) : data(std::move(d)), chunk(c), window(c) {}
  int_type underflow() override {
    if (at == data.size()) return traits_type::eof();
    const std::size_t n = std::min(chunk, data.size() - at);
    std::memcpy(window.data(), data.data() + at, n);
    at += n;
    setg(window.data(), window.data(), window.data() + n);
    return traits_type::to_int_type(window[0]);
  }
};

// A file around `payload`, announcing `length` bytes of it (no checksum: a stream that ends early).
std::string file_around(const std::string& payload, std::int64_t length) {
  std::string f = "KVCSTATE";
  const std::int64_t head[2] = {kvc::detail::state_format_version, length};
  f.append(reinterpret_cast<const char*>(head), sizeof head);
  return f + payload;
}

}  // namespace

TEST_CASE("kvc::load through a stream of unknown length allocates only what has arrived") {
  // Valid states arrive whole, in chunks of any size: layers above the 64 KiB first read-ahead.
  std::mt19937 rng(53);
  kvc::DynamicCache<float> a;
  fill(a, 1, 2, 16, 3, 700, rng);  // 3 layers of 2100 tokens: 537600 bytes each
  const std::string bytes = saved(a);
  for (const std::size_t chunk : {std::size_t{7}, std::size_t{4093}}) {
    kvc::DynamicCache<float> b;
    pipe_buf buf(bytes, chunk);
    std::istream is(&buf);
    REQUIRE(is.tellg() == std::istream::pos_type(-1));  // it cannot be measured
    is.clear();
    kvc::load(b, is);
    CHECK(observed(b) == observed(a));
    CHECK(saved(b) == bytes);
  }
  // 154 bytes announcing 2^40 of state and a layer of 2^27 tokens x 8 heads x 64 dims (256 GiB
  // each for keys and values): the stream ends long before a buffer that size would be allocated.
  crafted c(1, "DynamicLayer");
  c.w.value(true);
  c.w.value(std::int64_t{1} << 27);
  for (const std::int64_t x : {1, 8, 64, 64}) c.w.value(x);
  const std::string hostile = file_around(c.sink.bytes, std::int64_t{1} << 40);
  CHECK(hostile.size() == 154);
  kvc::DynamicCache<float> b;
  fill(b, 1, 2, 4, 1, 2, rng);
  const auto before = take_snapshot(b);
  pipe_buf buf(hostile, 7);
  std::istream is(&buf);
  CHECK_THROWS_WITH_AS(kvc::load(b, is), "kvc::load: the file is truncated", kvc::StateError);
  CHECK(take_snapshot(b) == before);
}

TEST_CASE("kvc::load refuses a path that is not a regular file") {
  const auto dir = std::filesystem::temp_directory_path() / ("kvc_state_fifo_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto fifo = dir / "state.fifo";
  std::filesystem::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  kvc::DynamicCache<float> c;
  // No writer: opening it would wait for one forever.
  CHECK_THROWS_WITH_AS(kvc::load(c, fifo), ("kvc::load: " + fifo.string() + " is not a regular file").c_str(),
                       kvc::StateError);
  CHECK_THROWS_WITH_AS(kvc::load(c, dir), ("kvc::load: " + dir.string() + " is not a regular file").c_str(),
                       kvc::StateError);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kvc::load: a corrupted shape or count is a StateError naming the layer, never another exception") {
  std::mt19937 rng(59);
  kvc::DynamicCache<float> a, b;
  fill(a, 1, 2, 4, 1, 3, rng);
  fill(b, 1, 2, 4, 1, 1, rng);
  std::string bytes = saved(a);
  const std::int64_t batch = (std::int64_t{1} << 38) + 1;
  std::memcpy(bytes.data() + 122, &batch, 8);  // layer 0's batch
  CHECK(load_error(b, bytes) ==
        "kvc::load: layer 0 (DynamicLayer): a layer of batch 274877906945, 2 heads, 3 tokens, key head_dim 4 and "
        "value head_dim 4 is larger than kvc's allocation limit of 1099511627776 bytes");

  // Bit flips over every byte of six kinds' payloads, loaded without the checksum.
  const auto sweep = [&](auto make, auto fill_it) {
    auto src = make();
    fill_it(src);
    string_sink s;
    kvc::write_state(src, s);
    std::int64_t refused = 0;
    for (std::size_t i = 0; i < s.bytes.size(); ++i)
      for (const int bit : {1, 5, 6}) {
        std::string flipped = s.bytes;
        flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
        auto target = make();
        string_source in{flipped};
        try {
          kvc::StateLoader(target, in).load_all();
        } catch (const kvc::StateError&) {
          ++refused;
        } catch (const std::exception& e) {
          FAIL("byte " << i << " bit " << bit << ": " << std::string(e.what()));
        }
      }
    CHECK(refused > 0);
  };
  const auto kv = [&](auto& c) { fill(c, 1, 2, 4, 2, 3, rng); };
  sweep([] { return kvc::DynamicCache<float>(); }, kv);
  sweep([] { return mixed(); }, kv);
  for (const char* backend : {"quanto", "hqq"})
    sweep(
        [&] {
          return kvc::QuantizedCache<float>(backend, config(2, 2, 4),
                                            {.nbits = 4, .q_group_size = 4, .residual_length = 2});
        },
        kv);
  using Linear = kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer>>;
  sweep(
      [] {
        return Linear(kvc::LinearAttentionLayer{2, 2}, kvc::DynamicLayer{});
      },
      [&](Linear& c) {
        Eigen::Tensor<float, 3, Eigen::RowMajor> conv(1, 3, 2), rec(1, 2, 2);
        conv.setRandom();
        rec.setRandom();
        c.update_conv_state(conv, 0, 0, 2);
        c.update_recurrent_state(rec, 0, 1);
        c.update_conv_state(conv, 0, 1, 2);  // slot 1: a ring of two steps
        c.update_recurrent_state(rec, 0, 1);
        c.update_conv_state(conv, 0, 1, 2);
        fill(c, 1, 2, 4, 1, 2, rng);
      });
  using Indexed = kvc::Cache<kvc::Layers<kvc::DynamicIndexedLayer>>;
  sweep([] { return Indexed(kvc::DynamicIndexedLayer{}); },
        [&](Indexed& c) {
          fill(c, 1, 2, 4, 1, 2, rng);
          Eigen::Tensor<float, 3, Eigen::RowMajor> keys(1, 2, 3);
          keys.setRandom();
          c.update_indexer(keys, 0);
        });
}

TEST_CASE("StateLoader into a replicated cache grows its layer list geometrically") {
  std::mt19937 rng(61);
  kvc::DynamicCache<float> a, b;
  for (std::int64_t l = 0; l < 2048; ++l)
    a.update(random_tensor<float>(1, 1, 1, 2, rng), random_tensor<float>(1, 1, 1, 2, rng), l);
  string_sink s;
  kvc::write_state(a, s);
  string_source src{s.bytes};
  kvc::StateLoader loader(b, src);
  // Layer 0 moves each time the list grows: log2 of 2048 times, not once per layer.
  const auto home = [&] { return b.visit_layer(0, [](const auto& l) -> const void* { return &l; }); };
  loader.load_next();
  const void* last = home();
  int moves = 0;
  while (!loader.done()) {
    loader.load_next();
    moves += home() != last;
    last = home();
  }
  CHECK(moves <= 12);
  CHECK(observed(b) == observed(a));
}

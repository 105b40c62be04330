// kvc_demo: runs the three ready-made caches through a prompt and a decode loop on a small
// Gemma-style model (sliding and full layers alternating) and checks every `update` against a
// plain model of what transformers returns (hf_cache_inventory.md §1.2, §1.3, §1.5, §1.6).
//
// For each cache and layer it keeps the whole K/V history in a std::vector, computes which
// tokens transformers' layer of that kind returns (and the zero slots of a static buffer), and
// compares the returned views element by element, together with get_mask_sizes (asked before
// the update), get_seq_length and the layer kinds built from the config. Prints one table row
// per cache and exits non-zero on any mismatch.
#include <kvc/kvc.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::int64_t batch = 1;
constexpr std::int64_t kv_heads = 2;
constexpr std::int64_t head_dim = 32;
constexpr std::int64_t prompt_len = 100;
constexpr std::int64_t decode_steps = 50;
constexpr std::int64_t max_cache_len = 160;

// [snippet:config]
kvc::ModelConfig demo_config() {
  kvc::ModelConfig config;  // the fields of a transformers config.json that caches read
  config.num_hidden_layers = 4;
  config.num_attention_heads = 8;
  config.num_key_value_heads = 2;
  config.head_dim = 32;
  config.hidden_size = 8 * 32;
  config.sliding_window = 64;
  config.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  return config;
}
// [/snippet]

// SplitMix64: the same numbers with every compiler and standard library.
struct Rng {
  std::uint64_t state;
  float next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) / static_cast<float>(1 << 23) - 1.0f;  // [-1, 1)
  }
};

// The reference: what one layer of transformers returns, kept independently of kvc.
struct LayerModel {
  std::string kind;            // the transformers class name
  std::int64_t window = 0;     // sliding_window (sliding kinds)
  std::int64_t max_len = 0;    // max_cache_len (static kinds)
  std::int64_t max_length = -1;  // what get_max_length() must say
};

struct Expected {
  std::vector<std::int64_t> slots;  // the token index at every returned position, -1 for a zero slot
  std::int64_t kv_length = 0;       // get_mask_sizes(q), asked before the update
  std::int64_t kv_offset = 0;
};

// `cum` tokens seen before this update, `q` new ones.
Expected expect_update(const LayerModel& m, std::int64_t cum, std::int64_t q) {
  Expected e;
  const std::int64_t seen = cum + q;
  auto tokens = [&](std::int64_t from, std::int64_t to) {
    for (std::int64_t t = from; t < to; ++t) e.slots.push_back(t);
  };
  if (m.kind == "DynamicLayer") {  // §1.2: everything stored, (seq + q, 0)
    tokens(0, seen);
    e.kv_length = seen;
  } else if (m.kind == "DynamicSlidingWindowLayer") {  // §1.3: the last sw - 1 stored + the new ones
    const std::int64_t w = m.window;
    tokens(std::max<std::int64_t>(cum - (w - 1), 0), seen);
    e.kv_length = cum >= w ? w - 1 + q : cum + q;
    e.kv_offset = std::max<std::int64_t>(cum - w + 1, 0);
  } else if (m.kind == "StaticLayer") {  // §1.5: the whole buffer, zeros after the written tokens
    tokens(0, seen);
    e.slots.resize(static_cast<std::size_t>(m.max_len), -1);
    e.kv_length = m.max_len;
  } else if (m.kind == "StaticSlidingWindowLayer") {  // §1.6, W = min(sliding_window, max_cache_len)
    const std::int64_t w = std::min(m.window, m.max_len);
    e.kv_offset = std::max<std::int64_t>(cum - w + 1, 0);
    if (cum >= w) {  // full: the last W - 1 tokens + the new ones (q == 1: the rolled buffer)
      tokens(cum - (w - 1), seen);
      e.kv_length = w + q - 1;
    } else if (cum + q > w) {  // becoming full: everything seen + the new ones
      tokens(0, seen);
      e.kv_length = seen;
    } else {  // fits: the buffer of W slots
      tokens(0, seen);
      e.slots.resize(static_cast<std::size_t>(w), -1);
      e.kv_length = w;
    }
  }
  return e;
}

std::vector<LayerModel> models_from(const kvc::ModelConfig& config, bool dynamic) {
  std::vector<LayerModel> out;
  for (const auto& type : *config.layer_types) {
    const bool sliding = type == "sliding_attention";
    const std::int64_t w = *config.sliding_window;
    if (dynamic)
      out.push_back(sliding ? LayerModel{"DynamicSlidingWindowLayer", w, 0, w} : LayerModel{"DynamicLayer", 0, 0, -1});
    else
      out.push_back(sliding ? LayerModel{"StaticSlidingWindowLayer", w, max_cache_len, std::min(w, max_cache_len)}
                            : LayerModel{"StaticLayer", 0, max_cache_len, max_cache_len});
  }
  return out;
}

// One layer's K (or V) history, token-major: [token][batch][head][head_dim].
using History = std::vector<float>;

kvc::HostTensor<float> new_tokens(Rng& rng, std::int64_t q, History& history) {
  kvc::HostTensor<float> t(batch, kv_heads, q, head_dim);
  const std::size_t first = history.size();
  history.resize(first + static_cast<std::size_t>(q * batch * kv_heads * head_dim));
  for (std::int64_t s = 0; s < q; ++s)
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < kv_heads; ++h)
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const float x = rng.next();
          t(b, h, s, d) = x;
          history[first + static_cast<std::size_t>(((s * batch + b) * kv_heads + h) * head_dim + d)] = x;
        }
  return t;
}

template <class View>
bool matches(const View& view, const History& history, const std::vector<std::int64_t>& slots) {
  if (view.extent(0) != batch || view.extent(1) != kv_heads || view.extent(3) != head_dim ||
      view.extent(2) != static_cast<std::int64_t>(slots.size()))
    return false;
  for (std::int64_t s = 0; s < view.extent(2); ++s) {
    const std::int64_t t = slots[static_cast<std::size_t>(s)];
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < kv_heads; ++h)
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const float want =
              t < 0 ? 0.0f : history[static_cast<std::size_t>(((t * batch + b) * kv_heads + h) * head_dim + d)];
          if (view(b, h, s, d) != want) return false;
        }
  }
  return true;
}

struct Row {
  std::string cache;
  std::string layers;
  std::int64_t seen = 0;
  std::int64_t max_length = 0;
  std::int64_t bytes = 0;
  std::vector<std::string> failures;
};

// "4 x DynamicLayer", "2 x (StaticSlidingWindowLayer, StaticLayer)": the layer kinds, by period.
std::string describe_layers(const std::vector<std::string>& names) {
  const std::size_t n = names.size();
  std::size_t p = 1;
  while (p < n && (n % p != 0 || !std::equal(names.begin() + static_cast<std::ptrdiff_t>(p), names.end(), names.begin())))
    ++p;
  std::string out = std::to_string(n / std::max<std::size_t>(p, 1)) + " x ";
  if (p > 1) out += "(";
  for (std::size_t i = 0; i < p && i < n; ++i) out += (i ? ", " : "") + names[i];
  if (p > 1) out += ")";
  return out;
}

template <class Cache>
Row run(std::string name, Cache& cache, const std::vector<LayerModel>& models) {
  Row row{std::move(name), "", 0, 0, 0, {}};
  auto fail = [&](std::int64_t layer, std::int64_t step, const std::string& what) {
    if (row.failures.size() < 5)
      row.failures.push_back("layer " + std::to_string(layer) + ", step " + std::to_string(step) + ": " + what);
    else if (row.failures.size() == 5)
      row.failures.push_back("...");
  };
  Rng rng{2024};
  const std::size_t n = models.size();
  std::vector<History> keys(n), values(n);
  std::vector<std::int64_t> seen(n, 0);

  auto step = [&](std::int64_t s, std::int64_t q) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto idx = static_cast<std::int64_t>(i);
      const kvc::HostTensor<float> k = new_tokens(rng, q, keys[i]);
      const kvc::HostTensor<float> v = new_tokens(rng, q, values[i]);
      const Expected want = expect_update(models[i], seen[i], q);

      const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, idx);
      const auto kv = cache.update(k, v, idx);
      seen[i] += q;

      if (kv_length != want.kv_length || kv_offset != want.kv_offset)
        fail(idx, s, "get_mask_sizes gave (" + std::to_string(kv_length) + ", " + std::to_string(kv_offset) +
                         "), transformers (" + std::to_string(want.kv_length) + ", " +
                         std::to_string(want.kv_offset) + ")");
      if (kv.keys.extent(2) != kv_length)
        fail(idx, s, "update returned " + std::to_string(kv.keys.extent(2)) + " tokens, get_mask_sizes said " +
                         std::to_string(kv_length));
      if (!matches(kv.keys, keys[i], want.slots)) fail(idx, s, "returned keys differ from the reference");
      if (!matches(kv.values, values[i], want.slots)) fail(idx, s, "returned values differ from the reference");
      if (cache.get_seq_length(idx) != seen[i])
        fail(idx, s, "get_seq_length is " + std::to_string(cache.get_seq_length(idx)) + ", expected " +
                         std::to_string(seen[i]));
    }
  };

  step(0, prompt_len);
  for (std::int64_t s = 1; s <= decode_steps; ++s) step(s, 1);

  std::vector<std::string> names;
  if (cache.size() != static_cast<std::int64_t>(n))
    fail(-1, decode_steps, "the cache has " + std::to_string(cache.size()) + " layers");
  for (std::int64_t i = 0; i < cache.size(); ++i) {
    names.emplace_back(cache.layer_name(i));
    if (i < static_cast<std::int64_t>(n)) {
      const LayerModel& m = models[static_cast<std::size_t>(i)];
      if (names.back() != m.kind) fail(i, decode_steps, "is a " + names.back() + ", expected a " + m.kind);
      if (cache.get_max_length(i) != m.max_length)
        fail(i, decode_steps, "get_max_length is " + std::to_string(cache.get_max_length(i)));
    }
  }
  row.layers = describe_layers(names);
  row.seen = cache.get_seq_length();
  row.max_length = cache.get_max_length();
  row.bytes = cache.bytes();
  return row;
}

template <class Make>
Row guarded(const std::string& name, Make&& make_and_run) {
  try {
    return make_and_run();
  } catch (const std::exception& e) {
    Row row{name, "?", 0, 0, 0, {}};
    row.failures.push_back(std::string("threw: ") + e.what());
    return row;
  }
}

}  // namespace

int main() {
  const kvc::ModelConfig config = demo_config();
  const auto dynamic_models = models_from(config, true);
  const auto static_models = models_from(config, false);
  const std::vector<LayerModel> replicated_models(dynamic_models.size(), LayerModel{"DynamicLayer", 0, 0, -1});

  std::vector<Row> rows;
  rows.push_back(guarded("DynamicCache<float>", [&] {
    // [snippet:caches]
    kvc::DynamicCache<float> dynamic;                          // DynamicLayer, one per index, on demand
    auto configured = kvc::make_dynamic_cache<float>(config);  // a layer per config.layer_types entry
    kvc::StaticCache<float> fixed(config, max_cache_len);      // buffers of max_cache_len (window) slots
    // [/snippet]
    (void)configured;
    (void)fixed;
    return run("DynamicCache<float>", dynamic, replicated_models);
  }));
  rows.push_back(guarded("make_dynamic_cache<float>(config)", [&] {
    auto cache = kvc::make_dynamic_cache<float>(config);
    return run("make_dynamic_cache<float>(config)", cache, dynamic_models);
  }));
  rows.push_back(guarded("StaticCache<float>(config, 160)", [&] {
    kvc::StaticCache<float> cache(config, max_cache_len);
    return run("StaticCache<float>(config, 160)", cache, static_models);
  }));

  std::printf("config: 4 layers (sliding_attention window 64 / full_attention), 8 heads, 2 KV heads, head_dim 32\n");
  std::printf("run:    prompt of %lld tokens, then %lld decode steps of 1 token, checked after every update\n\n",
              static_cast<long long>(prompt_len), static_cast<long long>(decode_steps));
  std::printf("%-34s %-46s %5s %8s %9s  %s\n", "cache", "layers", "seen", "max_len", "KV bytes", "check");
  int failed = 0;
  for (const Row& r : rows) {
    const bool ok = r.failures.empty();
    failed += ok ? 0 : 1;
    std::printf("%-34s %-46s %5lld %8lld %9lld  %s\n", r.cache.c_str(), r.layers.c_str(),
                static_cast<long long>(r.seen), static_cast<long long>(r.max_length),
                static_cast<long long>(r.bytes), ok ? "PASS" : "FAIL");
  }
  for (const Row& r : rows)
    for (const std::string& f : r.failures) std::printf("  %s: %s\n", r.cache.c_str(), f.c_str());

  if (failed == 0) {
    std::printf("\nkvc_demo: %zu/%zu caches match transformers' semantics\n", rows.size(), rows.size());
    return EXIT_SUCCESS;
  }
  std::printf("\nkvc_demo: %d of %zu caches FAILED\n", failed, rows.size());
  return EXIT_FAILURE;
}

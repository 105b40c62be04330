// Picking a cache at run time, and attending over it: a model's generation_config.json and
// config.json read from JSON, the cache make_cache names behind a kvc::AnyCache, a cache described
// by JSON, the static export path, and kvc::attend / kvc::scaled_dot_product_attention with masks
// from get_mask_sizes. Every attention output is checked against a model recomputing the whole
// sequence without a cache. docs/runtime.md and docs/attention.md quote the snippets; the last
// line printed is the verdict.
#include <kvc/cache_description.hpp>
#include <kvc/runtime.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../common/tokens.hpp"

using examples::expect;

namespace {

// ---- a tiny Gemma-2-style model: the two JSON files a checkpoint ships --------------------------

// [snippet:json_files]
// config.json: Gemma2Config alternates sliding (even indices) and full layers.
constexpr const char* config_json = R"({
  "architectures": ["Gemma2ForCausalLM"],
  "model_type": "gemma2",
  "num_hidden_layers": 4,
  "hidden_size": 64,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "sliding_window": 4,
  "torch_dtype": "bfloat16"
})";

// generation_config.json: token ids and sampling fields are not cache fields and are ignored.
constexpr const char* generation_config_json = R"({
  "bos_token_id": 2,
  "eos_token_id": [1, 107],
  "pad_token_id": 0,
  "cache_implementation": "static",
  "max_length": 17,
  "transformers_version": "4.57.0"
})";
// [/snippet]

constexpr std::int64_t tokens = 9;  // a prompt of 6, then 3 decode steps
const std::vector<std::int64_t> steps{6, 1, 1, 1};

// Queries, keys and values of every token of one layer: [1, heads, tokens, head_dim].
struct LayerQKV {
  kvc::HostTensor<float> q, k, v;
};

std::vector<LayerQKV> random_qkv(const kvc::ModelConfig& model) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto fill = [&](kvc::HostTensor<float>& t) {
    for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = normal(rng);
  };
  std::vector<LayerQKV> out;
  for (std::int64_t layer = 0; layer < model.num_hidden_layers; ++layer) {
    const std::int64_t hq = model.layer_num_attention_heads(layer), hkv = model.layer_num_key_value_heads(layer),
                       d = model.layer_head_dim(layer);
    LayerQKV x{kvc::HostTensor<float>(1, hq, tokens, d), kvc::HostTensor<float>(1, hkv, tokens, d),
               kvc::HostTensor<float>(1, hkv, tokens, d)};
    fill(x.q);
    fill(x.k);
    fill(x.v);
    out.push_back(std::move(x));
  }
  return out;
}

// Tokens [from, from + n) of a [1, heads, tokens, head_dim] tensor, as a view (no copy).
template <class T>
kvc::TensorView<T> positions(const kvc::HostTensor<T>& t, std::int64_t from, std::int64_t n) {
  const std::int64_t h = t.dimension(1), s = t.dimension(2), d = t.dimension(3);
  return {t.data() + from * d, {1, h, n, d}, {h * s * d, s * d, d, 1}};
}

// The largest difference between `out` (the attention output of tokens [from, from + n)) and the
// same queries attending over every key from position 0 with the layer's mask: what a model
// recomputing the whole sequence without a cache gets.
double no_cache_difference(const kvc::HostTensor<float>& out, const LayerQKV& x, std::int64_t from, std::int64_t n,
                           std::optional<std::int64_t> window) {
  const kvc::AttentionMask mask{
      .kv_length = from + n, .kv_offset = 0, .query_position = from, .sliding_window = window};
  const auto want = kvc::scaled_dot_product_attention(positions(x.q, from, n), positions(x.k, 0, from + n),
                                                      positions(x.v, 0, from + n), mask);
  double diff = 0;
  for (std::int64_t i = 0; i < want.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(out.data()[i]) - static_cast<double>(want.data()[i])));
  return diff;
}

// Runs the prompt and the decode steps through `cache` with kvc::attend, the window of each layer
// coming from the model; returns the largest difference from the no-cache model.
template <class Cache>
double decode(Cache& cache, const kvc::ModelConfig& model, const std::vector<LayerQKV>& qkv) {
  const std::vector<kvc::LayerSpec> specs = kvc::layer_specs(model);
  double worst = 0;
  std::int64_t from = 0;
  for (const std::int64_t n : steps) {
    for (std::int64_t layer = 0; layer < static_cast<std::int64_t>(specs.size()); ++layer) {
      const LayerQKV& x = qkv[static_cast<std::size_t>(layer)];
      const std::optional<std::int64_t> window = specs[static_cast<std::size_t>(layer)].sliding_window;
      const auto out = kvc::attend(cache, layer, positions(x.q, from, n), positions(x.k, from, n),
                                   positions(x.v, from, n), {.sliding_window = window});
      worst = std::max(worst, no_cache_difference(out, x, from, n, window));
    }
    from += n;
  }
  return worst;
}

constexpr double float_bound = 1e-5;

// ---- runtime.md --------------------------------------------------------------------------------

void load_and_make(const std::vector<LayerQKV>& qkv) {
  // [snippet:load_configs]
  const kvc::ModelConfig model = kvc::ModelConfig::from_json(config_json);
  // model.layer_types: sliding, full, sliding, full; 2 KV heads of head_dim 16
  const kvc::GenerationConfig generation = kvc::GenerationConfig::from_json(generation_config_json);
  // generation.cache_implementation == "static", generation.max_length == 17
  // [/snippet]
  expect(model.model_type == "gemma2", "config.json: model_type");
  expect(model.layer_types == std::optional<std::vector<std::string>>(
                                  {"sliding_attention", "full_attention", "sliding_attention", "full_attention"}),
         "config.json: Gemma2's layer types");
  expect(model.layer_num_key_value_heads(0) == 2 && model.layer_head_dim(3) == 16, "config.json: head shapes");
  expect(generation.cache_implementation == std::optional<std::string>("static") && generation.max_length == 17,
         "generation_config.json: cache fields");

  // [snippet:make_cache]
  kvc::AnyCache cache = kvc::make_cache(generation, model);  // "static": a StaticCache<float>
  // 4 layers: StaticSlidingWindowLayer (window 4), StaticLayer (max_length - 1 = 16 slots), ...
  const double difference = decode(cache, model, qkv);  // a prompt of 6 tokens, then 3 decode steps
  // cache.get_seq_length(1) == 9; get<kvc::StaticCache<float>>() gives back the typed cache
  // [/snippet]
  expect(cache.get<kvc::StaticCache<float>>() != nullptr, "make_cache(\"static\") holds a StaticCache<float>");
  expect(cache.layer_name(0) == "StaticSlidingWindowLayer" && cache.layer_name(1) == "StaticLayer",
         "make_cache(\"static\"): the config's layer types");
  expect(cache.get_max_length(0) == 4 && cache.get_max_length(1) == 16, "make_cache(\"static\"): sizes");
  expect(cache.get_seq_length(1) == tokens, "make_cache(\"static\"): every token stored");
  expect(difference < float_bound, "make_cache(\"static\"): attention matches the no-cache model");
  std::printf("make_cache(\"static\"): %lld layers, %lld K/V bytes, max |difference| %.2e\n",
              static_cast<long long>(cache.size()), static_cast<long long>(cache.bytes()), difference);

  // What each cache_implementation name builds, through the same handle.
  // [snippet:names]
  for (const char* name : {"dynamic", "hybrid", "static", "sliding_window", "quantized", "offloaded"}) {
    kvc::GenerationConfig g;
    g.cache_implementation = name;
    try {
      kvc::AnyCache c = kvc::make_cache(g, model);
      std::printf("  %-15s %s, %s, ...\n", name, std::string(c.layer_name(0)).c_str(),
                  std::string(c.layer_name(1)).c_str());
    } catch (const kvc::ValueError& e) {  // quantized: QuantizedCache needs a full-attention model
      std::printf("  %-15s ValueError: %s\n", name, e.what());
    }
  }
  // [/snippet]
  for (const char* name : {"dynamic", "hybrid"}) {
    kvc::GenerationConfig g;
    g.cache_implementation = name;
    kvc::AnyCache c = kvc::make_cache(g, model);
    expect(c.get<kvc::ConfiguredDynamicCache<float>>() != nullptr,
           "dynamic and hybrid build the config's dynamic cache");
    expect(decode(c, model, qkv) < float_bound, "the dynamic cache matches the no-cache model");
  }

  // [snippet:prepare]
  kvc::GenerationConfig draft = generation;  // the assistant model of assisted generation
  draft.cache_implementation.reset();        // unset: a dynamic cache built from the config
  draft.is_assistant = true;
  std::optional<kvc::AnyCache> draft_cache = kvc::prepare_cache_for_generation(draft, model, "Gemma2ForCausalLM");
  // *draft_cache records its sliding layers' past, so that rejected draft tokens can be cropped
  // [/snippet]
  expect(draft_cache.has_value(), "prepare_cache_for_generation builds a cache");
  if (draft_cache) {
    const double diff = decode(*draft_cache, model, qkv);
    expect(diff < float_bound, "a recording cache matches the no-cache model");
    draft_cache->crop(-3);  // the last 3 draft tokens were rejected
    expect(draft_cache->get_seq_length(0) == tokens - 3, "a recording sliding layer rolls back past its window");
  }
  try {
    kvc::prepare_cache_for_generation(generation, model, "Gemma2ForCausalLM", kvc::DynamicCache<float>());
    expect(false, "a cache and a cache_implementation together are refused");
  } catch (const kvc::ValueError&) {
  }
}

void describe(const kvc::ModelConfig& model, const std::vector<LayerQKV>& qkv) {
  // [snippet:description]
  kvc::AnyCache described = kvc::cache_from_description(R"({
    "layers": [{"type": "StaticSlidingWindowLayer", "max_cache_len": 16, "sliding_window": 4},
               "DynamicLayer",
               {"type": "DynamicSlidingWindowLayer", "sliding_window": 4},
               {"type": "StaticLayer", "max_cache_len": 16}]
  })");
  const double difference = decode(described, model, qkv);  // the model's 4 layers, any mix of kinds
  // [/snippet]
  expect(described.size() == 4 && described.layer_name(2) == "DynamicSlidingWindowLayer", "described layers");
  expect(difference < float_bound, "a described cache matches the no-cache model");

  // [snippet:layer_sources]
  try {
    kvc::cache_from_description(R"({"layers": ["DynamicLayer"], "layer_class_to_replicate": "DynamicLayer"})");
  } catch (const kvc::ValueError& e) {
    // e.what() == kvc::both_layer_sources_message, what kvc::Cache's static_assert prints
  }
  // [/snippet]
  try {
    kvc::cache_from_description(R"({"layers": ["DynamicLayer"], "layer_class_to_replicate": "DynamicLayer"})");
    expect(false, "both layer sources are refused");
  } catch (const kvc::ValueError& e) {
    expect(e.what() == kvc::both_layer_sources_message, "both layer sources: the static_assert's text");
  }
  try {
    kvc::cache_from_description(R"({"dtype": "half"})");
    expect(false, "no layer source is refused");
  } catch (const kvc::ValueError& e) {
    expect(e.what() == kvc::no_layer_source_message, "no layer source: the static_assert's text");
  }
}

// What an exporter does with each buffer: registers it under its name (here: counts and prints).
int registered = 0;
void register_buffer(const kvc::ExportedBuffer& b) {
  if (registered++ == 0)
    std::printf("export: %s [%lld, %lld, %lld, %lld] %s, ...\n", b.name.c_str(), static_cast<long long>(b.shape[0]),
                static_cast<long long>(b.shape[1]), static_cast<long long>(b.shape[2]),
                static_cast<long long>(b.shape[3]), std::string(b.dtype).c_str());
}

void export_static(const kvc::ModelConfig& model, const std::vector<LayerQKV>& qkv) {
  // [snippet:export]
  // The generation config of a model exported with a static cache (sizes in cache_config).
  const auto generation = kvc::GenerationConfig::from_json(R"({
    "use_cache": true, "cache_implementation": "static",
    "cache_config": {"batch_size": 1, "max_cache_len": 16}
  })");
  kvc::StaticCacheExport<float> exported(model, generation);  // 4 full StaticLayers, allocated now
  for (const kvc::ExportedBuffer& b : exported.buffers())
    register_buffer(b);                     // key_cache_0, value_cache_0, key_cache_1, ...: [1, 2, 16, 16] float32
  exported.begin_step({0, 1, 2, 3, 4, 5});  // the prompt: every layer writes from cache_position[0]
  // ... the model's forward: exported.cache().update(keys, values, layer) for each layer ...
  exported.begin_step({6});  // one decode step at position 6
  // [/snippet]
  // [snippet:head_shapes]
  const kvc::HeadShapes shapes = kvc::get_head_shapes(model);  // what early_initialization was given
  // one entry per layer that has a cache, here all 4: num_heads {2, 2, 2, 2}, head_dim {16, 16, 16, 16}
  // [/snippet]
  expect(shapes.num_heads == std::vector<std::int64_t>(4, 2) && shapes.head_dim == std::vector<std::int64_t>(4, 16),
         "get_head_shapes: one entry per layer");
  const auto buffers = exported.buffers();
  expect(registered == 8, "export: every buffer registered");
  expect(buffers.size() == 8 && buffers[0].name == "key_cache_0" && buffers[7].name == "value_cache_3",
         "export: key_cache_{i} and value_cache_{i}");
  expect(buffers[2].shape == std::array<std::int64_t, 4>{1, 2, 16, 16} && buffers[2].dtype == "float32",
         "export: shapes from cache_config and the model");
  expect(exported.cache().layer_name(0) == "StaticLayer", "export: the sliding layer became a StaticLayer");

  // The exported program runs every step from begin_step; the sliding layers of the model still
  // mask with their window, which the full StaticLayers of the export cache know nothing about.
  const std::vector<kvc::LayerSpec> specs = kvc::layer_specs(model);
  auto& cache = exported.cache();
  double worst = 0;
  for (int pass = 0; pass < 2; ++pass) {  // the second pass reruns the same positions in place
    std::int64_t from = 0;
    for (const std::int64_t n : steps) {
      std::vector<std::int64_t> cache_position(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) cache_position[static_cast<std::size_t>(i)] = from + i;
      exported.begin_step(cache_position);
      for (std::int64_t layer = 0; layer < cache.size(); ++layer) {
        const LayerQKV& x = qkv[static_cast<std::size_t>(layer)];
        const auto window = specs[static_cast<std::size_t>(layer)].sliding_window;
        const auto out = kvc::attend(cache, layer, positions(x.q, from, n), positions(x.k, from, n),
                                     positions(x.v, from, n), {.sliding_window = window});
        worst = std::max(worst, no_cache_difference(out, x, from, n, window));
      }
      from += n;
    }
  }
  expect(worst < float_bound, "export: attention matches the no-cache model, twice over the same buffers");
  expect(exported.buffers()[0].data == buffers[0].data, "export: buffers never move");
}

// ---- attention.md ------------------------------------------------------------------------------

void explicit_mask(const kvc::ModelConfig& model, const std::vector<LayerQKV>& qkv) {
  kvc::StaticCache<float> cache(model, /*max_cache_len=*/16);
  const LayerQKV& x = qkv[0];
  const std::int64_t layer = 0;
  const std::optional<std::int64_t> window = model.sliding_window;
  std::int64_t from = 0;
  double worst = 0;
  for (const std::int64_t q : steps) {
    const auto queries = positions(x.q, from, q), keys = positions(x.k, from, q), values = positions(x.v, from, q);
    // [snippet:explicit_mask]
    // One attention layer's step, as kvc::attend does it.
    const auto [kv_length, kv_offset] = cache.get_mask_sizes(q, layer);  // asked before the update
    const std::int64_t query_position = cache.get_seq_length(layer);     // tokens seen before this step
    const auto kv = cache.update(keys, values, layer);                   // kv.keys.extent(2) == kv_length
    const kvc::AttentionMask mask{.kv_length = kv_length,
                                  .kv_offset = kv_offset,  // key j sits at position kv_offset + j
                                  .query_position = query_position,
                                  .sliding_window = window};  // the model's window for this layer
    const kvc::HostTensor<float> out = kvc::scaled_dot_product_attention(queries, kv.keys, kv.values, mask);
    // [/snippet]
    worst = std::max(worst, no_cache_difference(out, x, from, q, window));
    from += q;
  }
  expect(worst < float_bound, "explicit masks from get_mask_sizes match the no-cache model");
}

void model_window(const kvc::ModelConfig& model, const std::vector<LayerQKV>& qkv) {
  const LayerQKV& x = qkv[0];  // a sliding layer of the model
  std::vector<kvc::HostTensor<float>> outputs;
  // [snippet:attend_window]
  kvc::DynamicCache<float> cache;  // no config: layer 0 keeps every token, as a full layer does
  std::int64_t from = 0;
  for (const std::int64_t q : steps) {  // a prompt of 6 tokens, then 3 decode steps
    outputs.push_back(kvc::attend(cache, /*layer_idx=*/0, positions(x.q, from, q), positions(x.k, from, q),
                                  positions(x.v, from, q), {.sliding_window = model.sliding_window}));
    from += q;
  }
  // without .sliding_window, attend would mask layer 0 of this cache as a full layer: the queries
  // past the window would also see the keys that left it
  // [/snippet]
  double with_window = 0, without = 0;
  from = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    with_window = std::max(with_window, no_cache_difference(outputs[i], x, from, steps[i], model.sliding_window));
    without = std::max(without, no_cache_difference(outputs[i], x, from, steps[i], std::nullopt));
    from += steps[i];
  }
  expect(cache.get_seq_length(0) == tokens && cache.stored(0).keys.extent(2) == tokens,
         "a DynamicCache keeps every token");
  expect(with_window < float_bound, "the model's window: matches the sliding no-cache model");
  expect(without > 1e-2, "the model's window: differs from full attention once the window is passed");
}

void chunked() {
  // [snippet:chunked_mask]
  const kvc::AttentionMask chunks{
      .kv_length = 8, .kv_offset = 0, .query_position = 0, .sliding_window = std::nullopt, .attention_chunk_size = 4};
  // positions 0-3 and 4-7 are two chunks: the query at 5 sees keys 4 and 5 only
  // [/snippet]
  expect(chunks.visible(5, 4) && chunks.visible(5, 5) && !chunks.visible(5, 3) && !chunks.visible(5, 6),
         "chunked attention: a query sees the causal part of its chunk");
  expect(chunks.first_visible(7) == 4 && chunks.first_visible(3) == 0, "chunked attention: first visible key");
  const kvc::AttentionMask window{.kv_length = 8, .kv_offset = 0, .query_position = 0, .sliding_window = 4};
  expect(window.visible(5, 2) && !window.visible(5, 1), "sliding window: the 4 latest positions");
}

void sixteen_bit(const std::vector<LayerQKV>& qkv) {
  const LayerQKV& x = qkv[0];
  using bf16 = Eigen::bfloat16;
  const kvc::HostTensor<bf16> q16 = x.q.cast<bf16>(), k16 = x.k.cast<bf16>(), v16 = x.v.cast<bf16>();
  // [snippet:bfloat16]
  kvc::AnyCache cache = kvc::cache_from_description(
      R"({"layer_class_to_replicate": {"type": "DynamicSlidingWindowLayer", "sliding_window": 4},
          "dtype": "bfloat16"})");
  // bfloat16 in the cache and in the output; scores and softmax accumulate in float
  const kvc::HostTensor<bf16> out = kvc::attend(cache, 0, q16, k16, v16);  // window 4: the layer's own
  // [/snippet]
  // The float reference, from the bfloat16 inputs: the difference is the output's rounding.
  const kvc::HostTensor<float> qf = q16.cast<float>(), kf = k16.cast<float>(), vf = v16.cast<float>();
  const kvc::AttentionMask mask{.kv_length = tokens, .kv_offset = 0, .query_position = 0, .sliding_window = 4};
  const auto want = kvc::scaled_dot_product_attention(positions(qf, 0, tokens), positions(kf, 0, tokens),
                                                      positions(vf, 0, tokens), mask);
  double worst = 0;
  for (std::int64_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(static_cast<float>(out.data()[i])) - want.data()[i]));
  expect(out.dimension(1) == 4 && out.dimension(2) == tokens, "bfloat16: GQA output shape [1, 4, 9, 16]");
  expect(worst < 3e-2, "bfloat16: within the output's rounding of the float result");
  std::printf("bfloat16 attention: max |difference| from float %.2e\n", worst);
}

}  // namespace

int main() {
  const kvc::ModelConfig model = kvc::ModelConfig::from_json(config_json);
  const std::vector<LayerQKV> qkv = random_qkv(model);
  load_and_make(qkv);
  describe(model, qkv);
  export_static(model, qkv);
  explicit_mask(model, qkv);
  model_window(model, qkv);
  chunked();
  sixteen_bit(qkv);
  if (examples::failures == 0) std::printf("runtime: OK\n");
  return examples::failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

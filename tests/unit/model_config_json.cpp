// kvc::ModelConfig::from_json / from_file on transformers config.json files (docs/model_configs.md):
// the nested text config, each model_type's layer types and class defaults, the caches built from
// them, and every error message.

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {

namespace fs = std::filesystem;
using S = std::vector<std::string>;

// <repo>/tests/unit/model_config_json.cpp -> <repo>
fs::path repo_root() { return fs::path(__FILE__).parent_path().parent_path().parent_path(); }
fs::path test_config(const char* name) { return repo_root() / "tests" / "data" / "configs" / name; }

// `n` layers: `every` at each index i with (i + 1) % period == 0, `other` elsewhere.
S periodic(std::int64_t n, std::int64_t period, const std::string& other, const std::string& every) {
  S out;
  for (std::int64_t i = 0; i < n; ++i) out.push_back((i + 1) % period == 0 ? every : other);
  return out;
}
S repeat(std::int64_t n, const std::string& type) { return S(static_cast<std::size_t>(n), type); }
S spec_types(const kvc::ModelConfig& c) {
  S out;
  for (const auto& spec : kvc::layer_specs(c)) out.push_back(spec.type);
  return out;
}

struct layout {
  std::string model_type;
  S types;                             // after layer_specs
  std::optional<std::int64_t> window;  // of the sliding layers
  std::int64_t heads;
  std::int64_t kv_heads;
  std::int64_t head_dim;
};

void check_layout(const kvc::ModelConfig& c, const layout& want) {
  CHECK(c.model_type == want.model_type);
  CHECK(c.num_hidden_layers == static_cast<std::int64_t>(want.types.size()));
  const auto specs = kvc::layer_specs(c);
  REQUIRE(specs.size() == want.types.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    INFO("layer " << i);
    CHECK(specs[i].type == want.types[i]);
    if (want.types[i] == "sliding_attention") CHECK(specs[i].sliding_window == want.window);
    const auto layer = static_cast<std::int64_t>(i);
    CHECK(c.layer_num_attention_heads(layer) == want.heads);
    CHECK(c.layer_num_key_value_heads(layer) == want.kv_heads);
    CHECK(c.layer_head_dim(layer) == want.head_dim);
  }
}

// make_dynamic_cache and StaticCache(config, 64) build one layer kind per layer type.
void check_caches(const kvc::ModelConfig& c, const layout& want) {
  const auto dynamic = kvc::make_dynamic_cache<float>(c);
  const kvc::StaticCache<float> fixed(c, 64);
  REQUIRE(dynamic.size() == static_cast<std::int64_t>(want.types.size()));
  REQUIRE(fixed.size() == static_cast<std::int64_t>(want.types.size()));
  for (std::int64_t i = 0; i < dynamic.size(); ++i) {
    INFO("layer " << i);
    const bool sliding = want.types[static_cast<std::size_t>(i)] == "sliding_attention";
    CHECK(dynamic.layer_name(i) == (sliding ? "DynamicSlidingWindowLayer" : "DynamicLayer"));
    CHECK(fixed.layer_name(i) == (sliding ? "StaticSlidingWindowLayer" : "StaticLayer"));
    CHECK(fixed.get_max_length(i) == (sliding ? std::min<std::int64_t>(*want.window, 64) : 64));
    if (sliding) CHECK(dynamic.get_max_length(i) == *want.window);
  }
}

const char* const sw = "sliding_attention";
const char* const full = "full_attention";
const char* const linear = "linear_attention";

}  // namespace

TEST_CASE("real configs written for the tests (tests/data/configs)") {
  kvc_test::captured_warnings warnings;
  struct item {
    const char* file;
    layout want;
    bool buildable;
  };
  const std::vector<item> items{
      {"llama-3.1-8b-instruct.config.json", {"llama", repeat(32, full), {}, 32, 8, 128}, true},
      // head_dim 128 although 5120 / 32 = 160; "sliding_window": null keeps MistralConfig's None
      {"mistral-nemo-instruct-2407.config.json", {"mistral", repeat(40, full), {}, 32, 8, 128}, true},
      // use_sliding_window false: Qwen2Config drops sliding_window 131072, every layer is full
      {"qwen2.5-7b-instruct.config.json", {"qwen2", repeat(28, full), {}, 28, 4, 128}, true},
      {"gemma-2-9b-it.config.json", {"gemma2", periodic(42, 2, sw, full), 4096, 16, 8, 256}, true},
      // heads 8, kv heads 4, head_dim 256 and the pattern 6 are Gemma3TextConfig's defaults
      {"gemma-3-4b-it.config.json", {"gemma3_text", periodic(34, 6, sw, full), 1024, 8, 4, 256}, true},
      {"qwen3-next-80b-a3b-instruct.config.json", {"qwen3_next", periodic(48, 4, linear, full), {}, 16, 2, 256}, false},
      {"flan-t5-base.config.json", {"t5", repeat(12, full), {}, 12, 12, 64}, true},
      // the decoder has 4 layers (num_hidden_layers 32 is the encoder's)
      {"whisper-large-v3-turbo.config.json", {"whisper", repeat(4, full), {}, 20, 20, 64}, true},
  };
  for (const auto& it : items) {  // no structured bindings: clang 14 cannot capture them in CAPTURE
    CAPTURE(it.file);
    const auto c = kvc::ModelConfig::from_file(test_config(it.file));
    check_layout(c, it.want);
    if (it.buildable) check_caches(c, it.want);
  }
  CHECK(warnings.messages.empty());
}

TEST_CASE("docs/model_configs.md: loading a config and building its caches") {
  const fs::path path = test_config("gemma-3-4b-it.config.json");
  // [snippet:model_config_from_file]
  const kvc::ModelConfig config = kvc::ModelConfig::from_file(path);  // or a folder holding config.json
  auto dynamic = kvc::make_dynamic_cache<float>(config);              // one layer per config layer
  kvc::StaticCache<float> fixed(config, /*max_cache_len=*/4096);
  // [/snippet]
  CHECK(config.model_type == "gemma3_text");
  CHECK(dynamic.size() == 34);
  CHECK(dynamic.layer_name(5) == "DynamicLayer");
  CHECK(fixed.get_max_length(0) == 1024);
}

TEST_CASE("the fields behind the layouts") {
  const auto gemma3 = kvc::ModelConfig::from_file(test_config("gemma-3-4b-it.config.json"));
  CHECK(gemma3.hidden_size == 2560);
  CHECK(gemma3.head_dim == 256);
  CHECK(gemma3.num_key_value_heads == 4);
  CHECK(gemma3.sliding_window == 1024);
  CHECK(gemma3.layer_types == periodic(34, 6, sw, full));
  const auto llama = kvc::ModelConfig::from_file(test_config("llama-3.1-8b-instruct.config.json"));
  CHECK(llama.head_dim == 128);                // LlamaConfig.__post_init__: hidden_size // num_attention_heads
  CHECK_FALSE(llama.layer_types.has_value());  // the generic rule applies in layer_specs
  const auto t5 = kvc::ModelConfig::from_file(test_config("flan-t5-base.config.json"));
  CHECK(t5.hidden_size == 768);
  CHECK(t5.num_attention_heads == 12);
  const auto whisper = kvc::ModelConfig::from_file(test_config("whisper-large-v3-turbo.config.json"));
  CHECK(whisper.hidden_size == 1280);
  CHECK(whisper.num_hidden_layers == 4);
}

TEST_CASE("a linear-attention hybrid (Qwen3-Next) builds linear and full-attention layers") {
  const auto c = kvc::ModelConfig::from_file(test_config("qwen3-next-80b-a3b-instruct.config.json"));
  auto dynamic = kvc::make_dynamic_cache<float>(c);
  kvc::StaticCache<float> fixed(c, 8);
  REQUIRE(dynamic.size() == c.num_hidden_layers);
  for (std::int64_t i = 0; i < dynamic.size(); ++i) {
    const bool full = (i + 1) % 4 == 0;  // full_attention_interval 4
    CHECK(std::string(dynamic.layer_name(i)) == (full ? "DynamicLayer" : "LinearAttentionLayer"));
    CHECK(std::string(fixed.layer_name(i)) == (full ? "StaticLayer" : "LinearAttentionLayer"));
  }
  CHECK(dynamic.is_linear()[0]);
  CHECK_FALSE(dynamic.is_linear()[3]);
  CHECK(fixed.get_max_length() == 8);  // the linear layers have no length
}

TEST_CASE("the 13 published config.json files (tests/data/configs/published)") {
  const fs::path dir = repo_root() / "tests" / "data" / "configs" / "published";
  REQUIRE(fs::is_directory(dir));
  kvc_test::captured_warnings warnings;
  const std::map<std::string, std::pair<layout, bool>> expected{
      {"gemma-2-2b-it.config.json", {{"gemma2", periodic(26, 2, sw, full), 4096, 8, 4, 256}, true}},
      {"gemma-3-1b-it.config.json", {{"gemma3_text", periodic(26, 6, sw, full), 512, 4, 1, 256}, true}},
      {"gemma-3-27b-it.config.json", {{"gemma3_text", periodic(62, 6, sw, full), 1024, 32, 16, 128}, true}},
      {"gpt-oss-20b.config.json", {{"gpt_oss", periodic(24, 2, sw, full), 128, 64, 8, 64}, true}},
      {"llama-3.2-1b-instruct.config.json", {{"llama", repeat(16, full), {}, 32, 8, 64}, true}},
      // text_config holds almost nothing: LlamaConfig's defaults
      {"llava-1.5-7b-hf.config.json", {{"llama", repeat(32, full), {}, 32, 32, 128}, true}},
      {"mistral-7b-instruct-v0.2-dequantized.config.json", {{"mistral", repeat(32, full), {}, 32, 8, 128}, true}},
      {"mistral-7b-v0.1.config.json", {{"mistral", repeat(32, sw), 4096, 32, 8, 128}, true}},
      {"mixtral-8x7b-v0.1.config.json", {{"mixtral", repeat(32, full), {}, 32, 8, 128}, true}},
      // the generic rule: sliding_window 262144 makes every layer sliding
      {"phi-3-mini-128k-instruct.config.json", {{"phi3", repeat(32, sw), 262144, 32, 32, 96}, true}},
      // flat text keys (Qwen2VLTextConfig); use_sliding_window false
      {"qwen2-vl-2b-instruct.config.json", {{"qwen2_vl_text", repeat(28, full), {}, 12, 2, 128}, true}},
      {"qwen3-0.6b.config.json", {{"qwen3", repeat(28, full), {}, 16, 8, 128}, true}},
      {"qwen3-next-80b-a3b-thinking.config.json",
       {{"qwen3_next", periodic(48, 4, linear, full), {}, 16, 2, 256}, false}},
  };
  std::size_t seen = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() != ".json") continue;
    CAPTURE(name);
    const auto it = expected.find(name);
    REQUIRE_MESSAGE(it != expected.end(), "no expected layout for " << name);
    ++seen;
    const auto c = kvc::ModelConfig::from_file(entry.path());
    check_layout(c, it->second.first);
    if (it->second.second) check_caches(c, it->second.first);
  }
  CHECK(seen == expected.size());
  CHECK(warnings.messages.empty());
}

TEST_CASE("model_type rules on small configs") {
  using kvc::ModelConfig;
  SUBCASE("qwen2: sliding from max_window_layers on when use_sliding_window") {
    const auto c = ModelConfig::from_json(R"({"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64,
      "num_attention_heads": 4, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 2})");
    CHECK(c.layer_types == S{full, full, sw, sw});
    CHECK(c.sliding_window == 16);
    CHECK(c.num_key_value_heads == 32);  // Qwen2Config's default, the key being absent
    CHECK(c.head_dim == 16);
  }
  SUBCASE("qwen2_moe: even layers below max_window_layers") {
    const auto c = ModelConfig::from_json(R"({"model_type": "qwen2_moe", "num_hidden_layers": 6,
      "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 3})");
    CHECK(c.layer_types == S{sw, full, sw, full, full, full});
    const auto off =
        ModelConfig::from_json(R"({"model_type": "qwen2_moe", "num_hidden_layers": 2, "sliding_window": 0})");
    CHECK(off.layer_types == S{full, full});
    CHECK_FALSE(off.sliding_window.has_value());  // transformers stores 0, which no layer uses
  }
  SUBCASE("qwen3_moe: the gate, then the generic rule") {
    const auto on = ModelConfig::from_json(R"({"model_type": "qwen3_moe", "use_sliding_window": true})");
    CHECK(on.num_hidden_layers == 24);
    CHECK(spec_types(on) == repeat(24, sw));
    CHECK(on.sliding_window == 4096);
    CHECK_FALSE(ModelConfig::from_json(R"({"model_type": "qwen3_moe"})").sliding_window.has_value());
  }
  SUBCASE("mistral: an absent sliding_window is 4096, a null one None") {
    const auto absent = ModelConfig::from_json(R"({"model_type": "mistral", "num_hidden_layers": 2})");
    CHECK(absent.sliding_window == 4096);
    CHECK(kvc::layer_specs(absent)[1].type == sw);
    CHECK_FALSE(ModelConfig::from_json(R"({"model_type": "mistral", "sliding_window": null})").sliding_window);
  }
  SUBCASE("num_key_value_heads and head_dim: absent takes the class default, null the fallback") {
    const auto absent = ModelConfig::from_json(R"({"model_type": "mistral"})");
    CHECK(absent.num_key_value_heads == 8);
    const auto null_kv = ModelConfig::from_json(R"({"model_type": "mistral", "num_key_value_heads": null})");
    CHECK(null_kv.num_key_value_heads == 32);
    CHECK(ModelConfig::from_json(R"({"model_type": "qwen3"})").head_dim == 128);
    CHECK(ModelConfig::from_json(R"({"model_type": "qwen3", "head_dim": null})").head_dim == 4096 / 32);
  }
  SUBCASE("gemma2 and gemma3_text defaults, sliding_window_pattern, bidirectional attention") {
    const auto g2 = ModelConfig::from_json(R"({"model_type": "gemma2", "num_hidden_layers": 3})");
    CHECK(g2.layer_types == S{sw, full, sw});
    CHECK(g2.sliding_window == 4096);
    const auto g3 = ModelConfig::from_json(
        R"({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512, "sliding_window_pattern": 3,
            "use_bidirectional_attention": true})");
    CHECK(g3.layer_types == S{sw, sw, full, sw, sw, full});
    CHECK(g3.sliding_window == 257);  // 512 // 2 + 1
    const auto defaults = ModelConfig::from_json(R"({"model_type": "gemma3"})");
    CHECK(defaults.model_type == "gemma3_text");
    CHECK(defaults.layer_types == periodic(26, 6, sw, full));
  }
  SUBCASE("qwen3_next: legacy layer type names are remapped") {
    const auto c = ModelConfig::from_json(
        R"({"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["mamba", "attention"]})");
    CHECK(c.layer_types == S{linear, full});
  }
  SUBCASE("t5: num_decoder_layers null falls back to num_layers; the class defaults") {
    const auto c = ModelConfig::from_json(R"({"model_type": "t5", "num_layers": 3, "num_decoder_layers": null})");
    CHECK(c.num_hidden_layers == 3);
    const auto d = ModelConfig::from_json(R"({"model_type": "t5"})");
    CHECK(d.num_hidden_layers == 6);
    CHECK(d.layer_num_attention_heads(0) == 8);
    CHECK(d.layer_head_dim(0) == 64);
    CHECK(d.hidden_size == 512);
  }
  SUBCASE("decoder and generator sub-configs are text configs too") {
    const auto c = ModelConfig::from_json(R"({"model_type": "vision-encoder-decoder", "encoder": {"model_type": "vit"},
      "decoder": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}})");
    CHECK(c.model_type == "llama");
    CHECK(c.num_hidden_layers == 2);
    CHECK(c.layer_head_dim(1) == 16);
  }
  SUBCASE("an unknown composite with a known text config: no warning") {
    kvc_test::captured_warnings warnings;
    const auto c = ModelConfig::from_json(R"({"model_type": "some_vlm", "text_config": {"model_type": "qwen3",
      "num_hidden_layers": 2}})");
    CHECK(c.model_type == "qwen3");
    CHECK(c.layer_types == S{full, full});
    CHECK(warnings.messages.empty());
  }
  SUBCASE("generic keys: attention_chunk_size, num_kv_shared_layers, per_layer_config") {
    const auto chunked = ModelConfig::from_json(R"({"model_type": "llama", "num_hidden_layers": 2,
      "attention_chunk_size": 8192})");
    CHECK(spec_types(chunked) == S{"chunked_attention", "chunked_attention"});
    const auto shared = ModelConfig::from_json(R"({"model_type": "llama", "num_hidden_layers": 4, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
      "num_kv_shared_layers": 2})");
    CHECK(spec_types(shared) == S{sw, full});
    const auto per_layer = ModelConfig::from_json(R"({"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64,
      "num_attention_heads": 4, "num_key_value_heads": 4,
      "per_layer_config": {"0": {"sliding_window": 32}, "2": {"num_key_value_heads": 2, "head_dim": 8}, "1": null}})");
    const auto cache = kvc::make_dynamic_cache<float>(per_layer);
    CHECK(cache.layer_name(0) == "DynamicSlidingWindowLayer");
    CHECK(cache.get_max_length(0) == 32);
    CHECK(cache.layer_name(1) == "DynamicLayer");
    CHECK(per_layer.layer_num_key_value_heads(2) == 2);
    CHECK(per_layer.layer_head_dim(2) == 8);
    CHECK(per_layer.layer_head_dim(1) == 16);
  }
}

TEST_CASE("an unknown model_type: the generic rule and one warning naming it") {
  kvc_test::captured_warnings warnings;
  const char* json = R"({"model_type": "my_model", "num_hidden_layers": 2, "sliding_window": 8, "hidden_size": 32,
    "num_attention_heads": 2})";
  const auto c = kvc::ModelConfig::from_json(json);
  CHECK(c.model_type == "my_model");
  CHECK(spec_types(c) == S{sw, sw});
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 16);
  kvc::ModelConfig::from_json(json);
  REQUIRE(warnings.messages.size() == 1);
  CHECK(warnings.messages[0] ==
        "ModelConfig: model_type 'my_model' has no kvc rule (docs/model_configs.md): its layers follow the generic "
        "rule (layer_types, else sliding_window or attention_chunk_size for every layer) and absent fields get no "
        "class defaults");
  SUBCASE("an encoder-decoder of unknown type: the decoder_ keys, as get_text_config(decoder=True)") {
    const auto bart = kvc::ModelConfig::from_json(R"({"model_type": "bart", "is_encoder_decoder": true,
      "num_hidden_layers": 12, "encoder_layers": 12, "decoder_layers": 6, "decoder_attention_heads": 16,
      "encoder_attention_heads": 12, "d_model": 1024})");
    CHECK(bart.num_hidden_layers == 6);
    CHECK(bart.num_attention_heads == 16);
    CHECK(warnings.messages.back().find("'bart'") != std::string::npos);
  }
  SUBCASE("no model_type at all: the generic rule, silently") {
    const auto plain = kvc::ModelConfig::from_json(R"({"num_hidden_layers": 1})");
    CHECK(plain.model_type.empty());
    CHECK(warnings.messages.size() == 1);
  }
}

TEST_CASE("from_file reads <dir>/config.json and reports unreadable files") {
  const fs::path dir = fs::temp_directory_path() / "kvc_model_config_json_test";
  fs::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << R"({"model_type": "gemma2", "num_hidden_layers": 2})";
    std::ofstream(dir / "broken.json") << "{\"model_type\": \"llama\",\n  \"num_hidden_layers\": 32,,}";
  }
  CHECK(kvc::ModelConfig::from_file(dir).layer_types == S{sw, full});
  const std::string broken = (dir / "broken.json").string();
  CHECK_THROWS_WITH_AS(kvc::ModelConfig::from_file(dir / "broken.json"),
                       ("It looks like the config file at '" + broken +
                        "' is not a valid JSON file. [json.exception.parse_error.101] parse error at line 2, column "
                        "27: syntax error while parsing object key - unexpected ','; expected string literal")
                           .c_str(),
                       kvc::ValueError);
  const std::string missing = (dir / "missing.json").string();
  CHECK_THROWS_WITH_AS(kvc::ModelConfig::from_file(dir / "missing.json"),
                       ("ModelConfig: cannot open '" + missing + "'").c_str(), kvc::RuntimeError);
  fs::remove_all(dir);
}

TEST_CASE("error messages") {
  using kvc::ModelConfig;
  kvc_test::captured_warnings warnings;  // the unknown model_type 'x' below
  const auto error = [](const std::string& json) -> std::string {
    try {
      ModelConfig::from_json(json);
    } catch (const kvc::ValueError& e) {
      return e.what();
    }
    return "no ValueError";
  };
  // malformed JSON: the parser's message, with its position
  CHECK(error(R"({"num_hidden_layers": })") ==
        "ModelConfig: malformed JSON: [json.exception.parse_error.101] parse error at line 1, column 23: syntax error "
        "while parsing value - unexpected '}'; expected '[', '{', or a literal");
  CHECK(error("") ==
        "ModelConfig: malformed JSON: [json.exception.parse_error.101] parse error at line 1, column 1: syntax error "
        "while parsing value - unexpected end of input; expected '[', '{', or a literal");
  CHECK(error("[1, 2]") == "ModelConfig: a model config must be a JSON object, got [1,2]");
  // wrong types, named with their path
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": "32"})") ==
        "ModelConfig: `num_hidden_layers` must be an integer, got \"32\"");
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 32.0})") ==
        "ModelConfig: `num_hidden_layers` must be an integer, got 32.0");
  CHECK(error(R"({"model_type": "llama", "hidden_size": true})") ==
        "ModelConfig: `hidden_size` must be an integer, got true");
  CHECK(error(R"({"model_type": 3})") == "ModelConfig: `model_type` must be a string, got 3");
  CHECK(error(R"({"model_type": "gemma3", "text_config": {"head_dim": [256]}})") ==
        "ModelConfig: `text_config.head_dim` must be an integer, got [256]");
  CHECK(error(R"({"model_type": "qwen2", "use_sliding_window": "yes"})") ==
        "ModelConfig: `use_sliding_window` must be a boolean, got \"yes\"");
  CHECK(error(R"({"model_type": "llava", "text_config": "llama"})") ==
        "ModelConfig: `text_config` must be an object, got \"llama\"");
  CHECK(error(R"({"model_type": "llama", "layer_types": "full_attention"})") ==
        "ModelConfig: `layer_types` must be an array of strings, got \"full_attention\"");
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["full_attention", 3]})") ==
        "ModelConfig: `layer_types[1]` must be a string, got 3");
  CHECK(error(R"({"model_type": "llama", "per_layer_config": [1]})") ==
        "ModelConfig: `per_layer_config` must be an object, got [1]");
  CHECK(error(R"({"model_type": "llama", "per_layer_config": {"1": 5}})") ==
        "ModelConfig: `per_layer_config.1` must be an object, got 5");
  CHECK(error(R"({"model_type": "llama", "per_layer_config": {"1": {"sliding_window": "8"}}})") ==
        "ModelConfig: `per_layer_config.1.sliding_window` must be an integer, got \"8\"");
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": ")" + std::string(100, 'x') + R"("})") ==
        "ModelConfig: `num_hidden_layers` must be an integer, got \"" + std::string(60, 'x') + "...");
  // negative and zero sizes
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": -1})") ==
        "ModelConfig: `num_hidden_layers` must be 0 or more, got -1");
  CHECK(error(R"({"model_type": "llama", "num_attention_heads": 0})") ==
        "ModelConfig: `num_attention_heads` must be a positive integer, got 0");
  CHECK(error(R"({"model_type": "gemma3", "text_config": {"head_dim": -4}})") ==
        "ModelConfig: `text_config.head_dim` must be a positive integer, got -4");
  CHECK(error(R"({"model_type": "mistral", "sliding_window": 0})") ==
        "ModelConfig: `sliding_window` must be a positive integer, got 0");
  CHECK(error(R"({"model_type": "mistral", "sliding_window": -8})") ==
        "ModelConfig: `sliding_window` must be 0 or more, got -8");
  CHECK(error(R"({"model_type": "gemma3_text", "sliding_window_pattern": 0})") ==
        "ModelConfig: `sliding_window_pattern` must be a positive integer, got 0");
  CHECK(error(R"({"model_type": "t5", "d_kv": -1})") == "ModelConfig: `d_kv` must be a positive integer, got -1");
  // absurd sizes, refused before anything is allocated
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 2000000})") ==
        "ModelConfig: `num_hidden_layers` is 2000000, above kvc's limit of 1048576");
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 18446744073709551615})") ==
        "ModelConfig: `num_hidden_layers` is 18446744073709551615, above kvc's limit of 1048576");
  CHECK(error(R"({"model_type": "llama", "hidden_size": 9223372036854775807})") ==
        "ModelConfig: `hidden_size` is 9223372036854775807, above kvc's limit of 1099511627776");
  std::string long_types = R"({"model_type": "llama", "layer_types": [0)";
  for (int i = 0; i < (1 << 20); ++i) long_types += ",0";
  CHECK(error(long_types + "]}") == "ModelConfig: `layer_types` has 1048577 entries, above kvc's limit of 1048576");
  // inconsistent or missing values
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 3, "layer_types": ["full_attention"]})") ==
        "ModelConfig: `num_hidden_layers` (3) must be equal to the number of `layer_types` (1)");
  CHECK(error(R"({"model_type": "llama", "num_hidden_layers": 2, "per_layer_config": {"2": {}}})") ==
        "ModelConfig: `per_layer_config` key \"2\" is out of range for 2 layers");
  CHECK(error(R"({"model_type": "llama", "per_layer_config": {"first": {}}})") ==
        "ModelConfig: `per_layer_config` key \"first\" is not a layer index");
  CHECK(error(R"({"hidden_size": 8})") == "ModelConfig: the config has no `num_hidden_layers`");
  CHECK(error(R"({"model_type": "x", "text_config": {"hidden_size": 8}})") ==
        "ModelConfig: the config has no `text_config.num_hidden_layers`");
  CHECK(error(R"({"text_config": {}, "decoder": {}})") ==
        "Multiple valid text configs were found in the model config: ['decoder', 'text_config']. In this case, using "
        "`get_text_config()` would be ambiguous. Please specify the desired text config directly, e.g. `text_config = "
        "config.sub_config_name`");
}

// kvc::GenerationConfig and the cache_implementation constant lists (transformers'
// generation/configuration_utils.py: GenerationConfig.validate and the module-level constants).

#include "../support/kvc_test.hpp"

#include <kvc/generation.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace {

template <std::size_t N>
constexpr bool names_are(const std::array<std::string_view, N>& got, const std::array<std::string_view, N>& want) {
  for (std::size_t i = 0; i < N; ++i)
    if (got[i] != want[i]) return false;
  return true;
}

// ---- the constant lists, checked at compile time -------------------------------------------
static_assert(std::is_same_v<decltype(kvc::STATIC_CACHE_IMPLEMENTATIONS), const std::array<std::string_view, 2>>);
static_assert(std::is_same_v<decltype(kvc::ALL_CACHE_IMPLEMENTATIONS), const std::array<std::string_view, 10>>);
static_assert(names_are(kvc::STATIC_CACHE_IMPLEMENTATIONS, {"static", "offloaded_static"}));
static_assert(names_are(kvc::DYNAMIC_CACHE_IMPLEMENTATIONS, {"dynamic", "offloaded", "quantized"}));
static_assert(names_are(kvc::DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS,
                        {"sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
                         "offloaded_hybrid_chunked"}));
static_assert(kvc::ALL_STATIC_CACHE_IMPLEMENTATIONS.size() == 7);
static_assert(names_are(kvc::ALL_STATIC_CACHE_IMPLEMENTATIONS,
                        {"static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
                         "offloaded_hybrid_chunked"}));
static_assert(names_are(kvc::ALL_CACHE_IMPLEMENTATIONS,
                        {"static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
                         "offloaded_hybrid_chunked", "dynamic", "offloaded", "quantized"}));
// No "dynamic_full" alias in transformers at a597f974; "paged" is valid for validate() only.
static_assert(!kvc::detail::contains_name(kvc::ALL_CACHE_IMPLEMENTATIONS, "dynamic_full"));
static_assert(!kvc::detail::contains_name(kvc::ALL_CACHE_IMPLEMENTATIONS, "paged"));
static_assert(kvc::detail::valid_cache_implementations.size() == 11);
static_assert(kvc::detail::valid_cache_implementations.back() == "paged");

const std::filesystem::path data_dir = std::filesystem::path(__FILE__).parent_path() / ".." / "data" / "generation";

const std::string choose_one_of =
    "Choose one of: ('static', 'offloaded_static', 'sliding_window', 'hybrid', 'hybrid_chunked', 'offloaded_hybrid', "
    "'offloaded_hybrid_chunked', 'dynamic', 'offloaded', 'quantized', 'paged')";

const std::string pretrained_note =
    "\nIf you're using a pretrained model, note that some of these attributes may be set through the model's "
    "`generation_config.json` file.";

kvc::GenerationConfig with_implementation(const char* name) {
  kvc::GenerationConfig c;
  c.cache_implementation = name;
  return c;
}

}  // namespace

TEST_CASE("the lists print the way Python prints them") {
  CHECK(kvc::detail::py_str_tuple(kvc::STATIC_CACHE_IMPLEMENTATIONS) == "('static', 'offloaded_static')");
  CHECK(kvc::detail::py_str_tuple(kvc::DYNAMIC_CACHE_IMPLEMENTATIONS) == "('dynamic', 'offloaded', 'quantized')");
  CHECK("Choose one of: " + kvc::detail::py_str_tuple(kvc::detail::valid_cache_implementations) == choose_one_of);
}

TEST_CASE("defaults: transformers' defaults, no cache fields set") {
  const kvc::GenerationConfig c;
  CHECK_FALSE(c.use_cache.has_value());
  CHECK_FALSE(c.cache_implementation.has_value());
  CHECK(c.cache_config.is_null());
  CHECK_FALSE(c.max_cache_len.has_value());
  CHECK_FALSE(c.prefill_chunk_size.has_value());
  CHECK(c.max_length == 20);
  CHECK_FALSE(c.max_new_tokens.has_value());
  CHECK(c.num_beams == 1);
  CHECK(c.num_return_sequences == 1);
  CHECK_FALSE(c.is_assistant.has_value());
  kvc_test::captured_warnings w;
  c.validate();
  c.validate(true);
  CHECK(w.messages.empty());
}

TEST_CASE("every valid cache_implementation passes, paged included") {
  kvc_test::captured_warnings w;
  for (const auto name : kvc::ALL_CACHE_IMPLEMENTATIONS) with_implementation(std::string(name).c_str()).validate(true);
  with_implementation("paged").validate(true);
  CHECK(w.messages.empty());
}

TEST_CASE("an unknown cache_implementation is a ValueError listing the valid ones") {
  CHECK_THROWS_WITH_AS(with_implementation("dynamic_full").validate(),
                       ("Invalid `cache_implementation` (dynamic_full). " + choose_one_of).c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(with_implementation("Static").validate(true),
                       ("Invalid `cache_implementation` (Static). " + choose_one_of).c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(with_implementation("").validate(),
                       ("Invalid `cache_implementation` (). " + choose_one_of).c_str(), kvc::ValueError);
}

TEST_CASE("max_new_tokens must be positive, and is checked first") {
  kvc::GenerationConfig c;
  c.max_new_tokens = 1;
  c.validate(true);
  c.max_new_tokens = 0;
  CHECK_THROWS_WITH_AS(c.validate(), "`max_new_tokens` must be greater than 0, but is 0.", kvc::ValueError);
  c.max_new_tokens = -3;
  c.cache_implementation = "nope";
  CHECK_THROWS_WITH_AS(c.validate(), "`max_new_tokens` must be greater than 0, but is -3.", kvc::ValueError);
}

TEST_CASE("max_cache_len without a static cache: one warning, with the implementation's repr") {
  kvc_test::captured_warnings w;
  kvc::GenerationConfig c;
  c.max_cache_len = 128;
  c.validate();
  c.validate();  // warning_once
  c.cache_implementation = "dynamic";
  c.validate(true);  // a warning even when strict
  c.cache_implementation = "paged";
  c.validate();
  CHECK(w.messages == std::vector<std::string>{
                          "`max_cache_len` is only used with static caches (('static', 'offloaded_static')); it will "
                          "be ignored with `cache_implementation=None`.",
                          "`max_cache_len` is only used with static caches (('static', 'offloaded_static')); it will "
                          "be ignored with `cache_implementation='dynamic'`.",
                          "`max_cache_len` is only used with static caches (('static', 'offloaded_static')); it will "
                          "be ignored with `cache_implementation='paged'`.",
                      });
  w.messages.clear();
  for (const auto name : kvc::ALL_STATIC_CACHE_IMPLEMENTATIONS) {  // deprecated names count as static
    c.cache_implementation = std::string(name);
    c.validate(true);
  }
  CHECK(w.messages.empty());
}

TEST_CASE("use_cache=False with cache fields set: minor issues") {
  kvc::GenerationConfig c;
  c.use_cache = false;
  c.validate(true);  // nothing else set: no issue
  c.cache_implementation = "static";
  const std::string impl_issue =
      "- `cache_implementation`: You have not set `use_cache` to `True`, but cache_implementation is set to "
      "static.cache_implementation will have no effect.";
  CHECK_THROWS_WITH_AS(c.validate(true), ("GenerationConfig is invalid: \n" + impl_issue + pretrained_note).c_str(),
                       kvc::ValueError);
  {
    kvc_test::captured_warnings w;
    c.validate();
    c.validate();
    CHECK(w.messages ==
          std::vector<std::string>{
              "The following generation flags are not valid and may be ignored: ['cache_implementation']."});
  }

  c.cache_config = {{"backend", "quanto"}, {"nbits", 4}};
  const std::string config_issue =
      "- `cache_config`: You have not set `use_cache` to `True`, but cache_config is set to {'backend': 'quanto', "
      "'nbits': 4}.cache_config will have no effect.";
  CHECK_THROWS_WITH_AS(c.validate(true),
                       ("GenerationConfig is invalid: \n" + impl_issue + "\n" + config_issue + pretrained_note).c_str(),
                       kvc::ValueError);
  {
    kvc_test::captured_warnings w;
    c.validate();
    CHECK(w.messages == std::vector<std::string>{"The following generation flags are not valid and may be ignored: "
                                                 "['cache_implementation', 'cache_config']."});
  }

  c.cache_implementation.reset();
  c.cache_config = nlohmann::ordered_json::object();  // {} is not None
  CHECK_THROWS_WITH_AS(c.validate(true),
                       ("GenerationConfig is invalid: \n- `cache_config`: You have not set `use_cache` to `True`, but "
                        "cache_config is set to {}.cache_config will have no effect." +
                        pretrained_note)
                           .c_str(),
                       kvc::ValueError);

  c.use_cache.reset();  // None means True
  c.validate(true);
  c.use_cache = true;
  c.cache_implementation = "quantized";
  c.validate(true);
}

TEST_CASE("kvc's own range checks") {
  const auto fails = [](auto set, const char* message) {
    kvc::GenerationConfig c;
    set(c);
    CHECK_THROWS_WITH_AS(c.validate(), message, kvc::ValueError);
  };
  fails([](auto& c) { c.max_cache_len = 0; }, "GenerationConfig: `max_cache_len` must be a positive integer, got 0");
  fails([](auto& c) { c.prefill_chunk_size = -1; },
        "GenerationConfig: `prefill_chunk_size` must be a positive integer, got -1");
  fails([](auto& c) { c.max_length = -1; }, "GenerationConfig: `max_length` must be 0 or more, got -1");
  fails([](auto& c) { c.num_beams = 0; }, "GenerationConfig: `num_beams` must be a positive integer, got 0");
  fails([](auto& c) { c.num_return_sequences = -2; },
        "GenerationConfig: `num_return_sequences` must be a positive integer, got -2");
}

TEST_CASE("from_file: a Llama-3 style file (eos list, sampling fields) sets no cache field") {
  kvc_test::captured_warnings w;
  const auto c = kvc::GenerationConfig::from_file(data_dir / "llama3_instruct.json");
  CHECK(c == kvc::GenerationConfig{});
  CHECK(w.messages.empty());
}

TEST_CASE("from_file: Gemma-2's hybrid cache_implementation is kept as written") {
  const auto c = kvc::GenerationConfig::from_file(data_dir / "gemma2_hybrid.json");
  REQUIRE(c.cache_implementation.has_value());
  CHECK(*c.cache_implementation == "hybrid");
  CHECK_FALSE(c.use_cache.has_value());
  CHECK(c.cache_config.is_null());
}

TEST_CASE("from_file: a quantized cache_config keeps its keys in file order") {
  const auto c = kvc::GenerationConfig::from_file(data_dir / "quantized_cache.json");
  CHECK(c.cache_implementation == std::optional<std::string>("quantized"));
  CHECK(c.max_new_tokens == std::optional<std::int64_t>(256));
  REQUIRE(c.cache_config.is_object());
  CHECK(c.cache_config.at("backend") == "quanto");
  CHECK(c.cache_config.at("nbits") == 4);
  std::vector<std::string> keys;
  for (auto it = c.cache_config.begin(); it != c.cache_config.end(); ++it) keys.push_back(it.key());
  CHECK(keys ==
        std::vector<std::string>{"backend", "nbits", "residual_length", "q_group_size", "axis_key", "axis_value"});
}

TEST_CASE("from_file: every modelled field") {
  kvc_test::captured_warnings w;
  const auto c = kvc::GenerationConfig::from_file(data_dir / "static_compiled.json");
  CHECK(c.use_cache == std::optional<bool>(true));
  CHECK(c.cache_implementation == std::optional<std::string>("static"));
  CHECK(c.max_cache_len == std::optional<std::int64_t>(4096));
  CHECK(c.prefill_chunk_size == std::optional<std::int64_t>(512));
  CHECK(c.max_length == 32768);
  CHECK_FALSE(c.max_new_tokens.has_value());
  CHECK(c.num_beams == 4);
  CHECK(c.num_return_sequences == 2);
  CHECK(c.is_assistant == std::optional<bool>(false));
  CHECK(w.messages.empty());
}

TEST_CASE("from_file validates like transformers' constructor (not strict)") {
  kvc_test::captured_warnings w;
  const auto c = kvc::GenerationConfig::from_file(data_dir / "no_cache.json");
  CHECK(w.messages == std::vector<std::string>{"The following generation flags are not valid and may be ignored: "
                                               "['cache_implementation', 'cache_config']."});
  CHECK_THROWS_WITH_AS(
      c.validate(true),
      ("GenerationConfig is invalid: \n- `cache_implementation`: You have not set `use_cache` to `True`, but "
       "cache_implementation is set to offloaded.cache_implementation will have no effect.\n- `cache_config`: You have "
       "not set `use_cache` to `True`, but cache_config is set to {'backend': 'HQQ', 'nbits': 2, 'axis_key': 1, "
       "'device': 'cuda:0'}.cache_config will have no effect." +
       pretrained_note)
          .c_str(),
      kvc::ValueError);
}

TEST_CASE("from_file: missing and malformed files") {
  const auto missing = data_dir / "does_not_exist.json";
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_file(missing),
                       ("GenerationConfig: cannot open '" + missing.string() + "'").c_str(), kvc::RuntimeError);
  const auto malformed = data_dir / "malformed.json";
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_file(malformed),
                       doctest::Contains(("It looks like the config file at '" + malformed.string() +
                                          "' is not a valid JSON file. [json.exception.parse_error.101] parse error at "
                                          "line 5, column 1")
                                             .c_str()),
                       kvc::ValueError);
}

TEST_CASE("from_json: validate's errors surface while loading") {
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"cache_implementation": "dynamic_full"})"),
                       ("Invalid `cache_implementation` (dynamic_full). " + choose_one_of).c_str(), kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"max_new_tokens": 0})"),
                       "`max_new_tokens` must be greater than 0, but is 0.", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"max_cache_len": -4, "cache_implementation": "static"})"),
                       "GenerationConfig: `max_cache_len` must be a positive integer, got -4", kvc::ValueError);
  kvc_test::captured_warnings w;
  kvc::GenerationConfig::from_json(R"({"max_cache_len": 64, "cache_implementation": "offloaded"})");
  CHECK(w.messages == std::vector<std::string>{
                          "`max_cache_len` is only used with static caches (('static', 'offloaded_static')); it will "
                          "be ignored with `cache_implementation='offloaded'`."});
}

TEST_CASE("from_json: null means unset, unknown fields are ignored") {
  const auto c = kvc::GenerationConfig::from_json(
      R"({"use_cache": null, "cache_implementation": null, "cache_config": null, "max_length": null,
          "num_beams": null, "watermarking_config": {"greenlist_ratio": 0.25}, "eos_token_id": [1, 2]})");
  CHECK(c == kvc::GenerationConfig{});
  CHECK(kvc::GenerationConfig::from_json("{}") == kvc::GenerationConfig{});
}

TEST_CASE("from_json: malformed JSON and wrong types name the problem") {
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"use_cache": true,})"),
                       doctest::Contains("GenerationConfig: malformed JSON: [json.exception.parse_error.101]"),
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(""), doctest::Contains("GenerationConfig: malformed JSON: "),
                       kvc::ValueError);
  // nlohmann reports a number too large for a double as out_of_range (found by the fuzz.json test).
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"max_length": 1e999})"),
                       "GenerationConfig: malformed JSON: [json.exception.out_of_range.406] number overflow parsing "
                       "'1e999'",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json("[1, 2]"),
                       "GenerationConfig: a generation config must be a JSON object, got [1,2]", kvc::ValueError);
  const auto fails = [](const char* json, const char* message) {
    CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(json), message, kvc::ValueError);
  };
  fails(R"({"use_cache": 1})", "GenerationConfig: `use_cache` must be a boolean or null, got 1");
  fails(R"({"is_assistant": "yes"})", R"(GenerationConfig: `is_assistant` must be a boolean or null, got "yes")");
  fails(R"({"cache_implementation": ["static"]})",
        R"(GenerationConfig: `cache_implementation` must be a string or null, got ["static"])");
  fails(R"({"cache_config": "quanto"})", R"(GenerationConfig: `cache_config` must be an object or null, got "quanto")");
  fails(R"({"cache_config": []})", "GenerationConfig: `cache_config` must be an object or null, got []");
  fails(R"({"max_length": "20"})", R"(GenerationConfig: `max_length` must be an integer or null, got "20")");
  fails(R"({"max_cache_len": 1024.0})", "GenerationConfig: `max_cache_len` must be an integer or null, got 1024.0");
  fails(R"({"num_beams": true})", "GenerationConfig: `num_beams` must be an integer or null, got true");
  fails(R"({"prefill_chunk_size": 18446744073709551615})",
        "GenerationConfig: `prefill_chunk_size` must be an integer that fits in 64 bits, got 18446744073709551615");
  fails(R"({"max_new_tokens": {"n": 1}})",
        R"(GenerationConfig: `max_new_tokens` must be an integer or null, got {"n":1})");
  fails(R"({"num_return_sequences": 0})", "GenerationConfig: `num_return_sequences` must be a positive integer, got 0");
}

TEST_CASE("Python's repr of JSON values") {
  using kvc::detail::py_float_repr;
  CHECK(py_float_repr(0.0) == "0.0");
  CHECK(py_float_repr(-0.0) == "-0.0");
  CHECK(py_float_repr(1.0) == "1.0");
  CHECK(py_float_repr(0.1) == "0.1");
  CHECK(py_float_repr(-2.5) == "-2.5");
  CHECK(py_float_repr(123.456) == "123.456");
  CHECK(py_float_repr(0.0001) == "0.0001");
  CHECK(py_float_repr(0.00001) == "1e-05");
  CHECK(py_float_repr(1.5e-7) == "1.5e-07");
  CHECK(py_float_repr(1e15) == "1000000000000000.0");
  CHECK(py_float_repr(1e16) == "1e+16");
  CHECK(py_float_repr(1.25e16) == "1.25e+16");
  CHECK(py_float_repr(1e300) == "1e+300");
  CHECK(py_float_repr(1.0 / 3) == "0.3333333333333333");

  using kvc::detail::py_str_repr;
  CHECK(py_str_repr("quanto") == "'quanto'");
  CHECK(py_str_repr("it's") == "\"it's\"");
  CHECK(py_str_repr("both ' and \"") == "'both \\' and \"'");
  CHECK(py_str_repr("a\\b\tc\nd\x01") == "'a\\\\b\\tc\\nd\\x01'");
  CHECK(py_str_repr("caf\xc3\xa9 \xc2\x85") == "'caf\xc3\xa9 \\x85'");

  const auto v = nlohmann::ordered_json::parse(
      R"({"z": null, "a": [true, false, 1, -2, 0.5, 1e-5, 100000, 1e5], "m": {"s": "x'y"}, "e": {}, "l": []})");
  CHECK(kvc::detail::py_json_repr(v) ==
        R"({'z': None, 'a': [True, False, 1, -2, 0.5, 1e-05, 100000, 100000.0], 'm': {'s': "x'y"}, 'e': {}, 'l': []})");
  CHECK(kvc::detail::py_json_str(nlohmann::ordered_json("bare")) == "bare");
  CHECK(kvc::detail::py_json_str(nlohmann::ordered_json(nullptr)) == "None");
  CHECK(kvc::detail::py_str_list(std::vector<std::string>{"cache_implementation", "cache_config"}) ==
        "['cache_implementation', 'cache_config']");
  // One helper quotes every sequence as Python does: the repr of each string, a tuple's trailing
  // comma, set() for an empty set.
  CHECK(kvc::detail::py_str_list(std::vector<std::string>{"it's"}) == R"(["it's"])");
  CHECK(kvc::detail::py_str_tuple(std::vector<std::string>{"a"}) == "('a',)");
  CHECK(kvc::detail::py_str_tuple(std::vector<std::string>{}) == "()");
  CHECK(kvc::detail::py_str_set({"b", "a"}) == "{'a', 'b'}");
  CHECK(kvc::detail::py_str_set({}) == "set()");
}

TEST_CASE("a generation config, from code") {
  kvc_test::captured_warnings w;
  // [snippet:generation_config]
  kvc::GenerationConfig config;
  config.cache_implementation = "static";  // one of kvc::ALL_CACHE_IMPLEMENTATIONS, or "paged"
  config.max_cache_len = 4096;             // only read by the static implementations
  config.validate(/*strict=*/true);        // throws kvc::ValueError on an invalid configuration

  auto loaded = kvc::GenerationConfig::from_json(R"({
    "eos_token_id": [128001, 128009],
    "cache_implementation": "quantized",
    "cache_config": {"backend": "quanto", "nbits": 4}
  })");
  // loaded.cache_config["nbits"] == 4; the token ids are not cache fields and are ignored
  // [/snippet]
  CHECK(loaded.cache_config["nbits"] == 4);
  CHECK(w.messages.empty());
}

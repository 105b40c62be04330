// Hostile JSON for every reader (<kvc/detail/json.hpp>, docs/limits.md): nesting past the depth
// limit (it used to overflow the stack), objects with very many keys (ordered parsing used to be
// quadratic), files that are not regular files or are too large (reading used to block or
// exhaust memory), duplicate keys, and integers past 64 bits.

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <sys/stat.h>

#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {
namespace fs = std::filesystem;

std::string nested_arrays(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A scratch directory, removed at the end.
struct scratch {
  fs::path dir;
  scratch() {
    std::string tmpl = (fs::temp_directory_path() / "kvc-hostile-json-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

double seconds(const auto& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("nesting deeper than max_json_depth is a ValueError, not a stack overflow") {
  const std::string deep = nested_arrays(100000);  // 200 KB: used to crash ModelConfig and GenerationConfig
  CHECK_THROWS_WITH_AS(kvc::ModelConfig::from_json(R"({"num_hidden_layers": 1, "rope_scaling": )" + deep + "}"),
                       "ModelConfig: the JSON nests arrays and objects deeper than kvc's limit of 128 levels",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"cache_config": )" + deep + "}"),
                       "GenerationConfig: the JSON nests arrays and objects deeper than kvc's limit of 128 levels",
                       kvc::ValueError);
  CHECK_THROWS_AS(kvc::ModelConfig::from_json(deep), kvc::ValueError);
  // The limit counts levels: 128 open (the top-level object included) is fine, 129 is not.
  const std::string ok = R"({"num_hidden_layers": 1, "x": )" + nested_arrays(127) + "}";
  CHECK(kvc::ModelConfig::from_json(ok).num_hidden_layers == 1);
  const std::string too_deep = R"({"num_hidden_layers": 1, "x": )" + nested_arrays(128) + "}";
  CHECK_THROWS_AS(kvc::ModelConfig::from_json(too_deep), kvc::ValueError);
  // A deep value in a message is quoted as an excerpt, not dumped whole.
  const std::string message = [&] {
    try {
      kvc::GenerationConfig::from_json(R"({"max_length": )" + nested_arrays(100) + "}");
    } catch (const kvc::ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  CHECK(message == "GenerationConfig: `max_length` must be an integer or null, got " + std::string(61, '[') + "...");
}

TEST_CASE("an object of 40000 keys parses in time linear in its size, also in key order") {
  std::string keys = "{";
  for (int i = 0; i < 40000; ++i) keys += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": " + std::to_string(i);
  keys += "}";
  const std::string generation = R"({"ignored": )" + keys + R"(, "max_length": 7})";
  const std::string model = R"({"num_hidden_layers": 1, "ignored": )" + keys + "}";
  // GenerationConfig keeps key order (an ordered object); ModelConfig does not. Both parse the same
  // bytes: the ordered parse used to take 11-16 s here against 0.08 s, now about the same time.
  double ordered = 0, unordered = 0;
  ordered = seconds([&] { CHECK(kvc::GenerationConfig::from_json(generation).max_length == 7); });
  unordered = seconds([&] { CHECK(kvc::ModelConfig::from_json(model).num_hidden_layers == 1); });
  CAPTURE(ordered);
  CAPTURE(unordered);
  CHECK(ordered < 40 * unordered + 0.2);  // quadratic was 150-200 times the unordered parse
  // Order and values survive in an object large enough for the index.
  std::string big = R"({"cache_config": {)";
  for (int i = 0; i < 40; ++i) big += "\"c" + std::to_string(i) + "\": " + std::to_string(i) + ",";
  big += R"("c3": "last"}})";  // a duplicate: Python keeps its first place and the last value
  const auto g = kvc::GenerationConfig::from_json(big);
  REQUIRE(g.cache_config.size() == 40);
  CHECK(g.cache_config.begin().key() == "c0");
  CHECK(std::next(g.cache_config.begin(), 3).key() == "c3");
  CHECK(std::next(g.cache_config.begin(), 3).value() == "last");
  CHECK(std::next(g.cache_config.begin(), 39).key() == "c39");
  const auto small = kvc::GenerationConfig::from_json(R"({"cache_config": {"b": 1, "a": 2, "b": 3}})");
  CHECK(small.cache_config.dump() == R"({"b":3,"a":2})");
}

TEST_CASE("from_file refuses what is not a regular file, and files past max_json_file_bytes") {
  scratch s;
  // /dev/zero used to be read until memory ran out, a FIFO to block forever.
  CHECK_THROWS_WITH_AS(kvc::ModelConfig::from_file("/dev/zero"), "ModelConfig: '/dev/zero' is not a regular file",
                       kvc::RuntimeError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_file("/dev/zero"),
                       "GenerationConfig: '/dev/zero' is not a regular file", kvc::RuntimeError);
  const fs::path fifo = s.dir / "fifo.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_file(fifo),
                       ("GenerationConfig: '" + fifo.string() + "' is not a regular file").c_str(), kvc::RuntimeError);
  CHECK_THROWS_AS(kvc::ModelConfig::from_file(fifo), kvc::RuntimeError);
  // A sparse file one byte past the limit: refused by its size, before it is read.
  const fs::path big = s.dir / "big.json";
  std::ofstream(big).put('{');
  fs::resize_file(big, static_cast<std::uintmax_t>(kvc::max_json_file_bytes) + 1);
  CHECK_THROWS_WITH_AS(
      kvc::ModelConfig::from_file(big),
      ("ModelConfig: '" + big.string() + "' holds 16777217 bytes, above kvc's limit of 16777216 bytes for a JSON file")
          .c_str(),
      kvc::ValueError);
  CHECK_THROWS_AS(kvc::GenerationConfig::from_file(big), kvc::ValueError);
  // A missing file: the existing message.
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_file(s.dir / "missing.json"),
                       ("GenerationConfig: cannot open '" + (s.dir / "missing.json").string() + "'").c_str(),
                       kvc::RuntimeError);
  // A file at the limit's side that is small reads normally.
  const fs::path ok = s.dir / "generation_config.json";
  std::ofstream(ok) << R"({"max_length": 33})";
  CHECK(kvc::GenerationConfig::from_file(ok).max_length == 33);
}

TEST_CASE("generation config sizes: 64-bit overflow and kvc's limits") {
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"max_cache_len": 18446744073709551615})"),
                       "GenerationConfig: `max_cache_len` must be an integer that fits in 64 bits, got "
                       "18446744073709551615",
                       kvc::ValueError);
  // Used to reach a static cache whose buffer size wrapped around (a heap overflow on update).
  CHECK_THROWS_WITH_AS(
      kvc::GenerationConfig::from_json(R"({"cache_implementation": "static", "max_cache_len": 4611686018427387905})"),
      "GenerationConfig: `max_cache_len` is 4611686018427387905, above kvc's limit of 1099511627776", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"max_length": 9223372036854775807})"),
                       "GenerationConfig: `max_length` is 9223372036854775807, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::GenerationConfig::from_json(R"({"num_beams": 1099511627776})"),
                       "GenerationConfig: `num_beams` is 1099511627776, above kvc's limit of 1048576", kvc::ValueError);
  CHECK_THROWS_AS(kvc::GenerationConfig::from_json(R"({"prefill_chunk_size": 9223372036854775807})"), kvc::ValueError);
  CHECK_THROWS_AS(kvc::GenerationConfig::from_json(R"({"max_new_tokens": 9223372036854775807})"), kvc::ValueError);
  CHECK_THROWS_AS(kvc::GenerationConfig::from_json(R"({"num_return_sequences": 2000000})"), kvc::ValueError);
  // A config filled in code is checked by validate() (make_cache calls it).
  kvc::GenerationConfig g;
  g.max_cache_len = (std::int64_t{1} << 62) + 1;
  CHECK_THROWS_AS(g.validate(), kvc::ValueError);
}

// The cost of a hostile JSON file (docs/limits.md): parsing a document of max_json_file_bytes
// (16 MiB) with kvc's reader, as ModelConfig (unordered objects) and GenerationConfig (objects in
// key order), for an array of small integers (the most values per byte) and an object of 1.5
// million keys. Reports seconds per parse and, as counters, the document's size and the peak RSS.
//   <build>/benchmarks/kvc_bench_json
// Linear time is the point: the ordered parse used to be quadratic in an object's keys.

#include <string>

#include <sys/resource.h>

#include <benchmark/benchmark.h>

#include <kvc/config_json.hpp>
#include <kvc/generation.hpp>

namespace {

std::string document(bool object, const char* head) {
  const auto target = static_cast<std::size_t>(kvc::max_json_file_bytes);
  std::string text = head;
  text.reserve(target);
  if (!object) {
    text += "\"x\": [";
    while (text.size() < target - 8) text += "1,";
    text += "1]}";
  } else {
    text += "\"x\": {";
    for (long i = 0; text.size() < target - 32; ++i) text += "\"k" + std::to_string(i) + "\":1,";
    text += "\"z\":1}}";
  }
  return text;
}

double peak_rss_mib() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_maxrss) / 1024.0;
}

template <bool Ordered>
void parse(benchmark::State& state) {
  const bool object = state.range(0) != 0;
  const std::string text = document(object, R"({"num_hidden_layers": 1, "max_length": 5, )");
  for (auto _ : state) {
    if constexpr (Ordered)
      benchmark::DoNotOptimize(kvc::GenerationConfig::from_json(text));
    else
      benchmark::DoNotOptimize(kvc::ModelConfig::from_json(text));
  }
  state.counters["MiB"] = static_cast<double>(text.size()) / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.SetLabel(object ? "object of 1.5M keys" : "array of 8M integers");
}

}  // namespace

BENCHMARK(parse<false>)->Name("ModelConfig/from_json")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(parse<true>)
    ->Name("GenerationConfig/from_json")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

BENCHMARK_MAIN();

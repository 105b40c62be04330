#pragma once
// What both benchmark binaries share: the bulk memcpy reference and the console reporter, which
// prints google benchmark's table (colours only on a terminal, so that `| tee file` stays plain
// text) and keeps every result by name, the median when repetitions ran, for each binary's summary.

#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <benchmark/benchmark.h>

namespace kvc_bench {

// Copies range(0) MiB with one memcpy per iteration: the bandwidth figures are ratios to this.
inline void memcpy_bulk(benchmark::State& state) {
  const std::int64_t n = state.range(0) << 20;
  std::vector<char> src(static_cast<std::size_t>(n), 1), dst(static_cast<std::size_t>(n), 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), static_cast<std::size_t>(n));
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n);
}

struct Result {
  double seconds = 0;  // CPU time per iteration
  double bytes_per_second = 0;
  std::map<std::string, double> counters;
};

class ResultsReporter : public benchmark::ConsoleReporter {
 public:
  ResultsReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred || r.iterations == 0) continue;
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      std::string name = r.run_name.str();
      if (const std::string_view it = "/iterations:1"; std::string_view(name).ends_with(it))
        name.resize(name.size() - it.size());  // single-iteration runs: not part of the name here
      if (!aggregate && medians_.count(name)) continue;
      if (aggregate) medians_.insert(name);
      Result res;
      res.seconds = r.cpu_accumulated_time / static_cast<double>(r.iterations);
      for (const auto& [k, c] : r.counters) res.counters[k] = c.value;
      if (auto it = r.counters.find("bytes_per_second"); it != r.counters.end())
        res.bytes_per_second = it->second.value;
      results_[name] = res;
    }
  }

  const Result* find(const std::string& name) const {
    auto it = results_.find(name);
    return it == results_.end() ? nullptr : &it->second;
  }

 private:
  std::map<std::string, Result> results_;
  std::set<std::string> medians_;
};

}  // namespace kvc_bench

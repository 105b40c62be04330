#pragma once
// The console reporter both benchmark binaries use: it prints google benchmark's table (colours
// only on a terminal, so that `| tee file` stays plain text) and keeps every result by name, the
// median when repetitions ran, for the summary each binary prints at the end.

#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <benchmark/benchmark.h>

namespace kvc_bench {

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
      if (auto it = r.counters.find("bytes_per_second"); it != r.counters.end()) res.bytes_per_second = it->second.value;
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

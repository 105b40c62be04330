// kvc_bench_offload: what kvc::OffloadToFile costs per decode step, next to the disk it spills to.
//
// Model shape: 32 layers x 8 KV heads x head_dim 128, float, batch 1. Caches are StaticCaches of
// max_cache_len 4096 (every layer full attention), pre-filled with 4032 tokens outside the timing,
// so each layer holds 2 x 16 MiB of buffers (1 GiB for the cache) whatever the step.
//
//   seq_write/page_cache     overwrites a file of the cache's size (1 GiB) sequentially, 32 MiB per
//                            call (the first, allocating pass is not timed)
//   seq_write/dropped        the same, each 32 MiB written back to the device (sync_file_range) and
//                            dropped from the page cache, as drop_page_cache does per spilled layer
//   seq_read/<mode>          reads it back sequentially: the reference bandwidth. mode page_cache:
//                            straight after writing it (the data is in the kernel's page cache, so
//                            this is a memory copy); mode dropped: after fsync and
//                            posix_fadvise(DONTNEED), so the reads go to the device
//   step/memory              one decode step (32 `update`s of one token) of StaticCache<float>
//   step/file                the same with OffloadToFile: each layer is read back (prefetched) and
//                            written out again, 2 x 1 GiB of I/O per step, through the page cache
//   step/file_dropped        the same with OffloadFileOptions::drop_page_cache: every spill is
//                            written back to the device and dropped from the page cache, so the
//                            reads come from the device too
//
// Counters: GiB_moved (read + written per step), vs_memory (step time / step/memory's),
// read_vs_seq (the step's read bandwidth / seq_read of the same mode), io_vs_seq (the time the
// step's reads and writes take at the seq_read and seq_write bandwidths of the same mode / the
// step's time: 1 means as fast as sequential I/O). Times are wall-clock (the
// prefetch thread and the I/O waits are the point), each step's loop has no attention or MLP
// between the updates: the prefetch overlaps only with the other layers' updates, so this is the
// worst case of the overhead. Spill files go to $KVC_OFFLOAD_DIR, else $TMPDIR, else /tmp.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <kvc/caches.hpp>
#include <kvc/policies/offload/file.hpp>

namespace {

constexpr std::int64_t kLayers = 32;
constexpr std::int64_t kHeads = 8;
constexpr std::int64_t kHeadDim = 128;
constexpr std::int64_t kMaxLen = 4096;
constexpr std::int64_t kPrefill = 4032;
constexpr std::int64_t kLayerBytes = 2 * kHeads * kMaxLen * kHeadDim * static_cast<std::int64_t>(sizeof(float));
constexpr std::int64_t kCacheBytes = kLayers * kLayerBytes;  // 1 GiB
constexpr std::int64_t kChunk = 32 << 20;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Bandwidths measured by the seq_* benchmarks (they run first), bytes/s.
double g_read_page_cache = 0, g_read_dropped = 0, g_write = 0, g_write_dropped = 0, g_step_memory = 0;

std::string spill_directory() { return kvc::detail::spill::spill_directory(kvc::offload_file_options()); }

// A scratch file in the spill directory, unlinked at once (like the spill files).
struct scratch_file {
  int fd = -1;
  scratch_file() {
    std::string path = spill_directory() + "/kvc-bench-XXXXXX";
    fd = ::mkstemp(path.data());
    if (fd >= 0) ::unlink(path.c_str());
  }
  ~scratch_file() {
    if (fd >= 0) ::close(fd);
  }
};

// Writes the file in 32 MiB chunks; `drop`: each chunk is written back and dropped from the page
// cache before the next, as OffloadFileOptions::drop_page_cache does with each spilled layer.
bool write_all(int fd, const std::vector<char>& chunk, bool drop = false) {
  for (std::int64_t off = 0; off < kCacheBytes; off += kChunk) {
    if (kvc::detail::spill::pwrite_all(fd, reinterpret_cast<const std::byte*>(chunk.data()), chunk.size(), off) != 0)
      return false;
    if (drop) {
      ::sync_file_range(fd, off, kChunk,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      ::posix_fadvise(fd, off, kChunk, POSIX_FADV_DONTNEED);
    }
  }
  return true;
}

void BM_SeqWrite(benchmark::State& state) {
  const bool drop = state.range(0) != 0;
  scratch_file f;
  if (f.fd < 0) return state.SkipWithError("cannot create a scratch file in the spill directory");
  std::vector<char> chunk(kChunk, 1);
  // Untimed first pass: the spill file's regions are overwritten in steady state, so the reference
  // is an overwrite too (a first write into a new file also allocates the blocks).
  if (!write_all(f.fd, chunk)) return state.SkipWithError("write failed");
  for (auto _ : state)
    if (!write_all(f.fd, chunk, drop)) return state.SkipWithError("write failed");
  state.SetBytesProcessed(state.iterations() * kCacheBytes);
}

void BM_SeqRead(benchmark::State& state) {
  const bool drop = state.range(0) != 0;
  scratch_file f;
  if (f.fd < 0) return state.SkipWithError("cannot create a scratch file in the spill directory");
  std::vector<char> chunk(kChunk, 1);
  if (!write_all(f.fd, chunk)) return state.SkipWithError("write failed");
  ::fsync(f.fd);
  for (auto _ : state) {
    if (drop) {
      state.PauseTiming();
      ::posix_fadvise(f.fd, 0, kCacheBytes, POSIX_FADV_DONTNEED);
      state.ResumeTiming();
    }
    for (std::int64_t off = 0; off < kCacheBytes; off += kChunk)
      if (kvc::detail::spill::pread_all(f.fd, reinterpret_cast<std::byte*>(chunk.data()), chunk.size(), off) != 0)
        return state.SkipWithError("read failed");
    benchmark::DoNotOptimize(chunk.data());
  }
  state.SetBytesProcessed(state.iterations() * kCacheBytes);
}

kvc::ModelConfig model() {
  kvc::ModelConfig c;
  c.num_hidden_layers = kLayers;
  c.num_attention_heads = 4 * kHeads;
  c.num_key_value_heads = kHeads;
  c.head_dim = kHeadDim;
  c.hidden_size = 4 * kHeads * kHeadDim;
  return c;
}

template <class Cache>
void prefill(Cache& cache, std::mt19937& rng) {
  kvc::HostTensor<float> t(1, kHeads, kPrefill, kHeadDim);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(rng);
  for (std::int64_t l = 0; l < kLayers; ++l) cache.update(t, t, l);
}

// One decode step per iteration; at most kMaxLen - kPrefill steps (Iterations below).
template <class Cache>
void BM_Step(benchmark::State& state, bool drop_page_cache) {
  const auto saved = kvc::offload_file_options();
  auto options = saved;
  options.drop_page_cache = drop_page_cache;
  kvc::set_offload_file_options(options);
  {
    Cache cache(model(), kMaxLen);
    std::mt19937 rng(1);
    prefill(cache, rng);
    kvc::HostTensor<float> k(1, kHeads, 1, kHeadDim), v(1, kHeads, 1, kHeadDim);
    k.setConstant(0.5f);
    v.setConstant(-0.5f);
    for (std::int64_t l = 0; l < kLayers; ++l) cache.update(k, v, l);  // one warm-up step
    kvc::reset_offload_file_stats();
    for (auto _ : state)
      for (std::int64_t l = 0; l < kLayers; ++l) benchmark::DoNotOptimize(cache.update(k, v, l).keys.data());
    const auto stats = kvc::offload_file_stats();
    const double iters = static_cast<double>(state.iterations());
    const double moved = static_cast<double>(stats.bytes_read + stats.bytes_written) / iters;
    state.counters["GiB_moved"] = moved / kGiB;
    state.counters["sync_reads"] = static_cast<double>(stats.sync_reads) / iters;
    state.counters["prefetch_waits"] = static_cast<double>(stats.prefetch_waits) / iters;
    // Per-step figures in seconds are set by the reporter below (it knows the measured time).
    state.counters["bytes_read_per_step"] = static_cast<double>(stats.bytes_read) / iters;
    state.counters["bytes_written_per_step"] = static_cast<double>(stats.bytes_written) / iters;
  }
  kvc::set_offload_file_options(saved);
}

// Prints the table and keeps each run's wall time per iteration, then derives the ratios.
class Reporter : public benchmark::ConsoleReporter {
 public:
  Reporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    std::vector<Run> out = runs;
    for (Run& r : out) {
      if (r.error_occurred || r.iterations == 0) continue;
      const double seconds = r.real_accumulated_time / static_cast<double>(r.iterations);
      const std::string name = r.run_name.str();
      if (name.starts_with("seq_write/page_cache")) g_write = kCacheBytes / seconds;
      if (name.starts_with("seq_write/dropped")) g_write_dropped = kCacheBytes / seconds;
      if (name.starts_with("seq_read/page_cache")) g_read_page_cache = kCacheBytes / seconds;
      if (name.starts_with("seq_read/dropped")) g_read_dropped = kCacheBytes / seconds;
      if (name.starts_with("step/memory")) g_step_memory = seconds;
      if (name.starts_with("step/file")) {
        const bool dropped = name.starts_with("step/file_dropped");
        const double read_bw = r.counters["bytes_read_per_step"].value / seconds;
        const double io = r.counters["bytes_read_per_step"].value + r.counters["bytes_written_per_step"].value;
        const double seq_read = dropped ? g_read_dropped : g_read_page_cache;
        const double seq_write = dropped ? g_write_dropped : g_write;
        // The time the same bytes take at the sequential bandwidths: reads plus writes.
        const double seq_time = r.counters["bytes_read_per_step"].value / std::max(seq_read, 1.0) +
                                r.counters["bytes_written_per_step"].value / std::max(seq_write, 1.0);
        r.counters["vs_memory"] = g_step_memory > 0 ? seconds / g_step_memory : 0;
        r.counters["read_vs_seq"] = seq_read > 0 ? read_bw / seq_read : 0;
        r.counters["io_vs_seq"] = seq_time > 0 ? seq_time / seconds : 0;
        r.counters["GBps_io"] = io / seconds / 1e9;
        summary_.push_back(name + ": " + std::to_string(seconds * 1e3) + " ms/step, " +
                           std::to_string(seconds / std::max(g_step_memory, 1e-12)) + "x step/memory, " +
                           std::to_string(io / seconds / 1e9) + " GB/s of I/O, reads at " +
                           std::to_string(read_bw / std::max(seq_read, 1.0)) + " of seq_read, " +
                           std::to_string(seq_time / seconds) + " of the sequential read+write time");
      }
      r.counters.erase("bytes_read_per_step");
      r.counters.erase("bytes_written_per_step");
    }
    ConsoleReporter::ReportRuns(out);
  }
  void print_summary() const {
    std::printf("\nspill directory: %s\n", spill_directory().c_str());
    std::printf(
        "seq_write page_cache %.2f GB/s, dropped %.2f GB/s; seq_read page_cache %.2f GB/s, dropped %.2f GB/s; "
        "step/memory %.3f ms\n",
        g_write / 1e9, g_write_dropped / 1e9, g_read_page_cache / 1e9, g_read_dropped / 1e9, g_step_memory * 1e3);
    for (const auto& s : summary_) std::printf("%s\n", s.c_str());
  }

 private:
  std::vector<std::string> summary_;
};

}  // namespace

int main(int argc, char** argv) {
  using Memory = kvc::StaticCache<float>;
  using File = kvc::StaticCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<>>;
  benchmark::RegisterBenchmark("seq_write/page_cache", BM_SeqWrite)
      ->Arg(0)
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("seq_write/dropped", BM_SeqWrite)
      ->Arg(1)
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("seq_read/page_cache", BM_SeqRead)
      ->Arg(0)
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("seq_read/dropped", BM_SeqRead)
      ->Arg(1)
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step/memory", [](benchmark::State& s) { BM_Step<Memory>(s, false); })
      ->Iterations(kMaxLen - kPrefill - 1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step/file", [](benchmark::State& s) { BM_Step<File>(s, false); })
      ->Iterations(8)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step/file_dropped", [](benchmark::State& s) { BM_Step<File>(s, true); })
      ->Iterations(4)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.print_summary();
  benchmark::Shutdown();
  return 0;
}

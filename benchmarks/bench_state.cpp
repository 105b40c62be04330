// kvc_bench_state: kvc::save / kvc::load of a cache to a file against plain sequential file I/O of
// the same number of bytes, in the same run (docs/distributed.md, docs/state.md).
//
//   build/bench/benchmarks/kvc_bench_state [--mib N] [--reps N] [--dir DIR] [--cold] [--warm-heap]
//
// A kvc::DynamicCache<float> of N MiB of K/V (default 256: 16 layers, 8 KV heads of head_dim 128)
// is saved with kvc::save(cache, path) (written to path.tmp, checksummed, renamed) and loaded back
// with kvc::load(cache, path) into a new cache each time. The floor writes the same number of bytes
// from one buffer with one std::ofstream::write, and reads them back with one std::ifstream::read
// into a buffer allocated once; two more rows show what a load adds to that read: reading into a
// buffer new to the process (the kernel zeroes its pages on first touch, as it does for a new
// cache's), and the checksum (XXH64 over the bytes in memory). Every file is fsync'ed after it is
// written, outside the timing, so that no write-back runs during the reads; the reads then come
// from the page cache, unless --cold, which drops the files' pages (posix_fadvise DONTNEED)
// before each read, so that they come from the disk. --warm-heap keeps freed memory in the heap
// (mallopt), so that a load reuses the previous cache's pages. `reps` rounds after one warm-up, the
// medians compared. Prints a table and
//   SUMMARY state bytes=<file bytes> heap=default|warm reads=page-cache|cold
//           save_ratio=<floor write / kvc::save> load_ratio=<floor read / kvc::load>
//           load_ratio_new_buffer=<read into a new buffer / kvc::load>
// (ratio 1 = as fast as plain file I/O; the goal is >= 0.8). The files go to DIR (default: the
// current directory) and are removed at the end.
#include <kvc/kvc.hpp>
#include <kvc/state.hpp>

#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "instantiations.hpp"  // DynamicCache<float> instantiated once (inst_dynamic.cpp)

namespace {

using Cache = kvc::DynamicCache<float>;
using clock_type = std::chrono::steady_clock;

constexpr std::int64_t layers = 16, kv_heads = 8, head_dim = 128;

Cache make_cache(std::int64_t mib) {
  const std::int64_t seq = mib * 1024 * 1024 / (2 * layers * kv_heads * head_dim * 4);
  Cache cache;
  kvc::HostTensor<float> k(1, kv_heads, seq, head_dim), v(1, kv_heads, seq, head_dim);
  for (std::int64_t l = 0; l < layers; ++l) {
    for (Eigen::Index i = 0; i < k.size(); ++i) {
      k.data()[i] = static_cast<float>((i + l) % 1000);
      v.data()[i] = static_cast<float>((i + 3 * l) % 1000);
    }
    cache.update(k, v, l);
  }
  return cache;
}

// fsync(path); with drop, then asks the kernel to forget its cached pages.
void sync_file(const std::filesystem::path& path, bool drop) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path.string());
  const bool ok = ::fsync(fd) == 0 && (!drop || ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
  ::close(fd);
  if (!ok) throw std::runtime_error("fsync/posix_fadvise failed on " + path.string());
}

template <class F>
double seconds(F&& f) {
  const auto t = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int parse(std::string_view text) {
  int v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || v < 1)
    throw std::invalid_argument("not a positive integer: " + std::string(text));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int mib = 256, reps = 5;
    bool cold = false, warm_heap = false;
    std::filesystem::path dir = ".";
    for (int i = 1; i < argc; ++i) {
      const std::string_view option = argv[i];
      if (option == "--cold" || option == "--warm-heap") {
        (option == "--cold" ? cold : warm_heap) = true;
        continue;
      }
      if (i + 1 >= argc) throw std::invalid_argument("option " + std::string(option) + " needs a value");
      if (option == "--mib")
        mib = parse(argv[++i]);
      else if (option == "--reps")
        reps = parse(argv[++i]);
      else if (option == "--dir")
        dir = argv[++i];
      else
        throw std::invalid_argument("unknown option " + std::string(option));
    }
    if (warm_heap) {
      // As in kvc_bench_mpi: freed layers stay in the heap for the next load instead of going back
      // to the kernel (glibc's defaults), so that a load does not pay for new, zeroed pages.
      mallopt(M_MMAP_THRESHOLD, 32 << 20);
      mallopt(M_TRIM_THRESHOLD, INT_MAX);
    }
    const std::filesystem::path kvc_file = dir / "kvc_bench_state.kvc", raw_file = dir / "kvc_bench_state.raw";

    const Cache cache = make_cache(mib);
    kvc::save(cache, kvc_file);
    const auto bytes = static_cast<std::size_t>(std::filesystem::file_size(kvc_file));
    std::vector<char> buffer(bytes, 1);

    std::vector<double> save_s, write_s, load_s, read_s, fresh_s, hash_s;
    std::int64_t loaded_bytes = 0;
    for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up
      const double save_t = seconds([&] { kvc::save(cache, kvc_file); });
      sync_file(kvc_file, cold);
      const double write_t = seconds([&] {
        std::ofstream os(raw_file, std::ios::binary | std::ios::trunc);
        os.write(buffer.data(), static_cast<std::streamsize>(bytes));
        os.close();
        if (!os) throw std::runtime_error("writing " + raw_file.string() + " failed");
      });
      sync_file(raw_file, cold);
      const double load_t = seconds([&] {
        Cache loaded;
        kvc::load(loaded, kvc_file);
        loaded_bytes = loaded.bytes();
      });
      const double read_t = seconds([&] {
        std::ifstream is(raw_file, std::ios::binary);
        is.read(buffer.data(), static_cast<std::streamsize>(bytes));
        if (static_cast<std::size_t>(is.gcount()) != bytes) throw std::runtime_error("reading the floor's file failed");
      });
      // What kvc::load does beyond the floor's read: reading into memory new to the process (as a
      // new cache's), and the checksum (XXH64 over every byte, here over the buffer in memory).
      if (cold) sync_file(raw_file, true);
      const double fresh_t = seconds([&] {
        const std::unique_ptr<char[]> fresh(new char[bytes]);
        std::ifstream is(raw_file, std::ios::binary);
        is.read(fresh.get(), static_cast<std::streamsize>(bytes));
        if (static_cast<std::size_t>(is.gcount()) != bytes) throw std::runtime_error("reading the floor's file failed");
      });
      std::uint64_t hash = 0;
      const double hash_t = seconds([&] { hash = kvc::detail::xxh64(buffer.data(), bytes, 0); });
      if (hash == 42) std::printf("(a hash of 42)\n");  // keeps the hash from being optimised away
      if (r == 0) continue;
      save_s.push_back(save_t);
      write_s.push_back(write_t);
      load_s.push_back(load_t);
      read_s.push_back(read_t);
      fresh_s.push_back(fresh_t);
      hash_s.push_back(hash_t);
    }
    std::filesystem::remove(kvc_file);
    std::filesystem::remove(raw_file);

    const double gb = static_cast<double>(bytes) / 1e9;
    const double save_t = median(save_s), write_t = median(write_s), load_t = median(load_s), read_t = median(read_s);
    std::printf(
        "kvc_bench_state: a %.1f MiB state file (%lld layers, %lld KV heads, head_dim %lld; %.1f MiB of K/V "
        "loaded), %s reads, median of %d, in %s\n",
        static_cast<double>(bytes) / (1024.0 * 1024.0), static_cast<long long>(layers),
        static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
        static_cast<double>(loaded_bytes) / (1024.0 * 1024.0), cold ? "cold (from the disk)" : "page-cache", reps,
        std::filesystem::absolute(dir).lexically_normal().c_str());
    std::printf("%-46s %10s %10s\n", "operation", "ms", "GB/s");
    std::printf("%-46s %10.1f %10.2f\n", "kvc::save(cache, path)", save_t * 1e3, gb / save_t);
    std::printf("%-46s %10.1f %10.2f\n", "std::ofstream::write, one buffer", write_t * 1e3, gb / write_t);
    std::printf("%-46s %10.1f %10.2f\n", "kvc::load(cache, path), new cache", load_t * 1e3, gb / load_t);
    std::printf("%-46s %10.1f %10.2f\n", "std::ifstream::read, one buffer", read_t * 1e3, gb / read_t);
    std::printf("%-46s %10.1f %10.2f\n", "std::ifstream::read into a new buffer", median(fresh_s) * 1e3,
                gb / median(fresh_s));
    std::printf("%-46s %10.1f %10.2f\n", "XXH64 of the bytes in memory", median(hash_s) * 1e3, gb / median(hash_s));
    std::printf("SUMMARY state bytes=%zu heap=%s reads=%s save_ratio=%.3f load_ratio=%.3f load_ratio_new_buffer=%.3f\n",
                bytes, warm_heap ? "warm" : "default", cold ? "cold" : "page-cache", write_t / save_t, read_t / load_t,
                median(fresh_s) / load_t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvc_bench_state: %s\n", e.what());
    return 2;
  }
  return 0;
}

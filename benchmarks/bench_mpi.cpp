// kvc_bench_mpi: a cache sent between two MPI ranks against the bandwidth of MPI itself, in the
// same run (docs/distributed.md).
//
//   mpirun -np 2 build/bench/benchmarks/kvc_bench_mpi [--mib N] [--reps N] [--warm-heap]
//
// Rank 0 holds a kvc::DynamicCache<float> of N MiB of K/V (default 64: 8 layers, 8 KV heads of
// head_dim 128, the sequence length that makes N MiB) and sends it with kvc::mpi::send; rank 1
// receives it with kvc::mpi::receive into a cache of its own (a new one each time, as a decode
// server would). The time of one transfer runs from a barrier to the receiver holding everything.
// Against it, the same number of bytes through plain MPI:
//   - one MPI_Send / MPI_Recv from one buffer into another, both allocated once (the floor);
//   - the same, cut into the pieces kvc sends (one message per K or V row of a head);
//   - one message received into memory allocated for it, as the new cache's is.
// Each runs `reps` times after one warm-up, interleaved; the medians are compared. The new cache
// is new memory to the process (glibc maps big blocks afresh and trims its heap on free), which
// the kernel zeroes on first touch; --warm-heap keeps freed memory in the heap instead (mallopt),
// as in a server that has been running. Prints a table and
//   SUMMARY transfer bytes=<state bytes> heap=default|warm kvc_gbps=... mpi_gbps=...
//           ratio=<floor time / kvc time> ratio_new_buffer=<new-buffer time / kvc time>
// (ratio 1 = as fast as the plain message; the goal is >= 0.9).
#include <kvc/kvc.hpp>
#include <kvc/mpi.hpp>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <malloc.h>
#include <mpi.h>

#include "instantiations.hpp"  // DynamicCache<float> instantiated once (inst_dynamic.cpp)

namespace {

using Cache = kvc::DynamicCache<float>;

constexpr std::int64_t layers = 8, kv_heads = 8, head_dim = 128;

Cache make_cache(std::int64_t mib) {
  // K and V of every layer: 2 * layers * kv_heads * seq * head_dim floats.
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

// The bytes write_state produces for `cache`.
std::uint64_t state_bytes(const Cache& cache) {
  kvc::detail::counting_sink counter;  // what kvc::save counts a file's payload with
  kvc::write_state(cache, counter);
  return counter.bytes;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) throw std::runtime_error(std::string(what) + " failed");
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
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    int mib = 64, reps = 7;
    bool warm_heap = false;
    for (int i = 1; i < argc; ++i) {
      const std::string_view option = argv[i];
      if (option == "--warm-heap") {
        warm_heap = true;
        continue;
      }
      if (i + 1 >= argc) throw std::invalid_argument("option " + std::string(option) + " needs a value");
      if (option == "--mib")
        mib = parse(argv[++i]);
      else if (option == "--reps")
        reps = parse(argv[++i]);
      else
        throw std::invalid_argument("unknown option " + std::string(option));
    }
    if (warm_heap) {
      // glibc serves blocks above M_MMAP_THRESHOLD (at most 32 MiB) with mmap and returns them to
      // the kernel when freed, and trims the heap's free top above M_TRIM_THRESHOLD: either way
      // the next cache gets new pages, which the kernel zeroes on first touch. Raised, a freed
      // cache's memory stays in the heap for the next one, as in a server that keeps running.
      mallopt(M_MMAP_THRESHOLD, 32 << 20);
      mallopt(M_TRIM_THRESHOLD, INT_MAX);
    }
    if (size != 2) throw std::invalid_argument("run with 2 ranks: mpirun -np 2 kvc_bench_mpi");

    const Cache sent = rank == 0 ? make_cache(mib) : Cache{};
    std::uint64_t bytes = rank == 0 ? state_bytes(sent) : 0;
    check(MPI_Bcast(&bytes, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD), "MPI_Bcast");
    if (bytes > static_cast<std::uint64_t>(INT32_MAX)) throw std::invalid_argument("--mib: at most 2047");
    std::vector<char> buffer(bytes, 1);  // the floor's send and receive buffer

    // The floor once more, cut into the pieces kvc sends (one message per (layer, K or V, head)
    // row): MPI's cost per message, without kvc.
    const std::int64_t pieces = 2 * layers * kv_heads;
    const std::size_t piece = bytes / static_cast<std::size_t>(pieces);
    std::vector<double> kvc_s, mpi_s, fresh_s, pieces_s;
    std::int64_t received_bytes = 0;
    for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up
      check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      double t = MPI_Wtime();
      if (rank == 0) {
        kvc::mpi::send(sent, 1, 1, MPI_COMM_WORLD);
      } else {
        Cache received;
        kvc::mpi::receive(received, 0, 1, MPI_COMM_WORLD);
        t = MPI_Wtime() - t;
        received_bytes = received.bytes();
        if (r > 0) kvc_s.push_back(t);
      }

      check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      t = MPI_Wtime();
      if (rank == 0) {
        check(MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 2, MPI_COMM_WORLD), "MPI_Send");
      } else {
        check(MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 0, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
              "MPI_Recv");
        t = MPI_Wtime() - t;
        if (r > 0) mpi_s.push_back(t);
      }

      check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      t = MPI_Wtime();
      if (rank == 0) {
        std::vector<MPI_Request> requests(static_cast<std::size_t>(pieces));
        for (std::int64_t i = 0; i < pieces; ++i)
          check(MPI_Isend(buffer.data() + i * piece, static_cast<int>(piece), MPI_BYTE, 1, 4, MPI_COMM_WORLD,
                          &requests[static_cast<std::size_t>(i)]),
                "MPI_Isend");
        check(MPI_Waitall(static_cast<int>(pieces), requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
      } else {
        for (std::int64_t i = 0; i < pieces; ++i)
          check(MPI_Recv(buffer.data() + i * piece, static_cast<int>(piece), MPI_BYTE, 0, 4, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE),
                "MPI_Recv");
        t = MPI_Wtime() - t;
        if (r > 0) pieces_s.push_back(t);
      }

      // The floor again, received into memory allocated for it (as the new cache is).
      check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      t = MPI_Wtime();
      if (rank == 0) {
        check(MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 3, MPI_COMM_WORLD), "MPI_Send");
      } else {
        const std::unique_ptr<char[]> fresh(new char[bytes]);
        check(MPI_Recv(fresh.get(), static_cast<int>(bytes), MPI_BYTE, 0, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
              "MPI_Recv");
        t = MPI_Wtime() - t;
        if (r > 0) fresh_s.push_back(t);
      }
    }

    if (rank == 1) {
      const double gb = static_cast<double>(bytes) / 1e9, kvc_t = median(kvc_s), mpi_t = median(mpi_s);
      std::printf(
          "kvc_bench_mpi: %.1f MiB of state (%lld layers, %lld KV heads, head_dim %lld; %.1f MiB of K/V in "
          "the received cache), 2 ranks, median of %d\n",
          static_cast<double>(bytes) / (1024.0 * 1024.0), static_cast<long long>(layers),
          static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
          static_cast<double>(received_bytes) / (1024.0 * 1024.0), reps);
      std::printf("%-44s %10s %10s\n", "transfer", "ms", "GB/s");
      std::printf("%-44s %10.2f %10.2f\n", "kvc::mpi::send / receive (new cache)", kvc_t * 1e3, gb / kvc_t);
      std::printf("%-44s %10.2f %10.2f\n", "MPI_Send / MPI_Recv, one buffer", mpi_t * 1e3, gb / mpi_t);
      std::printf("%-44s %10.2f %10.2f\n", "MPI_Send / MPI_Recv into a new buffer", median(fresh_s) * 1e3,
                  gb / median(fresh_s));
      const std::string cut = "MPI_Isend / MPI_Recv, " + std::to_string(pieces) + " pieces";
      std::printf("%-44s %10.2f %10.2f\n", cut.c_str(), median(pieces_s) * 1e3, gb / median(pieces_s));
      std::printf("SUMMARY transfer bytes=%llu heap=%s kvc_gbps=%.2f mpi_gbps=%.2f ratio=%.3f ratio_new_buffer=%.3f\n",
                  static_cast<unsigned long long>(bytes), warm_heap ? "warm" : "default", gb / kvc_t, gb / mpi_t,
                  mpi_t / kvc_t, median(fresh_s) / kvc_t);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvc_bench_mpi (rank %d): %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return 0;
}

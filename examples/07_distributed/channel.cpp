// kvc_mpi_channel: checks of <kvc/mpi.hpp> between two ranks (docs/distributed.md): the batching
// of small puts, large puts received in place, the end of the stream, the errors of a reader that
// does not mirror the writer (each side reports it, neither hangs), the byte bound of a Source,
// whole caches (send/receive, LayerReceiver), a paged request, and min_over_ranks alone and in a
// paged cache under tensor parallelism.
//
//   mpirun -np 2 build/examples/kvc_mpi_channel
//
// Prints a FAILED line per failed check and "kvc_mpi_channel: OK" last when every check passed.
#include <kvc/kvc.hpp>
#include <kvc/mpi.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <mpi.h>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// Runs f and checks that it throws E with `needle` in its message.
template <class E>
void expect_throw(const std::function<void()>& f, const std::string& needle, const std::string& what) {
  try {
    f();
  } catch (const E& e) {
    expect(std::string(e.what()).find(needle) != std::string::npos,
           what + ": message '" + e.what() + "' lacks '" + needle + "'");
    return;
  } catch (const std::exception& e) {
    expect(false, what + ": threw another type: " + e.what());
    return;
  }
  expect(false, what + ": did not throw");
}

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) >> 3);
  return v;
}

// Collects write_state's bytes, to compare two caches' states.
struct VectorSink {
  std::vector<unsigned char> bytes;
  void put(const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    bytes.insert(bytes.end(), c, c + n);
  }
};

template <class Cache>
std::vector<unsigned char> state_of(const Cache& cache) {
  VectorSink sink;
  kvc::write_state(cache, sink);
  return sink.bytes;
}

kvc::DynamicCache<float> three_layers() {
  kvc::DynamicCache<float> cache;
  for (std::int64_t layer = 0; layer < 3; ++layer) {
    // 2 heads of 40 tokens and head_dim 16: rows of 2560 bytes, batched; layer 2 has 8 heads of 100
    // tokens of 64: rows of 25600 bytes, sent on their own.
    const std::int64_t heads = layer == 2 ? 8 : 2, seq = layer == 2 ? 100 : 40, dim = layer == 2 ? 64 : 16;
    kvc::HostTensor<float> k(1, heads, seq, dim), v(1, heads, seq, dim);
    for (Eigen::Index i = 0; i < k.size(); ++i) {
      k.data()[i] = static_cast<float>(layer * 1000 + i);
      v.data()[i] = -static_cast<float>(layer * 1000 + i);
    }
    cache.update(k, v, layer);
  }
  return cache;
}

void channel(int rank, MPI_Comm comm) {
  const auto large = pattern(100000, 1), medium = pattern(5000, 2);
  if (rank == 0) {
    kvc::mpi::Sink sink(1, 10, comm);
    const std::int64_t seven = 7;
    sink.put(&seven, sizeof seven);
    sink.put("abc", 3);
    sink.put(nullptr, 0);
    sink.put(large.data(), large.size());
    const double sixteen[2] = {1.5, -2.5};
    sink.put(sixteen, sizeof sixteen);
    sink.put(medium.data(), medium.size());
    sink.put("z", 1);
    sink.finish();
    // batch(seven, abc), large, batch(sixteen), medium, batch(z), the end marker
    expect(sink.messages() == 6, "the Sink sent " + std::to_string(sink.messages()) + " messages, not 6");
    expect(sink.bytes() == 8 + 3 + 100000 + 16 + 5000 + 1, "the Sink counted its bytes");
  } else {
    kvc::mpi::Source source(0, 10, comm);
    std::int64_t seven = 0;
    char abc[3] = {}, z = 0;
    double sixteen[2] = {};
    std::vector<unsigned char> got_large(large.size()), got_medium(medium.size());
    source.get(&seven, sizeof seven);
    source.get(abc, 3);
    source.get(nullptr, 0);
    source.get(got_large.data(), got_large.size());
    source.get(sixteen, sizeof sixteen);
    source.get(got_medium.data(), got_medium.size());
    source.get(&z, 1);
    source.finish();
    expect(seven == 7 && std::memcmp(abc, "abc", 3) == 0 && sixteen[0] == 1.5 && sixteen[1] == -2.5 && z == 'z',
           "the batched values came back");
    expect(got_large == large && got_medium == medium, "the large puts came back");
    expect(source.bytes() == 8 + 3 + 100000 + 16 + 5000 + 1, "the Source counted its bytes");
  }
}

// Readers that do not mirror the writer: the reader throws, the writer's finish() returns. The
// reader takes the streams in the order they are sent: a finish() returns only once the receiver
// has taken its large messages.
void mismatches(int rank, MPI_Comm comm) {
  const auto block = pattern(8192, 3);
  if (rank == 0) {
    for (int tag = 20; tag < 24; ++tag) {
      kvc::mpi::Sink sink(1, tag, comm);
      if (tag == 20) sink.put(block.data(), block.size());  // read as 8000 bytes
      if (tag == 21) sink.put(block.data(), 16);            // read as 16 + 8 bytes
      if (tag == 22) sink.put(block.data(), 16);            // read as 8 bytes, then finish
      if (tag == 23) sink.put(block.data(), block.size());  // read with a bound of 4096 bytes
      sink.finish();
    }
    {
      kvc::mpi::Sink sink(1, 25, comm);
      sink.put(block.data(), 5000);  // read as 8192 bytes
      sink.finish();
    }
    {  // a writer that stops early: its destructor ends the stream
      kvc::mpi::Sink sink(1, 24, comm);
      sink.put(block.data(), 8);
    }
  } else {
    std::vector<unsigned char> buffer(block.size());
    expect_throw<kvc::RuntimeError>(
        [&] {
          kvc::mpi::Source source(0, 20, comm);
          source.get(buffer.data(), 8000);
        },
        "kvc::mpi: MPI_Recv failed", "a large read shorter than the message (MPI_ERR_TRUNCATE)");
    expect_throw<kvc::StateError>(
        [&] {
          kvc::mpi::Source source(0, 21, comm);
          source.get(buffer.data(), 16);
          source.get(buffer.data(), 8);
        },
        "the stream ended after 16 bytes", "a read past the end");
    expect_throw<kvc::StateError>(
        [&] {
          kvc::mpi::Source source(0, 22, comm);
          source.get(buffer.data(), 8);
          source.finish();
        },
        "8 batched bytes are unread", "a finish before the batch is read");
    expect_throw<kvc::StateError>(
        [&] {
          kvc::mpi::Source source(0, 23, comm, 4096);
          source.get(buffer.data(), buffer.size());
        },
        "exceeds the 4096 bytes still allowed", "a read past the Source's bound");
    expect_throw<kvc::StateError>(
        [&] {
          kvc::mpi::Source source(0, 25, comm);
          source.get(buffer.data(), 8192);
        },
        "expected a message of 8192 bytes, received one of 5000", "a large read longer than the message");
    expect_throw<kvc::StateError>(
        [&] {
          kvc::mpi::Source source(0, 24, comm);
          source.get(buffer.data(), 8);
          source.get(buffer.data(), 8);
        },
        "the stream ended after 8 bytes", "a writer that stopped early");
  }
}

void caches(int rank, MPI_Comm comm) {
  const kvc::DynamicCache<float> sent = three_layers();
  if (rank == 0) {
    kvc::mpi::send(sent, 1, 30, comm);
    kvc::mpi::send(sent, 1, 31, comm);
    kvc::mpi::send(sent, 1, 32, comm);  // received into a cache of doubles: refused
    kvc::mpi::send(sent, 1, 33, comm);  // read layer by layer, then given up after one layer
  } else {
    kvc::DynamicCache<float> whole;
    kvc::mpi::receive(whole, 0, 30, comm);
    expect(state_of(whole) == state_of(sent), "receive: the cache arrived whole");

    kvc::DynamicCache<float> layered;
    {
      kvc::mpi::LayerReceiver<kvc::DynamicCache<float>> receiver(layered, 0, 31, comm);
      expect(receiver.layers() == 3 && receiver.loaded() == 0, "LayerReceiver: 3 layers announced, none loaded");
      receiver.pull(0);
      expect(receiver.loaded() == 1 && layered.get_seq_length(0) == 40, "LayerReceiver: pull(0) loads layer 0");
      receiver.pull(1);
      receiver.pull(0);
      expect(receiver.loaded() == 2, "LayerReceiver: pull(1) loads layer 1, pull(0) nothing");
      receiver.finish();
      expect(receiver.done(), "LayerReceiver: finish loads the rest");
    }
    expect(state_of(layered) == state_of(sent), "LayerReceiver: the cache arrived whole");

    kvc::DynamicCache<double> wrong;
    expect_throw<kvc::StateError>([&] { kvc::mpi::receive(wrong, 0, 32, comm); }, "",
                                  "a cache of another element type");
    expect(wrong.get_seq_length(0) == 0, "the refused cache is unchanged");

    kvc::DynamicCache<float> partial;
    {
      kvc::mpi::LayerReceiver<kvc::DynamicCache<float>> receiver(partial, 0, 33, comm);
      receiver.pull(0);
    }  // the rest of the stream is dropped: the sender's send returns
    expect(partial.get_seq_length(0) == 40, "a receiver given up keeps the layers it loaded");
  }
}

void paged(int rank, MPI_Comm comm) {
  kvc::ModelConfig model;
  model.num_hidden_layers = 2;
  model.num_attention_heads = 4;
  model.num_key_value_heads = 2;
  model.head_dim = 8;
  model.hidden_size = 32;
  kvc::ContinuousBatchingConfig blocks;
  blocks.block_size = 4;
  blocks.num_blocks = 16;
  kvc::PagedCache<kvc::HostStorage<float>> cache(model, blocks);
  if (rank == 0) {
    // Request "a": 10 tokens in 3 blocks, written to both layers.
    (void)cache.allocate_blocks(3, "a", 0);
    const auto groups = static_cast<std::size_t>(cache.num_groups());
    kvc::PagedIndices reads(groups), writes(groups);
    cache.extend_read_and_write_indices("a", 0, 10, nullptr, writes);
    kvc::HostTensor<float> k(1, 2, 10, 8), v(1, 2, 10, 8);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      for (Eigen::Index i = 0; i < k.size(); ++i) {
        k.data()[i] = static_cast<float>(100 * layer + i);
        v.data()[i] = -static_cast<float>(100 * layer + i);
      }
      const kvc::TensorView<float> kv_k{k.data(), {1, 2, 10, 8}, {160, 80, 8, 1}};
      const kvc::TensorView<float> kv_v{v.data(), {1, 2, 10, 8}, {160, 80, 8, 1}};
      (void)cache.update(kv_k, kv_v, layer, reads, writes);
    }
    kvc::mpi::send_request(cache, "a", 1, 40, comm);
    VectorSink sent;
    kvc::write_request(cache, "a", sent);
    const auto n = static_cast<int>(sent.bytes.size());
    MPI_Send(&n, 1, MPI_INT, 1, 41, comm);
    MPI_Send(sent.bytes.data(), n, MPI_BYTE, 1, 41, comm);
  } else {
    (void)cache.allocate_blocks(2, "other", 0);  // so that "b" gets other block numbers than "a"
    kvc::mpi::receive_request(cache, "b", 0, 40, comm);
    expect(cache.blocks_in_use("b") == 3, "receive_request: the request's 3 blocks are allocated");
    int n = 0;
    MPI_Recv(&n, 1, MPI_INT, 0, 41, comm, MPI_STATUS_IGNORE);
    std::vector<unsigned char> sent(static_cast<std::size_t>(n));
    MPI_Recv(sent.data(), n, MPI_BYTE, 0, 41, comm, MPI_STATUS_IGNORE);
    VectorSink received;
    kvc::write_request(cache, "b", received);
    expect(received.bytes == sent, "receive_request: the request's blocks hold what the sender's held");
  }
}

void minimum(int rank, int size, MPI_Comm comm) {
  std::vector<std::int64_t> values = {100 + rank, 50 - rank, -7};
  kvc::mpi::min_over_ranks(comm)(values);
  expect(values[0] == 100 && values[1] == 50 - (size - 1) && values[2] == -7, "min_over_ranks");

  // A paged cache under tensor parallelism: each rank offers its own block count, all agree on the
  // smallest, and each keeps its share of the KV heads.
  kvc::ModelConfig model;
  model.num_hidden_layers = 2;
  model.num_attention_heads = 4 * size;
  model.num_key_value_heads = 2 * size;
  model.head_dim = 8;
  model.hidden_size = 32;
  kvc::ContinuousBatchingConfig blocks;
  blocks.block_size = 4;
  blocks.num_blocks = 10 + 5 * rank;
  const kvc::PagedCache<kvc::HostStorage<float>> cache(
      model, blocks,
      kvc::PagedTensorParallel{.tp_size = size, .kv_is_tp = true, .min_over_ranks = kvc::mpi::min_over_ranks(comm)});
  expect(cache.num_blocks() == 10, "PagedTensorParallel with min_over_ranks: every rank plans " +
                                       std::to_string(cache.num_blocks()) + " blocks, not 10");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    if (size < 2) throw std::invalid_argument("run with 2 ranks: mpirun -np 2 kvc_mpi_channel");
    MPI_Comm pair = MPI_COMM_NULL;  // ranks 0 and 1; the others only take part in min_over_ranks
    MPI_Comm_split(MPI_COMM_WORLD, rank < 2 ? 0 : MPI_UNDEFINED, rank, &pair);
    if (rank < 2) {
      channel(rank, pair);
      mismatches(rank, pair);
      caches(rank, pair);
      paged(rank, pair);
      MPI_Comm_free(&pair);
    }
    minimum(rank, size, MPI_COMM_WORLD);
  } catch (const std::exception& e) {
    std::printf("FAILED on rank %d: %s\n", rank, e.what());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  // Rank 0 prints the verdict after every rank's checks.
  int all_failures = 0;
  MPI_Reduce(&failures, &all_failures, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  std::fflush(stdout);
  if (rank == 0 && all_failures == 0) std::printf("kvc_mpi_channel: OK\n");
  if (rank == 0 && all_failures != 0) std::printf("kvc_mpi_channel: %d checks FAILED\n", all_failures);
  MPI_Finalize();
  return all_failures == 0 ? 0 : 1;
}

// kvc_disaggregated: prefill on one rank, decode on another (docs/distributed.md).
//
//   mpirun -np 2 build/examples/kvc_disaggregated [--requests N] [--tokens N]
//
// Rank 0 runs each request's prompt through the seeded decoder of examples/common into a
// kvc::DynamicCache<float> and ships the cache to rank 1 with kvc::mpi::send, after the logits of
// the prompt's last token (the first generated token comes from them). Rank 1 opens a
// kvc::mpi::LayerReceiver on a cache of its own and decodes greedily: inside each decode step it
// pulls layer l from the channel just before attending with it, so the first step starts as soon
// as layer 0 is in. Rank 1 then runs the same request in one process (prefill and decode through its
// own cache) and checks that every logit is equal bit for bit (memcmp) to the disaggregated run.
// Ranks past 1 wait. Exits 0 when every request matches, 1 otherwise; prints its verdict last.
#include <kvc/kvc.hpp>
#include <kvc/mpi.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mpi.h>

#include "../common/decoder.hpp"

namespace {

using examples::Decoder;
using examples::Logits;
using Cache = kvc::DynamicCache<float>;

constexpr int prefill_rank = 0, decode_rank = 1;
constexpr std::uint64_t model_seed = 1234;

// A small Gemma-style model (sliding and full layers alternating, grouped-query attention): the
// whole demo runs in about a second.
examples::DecoderConfig demo_config() {
  examples::DecoderConfig c;
  c.num_hidden_layers = 4;
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.vocab_size = 256;
  c.intermediate_size = 256;
  c.sliding_window = 16;
  c.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  return c;
}

// Request r's prompt: 24 to 47 tokens, the same on every rank.
std::vector<std::int32_t> prompt(int request, std::int64_t vocab) {
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(request));
  std::vector<std::int32_t> tokens(24 + rng() % 24);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return tokens;
}

std::int32_t argmax(const Logits& logits) {
  Eigen::Index best = 0;
  logits.row(0).maxCoeff(&best);
  return static_cast<std::int32_t>(best);
}

bool same_bits(const Logits& a, const Logits& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(float)) == 0;
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) throw std::runtime_error(std::string(what) + " failed");
}

// Message tags: request r's first-token logits and its cache, each on a tag of their own.
int logits_tag(int request) { return 2 * request; }
int cache_tag(int request) { return 2 * request + 1; }

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

void prefill(const Decoder<float>& model, int requests) {
  for (int r = 0; r < requests; ++r) {
    const std::vector<std::int32_t> tokens = prompt(r, model.config().vocab_size);
    Cache cache;
    const Logits logits = model.forward(tokens, cache);
    check(
        MPI_Send(logits.data(), static_cast<int>(logits.size()), MPI_FLOAT, decode_rank, logits_tag(r), MPI_COMM_WORLD),
        "MPI_Send");
    // [snippet:send]
    kvc::mpi::send(cache, decode_rank, cache_tag(r), MPI_COMM_WORLD);  // header, then every layer
    // [/snippet]
  }
}

// Returns the number of requests whose logits all matched.
int decode(const Decoder<float>& model, int requests, int new_tokens) {
  const examples::DecoderConfig& config = model.config();
  int matched = 0;
  std::uint64_t bytes = 0;
  double first_layer_ms = 0, decode_ms = 0;
  for (int r = 0; r < requests; ++r) {
    const std::vector<std::int32_t> tokens = prompt(r, config.vocab_size);
    const auto prompt_len = static_cast<std::int64_t>(tokens.size());
    Logits logits(1, config.vocab_size);
    check(MPI_Recv(logits.data(), static_cast<int>(logits.size()), MPI_FLOAT, prefill_rank, logits_tag(r),
                   MPI_COMM_WORLD, MPI_STATUS_IGNORE),
          "MPI_Recv");
    std::vector<Logits> steps{logits};

    const auto start = std::chrono::steady_clock::now();
    // [snippet:layer_receiver]
    Cache cache;
    kvc::mpi::LayerReceiver<Cache> receiver(cache, prefill_rank, cache_tag(r), MPI_COMM_WORLD);
    // Attention of layer l pulls layer l first: the step starts before the last layer is in.
    auto attend = [&](std::int64_t layer, const kvc::HostTensor<float>& q, const kvc::HostTensor<float>& k,
                      const kvc::HostTensor<float>& v) {
      receiver.pull(layer);
      return kvc::attend(cache, layer, q, k, v, {.sliding_window = config.window(layer)});
    };
    // [/snippet]
    std::int32_t next = argmax(logits);
    std::vector<std::int32_t> generated{next};
    for (int s = 0; s < new_tokens; ++s) {
      const std::int32_t token[] = {next};
      const std::int64_t position[] = {prompt_len + s}, row[] = {0};
      steps.push_back(model.forward_packed(token, position, row, attend));
      if (s == 0) first_layer_ms += ms_since(start);
      next = argmax(steps.back());
      generated.push_back(next);
    }
    receiver.finish();
    decode_ms += ms_since(start);
    bytes += receiver.bytes();

    // The same request in one process, fed the same tokens.
    Cache reference;
    bool same = same_bits(model.forward(tokens, reference), steps[0]);
    for (int s = 0; s < new_tokens; ++s) {
      const std::int32_t token[] = {generated[static_cast<std::size_t>(s)]};
      same = same_bits(model.forward(token, reference), steps[static_cast<std::size_t>(s) + 1]) && same;
    }
    same = same && cache.get_seq_length(0) == reference.get_seq_length(0);
    std::printf("request %d: prompt %lld tokens, %d decoded, %lld layers received (%llu bytes): %s\n", r,
                static_cast<long long>(prompt_len), new_tokens, static_cast<long long>(receiver.layers()),
                static_cast<unsigned long long>(receiver.bytes()), same ? "bit-identical" : "FAILED: logits differ");
    matched += same ? 1 : 0;
  }
  std::printf(
      "%d requests: %.1f KiB of state received, first step done %.2f ms after the header (mean), "
      "all %d steps %.2f ms\n",
      requests, static_cast<double>(bytes) / 1024.0, first_layer_ms / requests, new_tokens, decode_ms / requests);
  return matched;
}

int parse(std::string_view text) {
  int v = 0;
  for (char c : text) {
    if (c < '0' || c > '9' || v > 100000) throw std::invalid_argument("not a positive integer: " + std::string(text));
    v = v * 10 + (c - '0');
  }
  if (v < 1) throw std::invalid_argument("not a positive integer: " + std::string(text));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 0, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    int requests = 4, new_tokens = 8;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string_view option = argv[i];
      if (option == "--requests")
        requests = parse(argv[i + 1]);
      else if (option == "--tokens")
        new_tokens = parse(argv[i + 1]);
      else
        throw std::invalid_argument("unknown option " + std::string(option));
    }
    if (size < 2) throw std::invalid_argument("run with at least 2 ranks: mpirun -np 2 kvc_disaggregated");
    const Decoder<float> model(demo_config(), model_seed);
    if (rank == prefill_rank) prefill(model, requests);
    if (rank == decode_rank) {
      const int matched = decode(model, requests, new_tokens);
      std::printf("kvc_disaggregated: %d/%d requests decoded on rank %d match the single-process run bit for bit\n",
                  matched, requests, decode_rank);
      status = matched == requests ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::printf("FAILED on rank %d: %s\n", rank, e.what());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fflush(stdout);
  MPI_Finalize();
  return status;
}

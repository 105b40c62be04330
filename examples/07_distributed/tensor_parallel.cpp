// kvc_tensor_parallel: the decoder's attention split over the ranks (docs/distributed.md).
//
//   mpirun -np 2 build/examples/kvc_tensor_parallel [--tokens N]
//
// Each of the R ranks builds its shard of the seeded decoder of examples/common
// (Decoder::shard: 1/R of the query heads and of the KV heads, the matching columns of wq, wk, wv
// and rows of wo; the MLP and the rest replicated) and keeps its own kvc::DynamicCache<float>,
// which holds only its KV heads. The output projection of each layer's attention is a partial
// sum, added over the ranks by one MPI_Allreduce (MPI_SUM) per layer; every rank then holds the
// same residual stream and the same logits. A prompt is prefilled and decoded greedily.
//
// Checks, on rank 0: every rank's logits are the same bits; they equal the single-rank model's
// (the whole decoder, fed the same tokens) within float rounding (the partial sums are added in
// another order), the largest difference below 1e-4 of the logits' largest magnitude; and each
// rank's cache.bytes() is exactly 1/R of the single-rank cache's. Exits 0 when all hold, 1
// otherwise; prints its verdict last.
#include <kvc/kvc.hpp>
#include <kvc/mpi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <mpi.h>

#include "../common/decoder.hpp"

namespace {

using examples::Decoder;
using examples::Logits;
using Cache = kvc::DynamicCache<float>;

constexpr std::uint64_t model_seed = 1234;

// A small model with 8 query heads and 4 KV heads, so that 1, 2 or 4 ranks divide both.
examples::DecoderConfig demo_config() {
  examples::DecoderConfig c;
  c.num_hidden_layers = 4;
  c.hidden_size = 256;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 32;
  c.vocab_size = 256;
  c.intermediate_size = 256;
  c.sliding_window = 16;
  c.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  return c;
}

std::int32_t argmax(const Logits& logits) {
  Eigen::Index best = 0;
  logits.row(0).maxCoeff(&best);
  return static_cast<std::int32_t>(best);
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) throw std::runtime_error(std::string(what) + " failed");
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

int run(int rank, int ranks, int new_tokens) {
  const Decoder<float> full(demo_config(), model_seed);
  const std::int64_t vocab = full.config().vocab_size;

  // [snippet:shard]
  Decoder<float> model = full.shard(rank, ranks);  // this rank's heads; the MLP replicated
  model.set_attention_reduce([](Decoder<float>::Matrix& partial) {
    // One all-reduce per layer: the sum over the ranks of their heads' share of the projection.
    check(MPI_Allreduce(MPI_IN_PLACE, partial.data(), static_cast<int>(partial.size()), MPI_FLOAT, MPI_SUM,
                        MPI_COMM_WORLD),
          "MPI_Allreduce");
  });
  Cache cache;  // holds this rank's KV heads only
  // [/snippet]

  std::mt19937_64 rng(42);
  std::vector<std::int32_t> tokens(40);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  const std::size_t prompt_len = tokens.size();

  std::vector<Logits> steps{model.forward(tokens, cache)};
  for (int s = 0; s < new_tokens; ++s) {
    tokens.push_back(argmax(steps.back()));
    const std::int32_t token[] = {tokens.back()};
    steps.push_back(model.forward(token, cache));
  }

  // Rank 0 gathers the other ranks' logits and cache sizes.
  std::vector<float> mine;
  for (const Logits& l : steps) mine.insert(mine.end(), l.data(), l.data() + l.size());
  std::vector<float> all(rank == 0 ? mine.size() * static_cast<std::size_t>(ranks) : 0);
  check(MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_FLOAT, all.data(), static_cast<int>(mine.size()),
                   MPI_FLOAT, 0, MPI_COMM_WORLD),
        "MPI_Gather");
  const std::int64_t my_bytes = cache.bytes();
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(ranks));
  check(MPI_Gather(&my_bytes, 1, MPI_INT64_T, bytes.data(), 1, MPI_INT64_T, 0, MPI_COMM_WORLD), "MPI_Gather");
  if (rank != 0) return 0;

  bool ranks_agree = true;
  for (int r = 1; r < ranks; ++r)
    ranks_agree = ranks_agree && std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * mine.size(),
                                             mine.size() * sizeof(float)) == 0;

  // The single-rank model, fed the tokens the sharded one chose.
  Cache reference;
  const std::span<const std::int32_t> prompt(tokens.data(), prompt_len);
  std::vector<Logits> expected{full.forward(prompt, reference)};
  for (std::size_t i = prompt_len; i < tokens.size(); ++i) expected.push_back(full.forward({&tokens[i], 1}, reference));
  float max_diff = 0, scale = 0;
  int same_argmax = 0;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    max_diff = std::max(max_diff, (steps[s] - expected[s]).cwiseAbs().maxCoeff());
    scale = std::max(scale, expected[s].cwiseAbs().maxCoeff());
    same_argmax += argmax(steps[s]) == argmax(expected[s]) ? 1 : 0;
  }
  const bool close = max_diff <= 1e-4f * scale;
  bool halves = true;
  for (int r = 0; r < ranks; ++r) halves = halves && bytes[static_cast<std::size_t>(r)] * ranks == reference.bytes();

  std::printf("%d ranks, %lld-token prompt and %d decode steps, one all-reduce per layer per step\n", ranks,
              static_cast<long long>(prompt_len), new_tokens);
  std::printf("logits of every rank bit-identical: %s\n", ranks_agree ? "yes" : "FAILED: no");
  std::printf(
      "max |logit - single-rank logit| = %.3g (largest |logit| %.3g, bound %.3g): %s; greedy tokens "
      "agree at %d/%zu steps\n",
      static_cast<double>(max_diff), static_cast<double>(scale), 1e-4 * static_cast<double>(scale),
      close ? "ok" : "FAILED", same_argmax, steps.size());
  for (int r = 0; r < ranks; ++r)
    std::printf("rank %d cache: %lld bytes, single-rank cache %lld bytes (1/%d: %s)\n", r,
                static_cast<long long>(bytes[static_cast<std::size_t>(r)]), static_cast<long long>(reference.bytes()),
                ranks, bytes[static_cast<std::size_t>(r)] * ranks == reference.bytes() ? "yes" : "FAILED: no");
  const bool ok = ranks_agree && close && halves;
  std::printf("kvc_tensor_parallel: %s: %d ranks match the single-rank decoder\n", ok ? "OK" : "FAILED", ranks);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 0, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    int new_tokens = 8;
    for (int i = 1; i + 1 < argc; i += 2) {
      if (std::string_view(argv[i]) == "--tokens")
        new_tokens = parse(argv[i + 1]);
      else
        throw std::invalid_argument("unknown option " + std::string(argv[i]));
    }
    status = run(rank, size, new_tokens);
  } catch (const std::exception& e) {
    std::printf("FAILED on rank %d: %s\n", rank, e.what());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fflush(stdout);
  MPI_Finalize();
  return status;
}

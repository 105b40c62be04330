#pragma once
// A small Llama/Gemma-style decoder-only language model with random weights, for the demo
// (examples/02_demo): token embedding, pre-norm blocks of grouped-query attention (rotary position
// embedding, full or sliding-window causal mask) and a SwiGLU MLP, a final RMSNorm and an LM head.
// A layer of type "linear_attention" replaces attention by a gated linear recurrence in the shape
// of gated DeltaNet's or Mamba-2's state: a short causal convolution (kernel 4) over the keys and
// values, then per KV head a state S [head_dim, head_dim], S = decay * S + k^T v, read by the
// normalized queries (examples/10_speculative).
// Attention runs through a kvc cache (`forward`) or recomputes the whole sequence with an explicit
// mask (`forward_no_cache`, the reference the demo checks the caches against).
//
// What runs in which type, for Decoder<T> with T = float, Eigen::bfloat16 or Eigen::half:
//   float: the weights (PackedWeight), the residual stream, RMSNorm, the Q/K/V and output
//          projections, the rotary embedding, the MLP, the LM head and the logits;
//   T:     the queries, keys and values after the rotary embedding (converted from float), the
//          K/V the cache stores and the attention output; kvc::scaled_dot_product_attention
//          computes scores and softmax in float for the 16-bit types. The attention output is
//          converted back to float before the output projection.
// Both forward modes share every step but the attention call, so their difference measures the
// cache (and the rounding of different GEMM shapes), nothing else. `shard` and
// `set_attention_reduce` split the attention over tensor-parallel ranks (examples/07_distributed).
#include <kvc/kvc.hpp>
#include <kvc/fp8_attention.hpp>
#include <kvc/quantized_attention.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <Eigen/Core>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace examples {

// The shape of the model: the fields of a transformers config.json it reads. The defaults are the
// demo's embedded model, a small Gemma-style decoder with sliding and full layers alternating.
struct DecoderConfig {
  std::int64_t num_hidden_layers = 4;
  std::int64_t hidden_size = 256;
  std::int64_t num_attention_heads = 8;
  std::int64_t num_key_value_heads = 2;
  std::int64_t head_dim = 32;
  std::int64_t vocab_size = 512;
  std::int64_t intermediate_size = 512;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<std::int64_t> sliding_window = 64;
  std::vector<std::string> layer_types{"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  bool tie_word_embeddings = false;  // the LM head reuses the embedding matrix

  bool is_sliding(std::int64_t layer) const {
    return layer_types.at(static_cast<std::size_t>(layer)) == "sliding_attention";
  }
  bool is_linear(std::int64_t layer) const {
    return layer_types.at(static_cast<std::size_t>(layer)) == "linear_attention";
  }
  // The window a sliding layer's mask uses; none for a full-attention layer.
  std::optional<std::int64_t> window(std::int64_t layer) const {
    return is_sliding(layer) ? sliding_window : std::nullopt;
  }

  // [snippet:cache_config]
  // What a kvc cache needs to know about the model: its layers, their types and windows.
  kvc::ModelConfig cache_config() const {
    kvc::ModelConfig config;
    config.num_hidden_layers = num_hidden_layers;
    config.num_attention_heads = num_attention_heads;
    config.num_key_value_heads = num_key_value_heads;
    config.head_dim = head_dim;
    config.hidden_size = hidden_size;
    config.sliding_window = sliding_window;
    config.layer_types = layer_types;  // e.g. {"sliding_attention", "full_attention", ...}
    return config;
  }
  // [/snippet]

  // The number of weights; -1 when it does not fit in 64 bits (validate() refuses such a config:
  // every field within its own limit can still multiply past 2^63).
  std::int64_t parameter_count() const {
    using kvc::detail::mul_fits;
    const std::int64_t h = hidden_size;
    std::int64_t q = 0, kv = 0, attn = 0, kvw = 0, mlp = 0, embed = 0, layers = 0;
    if (!mul_fits(num_attention_heads, head_dim, q) || !mul_fits(num_key_value_heads, head_dim, kv) ||
        !mul_fits(h, q, attn) || !mul_fits(h, kv, kvw) || !mul_fits(h, intermediate_size, mlp) ||
        !mul_fits(vocab_size, h, embed))
      return -1;
    std::int64_t per_layer = 0;
    for (const auto& [count, weights] : {std::pair{2, attn}, std::pair{2, kvw}, std::pair{3, mlp}, std::pair{2, h}}) {
      std::int64_t part = 0;
      if (!mul_fits(count, weights, part) || __builtin_add_overflow(per_layer, part, &per_layer)) return -1;
    }
    std::int64_t total = 0;
    if (!mul_fits(embed, tie_word_embeddings ? 1 : 2, total) || !mul_fits(num_hidden_layers, per_layer, layers) ||
        __builtin_add_overflow(total, layers, &total) || __builtin_add_overflow(total, h, &total))
      return -1;
    return total;
  }
  std::int64_t weight_bytes() const { return parameter_count() * static_cast<std::int64_t>(sizeof(float)); }

  // Throws std::invalid_argument (one line) for a shape the model cannot run.
  void validate() const {
    auto positive = [](const char* name, std::int64_t v) {
      if (v < 1 || v > (std::int64_t{1} << 24))
        throw std::invalid_argument(std::string(name) + " must be between 1 and 2^24, got " + std::to_string(v));
    };
    positive("num_hidden_layers", num_hidden_layers);
    positive("hidden_size", hidden_size);
    positive("num_attention_heads", num_attention_heads);
    positive("num_key_value_heads", num_key_value_heads);
    positive("head_dim", head_dim);
    positive("vocab_size", vocab_size);
    positive("intermediate_size", intermediate_size);
    if (num_attention_heads % num_key_value_heads != 0)
      throw std::invalid_argument("num_attention_heads (" + std::to_string(num_attention_heads) +
                                  ") must be a multiple of num_key_value_heads (" +
                                  std::to_string(num_key_value_heads) + ")");
    if (head_dim % 2 != 0)
      throw std::invalid_argument("head_dim must be even for the rotary embedding, got " + std::to_string(head_dim));
    if (!(rms_norm_eps > 0) || !(rope_theta > 1))
      throw std::invalid_argument("rms_norm_eps must be positive and rope_theta above 1");
    // weight_bytes() is parameter_count() * 4: both must fit in 64 bits.
    if (const std::int64_t n = parameter_count(); n < 0 || n > std::numeric_limits<std::int64_t>::max() / 4)
      throw std::invalid_argument("the config's parameter count does not fit in 64 bits");
    if (static_cast<std::int64_t>(layer_types.size()) != num_hidden_layers)
      throw std::invalid_argument("layer_types has " + std::to_string(layer_types.size()) + " entries but " +
                                  "num_hidden_layers is " + std::to_string(num_hidden_layers));
    for (std::size_t i = 0; i < layer_types.size(); ++i) {
      const std::string& t = layer_types[i];
      if (t != "full_attention" && t != "sliding_attention" && t != "linear_attention")
        throw std::invalid_argument("layer " + std::to_string(i) + " has layer type '" + t +
                                    "'; the demo's model has full_attention, sliding_attention and "
                                    "linear_attention layers only");
      if (t == "sliding_attention" && (!sliding_window || *sliding_window < 1))
        throw std::invalid_argument("layer " + std::to_string(i) +
                                    " is sliding_attention but sliding_window is not a positive integer");
    }
  }
};

// Runs body(0) .. body(count - 1) on up to `threads` threads (0: one per hardware thread);
// rethrows the first exception. With more than one thread, each body runs with an OpenMP team of
// one: a std::thread is not inside an OpenMP region, so each would otherwise start a team of its
// own, and N threads of N-thread teams spinning on N cores slow the whole program many times over.
inline void parallel_for(std::int64_t count, const std::function<void(std::int64_t)>& body, unsigned threads = 0) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads = static_cast<unsigned>(std::clamp<std::int64_t>(count, 1, threads));
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
#if defined(_OPENMP)
  const int caller_team = omp_get_max_threads();  // the calling thread's setting, restored below
#endif
  auto worker = [&] {
#if defined(_OPENMP)
    if (threads > 1) omp_set_num_threads(1);  // this thread's setting only
#endif
    for (std::int64_t i; (i = next.fetch_add(1)) < count;) {
      try {
        body(i);
      } catch (...) {
        const std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
#if defined(_OPENMP)
  omp_set_num_threads(caller_team);
#endif
  if (error) std::rethrow_exception(error);
}

// A weight matrix W, [in, out] (y = x * W), stored once, when the model is made, in the order its
// products read it: panels of `width` output columns (two of the CPU's SIMD vectors: 32 floats
// with AVX-512, 16 with AVX, 8 otherwise), each panel's values of input 0, then of input 1, and so
// on (the last panel padded with zeros). A product then streams each weight once from
// memory into registers, with no copy per product (Eigen's matrix product packs both operands
// anew on every call: a third of the decoder's product time at a batch of 32 rows). Each output
// is one sum over the inputs in order, whatever the number of rows or threads, so a token's
// result does not depend on the batch it shares or on the thread count. The products run on
// OpenMP's threads where the program is built with it (the panels divided among them).
class PackedWeight {
 public:
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  PackedWeight() = default;
  explicit PackedWeight(const Eigen::MatrixXf& w)
      : in_(w.rows()), out_(w.cols()), panels_((w.cols() + width - 1) / width) {
    data_.assign(static_cast<std::size_t>(panels_ * in_ * (width / lanes)), lane_vector{});
    float* d = reinterpret_cast<float*>(data_.data());
    for (std::int64_t p = 0; p < panels_; ++p)
      for (std::int64_t j = 0; j < width && p * width + j < out_; ++j)
        for (std::int64_t k = 0; k < in_; ++k) d[(p * in_ + k) * width + j] = w(k, p * width + j);
  }

  std::int64_t rows() const noexcept { return in_; }
  std::int64_t cols() const noexcept { return out_; }

  // W as a plain matrix again (for slicing: Decoder::shard).
  Eigen::MatrixXf unpack() const {
    Eigen::MatrixXf w(in_, out_);
    const float* d = reinterpret_cast<const float*>(data_.data());
    for (std::int64_t p = 0; p < panels_; ++p)
      for (std::int64_t j = 0; j < width && p * width + j < out_; ++j)
        for (std::int64_t k = 0; k < in_; ++k) w(k, p * width + j) = d[(p * in_ + k) * width + j];
    return w;
  }

  // y = x * W, y resized to [x.rows(), cols()] (no allocation when it has that size already).
  void times(const Eigen::Ref<const Matrix>& x, Matrix& y) const {
    if (x.cols() != in_) throw std::invalid_argument("PackedWeight: x has the wrong number of columns");
    y.resize(x.rows(), out_);
    const std::int64_t M = x.rows(), ld = x.outerStride();
    // One row reads four panels at once (eight independent sums in flight); more rows read one
    // panel at a time, in blocks of `block_rows`, 4 and 1 rows that share each weight load.
    const std::int64_t group = M == 1 && panels_ >= 16 ? 4 : 1, items = (panels_ + group - 1) / group;
    const auto item = [&](std::int64_t i) {
      const std::int64_t p0 = i * group, n = std::min(group, panels_ - p0);
      const lane_vector* panel = data_.data() + p0 * in_ * (width / lanes);
      float* out = y.data() + p0 * width;
      if (n == 4) return block<1, 4>(x.data(), ld, panel, out, p0);
      std::int64_t m = 0;
      for (; m + block_rows <= M; m += block_rows)
        block<block_rows, 1>(x.data() + m * ld, ld, panel, out + m * out_, p0);
      if constexpr (block_rows > 4)
        for (; m + 4 <= M; m += 4) block<4, 1>(x.data() + m * ld, ld, panel, out + m * out_, p0);
      for (; m < M; ++m)
        for (std::int64_t q = 0; q < n; ++q)
          block<1, 1>(x.data() + m * ld, ld, panel + q * in_ * (width / lanes), out + m * out_ + q * width, p0 + q);
    };
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (items > 1 && !omp_in_parallel())
#endif
    for (std::int64_t i = 0; i < items; ++i) item(i);
  }

 private:
  // The CPU's vector of floats (GCC's and clang's vector extension) and the rows a block keeps
  // in registers: block_rows x 2 vectors of sums, two of weights and a broadcast input fit the
  // register file (32 vectors with AVX-512, 16 otherwise).
#if defined(__AVX512F__)
  static constexpr std::int64_t lanes = 16;
  static constexpr int block_rows = 8;
#elif defined(__AVX__)
  static constexpr std::int64_t lanes = 8;
  static constexpr int block_rows = 4;
#else
  static constexpr std::int64_t lanes = 4;
  static constexpr int block_rows = 4;
#endif
  static constexpr std::int64_t width = 2 * lanes;
  using lane_vector = float __attribute__((vector_size(lanes * sizeof(float))));

  // Rows [0, R) of x (ld apart) times panels [p0, p0 + P) into y (rows out_ apart): R x P x 2 sums
  // kept in registers over the whole of the input.
  template <int R, int P>
  void block(const float* x, std::int64_t ld, const lane_vector* panel, float* y, std::int64_t p0) const noexcept {
    lane_vector acc[R][P][2] = {};
    for (std::int64_t k = 0; k < in_; ++k) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float a = x[r * ld + k];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          acc[r][p][0] += a * panel[(p * in_ + k) * 2];
          acc[r][p][1] += a * panel[(p * in_ + k) * 2 + 1];
        }
      }
    }
    const std::int64_t cols = std::min<std::int64_t>(P * width, out_ - p0 * width);
    for (int r = 0; r < R; ++r)
      std::memcpy(y + r * out_, &acc[r][0][0], sizeof(float) * static_cast<std::size_t>(cols));
  }

  std::int64_t in_ = 0, out_ = 0, panels_ = 0;
  std::vector<lane_vector> data_;
};

// Logits, one row per token: [tokens, vocab_size].
using Logits = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The executor kvc's attention runs on in the examples: OpenMP's team where they are built with
// OpenMP (OMP_NUM_THREADS threads), else the calling thread.
#if defined(_OPENMP)
using AttentionExecutor = kvc::OpenMPExecutor;
#else
using AttentionExecutor = kvc::SerialExecutor;
#endif

// How Decoder::forward attends: through the cache's update (kvc::attend), from a quantized
// layer's codes (kvc::attend_quantized), or through an fp8 cache (kvc::attend_fp8, scales of 1:
// vLLM's default k_scale and v_scale).
enum class Attention { update, codes, fp8 };

template <class T>
class Decoder {
 public:
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // activations
  using Weight = PackedWeight;                                                           // [in, out]: y = x * W

  // Weights from `seed`: std::mt19937_64 streams (one per 2^20 values of a matrix), approximately
  // normal with std 1/sqrt(fan_in), so every projection keeps activations O(1); RMSNorm weights
  // 1 + N(0, 0.02). The same seed gives the same weights on every platform and thread count.
  Decoder(DecoderConfig config, std::uint64_t seed) : config_(std::move(config)) {
    config_.validate();
    const auto h = config_.hidden_size, q = config_.num_attention_heads * config_.head_dim,
               kv = config_.num_key_value_heads * config_.head_dim, ff = config_.intermediate_size;
    struct Job {
      float* data;
      std::int64_t size;
      float mean, stddev;
    };
    std::vector<Job> jobs;
    // The weights are drawn into plain column-major matrices, then packed one by one.
    std::deque<std::pair<Weight*, Eigen::MatrixXf>> drawn;
    auto weight = [&](Weight& w, std::int64_t in, std::int64_t out) {
      Eigen::MatrixXf& m = drawn.emplace_back(&w, Eigen::MatrixXf(in, out)).second;
      jobs.push_back({m.data(), m.size(), 0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(in)))});
    };
    auto norm = [&](Eigen::RowVectorXf& w) {
      w.resize(h);
      jobs.push_back({w.data(), w.size(), 1.0f, 0.02f});
    };
    // The embedding rows have std 1/sqrt(hidden) and are scaled by sqrt(hidden) on the way in
    // (Gemma's normalizer), so a tied LM head gives logits of std ~1 like an untied one.
    embed_.resize(config_.vocab_size, h);
    jobs.push_back({embed_.data(), embed_.size(), 0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(h)))});
    layers_.resize(static_cast<std::size_t>(config_.num_hidden_layers));
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      Layer& l = layers_[i];
      norm(l.attn_norm);
      weight(l.wq, h, q);
      weight(l.wk, h, kv);
      weight(l.wv, h, kv);
      weight(l.wo, q, h);
      norm(l.mlp_norm);
      weight(l.w_gate, h, ff);
      weight(l.w_up, h, ff);
      weight(l.w_down, ff, h);
      if (config_.is_linear(static_cast<std::int64_t>(i))) {  // the conv taps: std 1/sqrt(kernel)
        l.conv.resize(2 * kv, conv_kernel);
        jobs.push_back({l.conv.data(), l.conv.size(), 0.0f, 0.5f});
      }
    }
    norm(final_norm_);
    Matrix lm_head;  // [vocab, hidden]; empty when tied to embed_
    if (!config_.tie_word_embeddings) {
      lm_head.resize(config_.vocab_size, h);
      jobs.push_back(
          {lm_head.data(), lm_head.size(), 0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(h)))});
    }
    // Chunks of 2^20 values, each its own stream: the same weights whatever the thread count.
    constexpr std::int64_t chunk = std::int64_t{1} << 20;
    std::vector<std::pair<std::size_t, std::int64_t>> chunks;  // (job, first value)
    for (std::size_t i = 0; i < jobs.size(); ++i)
      for (std::int64_t first = 0; first < jobs[i].size; first += chunk) chunks.emplace_back(i, first);
    parallel_for(static_cast<std::int64_t>(chunks.size()), [&](std::int64_t c) {
      const auto [i, first] = chunks[static_cast<std::size_t>(c)];
      const Job& j = jobs[i];
      fill_normal(j.data + first, std::min(chunk, j.size - first), j.mean, j.stddev,
                  stream_seed(seed, (static_cast<std::uint64_t>(i) << 32) + static_cast<std::uint64_t>(first / chunk)));
    });
    for (auto& [packed, m] : drawn) {
      *packed = Weight(m);
      m = Eigen::MatrixXf();  // the plain copy goes as soon as the packed one exists
    }
    head_ = Weight(config_.tie_word_embeddings ? Eigen::MatrixXf(embed_.transpose())
                                               : Eigen::MatrixXf(lm_head.transpose()));
    inv_freq_.resize(static_cast<std::size_t>(config_.head_dim / 2));
    for (std::size_t i = 0; i < inv_freq_.size(); ++i)
      inv_freq_[i] =
          std::pow(config_.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(config_.head_dim));
  }

  const DecoderConfig& config() const noexcept { return config_; }

  // Tensor parallelism (examples/07_distributed): rank `rank` of `ranks`' shard of the model. Its
  // attention has heads [rank * H / ranks, (rank + 1) * H / ranks) of the H query heads and the
  // matching slice of the KV heads: the columns of wq, wk and wv that produce them and the rows of
  // wo that read them (a column split, then a row split); everything else (embedding, norms, MLP,
  // LM head) is a full copy. Its config has H / ranks query heads and KV / ranks KV heads, so a
  // cache built from it holds 1 / ranks of the K/V. The shard's output projection gives a partial
  // sum: set_attention_reduce must add the partial sums of all the ranks (an all-reduce).
  Decoder shard(std::int64_t rank, std::int64_t ranks) const {
    const std::int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
    if (ranks < 1 || rank < 0 || rank >= ranks || heads % ranks != 0 || kv_heads % ranks != 0)
      throw std::invalid_argument("Decoder::shard: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                  ": the ranks must divide the " + std::to_string(heads) + " heads and the " +
                                  std::to_string(kv_heads) + " KV heads");
    const std::int64_t d = config_.head_dim, q_cols = heads / ranks * d, kv_cols = kv_heads / ranks * d;
    Decoder out = *this;
    out.config_.num_attention_heads = heads / ranks;
    out.config_.num_key_value_heads = kv_heads / ranks;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const Layer& full = layers_[l];
      Layer& part = out.layers_[l];
      part.wq = Weight(full.wq.unpack().middleCols(rank * q_cols, q_cols));
      part.wk = Weight(full.wk.unpack().middleCols(rank * kv_cols, kv_cols));
      part.wv = Weight(full.wv.unpack().middleCols(rank * kv_cols, kv_cols));
      part.wo = Weight(full.wo.unpack().middleRows(rank * q_cols, q_cols));
    }
    out.reduce_ = {};
    return out;
  }

  // Called once per layer with the attention's output projection, [tokens, hidden], before it is
  // added to the residual stream; a shard's reduce replaces its partial sum by the sum over the
  // ranks. Unset (the default), nothing runs there.
  void set_attention_reduce(std::function<void(Matrix&)> reduce) { reduce_ = std::move(reduce); }

  // Runs `tokens` through the model, storing their keys and values in `cache`; their positions
  // continue from cache.get_seq_length(). Returns the logits of the last token, or of every token.
  // Attention::codes reads a quantized cache's codes (kvc::attend_quantized: no dequantized
  // workspace) instead of what its update returns. The mask's window comes from the model's layer
  // type, as in transformers (the model builds the mask, the cache only holds K/V): a
  // DynamicCache() keeps every token of a sliding layer, and the model's window hides the old ones.
  // A linear_attention layer runs its recurrence one token at a time, each token a step of the
  // cache's linear layer (update_conv_state of its column, then update_recurrent_state), so that a
  // cache keeping a ring of states can roll back any of them (docs/rollback.md).
  template <Attention How = Attention::update, class Cache>
  Logits forward(std::span<const std::int32_t> tokens, Cache& cache, bool all_logits = false) const {
    const Matrix& x = run(
        tokens, positions_from(cache.get_seq_length(0), tokens.size()),
        [&](std::int64_t layer, const kvc::HostTensor<T>& q, const kvc::HostTensor<T>& k, const kvc::HostTensor<T>& v) {
          const AttentionExecutor executor{};
          const kvc::AttendOptions opts{.sliding_window = config_.window(layer), .context = {executor}};
          if constexpr (How == Attention::codes)
            return kvc::attend_quantized(cache, layer, view(q), view(k), view(v), opts);
          else if constexpr (How == Attention::fp8)
            return kvc::attend_fp8(cache, layer, view(q), view(k), view(v), kvc::Fp8Scales{}, opts);
          else
            return kvc::attend(cache, layer, q, k, v, opts);
        },
        [&](std::int64_t layer, const Matrix& q, const Matrix& k, const Matrix& v, Matrix& out) {
          if constexpr (requires { requires std::is_same_v<typename Cache::element_type, float>; })
            linear_with_cache(cache, layer, q, k, v, out);
          else
            throw std::invalid_argument("Decoder: linear_attention layers need a float kvc::Cache");
        });
    return all_logits ? logits(x) : logits(x.bottomRows(1));
  }

  // One step of a continuous batch: the tokens of several sequences packed one after another,
  // token i at position positions[i], and attend_fn(layer, q, k, v) attending each sequence's
  // queries to its own keys only (kvc::paged_attention over a paged cache). Returns the logits of
  // the rows `logit_rows`, in that order.
  template <class Attend>
  Logits forward_packed(std::span<const std::int32_t> tokens, std::span<const std::int64_t> positions,
                        std::span<const std::int64_t> logit_rows, Attend&& attend_fn) const {
    if (positions.size() != tokens.size()) throw std::invalid_argument("Decoder: one position per token");
    const Matrix& x = run(tokens, std::vector<std::int64_t>(positions.begin(), positions.end()), attend_fn);
    return pick_logits(x, logit_rows);
  }

  // The reference: the whole sequence recomputed from scratch, attention over all its keys with
  // an explicit causal mask (and the layer's window for sliding layers). Positions start at 0.
  Logits forward_no_cache(std::span<const std::int32_t> tokens, bool all_logits = false) const {
    const auto n = static_cast<std::int64_t>(tokens.size());
    const Matrix& x = run(
        tokens, positions_from(0, tokens.size()),
        [&](std::int64_t layer, const kvc::HostTensor<T>& q, const kvc::HostTensor<T>& k, const kvc::HostTensor<T>& v) {
          const kvc::AttentionMask mask{.kv_length = n,
                                        .kv_offset = 0,
                                        .query_position = 0,
                                        .sliding_window = config_.window(layer),
                                        .causal = true};
          return kvc::scaled_dot_product_attention(q, view(k), view(v), mask);
        },
        [&](std::int64_t layer, const Matrix& q, const Matrix& k, const Matrix& v, Matrix& out) {
          // The recurrence from a zero state, the conv's left context zeros.
          const std::int64_t c = 2 * config_.num_key_value_heads * config_.head_dim;
          std::vector<float> state(static_cast<std::size_t>(state_size()), 0.0f);
          std::vector<float> columns(static_cast<std::size_t>(c * (conv_kernel - 1 + n)), 0.0f);  // [time][channel]
          std::vector<float> window(static_cast<std::size_t>(c * conv_kernel));
          out.resize(n, q.cols());
          for (std::int64_t t = 0; t < n; ++t) {
            float* col = columns.data() + (conv_kernel - 1 + t) * c;
            std::copy_n(k.row(t).data(), k.cols(), col);
            std::copy_n(v.row(t).data(), v.cols(), col + k.cols());
            for (std::int64_t ch = 0; ch < c; ++ch)
              for (std::int64_t j = 0; j < conv_kernel; ++j)
                window[static_cast<std::size_t>(ch * conv_kernel + j)] =
                    columns[static_cast<std::size_t>((t + j) * c + ch)];
            linear_token(layers_[static_cast<std::size_t>(layer)], window.data(), q.row(t).data(), state.data(),
                         out.row(t).data());
          }
        });
    return all_logits ? logits(x) : logits(x.bottomRows(1));
  }

  // A linear_attention layer over rows [first, first + count) of q, k and v (one sequence's tokens,
  // in order), into the same rows of `out` (sized by the caller): its recurrent state starts from
  // `held` (zeros when empty), and each token is one step: conv(column [1, channels, 1]) stores the
  // token's keys and values and returns its conv window (this token last), store(state) stores the
  // new recurrent state. What a cache's update_conv_state and update_recurrent_state do, for a dense
  // cache (forward) or for one request of a paged cache (forward_packed).
  template <class ConvFn, class StoreFn>
  void linear_rows(const kvc::StateView<float>& held, ConvFn&& conv, StoreFn&& store, std::int64_t layer,
                   const Matrix& q, const Matrix& k, const Matrix& v, Matrix& out, Eigen::Index first,
                   Eigen::Index count) const {
    const std::int64_t c = k.cols() + v.cols();
    Eigen::Tensor<float, 4, Eigen::RowMajor> state(1, config_.num_key_value_heads, config_.head_dim, config_.head_dim);
    state.setZero();
    if (held.rank > 0 && held.size() == state.size()) std::copy_n(held.data(), held.size(), state.data());
    Eigen::Tensor<float, 3, Eigen::RowMajor> column(1, c, 1);
    std::vector<float> window(static_cast<std::size_t>(c * conv_kernel));
    for (Eigen::Index t = first; t < first + count; ++t) {
      std::copy_n(k.row(t).data(), k.cols(), column.data());
      std::copy_n(v.row(t).data(), v.cols(), column.data() + k.cols());
      const auto x = conv(column);  // [1, c, width], this token last
      const std::int64_t width = x.extent(2);
      for (std::int64_t ch = 0; ch < c; ++ch)
        for (std::int64_t j = 0; j < conv_kernel; ++j)
          window[static_cast<std::size_t>(ch * conv_kernel + j)] = x[ch * width + width - conv_kernel + j];
      linear_token(layers_[static_cast<std::size_t>(layer)], window.data(), q.row(t).data(), state.data(),
                   out.row(t).data());
      store(state);
    }
  }

  // forward_packed for a model with linear_attention layers: linear_fn(layer, q, k, v, out) computes
  // such a layer's output rows [tokens, heads * head_dim] (out sized by it), with linear_rows for
  // each sequence of the batch.
  template <class Attend, class Linear>
  Logits forward_packed(std::span<const std::int32_t> tokens, std::span<const std::int64_t> positions,
                        std::span<const std::int64_t> logit_rows, Attend&& attend_fn, Linear&& linear_fn) const {
    if (positions.size() != tokens.size()) throw std::invalid_argument("Decoder: one position per token");
    const Matrix& x = run(tokens, std::vector<std::int64_t>(positions.begin(), positions.end()), attend_fn, linear_fn);
    return pick_logits(x, logit_rows);
  }

  // The recurrent state of a linear layer, [1, KV heads, head_dim, head_dim].
  std::int64_t state_size() const { return config_.num_key_value_heads * config_.head_dim * config_.head_dim; }
  // The conv kernel of the linear layers.
  static constexpr std::int64_t conv_kernel = 4;

 private:
  struct Layer {
    Eigen::RowVectorXf attn_norm, mlp_norm;
    Weight wq, wk, wv, wo, w_gate, w_up, w_down;
    Matrix conv;  // linear_attention layers: the conv taps, [2 * KV heads * head_dim, conv_kernel]
  };

  // One token of a linear-attention layer: `window` [channels, conv_kernel] (row-major, the
  // token's keys and values in the last column, the earlier tokens' before), `state` the KV heads'
  // states [KV heads, head_dim, head_dim] (updated), `q` the token's queries, `out` its output.
  void linear_token(const Layer& w, const float* window, const float* q, float* state, float* out) const {
    const std::int64_t d = config_.head_dim, hkv = config_.num_key_value_heads,
                       group = config_.num_attention_heads / hkv, c = 2 * hkv * d;
    std::vector<float>& u = buffers().conv_out;
    u.resize(static_cast<std::size_t>(c));
    for (std::int64_t ch = 0; ch < c; ++ch) {  // the causal conv, then SiLU
      float a = 0;
      for (std::int64_t j = 0; j < conv_kernel; ++j) a += w.conv(ch, j) * window[ch * conv_kernel + j];
      u[static_cast<std::size_t>(ch)] = a / (1.0f + std::exp(-a));
    }
    const auto unit = [d](const float* x, float* y) {  // L2-normalized, as gated DeltaNet's q and k
      float n = 0;
      for (std::int64_t i = 0; i < d; ++i) n += x[i] * x[i];
      const float s = 1.0f / std::sqrt(n + 1e-6f);
      for (std::int64_t i = 0; i < d; ++i) y[i] = x[i] * s;
    };
    std::vector<float>&kn = buffers().unit_k, &qn = buffers().unit_q;
    kn.resize(static_cast<std::size_t>(d));
    qn.resize(static_cast<std::size_t>(d));
    for (std::int64_t g = 0; g < hkv; ++g) {
      float* s = state + g * d * d;
      const float decay = 0.75f + 0.2f * static_cast<float>(g + 1) / static_cast<float>(hkv + 1);
      unit(u.data() + g * d, kn.data());
      const float* v = u.data() + hkv * d + g * d;
      for (std::int64_t i = 0; i < d; ++i)
        for (std::int64_t j = 0; j < d; ++j)
          s[i * d + j] = decay * s[i * d + j] + kn[static_cast<std::size_t>(i)] * v[j];
      for (std::int64_t hd = g * group; hd < (g + 1) * group; ++hd) {
        unit(q + hd * d, qn.data());
        for (std::int64_t j = 0; j < d; ++j) {
          float o = 0;
          for (std::int64_t i = 0; i < d; ++i) o += qn[static_cast<std::size_t>(i)] * s[i * d + j];
          out[hd * d + j] = o;
        }
      }
    }
  }

  // A linear-attention layer over a kvc cache: the state is read from the cache, and each token
  // is a step of its linear layer: update_conv_state(the token's column) gives the conv window,
  // update_recurrent_state(the new state) stores it.
  template <class Cache>
  void linear_with_cache(Cache& cache, std::int64_t layer, const Matrix& q, const Matrix& k, const Matrix& v,
                         Matrix& out) const {
    kvc::StateView<float> held{};
    cache.visit_layer(layer, [&](const auto& l) {
      if constexpr (requires { l.recurrent_state(0); }) held = l.recurrent_state(0);
    });
    out.resize(q.rows(), q.cols());
    linear_rows(
        held, [&](const auto& column) { return cache.update_conv_state(column, layer, 0, conv_kernel); },
        [&](const auto& state) { cache.update_recurrent_state(state, layer, 0); }, layer, q, k, v, out, 0, q.rows());
  }

  // The logits of rows `logit_rows` of the hidden states x, in that order.
  Logits pick_logits(const Matrix& x, std::span<const std::int64_t> logit_rows) const {
    Matrix& picked = buffers().picked;
    picked.resize(static_cast<Eigen::Index>(logit_rows.size()), x.cols());
    for (std::size_t i = 0; i < logit_rows.size(); ++i) {
      const std::int64_t r = logit_rows[i];
      if (r < 0 || r >= x.rows()) throw std::out_of_range("Decoder: logit row " + std::to_string(r));
      picked.row(static_cast<Eigen::Index>(i)) = x.row(r);
    }
    return logits(picked);
  }

  static std::vector<std::int64_t> positions_from(std::int64_t first, std::size_t n) {
    std::vector<std::int64_t> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = first + static_cast<std::int64_t>(i);
    return out;
  }

  // The activations of a forward pass, one set per thread (the decoder's methods are const and may
  // run on several threads at once), kept from pass to pass: Eigen reallocates a matrix only when
  // its number of elements changes, so a pass over as many tokens as the one before (a decode
  // step) allocates none of them.
  struct Buffers {
    Matrix x, a, q, k, v, attended, projected, gate, up, down, cos, sin, picked;
    kvc::HostTensor<T> hq, hk, hv;
    std::vector<float> conv_out, unit_k, unit_q;  // a linear_attention layer's token
  };
  static Buffers& buffers() {
    thread_local Buffers b;
    return b;
  }

  // The final hidden states, [tokens, hidden] (this thread's buffer, valid until its next pass);
  // token i at positions[i].
  template <class Attend>
  const Matrix& run(std::span<const std::int32_t> tokens, const std::vector<std::int64_t>& positions,
                    Attend&& attend_fn) const {
    return run(tokens, positions, attend_fn, [](std::int64_t, const Matrix&, const Matrix&, const Matrix&, Matrix&) {
      throw std::invalid_argument("Decoder: linear_attention layers run through Decoder::forward only");
    });
  }
  // The same, with linear_fn(layer, q, k, v, out) computing a linear_attention layer's output
  // [tokens, heads * head_dim] from its rotated queries and keys and its values.
  template <class Attend, class Linear>
  const Matrix& run(std::span<const std::int32_t> tokens, const std::vector<std::int64_t>& positions,
                    Attend&& attend_fn, Linear&& linear_fn) const {
    const auto n = static_cast<std::int64_t>(tokens.size());
    const std::int64_t h = config_.hidden_size, hq = config_.num_attention_heads, hkv = config_.num_key_value_heads;
    if (n == 0) throw std::invalid_argument("Decoder: no tokens");
    for (const std::int32_t t : tokens)
      if (t < 0 || t >= config_.vocab_size)
        throw std::out_of_range("Decoder: token " + std::to_string(t) + " is outside the vocabulary");
    Buffers& b = buffers();
    Matrix& x = b.x;
    x.resize(n, h);
    const float normalizer = std::sqrt(static_cast<float>(h));
    for (std::int64_t i = 0; i < n; ++i) x.row(i) = embed_.row(tokens[static_cast<std::size_t>(i)]) * normalizer;
    rope_table(positions, b.cos, b.sin);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      rms_norm(x, w.attn_norm, b.a);
      w.wq.times(b.a, b.q);
      w.wk.times(b.a, b.k);
      w.wv.times(b.a, b.v);
      rotate(b.q, hq, b.cos, b.sin);
      rotate(b.k, hkv, b.cos, b.sin);
      if (config_.is_linear(static_cast<std::int64_t>(l))) {
        linear_fn(static_cast<std::int64_t>(l), b.q, b.k, b.v, b.attended);
      } else {
        to_heads(b.q, hq, b.hq);
        to_heads(b.k, hkv, b.hk);
        to_heads(b.v, hkv, b.hv);
        const kvc::HostTensor<T> out = attend_fn(static_cast<std::int64_t>(l), b.hq, b.hk, b.hv);
        from_heads(out, b.attended);
      }
      w.wo.times(b.attended, b.projected);
      if (reduce_) reduce_(b.projected);  // a tensor-parallel shard's partial sum, summed over the ranks
      x.noalias() += b.projected;
      rms_norm(x, w.mlp_norm, b.a);
      w.w_gate.times(b.a, b.gate);
      w.w_up.times(b.a, b.up);
      b.gate.array() = b.gate.array() / (1.0f + (-b.gate.array()).exp()) * b.up.array();  // SiLU(gate) * up
      w.w_down.times(b.gate, b.down);
      x.noalias() += b.down;
    }
    return x;
  }

  // The logits of the hidden states x (the LM head on every thread OpenMP gives).
  Logits logits(const Eigen::Ref<const Matrix>& x) const {
    Matrix& normed = buffers().a;
    rms_norm(x, final_norm_, normed);
    Logits out;
    head_.times(normed, out);
    return out;
  }

  void rms_norm(const Eigen::Ref<const Matrix>& x, const Eigen::RowVectorXf& weight, Matrix& y) const {
    y.resize(x.rows(), x.cols());
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (x.rows() >= 16 && !omp_in_parallel())
#endif
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const float ms = x.row(r).squaredNorm() / static_cast<float>(x.cols());
      y.row(r) = (x.row(r) * (1.0f / std::sqrt(ms + static_cast<float>(config_.rms_norm_eps)))).cwiseProduct(weight);
    }
  }

  // cos/sin of position * inv_freq, [n, head_dim / 2], computed in double and rounded once.
  void rope_table(const std::vector<std::int64_t>& positions, Matrix& c, Matrix& s) const {
    const auto half = static_cast<Eigen::Index>(inv_freq_.size());
    const auto n = static_cast<Eigen::Index>(positions.size());
    c.resize(n, half);
    s.resize(n, half);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n >= 16 && !omp_in_parallel())
#endif
    for (Eigen::Index i = 0; i < n; ++i)
      for (Eigen::Index j = 0; j < half; ++j) {
        const double angle =
            static_cast<double>(positions[static_cast<std::size_t>(i)]) * inv_freq_[static_cast<std::size_t>(j)];
        c(i, j) = static_cast<float>(std::cos(angle));
        s(i, j) = static_cast<float>(std::sin(angle));
      }
  }

  // Llama's rotate_half: element j of each head pairs with element j + head_dim / 2.
  void rotate(Matrix& x, std::int64_t heads, const Matrix& cos, const Matrix& sin) const {
    const std::int64_t d = config_.head_dim, half = d / 2;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (x.rows() >= 16 && !omp_in_parallel())
#endif
    for (Eigen::Index i = 0; i < x.rows(); ++i)
      for (std::int64_t hd = 0; hd < heads; ++hd) {
        float* p = x.row(i).data() + hd * d;
        for (std::int64_t j = 0; j < half; ++j) {
          const float a = p[j], b = p[j + half], c = cos(i, j), s = sin(i, j);
          p[j] = a * c - b * s;
          p[j + half] = b * c + a * s;
        }
      }
  }

  // [tokens, heads * head_dim] float -> [1, heads, tokens, head_dim] in T.
  void to_heads(const Matrix& x, std::int64_t heads, kvc::HostTensor<T>& out) const {
    const std::int64_t n = x.rows(), d = config_.head_dim;
    out.resize(1, heads, n, d);
    for (std::int64_t hd = 0; hd < heads; ++hd)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < d; ++j) out(0, hd, i, j) = static_cast<T>(x(i, hd * d + j));
  }

  // [1, heads, tokens, head_dim] in T -> [tokens, heads * head_dim] float.
  void from_heads(const kvc::HostTensor<T>& t, Matrix& out) const {
    const std::int64_t heads = t.dimension(1), n = t.dimension(2), d = t.dimension(3);
    out.resize(n, heads * d);
    for (std::int64_t hd = 0; hd < heads; ++hd)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < d; ++j) out(i, hd * d + j) = static_cast<float>(t(0, hd, i, j));
  }

  static kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
    const std::array<std::int64_t, 4> e{t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
    return {t.data(), e, {e[1] * e[2] * e[3], e[2] * e[3], e[3], 1}};
  }

  static std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) {
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (stream + 1);  // SplitMix64 finalizer
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // Approximately normal values (Irwin-Hall: the sum of four 16-bit uniforms from one
  // std::mt19937_64 draw, whose output the standard fixes; tails end at 3.5 std): cheap enough
  // for the hundreds of millions of weights of a real config.
  static void fill_normal(float* out, std::int64_t n, float mean, float stddev, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    // Each 16-bit part: mean 32767.5, variance (65536^2 - 1) / 12; the sum of four: twice that.
    const double scale = static_cast<double>(stddev) / std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t r = rng();
      const double sum = static_cast<double>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
      out[i] = mean + static_cast<float>((sum - 131070.0) * scale);
    }
  }

  DecoderConfig config_;
  Matrix embed_;  // [vocab, hidden]
  Weight head_;   // the LM head, [hidden, vocab]: embed_ transposed when tied, else its own
  std::vector<Layer> layers_;
  Eigen::RowVectorXf final_norm_;
  std::vector<double> inv_freq_;
  std::function<void(Matrix&)> reduce_;  // set_attention_reduce
};

}  // namespace examples

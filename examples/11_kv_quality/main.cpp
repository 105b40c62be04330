// kvc_kv_quality: what a low-bit KV format costs in model quality, measured on the example decoder
// (examples/common/decoder.hpp) against the exact cache.
//
// A prompt of random tokens is prefilled exactly (as transformers' quantized layers do: the
// prompt attends its own unquantized keys), its keys and values are then stored in the format
// under test, and the model decodes `steps` tokens fed the exact model's greedy tokens (teacher
// forcing, so every step is compared on the same input). Each new key and value row is stored in
// the format too. Per step: the KL divergence of the next-token distribution from the exact one,
// the largest |logit difference|, and whether the greedy token agrees.
//
// Formats, per token and KV head unless named: int8 / int4 / int2 (asymmetric: min, max and
// 2^bits - 1 steps between), int4-channel (KIVI's keys: each channel over groups of 32 tokens, the
// last, incomplete group kept exact), fp8 (E4M3, scale 1, vLLM's default), nvfp4 (E2M1 with an
// E4M3 scale per 16 values and a tensor scale per layer from the prompt's largest magnitude), fp32
// (kept exact). "rot" rotates keys, queries and values with kvc::hadamard_rotate before they are
// stored (the attention output is rotated back). These formats are simulated (each row quantized
// and dequantized in place); the two "QuantizedCache" rows hold int4 in kvc's quantized layers
// instead (CacheAttention), plain and with their rotate_keys / rotate_values.
//
// Two models: the decoder's random weights, and the same model with the outlier structure real
// keys have: key channels 3, 17 and 40 of every head 30, 60 and 100 times larger, the queries'
// channels as much smaller (the scores, and so the exact model, do not change).
//
//   kvc_kv_quality [--context N ...] [--steps M] [--check]
// --check runs the assertions (printed PASS/FAIL): rotation is exact without quantization; on the
// outlier model, rotation lowers the mean KL divergence of int4 keys at least 2x, and keys per
// channel beat keys per token, and QuantizedCache's rotation lowers int4's KL at least 2x. Exits 0
// when they hold (or without --check), 1 otherwise.
#include "../common/decoder.hpp"

#include <kvc/float8.hpp>
#include <kvc/nvfp4.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/rotation.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using examples::Decoder;
using examples::DecoderConfig;
using examples::Logits;

enum class Format { fp32, int8, int4, int2, int4_channel, fp8, nvfp4 };

const char* format_name(Format f) {
  switch (f) {
    case Format::fp32:
      return "fp32";
    case Format::int8:
      return "int8";
    case Format::int4:
      return "int4";
    case Format::int2:
      return "int2";
    case Format::int4_channel:
      return "int4-channel";
    case Format::fp8:
      return "fp8";
    case Format::nvfp4:
      return "nvfp4";
  }
  return "?";
}

struct Setup {
  Format k, v;
  bool rotate;
};

constexpr std::int64_t channel_group = 32;  // int4-channel: tokens per group
constexpr std::array<std::int64_t, 3> outlier_channels{3, 17, 40};
constexpr std::array<float, 3> outlier_factors{30.0f, 60.0f, 100.0f};

// Asymmetric integer quantization of n values in place: min, max and 2^bits - 1 steps.
void int_row(float* x, std::int64_t n, std::int64_t stride, int bits) {
  float lo = x[0], hi = x[0];
  for (std::int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const float levels = static_cast<float>((1 << bits) - 1), step = (hi - lo) / levels;
  if (!(step > 0.0f)) return;
  for (std::int64_t i = 0; i < n; ++i) {
    const float q = std::clamp(std::nearbyint((x[i * stride] - lo) / step), 0.0f, levels);
    x[i * stride] = q * step + lo;
  }
}

// The outlier model: key channels outlier_channels of every head outlier_factors times larger, the
// queries' as much smaller (scores unchanged). Rows of `dim` values.
void add_outliers(kvc::HostTensor<float>& q, kvc::HostTensor<float>& k, std::int64_t dim) {
  for (std::size_t o = 0; o < outlier_channels.size(); ++o) {
    for (std::int64_t i = outlier_channels[o]; i < k.size(); i += dim) k.data()[i] *= outlier_factors[o];
    for (std::int64_t i = outlier_channels[o]; i < q.size(); i += dim) q.data()[i] /= outlier_factors[o];
  }
}

// One layer's keys or values as the format stores them: [head][capacity][head_dim], the rows
// past the tokens held unused (appending a step copies nothing already held).
class Store {
 public:
  Store(Format format, std::int64_t heads, std::int64_t dim) : format_(format), heads_(heads), dim_(dim) {}

  // Appends x ([1, heads, count, dim], raw values) in the format; the tensor scale of nvfp4 comes
  // from the first rows appended (the prompt).
  void append(const kvc::HostTensor<float>& x) {
    const std::int64_t count = x.dimension(2);
    if (format_ == Format::nvfp4 && tensor_scale_ == 0.0f) {
      float amax = 0.0f;
      for (std::int64_t i = 0; i < x.size(); ++i) amax = std::max(amax, std::fabs(x.data()[i]));
      tensor_scale_ = kvc::nvfp4_tensor_scale(std::max(amax, 1e-30f));
    }
    if (tokens_ + count > capacity_) grow(std::max(2 * capacity_, tokens_ + count));
    for (std::int64_t h = 0; h < heads_; ++h)
      for (std::int64_t t = 0; t < count; ++t) {
        float* row = at(h, tokens_ + t);
        std::copy_n(x.data() + (h * count + t) * dim_, dim_, row);
        encode(row);
      }
    tokens_ += count;
    if (format_ == Format::int4_channel)
      for (; exact_from_ + channel_group <= tokens_; exact_from_ += channel_group)
        for (std::int64_t h = 0; h < heads_; ++h)
          for (std::int64_t c = 0; c < dim_; ++c) int_row(at(h, exact_from_) + c, channel_group, dim_, 4);
  }
  std::int64_t tokens() const { return tokens_; }
  // The rows held, [1, heads, tokens, dim], in place.
  kvc::TensorView<float> view() const {
    return {values_.data(), {1, heads_, tokens_, dim_}, {heads_ * capacity_ * dim_, capacity_ * dim_, dim_, 1}};
  }

 private:
  float* at(std::int64_t h, std::int64_t t) { return values_.data() + (h * capacity_ + t) * dim_; }
  void grow(std::int64_t capacity) {
    std::vector<float> grown(static_cast<std::size_t>(heads_ * capacity * dim_));
    for (std::int64_t h = 0; h < heads_; ++h)
      std::copy_n(values_.data() + h * capacity_ * dim_, tokens_ * dim_, grown.data() + h * capacity * dim_);
    values_ = std::move(grown);
    capacity_ = capacity;
  }
  void encode(float* row) {
    switch (format_) {
      case Format::fp32:
      case Format::int4_channel:
        return;  // (per channel: when its group is complete)
      case Format::int8:
        return int_row(row, dim_, 1, 8);
      case Format::int4:
        return int_row(row, dim_, 1, 4);
      case Format::int2:
        return int_row(row, dim_, 1, 2);
      case Format::fp8:
        for (std::int64_t i = 0; i < dim_; ++i) row[i] = kvc::float8_e4m3(row[i]).to_float();
        return;
      case Format::nvfp4: {
        std::array<std::uint8_t, 512> codes;
        std::array<kvc::float8_e4m3, 64> scales;
        kvc::nvfp4_quantize(row, dim_, tensor_scale_, codes.data(), scales.data());
        kvc::nvfp4_dequantize(codes.data(), scales.data(), dim_, tensor_scale_, row);
        return;
      }
    }
  }

  Format format_;
  std::int64_t heads_, dim_, tokens_ = 0, capacity_ = 0;
  std::vector<float> values_;
  std::int64_t exact_from_ = 0;  // int4-channel: the first token not yet quantized
  float tensor_scale_ = 0.0f;
};

// The model's attention with its K/V held in a format: keys and queries given outlier channels
// (when asked) and rotated (when asked), keys and values stored in the format and attended over,
// the output rotated back. The prompt is loaded from the exact prefill's keys and values (load).
class QuantizedAttention {
 public:
  QuantizedAttention(const DecoderConfig& config, Setup setup, bool outliers)
      : setup_(setup), outliers_(outliers), dim_(config.head_dim) {
    for (std::int64_t l = 0; l < config.num_hidden_layers; ++l) {
      keys_.emplace_back(setup.k, config.num_key_value_heads, config.head_dim);
      values_.emplace_back(setup.v, config.num_key_value_heads, config.head_dim);
    }
  }

  // Stores layer `layer`'s prompt keys and values (raw, as the model made them).
  void load(std::int64_t layer, kvc::HostTensor<float> k, kvc::HostTensor<float> v) {
    kvc::HostTensor<float> none;
    transform(none, k, v);
    keys_[static_cast<std::size_t>(layer)].append(k);
    values_[static_cast<std::size_t>(layer)].append(v);
  }

  kvc::HostTensor<float> operator()(std::int64_t layer, const kvc::HostTensor<float>& q,
                                    const kvc::HostTensor<float>& k, const kvc::HostTensor<float>& v) {
    kvc::HostTensor<float> qq = q, kk = k, vv = v;
    transform(qq, kk, vv);
    Store& ks = keys_[static_cast<std::size_t>(layer)];
    Store& vs = values_[static_cast<std::size_t>(layer)];
    const std::int64_t past = ks.tokens();
    ks.append(kk);
    vs.append(vv);
    const kvc::AttentionMask mask{.kv_length = past + q.dimension(2), .kv_offset = 0, .query_position = past};
    kvc::HostTensor<float> out = kvc::scaled_dot_product_attention(kvc::input_view(qq), ks.view(), vs.view(), mask);
    if (setup_.rotate) kvc::hadamard_rotate(out.data(), out.size() / dim_, dim_);
    return out;
  }

 private:
  void transform(kvc::HostTensor<float>& q, kvc::HostTensor<float>& k, kvc::HostTensor<float>& v) const {
    if (outliers_) add_outliers(q, k, dim_);
    if (setup_.rotate)
      for (kvc::HostTensor<float>* t : {&q, &k, &v}) kvc::hadamard_rotate(t->data(), t->size() / dim_, dim_);
  }

  Setup setup_;
  bool outliers_;
  std::int64_t dim_;
  std::vector<Store> keys_, values_;
};

// The same attention with K/V held by kvc's own quantized layers instead of the simulation above: a
// QuantizedCache<float> of quanto int4, one group per row of head_dim (per token and KV head, the
// simulation's int4), read from its codes by kvc::attend_quantized, with rotate_keys and
// rotate_values when asked (the layer rotates; nothing is rotated here). Its residual keeps the
// last token exact between flushes (residual_length 2, append-only), and a step's own token is
// exact in its own attention: the simulation quantizes both.
class CacheAttention {
 public:
  CacheAttention(const DecoderConfig& config, bool rotate, bool outliers)
      : outliers_(outliers), dim_(config.head_dim), cache_("quanto", config.cache_config(), options(config, rotate)) {}

  void load(std::int64_t layer, kvc::HostTensor<float> k, const kvc::HostTensor<float>& v) {
    kvc::HostTensor<float> none;
    if (outliers_) add_outliers(none, k, dim_);
    const auto kv = kvc::input_view(k), vv = kvc::input_view(v);
    cache_.update_with(kv, vv, layer, [&](auto& st) {
      st.append(kv, vv);
      return 0;
    });
  }

  kvc::HostTensor<float> operator()(std::int64_t layer, const kvc::HostTensor<float>& q,
                                    const kvc::HostTensor<float>& k, const kvc::HostTensor<float>& v) {
    kvc::HostTensor<float> qq = q, kk = k;
    if (outliers_) add_outliers(qq, kk, dim_);
    return kvc::attend_quantized(cache_, layer, qq, kk, v);
  }

 private:
  static kvc::QuantizedOptions options(const DecoderConfig& config, bool rotate) {
    kvc::QuantizedOptions o{.nbits = 4,
                            .axis_key = 0,
                            .axis_value = 0,
                            .q_group_size = config.head_dim,
                            .residual_length = 2,
                            .append_only = true};
    o.rotate_keys = o.rotate_values = rotate;
    return o;
  }

  bool outliers_;
  std::int64_t dim_;
  kvc::QuantizedCache<float> cache_;
};

// The exact prefill: attention over the prompt's own keys and values, which it keeps per layer.
struct Prefill {
  std::vector<std::pair<kvc::HostTensor<float>, kvc::HostTensor<float>>> kv;
  kvc::HostTensor<float> operator()(std::int64_t layer, const kvc::HostTensor<float>& q,
                                    const kvc::HostTensor<float>& k, const kvc::HostTensor<float>& v) {
    if (static_cast<std::size_t>(layer) >= kv.size()) kv.resize(static_cast<std::size_t>(layer) + 1);
    kv[static_cast<std::size_t>(layer)] = {k, v};
    return kvc::scaled_dot_product_attention(q, k, v, kvc::AttentionMask{.kv_length = k.dimension(2)});
  }
};

struct Scores {
  double kl_mean = 0, kl_p99 = 0, max_dlogit = 0, agreement = 0;
};

std::int32_t argmax(const Eigen::Ref<const Eigen::RowVectorXf>& row) {
  Eigen::Index best = 0;
  row.maxCoeff(&best);
  return static_cast<std::int32_t>(best);
}

// KL(p || q) of the softmax distributions of two logit rows.
double kl_divergence(const Eigen::RowVectorXf& p_logits, const Eigen::RowVectorXf& q_logits) {
  const auto log_softmax = [](const Eigen::RowVectorXf& x) {
    const double m = x.maxCoeff();
    double sum = 0;
    for (Eigen::Index i = 0; i < x.size(); ++i) sum += std::exp(x[i] - m);
    std::vector<double> out(static_cast<std::size_t>(x.size()));
    for (Eigen::Index i = 0; i < x.size(); ++i) out[static_cast<std::size_t>(i)] = x[i] - m - std::log(sum);
    return out;
  };
  const auto lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);
}

// Decodes `feed.size()` tokens fed `feed` after the prompt `prefill` holds (the exact model's
// greedy tokens): the logits of each step.
template <class Attention>
std::vector<Eigen::RowVectorXf> decode(const Decoder<float>& model, Attention& attention, const Prefill& prefill,
                                       const std::vector<std::int32_t>& feed) {
  for (std::size_t l = 0; l < prefill.kv.size(); ++l)
    attention.load(static_cast<std::int64_t>(l), prefill.kv[l].first, prefill.kv[l].second);
  const std::int64_t past = prefill.kv.front().first.dimension(2);
  const std::array<std::int64_t, 1> first{0};
  std::vector<Eigen::RowVectorXf> out;
  for (std::size_t s = 0; s < feed.size(); ++s) {
    const std::array<std::int32_t, 1> token{feed[s]};
    const std::array<std::int64_t, 1> position{past + static_cast<std::int64_t>(s)};
    out.emplace_back(model.forward_packed(token, position, first, attention).row(0));
  }
  return out;
}

Scores compare(const std::vector<Eigen::RowVectorXf>& exact, const std::vector<Eigen::RowVectorXf>& got) {
  Scores s;
  std::vector<double> kl;
  std::int64_t agree = 0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    kl.push_back(kl_divergence(exact[i], got[i]));
    s.max_dlogit = std::max(s.max_dlogit, static_cast<double>((exact[i] - got[i]).cwiseAbs().maxCoeff()));
    agree += argmax(exact[i]) == argmax(got[i]) ? 1 : 0;
  }
  for (const double x : kl) s.kl_mean += x / static_cast<double>(kl.size());
  std::sort(kl.begin(), kl.end());
  s.kl_p99 = kl[static_cast<std::size_t>(std::ceil(0.99 * static_cast<double>(kl.size()))) - 1];
  s.agreement = static_cast<double>(agree) / static_cast<double>(exact.size());
  return s;
}

std::int64_t option(const char* text, std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < lo || v > hi)
    throw std::invalid_argument("expected a number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                                ", got '" + text + "'");
  return v;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::int64_t> contexts;
  std::int64_t steps = 64;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--check") == 0) {
      check = true;
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = option(argv[++i], 1, 4096);
    } else if (std::strcmp(argv[i], "--context") == 0 && i + 1 < argc) {
      contexts.push_back(option(argv[++i], 1, 65536));
    } else {
      throw std::invalid_argument(std::string("unknown option '") + argv[i] +
                                  "' (usage: kvc_kv_quality [--context N ...] [--steps M] [--check])");
    }
  }
  if (contexts.empty()) contexts = {512, 4096};

  DecoderConfig config;
  config.num_attention_heads = 4;
  config.head_dim = 64;
  config.sliding_window = std::nullopt;  // (head_dim 64: the outlier channels, up to 40, exist)
  config.layer_types = {"full_attention", "full_attention", "full_attention", "full_attention"};
  const Decoder<float> model(config, 2026);

  const std::vector<Setup> setups{
      {Format::fp32, Format::fp32, true},    {Format::int8, Format::int8, false},
      {Format::int8, Format::int8, true},    {Format::int4, Format::fp32, false},
      {Format::int4, Format::fp32, true},    {Format::int4_channel, Format::fp32, false},
      {Format::int4, Format::int4, false},   {Format::int4, Format::int4, true},
      {Format::fp8, Format::fp8, false},     {Format::fp8, Format::int4, false},
      {Format::fp8, Format::int4, true},     {Format::int8, Format::int2, false},
      {Format::int8, Format::int2, true},    {Format::fp32, Format::int4, false},
      {Format::nvfp4, Format::nvfp4, false}, {Format::nvfp4, Format::nvfp4, true},
  };
  std::printf(
      "kvc_kv_quality: %lld layers, %lld query / %lld KV heads of %lld, vocabulary %lld; %lld decode steps fed "
      "the exact model's greedy tokens\n",
      static_cast<long long>(config.num_hidden_layers), static_cast<long long>(config.num_attention_heads),
      static_cast<long long>(config.num_key_value_heads), static_cast<long long>(config.head_dim),
      static_cast<long long>(config.vocab_size), static_cast<long long>(steps));

  int failed = 0;
  const auto verdict = [&](bool ok, const std::string& what) {
    std::printf("  check: %s: %s\n", what.c_str(), ok ? "PASS" : "FAIL");
    failed += ok ? 0 : 1;
  };
  for (const bool outliers : {false, true}) {
    for (const std::int64_t context : contexts) {
      std::mt19937 rng(static_cast<std::uint32_t>(context));
      std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.vocab_size - 1));
      std::vector<std::int32_t> prompt(static_cast<std::size_t>(context));
      for (auto& t : prompt) t = token(rng);
      // The exact prefill, once; then the exact model's greedy tokens and their logits.
      Prefill prefill;
      std::vector<std::int64_t> positions(prompt.size());
      for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int64_t>(i);
      const std::array<std::int64_t, 1> last{context - 1};
      const Logits prompt_logits = model.forward_packed(prompt, positions, last, prefill);
      std::vector<std::int32_t> feed{argmax(prompt_logits.row(0))};
      std::vector<Eigen::RowVectorXf> exact;
      {
        QuantizedAttention attention(config, {Format::fp32, Format::fp32, false}, false);
        for (std::size_t l = 0; l < prefill.kv.size(); ++l)
          attention.load(static_cast<std::int64_t>(l), prefill.kv[l].first, prefill.kv[l].second);
        for (std::int64_t s = 0; s < steps; ++s) {
          const std::array<std::int32_t, 1> token{feed.back()};
          const std::array<std::int64_t, 1> position{context + s};
          const std::array<std::int64_t, 1> first{0};
          exact.emplace_back(model.forward_packed(token, position, first, attention).row(0));
          if (s + 1 < steps) feed.push_back(argmax(exact.back()));
        }
      }
      std::printf("\n%s, context %lld:\n",
                  outliers ? "outlier keys (channels 3, 17, 40 x30, x60, x100)" : "random model",
                  static_cast<long long>(context));
      std::printf("  %-30s %12s %12s %12s %8s\n", "K / V", "KL mean", "KL p99", "max|dlogit|", "greedy");
      std::vector<Scores> scores;
      for (const Setup& setup : setups) {
        QuantizedAttention attention(config, setup, outliers);
        const Scores s = compare(exact, decode(model, attention, prefill, feed));
        scores.push_back(s);
        const std::string name =
            std::string(format_name(setup.k)) + " / " + format_name(setup.v) + (setup.rotate ? " rot" : "");
        std::printf("  %-30s %12.3g %12.3g %12.3g %7.1f%%\n", name.c_str(), s.kl_mean, s.kl_p99, s.max_dlogit,
                    100.0 * s.agreement);
      }
      Scores through_cache[2];  // plain, rotated
      for (const bool rotate : {false, true}) {
        CacheAttention attention(config, rotate, outliers);
        const Scores s = compare(exact, decode(model, attention, prefill, feed));
        through_cache[rotate ? 1 : 0] = s;
        std::printf("  %-30s %12.3g %12.3g %12.3g %7.1f%%\n",
                    rotate ? "int4 / int4 rot, QuantizedCache" : "int4 / int4, QuantizedCache", s.kl_mean, s.kl_p99,
                    s.max_dlogit, 100.0 * s.agreement);
      }
      if (check) {
        const auto at = [&](Format k, Format v, bool rotate) {
          for (std::size_t i = 0; i < setups.size(); ++i)
            if (setups[i].k == k && setups[i].v == v && setups[i].rotate == rotate) return scores[i];
          throw std::logic_error("no such setup");
        };
        verdict(at(Format::fp32, Format::fp32, true).kl_mean < 1e-6,
                "rotation without quantization changes nothing (KL < 1e-6)");
        if (outliers) {
          const double plain = at(Format::int4, Format::fp32, false).kl_mean,
                       rotated = at(Format::int4, Format::fp32, true).kl_mean,
                       channel = at(Format::int4_channel, Format::fp32, false).kl_mean;
          verdict(2 * rotated <= plain, "rotation lowers int4 keys' KL at least 2x (" + std::to_string(plain) + " -> " +
                                            std::to_string(rotated) + ")");
          verdict(channel < plain, "int4 keys per channel beat int4 keys per token (" + std::to_string(channel) +
                                       " < " + std::to_string(plain) + ")");
          verdict(2 * through_cache[1].kl_mean <= through_cache[0].kl_mean,
                  "QuantizedCache's rotate_keys/rotate_values lower int4's KL at least 2x (" +
                      std::to_string(through_cache[0].kl_mean) + " -> " + std::to_string(through_cache[1].kl_mean) +
                      ")");
        }
      }
    }
  }
  if (check) std::printf("kvc_kv_quality: %s\n", failed == 0 ? "PASS" : "FAIL");
  return failed == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvc_kv_quality: %s\n", e.what());
  return 2;
}

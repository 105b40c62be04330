#pragma once
// Helpers shared by the unit tests: small tensors written the way transformers' tests write them
// ([1, 1, S, 1] from a list of values), random tensors, and a snapshot of every observable of a
// cache (for the strong exception guarantee).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <doctest/doctest.h>
#include <kvc/kvc.hpp>

namespace kvc_test {

using element_types = std::tuple<float, double, Eigen::half, Eigen::bfloat16>;

// A [1, 1, S, 1] tensor holding `values` (transformers' torch.tensor(v)[None, None, :, None]).
template <class T = float>
kvc::HostTensor<T> seq(const std::vector<float>& values) {
  kvc::HostTensor<T> t(1, 1, static_cast<Eigen::Index>(values.size()), 1);
  for (std::size_t i = 0; i < values.size(); ++i) t(0, 0, static_cast<Eigen::Index>(i), 0) = T(values[i]);
  return t;
}

// The values along the seq axis of a view at (b, h, :, d), as floats.
template <class View>
std::vector<float> values_of(const View& v, std::int64_t b = 0, std::int64_t h = 0, std::int64_t d = 0) {
  std::vector<float> out;
  for (std::int64_t s = 0; s < v.extent(2); ++s) out.push_back(static_cast<float>(v(b, h, s, d)));
  return out;
}

// Every element of a view, in [b, h, s, d] order, as doubles.
template <class View>
std::vector<double> flatten(const View& v) {
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(v.size()));
  for (std::int64_t b = 0; b < v.extent(0); ++b)
    for (std::int64_t h = 0; h < v.extent(1); ++h)
      for (std::int64_t s = 0; s < v.extent(2); ++s)
        for (std::int64_t d = 0; d < v.extent(3); ++d) out.push_back(static_cast<double>(v(b, h, s, d)));
  return out;
}

template <class T>
kvc::HostTensor<T> random_tensor(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-64, 64);  // exactly representable in every element type
  kvc::HostTensor<T> t(b, h, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = T(static_cast<float>(dist(rng)) / 8.0f);
  return t;
}

// Attention in double precision with explicit loops, [B, Hq, Q, Dv] flattened: each query sees
// the keys `mask` lets it see (positions, window, chunk, causality and key_padding_mask), scores
// times `scale`; a query that sees no key gives zeros. The reference the host attention tests
// compare with.
template <class T>
std::vector<double> reference_attention(const kvc::HostTensor<T>& q, const kvc::HostTensor<T>& k,
                                        const kvc::HostTensor<T>& v, const kvc::AttentionMask& mask, double scale) {
  const auto B = q.dimension(0), Hq = q.dimension(1), Q = q.dimension(2), D = q.dimension(3);
  const auto Hkv = k.dimension(1), S = k.dimension(2), Dv = v.dimension(3);
  const std::int64_t width = B > 0 ? static_cast<std::int64_t>(mask.key_padding_mask.size()) / B : 0;
  std::vector<double> out;
  for (Eigen::Index b = 0; b < B; ++b)
    for (Eigen::Index h = 0; h < Hq; ++h)
      for (Eigen::Index i = 0; i < Q; ++i) {
        const auto hk = h / (Hq / Hkv);
        std::vector<double> w(static_cast<std::size_t>(S), 0.0);
        std::vector<bool> seen(static_cast<std::size_t>(S), false);
        double max = -1e300, sum = 0;
        for (Eigen::Index j = 0; j < S; ++j) {
          const std::int64_t kp = mask.kv_offset + j;
          if (!mask.visible(mask.query_position + i, kp)) continue;
          if (width > 0 && mask.key_padding_mask[static_cast<std::size_t>(b * width + kp)] == 0) continue;
          double dot = 0;
          for (Eigen::Index d = 0; d < D; ++d) dot += double(q(b, h, i, d)) * double(k(b, hk, j, d));
          w[std::size_t(j)] = dot * scale;
          seen[std::size_t(j)] = true;
          max = std::max(max, w[std::size_t(j)]);
        }
        for (Eigen::Index j = 0; j < S; ++j) {
          w[std::size_t(j)] = seen[std::size_t(j)] ? std::exp(w[std::size_t(j)] - max) : 0.0;
          sum += w[std::size_t(j)];
        }
        for (Eigen::Index d = 0; d < Dv; ++d) {
          double acc = 0;
          for (Eigen::Index j = 0; j < S; ++j) acc += sum > 0 ? w[std::size_t(j)] / sum * double(v(b, hk, j, d)) : 0.0;
          out.push_back(acc);
        }
      }
  return out;
}

// The same, causal, queries at positions q_pos0.., keys at k_pos0.., with an optional sliding
// window and chunk (0: none), scores scaled by 1 / sqrt(head_dim).
template <class T>
std::vector<double> reference_attention(const kvc::HostTensor<T>& q, const kvc::HostTensor<T>& k,
                                        const kvc::HostTensor<T>& v, std::int64_t q_pos0, std::int64_t k_pos0,
                                        std::int64_t window /* 0: none */, std::int64_t chunk = 0 /* 0: none */) {
  kvc::AttentionMask mask{k.dimension(2), k_pos0, q_pos0};
  if (window > 0) mask.sliding_window = window;
  if (chunk > 0) mask.attention_chunk_size = chunk;
  return reference_attention(q, k, v, mask, 1.0 / std::sqrt(double(q.dimension(3))));
}

// The tensor's seq slice [from, from + len) as a flat vector in [b, h, s, d] order.
template <class T>
std::vector<double> slice_seq(const kvc::HostTensor<T>& t, std::int64_t from, std::int64_t len) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < t.dimension(0); ++b)
    for (std::int64_t h = 0; h < t.dimension(1); ++h)
      for (std::int64_t s = from; s < from + len; ++s)
        for (std::int64_t d = 0; d < t.dimension(3); ++d) out.push_back(static_cast<double>(t(b, h, s, d)));
  return out;
}

// Concatenates tensors along seq (dim 2).
template <class T>
kvc::HostTensor<T> cat(const kvc::HostTensor<T>& a, const kvc::HostTensor<T>& b) {
  kvc::HostTensor<T> out(a.dimension(0), a.dimension(1), a.dimension(2) + b.dimension(2), a.dimension(3));
  for (std::int64_t i = 0; i < out.dimension(0); ++i)
    for (std::int64_t h = 0; h < out.dimension(1); ++h)
      for (std::int64_t s = 0; s < out.dimension(2); ++s)
        for (std::int64_t d = 0; d < out.dimension(3); ++d)
          out(i, h, s, d) = s < a.dimension(2) ? a(i, h, s, d) : b(i, h, s - a.dimension(2), d);
  return out;
}

// A fresh directory for spill files, used by every engine created while it lives.
struct spill_dir {
  std::string path;
  kvc::OffloadFileOptions saved = kvc::offload_file_options();

  explicit spill_dir(bool drop_page_cache = false) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvc-offload-test-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
    kvc::set_offload_file_options({path, drop_page_cache});
  }
  ~spill_dir() {
    kvc::set_offload_file_options(saved);
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  spill_dir(const spill_dir&) = delete;
  spill_dir& operator=(const spill_dir&) = delete;

  // Names in the directory (spill files are unlinked as soon as they are open).
  std::int64_t entries() const {
    std::int64_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(path)) ++n;
    return n;
  }
  // Spill files of this directory the process holds open.
  std::int64_t open_spill_files() const {
    std::int64_t n = 0;
    const std::string prefix = path + "/kvc-spill-";
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      const auto target = std::filesystem::read_symlink(e.path(), ec);
      if (!ec && target.string().starts_with(prefix)) ++n;
    }
    return n;
  }
};

// Collects warnings for the lifetime of the object.
struct captured_warnings {
  std::vector<std::string> messages;
  kvc::WarningHandler previous;
  captured_warnings() {
    kvc::reset_warnings_seen();
    previous = kvc::set_warning_handler([this](std::string_view m) { messages.emplace_back(m); });
  }
  ~captured_warnings() { kvc::set_warning_handler(previous); }
};

// Everything a caller can observe of a cache, for checking that a throwing call changed nothing.
struct snapshot {
  std::int64_t size = 0;
  bool initialized = false;
  bool compileable = false;
  std::string batch;
  std::int64_t bytes = 0;
  std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::string, std::vector<double>,
                         std::vector<double>, std::array<std::int64_t, 4>>>
      layers;
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

template <class Cache>
snapshot take_snapshot(const Cache& c) {
  snapshot s;
  s.size = c.size();
  s.initialized = c.is_initialized();
  s.compileable = c.is_compileable();
  try {
    s.batch = std::to_string(c.batch_size());
  } catch (const kvc::ValueError& e) {
    s.batch = e.what();
  }
  s.bytes = c.bytes();
  for (std::int64_t i = 0; i < c.size(); ++i) {
    std::vector<double> keys, values;
    std::array<std::int64_t, 4> extents{};
    std::int64_t seq = -1, kl = -1, ko = -1;
    if (!c.is_linear()[static_cast<std::size_t>(i)]) {  // pure linear layers have no K/V and no length
      const auto kv = c.stored(i);
      keys = flatten(kv.keys);
      values = flatten(kv.values);
      extents = kv.keys.extents;
      seq = c.get_seq_length(i);
      std::tie(kl, ko) = c.get_mask_sizes(3, i);
    }
    // Linear-attention states and indexer keys, appended to the values.
    c.visit_layer(i, [&](const auto& l) {
      auto add = [&](const auto& v) {
        values.push_back(static_cast<double>(v.rank));
        for (int r = 0; r < v.rank; ++r) values.push_back(static_cast<double>(v.extent(r)));
        for (std::int64_t j = 0; j < v.size(); ++j) values.push_back(static_cast<double>(v[j]));
      };
      auto add_linear = [&](const auto& lin) {
        for (std::int64_t st = 0; st < lin.number_of_states(); ++st) {
          add(lin.conv_state(st));
          add(lin.recurrent_state(st));
          values.push_back(lin.has_previous_state(st));
        }
        values.push_back(static_cast<double>(lin.rollback_depth()));  // shows the rings' state
      };
      if constexpr (requires { l.linear_part(); })
        add_linear(l.linear_part());
      else if constexpr (requires { l.conv_state(0); })
        add_linear(l);
      if constexpr (requires { l.indexer_keys(); }) add(l.indexer_keys());
    });
    s.layers.emplace_back(seq, c.get_max_length(i), kl, ko, std::string(c.layer_name(i)), std::move(keys),
                          std::move(values), extents);
  }
  return s;
}

}  // namespace kvc_test

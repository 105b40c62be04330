// libFuzzer target over everything kvc reads from files: the first byte picks what the rest is.
//   byte % 4 == 0, 1, 2: one document for one JSON reader, ModelConfig::from_json (then
//     layer_specs), GenerationConfig::from_json (then validate(true)) or cache_from_description
//     (then size() and is_sliding()). Only ValueError, KeyError, TypeError and IndexError may
//     come out (the seeds in tests/fuzz/corpus; the fuzz.json test).
//   byte % 4 == 3: the path a model's files take through kvc (the seeds in tests/fuzz/corpus_e2e;
//     the fuzz.e2e test): config.json, then generation_config.json, then a cache description,
//     separated by NUL bytes. Each part that parses goes on: make_cache (and
//     make_encoder_decoder_cache) builds the cache generate() would build, StaticCacheExport the
//     exported one, cache_from_description the described one, and each gets a prefill of 3 tokens
//     and two decode steps through kvc::attend on its first layers (linear-attention layers get
//     their states instead), then reorder_cache and reset.
// Whatever the files say must end in a documented kvc exception or in a working cache: never a
// crash, an out-of-bounds access (ASan, UBSan), an allocation beyond libFuzzer's -malloc_limit_mb
// or another exception type. The target lowers kvc::set_allocation_limit to 16 MiB per buffer,
// as a service reading untrusted files would, and updates at most 4 layers of at most 16, so that
// a valid but huge cache is refused by kvc (ValueError) rather than by the fuzzer's memory limit.
//   byte 'S' (then a cache kind byte) and 'P': a saved state (the seeds in tests/fuzz/corpus_state;
//     the fuzz.state test), loaded by kvc::load into a fresh cache of that kind (tests/fuzz/
//     state_targets.hpp), or by kvc::load_request into a paged cache; and its payload alone through
//     kvc::StateLoader (kvc::read_request), which has no checksum, so that the fuzzer's changes
//     reach every check of the layer kinds. A state that loads must save back to the same bytes,
//     and take one more token in every K/V layer.
//   byte 'F' and 'N' (then a cache kind byte): a saved state loaded by kvc::load into a cache of
//     that kind that already holds tokens, through a stream that can be measured ('F') or through
//     one that cannot seek, as a pipe ('N'; the loader must not allocate what has not arrived).
//     Only kvc::StateError may come out, and a refused load must leave the cache saving the same
//     bytes as before it.
//   byte 'M': a model-checked run of the continuous-batching scheduler over a paged cache
//     (tests/support/scheduler_model.hpp), its layout, sizes and operations drawn from the rest
//     of the input; a broken invariant aborts (the seeds in tests/fuzz/corpus_state). Byte 'A':
//     the same with allocation failures injected into every scheduler call (each must change
//     nothing, and succeed when made again).
// One binary for all (the heavy instantiations compile once); built with clang only.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <optional>
#include <string_view>
#include <vector>

#include <algorithm>
#include <cstring>
#include <istream>
#include <random>
#include <span>
#include <sstream>
#include <streambuf>
#include <string>

#include <kvc/cache_description.hpp>
#include <kvc/runtime.hpp>

#include "../support/failing_allocator.hpp"
#include "../support/scheduler_model.hpp"
#include "state_targets.hpp"

namespace {

constexpr std::int64_t max_layers_built = 16;  // more than this: parsed and checked, not built
constexpr std::int64_t layers_updated = 4;
constexpr std::int64_t max_width = 1024;  // heads * head_dim of an updated layer

// Small deterministic values.
template <class Tensor>
void fill(Tensor& t, std::uint32_t seed) {
  for (std::int64_t i = 0; i < t.size(); ++i)
    t.data()[i] = static_cast<float>((seed * 2654435761u + i * 40503u) % 17) / 8.0f - 1.0f;
}

// A prefill of 3 tokens and two decode steps through attend on the first layers of `cache`;
// linear-attention layers get a conv and a recurrent state.
template <class C>
void exercise(C& cache, const kvc::ModelConfig& config, std::int64_t batch) {
  if (cache.size() > max_layers_built) return;
  const std::vector<bool> linear = cache.is_linear();
  const kvc::HeadShapes shapes = kvc::get_head_shapes(config);
  for (std::int64_t step = 0; step < 3; ++step) {
    const std::int64_t q = step == 0 ? 3 : 1;
    for (std::int64_t i = 0; i < cache.size() && i < layers_updated; ++i) {
      const auto u = static_cast<std::size_t>(i);
      if (linear[u]) {
        Eigen::Tensor<float, 3, Eigen::RowMajor> conv(batch, 4, q);
        fill(conv, static_cast<std::uint32_t>(i + step));
        cache.update_conv_state(conv, i, 0, 4);
        Eigen::Tensor<float, 2, Eigen::RowMajor> rec(batch, 4);
        fill(rec, static_cast<std::uint32_t>(i));
        cache.update_recurrent_state(rec, i);
        continue;
      }
      const std::int64_t kv_heads = u < shapes.num_heads.size() ? shapes.num_heads[u] : 1;
      const std::int64_t dim = u < shapes.head_dim.size() ? shapes.head_dim[u] : 4;
      const std::int64_t q_heads =
          config.layer_num_attention_heads(i) > 0 ? config.layer_num_attention_heads(i) : kv_heads;
      if (kv_heads * dim > max_width || q_heads * dim > max_width) return;
      kvc::HostTensor<float> queries(batch, q_heads, q, dim), keys(batch, kv_heads, q, dim),
          values(batch, kv_heads, q, dim);
      fill(queries, 1);
      fill(keys, 2);
      fill(values, 3);
      const auto out = kvc::attend(cache, i, queries, keys, values);
      if (out.dimension(2) != q) std::abort();
    }
  }
  (void)cache.get_seq_length();
  (void)cache.bytes();
}

// Up to three documents, separated by NUL bytes.
std::vector<std::string_view> split(std::string_view text) {
  std::vector<std::string_view> parts;
  while (parts.size() < 2) {
    const std::size_t nul = text.find('\0');
    if (nul == std::string_view::npos) break;
    parts.push_back(text.substr(0, nul));
    text.remove_prefix(nul + 1);
  }
  parts.push_back(text);
  return parts;
}

template <class F>
void guarded(F&& f) {
  try {
    f();
  } catch (const kvc::ValueError&) {
  } catch (const kvc::KeyError&) {
  } catch (const kvc::TypeError&) {
  } catch (const kvc::IndexError&) {
  } catch (const kvc::AttributeError&) {
  } catch (const kvc::AssertionError&) {
  } catch (const kvc::RuntimeError&) {  // the offloaded caches' spill file
  } catch (const std::exception&) {
    std::abort();  // an exception kvc does not document (std::bad_alloc included: the limit is 16 MiB)
  }
}

// One JSON document for one reader: only the readers' exception types are allowed.
void read_one(std::uint8_t which, std::string_view text) {
  try {
    switch (which) {
      case 0:
        (void)kvc::layer_specs(kvc::ModelConfig::from_json(text));
        break;
      case 1:
        kvc::GenerationConfig::from_json(text).validate(true);
        break;
      default: {
        const kvc::AnyCache cache = kvc::cache_from_description(text);
        (void)cache.size();
        (void)cache.is_sliding();
      }
    }
  } catch (const kvc::ValueError&) {
  } catch (const kvc::KeyError&) {
  } catch (const kvc::TypeError&) {
  } catch (const kvc::IndexError&) {
  } catch (const std::exception&) {
    std::abort();  // an exception the readers do not document: a bug
  }
}

// The model files, through every cache built from them.
void end_to_end(std::string_view input) {
  const std::vector<std::string_view> parts = split(input);
  const std::size_t size = input.size();
  std::optional<kvc::ModelConfig> config;
  guarded([&] { config = kvc::ModelConfig::from_json(parts[0]); });
  if (!config) return;
  guarded([&] { (void)kvc::layer_specs(*config); });
  std::optional<kvc::GenerationConfig> generation;
  if (parts.size() > 1) guarded([&] { generation = kvc::GenerationConfig::from_json(parts[1]); });
  const std::int64_t batch = 1 + static_cast<std::int64_t>(size % 2);
  if (config->num_hidden_layers <= max_layers_built) {
    const kvc::GenerationConfig g = generation.value_or(kvc::GenerationConfig{});
    guarded([&] {
      kvc::AnyCache cache =
          kvc::make_cache<float>(g, *config, {.batch_size = batch, .max_cache_length = -1, .encoder_length = 8});
      exercise(cache, *config, batch);
      cache.reorder_cache(std::vector<std::int64_t>(static_cast<std::size_t>(batch), 0));
      cache.reset();
    });
    if (config->is_encoder_decoder)
      guarded([&] {
        auto pair = kvc::make_encoder_decoder_cache<float>(
            g, *config, {.batch_size = batch, .max_cache_length = -1, .encoder_length = 8});
        exercise(pair.self_attention_cache(), *config, batch);
        pair.reset();
      });
    guarded([&] {
      kvc::StaticCacheExport<float> exported(*config, generation, batch);
      exported.begin_step({0});
      exercise(exported.cache(), *config, batch);
      (void)exported.buffers();
    });
  }
  if (parts.size() > 2)
    guarded([&] {
      kvc::AnyCache described = kvc::cache_from_description(parts[2]);
      if (described.element_type_name() == "float") exercise(described, *config, batch);
    });
}

// ---- saved states ----------------------------------------------------------------------------------

struct memory_source {
  std::string_view bytes;
  void get(void* p, std::size_t n) {
    if (n > bytes.size()) throw kvc::StateError("kvc::load: the state is truncated");
    std::memcpy(p, bytes.data(), n);
    bytes.remove_prefix(n);
  }
  std::uint64_t available() const noexcept { return bytes.size(); }
};

// One more token in each of the first K/V layers that hold some, in their own shape.
template <class C>
void one_more_token(C& cache) {
  const std::vector<bool> linear = cache.is_linear();
  for (std::int64_t i = 0; i < cache.size() && i < layers_updated; ++i) {
    if (linear[static_cast<std::size_t>(i)]) continue;
    guarded([&] {
      const auto kv = cache.stored(i);
      const std::int64_t b = kv.keys.extent(0), h = kv.keys.extent(1), dk = kv.keys.extent(3), dv = kv.values.extent(3);
      if (b < 1 || h < 1 || b * h * (dk + dv) > max_width) return;
      kvc::HostTensor<float> k(b, h, 1, dk), v(b, h, 1, dv);
      fill(k, 5);
      fill(v, 6);
      cache.update(k, v, i);
    });
  }
}

template <class C>
std::string saved(const C& cache) {
  std::ostringstream os(std::ios::binary);
  kvc::save(cache, os);
  return os.str();
}
// What loads saves back to the bytes it came from.
template <class C>
void check_saves_back(const C& cache, std::string_view bytes) {
  const std::string again = saved(cache);
  if (bytes.substr(0, again.size()) != again) std::abort();
}

void load_state(std::uint8_t which, std::string_view bytes) {
  kvc_fuzz::with_cache(which, [&](auto& cache) {
    bool loaded = false;
    guarded([&] {
      std::istringstream is{std::string(bytes), std::ios::binary};
      kvc::load(cache, is);
      loaded = true;
    });
    if (!loaded) return;
    check_saves_back(cache, bytes);
    if constexpr (requires { cache.self_attention_cache(); }) {
      one_more_token(cache.self_attention_cache());
      one_more_token(cache.cross_attention_cache());
    } else {
      one_more_token(cache);
    }
  });
  constexpr std::size_t header = 24;  // magic, version, length
  if (bytes.size() <= header) return;
  kvc_fuzz::with_cache(which, [&](auto& cache) {
    if constexpr (!requires { cache.self_attention_cache(); }) {
      memory_source payload{bytes.substr(header)};
      guarded([&] {
        kvc::StateLoader loader(cache, payload);
        loader.load_all();
      });
      one_more_token(cache);
    }
  });
}

// A stream that cannot seek (a pipe's), handing out 61 bytes at a time.
struct pipe_buf : std::streambuf {
  std::string_view data;
  char window[61] = {};
  explicit pipe_buf(std::string_view d) : data(d) {}
  int_type underflow() override {
    if (data.empty()) return traits_type::eof();
    const std::size_t n = std::min(sizeof window, data.size());
    std::memcpy(window, data.data(), n);
    data.remove_prefix(n);
    setg(window, window, window + n);
    return traits_type::to_int_type(window[0]);
  }
};

void load_into_filled(std::uint8_t which, std::string_view bytes, bool pipe) {
  kvc_fuzz::with_cache(which, [&](auto& cache) {
    std::mt19937 rng(which);
    if constexpr (requires { cache.self_attention_cache(); }) {
      kvc_fuzz::fill(cache.self_attention_cache(), 2, rng);
      kvc_fuzz::fill(cache.cross_attention_cache(), 3, rng);
    } else {
      kvc_fuzz::fill(cache, 2, rng);
    }
    const std::string before = saved(cache);
    try {
      if (pipe) {
        pipe_buf buf(bytes);
        std::istream is(&buf);
        kvc::load(cache, is);
      } else {
        std::istringstream is{std::string(bytes), std::ios::binary};
        kvc::load(cache, is);
      }
    } catch (const kvc::StateError&) {
      if (saved(cache) != before) std::abort();  // a refused load changes nothing
      return;
    }
    check_saves_back(cache, bytes);
  });
}

void load_paged_request(std::string_view bytes) {
  kvc_fuzz::Paged cache = kvc_fuzz::paged();
  guarded([&] {
    std::istringstream is{std::string(bytes), std::ios::binary};
    kvc::load_request(cache, "r", is);
  });
  if (cache.get_num_free_blocks() != 8 - cache.blocks_in_use("r")) std::abort();
  if (bytes.size() > 24) {
    memory_source payload{bytes.substr(24)};
    guarded([&] { kvc::read_request(cache, "s", payload); });
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvc::set_warning_handler({});  // warnings are expected on odd input; keep the output quiet
  kvc::set_allocation_limit(std::int64_t{16} << 20);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] == 'S') {
    if (!rest.empty()) load_state(static_cast<std::uint8_t>(rest[0]), rest.substr(1));
  } else if (data[0] == 'M' || data[0] == 'A') {
    kvc_model::source src(std::span(data + 1, size - 1));
    try {
      kvc_model::run r(src);
      if (data[0] == 'A') r.inject([](std::int64_t n) { arm(n); }, [] { return disarm(); });
      (void)r.go();
    } catch (const kvc_model::violation& v) {
      std::fprintf(stderr, "scheduler model: %s\n", v.what());
      std::abort();
    }
  } else if (data[0] == 'F' || data[0] == 'N') {
    if (!rest.empty()) load_into_filled(static_cast<std::uint8_t>(rest[0]), rest.substr(1), data[0] == 'N');
  } else if (data[0] == 'P') {
    load_paged_request(rest);
  } else if (data[0] % 4 == 3)
    end_to_end(rest);
  else
    read_one(static_cast<std::uint8_t>(data[0] % 4), rest);
  return 0;
}

// libFuzzer target over kvc's JSON readers: ModelConfig::from_json, GenerationConfig::from_json
// and cache_from_description. The first byte picks the reader; the rest is the document.
// Malformed input must end in a kvc exception (ValueError, KeyError, ...), never in a crash, an
// unbounded allocation (libFuzzer's -rss_limit_mb catches those) or another exception type.
// Built only with clang (-fsanitize=fuzzer,address,undefined); tools/test-all.sh runs it for a
// bounded time on the seed corpus in tests/fuzz/corpus.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string_view>

#include <kvc/cache_description.hpp>
#include <kvc/kvc.hpp>

namespace {
template <class C>
void touch(const C& cache) {
  // Exercise what a caller would do next with what was built.
  (void)cache.size();
  (void)cache.is_sliding();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  kvc::set_warning_handler({});  // warnings are expected on odd input; keep the output quiet
  try {
    switch (data[0] % 3) {
      case 0: {
        const auto config = kvc::ModelConfig::from_json(text);
        (void)kvc::layer_specs(config);
        break;
      }
      case 1: {
        const auto g = kvc::GenerationConfig::from_json(text);
        g.validate(true);
        break;
      }
      default:
        touch(kvc::cache_from_description(text));
        break;
    }
  } catch (const kvc::ValueError&) {
  } catch (const kvc::KeyError&) {
  } catch (const kvc::TypeError&) {
  } catch (const kvc::IndexError&) {
  } catch (const std::exception&) {
    std::abort();  // an exception kvc does not document: a bug
  }
  return 0;
}

// The storage conformance scenarios (conformance.hpp) over HostStorage<float>, built by the host
// compiler in every configuration: the semantics the CUDA storage is compared against.
#include "conformance.hpp"

namespace kc = kvc_conformance;

TEST_CASE("conformance: HostStorage<float> passes every scenario") {
  const auto records = kc::run_all<kc::HostBackend<float>>();
  CHECK(records.size() == 10);
  for (const auto& scenario : records) {  // no structured binding: clang 14 cannot capture one in INFO
    INFO("scenario " << scenario.first);
    CHECK_FALSE(scenario.second.labels.empty());
  }
}

TEST_CASE("conformance: a run is deterministic, so host and device records can be compared") {
  const auto a = kc::run_all<kc::HostBackend<float>>();
  const auto b = kc::run_all<kc::HostBackend<float>>();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(kc::same_record(a[i].second, b[i].second, a[i].first));
}

TEST_CASE("conformance: HostStorage<Eigen::bfloat16> gives the float results, rounded exactly") {
  const auto f = kc::run_all<kc::HostBackend<float>>();
  const auto h = kc::run_all<kc::HostBackend<Eigen::bfloat16>>();
  REQUIRE(f.size() == h.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    // bytes differ with the element size; everything else (shapes, lengths, elements) is equal,
    // except what the quantized layers return (their metadata is rounded to bfloat16) and attention
    // outputs (rounded to bfloat16)
    CHECK(f[i].second.labels == h[i].second.labels);
    const std::string name = f[i].first;
    if (name != "quantized" && name != "attention" && name != "paged")
      CHECK(f[i].second.tensors == h[i].second.tensors);
  }
}

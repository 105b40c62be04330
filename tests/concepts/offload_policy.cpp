// kvc::concepts::OffloadPolicy<O, S> and serves_storage<O, S>
// (concepts/kvc/concepts/offload_policy.hpp): the shipped policy and a minimal archetype model
// them; one near-miss per named requirement does not. Compile-only.
#include <kvc/concepts/offload_policy.hpp>
#include <kvc/policies/offload/none.hpp>
#include <kvc/policies/storage/host.hpp>

#include <cstdint>

// A named namespace (not an anonymous one): clang warns about unused static members of
// internal-linkage archetypes.
namespace kvc_test_offload_policy {

using kvc::concepts::has_offload_engine;
using kvc::concepts::has_serves_flag;
using kvc::concepts::OffloadPolicy;
using kvc::concepts::serves_storage;
using host = kvc::HostStorage<float>;

// ---- shipped policy --------------------------------------------------------------------------
static_assert(OffloadPolicy<kvc::NoOffload, kvc::HostStorage<float>>);
static_assert(OffloadPolicy<kvc::NoOffload, kvc::HostStorage<double>>);
static_assert(OffloadPolicy<kvc::NoOffload, kvc::HostStorage<Eigen::half>>);
static_assert(OffloadPolicy<kvc::NoOffload, kvc::HostStorage<Eigen::bfloat16>>);
static_assert(serves_storage<kvc::NoOffload, kvc::HostStorage<float>>);

// ---- minimal archetype: a `serves<S>` flag and a default-constructible `engine<S>` -------------
struct offload_archetype {
  template <class S>
  static constexpr bool serves = true;
  template <class S>
  struct engine {};
};
static_assert(has_serves_flag<offload_archetype, host>);
static_assert(has_offload_engine<offload_archetype, host>);
static_assert(OffloadPolicy<offload_archetype, host>);
static_assert(serves_storage<offload_archetype, host>);

// ---- near-misses -----------------------------------------------------------------------------
// has_serves_flag: `serves` is a plain bool, not a variable template over the storage.
struct serves_not_a_template {
  static constexpr bool serves = true;
  template <class S>
  struct engine {};
};
static_assert(!has_serves_flag<serves_not_a_template, host>);
static_assert(has_offload_engine<serves_not_a_template, host>);
static_assert(!OffloadPolicy<serves_not_a_template, host>);

// has_serves_flag: `serves<S>` is not convertible to bool.
struct serves_not_a_bool {
  struct answer {};
  template <class S>
  static constexpr answer serves{};
  template <class S>
  struct engine {};
};
static_assert(!has_serves_flag<serves_not_a_bool, host>);
static_assert(!OffloadPolicy<serves_not_a_bool, host>);

// has_offload_engine: no engine at all.
struct no_engine {
  template <class S>
  static constexpr bool serves = true;
};
static_assert(has_serves_flag<no_engine, host>);
static_assert(!has_offload_engine<no_engine, host>);
static_assert(!OffloadPolicy<no_engine, host>);

// has_offload_engine: the engine needs a constructor argument (the Cache default-constructs it).
struct engine_needs_argument {
  template <class S>
  static constexpr bool serves = true;
  template <class S>
  struct engine {
    explicit engine(std::int64_t prefetch_depth);
  };
};
static_assert(!has_offload_engine<engine_needs_argument, host>);
static_assert(!OffloadPolicy<engine_needs_argument, host>);

// serves_storage: a well-formed policy that declines this storage (device memory only).
struct device_only {
  template <class S>
  static constexpr bool serves = S::space == kvc::memory_space::device;
  template <class S>
  struct engine {};
};
static_assert(OffloadPolicy<device_only, host>);
static_assert(!serves_storage<device_only, host>);

static_assert(!OffloadPolicy<int, host>);
static_assert(!serves_storage<int, host>);

}  // namespace kvc_test_offload_policy

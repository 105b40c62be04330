// EXPECT-ERROR: kvc::Cache: the OffloadPolicy cannot serve this StoragePolicy. Pick an offload policy made for the storage's memory space
// A well-formed offload policy that only serves device storage, paired with host storage.
// docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#include <cstdint>

// Serves only storage in device memory; the engine's hooks do nothing here.
struct DeviceOnlyOffload {
  template <class S>
  static constexpr bool serves = S::space == kvc::memory_space::device;

  template <class S>
  struct engine {
    template <class Cache>
    void before_update(Cache&, std::int64_t) noexcept {}
    template <class Cache>
    void after_update(Cache&, std::int64_t) noexcept {}
  };
};

// The same engine, serving every storage: accepted.
struct AnyOffload : DeviceOnlyOffload {
  template <class S>
  static constexpr bool serves = true;
};

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, DeviceOnlyOffload> misuse;
#endif

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, AnyOffload> cache;
  kvc::HostTensor<float> k(1, 1, 2, 4);
  k.setConstant(1.0f);
  const auto [keys, values] = cache.update(k, k, 0);
  return keys.extent(2) == 2 && values.extent(2) == 2 ? 0 : 1;
}

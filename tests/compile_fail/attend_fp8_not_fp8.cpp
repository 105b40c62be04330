// EXPECT-ERROR: kvc::attend_fp8: the cache's element type must be kvc::float8_e4m3 or kvc::float8_e5m2 (e.g. kvc::DynamicCache<kvc::float8_e4m3>); use kvc::attend for other caches
// kvc::attend_fp8 stores fp8 codes: a cache of another element type cannot hold them.
// docs/errors.md lists the fix.
#include <kvc/caches.hpp>
#include <kvc/fp8_attention.hpp>

int main() {
  kvc::HostTensor<float> x(1, 1, 1, 4);
  x.setZero();
  const auto v = kvc::HostStorage<float>::input_view(x);
#ifdef KVC_SHOULD_FAIL
  kvc::DynamicCache<float> cache;
#else
  kvc::DynamicCache<kvc::float8_e4m3> cache;
#endif
  return kvc::attend_fp8(cache, 0, v, v, v, {}).size() == 4 ? 0 : 1;
}

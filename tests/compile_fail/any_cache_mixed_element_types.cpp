// EXPECT-ERROR: kvc::AnyCache::update: keys and values must have the same element type
// AnyCache erases the cache type, not the element type of a call: keys and values of one update
// must agree, which is known at compile time.
#include <kvc/any_cache.hpp>
#include <kvc/caches.hpp>

int main() {
  kvc::AnyCache cache = kvc::DynamicCache<float>();
  kvc::HostTensor<float> keys(1, 1, 1, 1);
  keys.setZero();
#ifdef KVC_SHOULD_FAIL
  kvc::HostTensor<double> values(1, 1, 1, 1);
  values.setZero();
#else
  kvc::HostTensor<float> values(1, 1, 1, 1);
  values.setZero();
#endif
  return cache.update(keys, values, 0).keys.extent(2) == 1 ? 0 : 1;
}

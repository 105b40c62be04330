// EXPECT-ERROR: kvc::Cache: the StoragePolicy does not model kvc::concepts::StoragePolicy. Use kvc::HostStorage or see docs/concepts/storage_policy.md
// A misconfigured Cache that the program goes on to use: the policy's message is the only error
// (the compile_fail suite fails a case whose output holds a second `error:`), with no
// "has no member named 'update'" after it. docs/errors.md lists the fix.
#include <cstdint>

#include <kvc/cache.hpp>

int main() {
#ifdef KVC_SHOULD_FAIL
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, float> cache;
#else
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer> > cache;
#endif
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(0.5f);
  auto [keys, values] = cache.update(k, k, 0);
  (void)keys;
  (void)values;
  const std::int64_t n = cache.get_seq_length() + cache.get_max_length() + cache.size();
  const auto [kv_length, kv_offset] = cache.get_mask_sizes(1, 0);
  cache.reorder_cache({0});
  cache.batch_select_indices({0});
  cache.crop(-1);
  cache.reset();
  return n > 0 && kv_length >= kv_offset && !cache.is_compileable() ? 0 : 1;
}

// Package smoke test, shared by install_consumer and subdir_consumer.
#include <kvc/kvc.hpp>

int main() {
  kvc::DynamicCache<float> cache;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(1.f);
  auto kv = cache.update(k, k, 0);
  return (kv.keys.extent(2) == 3 && cache.get_seq_length(0) == 3) ? 0 : 1;
}

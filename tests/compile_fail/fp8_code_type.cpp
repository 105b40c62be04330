// EXPECT-ERROR: kvc fp8: the code type must be kvc::float8_e4m3 or kvc::float8_e5m2
// kvc::to_fp8 and kvc::fp8_scales_for take the 8-bit float type to encode to.
// docs/errors.md lists the fix.
#include <vector>

#include <kvc/caches.hpp>
#include <kvc/fp8_attention.hpp>

int main() {
  kvc::HostTensor<float> x(1, 1, 1, 4);
  x.setZero();
  const auto v = kvc::HostStorage<float>::input_view(x);
#ifdef KVC_SHOULD_FAIL
  return kvc::to_fp8<Eigen::half>(v, std::vector<float>{1.f}).size() == 4 ? 0 : 1;
#else
  return kvc::to_fp8<kvc::float8_e5m2>(v, std::vector<float>{1.f}).size() == 4 ? 0 : 1;
#endif
}

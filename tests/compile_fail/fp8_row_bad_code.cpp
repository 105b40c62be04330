// EXPECT-ERROR: kvc::fp8_row<F8>: F8 must be kvc::float8_e4m3 or kvc::float8_e5m2
// fp8_row stores 8-bit float codes; another type has no fp8 encoding. docs/errors.md lists the fix.
#include <kvc/row_codes.hpp>

int main() {
#ifdef KVC_SHOULD_FAIL
  return kvc::fp8_row<Eigen::half>::row_bytes(4) == 8 ? 0 : 1;
#else
  return kvc::fp8_row<kvc::float8_e5m2>::row_bytes(4) == 8 ? 0 : 1;
#endif
}

// EXPECT-ERROR: kvc::rotated<C>: C must be kvc::int8_row, int4_row, int2_row, nvfp4_row or kvc::fp8_row<F8>
// kvc::rotated rotates the rows of a code format; a plain element type has no codes to rotate into
// (kvc::hadamard_rotate rotates plain values). docs/errors.md lists the fix.
#include <kvc/paged/paged_cache.hpp>
#include <kvc/row_codes.hpp>

int main() {
#ifdef KVC_SHOULD_FAIL
  return kvc::rotated<float>::name.empty() ? 1 : 0;
#else
  return kvc::rotated<kvc::int4_row>::name.empty() ? 1 : 0;
#endif
}

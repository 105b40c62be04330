// EXPECT-ERROR: kvc::to_row_codes: the code type must be one row format (kvc::int8_row, int4_row, int2_row, nvfp4_row, fp8_row<F8>, bfloat16_row or kvc::rotated<one>); a kvc::kv_codes pool's rows come from kvc::to_kv_codes
// A kv_codes pool encodes keys and values in two formats: one call cannot know which side a
// tensor is. docs/errors.md lists the fix.
#include <kvc/row_codes.hpp>

int main() {
  using Pool = kvc::kv_codes<kvc::int8_row, kvc::int4_row>;
  const kvc::HostTensor<float> x(1, 1, 1, 4);
#ifdef KVC_SHOULD_FAIL
  const auto rows = kvc::to_row_codes<Pool>(x);
  return rows.size() > 0 ? 0 : 1;
#else
  const auto rows = kvc::to_kv_codes<Pool>(x, x);
  return rows.keys.size() > 0 ? 0 : 1;
#endif
}

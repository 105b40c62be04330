#pragma once
// Whether this test binary is built with ASan/UBSan (KVC_SANITIZE defines KVC_TEST_SANITIZED for
// the unit tests). There, the heaviest cases (which run 5 to 20 times slower at -O0 under the
// sanitizers) run a subset of the repetitions that only take the same code paths again with other
// thread counts, element types or lengths; the g++ build runs every repetition, natively and under
// valgrind (tools/test-all.sh).

namespace kvc_test {

#if defined(KVC_TEST_SANITIZED)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif

}  // namespace kvc_test

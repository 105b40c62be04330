// EXPECT-ERROR: error:
// Sanity case for the compile-fail machinery (cmake/kvcCompileFail.cmake): the _ok build must
// succeed and the _ko build must fail with a plain compiler error. If compile_fail.sanity.ko
// passes while every other .ko fails (or the reverse), suspect the harness, not the headers.
int main() { return 0; }

#ifdef KVC_SHOULD_FAIL
this is not C++ at all;
#endif

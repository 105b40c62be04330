// <kvc/version.hpp> against the CMake project's version (KVC_PROJECT_VERSION, set by
// tests/CMakeLists.txt): the two cannot differ, and the macros agree with each other.
#include <doctest/doctest.h>

#include <string>

#include <kvc/kvc.hpp>

static_assert(KVC_VERSION == KVC_VERSION_MAJOR * 10000 + KVC_VERSION_MINOR * 100 + KVC_VERSION_PATCH);
static_assert(kvc::version_major == KVC_VERSION_MAJOR && kvc::version_minor == KVC_VERSION_MINOR &&
              kvc::version_patch == KVC_VERSION_PATCH);

TEST_CASE("the version in <kvc/version.hpp> is the CMake project's") {
  CHECK(std::string(KVC_VERSION_STRING) == KVC_PROJECT_VERSION);
  CHECK(std::string(kvc::version_string) == std::to_string(KVC_VERSION_MAJOR) + "." +
                                                std::to_string(KVC_VERSION_MINOR) + "." +
                                                std::to_string(KVC_VERSION_PATCH));
}

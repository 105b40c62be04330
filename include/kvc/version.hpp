#pragma once
// kvc's version. This header is where the version is set: CMakeLists.txt reads these numbers into
// its project version (and so into find_package's version check and kvc.pc), so the two cannot
// differ, and a program that includes kvc from a source tree, without CMake, sees the same.

#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1
#define KVC_VERSION_PATCH 0
#define KVC_VERSION_STRING "0.1.0"
// One number that orders versions: major * 10000 + minor * 100 + patch (0.1.0: 100).
#define KVC_VERSION (KVC_VERSION_MAJOR * 10000 + KVC_VERSION_MINOR * 100 + KVC_VERSION_PATCH)

namespace kvc {
// kvc's major version (KVC_VERSION_MAJOR).
inline constexpr int version_major = KVC_VERSION_MAJOR;
// kvc's minor version (KVC_VERSION_MINOR).
inline constexpr int version_minor = KVC_VERSION_MINOR;
// kvc's patch version (KVC_VERSION_PATCH).
inline constexpr int version_patch = KVC_VERSION_PATCH;
// kvc's version as text, "major.minor.patch" (KVC_VERSION_STRING).
inline constexpr const char* version_string = KVC_VERSION_STRING;
}  // namespace kvc

// A program built with pkg-config alone (tests/package/pkgconfig_test.cmake): one layer's update
// through a DynamicCache, and the version it was built against.
#include <cstdio>
#include <cstring>

#include <kvc/kvc.hpp>

int main(int argc, char** argv) {
  kvc::DynamicCache<float> cache;
  const kvc::HostTensor<float> k(1, 2, 3, 4), v(1, 2, 3, 4);
  (void)cache.update(k, v, 0);
  if (cache.get_seq_length(0) != 3) return 1;
  if (argc > 1 && std::strcmp(argv[1], KVC_VERSION_STRING) != 0) {
    std::printf("kvc.pc consumer: built against kvc %s, expected %s\n", KVC_VERSION_STRING, argv[1]);
    return 1;
  }
  std::printf("kvc.pc consumer: kvc %s, 3 tokens cached\n", kvc::version_string);
  return 0;
}

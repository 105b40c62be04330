// Package smoke test of the cuda component (find_package(kvc COMPONENTS cuda), kvc::cuda): builds
// with nvcc against the installed headers; runs a device cache where there is a GPU, and otherwise
// exits 77 (CTest: skipped).
#include <kvc/cuda.hpp>

#include <algorithm>
#include <cstdio>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  kvc::DynamicCache<float, kvc::CudaStorage<float>> cache;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  std::fill_n(k.data(), k.size(), 1.5f);
  const kvc::DeviceTensor<float> dk = kvc::to_device(k);
  auto kv = cache.update(dk, dk, 0);
  const kvc::HostTensor<float> back = kvc::to_host(kv.keys);
  const bool same = std::equal(back.data(), back.data() + back.size(), k.data());
  return (same && kv.keys.extent(2) == 3 && cache.get_seq_length(0) == 3) ? 0 : 1;
}

#pragma once
// The quantized tensor of kvc::QuantizedLayer over kvc::CudaStorage (kvc::detail, needs nvcc):
// the same layout, codes and numbers as the host's detail::quantized_tensor
// (<kvc/policies/quantization/codecs.hpp>), computed by kernels from the same KVC_HOST_DEVICE
// arithmetic. Three kernels, each a grid-stride loop over a per-item step of codecs.hpp:
//   - fit (fit_group_at): one thread per group fits it (QuantoCodec's min/max, HqqCodec's
//     iterations), stores its scale and offset and writes one unpacked code byte per element to
//     a scratch buffer;
//   - pack (packed_byte_at): one thread per output byte gathers the codes whose bits fall in it
//     (a byte can hold bits of several groups, so packing waits for every group's codes);
//   - dequantize (decode_run_at, decode_at): one thread per 16 output bytes (one per element
//     where the output is not 16-byte aligned) reads the codes and their groups' metadata; the
//     16-byte kernel is instantiated for head_dim 128 at compile time, and for any.
// Every launch and copy is queued on Stream, like the storage's own work; the scratch buffer is
// allocated and freed in stream order (cudaMallocAsync / cudaFreeAsync, where the device has
// memory pools), so encoding does not synchronise the device.
//
// Bit-identity with the host codec holds under nvcc's default float flags (IEEE division, no
// flush to zero; --use_fast_math changes both and powf) and a host compiler that does not fuse
// a * b + c (x86-64 without -march flags does not; GCC with FMA targets does unless given
// -ffp-contract=off). The conversions to and from __half / __nv_bfloat16 are the CUDA conversion
// functions (float_conversion in detail/element_conversion.hpp), so builds with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__ (PyTorch extensions) compile and
// give the same bits.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <cuda_runtime.h>

#include <kvc/detail/cuda_kernels.cuh>
#include <kvc/detail/cuda_runtime.cuh>
#include <kvc/errors.hpp>
#include <kvc/policies/quantization/codecs.hpp>

namespace kvc::detail {

// Launch shape for one thread per item: 256-thread blocks, a capped grid, grid-stride loops.
inline unsigned quant_blocks(std::int64_t items) noexcept {
  return static_cast<unsigned>(std::clamp<std::int64_t>((items + 255) / 256, 1, 65535));
}

// Grid-stride loops over the per-item steps of codecs.hpp (fit_group_at, packed_byte_at,
// decode_at).
template <class Codec, class T, class M>
__global__ void quant_fit_kernel(const T* __restrict__ src, std::int64_t stride_b, std::int64_t stride_h,
                                 quant_layout l, M* __restrict__ scale, M* __restrict__ offset,
                                 std::uint8_t* __restrict__ codes) {
  const std::int64_t total = l.blocks() * l.groups;
  for (std::int64_t m = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; m < total;
       m += std::int64_t{gridDim.x} * blockDim.x)
    fit_group_at<Codec>(m, src, stride_b, stride_h, l, scale, offset, codes);
}

template <int = 0>
__global__ void quant_pack_kernel(const std::uint8_t* __restrict__ codes, quant_layout l,
                                  std::uint8_t* __restrict__ out) {
  const std::int64_t total = l.blocks() * l.block_bytes;
  for (std::int64_t t = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total;
       t += std::int64_t{gridDim.x} * blockDim.x)
    out[t] = packed_byte_at(t, codes, l);
}

template <class T, class M>
__global__ void quant_decode_kernel(T* __restrict__ dst, std::int64_t stride_b, std::int64_t stride_h, quant_layout l,
                                    const std::uint8_t* __restrict__ codes, const M* __restrict__ scale,
                                    const M* __restrict__ offset) {
  const std::int64_t total = l.blocks() * l.elements();
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t{gridDim.x} * blockDim.x)
    decode_at(e, dst, stride_b, stride_h, l, codes, scale, offset);
}

// The same with V = 16 / sizeof(T) elements per thread and one 16-byte store: for outputs whose
// rows, strides and base are 16-byte aligned (the layer's workspace is when a head_dim row fills whole
// 16-byte words: 128 halves or floats, not 4). Dim: head_dim at compile time (decode_run_at), 0 for
// any.
template <std::int64_t Dim, class T, class M>
__global__ void quant_decode_vec_kernel(T* __restrict__ dst, std::int64_t stride_b, std::int64_t stride_h,
                                        quant_layout l, const std::uint8_t* __restrict__ codes,
                                        const M* __restrict__ scale, const M* __restrict__ offset) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const std::int64_t n = l.tokens * (Dim > 0 ? Dim : l.dim), total = l.blocks() * n / V;
  for (std::int64_t r = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < total;
       r += std::int64_t{gridDim.x} * blockDim.x) {
    union {
      uint4 word;
      T elements[V];
    } out;
    const std::int64_t e = r * V, blk = e / n;
    decode_run_at<V, Dim>(e, out.elements, l, codes, scale, offset);
    *reinterpret_cast<uint4*>(dst + (blk / l.heads) * stride_b + (blk % l.heads) * stride_h + e % n) = out.word;
  }
}

// One quantized K or V tensor in device memory: the host quantized_tensor's layout and numbers.
template <class M, class Stream>
class device_quantized_tensor {
 public:
  device_quantized_tensor() = default;

  // As quantized_tensor::encode, with src in device memory (T: float, __half or __nv_bfloat16).
  template <class Codec, class T>
  static device_quantized_tensor encode(int nbits, quant_grouping grouping, std::int64_t group_size, const T* src,
                                        std::int64_t batch, std::int64_t heads, std::int64_t tokens, std::int64_t dim,
                                        std::int64_t stride_b, std::int64_t stride_h) {
    device_quantized_tensor out(quant_layout(nbits, grouping, group_size, batch, heads, tokens, dim));
    const quant_layout& l = out.layout_;
    if (l.blocks() * l.elements() == 0) return out;
    const cudaStream_t stream = Stream::get();  // once: the scratch is freed on the stream that used it
    stream_scratch codes(static_cast<std::size_t>(checked_elements({l.blocks(), l.elements()}, 1)), stream);
    auto* unpacked = static_cast<std::uint8_t*>(codes.get());
    quant_fit_kernel<Codec><<<quant_blocks(l.blocks() * l.groups), 256, 0, stream>>>(
        src, stride_b, stride_h, l, out.scale_.data(), out.offset_.data(), unpacked);
    cuda_check(cudaGetLastError(), "launching kvc's quantization kernel");
    quant_pack_kernel<><<<quant_blocks(l.blocks() * l.block_bytes), 256, 0, stream>>>(unpacked, l, out.codes_.data());
    cuda_check(cudaGetLastError(), "launching kvc's code packing kernel");
    return out;
  }

  // As quantized_tensor::decode, with dst in device memory.
  template <class T>
  void decode(T* dst, std::int64_t stride_b, std::int64_t stride_h) const {
    const std::int64_t total = layout_.blocks() * layout_.elements();
    if (total == 0) return;
    if (vectorisable(dst, stride_b, stride_h))  // head_dim 128 (the benchmarked one) at compile time
      return layout_.dim == 128 ? decode_vec<128>(dst, stride_b, stride_h) : decode_vec<0>(dst, stride_b, stride_h);
    quant_decode_kernel<<<quant_blocks(total), 256, 0, Stream::get()>>>(dst, stride_b, stride_h, layout_, codes_.data(),
                                                                        scale_.data(), offset_.data());
    cuda_check(cudaGetLastError(), "launching kvc's dequantization kernel");
  }

  // Whether the 16-byte kernel can write dst: aligned base, strides and rows of whole 16-byte words.
  template <class T>
  bool vectorisable(const T* dst, std::int64_t stride_b, std::int64_t stride_h) const noexcept {
    constexpr std::int64_t V = 16 / sizeof(T);
    return vector_aligned(dst) && layout_.elements() % V == 0 && stride_b % V == 0 && stride_h % V == 0;
  }

  // The vectorised dequantization with head_dim Dim at compile time (0: any). Public for the
  // benchmark that compares the two, so it checks its preconditions itself.
  template <std::int64_t Dim, class T>
  void decode_vec(T* dst, std::int64_t stride_b, std::int64_t stride_h) const {
    constexpr std::int64_t V = 16 / sizeof(T);
    if ((Dim > 0 && layout_.dim != Dim) || !vectorisable(dst, stride_b, stride_h))
      throw AssertionError(
          "kvc: the 16-byte dequantization kernel needs a 16-byte aligned output, strides and rows of "
          "whole 16-byte words, and its compile-time head_dim equal to the tensor's");
    quant_decode_vec_kernel<Dim><<<quant_blocks(layout_.blocks() * layout_.elements() / V), 256, 0, Stream::get()>>>(
        dst, stride_b, stride_h, layout_, codes_.data(), scale_.data(), offset_.data());
    cuda_check(cudaGetLastError(), "launching kvc's dequantization kernel");
  }

  // As quantized_tensor::gathered: packed bytes and metadata copied as they are.
  device_quantized_tensor gathered(std::span<const std::int64_t> indices) const {
    device_quantized_tensor out(layout_.with_batch(static_cast<std::int64_t>(indices.size())));
    const auto cb = static_cast<std::size_t>(layout_.heads * layout_.block_bytes);
    const auto mb = sizeof(M) * static_cast<std::size_t>(layout_.heads * layout_.groups);
    for (std::size_t i = 0; i < indices.size(); ++i) {
      const auto from = static_cast<std::size_t>(indices[i]);
      copy_rows_bytes(out.codes_.data() + i * cb, cb, codes_.data() + from * cb, cb, cb, 1, Stream::get());
      copy_rows_bytes(reinterpret_cast<unsigned char*>(out.scale_.data()) + i * mb, mb,
                      reinterpret_cast<const unsigned char*>(scale_.data()) + from * mb, mb, mb, 1, Stream::get());
      copy_rows_bytes(reinterpret_cast<unsigned char*>(out.offset_.data()) + i * mb, mb,
                      reinterpret_cast<const unsigned char*>(offset_.data()) + from * mb, mb, mb, 1, Stream::get());
    }
    return out;
  }

  std::int64_t tokens() const noexcept { return layout_.tokens; }
  std::int64_t bytes() const noexcept {
    return static_cast<std::int64_t>(codes_.bytes() + scale_.bytes() + offset_.bytes());
  }
  std::int64_t code_bytes() const noexcept { return codes_.size(); }
  std::int64_t groups_per_block() const noexcept { return layout_.groups; }

 private:
  explicit device_quantized_tensor(const quant_layout& layout)
      : layout_(layout),
        codes_(checked_elements({layout.blocks(), layout.block_bytes}, 1)),
        scale_(checked_elements({layout.blocks(), layout.groups}, sizeof(M))),
        offset_(checked_elements({layout.blocks(), layout.groups}, sizeof(M))) {}

  quant_layout layout_;
  device_buffer<std::uint8_t, Stream> codes_;
  device_buffer<M, Stream> scale_, offset_;
};

}  // namespace kvc::detail

// CUDA kernels of the 2-bit codec (see two_bit.h for the format, two_bit_gpu.h
// for the API). One thread owns one output byte, i.e. four consecutive
// elements, so a warp reads 512 contiguous bytes of gradient and of residual
// with float4 loads and writes 32 contiguous packed bytes.
//
// A thread's arithmetic is in two_bit_kernels.h, shared with the CPU codec and
// run by host tests; the kernels here only load, store and launch.
// Bit-identity with the CPU: see two_bit_kernels.h; the target is also built
// with --fmad=false and without -ftz.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_gpu.h"
#include "common/compression/two_bit_kernels.h"
#include "common/gpu/cuda/cuda_check.h"

namespace tessera::compression {
namespace {

constexpr int kThreadsPerBlock = 256;

cudaStream_t AsStream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

absl::Status CheckThreshold(float threshold) {
  if (!(threshold > 0.0f) || !std::isfinite(threshold)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "2-bit compression threshold must be finite and > 0, got ", threshold));
  }
  return absl::OkStatus();
}

int BlocksFor(size_t threads) {
  // Grid-stride loops cover whatever the cap leaves out.
  const size_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<int>(
      std::min<size_t>(std::max<size_t>(blocks, 1), 1u << 20));
}

// Thread b writes out byte b (kernels::QuantizePayloadByte); kVector loads and
// stores whole bytes' elements as float4 (the pointers are 16-byte aligned).
template <bool kVector>
__global__ void QuantizeKernel(const float* __restrict__ grad,
                               float* __restrict__ residual, size_t len,
                               size_t out_bytes, float t,
                               uint8_t* __restrict__ out) {
  const float neg_t = -t;
  for (size_t b = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       b < out_bytes; b += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if (kVector && kernels::ElementsInByte(b, len) == 4) {
      const float4 g4 = reinterpret_cast<const float4*>(grad)[b];
      const float4 r4 = reinterpret_cast<const float4*>(residual)[b];
      const float g[4] = {g4.x, g4.y, g4.z, g4.w};
      float r[4] = {r4.x, r4.y, r4.z, r4.w};
      out[b] = static_cast<uint8_t>(kernels::QuantizeByte(g, r, 4, t, neg_t));
      reinterpret_cast<float4*>(residual)[b] =
          make_float4(r[0], r[1], r[2], r[3]);
    } else {
      out[b] = kernels::QuantizePayloadByte(grad, residual, len, b, t, neg_t);
    }
  }
}

// Thread b reads in byte b and writes its (up to) four elements
// (kernels::DequantizePayloadByte); it reports a code 0b01 or a set bit in a
// padding slot through *flags.
template <bool kVector>
__global__ void DequantizeKernel(const uint8_t* __restrict__ in, size_t len,
                                 size_t in_bytes, float t,
                                 float* __restrict__ out,
                                 unsigned* __restrict__ flags) {
  const float neg_t = -t;
  for (size_t b = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       b < in_bytes; b += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t bad;
    if (kVector && kernels::ElementsInByte(b, len) == 4) {
      const uint32_t byte = in[b];
      float v[4];
      kernels::DequantizeByte(byte, 4, t, neg_t, v);
      reinterpret_cast<float4*>(out)[b] = make_float4(v[0], v[1], v[2], v[3]);
      bad = kernels::CheckByte(byte, 4);
    } else {
      bad = kernels::DequantizePayloadByte(in, len, b, t, neg_t, out);
    }
    if (bad != 0) atomicOr(flags, bad);
  }
}

}  // namespace

absl::Status TwoBitQuantizeDevice(const float* d_grad, float* d_residual,
                                  size_t len, float threshold, uint8_t* d_out,
                                  void* stream) {
  if (absl::Status s = CheckThreshold(threshold); !s.ok()) return s;
  if (len == 0) return absl::OkStatus();
  if (d_grad == nullptr || d_residual == nullptr || d_out == nullptr) {
    return absl::InvalidArgumentError(
        "2-bit quantize (GPU): null grad, residual or output pointer with len "
        "> 0");
  }
  const size_t out_bytes = TwoBitCompressedBytes(len);
  const int blocks = BlocksFor(out_bytes);
  if (Aligned16(d_grad) && Aligned16(d_residual)) {
    QuantizeKernel<true><<<blocks, kThreadsPerBlock, 0, AsStream(stream)>>>(
        d_grad, d_residual, len, out_bytes, threshold, d_out);
  } else {
    QuantizeKernel<false><<<blocks, kThreadsPerBlock, 0, AsStream(stream)>>>(
        d_grad, d_residual, len, out_bytes, threshold, d_out);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status TwoBitDequantizeDevice(const uint8_t* d_in, size_t len,
                                    float threshold, float* d_out,
                                    void* stream) {
  if (absl::Status s = CheckThreshold(threshold); !s.ok()) return s;
  if (len == 0) return absl::OkStatus();
  if (d_in == nullptr || d_out == nullptr) {
    return absl::InvalidArgumentError(
        "2-bit dequantize (GPU): null input or output pointer with len > 0");
  }
  cudaStream_t s = AsStream(stream);
  const size_t in_bytes = TwoBitCompressedBytes(len);
  unsigned* d_flags = nullptr;
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&d_flags), sizeof(unsigned), s));
  unsigned flags = 0;
  cudaError_t err = cudaMemsetAsync(d_flags, 0, sizeof(unsigned), s);
  if (err == cudaSuccess) {
    const int blocks = BlocksFor(in_bytes);
    if (Aligned16(d_out)) {
      DequantizeKernel<true><<<blocks, kThreadsPerBlock, 0, s>>>(
          d_in, len, in_bytes, threshold, d_out, d_flags);
    } else {
      DequantizeKernel<false><<<blocks, kThreadsPerBlock, 0, s>>>(
          d_in, len, in_bytes, threshold, d_out, d_flags);
    }
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(&flags, d_flags, sizeof(unsigned),
                          cudaMemcpyDeviceToHost, s);
  }
  const cudaError_t free_err = cudaFreeAsync(d_flags, s);
  const cudaError_t sync_err = cudaStreamSynchronize(s);
  TESSERA_CUDA_RETURN_IF_ERROR(err);
  TESSERA_CUDA_RETURN_IF_ERROR(free_err);
  TESSERA_CUDA_RETURN_IF_ERROR(sync_err);
  if (flags & kernels::kBadPaddingFlag) {
    return absl::DataLossError(absl::StrCat(
        "2-bit payload (GPU) has codes in the wrong place: padding bits past "
        "element ",
        len, " are set"));
  }
  if (flags & kernels::kBadCodeFlag) {
    return absl::DataLossError(
        "2-bit payload (GPU) holds the invalid code 0b01");
  }
  return absl::OkStatus();
}

}  // namespace tessera::compression

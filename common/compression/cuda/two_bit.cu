// CUDA kernels of the 2-bit codec (see two_bit.h for the format, two_bit_gpu.h
// for the API). One thread owns one output byte, i.e. four consecutive
// elements, so a warp reads 512 contiguous bytes of gradient and of residual
// with float4 loads and writes 32 contiguous packed bytes.
//
// Bit-identity with the CPU: each element sees exactly one rounded add (r + g)
// and one rounded subtract (r - taken, taken in {t, -t, 0}), written with
// __fadd_rn/__fsub_rn so nvcc can neither contract nor reassociate them (the
// target is also built with
// --fmad=false). Denormals are kept (no -ftz), as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_gpu.h"

namespace tessera::compression {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr unsigned kBadCodeFlag = 1u;
constexpr unsigned kBadPaddingFlag = 2u;

#define TESSERA_CUDA_RETURN_IF_ERROR(expr)                            \
  do {                                                                \
    const cudaError_t tessera_cuda_err = (expr);                      \
    if (tessera_cuda_err != cudaSuccess) {                            \
      return absl::InternalError(absl::StrCat(                        \
          #expr, " failed: ", cudaGetErrorString(tessera_cuda_err))); \
    }                                                                 \
  } while (0)

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

// Codes one element; the same operations as QuantizeWord in two_bit.cc.
__device__ __forceinline__ unsigned CodeOne(float g, float& r, float t,
                                            float neg_t) {
  const float v = __fadd_rn(r, g);
  const bool pos = v >= t;
  const bool neg = v <= neg_t;
  const float taken = pos ? t : (neg ? neg_t : 0.0f);
  r = __fsub_rn(v, taken);
  return (pos ? 0b11u : 0u) | (neg ? 0b10u : 0u);
}

// Thread b writes out byte b: elements 4b..4b+3, the first in the two highest
// bits. Bytes whose elements all lie past `len` are padding and get zero.
template <bool kVector>
__global__ void QuantizeKernel(const float* __restrict__ grad,
                               float* __restrict__ residual, size_t len,
                               size_t out_bytes, float t,
                               uint8_t* __restrict__ out) {
  const float neg_t = -t;
  for (size_t b = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       b < out_bytes; b += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t first = 4 * b;
    unsigned byte = 0;
    if (kVector && first + 4 <= len) {
      const float4 g = reinterpret_cast<const float4*>(grad)[b];
      float4 r = reinterpret_cast<float4*>(residual)[b];
      byte = CodeOne(g.x, r.x, t, neg_t) << 6 |
             CodeOne(g.y, r.y, t, neg_t) << 4 |
             CodeOne(g.z, r.z, t, neg_t) << 2 | CodeOne(g.w, r.w, t, neg_t);
      reinterpret_cast<float4*>(residual)[b] = r;
    } else {
      for (size_t i = first; i < first + 4 && i < len; ++i) {
        float r = residual[i];
        byte |= CodeOne(grad[i], r, t, neg_t) << (6 - 2 * (i - first));
        residual[i] = r;
      }
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}

__device__ __forceinline__ float DecodeOne(unsigned code, float t) {
  return code == 0b11u ? t : (code == 0b10u ? -t : 0.0f);
}

// Thread b reads in byte b and writes its (up to) four elements; it reports a
// code 0b01 or a set bit in a padding slot through *flags.
template <bool kVector>
__global__ void DequantizeKernel(const uint8_t* __restrict__ in, size_t len,
                                 size_t in_bytes, float t,
                                 float* __restrict__ out,
                                 unsigned* __restrict__ flags) {
  for (size_t b = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       b < in_bytes; b += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const unsigned byte = in[b];
    const size_t first = 4 * b;
    const size_t valid = first >= len ? 0 : (len - first < 4 ? len - first : 4);
    // Mask of the bits that belong to elements below len.
    const unsigned used = valid == 0 ? 0u : (0xffu << (8 - 2 * valid)) & 0xffu;
    unsigned bad = 0;
    if (byte & ~used) bad |= kBadPaddingFlag;
    const unsigned low = byte & used & 0x55u;
    if (low & ~(byte >> 1)) bad |= kBadCodeFlag;
    if (bad != 0) atomicOr(flags, bad);
    if (kVector && valid == 4) {
      reinterpret_cast<float4*>(out)[b] =
          make_float4(DecodeOne(byte >> 6, t), DecodeOne((byte >> 4) & 3u, t),
                      DecodeOne((byte >> 2) & 3u, t), DecodeOne(byte & 3u, t));
    } else {
      for (size_t k = 0; k < valid; ++k) {
        out[first + k] = DecodeOne((byte >> (6 - 2 * k)) & 3u, t);
      }
    }
  }
}

// Fills `n` floats with a reproducible spread of values in [-1.5, 1.5).
__global__ void FillKernel(float* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
    h ^= h >> 16;
    h *= 2246822519u;
    h ^= h >> 13;
    out[i] = (static_cast<float>(h >> 8) / 16777216.0f) * 3.0f - 1.5f;
  }
}

}  // namespace

bool CudaDeviceAvailable() {
  static const bool available = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // Clear the sticky-free error for later calls.
      return false;
    }
    return count > 0;
  }();
  return available;
}

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
  if (flags & kBadPaddingFlag) {
    return absl::DataLossError(absl::StrCat(
        "2-bit payload (GPU) has codes in the wrong place: padding bits past "
        "element ",
        len, " are set"));
  }
  if (flags & kBadCodeFlag) {
    return absl::DataLossError(
        "2-bit payload (GPU) holds the invalid code 0b01");
  }
  return absl::OkStatus();
}

namespace {

// Device buffers freed on every path out of RunGpuCodecBench.
class DeviceBuffers {
 public:
  ~DeviceBuffers() {
    for (void* p : device_) cudaFree(p);
    for (void* p : host_) cudaFreeHost(p);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  template <typename T>
  absl::Status Device(T** p, size_t bytes) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(p), bytes));
    device_.push_back(*p);
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Pinned(T** p, size_t bytes) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(p), bytes));
    host_.push_back(*p);
    return absl::OkStatus();
  }
  absl::Status Event(cudaEvent_t* e) {
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreate(e));
    events_.push_back(*e);
    return absl::OkStatus();
  }

 private:
  std::vector<void*> device_;
  std::vector<void*> host_;
  std::vector<cudaEvent_t> events_;
};

// Milliseconds per call of `op` on the default stream: one warm-up, then the
// mean of `reps` back-to-back calls timed with events.
template <typename Op>
absl::StatusOr<double> TimeOnStream(cudaEvent_t start, cudaEvent_t stop,
                                    int reps, Op op) {
  if (absl::Status s = op(); !s.ok()) return s;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, nullptr));
  for (int i = 0; i < reps; ++i) {
    if (absl::Status s = op(); !s.ok()) return s;
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, nullptr));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
  return static_cast<double>(ms) / reps;
}

// Best wall-clock milliseconds of `reps` runs of `op`, each ending in a full
// sync.
template <typename Op>
absl::StatusOr<double> BestWallMs(int reps, Op op) {
  double best = 1e300;
  for (int i = 0; i < reps + 1; ++i) {
    const auto begin = std::chrono::steady_clock::now();
    if (absl::Status s = op(); !s.ok()) return s;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - begin)
                          .count();
    if (i > 0) best = std::min(best, ms);  // Run 0 is the warm-up.
  }
  return best;
}

}  // namespace

absl::StatusOr<GpuCodecBenchResult> RunGpuCodecBench(size_t bytes) {
  if (!CudaDeviceAvailable()) {
    return absl::FailedPreconditionError("no CUDA device available");
  }
  const size_t len = bytes / sizeof(float);
  if (len == 0) return absl::InvalidArgumentError("bench size below one float");
  const size_t float_bytes = len * sizeof(float);
  const size_t packed_bytes = TwoBitCompressedBytes(len);
  constexpr float kThreshold = 0.5f;

  GpuCodecBenchResult result;
  result.bytes = float_bytes;
  int device = 0;
  cudaDeviceProp prop{};
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  result.device_name = prop.name;

  DeviceBuffers buffers;
  float* d_grad = nullptr;
  float* d_residual = nullptr;
  float* d_decoded = nullptr;
  uint8_t* d_packed = nullptr;
  float* h_floats = nullptr;
  uint8_t* h_packed = nullptr;
  cudaEvent_t start{}, stop{};
  for (absl::Status s : {buffers.Device(&d_grad, float_bytes),
                         buffers.Device(&d_residual, float_bytes),
                         buffers.Device(&d_decoded, float_bytes),
                         buffers.Device(&d_packed, packed_bytes),
                         buffers.Pinned(&h_floats, float_bytes),
                         buffers.Pinned(&h_packed, packed_bytes),
                         buffers.Event(&start), buffers.Event(&stop)}) {
    if (!s.ok()) return s;
  }
  FillKernel<<<BlocksFor(len), kThreadsPerBlock>>>(d_grad, len);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemset(d_residual, 0, float_bytes));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());

  const int reps = float_bytes >= (64u << 20) ? 10 : 50;
  const double seconds_per_gb = 1e-3 / (static_cast<double>(float_bytes) / 1e9);

  absl::StatusOr<double> quantize_ms = TimeOnStream(start, stop, reps, [&] {
    return TwoBitQuantizeDevice(d_grad, d_residual, len, kThreshold, d_packed,
                                nullptr);
  });
  if (!quantize_ms.ok()) return quantize_ms.status();
  result.quantize_gbps = 1.0 / (*quantize_ms * seconds_per_gb);

  absl::StatusOr<double> dequantize_ms = TimeOnStream(start, stop, reps, [&] {
    return TwoBitDequantizeDevice(d_packed, len, kThreshold, d_decoded,
                                  nullptr);
  });
  if (!dequantize_ms.ok()) return dequantize_ms.status();
  result.dequantize_gbps = 1.0 / (*dequantize_ms * seconds_per_gb);

  absl::StatusOr<double> d2d_ms =
      TimeOnStream(start, stop, reps, [&]() -> absl::Status {
        TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            d_decoded, d_grad, float_bytes, cudaMemcpyDeviceToDevice, nullptr));
        return absl::OkStatus();
      });
  if (!d2d_ms.ok()) return d2d_ms.status();
  result.d2d_memcpy_gbps = 1.0 / (*d2d_ms * seconds_per_gb);

  absl::StatusOr<double> d2h_float_ms = BestWallMs(5, [&]() -> absl::Status {
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        h_floats, d_grad, float_bytes, cudaMemcpyDeviceToHost, nullptr));
    return absl::OkStatus();
  });
  if (!d2h_float_ms.ok()) return d2h_float_ms.status();
  result.d2h_float_ms = *d2h_float_ms;

  absl::StatusOr<double> d2h_compressed_ms =
      BestWallMs(5, [&]() -> absl::Status {
        if (absl::Status s = TwoBitQuantizeDevice(
                d_grad, d_residual, len, kThreshold, d_packed, nullptr);
            !s.ok()) {
          return s;
        }
        TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            h_packed, d_packed, packed_bytes, cudaMemcpyDeviceToHost, nullptr));
        return absl::OkStatus();
      });
  if (!d2h_compressed_ms.ok()) return d2h_compressed_ms.status();
  result.d2h_compressed_ms = *d2h_compressed_ms;
  return result;
}

}  // namespace tessera::compression

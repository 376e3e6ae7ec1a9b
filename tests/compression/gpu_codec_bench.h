// The GPU half of tessera-codec-bench (codec_bench.cc): times the 2-bit
// kernels (common/compression/two_bit_gpu.h) against a device-to-device copy,
// and the transfer of a gradient to the host with and without compression.
// Benchmark code: it lives with the benchmark, not in tessera::compression.
// gpu_codec_bench.cu with CUDA, gpu_codec_bench_stub.cc without.
//
//   if (gpu::DeviceAvailable()) {
//     absl::StatusOr<GpuCodecBenchResult> r = RunGpuCodecBench(64 << 20);
//     if (r.ok()) printf("%.1f GB/s\n", r->quantize_gbps);
//   }
#ifndef TESSERA_TESTS_COMPRESSION_GPU_CODEC_BENCH_H_
#define TESSERA_TESTS_COMPRESSION_GPU_CODEC_BENCH_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::compression {

// Figures from RunGpuCodecBench, all measured in the same run on the current
// device.
struct GpuCodecBenchResult {
  size_t bytes = 0;            // Float input size of the codec runs.
  double quantize_gbps = 0;    // Float input bytes per second / 1e9.
  double dequantize_gbps = 0;  // Float output bytes per second / 1e9.
  double d2d_memcpy_gbps = 0;  // cudaMemcpy device-to-device of `bytes`.
  // Moving `bytes` of gradient from the GPU to pinned host memory.
  double d2h_float_ms = 0;       // Plain D2H copy of the floats.
  double d2h_compressed_ms = 0;  // Quantize on the GPU, then D2H of the packed
                                 // bytes.
  std::string device_name;       // As the CUDA runtime names it.
};

// Times the kernels on `bytes` of float input (rounded down to whole floats)
// against device-to-device memcpy, and the D2H transfer of the same gradient
// with and without compression. Allocates and frees its own buffers. Errors:
// FailedPrecondition without CUDA or without a device; InvalidArgument below
// one float; Internal for CUDA errors.
absl::StatusOr<GpuCodecBenchResult> RunGpuCodecBench(size_t bytes);

}  // namespace tessera::compression

#endif  // TESSERA_TESTS_COMPRESSION_GPU_CODEC_BENCH_H_

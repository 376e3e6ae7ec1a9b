// 2-bit gradient compression on the GPU: the same format and the same bits as
// the CPU codec in two_bit.h, for gradients and residuals that live in device
// memory.
//
// This header names no CUDA type, so callers build without the CUDA toolkit.
// Without CUDA (TESSERA_ENABLE_CUDA=OFF) the functions exist and return
// FailedPrecondition "built without CUDA", and gpu::DeviceAvailable()
// (common/gpu/device.h) returns false. The kernels' arithmetic is in
// two_bit_kernels.h.
//
// Example (worker, residual kept on the GPU next to the gradient):
//
//   if (gpu::DeviceAvailable()) {
//     // d_grad, d_residual: len floats; d_packed: TwoBitCompressedBytes(len) bytes.
//     absl::Status s = TwoBitQuantizeDevice(d_grad, d_residual, len, 0.5f, d_packed,
//                                           /*stream=*/nullptr);
//     // ...then copy d_packed to the host and push it.
//   }
//
// Streams: `stream` is a cudaStream_t passed as void*; nullptr means the
// default stream. Thread-safety: no shared state; calls on different arrays may
// run concurrently.
#ifndef TESSERA_COMMON_COMPRESSION_TWO_BIT_GPU_H_
#define TESSERA_COMMON_COMPRESSION_TWO_BIT_GPU_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace tessera::compression {

// GPU version of TwoBitQuantize: residual (device, len floats, in/out) += grad,
// codes it and writes TwoBitCompressedBytes(len) bytes to d_out (device).
// Bit-identical to the CPU codec, residual included (a NaN residual is NaN on
// both, its payload may differ; see two_bit_kernels.h). Asynchronous: the work
// is queued on `stream`; read d_out or d_residual only after synchronising
// with it. REQUIRES: device pointers of the current device; d_out does not
// overlap the others. Errors: InvalidArgument for a threshold <= 0 or not
// finite, or a null pointer with len > 0; Internal if the kernel launch fails;
// FailedPrecondition without CUDA.
absl::Status TwoBitQuantizeDevice(const float* d_grad, float* d_residual,
                                  size_t len, float threshold, uint8_t* d_out,
                                  void* stream);

// GPU version of TwoBitDequantize: decodes TwoBitCompressedBytes(len) bytes at
// d_in into len floats at d_out (both device memory). It validates like the CPU
// codec, so it waits for `stream` to finish before returning (to read the
// verdict back). Errors: InvalidArgument (threshold, null pointers); DataLoss
// if a code 0b01 appears or a padding bit past len is set (d_out then holds
// unspecified values); Internal for a CUDA error; FailedPrecondition without
// CUDA.
absl::Status TwoBitDequantizeDevice(const uint8_t* d_in, size_t len,
                                    float threshold, float* d_out,
                                    void* stream);

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_TWO_BIT_GPU_H_

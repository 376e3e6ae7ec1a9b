// DeviceCopy: the few CUDA runtime calls the KV client needs for gradients that
// live in GPU memory, behind a header that names no CUDA type (so the client
// builds without CUDA; the stub reports that no device is present).
// DeviceAvailable() is the project's one availability check, from
// common/gpu/device.h.
//
//   if (gpu::DeviceAvailable()) {
//     absl::StatusOr<void*> d = gpu::DeviceAlloc(bytes);
//     gpu::CopyDeviceToHost(host, *d, bytes, stream);   // waits for the stream
//   }
#ifndef TESSERA_WORKER_CLIENT_DEVICE_COPY_H_
#define TESSERA_WORKER_CLIENT_DEVICE_COPY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/gpu/device.h"

namespace tessera::gpu {

// Zeroed device memory.
absl::StatusOr<void*> DeviceAlloc(size_t bytes);
void DeviceFree(void* ptr);
// Page-locked host memory, for fast asynchronous copies.
absl::StatusOr<void*> PinnedAlloc(size_t bytes);
void PinnedFree(void* ptr);
// Copies on `stream` (a cudaStream_t or nullptr) and waits for the stream to
// finish.
absl::Status CopyDeviceToHost(void* host, const void* device, size_t bytes,
                              void* stream);

}  // namespace tessera::gpu

#endif  // TESSERA_WORKER_CLIENT_DEVICE_COPY_H_

// The KV client's CUDA runtime calls (see worker/client/device_copy.h).
#include <cuda_runtime.h>

#include "common/gpu/cuda/cuda_check.h"
#include "worker/client/device_copy.h"

namespace tessera::gpu {

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* ptr = nullptr;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes));
  const cudaError_t err = cudaMemset(ptr, 0, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    return CudaErrorStatus("cudaMemset", err);
  }
  return ptr;
}

void DeviceFree(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

absl::StatusOr<void*> PinnedAlloc(size_t bytes) {
  void* ptr = nullptr;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr, bytes == 0 ? 1 : bytes));
  return ptr;
}

void PinnedFree(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

absl::Status CopyDeviceToHost(void* host, const void* device, size_t bytes,
                              void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

}  // namespace tessera::gpu

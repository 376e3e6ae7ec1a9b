#include <cuda_runtime.h>

#include <string>

#include "worker/client/device_copy.h"

namespace tessera::gpu {
namespace {
absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(std::string(what) + ": " +
                             cudaGetErrorString(err));
}
}  // namespace

bool DeviceAvailable() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) return CudaError("cudaMalloc", err);
  err = cudaMemset(ptr, 0, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    return CudaError("cudaMemset", err);
  }
  return ptr;
}

void DeviceFree(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

absl::StatusOr<void*> PinnedAlloc(size_t bytes) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocHost(&ptr, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) return CudaError("cudaMallocHost", err);
  return ptr;
}

void PinnedFree(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

absl::Status CopyDeviceToHost(void* host, const void* device, size_t bytes,
                              void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err =
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s);
  if (err != cudaSuccess) return CudaError("cudaMemcpyAsync", err);
  err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return CudaError("cudaStreamSynchronize", err);
  return absl::OkStatus();
}

}  // namespace tessera::gpu

// TESSERA_CUDA_RETURN_IF_ERROR: the CUDA error check of every .cu file. For
// .cu files only (it names cudaError_t); the headers those files implement name
// no CUDA type.
//
//   absl::Status Upload(float* d, const float* h, size_t n, cudaStream_t s) {
//     TESSERA_CUDA_RETURN_IF_ERROR(
//         cudaMemcpyAsync(d, h, n * sizeof(float), cudaMemcpyHostToDevice, s));
//     return absl::OkStatus();
//   }
//
// A failing call becomes absl::InternalError("<call> failed: <CUDA error
// name>: <CUDA's description>").
#ifndef TESSERA_COMMON_GPU_CUDA_CUDA_CHECK_H_
#define TESSERA_COMMON_GPU_CUDA_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::gpu {

// The Status TESSERA_CUDA_RETURN_IF_ERROR returns for `err` from `what`; for
// paths that must release something before returning. REQUIRES: err !=
// cudaSuccess.
inline absl::Status CudaErrorStatus(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(
      what, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

}  // namespace tessera::gpu

#define TESSERA_CUDA_RETURN_IF_ERROR(expr)                             \
  do {                                                                 \
    const cudaError_t tessera_cuda_err = (expr);                       \
    if (tessera_cuda_err != cudaSuccess) {                             \
      return ::tessera::gpu::CudaErrorStatus(#expr, tessera_cuda_err); \
    }                                                                  \
  } while (0)

#endif  // TESSERA_COMMON_GPU_CUDA_CUDA_CHECK_H_

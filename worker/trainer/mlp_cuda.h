// The CUDA backend of Mlp (worker/trainer/cuda/mlp_cuda.cu), behind a header
// that names no CUDA type. Builds without CUDA link mlp_cuda_stub.cc instead,
// where CreateCudaMlp fails with FailedPrecondition. Whether a device is there
// is gpu::DeviceAvailable() (common/gpu/device.h); the kernels' arithmetic is
// in mlp_kernels.h.
//
//   if (tessera::gpu::DeviceAvailable()) {
//     auto mlp = tessera::CreateCudaMlp(config, /*max_batch=*/128);
//   }
#ifndef TESSERA_WORKER_TRAINER_MLP_CUDA_H_
#define TESSERA_WORKER_TRAINER_MLP_CUDA_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/trainer/mlp.h"

namespace tessera {

// The CUDA backend on device 0. FailedPrecondition without a device; Internal
// when a CUDA or cuBLAS call fails (the message names the call).
absl::StatusOr<std::unique_ptr<Mlp>> CreateCudaMlp(const MlpConfig& config,
                                                   int max_batch);

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_MLP_CUDA_H_

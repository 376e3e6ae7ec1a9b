// The CUDA backend of Mlp (worker/cuda/mlp_cuda.cu), behind a header that names
// no CUDA type. Builds without CUDA link worker/mlp_cuda_stub.cc instead, where
// CudaAvailable() is false and CreateCudaMlp fails with FailedPrecondition.
//
//   if (tessera::CudaAvailable()) {
//     auto mlp = tessera::CreateCudaMlp(config, /*max_batch=*/128);
//   }
#ifndef TESSERA_WORKER_TRAINER_MLP_CUDA_H_
#define TESSERA_WORKER_TRAINER_MLP_CUDA_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/trainer/mlp.h"

namespace tessera {

// True when this build has CUDA and the runtime reports at least one device.
bool CudaAvailable();

// One line about the CUDA situation, for messages: the device's name, or why
// none.
std::string CudaDescription();

// The CUDA backend on device 0. FailedPrecondition without a device; Internal
// when a CUDA or cuBLAS call fails (the message names the call).
absl::StatusOr<std::unique_ptr<Mlp>> CreateCudaMlp(const MlpConfig& config,
                                                   int max_batch);

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_MLP_CUDA_H_

// Stands in for cuda/mlp_cuda.cu in builds without CUDA.
#include "absl/status/status.h"
#include "worker/trainer/mlp_cuda.h"

namespace tessera {

absl::StatusOr<std::unique_ptr<Mlp>> CreateCudaMlp(const MlpConfig& config,
                                                   int max_batch) {
  return absl::FailedPreconditionError(
      "the CUDA backend is not available: this build has no CUDA support");
}

}  // namespace tessera

// The GPU half of tessera-codec-bench when Tessera is built without CUDA.
#include "absl/status/status.h"
#include "tests/compression/gpu_codec_bench.h"

namespace tessera::compression {

absl::StatusOr<GpuCodecBenchResult> RunGpuCodecBench(size_t) {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace tessera::compression

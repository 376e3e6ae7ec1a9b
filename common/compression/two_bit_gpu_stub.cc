// The GPU codec when Tessera is built without CUDA: every call says so.
#include "common/compression/two_bit_gpu.h"

namespace tessera::compression {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError("built without CUDA");
}

}  // namespace

absl::Status TwoBitQuantizeDevice(const float*, float*, size_t, float, uint8_t*,
                                  void*) {
  return NoCuda();
}

absl::Status TwoBitDequantizeDevice(const uint8_t*, size_t, float, float*,
                                    void*) {
  return NoCuda();
}

}  // namespace tessera::compression

#include "worker/client/device_push.h"

#include "common/compression/two_bit.h"
#include "common/compression/two_bit_gpu.h"
#include "common/status_macros.h"
#include "worker/client/device_copy.h"

namespace tessera {

DevicePushStager::~DevicePushStager() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, s] : keys_) {
    gpu::DeviceFree(s.device_residual);
    gpu::DeviceFree(s.device_packed);
    gpu::PinnedFree(s.pinned);
  }
}

absl::StatusOr<std::vector<Buffer>> DevicePushStager::Stage(
    uint64_t key, const float* device_grad, size_t len,
    const std::vector<KeyPart>& parts, bool two_bit, float threshold,
    void* stream) {
  if (!gpu::DeviceAvailable()) {
    return absl::FailedPreconditionError(
        "push from GPU memory: no CUDA device available");
  }
  absl::MutexLock lock(&mu_);
  Staging& s = keys_[key];
  const size_t total_bytes =
      two_bit ? compression::TwoBitCompressedBytes(len) + 4 * parts.size()
              : len * sizeof(float);
  if (s.pinned == nullptr) {
    TESSERA_ASSIGN_OR_RETURN(s.pinned, gpu::PinnedAlloc(total_bytes));
    if (two_bit) {
      TESSERA_ASSIGN_OR_RETURN(s.device_residual,
                               gpu::DeviceAlloc(len * sizeof(float)));
      TESSERA_ASSIGN_OR_RETURN(s.device_packed, gpu::DeviceAlloc(total_bytes));
    }
  }
  // Compress each server part on the GPU (the residual stays there), then one
  // copy of everything.
  std::vector<std::pair<size_t, size_t>> spans;  // (offset in pinned, bytes)
  size_t offset = 0;
  for (const KeyPart& part : parts) {
    const size_t bytes = two_bit
                             ? compression::TwoBitCompressedBytes(part.length)
                             : part.length * sizeof(float);
    if (two_bit) {
      TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantizeDevice(
          device_grad + part.offset,
          static_cast<float*>(s.device_residual) + part.offset, part.length,
          threshold, static_cast<uint8_t*>(s.device_packed) + offset, stream));
    }
    spans.emplace_back(offset, bytes);
    offset += bytes;
  }
  const void* source =
      two_bit ? s.device_packed : static_cast<const void*>(device_grad);
  TESSERA_RETURN_IF_ERROR(
      gpu::CopyDeviceToHost(s.pinned, source, offset, stream));
  std::vector<Buffer> payloads;
  for (const auto& [at, bytes] : spans) {
    payloads.push_back(
        Buffer::CopyOf(static_cast<uint8_t*>(s.pinned) + at, bytes));
  }
  return payloads;
}

}  // namespace tessera

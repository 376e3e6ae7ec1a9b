// Built when CUDA is off: there is never a device.
#include "worker/client/device_copy.h"

namespace tessera::gpu {
namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError("this build has no CUDA support");
}
}  // namespace

absl::StatusOr<void*> DeviceAlloc(size_t) { return NoCuda(); }
void DeviceFree(void*) {}
absl::StatusOr<void*> PinnedAlloc(size_t) { return NoCuda(); }
void PinnedFree(void*) {}
absl::Status CopyDeviceToHost(void*, const void*, size_t, void*) {
  return NoCuda();
}

}  // namespace tessera::gpu

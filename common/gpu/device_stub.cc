// Stands in for cuda/device.cu in builds without CUDA: there is never a device.
#include "common/gpu/device.h"

namespace tessera::gpu {

bool DeviceAvailable() { return false; }

std::string DeviceDescription() { return "this build has no CUDA support"; }

}  // namespace tessera::gpu

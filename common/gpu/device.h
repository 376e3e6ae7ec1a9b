// The one answer to "is there a CUDA device?", for every GPU path (the 2-bit
// codec, the KV client's device copies, the CUDA MLP), behind a header that
// names no CUDA type. Builds without CUDA (TESSERA_ENABLE_CUDA=OFF) link
// device_stub.cc, where there is never a device.
//
//   if (tessera::gpu::DeviceAvailable()) {
//     ...use the GPU path...
//   } else {
//     LOG(INFO) << "CPU path: " << tessera::gpu::DeviceDescription();
//   }
//
// Thread-safety: both functions may be called from any thread.
#ifndef TESSERA_COMMON_GPU_DEVICE_H_
#define TESSERA_COMMON_GPU_DEVICE_H_

#include <string>

namespace tessera::gpu {

// True when this build has CUDA and the runtime reports at least one device
// without error. Asked once per process; later calls return the cached answer.
bool DeviceAvailable();

// One line about the CUDA situation, for messages: device 0's name and the
// device count, or why there is no device (no CUDA in this build, or the
// runtime's error).
std::string DeviceDescription();

}  // namespace tessera::gpu

#endif  // TESSERA_COMMON_GPU_DEVICE_H_

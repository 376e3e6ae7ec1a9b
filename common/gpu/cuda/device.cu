// The CUDA availability check (see common/gpu/device.h).
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/gpu/device.h"

namespace tessera::gpu {
namespace {

// cudaGetDeviceCount's verdict, asked once.
struct DeviceCount {
  cudaError_t err = cudaSuccess;
  int count = 0;
};

const DeviceCount& Query() {
  static const DeviceCount query = [] {
    DeviceCount q;
    q.err = cudaGetDeviceCount(&q.count);
    if (q.err != cudaSuccess) {
      q.count = 0;
      (void)cudaGetLastError();  // Not sticky: clear it for later calls.
    }
    return q;
  }();
  return query;
}

}  // namespace

bool DeviceAvailable() { return Query().count > 0; }

std::string DeviceDescription() {
  const DeviceCount& q = Query();
  if (q.err != cudaSuccess) {
    return absl::StrCat("no CUDA device: cudaGetDeviceCount: ",
                        cudaGetErrorString(q.err));
  }
  if (q.count == 0) {
    return "no CUDA device: cudaGetDeviceCount reports 0 devices";
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("CUDA device 0 (", q.count, " device(s))");
  }
  return absl::StrCat("CUDA device 0: ", prop.name, " (", q.count,
                      " device(s))");
}

}  // namespace tessera::gpu

// DevicePushStager: gets a gradient that lives in GPU memory ready to push.
// With 2-bit compression each server part is compressed on the GPU (its
// error-feedback residual stays there) and only the packed bytes cross PCIe;
// without, the floats are copied. Either way the result is one host Buffer per
// part, which the client's one push path sends like any other payload.
//
//   DevicePushStager stager;
//   absl::StatusOr<std::vector<Buffer>> payloads =
//       stager.Stage(key, d_grad, len, parts, /*two_bit=*/true, 0.5f, stream);
//
// Staging buffers (pinned host memory, device residual and packed bytes) are
// allocated per key on first use and freed with the stager.
//
// Thread-safety: Stage calls are serialised (the buffers are shared per key).
#ifndef TESSERA_WORKER_CLIENT_DEVICE_PUSH_H_
#define TESSERA_WORKER_CLIENT_DEVICE_PUSH_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/buffer.h"
#include "worker/client/key_partitioner.h"

namespace tessera {

class DevicePushStager {
 public:
  DevicePushStager() = default;
  DevicePushStager(const DevicePushStager&) = delete;
  DevicePushStager& operator=(const DevicePushStager&) = delete;
  ~DevicePushStager();

  // The payload of each of `parts` (2-bit packed or float32), from `len`
  // floats of device memory at `device_grad`; waits for `stream` (a
  // cudaStream_t or nullptr). FailedPrecondition without a CUDA device;
  // Internal for CUDA errors.
  absl::StatusOr<std::vector<Buffer>> Stage(uint64_t key,
                                            const float* device_grad,
                                            size_t len,
                                            const std::vector<KeyPart>& parts,
                                            bool two_bit, float threshold,
                                            void* stream);

 private:
  struct Staging {
    void* device_residual = nullptr;
    void* device_packed = nullptr;
    void* pinned = nullptr;
  };
  absl::Mutex mu_;
  std::map<uint64_t, Staging> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_DEVICE_PUSH_H_

// PulledCopy: a worker's own copy of one key slice for compressed pulls, and
// how a server's reply brings it forward (see server/pull_shadow.h for the
// server's side). The copy is what the server believes this worker holds,
// bit for bit: a reply carries either the server's shadow whole (float32) or
// the 2-bit codes of the versions since the one this copy is at, each added
// with TwoBitDequantizeAdd as the server added it.
//
//   PulledCopy copy(length);
//   request.header: copy.chain(), copy.version()
//   absl::Status s = copy.Apply(reply);   // DataLoss: nothing applied
//   copy.CopyTo(out);
//
// Replies can arrive in any order when pulls of the same slice overlap: a
// version the copy already has is skipped, so nothing is applied twice.
//
// Thread-safety: all methods are thread-safe.
#ifndef TESSERA_WORKER_CLIENT_PULLED_COPY_H_
#define TESSERA_WORKER_CLIENT_PULLED_COPY_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/message.h"

namespace tessera {

class PulledCopy {
 public:
  explicit PulledCopy(uint64_t length) : length_(length) {}

  // What to put in a compressed pull's header.
  uint64_t chain() const;
  uint64_t version() const;

  // Brings the copy forward with a compressed pull's reply. DataLoss (and the
  // copy left as it was, but marked so that the next pull takes the server's
  // shadow whole) for a malformed reply: frames that do not match the header
  // or the slice, a bad 2-bit payload or threshold, codes for another chain,
  // or a reply that assumes a version this copy does not hold.
  absl::Status Apply(const Message& reply);
  // Writes the copy (length floats). REQUIRES: a successful Apply.
  void CopyTo(float* out) const;

 private:
  const uint64_t length_;
  mutable absl::Mutex mu_;
  std::vector<float> values_ ABSL_GUARDED_BY(mu_);
  uint64_t chain_ ABSL_GUARDED_BY(mu_) = 0;    // 0: holds nothing
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_PULLED_COPY_H_

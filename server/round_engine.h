// SyncRound: one key's open dist_sync round on a server. Every worker
// contributes one push per round; when all have, the round's sum is handed to
// the update (the optimizer, or the store itself with no optimizer) and the
// held replies go out. The sum is computed in rank order, so it does not
// depend on the order in which the pushes arrived.
//
//   SyncRound round(/*num_workers=*/3, /*length=*/n);
//   if (!round.Contributed(rank)) round.Add(rank, std::move(decoded), header);
//   if (round.complete()) {
//     Buffer sum = round.TakeSum();                 // opens the next round
//     std::vector<wire::Header> replies = round.TakeRequests();
//   }
//
// Thread-safety: none; owned with its key (see KVServer).
#ifndef TESSERA_SERVER_ROUND_ENGINE_H_
#define TESSERA_SERVER_ROUND_ENGINE_H_

#include <cstdint>
#include <vector>

#include "common/buffer.h"
#include "proto/tessera.pb.h"

namespace tessera {

class SyncRound {
 public:
  SyncRound(int num_workers, uint64_t length)
      : length_(length), pushes_(num_workers) {}

  // True when `rank` has contributed to the open round.
  bool Contributed(int rank) const { return !pushes_[rank].empty(); }
  // Contributes `rank`'s decoded push (length float32 values) to the open
  // round; `request` is answered when the round completes.
  // REQUIRES: !Contributed(rank), values.size() == length * 4.
  void Add(int rank, Buffer values, const wire::Header& request);
  // A repeat of `sender`'s push in the open round (a restarted worker's new
  // life, or a resent copy under a new request id): the newest header is the
  // one answered.
  void ReplaceRequest(int sender, const wire::Header& request);

  int count() const { return count_; }
  bool complete() const {
    return count_ == static_cast<int>(pushes_.size());
  }
  // The round's sum (length floats), summed in rank order; the round is open
  // again, empty. REQUIRES: complete().
  Buffer TakeSum();
  // The requests to answer, in the order they arrived.
  std::vector<wire::Header> TakeRequests();

 private:
  const uint64_t length_;
  std::vector<Buffer> pushes_;  // by rank
  std::vector<wire::Header> requests_;
  int count_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_ROUND_ENGINE_H_

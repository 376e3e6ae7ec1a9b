// The store of a server: its slices of the keys (a key's part on a server may
// come as several slices, TESSERA_CHUNK_BYTES each), each with its weights,
// optimizer state, delivery bookkeeping, open dist_sync round and waiting
// messages, and (while a restarted server recovers) the messages for slices
// not created yet. A slice is named by its key and offset.
//
//   KeyStore store(/*num_workers=*/2, WaitingLimits());
//   StoredKey* key = store.Create(slice, /*sync=*/true);
//   key->ApplyUpdate(*optimizer, grad);
//   key->engine->Push(msg, settings, ctx);   // the kind's own work
//   StoredKey* same = store.Find(slice);
//
// Thread-safety: none; a server gives each of its update threads a KeyStore
// of its own (see KVServer).
#ifndef TESSERA_SERVER_KEY_STORE_H_
#define TESSERA_SERVER_KEY_STORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/buffer.h"
#include "common/metrics.h"
#include "proto/tessera.pb.h"
#include "server/delivery.h"
#include "server/optimizer.h"
#include "server/replication.h"
#include "server/round_engine.h"
#include "server/slice_engine.h"
#include "server/staleness.h"

namespace tessera {

// A key's metric series on its server (the first slice's counts):
// tessera_server_key_*_total{key="..."}.
struct KeyMetrics {
  Counter* pushes = nullptr;
  Counter* pulls = nullptr;
  Counter* rounds = nullptr;
};

struct StoredKey {
  StoredKey(const wire::KeySlice& slice, bool sync, int num_workers,
            WaitingLimits limits,
            SyncRound::Mode sum_mode = SyncRound::Mode::kExact);

  // OK when `slice` names exactly the part of the key this server holds;
  // otherwise the InvalidArgument to answer with.
  absl::Status CheckSlice(const wire::KeySlice& slice) const;
  // Applies `optimizer` with `grad` (length floats): weights, state, steps.
  // Copy on write: a pull reply may still be sending the current weights.
  void ApplyUpdate(const Optimizer& optimizer, const float* grad);
  // Applies `optimizer` to the given rows only (MXNet's lazy update: the
  // others, weights and optimizer state alike, are untouched); `grad` holds
  // their gradients one after another. One step of the key.
  void ApplyRowUpdates(const Optimizer& optimizer,
                       const std::vector<uint64_t>& rows, const float* grad);
  // The same with row i's gradient at row_grad(i).
  void ApplyRowUpdates(const Optimizer& optimizer,
                       const std::vector<uint64_t>& rows,
                       const std::function<const float*(size_t)>& row_grad);
  // The weights were replaced or updated (compressed pulls make a new
  // version).
  void WeightsChanged() { engine->WeightsChanged(); }
  // The key as a checkpoint holds it. A push of the open dist_sync round is
  // not in the weights, so it is not counted: the worker sends it again after
  // a restore.
  void Snapshot(wire::CheckpointKey* out) const;

  const uint64_t key;
  const uint64_t offset;        // rows, for a row-sparse key
  const uint64_t length;        // values held (rows x row_length)
  const uint64_t total_length;  // rows, for a row-sparse key
  const uint64_t row_length;    // 0: a dense key
  // A hashed row key (offset, length and total_length 0): its HashedSpec.
  const std::string hashed_spec;
  bool hashed() const { return row_length != 0 && total_length == 0; }
  const bool sync;
  // dist_ssp (server/staleness.h): set at init for a key whose pulls wait
  // for the staleness bound (sync is false: pushes are applied on arrival).
  std::unique_ptr<StalenessGate> ssp;
  Buffer weights;
  std::vector<std::vector<float>> optimizer_state;
  uint64_t steps = 0;  // updates applied (the optimizer's t)
  uint64_t rows() const { return row_length == 0 ? 0 : length / row_length; }
  PushLedger ledger;
  WaitingMessages waiting;
  bool progress = false;  // the waiting messages may have work to replay
  // What the slice's kind does (slice_engine.h): its open round, its pulls,
  // its arithmetic.
  std::unique_ptr<SliceEngine> engine;
  // Set by KVServer on first use.
  const KeyMetrics* metrics = nullptr;
  absl::Time round_started;     // the open dist_sync round's first push
  size_t reported_waiting = 0;  // waiting.size() as the RoundWatch knows it

  // Replication (server/replication.h); set by KVServer when the job has
  // TESSERA_REPLICAS > 1. The engine keeps each update for TakeUpdate.
  bool replicated = false;
  uint32_t replica = 0;      // this server's place in the slice's chain
  uint64_t replica_seq = 0;  // updates applied to the slice (and numbered)
  // As a primary: per place in the chain, the updates that backup holds;
  // and the updates not yet held by every live backup, oldest first.
  std::vector<uint64_t> acked;
  std::deque<PendingUpdate> unacked;
  // As a primary, per place: the state transfer to a replacement there
  // (kNoTransfer: none, it is an old member or not asked yet).
  enum Transfer : uint8_t { kNoTransfer = 0, kTransferSent, kTransferHeld };
  std::vector<uint8_t> transfer;
  std::vector<absl::Time> transfer_sent;  // when, for kTransferSent
  // A hand-back (KVServer::HandBack): the slice stops taking pushes at its
  // next round boundary (kYielding), then holds them (kYielded) until the
  // table changes.
  enum Yield : uint8_t { kNotYielding = 0, kYielding, kYielded };
  uint8_t yield = kNotYielding;
};

class KeyStore {
 public:
  KeyStore(int num_workers, WaitingLimits limits,
           SyncRound::Mode sum_mode = SyncRound::Mode::kExact)
      : num_workers_(num_workers),
        limits_(limits),
        sum_mode_(sum_mode),
        left_(num_workers, false),
        joined_(num_workers, false) {}

  // nullptr when this store does not hold the slice of `slice.key()` that
  // starts at `slice.offset()`.
  StoredKey* Find(const wire::KeySlice& slice);
  StoredKey* Find(uint64_t key, uint64_t offset);
  // REQUIRES: Find(slice) == nullptr.
  StoredKey* Create(const wire::KeySlice& slice, bool sync);
  // Elastic jobs: worker `rank` left the job, or joined it; the rounds of
  // every slice, held now or created later, go on without it, or take it
  // from the next round (SliceEngine::Leave, Join). `nominal` is the job's
  // own number of workers (DMLC_NUM_WORKER), which a round's sum is scaled
  // to; ranks from it on are out of the job until they join.
  void WorkerLeft(int rank);
  void WorkerJoined(int rank);
  void SetElastic(int nominal);
  bool Left(int rank) const {
    return rank >= 0 && rank < static_cast<int>(left_.size()) && left_[rank];
  }
  // This server heard `rank` join the job (and not leave since).
  bool Joined(int rank) const {
    return rank >= 0 && rank < static_cast<int>(joined_.size()) &&
           joined_[rank];
  }
  // Forgets a slice (a replacement's transfer replaces what it held).
  void Erase(uint64_t key, uint64_t offset) { keys_.erase({key, offset}); }
  // True for the slice of its key with the lowest offset in this store: a
  // push counts once per key, on that slice.
  bool IsFirstSlice(const StoredKey& key) const;
  // The same among the slices `counts` accepts (a replicated job's server
  // counts pushes on the slices it answers for, not those it backs up).
  bool IsFirstSlice(const StoredKey& key,
                    const std::function<bool(const StoredKey&)>& counts) const;
  // A key of a checkpoint. DataLoss when it does not fit this job.
  absl::Status Restore(const wire::CheckpointKey& saved);

  using SliceId = std::pair<uint64_t, uint64_t>;  // key, offset
  const std::map<SliceId, std::unique_ptr<StoredKey>>& keys() const {
    return keys_;
  }

  // A restarted server's message for a slice that the workers' replay has
  // not created yet: held, once per request (a resent copy is recognised),
  // within the limits of a key's waiting messages.
  absl::Status HoldOrphan(const wire::KeySlice& slice, Message& msg,
                          bool* duplicate);
  // Whether this very request (a resent copy, or its probe) is held as an
  // orphan of `slice`.
  bool HoldsOrphan(const wire::KeySlice& slice, int sender, uint64_t request_id,
                   uint64_t generation) const;
  // Moves the orphans of `key`'s slice (in arrival order) into its waiting
  // messages.
  void AdoptOrphans(StoredKey* key);

 private:
  const int num_workers_;
  const WaitingLimits limits_;
  const SyncRound::Mode sum_mode_;
  std::map<SliceId, std::unique_ptr<StoredKey>> keys_;
  std::map<SliceId, WaitingMessages> orphans_;
  std::vector<bool> left_;    // by worker rank
  std::vector<bool> joined_;  // joined the job (elastic): waited for once it
                              // pushed to a slice
  int nominal_ = 0;           // 0: num_workers_
};

}  // namespace tessera

#endif  // TESSERA_SERVER_KEY_STORE_H_

// SliceEngine: what one kind of key slice does that another does not.
//
// A server's slice (StoredKey, key_store.h) holds what every kind shares:
// weights, optimizer state and steps, the delivery bookkeeping and the
// messages that wait. Its engine holds the rest: the open dist_sync round in
// the kind's own form, what answers pulls, and the kind's arithmetic. KVServer
// keeps the threads, the routing, the order of each worker's messages, the
// replies and the tail of every round (metrics, traces, answers), and asks the
// engine only this:
//
//   dense (DenseEngine)       one array; float32 or 2-bit pushes summed
//                             exactly; pulls whole or 2-bit against a chain
//                             of versions (PullShadow)
//   row-sparse (RowEngine)    num_rows x row_length; pushes and pulls name
//                             rows; a round sums and updates only the rows
//                             pushed (MXNet's lazy update)
//   hashed (HashedEngine)     rows named by any uint64 id, created for the
//                             ids admitted, at most `capacity`
//                             (hashed_table.h)
//
//   std::unique_ptr<SliceEngine> engine = MakeSliceEngine(key, workers, mode);
//   absl::StatusOr<SliceEngine::Pushed> p = engine->Push(msg, settings, ctx);
//   if (p.ok() && *p == SliceEngine::Pushed::kRoundComplete) {
//     SliceEngine::Round r = engine->FinishRound(settings);   // r.requests
//   }
//
// Thread-safety: none; an engine lives on its slice's update thread.
#ifndef TESSERA_SERVER_SLICE_ENGINE_H_
#define TESSERA_SERVER_SLICE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/message.h"
#include "proto/tessera.pb.h"
#include "server/optimizer.h"
#include "server/round_engine.h"

namespace tessera {

struct StoredKey;
class PullShadow;
class HashedTable;
struct HashedSpec;

// The server-wide settings a push is taken under.
struct ServerSettings {
  std::shared_ptr<const Optimizer> optimizer;  // null: no updater
  std::string optimizer_spec = "none";
  std::string compression = "none";  // gradient compression: "2bit" or "none"
  float threshold = 0;
};

// What an engine asks of its server while it works.
class EngineContext {
 public:
  virtual ~EngineContext() = default;
  // A payload that does not decode (counted as malformed).
  virtual void CountMalformed() = 0;
  // Runs `update` of `key`'s weights, timed (metrics, trace).
  virtual void TimedUpdate(const StoredKey& key,
                           const std::function<void()>& update) = 0;
  // A fresh chain id for a slice's compressed pulls.
  virtual uint64_t NewChain() = 0;
};

class SliceEngine {
 public:
  virtual ~SliceEngine() = default;

  // dist_sync: whether `rank` has pushed to the open round; a repeat of its
  // push taking over the round's reply; and whether the round has no push
  // yet (its first starts the round's clock).
  virtual bool Contributed(int rank) const = 0;
  virtual void ReplaceRequest(int sender, const wire::Header& request) = 0;
  virtual bool RoundEmpty() const = 0;
  // Elastic jobs (RoundMembers): `rank` left or joined the job; whether it
  // is out of it; its push about to be taken (a joiner's first makes it a
  // member of the open round); whether the open round is complete (it may
  // be, once a rank left); the job's own number of workers, which a partial
  // round's sum is scaled to.
  virtual void Leave(int rank) {}
  virtual void Join(int rank) {}
  virtual bool Left(int rank) const { return false; }
  virtual void Enter(int rank) {}
  virtual bool RoundComplete() const { return false; }
  // A joining rank's entry (RoundMembers::EnterAt): whether the slice takes
  // round `at` (its open round is not past it); whether its push comes
  // before that round (and waits); whether it is joining and not yet in the
  // rounds; the open round's number (rounds completed).
  virtual bool EnterAt(int rank, uint64_t at) { return true; }
  virtual bool Early(int rank) const { return false; }
  virtual bool Joining(int rank) const { return false; }
  virtual uint64_t RoundNumber() const { return 0; }
  virtual void SetRoundNumber(uint64_t round) {}
  virtual void SetNominal(int workers) {}

  // Host-local aggregation (docs/local_groups.md): whether the kind takes a
  // local group's push (KV_PUSH with group_ranks: the group's sum, counted
  // for each rank it names). Dense slices do; row-sparse and hashed ones
  // take each worker's own push.
  virtual bool TakesGroupPushes() const { return false; }

  // Answers a pull: fills `reply` (made by the server: its header answers
  // `request`). An error is the pull's reply instead. The server has checked
  // that the pull may be answered now (not before the round its worker is
  // in completes).
  virtual absl::Status Pull(const Message& request, Message* reply,
                            EngineContext& ctx) = 0;

  enum class Pushed {
    kApplied,        // dist_async: applied to the weights; answer it now
    kAdded,          // dist_sync: in the open round, which waits for others
    kRoundComplete,  // dist_sync: in the round, which is now complete
  };
  // Checks a push against the slice and `settings` before the server takes
  // its number (PushLedger::Take): its frames, its row ids, and that a 2-bit
  // payload decodes (DataLoss, counted malformed). An error is the push's
  // reply (Header.push_untaken), and the push's number stays for a correct
  // push to take. Everything about the push itself that Push could refuse
  // is found here.
  virtual absl::Status CheckPush(const Message& msg,
                                 const ServerSettings& settings) const {
    return absl::OkStatus();
  }
  // Takes a push that is next in its worker's order (the server checked the
  // order, duplicates, the round and CheckPush) and whose number the server
  // took. An error is the push's reply, and the push counts (its worker stays
  // in step): only what the settings cannot do with it (dist_async without an
  // optimizer on the servers), or what CheckPush already refused.
  virtual absl::StatusOr<Pushed> Push(const Message& msg,
                                      const ServerSettings& settings,
                                      EngineContext& ctx) = 0;

  // The complete round, applied to the slice (the updater on the sum, or the
  // sum as the new value), opening the next: the requests of its pushes (to
  // be answered) and when the update ran.
  struct Round {
    std::vector<wire::Header> requests;
    absl::Time update_start;
    absl::Time update_end;
  };
  virtual Round FinishRound(const ServerSettings& settings) = 0;
  // After a round's answers went out: work best done before the next pull.
  virtual void AfterRound() {}

  // Whether the answer to a push of `command` (applied, or of a finished
  // round) carries the weights (a dense KV_PUSHPULL does).
  virtual bool AnswersWithWeights(wire::Command command) const = 0;
  // The weights were replaced or updated.
  virtual void WeightsChanged() {}

  // Replication (server/replication.h). After an update of a slice whose
  // StoredKey::replicated is set (a FinishRound, or a Push that answered
  // kApplied), the update's frames for the backups, appended to `out` (a
  // KV_REPLICATE the server addresses).
  virtual void TakeUpdate(Message* out) = 0;
  // A backup applies its primary's update: the same weights, optimizer state
  // and steps after it as the primary has. DataLoss for a malformed update.
  virtual absl::Status ApplyReplica(const Message& update,
                                    const ServerSettings& settings,
                                    EngineContext& ctx) = 0;

  // Replicated elastic jobs: each worker rank's place in the open and later
  // rounds of a dist_sync slice (RoundMembers::State), which the slice's
  // backups and replacements take from its primary; nothing for others.
  virtual void MemberStates(
      google::protobuf::RepeatedField<uint64_t>* out) const {}
  virtual void SetMemberState(int rank, uint64_t state) {}

  // What a checkpoint holds of the kind's own, and its restore (dense and
  // row-sparse slices have nothing of their own: open rounds are not saved,
  // their pushes are sent again).
  virtual void Snapshot(wire::CheckpointKey* out) const {}
  virtual absl::Status Restore(const wire::CheckpointKey& saved) {
    return absl::OkStatus();
  }

  // Tests: the compressed pulls' shadow, when the kind has one and it exists.
  virtual const PullShadow* pull_shadow() const { return nullptr; }
  // Tests and stats: a hashed key's table.
  virtual const HashedTable* hashed_table() const { return nullptr; }
};

// What every engine whose open dist_sync round is an `OpenRound` (SyncRound,
// RowRound) answers alike; the engines derive from it.
template <typename OpenRound>
class RoundSliceEngine : public SliceEngine {
 public:
  bool Contributed(int rank) const override { return round_.Contributed(rank); }
  void ReplaceRequest(int sender, const wire::Header& request) override {
    round_.ReplaceRequest(sender, request);
  }
  bool RoundEmpty() const override { return round_.count() == 0; }
  void Leave(int rank) override { round_.Leave(rank); }
  void Join(int rank) override { round_.Join(rank); }
  bool Left(int rank) const override { return round_.members().Out(rank); }
  void Enter(int rank) override { round_.members().Enter(rank); }
  bool RoundComplete() const override { return round_.complete(); }
  bool EnterAt(int rank, uint64_t at) override {
    return round_.EnterAt(rank, at);
  }
  bool Early(int rank) const override { return round_.members().Early(rank); }
  bool Joining(int rank) const override {
    return round_.members().Joining(rank);
  }
  uint64_t RoundNumber() const override { return round_.members().round(); }
  void SetRoundNumber(uint64_t round) override {
    round_.members().set_round(round);
  }
  void SetNominal(int workers) override {
    round_.members().set_nominal(workers);
  }
  void MemberStates(
      google::protobuf::RepeatedField<uint64_t>* out) const override {
    const RoundMembers& m = round_.members();
    for (int r = 0; r < m.size(); ++r) out->Add(m.State(r));
  }
  void SetMemberState(int rank, uint64_t state) override {
    round_.members().SetState(rank, state);
  }

 protected:
  // `round_args` make the round.
  template <typename... Args>
  RoundSliceEngine(StoredKey& key, Args&&... round_args)
      : key_(key), round_(std::forward<Args>(round_args)...) {}

  StoredKey& key_;  // the slice's; outlives the engine
  OpenRound round_;
};

// The engine of `key`'s kind (a hashed key's when key.hashed(), a row-sparse
// slice's when key.row_length != 0).
// `key` outlives it (it is the key's).
std::unique_ptr<SliceEngine> MakeSliceEngine(StoredKey& key, int num_workers,
                                             SyncRound::Mode sum_mode);
std::unique_ptr<SliceEngine> MakeDenseEngine(StoredKey& key, int num_workers,
                                             SyncRound::Mode sum_mode);
std::unique_ptr<SliceEngine> MakeRowEngine(StoredKey& key, int num_workers,
                                           SyncRound::Mode sum_mode);
std::unique_ptr<SliceEngine> MakeHashedEngine(StoredKey& key, int num_workers,
                                              SyncRound::Mode sum_mode,
                                              const HashedSpec& spec);

}  // namespace tessera

#endif  // TESSERA_SERVER_SLICE_ENGINE_H_

// KVServer: one server's shard of the weights and the rules that update it.
//
// Keys arrive as slices (a whole small array, or this server's part of a split
// one). dist_sync: the pushes of one round (one per worker) are summed in an
// order that does not depend on their arrival (SyncRound), the updater is
// applied once to the sum (or, with no updater, the sum replaces the value),
// then the held pushes and pulls are answered. dist_async: each push is
// applied on arrival; without an updater it is an error reply. dist_ssp:
// as dist_async, but a pull waits until no worker in the job is more than
// the key's staleness bound of pushes behind the puller
// (server/staleness.h). Each worker's
// pushes to a key are numbered and taken exactly once (PushLedger); messages
// that must wait do so per key, within limits (WaitingMessages).
//
// Keys are spread over update threads by hash; each thread owns a KeyStore,
// so a key's messages are handled in arrival order without locks. When a
// key's update thread has nothing queued, a cheap message (a pull, a message
// of up to 64 KB, a push that needs no arithmetic) is handled on Handle's
// thread instead, saving the hand-off; its reply is then sent from that
// thread.
//
//   KVServer server(/*num_workers=*/4, /*threads=*/2,
//                   [&](int peer, Message m) { return node->Send(peer, std::move(m)); });
//   node callback: server.Handle(std::move(message));
//   ...
//   server.Stop();
//
// Thread-safety: Handle, Snapshot and MarkDurable are called from one thread
// (the node's receiver); Handle blocks while the update threads' bounded
// queues are full (back-pressure to the sender through ZeroMQ and TCP).
// stats() may be called from any thread.
//
// Metrics (MetricsRegistry::Global(), docs/metrics.md): the counts of stats()
// are collected from the same counters when scraped, so they agree with
// KV_STATS; per key (the first kMaxKeySeries keys this server holds, the rest
// under key="other") pushes, pulls and rounds; round and update durations;
// the update threads' queue depth.
#ifndef TESSERA_SERVER_KV_SERVER_H_
#define TESSERA_SERVER_KV_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/debug_pending.h"
#include "common/message.h"
#include "common/metrics.h"
#include "common/replica_chain.h"
#include "proto/tessera.pb.h"
#include "server/catch_up.h"
#include "server/delivery.h"
#include "server/optimizer.h"
#include "server/round_engine.h"
#include "server/round_watch.h"
#include "server/slice_engine.h"
#include "server/staleness.h"

namespace tessera {

struct StoredKey;
struct PendingUpdate;
struct KeyMetrics;

class KVServer : private EngineContext {
 public:
  using SendFn = std::function<absl::Status(int peer, Message msg)>;

  // Keys with a metric series of their own (the first this server holds).
  static constexpr size_t kMaxKeySeries = 32;

  // Each key's mode (dist_sync or dist_async) comes with its KV_INIT.
  // `watch`: when a round is late enough to be logged (RoundWatch).
  KVServer(int num_workers, int num_threads, SendFn send,
           WaitingLimits limits = WaitingLimits(),
           SyncRound::Mode sum_mode = SyncRound::Mode::kExact,
           RoundWatch::Options watch = RoundWatch::Options());
  ~KVServer() override;

  // Takes a data-plane message (KV_*); replies through the SendFn.
  void Handle(Message&& msg);

  // Checkpoints. Snapshot asks every update thread to copy its keys (weights,
  // optimizer state, steps, and per worker the pushes the weights include)
  // when it reaches this point of its queue, so each key's weights and counts
  // agree; `done` then runs, on the last of those threads, with the whole
  // snapshot (it must not block). MarkDurable tells later push replies that
  // the pushes `saved` holds are safe on disk. Both from Handle's thread.
  void Snapshot(std::function<void(wire::ServerCheckpoint)> done);
  void MarkDurable(std::shared_ptr<const wire::ServerCheckpoint> saved);
  // Loads a checkpoint into an empty server, before the first Handle. The
  // server then holds pushes and pulls of keys it does not know yet (a worker
  // replaying them may come before the init that creates the key).
  absl::Status Restore(const wire::ServerCheckpoint& saved);
  // Push replies say that this server checkpoints, so workers keep their
  // pushes until they are durable.
  void set_checkpointing(bool on) { checkpointing_ = on; }
  // A restarted server with nothing to restore: it holds requests for keys
  // that the workers' replay has not initialised yet.
  void set_recovering() { recovering_.store(true); }
  // Replication (server/replication.h): this server's rank among
  // `num_servers`, each slice's chain `replicas` of them; unanswered updates
  // are sent to a backup again after `resend_timeout` (doubling up to 8x)
  // when a worker asks again for an answer that waits for them.
  // Before the first Handle.
  // With `single_copy` (TESSERA_MAX_SERVERS, TESSERA_REPLICAS=1) the chain
  // only places a slice: its acting primary holds the one copy and sends
  // updates only to a server it is moving the slice to.
  void set_replication(int rank, int num_servers, int replicas,
                       absl::Duration resend_timeout, bool single_copy = false);
  // The scheduler declared server `rank` dead: its slices' next live
  // replicas answer for them, and updates no longer wait for it. From
  // Handle's thread.
  void ServerDied(int rank);
  // The node table's server states changed (a death, a replacement taking a
  // rank, a replacement caught up): every slice follows them. From
  // Handle's thread.
  void UpdateServers(std::vector<ServerState> states);
  // Hand-back (server/replication.h): server `rank`, a replacement that
  // caught up, takes back its place in its chains. Every slice this server
  // answers for that `rank` will answer for stops taking pushes at its next
  // round boundary (they wait, and go to `rank` once the table says so);
  // once all did and their backups hold every update made, `ready(epoch)`
  // runs (on an update thread). It ends when the table says the rank has its
  // place, or died; a later epoch replaces it; other changes of the states
  // (UpdateServers) recompute which slices stop. A repeated or older epoch
  // is ignored; one that comes before the table says the rank caught up
  // waits for that change. From Handle's thread.
  // With `leave` (one copy, set_replication's `single_copy`): the rank,
  // this server's or another's, leaves instead; the slices it answers for
  // stop at their boundaries once the servers answering for them without it
  // hold them (it sends them), and the rest is as above.
  void HandBack(int rank, uint64_t epoch,
                std::function<void(uint64_t epoch)> ready, bool leave = false);
  // Elastic jobs (TESSERA_ELASTIC): worker `rank` left the job (goodbye or
  // declared dead). Every slice's open round that it has not pushed to, and
  // every later round, completes without it; what it sends from now on is
  // refused (FailedPrecondition). From Handle's thread.
  void WorkerLeft(int rank);
  // Elastic jobs: worker `rank` joined the job (a new process; a rank that
  // left before, or one never used): its first push to a slice enters the
  // round under way, and the slice's later rounds wait for it. From
  // Handle's thread.
  void WorkerJoined(int rank);
  // Elastic jobs, before the first Handle: the server was made for the most
  // workers the job may have (num_workers); `nominal` of them
  // (DMLC_NUM_WORKER) are in it at the start, the ranks after join later. A
  // round of m pushes with an optimizer is scaled by nominal / m. A worker's
  // goodbye (KV_FINISH) takes it out of the rounds, so that the others'
  // rounds go on without it while they train longer than it did.
  void set_elastic(int nominal);
  // Host-local aggregation (docs/local_groups.md), before the first Handle:
  // per worker rank, the ranks of its local group (itself included, in rank
  // order; empty: in no group), as the node table gives them. A push naming
  // group mates (group_ranks) is taken only from a worker in a group and
  // only when it names exactly its group's other members.
  void set_local_groups(std::vector<std::vector<int>> mates) {
    local_groups_ = std::move(mates);
  }
  // A replacement server (its own entry catching_up): asks every live server
  // for the slices of its chains (KV_TRANSFER) every PS_RESEND_TIMEOUT until
  // each has sent all it counted, then calls `caught_up` once. `states`
  // gives the table's current view. Stop ends it.
  void StartCatchUp(std::function<std::vector<ServerState>()> states,
                    std::function<void()> caught_up);
  // Called once, on Handle's thread, when every worker has said it finished
  // with this server (KV_FINISH, after its last barrier).
  void set_on_workers_finished(std::function<void()> callback) {
    on_workers_finished_ = std::move(callback);
  }
  // Updates applied so far (dist_sync key rounds plus dist_async pushes).
  uint64_t updates_applied() const {
    return rounds_applied_.load() + async_applied_.load();
  }

  // Stops the update threads after they drained their queues. Idempotent.
  void Stop();

  wire::KVStats stats() const;

  // For tests: the compressed-pull shadow of a key slice and its version
  // (empty when none was made), read between messages on its update thread.
  // REQUIRES: the server is not stopped.
  std::pair<std::vector<float>, uint64_t> ShadowForTesting(uint64_t key,
                                                           uint64_t offset);

 private:
  struct Shard;
  using Settings = ServerSettings;

  Shard* ShardOf(uint64_t key) const;
  // Queues `msg` for `shard`'s update thread (blocks while its queue is
  // full).
  void Enqueue(Shard* shard, Message&& msg);
  // Queues `task` for `shard`'s update thread, behind its messages.
  void Post(Shard* shard, std::function<void(Shard*)> task);
  void Run(Shard* shard);
  // The constructor's steps: the shards and their update threads; the
  // metrics collected from this server's counters (KV_STATS's and the
  // others), and its gauges (keys, queued work, threads).
  void StartUpdateThreads(int num_threads, SyncRound::Mode sum_mode);
  void RegisterCounters();
  void RegisterChainCounters();
  void RegisterGauges();
  void AddCounter(const char* name, const char* help,
                  const std::atomic<uint64_t>* value);
  // Handle's steps. A message between servers (a replica update or its
  // answer, a state transfer): true when it was taken (queued, processed or
  // answered; `msg` is then moved from), false when it is a worker's.
  bool TakeServerMessage(Message& msg);
  // KV_FINISH: the worker is done with this server.
  void WorkerFinished(const Message& msg);
  // A worker's request of a key slice (init, push, pull): processed here
  // when its shard is idle and it is cheap, else queued for its shard.
  void RouteSliceRequest(Message&& msg);
  // Whether `msg` is cheap enough to process on Handle's thread when its shard
  // is idle.
  bool ProcessInline(const Message& msg) const;
  void Process(Shard* shard, Message&& msg);
  // Process's steps. A request for a slice this shard does not hold: dropped
  // (it moved away), held (a recovering server), or answered NotFound; a
  // probe is acknowledged when its push is held, else answered send_whole.
  void AnswerUnknownSlice(Shard* shard, Message&& msg);
  // A worker's request of `key` (a slice it holds): taken, or held behind
  // what waits; a duplicate of a waiting one is acknowledged.
  void ProcessRequest(Shard* shard, StoredKey* key, Message&& msg);
  // Probes (wire::Header::probe, issue #46): the header of a push this
  // server acknowledged, without its data. A push taken before is answered
  // as its resent copy would be (never applied again); one this server
  // cannot answer for now (it lacks it, or is a backup not yet answering
  // for the slice) is answered send_whole. A probe is never held.
  static bool IsProbe(const Message& msg);
  void AnswerProbe(StoredKey* key, Message& msg);
  void AskForWhole(const Message& probe);
  void Init(Shard* shard, Message&& msg);
  // Init's cases: an init of a slice this server holds (resent, replayed, or
  // a conflict); a new hashed row key's; a new slice with a value (or, for a
  // row-sparse key, zeros).
  void AnswerRepeatedInit(StoredKey* key, const Message& msg);
  void InitHashed(Shard* shard, Message&& msg);
  void InitValued(Shard* shard, Message&& msg);
  void Rejoin(Shard* shard, Message&& msg);
  // A joining worker's entry into a slice's rounds (KV_INIT with rejoin and
  // enter).
  void EnterRounds(StoredKey* key, Message&& msg);
  // Returns false when `msg` must wait (for the open round, or for an earlier
  // push of its sender). The slice's kind is its engine's business.
  bool TryProcess(StoredKey* key, Message& msg);
  bool TryPush(StoredKey* key, Message& msg);
  // A push TryPush took (`pushed`: what the engine did with it): counted,
  // answered now or with its round, which it may complete. Returns false when
  // its answer waits (a dist_ssp pushpull's, for the bound).
  bool AnswerPush(StoredKey* key, Message& msg, SliceEngine::Pushed pushed);
  // Every kind's round ends here: the engine applies it, then metrics,
  // traces and the answers. `last_rank` pushed last (the round waited for it).
  void CompleteRound(StoredKey* key, int last_rank);
  // Tells the watch how many messages `key` holds, when that changed.
  void ReportWaiting(StoredKey* key);
  // This server's part of /debug/pending: open rounds, waiting messages,
  // rank lags, dist_ssp pulls the bound holds, the update threads' phases.
  void FillPending(wire::DebugPending* out) const;
  // Replication. A new slice's part in it: `replica`, this server's place in
  // its chain (KV_INIT's).
  void MakeReplicated(StoredKey* key, uint32_t replica);
  // A worker's KV_INIT names this server's place in the slice's chain
  // (header.replica); its word is not taken (issue #46). InvalidArgument
  // when the place is outside the chain, or the chain it puts this server
  // in starts at a server the key's layout cannot name for the slice
  // (common/key_layout.h), or, for a slice this server holds, it is not the
  // place held.
  absl::Status CheckInitPlace(const wire::Header& init,
                              const StoredKey* held = nullptr) const;
  // InvalidArgument when an async key would have more than 2 replicas.
  absl::Status CheckAsyncChain(const wire::Header& init) const;
  // Answers an init CheckInitPlace refused with `why`; counts it
  // (misplaced_inits_) and logs it, naming the sender, while LogOccurrence
  // says so.
  void RefuseMisplacedInit(const Message& msg, const absl::Status& why);
  // Drops a replica update or a transfer (`what`) from a server whose place
  // in the slice's chain, as this server sees it, may not send it (only the
  // acting primary does): a late one from a server declared dead or replaced
  // in its place, or a rogue (issue #46). Counts it
  // (misplaced_server_messages_) and logs it, naming the sender, while
  // LogOccurrence says so.
  void DropMisplaced(const wire::Header& h, const char* what,
                     const SliceChain& chain, int primary);
  // Whether this server answers for `key` now (the first live
  // member of its chain; always for an unreplicated slice).
  bool Active(const Shard& shard, const StoredKey& key) const;
  // The live members of `key`'s chain after this server.
  std::vector<int> LiveBackups(const Shard& shard, const StoredKey& key) const;
  // After an update of a replicated slice: numbers it, sends it to the live
  // backups and holds `requests` (answered with `weights` where their
  // command carries them) until every one of them holds it.
  void Replicate(StoredKey* key, std::vector<wire::Header> requests);
  // A replicated dist_ssp slice's update that changes no weight (no frames):
  // a joiner's entry, its count and its place among the ranks the bound
  // waits for; `entry` is answered once every live backup holds it.
  void ReplicateEntry(StoredKey* key, const wire::Header& entry);
  // Replicate's and ReplicateEntry's: the next update's header, numbered,
  // with the slice's counts (and members, CarriesMembers); and its sending.
  PendingUpdate NewUpdate(StoredKey* key);
  void SendNewUpdate(StoredKey* key, PendingUpdate p);
  // Elastic jobs: a dist_sync or dist_ssp slice's updates and transfers
  // carry each worker rank's place (RoundMembers::State).
  bool CarriesMembers(const StoredKey& key) const;
  // Sends `update` to the backup of rank `rank`.
  void SendUpdate(int rank, const Message& update);
  // A backup's side: applies a KV_REPLICATE in order and answers it.
  void TakeReplica(Shard* shard, Message&& msg);
  // Elastic jobs: takes the primary's worker states of a dist_sync or
  // dist_ssp slice (an update's or a transfer's, named by `what`; for
  // dist_ssp, which ranks the bound waits for), except where this server
  // heard the scheduler first: a rank it heard leave stays out, one it heard
  // join is not put out. Counts a wrong-sized list malformed.
  void TakeMembers(StoredKey* key,
                   const google::protobuf::RepeatedField<uint64_t>& states,
                   const char* what);
  // A primary's side: a backup holds updates up to the answered one.
  void ReplicaAnswered(Shard* shard, const Message& msg);
  // Answers the held updates every live backup holds, oldest first.
  void AnswerReplicated(Shard* shard, StoredKey* key);
  // A checkpoint's or a transfer's optimizer and compression settings
  // become this server's; DataLoss naming `what` for an unknown optimizer.
  absl::Status InstallSettings(const wire::ServerCheckpoint& saved,
                               const char* what);
  // Applies the table's server states to `shard`'s slices.
  void ApplyStates(Shard* shard, std::vector<ServerState> states);
  // Hand-back, on a shard's thread: its slices that `rank` will answer for
  // stop at their round boundary; the shard's part is done when they all
  // did and no update of theirs waits for a backup; a change of the states
  // ends it (the slices take pushes again, if they still answer).
  struct HandbackJob;
  // The states once the hand-back running on `shard` completed.
  std::vector<ServerState> StatesAfter(const Shard& shard) const;
  void StartYield(Shard* shard, int rank, bool leave,
                  const std::shared_ptr<HandbackJob>& job);
  // (Re)computes the slices that stop over the shard's table; those that no
  // longer move take their held pushes again.
  void Reyield(Shard* shard);
  void ReleaseYield(Shard* shard, StoredKey* key);
  // Whether the shard's table says the hand-back's rank waits for its place.
  bool Waiting(const Shard& shard) const;
  void CheckYield(Shard* shard);
  // Whether `key` is one this server answers for now and the rank of the
  // hand-back running on `shard` will.
  bool Moves(const Shard& shard, const StoredKey& key) const;
  // One copy: whether the table says this server answers for the slice of
  // `init`, and the hand-back running on `shard` does not move it away.
  bool TakesInit(const Shard& shard, const wire::Header& init) const;
  // Whether replacement `rank` answers for `key` once it has its place back.
  bool MovesTo(const Shard& shard, const StoredKey& key, int rank) const;
  // One copy: sends a new slice to a replacement that will answer for it.
  void OfferSlice(Shard* shard, StoredKey* key);
  void EndYield(Shard* shard);
  // After a change of the states: the hand-back ends (the rank has its place,
  // or died) or goes on over the new table.
  void HandbackAfterChange(Shard* shard);
  // Process, then the shard's part of a hand-back, if any, is looked at.
  void ProcessMessage(Shard* shard, Message&& msg);
  // `key`'s chain: this server holds place `key.replica` of it.
  SliceChain ChainOf(const StoredKey& key) const;
  // Whether the answers of `key`'s updates wait for the member at `place`.
  bool AnswerWaitsFor(const Shard& shard, const StoredKey& key,
                      int place) const;
  // State transfer (KV_TRANSFER). A server's side: what replacement `rank`
  // asked for (every slice it answers for whose chain holds `rank`, then
  // the count); one slice's snapshot to it; its answer.
  void TransferRequested(int rank, const wire::Header& request);
  void SendTransfer(StoredKey* key, int place);
  void TransferAnswered(Shard* shard, const Message& msg);
  // The replacement's side: a slice's snapshot, and a server's count (its
  // slices' names, to catch_up_).
  void TakeTransfer(Shard* shard, Message&& msg);
  void TransferCounted(int rank, const Message& msg);
  // Sends again `key`'s updates a backup has not answered in time.
  void ResendUpdates(Shard* shard, StoredKey* key);
  // A push of `key` already taken whose update is not yet held by every
  // backup: true when `msg` was joined to that update's answers.
  bool JoinPendingUpdate(StoredKey* key, const Message& msg);
  // dist_ssp (server/bounded_staleness.cc; the rule: server/staleness.h).
  // InvalidArgument for an init whose staleness does not fit (a dist_sync
  // key, a bound past kMaxStaleness).
  absl::Status CheckStalenessInit(const wire::Header& init) const;
  // A push naming group mates (group_ranks): InvalidArgument unless its
  // sender's local group is exactly those ranks and itself, and `key` takes
  // group pushes (dense, not dist_ssp).
  absl::Status CheckGroupPush(const StoredKey& key, const Message& msg) const;
  // A push naming no group mates: FailedPrecondition when its sender is in a
  // local group (of two or more) and `key` is a dense dist_sync slice, whose
  // rounds count the group's pushes for their members (a member's own push
  // would stall them). Other slices take each worker's own push.
  absl::Status CheckOwnPush(const StoredKey& key, const Message& msg) const;
  // A new slice's gate, when its init asks for one.
  void MakeBoundedStaleness(StoredKey* key, const wire::KVOptions& options);
  // Whether `msg` of dist_ssp slice `key` (a pull made after `clock` pushes
  // of its worker, or a pushpull's answer, `clock` its push_seq + 1) may be
  // answered now (kAnswerHeld: after the gate held it), or waits.
  enum class SspVerdict { kWait, kAnswer, kAnswerHeld };
  SspVerdict SspCheck(StoredKey* key, const Message& msg, uint64_t clock);
  // Elastic jobs: the clock a worker joining the job starts dist_ssp slice
  // `key` at (its pushes are numbered from it): the slowest clock of the
  // ranks the bound waits for, or its rank's own count when that is more
  // (a rank whose earlier holder left). Its entry (EnterRounds) sets it, and
  // from then on the rank holds the others back.
  uint64_t SspJoinClock(const StoredKey& key, int rank) const;
  // Dist_ssp slice `key` took a push of `rank` (its clock moves).
  void SspPushTaken(const StoredKey& key, int rank);
  // What `key`'s gate held of `sender` was answered otherwise.
  void SspForget(StoredKey* key, int sender);
  // A push of `key` taken before, seen again (resent, replayed, or a
  // dist_ssp pushpull held for its answer): answered, never applied twice.
  // False when it must wait (that pushpull's answer, for the bound).
  bool AnswerTakenPush(StoredKey* key, Message& msg);
  // Holds `msg` among `key`'s waiting messages, or answers it with the error
  // when the limits are reached.
  void Hold(StoredKey* key, Message&& msg);
  // Offers the waiting messages again while that makes progress.
  void Replay(StoredKey* key);
  // Whether a push or round of `key` counts here: on the first slice of its
  // key this server answers for (a key comes in slices; it counts once).
  bool CountsFor(const StoredKey& key) const;
  // Counts a push taken (once per key: on its first slice here).
  void CountPush(StoredKey& key);
  void HandleSettings(Message&& msg);
  void Reply(const Message& request, const absl::Status& status,
             Buffer values = Buffer(), const StoredKey* key = nullptr);
  // Answers `request` with `why`, found before its push number was taken
  // (PushLedger::Take): every refusal of a push before Take comes here, and
  // its reply says so (Header.push_untaken), so that its worker marks the key
  // out of step. A refusal after Take (SliceEngine::Push: dist_async without
  // an optimizer) goes by Reply: that push counts.
  void RefuseUntaken(const Message& request, const absl::Status& why);
  // A reply to `request` without data frames, and its sending.
  Message NewReply(const Message& request, const absl::Status& status,
                   const StoredKey* key);
  void SendReply(const Message& request, Message reply);
  // Counts `msg` malformed and drops it; logs it while LogOccurrence says so
  // ("dropped `what` (malformed message #n ...)").
  void DropMalformed(const std::string& what, const Message& msg);
  // A chain id for a key slice's compressed pulls: random, so a restarted
  // server's chains never match what workers hold from its earlier life.
  uint64_t NewChain() override;
  // Tells the sender its request arrived and is waiting; the reply follows.
  void Acknowledge(const Message& request);
  Settings settings() const;
  // EngineContext.
  void CountMalformed() override { ++malformed_; }
  void TimedUpdate(const StoredKey& key,
                   const std::function<void()>& update) override;
  // `key`'s metric series (made on first use; on its update thread).
  const KeyMetrics& MetricsOf(StoredKey* key);
  const KeyMetrics* SeriesFor(uint64_t key);
  // A completed dist_sync round of `key` in the trace (TESSERA_TRACE): the
  // round's span and its update's.
  void TraceRound(const StoredKey& key, absl::Time update_start,
                  absl::Time update_end, int last_rank);

  const int num_workers_;
  // set_local_groups: read-only once messages are handled.
  std::vector<std::vector<int>> local_groups_;
  const SendFn send_;
  const WaitingLimits limits_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::thread> threads_;

  mutable absl::Mutex settings_mu_;
  Settings settings_ ABSL_GUARDED_BY(settings_mu_);
  std::atomic<uint64_t> num_keys_{0};

  std::atomic<uint64_t> pushes_applied_{0};
  std::atomic<uint64_t> rounds_applied_{0};
  std::atomic<uint64_t> async_applied_{0};
  std::atomic<uint64_t> duplicates_{0};
  std::atomic<uint64_t> probes_sent_whole_{0};  // probes answered send_whole
  std::atomic<uint64_t> checkpoints_{0};
  std::atomic<uint64_t> refused_{0};  // ResourceExhausted replies
  std::atomic<bool> checkpointing_{false};
  std::atomic<bool> recovering_{false};
  mutable absl::Mutex key_counts_mu_;
  std::map<uint64_t, uint64_t> key_pushes_ ABSL_GUARDED_BY(key_counts_mu_);
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> malformed_warnings_{0};  // LogOccurrence's count
  std::atomic<uint64_t> failed_replies_{0};      // SendReply's send failed
  // A message to another server (chain update, transfer, its count or ask)
  // the transport would not take.
  std::atomic<uint64_t> failed_server_sends_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<bool> stopped_{false};
  absl::Mutex chain_mu_;
  std::mt19937_64 chain_rng_ ABSL_GUARDED_BY(chain_mu_);
  // Replication: set before the first Handle (set_replication).
  int rank_ = 0;
  int num_servers_ = 1;
  int replicas_ = 1;  // the chain's length
  bool single_copy_ = false;
  absl::Duration replica_resend_ = absl::Seconds(1);
  std::atomic<uint64_t> replica_updates_{0};
  std::atomic<uint64_t> promoted_{0};
  std::atomic<uint64_t> replica_resends_{0};
  std::atomic<uint64_t> misplaced_inits_{0};            // RefuseMisplacedInit
  std::atomic<uint64_t> misplaced_server_messages_{0};  // DropMisplaced
  std::atomic<uint64_t> slices_handed_back_{0};
  std::atomic<uint64_t> moved_away_{0};
  uint64_t handback_seen_ = 0;  // the last epoch taken; Handle's thread only
  CatchUp catch_up_;            // a replacement's (StartCatchUp)
  std::function<void()> on_workers_finished_;
  std::set<int> finished_workers_;  // ranks; Handle's thread only
  std::set<int> left_workers_;      // elastic jobs; Handle's thread only
  bool workers_finished_reported_ = false;  // Handle's thread only
  bool elastic_ = false;                    // set_elastic
  // Called when a worker finished or left: on_workers_finished_ once every
  // worker has done one or the other.
  void CheckWorkersFinished();
  // Elastic jobs: `rank` is out of every slice's rounds (see WorkerLeft).
  void LeaveRounds(int rank);

  std::map<uint64_t, std::unique_ptr<KeyMetrics>> key_series_
      ABSL_GUARDED_BY(key_counts_mu_);
  KeyMetrics* other_keys_ ABSL_GUARDED_BY(key_counts_mu_) = nullptr;
  Histogram* const round_duration_;
  Histogram* const update_duration_;
  RoundWatch watch_;
  StalenessStats ssp_stats_;         // dist_ssp's clocks and held pulls
  CollectorHandles metric_handles_;  // removed before the counters go
  DebugPendingRegistry::Section pending_section_;  // last: removed first
};

}  // namespace tessera

#endif  // TESSERA_SERVER_KV_SERVER_H_

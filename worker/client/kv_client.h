// KVClient: the implementation of tessera::KVWorker (include/tessera/
// kv_worker.h), the client side of the key-value protocol. Internal: programs
// use KVWorker::Create; tests build a KVClient over an in-memory transport.
//
//   MemoryNetwork net;                                  // tests/support
//   absl::StatusOr<std::unique_ptr<KVClient>> kv =
//       KVClient::Create(options, /*sync=*/true, net.NewTransport());
//   (*kv)->Init(0, weights);
//
// An operation (push, pull, pushpull) becomes one request per server part of
// the key (KeyPartitioner). The pieces:
//   - RequestTracker: request ids, replies, resends, deadlines, waiting;
//   - ReplayLog: settings, inits and pushes kept for a restarted server;
//   - DevicePushStager: gradients in GPU memory made ready to push.
// Every push, from host or device memory, compressed or not, goes through one
// path (SendPush), which numbers it per key (push_seq: the servers apply each
// exactly once) and counts it.
//
// Pushed float values are sent without a copy: the frame borrows the caller's
// buffer and pins the operation until it is no longer needed, so Wait returns
// only when the buffer is free again. Pulled frames (zero-copy ZeroMQ memory)
// wait with the operation and are copied into the caller's buffer by the
// thread in Wait, so the receiving thread goes back to the socket at once.
// The thread in Wait usually receives its replies itself
// (Node::ReceiveOnCaller through the RequestTracker): the reply wakes it
// directly rather than through the node's receiver thread.
//
// A worker restarted into a running job (TESSERA_RESTART_COUNT > 0) keeps its
// rank. Its Init asks each server part how many of this rank's pushes to the
// key it took (KV_INIT with rejoin) and joins the workers' barrier only if
// they wait in that key's init barrier; its pushes are numbered on from the
// smallest such count over its keys (ResumeRound).
//
// Thread-safety: as KVWorker (all methods may be called concurrently).
#ifndef TESSERA_WORKER_CLIENT_KV_CLIENT_H_
#define TESSERA_WORKER_CLIENT_KV_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/node.h"
#include "common/options.h"
#include "common/transport.h"
#include "tessera/kv_worker.h"
#include "worker/client/device_push.h"
#include "worker/client/key_partitioner.h"
#include "worker/client/local_group.h"
#include "worker/client/pulled_copy.h"
#include "worker/client/replay_log.h"
#include "worker/client/request_tracker.h"
#include "worker/client/server_routes.h"

namespace tessera {

class KVClient : public KVWorker {
 public:
  // Joins the job given by `options` (role worker) over `transport` (nullptr:
  // ZeroMQ). Blocks until the node table has arrived.
  static absl::StatusOr<std::unique_ptr<KVClient>> Create(
      const Options& options, bool sync,
      std::unique_ptr<Transport> transport = nullptr);

  ~KVClient() override;

  int rank() const override { return node_->rank(); }
  int num_workers() const override { return options_.num_workers; }
  int num_servers() const override { return options_.num_servers; }
  bool is_sync() const override { return sync_; }

  absl::Status SetOptimizer(const std::string& spec) override;
  absl::Status SetGradientCompression(const std::string& type,
                                      float threshold) override;
  absl::Status SetPullCompression(const std::string& type) override;
  absl::Status SetStaleness(int64_t staleness) override;
  // Makes this a dist_ssp store (KVWorker::Create("dist_ssp")) whose bound
  // is `staleness` (TESSERA_STALENESS; -1: none yet, SetStaleness must give
  // one). REQUIRES: before the first Init.
  void UseBoundedStaleness(int64_t staleness) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Init(uint64_t key, absl::Span<const float> value) override;
  uint64_t ResumeRound() override;
  absl::StatusOr<OpHandle> PushAsync(uint64_t key,
                                     absl::Span<const float> grad) override;
  absl::StatusOr<OpHandle> PushPullAsync(uint64_t key,
                                         absl::Span<const float> grad,
                                         absl::Span<float> out) override;
  absl::StatusOr<OpHandle> PushDeviceAsync(uint64_t key,
                                           const float* device_grad, size_t len,
                                           void* cuda_stream) override;
  absl::StatusOr<OpHandle> PullAsync(uint64_t key,
                                     absl::Span<float> out) override;
  absl::StatusOr<OpHandle> PullViewAsync(uint64_t key,
                                         PulledValue* out) override;
  absl::Status InitRows(uint64_t key, const float* value, uint64_t num_rows,
                        uint64_t row_length) override;
  absl::Status InitHashed(uint64_t key, uint64_t row_length,
                          const std::string& options) override;
  absl::StatusOr<OpHandle> PushRowsAsync(uint64_t key,
                                         absl::Span<const uint64_t> row_ids,
                                         absl::Span<const float> rows) override;
  absl::StatusOr<OpHandle> PullRowsAsync(uint64_t key,
                                         absl::Span<const uint64_t> row_ids,
                                         absl::Span<float> out) override;
  absl::StatusOr<uint64_t> RowLength(uint64_t key) const override {
    absl::StatusOr<RowKey> row_key = CheckRows(key, {}, "row call");
    if (!row_key.ok()) return row_key.status();
    return row_key->row_length;
  }
  absl::Status Wait(OpHandle handle) override;
  absl::Status Barrier() override;
  absl::Status Close() override;
  absl::Status Leave() override;
  KVWorkerStats stats() const override;
  absl::Status SetPriority(uint64_t key, int64_t priority) override;
  absl::StatusOr<int64_t> Priority(uint64_t key) const override;

  // Every server's KV_STATS (by server rank), for tests and tools that check
  // the servers' counts.
  absl::StatusOr<std::vector<wire::KVStats>> ServerStats();
  // The metrics server's port; 0 when TESSERA_METRICS_PORT is unset.
  int metrics_port() const { return node_->metrics_port(); }

 private:
  struct KeyInfo {
    uint64_t length = 0;         // values (rows x row_length for row keys)
    uint64_t row_length = 0;     // 0: a dense key
    std::vector<KeyPart> parts;  // slices of at most TESSERA_CHUNK_BYTES
    // A dense key with more slices on one server than PushWindow: pushes go
    // a window at a time, the next slice when an earlier one is answered.
    // (Row pushes size their window by their bytes: RowPushWindows.)
    bool windowed = false;
    uint64_t next_seq = 0;  // push_seq of the next push
    // Joining an elastic job, before its entry (EnterRounds): the count its
    // pushes start at (the largest over the key's slices) and the furthest
    // open round of its slices.
    uint64_t enter_seq = 0;
    uint64_t open_round = 0;
    // Not OK once a push of this key was refused by a server before it took
    // the push's number (Header.push_untaken: this worker's count is ahead
    // of the server's): later pushes and pulls of the key fail at once with
    // it instead of waiting for that push until TESSERA_TIMEOUT.
    absl::Status out_of_step;
    std::vector<float> residual;  // 2-bit error feedback, host pushes
    // Per slice, this worker's copy for compressed pulls.
    std::vector<std::shared_ptr<PulledCopy>> pulled;
    // Row keys with 2-bit pushes: error feedback of the rows pushed so far
    // (row -> its residual in row_residual).
    absl::flat_hash_map<uint64_t, uint64_t> row_slot;
    bool hashed = false;  // InitHashed: ids are any uint64, routed by hash
    // Host-local aggregation: part i is pushed and pulled by the group's
    // member (group_first + i) % size (the parts of the keys initialised
    // before it, so that the members' shares stay even).
    uint64_t group_first = 0;
    // Slot s's residual: row_residual[s / kRowsPerChunk], row s %
    // kRowsPerChunk. In chunks, so that more rows never move the others (a
    // vector's growth copied up to the whole key's worth each time).
    static constexpr uint64_t kRowsPerChunk = 256;
    std::vector<std::unique_ptr<float[]>> row_residual;
    float* RowResidual(uint64_t slot, uint64_t row_length) {
      const uint64_t chunk = slot / kRowsPerChunk;
      while (row_residual.size() <= chunk) {
        row_residual.push_back(
            std::make_unique<float[]>(kRowsPerChunk * row_length));  // zeros
      }
      return row_residual[chunk].get() + (slot % kRowsPerChunk) * row_length;
    }
  };
  // The entry of `key` for an operation (`what`, for the error) that checked
  // it under an earlier hold of mu_: NotFound when an init of the key failed
  // on another thread since, and forgot it.
  absl::StatusOr<KeyInfo*> KeyInfoLocked(uint64_t key, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What InitRows and Init share: declares the key, rejoins or stores it,
  // and waits in its init barrier. `value` may be null (row keys: zeros).
  absl::Status InitKey(uint64_t key, const float* value, uint64_t length,
                       uint64_t row_length, std::vector<KeyPart> parts,
                       const std::string& hashed_spec = "");
  // InitKey's steps (key_init.cc). DeclareKey: the key's KeyInfo (whether
  // its pushes are windowed, its residual and pulled copies) and its place
  // in the replay log; AlreadyExists when the key was declared before.
  absl::Status DeclareKey(uint64_t key, uint64_t length, uint64_t row_length,
                          const std::vector<KeyPart>& parts, bool hashed)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Undoes DeclareKey after a failed init.
  void ForgetKey(uint64_t key) ABSL_LOCKS_EXCLUDED(mu_);
  // A restarted or joining worker's init: asks the servers for this rank's
  // pushes (RejoinKey) and, when they hold the key, resumes or enters its
  // rounds and joins its init barrier if the others still wait there
  // (the init's result). nullopt when the key is not (wholly) on the servers.
  std::optional<absl::Status> RejoinStoredKey(uint64_t key, uint64_t total,
                                              uint64_t row_length);
  // Rank 0's store of a key: its KV_INIT to every server of each slice's
  // chain, waited for.
  absl::Status StoreKey(uint64_t key, const float* value, uint64_t total,
                        uint64_t row_length, const std::vector<KeyPart>& parts,
                        const std::string& hashed_spec);
  // Joining an elastic job: the key's pushes are numbered from the largest
  // count of the rank's earlier holder over its slices (the entry makes every
  // slice agree), and the key's rounds are entered before the first push
  // (EnterRounds).
  // Until then its pulls carry the smallest count (a pull waits for the
  // pushes it names).
  void EnterLater(uint64_t key, const RequestTracker::RejoinReplies& rejoin)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A joiner's key (the rejoin replies said joining): a dist_sync or
  // dist_async store's enters later (EnterLater); a dist_ssp store's now,
  // at the clock the replies named (docs/consistency.md, "Membership").
  // Errors: the entry's.
  absl::Status EnterJoined(uint64_t key, uint64_t total, uint64_t row_length,
                           const RequestTracker::RejoinReplies& rejoin)
      ABSL_LOCKS_EXCLUDED(mu_, enter_mu_);
  // The row keys' checks: the key exists, is row-sparse or hashed, and (not
  // hashed) every id is below its rows. Returns the row length and whether
  // the key is hashed.
  struct RowKey {
    uint64_t row_length = 0;
    bool hashed = false;
  };
  absl::StatusOr<RowKey> CheckRows(uint64_t key,
                                   absl::Span<const uint64_t> row_ids,
                                   const char* what) const;
  // The part of a row key holding row `id` (an index into `parts`).
  size_t PartOfRow(const std::vector<KeyPart>& parts, bool hashed,
                   uint64_t id) const;
  // Makes the data frames of one part of a push (a message with frames and
  // their descriptors only); `op` owns borrowed frames.
  using PayloadFn = std::function<absl::StatusOr<Message>(
      uint64_t op, size_t part_index, const KeyPart& part)>;

  KVClient(const Options& options, bool sync);
  absl::Status Start(std::unique_ptr<Transport> transport);

  absl::Status CheckOpen() const;
  bool HaveKeys() const;
  // dist_ssp: FailedPrecondition when the store has no bound for its keys
  // yet; OK in other modes. Sets what a KV_INIT tells the servers of the
  // key's mode.
  absl::Status CheckStaleness() const ABSL_LOCKS_EXCLUDED(mu_);
  void SetKeyMode(wire::KVOptions* options) const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<KeyPart> Parts(uint64_t key) const;
  absl::Status CheckKey(uint64_t key, size_t len, const char* what) const;
  // The one pull path (PullAsync, PullViewAsync): a KV_PULL per slice of
  // `key` (`length` values) as a new operation. `prepare` sees the slices
  // before any request goes. An uncompressed slice's request is completed by
  // `plain` (where its reply goes); with pull compression the reply brings
  // this worker's copy of slice i forward and `copied` then takes it.
  using PlainReplyFn =
      std::function<void(size_t, const KeyPart&, RequestTracker::Request*)>;
  using CopiedFn =
      std::function<void(size_t, const KeyPart&, const PulledCopy&)>;
  using PrepareFn = std::function<void(const std::vector<KeyPart>&)>;
  // `owned`: in a local group, the parts this member pulls (empty: all).
  absl::StatusOr<OpHandle> StartPull(uint64_t key, uint64_t length,
                                     const PlainReplyFn& plain,
                                     const CopiedFn& copied,
                                     const PrepareFn& prepare = nullptr,
                                     const std::vector<bool>& owned = {});
  // `total`: values of a dense key, rows of a row-sparse one.
  static Message SliceMessage(wire::Command cmd, uint64_t key,
                              const KeyPart& part, uint64_t total,
                              uint64_t row_length = 0);
  void SendPart(uint64_t op, const KeyPart& part, Message msg, float* out,
                RequestTracker::PartRef ref = {}, bool replayed = false,
                int window = 0);
  // One part of a row push, 2-bit packed (row_ops.cc): the rows of the
  // caller's arrays at `at` (push order), duplicates summed, coded with and
  // into each row's error feedback (KeyInfo::row_slot).
  absl::StatusOr<Message> TwoBitRowsBody(uint64_t key,
                                         const std::vector<size_t>& at,
                                         absl::Span<const uint64_t> row_ids,
                                         absl::Span<const float> rows,
                                         uint64_t row_length, float threshold);
  // What every request of one row pull shares (PullRowsAsync).
  struct RowPull {
    uint64_t op = 0;
    uint64_t key = 0;
    uint64_t total = 0;  // the key's rows
    uint64_t row_length = 0;
    uint64_t pushed = 0;   // push_seq: the pull sees this worker's pushes
    bool bf16 = false;     // pull compression: rows come as bfloat16
    float* out = nullptr;  // the caller's rows
  };
  // Sends a row pull's requests for its rows on one part (`part_index`):
  // `ids`, going to rows `at` of pull.out, in requests of about a slice.
  void SendRowPullRequests(const RowPull& pull, size_t part_index,
                           const KeyPart& part,
                           const std::vector<uint64_t>& ids,
                           const std::vector<uint64_t>& at);
  // A row push's window per server rank (kRowPushInflightChunks): how many of
  // its slices to that server are out at once, by the largest one's bytes.
  std::map<int, int> RowPushWindows(const std::vector<KeyPart>& parts,
                                    const std::vector<Message>& bodies) const;
  // Sends `msg` to every server and waits for all the answers.
  absl::Status Broadcast(const Message& msg, const std::string& what);

  // The one push path: numbers the push, makes each part's payload with
  // `payload` (all before anything is sent, so a failure uses up no number),
  // sends the parts and counts the push.
  // In a local group (`owned` not empty) only the parts this member owns go,
  // each naming the group's other members (`mates`).
  absl::StatusOr<OpHandle> SendPush(wire::Command cmd, uint64_t key, float* out,
                                    const PayloadFn& payload,
                                    const std::vector<bool>& owned = {},
                                    const std::vector<int>& mates = {});
  // The payload of host memory: 2-bit packed (error feedback in the key's
  // residual) or the caller's floats, borrowed.
  PayloadFn HostPayload(uint64_t key, absl::Span<const float> grad);

  // Host-local aggregation (group_ops.cc, docs/local_groups.md).
  // Joins the local group the node table places this worker in (none: OK).
  absl::Status JoinLocalGroup();
  bool grouped() const { return group_ != nullptr; }
  // Values per part of a dense key of `length` values: TESSERA_CHUNK_BYTES,
  // and in a job with local groups at most length / NodeTable's split (and
  // at least kMinGroupPart), the same at every worker.
  static constexpr uint64_t kMinGroupPart = 16384;
  uint64_t DenseChunk(uint64_t length) const;
  // The parts of `info` this member pushes and pulls.
  std::vector<bool> OwnedParts(const KeyInfo& info) const;
  // A dense host push (KV_PUSH, or KV_PUSHPULL into `out`) in a group: the
  // group's sum (float32, or with 2-bit compression each value's count of
  // codes), then this member's parts of it, for the whole group.
  absl::StatusOr<OpHandle> GroupPush(wire::Command cmd, uint64_t key,
                                     absl::Span<const float> grad, float* out);
  // A pull in a group: this member's parts, then (in Wait) the others'
  // from the group (FinishGroupPull).
  absl::StatusOr<OpHandle> GroupPull(uint64_t key, float* out, size_t n,
                                     const PlainReplyFn& plain,
                                     const CopiedFn& copied);
  absl::Status FinishGroupPull(OpHandle handle, absl::Status status);
  // This member's parts of a key as element ranges.
  static std::vector<std::pair<size_t, size_t>> OwnedRanges(
      const std::vector<KeyPart>& parts, const std::vector<bool>& owned);

  // After a restart: every key's pushes resume at the smallest count the
  // servers reported, so a step is repeated whole (its pushes the servers
  // already took are answered as duplicates).
  void SettleResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A restarted worker's Init: where this rank's pushes to `key` resume, the
  // smallest count over the key's server parts. NotFound when a server does
  // not hold the key.
  absl::Status RejoinKey(uint64_t key, uint64_t total, uint64_t row_length,
                         RequestTracker::RejoinReplies* replies);
  // A worker joining an elastic job, before its first push: enters every
  // dist_sync slice of the keys it declared at the same round (two past the
  // furthest open round its rejoins saw, later while a slice refuses), and
  // numbers its pushes to each key from the largest count of its rank's
  // earlier holder. Once; OK at once when not joining.
  absl::Status EnterRounds() ABSL_LOCKS_EXCLUDED(enter_mu_, mu_);
  // EnterRounds' steps: a key whose rounds it enters; the round to enter at
  // (two past the furthest open round of the keys in entering_, collected
  // into `keys`), FailedPrecondition when the keys' rounds are too far
  // apart; one try of the entry (its KV_INITs, waited for); and, the entry
  // taken, the keys' push numbering.
  struct EnteringKey {
    uint64_t key, total, row_length, seq;
    std::vector<KeyPart> parts;
  };
  absl::StatusOr<uint64_t> EntryRoundLocked(std::vector<EnteringKey>* keys)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(enter_mu_, mu_);
  absl::Status SendEntry(const std::vector<EnteringKey>& keys, uint64_t at,
                         RequestTracker::RejoinReplies* replies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(enter_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  void FinishEntry(const std::vector<EnteringKey>& keys, uint64_t at,
                   int attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(enter_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A server restarted (from its checkpoint, or empty): send it again what it
  // may have lost, then the requests still waiting for it, at once.
  void ReplayTo(int server);
  // The scheduler declared `server` dead: what waited for it goes to its
  // slices' next replicas at once.
  void FailOver(int server);
  // Replicated jobs: a replacement took a server's rank, or caught up.
  void ServersChanged();

  const Options options_;
  const bool sync_;
  const KeyPartitioner partitioner_;
  std::unique_ptr<Node> node_;
  // node_ once Start has it: the node's callbacks read this one (they can run
  // on its receiver thread while Node::Start still runs).
  std::atomic<Node*> live_node_{nullptr};
  ReplayLog replay_log_;
  std::unique_ptr<RequestTracker> tracker_;
  DevicePushStager device_;
  std::atomic<bool> closed_{false};

  // Where requests for a server's slices go (chains: TESSERA_REPLICAS > 1,
  // or one copy that moves), from the table's server states.
  ServerRoutes routes_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, KeyInfo> keys_ ABSL_GUARDED_BY(mu_);
  // Push operations not yet waited for: op -> (key, push_seq).
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> push_ops_
      ABSL_GUARDED_BY(mu_);
  bool two_bit_ ABSL_GUARDED_BY(mu_) = false;
  bool pull_two_bit_ ABSL_GUARDED_BY(mu_) = false;
  // dist_ssp (worker/client/bounded_staleness.cc): the store's mode, and the
  // bound its key inits carry (-1: not given yet).
  bool ssp_ ABSL_GUARDED_BY(mu_) = false;
  int64_t staleness_ ABSL_GUARDED_BY(mu_) = -1;
  float threshold_ ABSL_GUARDED_BY(mu_) = 0;
  // A restarted worker's push numbering: kPending once an Init learned a
  // count from the servers, kSettled after SettleResumeLocked.
  enum class Resume { kNone, kPending, kSettled };
  Resume resume_ ABSL_GUARDED_BY(mu_) = Resume::kNone;
  uint64_t resume_round_ ABSL_GUARDED_BY(mu_) = 0;
  // Joining an elastic job: the keys whose rounds it has yet to enter
  // (EnterRounds), whether there are any (read without a lock on every
  // push), and whether it entered (keys declared later enter with their
  // first push).
  absl::Mutex enter_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<uint64_t> entering_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> entering_pending_{false};
  bool entered_ ABSL_GUARDED_BY(mu_) = false;
  KVWorkerStats stats_ ABSL_GUARDED_BY(mu_);
  // Host-local aggregation: the group (set by Start, then read-only), the
  // members' worker ranks by local rank, the parts of the keys declared so
  // far, and the pulls (and pushpulls) whose other parts come from the
  // group once their own are in (op -> where, and the member's ranges).
  // group_mu_ keeps one collective at a time (each member must make the
  // group's calls in the same order: one thread's, or the same order).
  std::unique_ptr<LocalGroup> group_;
  std::vector<int> group_ranks_;
  uint32_t group_split_ = 0;  // NodeTable.local_group_split
  // Each key's priority (docs/priority.md), read on every send: a leaf lock.
  // A key's default is minus the keys declared before it.
  mutable absl::Mutex priority_mu_ ABSL_ACQUIRED_AFTER(mu_);
  absl::flat_hash_map<uint64_t, int32_t> priorities_
      ABSL_GUARDED_BY(priority_mu_);
  int64_t declared_keys_ ABSL_GUARDED_BY(priority_mu_) = 0;
  uint64_t last_declared_ ABSL_GUARDED_BY(priority_mu_) = 0;
  // Puts the key's priority in a push's or pull's header (unless
  // TESSERA_SEND_ORDER=fifo).
  void Prioritise(Message* msg) const ABSL_LOCKS_EXCLUDED(priority_mu_);
  absl::Mutex group_mu_;
  uint64_t group_parts_ ABSL_GUARDED_BY(mu_) = 0;
  struct GroupPullOp {
    float* out = nullptr;
    size_t n = 0;
    std::vector<std::pair<size_t, size_t>> mine;
  };
  std::map<uint64_t, GroupPullOp> group_pulls_ ABSL_GUARDED_BY(mu_);
  // tessera_worker_* counters of stats() (docs/metrics.md); first to go.
  CollectorHandles metric_handles_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_KV_CLIENT_H_

// KVServer: one server's shard of the weights and the rules that update it.
//
// Keys arrive as slices (a whole small array, or this server's part of a split
// one). dist_sync: the pushes of one round (one per worker) are summed in rank
// order, so the result does not depend on arrival order; the updater is applied
// once to the sum (or, with no updater, the sum replaces the value), then the
// held pushes and pulls are answered. dist_async: each push is applied on
// arrival; without an updater it is an error reply. Keys are spread over update
// threads by hash; each key's state is owned by one thread at a time, so a
// key's messages are handled in arrival order without locks. When a key's
// update thread has nothing queued, a cheap message (a pull, a message of up to
// 64 KB, a push that needs no arithmetic) is handled on Handle's thread
// instead, saving the hand-off; its reply is then sent from that thread.
//
//   KVServer server(/*num_workers=*/4, /*threads=*/2,
//                   [&](int peer, Message m) { return node->Send(peer,
//                   std::move(m)); });
//   node callback: server.Handle(std::move(message));
//   ...
//   server.Stop();
//
// Thread-safety: Handle is called from one thread (the node's receiver); it
// blocks when the update threads' bounded queues are full. stats() may be
// called from any thread.
#ifndef TESSERA_SERVER_KV_SERVER_H_
#define TESSERA_SERVER_KV_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/bounded_queue.h"
#include "common/message.h"
#include "proto/tessera.pb.h"
#include "server/optimizer.h"

namespace tessera {

class KVServer {
 public:
  using SendFn = std::function<absl::Status(int peer, Message msg)>;

  // Each key's mode (dist_sync or dist_async) comes with its KV_INIT.
  KVServer(int num_workers, int num_threads, SendFn send);
  ~KVServer();

  // Takes a data-plane message (KV_*); replies through the SendFn.
  void Handle(Message&& msg);

  // Checkpoints. Snapshot waits until the update threads are idle and copies
  // every key (weights, optimizer state, steps, and per worker the pushes the
  // weights include) and the settings; MarkDurable then tells later push
  // replies that those pushes are safe on disk. Both must be called from
  // Handle's thread (or while no Handle runs).
  wire::ServerCheckpoint Snapshot();
  void MarkDurable(const wire::ServerCheckpoint& saved);
  // Loads a checkpoint into an empty server, before the first Handle. The
  // server then holds pushes and pulls of keys it does not know yet (a worker
  // replaying them may come before the init that creates the key).
  absl::Status Restore(const wire::ServerCheckpoint& saved);
  // Push replies say that this server checkpoints, so workers keep their
  // pushes until they are durable.
  void set_checkpointing(bool on) { checkpointing_ = on; }
  // A restarted server with nothing to restore: it holds requests for keys
  // that the workers' replay has not initialised yet.
  void set_recovering();
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

 private:
  struct KeyState;
  struct Shard;
  struct Settings {
    std::shared_ptr<const Optimizer> optimizer;  // null: no updater
    std::string optimizer_spec = "none";
    std::string compression = "none";
    float threshold = 0;
  };

  void Run(Shard* shard);
  // Whether `msg` is cheap enough to process on Handle's thread when its shard
  // is idle.
  bool ProcessInline(const Message& msg) const;
  void Process(Shard* shard, Message&& msg);
  // Returns false when `msg` must wait for the current round to finish.
  bool TryProcess(Shard* shard, KeyState* key, Message& msg);
  void CompleteRound(Shard* shard, KeyState* key);
  // Applies the optimizer to one key with `grad` (key->length floats).
  void ApplyUpdate(const Optimizer& optimizer, KeyState* key,
                   const float* grad);
  void ReplayBacklog(Shard* shard, KeyState* key);
  void CountKeyPush(uint64_t key);
  // Blocks until every update thread is idle (only Handle's thread queues).
  void WaitIdle();
  void HandleSettings(Message&& msg);
  void Reply(const Message& request, const absl::Status& status,
             Buffer values = Buffer(), const KeyState* key = nullptr);
  // Tells the sender its request arrived and is waiting; the reply follows.
  void Acknowledge(const Message& request);
  KeyState* CreateKey(Shard* shard, const wire::KeySlice& slice, bool sync);
  absl::StatusOr<Buffer> DecodeGradient(const Message& msg, const KeyState& key,
                                        const Settings& settings);
  Settings settings() const;

  const int num_workers_;
  const SendFn send_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::thread> threads_;

  mutable absl::Mutex settings_mu_;
  Settings settings_ ABSL_GUARDED_BY(settings_mu_);
  std::atomic<uint64_t> num_keys_{0};

  std::atomic<uint64_t> pushes_applied_{0};
  std::atomic<uint64_t> rounds_applied_{0};
  std::atomic<uint64_t> async_applied_{0};
  std::atomic<uint64_t> duplicates_{0};
  std::atomic<uint64_t> checkpoints_{0};
  std::atomic<bool> checkpointing_{false};
  std::atomic<bool> recovering_{false};
  mutable absl::Mutex key_counts_mu_;
  std::map<uint64_t, uint64_t> key_pushes_ ABSL_GUARDED_BY(key_counts_mu_);
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<bool> stopped_{false};
  std::function<void()> on_workers_finished_;
  std::set<int> finished_workers_;  // ranks; Handle's thread only
};

}  // namespace tessera

#endif  // TESSERA_SERVER_KV_SERVER_H_

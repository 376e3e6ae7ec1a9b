// KVServer's private parts that its rooms share (not installed, not for
// other code): an update thread's shard, a hand-back's job, the error an
// elastic job's absent worker gets. KVServer's methods live in one file per
// room (docs/architecture.md):
//   kv_server.cc          threads, routing, settings, replies
//   kv_server_metrics.cc  metrics, KV_STATS counts, /debug/pending
//   rounds.cc             the slice data path: init, rounds, checkpoints,
//                         elastic workers
//   chain_replication.cc  a slice's updates to its backups and their answers
//   handback.cc           table changes: promotion, hand-back and leave
//   transfer.cc           slices sent to and taken by a replacement
//                         (its catch-up: server/catch_up.h)
//   bounded_staleness.cc  dist_ssp: a slice's staleness gate, the pulls it
//                         holds (the rule: server/staleness.h)
#ifndef TESSERA_SERVER_KV_SERVER_SHARD_H_
#define TESSERA_SERVER_KV_SERVER_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/bounded_queue.h"
#include "server/key_store.h"
#include "server/kv_server.h"

namespace tessera {

// What an update thread's queue holds at most: messages and their bytes.
constexpr size_t kShardQueueMessages = 4096;
constexpr uint64_t kShardQueueBytes = uint64_t{128} << 20;

// One update thread's work: messages of its keys, and tasks (checkpoint
// snapshots, durable marks) that must run between them.
struct KVServer::Shard {
  Shard(int num_workers, WaitingLimits limits, SyncRound::Mode sum_mode)
      : queue(kShardQueueMessages, kShardQueueBytes),
        phase_since_ns(absl::GetCurrentTimeNanos()),
        store(num_workers, limits, sum_mode) {}
  struct Work {
    Message msg;
    std::function<void(Shard*)> task;  // set: run it instead
  };
  BoundedQueue<Work> queue;
  // Work queued for the shard's thread and not yet done. Only Handle's thread
  // adds to it, so when it reads 0 the update thread is idle in Pop and the
  // keys may be handled on Handle's thread (release/acquire hands them over).
  std::atomic<int64_t> pending{0};
  // What the update thread does (for /debug/pending): the command of the
  // message it handles (0 idle, -1 a task), its key, and since when.
  std::atomic<int> phase{0};
  std::atomic<uint64_t> phase_key{0};
  std::atomic<int64_t> phase_since_ns;
  KeyStore store;  // owned by the shard's thread, or by Handle's thread while
                   // pending == 0
  // Replication, owned as `store` is: the node table's server states.
  std::vector<ServerState> states;
  // A hand-back in progress (HandBack): the slices that stop, and the job
  // (null once this shard's part is done, or none runs).
  std::vector<StoredKey*> yielding;
  std::shared_ptr<HandbackJob> handback;
  int handback_rank = -1;       // the rank taking its place back; -1: none
  bool handback_leave = false;  // one copy: the rank leaves instead
  // One copy: slices this shard gave to a server that joined and dropped;
  // a request for one that still comes here is dropped (the worker sends
  // it again to the new server once its table says so).
  std::set<std::pair<uint64_t, uint64_t>> moved_away;
};

struct KVServer::HandbackJob {
  uint64_t epoch = 0;
  std::function<void(uint64_t)> ready;
  absl::Mutex mu;
  size_t remaining ABSL_GUARDED_BY(mu) = 0;  // shards not done yet
};

// Elastic jobs: what a worker out of the job is told.
inline absl::Status NotInJob(int rank) {
  return absl::FailedPreconditionError(
      absl::StrCat("worker ", rank,
                   " is not in the job (TESSERA_ELASTIC: it left, or has not "
                   "joined); the rounds go on without it"));
}

}  // namespace tessera

#endif  // TESSERA_SERVER_KV_SERVER_SHARD_H_

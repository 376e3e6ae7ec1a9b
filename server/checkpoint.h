// Checkpoint files of a server's shard: written atomically (write to a
// temporary file, fsync, rename, fsync the folder), the newest K kept, and read
// back with their integrity checked, so a restarted server resumes from the
// last complete one.
//
//   CheckpointStore store("/var/tessera/ckpt", /*server_rank=*/1, /*keep=*/3);
//   wire::ServerCheckpoint shard = ...;
//   absl::Status s = store.Write(shard);            // sets shard.sequence
//   absl::StatusOr<std::optional<wire::ServerCheckpoint>> last = store.LoadLatest();
//
// File format: "TSCK" magic, a 4-byte version, the 8-byte payload length, the
// payload (a serialized wire::ServerCheckpoint) and its CRC-32, all
// little-endian. A file that is short, has a wrong magic, version, length or
// CRC, or does not parse is DataLoss; LoadLatest skips it (with a warning) and
// tries the next older one.
//
// Thread-safety: one writer per store; reading may happen from any thread.
#ifndef TESSERA_SERVER_CHECKPOINT_H_
#define TESSERA_SERVER_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/tessera.pb.h"

namespace tessera {

class CheckpointStore {
 public:
  // REQUIRES: keep >= 1. The folder is created on the first Write.
  CheckpointStore(std::string dir, int server_rank, int keep);

  // Writes `shard` as the next checkpoint (its sequence is set to one more than
  // the newest on disk), then deletes all but the newest `keep`. Unavailable
  // with the OS error when the folder or file cannot be written; nothing
  // half-written is ever visible under a checkpoint name.
  absl::Status Write(wire::ServerCheckpoint& shard);

  // The newest readable checkpoint of this server, or nullopt when there is
  // none.
  absl::StatusOr<std::optional<wire::ServerCheckpoint>> LoadLatest() const;

  // Checkpoint files of this server, oldest first.
  std::vector<std::string> List() const;

  // Reads and checks one file. DataLoss naming the file and the problem.
  static absl::StatusOr<wire::ServerCheckpoint> ReadFile(
      const std::string& path);

 private:
  std::string FileName(uint64_t sequence) const;

  const std::string dir_;
  const int server_rank_;
  const int keep_;
};

// When a server writes checkpoints: every N updates it applied (a dist_sync
// round of one key, or one dist_async push, counts as one update), or every so
// many seconds.
struct CheckpointPolicy {
  uint64_t every_updates = 0;                   // 0: not by updates
  absl::Duration every = absl::ZeroDuration();  // zero: not by time

  // "100" (updates) or "30s" (seconds). InvalidArgument naming the flag and
  // what was expected.
  static absl::StatusOr<CheckpointPolicy> Parse(const std::string& text);
};

class KVServer;

// Writes a KVServer's checkpoints by its policy, on a thread of its own so that
// a slow disk never stalls the server's traffic or heartbeats. MaybeWrite is
// called on the server's Handle thread before each message: when a checkpoint
// is due (and none is being written) it asks the server for a snapshot, which
// the update threads take between messages, so each key's weights and
// exactly-once counts agree; the writer thread then writes it. When a write
// has finished, the next MaybeWrite tells the server which pushes are durable.
// A failed write is logged and the server keeps serving (workers then keep
// their pushes for longer).
class Checkpointer {
 public:
  // `write_delay` (testing only, TESSERA_TEST_CHECKPOINT_DELAY) holds every
  // write for that long, as a slow disk would.
  Checkpointer(CheckpointStore* store, CheckpointPolicy policy,
               KVServer* server,
               absl::Duration write_delay = absl::ZeroDuration());
  // Stops the writer thread after the write in progress (a snapshot waiting
  // to be written is dropped). REQUIRES: the server's update threads have
  // stopped (KVServer::Stop), so no snapshot arrives afterwards.
  ~Checkpointer();

  // Also reports a write that has run for kSlowWrite or longer (INFO, every
  // kProgressInterval): "writing checkpoint (12.3 MB, 4 key(s)): 2s so far".
  void MaybeWrite();
  // Writes one checkpoint now and waits for it (tests). REQUIRES: called on
  // the Handle thread, while no Handle runs.
  absl::Status WriteNow();
  // True while a checkpoint is being taken or written.
  bool busy() const;

 private:
  void Start();
  void WriterLoop();
  // Hands a finished write's durable counts to the server.
  void Collect();
  // Logs a write in progress once it is slow; see MaybeWrite.
  void ReportSlowWrite();

  // Writes that take this long are logged at INFO (start and end); shorter
  // ones only with PS_VERBOSE, so short jobs stay quiet.
  static constexpr absl::Duration kSlowWrite = absl::Seconds(1);
  static constexpr absl::Duration kProgressInterval = absl::Seconds(5);

  CheckpointStore* const store_;
  const CheckpointPolicy policy_;
  KVServer* const server_;
  const absl::Duration write_delay_;
  uint64_t last_updates_ = 0;  // Handle's thread
  absl::Time last_time_;       // Handle's thread

  // Metrics (MetricsRegistry::Global()).
  Histogram* const total_duration_;
  Histogram* const write_duration_;
  Counter* const failures_;

  mutable absl::Mutex mu_;
  bool in_progress_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<wire::ServerCheckpoint> to_write_ ABSL_GUARDED_BY(mu_);
  absl::Time to_write_asked_ ABSL_GUARDED_BY(mu_);  // when its snapshot was
  std::optional<absl::StatusOr<std::shared_ptr<const wire::ServerCheckpoint>>>
      written_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The write in progress (InfiniteFuture when none), its size and when it was
  // last reported.
  absl::Time writing_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  size_t writing_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int writing_keys_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time writing_reported_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::thread writer_;
  CollectorHandles metric_handles_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_CHECKPOINT_H_

// Checkpoint files of a server's shard: written atomically (write to a
// temporary file, fsync, rename, fsync the folder), the newest K kept, and read
// back with their integrity checked, so a restarted server resumes from the
// last complete one.
//
//   CheckpointStore store("/var/tessera/ckpt", /*server_rank=*/1, /*keep=*/3);
//   wire::ServerCheckpoint shard = ...;
//   absl::Status s = store.Write(shard);            // sets shard.sequence
//   absl::StatusOr<std::optional<wire::ServerCheckpoint>> last =
//   store.LoadLatest();
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
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
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
  uint64_t every_updates = 0;  // 0: not by updates
  absl::Duration every = absl::ZeroDuration();  // zero: not by time

  // "100" (updates) or "30s" (seconds). InvalidArgument naming the flag and
  // what was expected.
  static absl::StatusOr<CheckpointPolicy> Parse(const std::string& text);
};

class KVServer;

// Writes a KVServer's checkpoints by its policy. MaybeWrite is called on the
// server's Handle thread before each message; a failed write is logged and the
// server keeps serving (workers then keep their pushes for longer).
class Checkpointer {
 public:
  Checkpointer(CheckpointStore* store, CheckpointPolicy policy,
               KVServer* server);
  void MaybeWrite();
  // Writes one checkpoint now.
  absl::Status Write();

 private:
  CheckpointStore* const store_;
  const CheckpointPolicy policy_;
  KVServer* const server_;
  uint64_t last_updates_ = 0;
  absl::Time last_time_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_CHECKPOINT_H_

// ZmqRecordSink: the sealed lane's way onto the wire. It sends a link's sealed
// records (sealed_link.h), each one ZeroMQ message of one frame, in memory
// that counts in the link's Backlog until ZeroMQ has written the record out,
// so that the ZeroMQ transport (zmq_transport_internal.h) seals at most
// kBacklogLimit ahead of its socket.
//
//   auto backlog = std::make_shared<Backlog>();
//   backlog->resume = [] { ... hand the link to the SealPool ... };
//   ZmqRecordSink sink(socket, backlog, blocks);
//   sealer.SealNext(job, sink);   // Allocate, then Emit, per record
//
// Thread-safety: a sink is used by one thread at a time (under its link's
// lock); Backlog and BlockCache from any thread (records are freed on
// ZeroMQ's I/O thread).
#ifndef TESSERA_COMMON_ZMQ_RECORD_SINK_H_
#define TESSERA_COMMON_ZMQ_RECORD_SINK_H_

#include <zmq.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/sealed_link.h"

namespace tessera::zmq_internal {

// What ZeroMQ holds of one sealed link's records. Each record's free callback
// (run by ZeroMQ once the record is written out, on its I/O thread) takes its
// bytes off, so that sealing runs at most kBacklogLimit ahead of the socket:
// what waits beyond that waits as references to the caller's frames, as an
// unsealed message would in ZeroMQ's queue, not as sealed copies (a server
// answering 16 workers' pulls of a 32 MB key would otherwise queue 512 MB of
// ciphertext).
constexpr int64_t kBacklogLimit = 1 << 20;
// Sealing resumes once the backlog is down to this.
constexpr int64_t kBacklogResume = 512 << 10;

// One per connection of a link (a socket: a refused one is replaced).
struct Backlog {
  std::atomic<int64_t> bytes{0};
  // Work of the link waits for room: the free callback that makes room
  // hands the link to the pool.
  std::atomic<bool> waiting{false};
  std::function<void()> resume;  // set once, before any record is sent
  // Under the link's lock (the sink's user): bytes of records ever made for
  // this socket (those freed unsent taken off again), and how many of them
  // ZeroMQ is known to have taken out of its queue onto the connection.
  // A record ZeroMQ frees while the socket still has its pipe was written
  // (a refusal ends the pipe before its records are freed), so what was
  // freed before a send that then succeeded went out: the transport counts
  // the messages past `confirmed` as lost when the connection is refused.
  int64_t allocated = 0;
  int64_t confirmed = 0;
};

// Memory for full-size records, reused: records are sealed on many threads
// (callers, the pool) and freed on ZeroMQ's, and with glibc each thread
// allocating large blocks grows an arena of its own, so fresh blocks per
// record cost a server with 16 links about 60 MB more at its peak.
class BlockCache {
 public:
  explicit BlockCache(size_t block_bytes) : block_bytes_(block_bytes) {}
  ~BlockCache();
  size_t block_bytes() const { return block_bytes_; }
  void* Take();
  void Give(void* block);

 private:
  static constexpr size_t kKeep = 64;
  const size_t block_bytes_;
  absl::Mutex mu_;
  std::vector<void*> free_ ABSL_GUARDED_BY(mu_);
};

// Bytes ahead of each record in its block (its bookkeeping): a BlockCache for
// records of n bytes holds blocks of kRecordBlockHead + n.
constexpr size_t kRecordBlockHead = 64;  // keeps the record 64-byte aligned

// Sends a link's sealed records, each one ZeroMQ message of one frame, so
// that ZeroMQ's I/O thread writes a record out while the next is sealed.
class ZmqRecordSink : public sealed::RecordSink {
 public:
  ZmqRecordSink(void* socket, std::shared_ptr<Backlog> backlog,
                std::shared_ptr<BlockCache> cache)
      : socket_(socket),
        backlog_(std::move(backlog)),
        cache_(std::move(cache)) {}
  ~ZmqRecordSink() override;
  uint8_t* Allocate(size_t size) override;
  // Sends the record, waiting at most the socket's send time-out for room.
  // Unavailable when it cannot; refused() then says whether the socket has
  // no pipe left (its connection was refused: ZeroMQ never connects it
  // again).
  absl::Status Emit() override;
  bool refused() const { return refused_; }

 private:
  // After a send found no room: waits for room (ZeroMQ's queue full), up
  // to the send time-out, and sends `msg`. False (with `*error`) when the
  // time-out passed, or at once when the socket has no pipe.
  bool WaitForRoom(zmq_msg_t* msg, std::string* error);
  void* socket_;
  std::shared_ptr<Backlog> backlog_;
  std::shared_ptr<BlockCache> cache_;
  void* block_ = nullptr;
  size_t size_ = 0;
  bool refused_ = false;
};

}  // namespace tessera::zmq_internal

#endif  // TESSERA_COMMON_ZMQ_RECORD_SINK_H_

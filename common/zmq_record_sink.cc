#include "common/zmq_record_sink.h"

#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera::zmq_internal {
namespace {

// While a send waits for room, whether the socket still has a pipe is
// looked at this often.
constexpr int kRoomLookMs = 100;

// A record's memory: the link's backlog it counts in, then the record.
struct RecordBlock {
  std::shared_ptr<Backlog> backlog;
  std::shared_ptr<BlockCache> cache;  // set when the block came from it
  size_t size;
};
static_assert(sizeof(RecordBlock) <= kRecordBlockHead);

void FreeRecord(void* /*data*/, void* hint) {
  auto* block = static_cast<RecordBlock*>(hint);
  std::shared_ptr<Backlog> backlog = std::move(block->backlog);
  std::shared_ptr<BlockCache> cache = std::move(block->cache);
  const int64_t size = static_cast<int64_t>(block->size);
  block->~RecordBlock();
  if (cache != nullptr) {
    cache->Give(hint);
  } else {
    std::free(hint);
  }
  const int64_t left = backlog->bytes.fetch_sub(size) - size;
  if (left <= kBacklogResume && backlog->waiting.exchange(false))
    backlog->resume();
}

}  // namespace

BlockCache::~BlockCache() {
  for (void* b : free_) std::free(b);
}

void* BlockCache::Take() {
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      void* b = free_.back();
      free_.pop_back();
      return b;
    }
  }
  return std::malloc(block_bytes_);
}

void BlockCache::Give(void* block) {
  {
    absl::MutexLock lock(&mu_);
    if (free_.size() < kKeep) {
      free_.push_back(block);
      return;
    }
  }
  std::free(block);
}

ZmqRecordSink::~ZmqRecordSink() {
  if (block_ == nullptr) return;
  backlog_->allocated -= static_cast<int64_t>(size_);
  FreeRecord(nullptr, block_);
}

uint8_t* ZmqRecordSink::Allocate(size_t size) {
  const bool cached =
      cache_ != nullptr && kRecordBlockHead + size == cache_->block_bytes();
  block_ = cached ? cache_->Take() : std::malloc(kRecordBlockHead + size);
  new (block_) RecordBlock{backlog_, cached ? cache_ : nullptr, size};
  backlog_->bytes.fetch_add(static_cast<int64_t>(size));
  backlog_->allocated += static_cast<int64_t>(size);
  size_ = size;
  return static_cast<uint8_t*>(block_) + kRecordBlockHead;
}

absl::Status ZmqRecordSink::Emit() {
  zmq_msg_t msg;
  zmq_msg_init_data(&msg, static_cast<uint8_t*>(block_) + kRecordBlockHead,
                    size_, FreeRecord, block_);
  block_ = nullptr;  // the message owns it now
  // What ZeroMQ had freed before this send (Backlog::confirmed).
  const int64_t freed = backlog_->allocated - backlog_->bytes.load();
  std::string error;
  if (zmq_msg_send(&msg, socket_, ZMQ_DONTWAIT) >= 0 ||
      (zmq_errno() == EAGAIN && WaitForRoom(&msg, &error))) {
    backlog_->confirmed = std::max(backlog_->confirmed, freed);
    return absl::OkStatus();
  }
  if (error.empty()) error = zmq_strerror(zmq_errno());
  backlog_->allocated -= static_cast<int64_t>(size_);
  zmq_msg_close(&msg);  // frees the record, takes its bytes off
  return absl::UnavailableError(error);
}

bool ZmqRecordSink::WaitForRoom(zmq_msg_t* msg, std::string* error) {
  int timeout_ms = -1;
  size_t len = sizeof(timeout_ms);
  zmq_getsockopt(socket_, ZMQ_SNDTIMEO, &timeout_ms, &len);
  const absl::Time deadline =
      timeout_ms < 0 ? absl::InfiniteFuture()
                     : absl::Now() + absl::Milliseconds(timeout_ms);
  while (true) {
    // Nothing of this socket's is left in ZeroMQ but this record, and still
    // no room: it has no pipe. A full pipe has records in it, and one that
    // has just emptied is writable again: its reader sent the word before
    // the records it read were freed, and ZMQ_EVENTS takes it in. (ZeroMQ
    // 4.3.4 learns of room in batches of about SNDHWM messages, so a pipe
    // far from full may refuse a send for a moment.)
    if (backlog_->bytes.load() == static_cast<int64_t>(size_)) {
      int events = 0;
      len = sizeof(events);
      if (zmq_getsockopt(socket_, ZMQ_EVENTS, &events, &len) == 0 &&
          (events & ZMQ_POLLOUT) == 0) {
        refused_ = true;
        *error = "its connection was refused (no pipe left)";
        return false;
      }
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      *error = zmq_strerror(EAGAIN);
      return false;
    }
    // A short wait, then the look above again: the pipe may go meanwhile.
    zmq_pollitem_t item = {socket_, 0, ZMQ_POLLOUT, 0};
    const long wait_ms = absl::ToInt64Milliseconds(
        std::min(left, absl::Milliseconds(kRoomLookMs)));
    if (zmq_poll(&item, 1, std::max(1L, wait_ms)) < 0 && zmq_errno() != EINTR) {
      *error = zmq_strerror(zmq_errno());
      return false;
    }
    if ((item.revents & ZMQ_POLLOUT) == 0) continue;
    if (zmq_msg_send(msg, socket_, ZMQ_DONTWAIT) >= 0) return true;
    if (zmq_errno() != EAGAIN) {
      *error = zmq_strerror(zmq_errno());
      return false;
    }
  }
}

}  // namespace tessera::zmq_internal

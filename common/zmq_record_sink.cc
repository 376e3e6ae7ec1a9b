#include "common/zmq_record_sink.h"

#include <zmq.h>

#include <cstdlib>
#include <new>
#include <string>
#include <utility>

namespace tessera::zmq_internal {
namespace {

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
  if (block_ != nullptr) FreeRecord(nullptr, block_);
}

uint8_t* ZmqRecordSink::Allocate(size_t size) {
  const bool cached =
      cache_ != nullptr && kRecordBlockHead + size == cache_->block_bytes();
  block_ = cached ? cache_->Take() : std::malloc(kRecordBlockHead + size);
  new (block_) RecordBlock{backlog_, cached ? cache_ : nullptr, size};
  backlog_->bytes.fetch_add(static_cast<int64_t>(size));
  size_ = size;
  return static_cast<uint8_t*>(block_) + kRecordBlockHead;
}

absl::Status ZmqRecordSink::Emit() {
  zmq_msg_t msg;
  zmq_msg_init_data(&msg, static_cast<uint8_t*>(block_) + kRecordBlockHead,
                    size_, FreeRecord, block_);
  block_ = nullptr;  // the message owns it now
  if (zmq_msg_send(&msg, socket_, 0) < 0) {
    const std::string err = zmq_strerror(zmq_errno());
    zmq_msg_close(&msg);  // frees the record, takes its bytes off
    return absl::UnavailableError(err);
  }
  return absl::OkStatus();
}

}  // namespace tessera::zmq_internal

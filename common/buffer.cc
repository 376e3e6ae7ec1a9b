#include "common/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <new>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera {
namespace {

// Large buffers come from the system as fresh mappings, and a fresh mapping
// costs a page fault and a cleared page for every 4 KiB the first time it is
// touched: on this project's 2-core VM a 100 MB row push + pull spent more
// time in the kernel clearing pages than in all of its own copies and sums
// (docs/benchmarks-history.md, "Every stage of a round"). glibc hands back
// blocks above its mmap threshold (at most 32 MiB) to the system on free, so
// every large message paid it again. BlockPool keeps freed large blocks for
// reuse:
//
//   - Sizes are rounded up to a class, eight per power of two (at most 12.5%
//     more), and a block is reused only for its own class.
//   - Blocks are mapped 2 MiB-aligned and advised MADV_HUGEPAGE: where the
//     kernel's transparent huge pages allow it (`madvise` or `always`), a
//     first touch costs one fault per 2 MiB instead of 512.
//   - The pool never raises the process's peak: a miss first returns cached
//     blocks (oldest first) of at least the new block's size to the system,
//     so pooled memory in use plus cached never exceeds the most that was in
//     use at once. It also caches at most kPoolLimit bytes.
constexpr size_t kPooledMin = size_t{1} << 20;
constexpr size_t kPoolLimit = size_t{1} << 30;
constexpr size_t kHugePage = size_t{2} << 20;

size_t ClassBytes(size_t size) {
  const int top = 63 - __builtin_clzll(size);
  const size_t step = size_t{1} << (top - 3);
  return (size + step - 1) & ~(step - 1);
}

class BlockPool {
 public:
  static BlockPool& Get() {
    static BlockPool* pool = new BlockPool;  // never destroyed: buffers
    return *pool;                            // may outlive static teardown
  }

  // A block of `bytes` (a class size), 2 MiB-aligned; nullptr when the
  // system has no memory.
  void* Take(size_t bytes) {
    std::deque<Block> evicted;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = cached_.begin(); it != cached_.end(); ++it) {
        if (it->bytes == bytes) {
          void* p = it->ptr;
          cached_bytes_ -= bytes;
          cached_.erase(it);
          return p;
        }
      }
      size_t freed = 0;
      while (!cached_.empty() && freed < bytes) {
        freed += cached_.front().bytes;
        cached_bytes_ -= cached_.front().bytes;
        evicted.push_back(cached_.front());
        cached_.pop_front();
      }
    }
    for (const Block& b : evicted) munmap(b.ptr, b.bytes);
    return Map(bytes);
  }

  void Give(void* ptr, size_t bytes) {
    std::deque<Block> evicted;
    {
      absl::MutexLock lock(&mu_);
      cached_.push_back({ptr, bytes});
      cached_bytes_ += bytes;
      while (cached_bytes_ > kPoolLimit) {
        cached_bytes_ -= cached_.front().bytes;
        evicted.push_back(cached_.front());
        cached_.pop_front();
      }
    }
    for (const Block& b : evicted) munmap(b.ptr, b.bytes);
  }

  size_t cached_bytes() {
    absl::MutexLock lock(&mu_);
    return cached_bytes_;
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  static void* Map(size_t bytes) {
    // Over-map by a huge page and trim both ends to align.
    const size_t span = bytes + kHugePage;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + span;
    if (end > aligned + bytes)
      munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
    void* p = reinterpret_cast<void*>(aligned);
    madvise(p, bytes, MADV_HUGEPAGE);  // advice: failure changes nothing
    return p;
  }

  absl::Mutex mu_;
  std::deque<Block> cached_ ABSL_GUARDED_BY(mu_);  // oldest first
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

Buffer Buffer::Allocate(size_t size) {
  Buffer b;
  b.size_ = size;
  if (size == 0) {
    b.owner_ = std::shared_ptr<const void>(nullptr, [](const void*) {});
    return b;
  }
  if (size >= kPooledMin) {
    if (size > (size_t{1} << 62)) throw std::bad_alloc();  // no class wraps
    const size_t bytes = ClassBytes(size);
    void* p = BlockPool::Get().Take(bytes);
    if (p == nullptr) throw std::bad_alloc();
    b.data_ = static_cast<const uint8_t*>(p);
    b.owner_ = std::shared_ptr<const void>(p, [bytes](const void* q) {
      BlockPool::Get().Give(const_cast<void*>(q), bytes);
    });
    return b;
  }
  // malloc and align by hand: glibc's aligned_alloc carves the block out of
  // a larger one and frees the rest, several times the cost of a malloc for
  // the small buffers every message needs (a received frame that ZeroMQ left
  // unaligned is copied into one).
  void* raw = std::malloc(size + 63);
  if (raw == nullptr) throw std::bad_alloc();
  const uintptr_t aligned =
      (reinterpret_cast<uintptr_t>(raw) + 63) & ~static_cast<uintptr_t>(63);
  b.data_ = reinterpret_cast<const uint8_t*>(aligned);
  b.owner_ = std::shared_ptr<const void>(
      b.data_, [raw](const void*) { std::free(raw); });
  return b;
}

size_t BufferPoolCachedBytesForTesting() {
  return BlockPool::Get().cached_bytes();
}

Buffer Buffer::CopyOf(const void* data, size_t size) {
  Buffer b = Allocate(size);
  if (size > 0) std::memcpy(b.mutable_data(), data, size);
  return b;
}

Buffer Buffer::Wrap(const void* data, size_t size,
                    std::shared_ptr<const void> owner) {
  Buffer b;
  b.data_ = static_cast<const uint8_t*>(data);
  b.size_ = size;
  b.owner_ = std::move(owner);
  return b;
}

bool Buffer::unique() const {
  // use_count() is a relaxed load: seeing 1 does not order the last reader's
  // accesses before ours. Taking and dropping a reference does: both are
  // read-modify-writes of the count after the reader's releasing decrement,
  // and dropping one is an acquire-release decrement (libstdc++ and libc++).
  // ThreadSanitizer sees this; it does not model a standalone acquire fence.
  if (owner_.use_count() != 1) return false;
  const std::shared_ptr<const void> acquire = owner_;
  return true;
}

}  // namespace tessera

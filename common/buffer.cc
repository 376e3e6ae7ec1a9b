#include "common/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace tessera {

Buffer Buffer::Allocate(size_t size) {
  Buffer b;
  b.size_ = size;
  if (size == 0) {
    b.owner_ = std::shared_ptr<const void>(nullptr, [](const void*) {});
    return b;
  }
  // malloc and align by hand: glibc's aligned_alloc carves the block out of
  // a larger one and frees the rest, several times the cost of a malloc for
  // the small buffers every message needs (a received frame that ZeroMQ left
  // unaligned is copied into one).
  void* raw = std::malloc(size + 63);
  if (raw == nullptr) throw std::bad_alloc();
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + 63) &
                            ~static_cast<uintptr_t>(63);
  b.data_ = reinterpret_cast<const uint8_t*>(aligned);
  b.owner_ = std::shared_ptr<const void>(
      b.data_, [raw](const void*) { std::free(raw); });
  return b;
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

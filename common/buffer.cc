#include "common/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace tessera {

Buffer Buffer::Allocate(size_t size) {
  const size_t rounded = ((size + 63) / 64) * 64;
  void* memory = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  if (rounded != 0 && memory == nullptr) throw std::bad_alloc();
  Buffer b;
  b.data_ = static_cast<const uint8_t*>(memory);
  b.size_ = size;
  b.owner_ = std::shared_ptr<const void>(
      memory, [](const void* p) { std::free(const_cast<void*>(p)); });
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

// Buffer: a read-only view of bytes with shared ownership, so tensor data can
// travel between the network, the server's store and user memory without
// copies.
//
//   Buffer b = Buffer::Allocate(n * sizeof(float));     // owned, writable until shared
//   std::memcpy(b.mutable_data(), src, b.size());
//   Buffer view = Buffer::Wrap(ptr, len, keep_alive);   // keep_alive owns ptr's memory
//
// Copying a Buffer copies the reference, not the bytes. Thread-safe like
// shared_ptr.
#ifndef TESSERA_COMMON_BUFFER_H_
#define TESSERA_COMMON_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace tessera {

class Buffer {
 public:
  Buffer() = default;

  // Uninitialised, 64-byte aligned memory of `size` bytes. From 1 MiB up the
  // memory is a block reused from earlier large buffers when one of its size
  // class is free (buffer.cc: BlockPool), so a large message does not pay a
  // page fault per 4 KiB each time.
  static Buffer Allocate(size_t size);
  // A copy of `size` bytes at `data`.
  static Buffer CopyOf(const void* data, size_t size);
  // `data` stays valid for as long as `owner` (or a copy of it) is alive.
  static Buffer Wrap(const void* data, size_t size,
                     std::shared_ptr<const void> owner);

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const float* floats() const { return reinterpret_cast<const float*>(data_); }
  size_t num_floats() const { return size_ / sizeof(float); }

  // Writable access. REQUIRES: this buffer came from Allocate/CopyOf and is not
  // shared with a reader that expects it unchanged (unique()).
  uint8_t* mutable_data() { return const_cast<uint8_t*>(data_); }
  float* mutable_floats() { return reinterpret_cast<float*>(mutable_data()); }

  // True when no other Buffer shares this memory. Then what other threads did
  // through the Buffers they have since dropped (ZeroMQ's I/O thread sending
  // the bytes) happens before the caller's next access: writing in place after
  // unique() does not race with them.
  bool unique() const;
  const std::shared_ptr<const void>& owner() const { return owner_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::shared_ptr<const void> owner_;
};

// Bytes of freed large blocks Buffer::Allocate keeps for reuse (tests).
size_t BufferPoolCachedBytesForTesting();

}  // namespace tessera

#endif  // TESSERA_COMMON_BUFFER_H_

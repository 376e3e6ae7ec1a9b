// Buffer: shared bytes and the check that makes writing them in place safe.
#include "common/buffer.h"

#include <cstring>
#include <thread>
#include <utility>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(BufferTest, CopiesShareTheBytesAndUniqueCountsThem) {
  Buffer b = Buffer::CopyOf("abcd", 4);
  EXPECT_TRUE(b.unique());
  {
    Buffer copy = b;
    EXPECT_EQ(copy.data(), b.data());
    EXPECT_FALSE(b.unique());
    EXPECT_FALSE(copy.unique());
  }
  EXPECT_TRUE(b.unique());
  EXPECT_FALSE(Buffer().unique());
}

// The server's copy-on-write: a pull reply shares the weights with ZeroMQ's I/O
// thread, which reads them and drops its reference; once unique() holds, the
// update writes them in place. unique() must order the reader's reads before
// that write. While it only compared use_count() (a relaxed load), this test
// was a data race under ThreadSanitizer (tools/tsan.sh); without TSan it passes
// either way.
TEST(BufferTest, UniqueOrdersAReleasedReaderBeforeTheNextWrite) {
  for (int round = 0; round < 20; ++round) {
    Buffer weights = Buffer::Allocate(64 * sizeof(float));
    for (int i = 0; i < 64; ++i)
      weights.mutable_floats()[i] = static_cast<float>(i);
    float sum = 0;
    std::thread reader([frame = Buffer(weights), &sum]() mutable {
      for (size_t i = 0; i < frame.num_floats(); ++i) sum += frame.floats()[i];
      frame = Buffer();
    });
    while (!weights.unique()) std::this_thread::yield();
    for (int i = 0; i < 64; ++i) weights.mutable_floats()[i] = -1;
    reader.join();
    EXPECT_EQ(sum, 63 * 64 / 2);
  }
}

// Large buffers reuse the blocks of freed ones of the same size class (no
// fresh pages to fault in), and a block of another class never lets the pool
// hold more than was in use at once: a miss first gives cached blocks back.
TEST(BufferTest, LargeBlocksAreReusedWithinTheirClassAndNeverPileUp) {
  const size_t before = BufferPoolCachedBytesForTesting();
  const void* first;
  {
    Buffer a = Buffer::Allocate(3 << 20);
    first = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
    std::memset(a.mutable_data(), 7, a.size());
  }
  EXPECT_EQ(BufferPoolCachedBytesForTesting(), before + (3 << 20));
  {
    // 3 MiB + 1 rounds up to the same class (3.5 MiB is the next): reused.
    Buffer b = Buffer::Allocate((3 << 20) - 4096);
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(b.data()[100], 7);  // not cleared: Allocate is uninitialised
    EXPECT_EQ(BufferPoolCachedBytesForTesting(), before);
  }
  {
    // Another class misses, and the cached 3 MiB goes back to the system
    // first, so in use + cached stays at the peak in use (5 MiB).
    Buffer c = Buffer::Allocate(5 << 20);
    EXPECT_NE(c.data(), first);
    EXPECT_EQ(BufferPoolCachedBytesForTesting(), before);
  }
  EXPECT_EQ(BufferPoolCachedBytesForTesting(), before + (5 << 20));
  // Small buffers are malloc's, never cached.
  { Buffer small = Buffer::Allocate(4096); }
  EXPECT_EQ(BufferPoolCachedBytesForTesting(), before + (5 << 20));
}

}  // namespace
}  // namespace tessera

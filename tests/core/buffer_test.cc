// Buffer: shared bytes and the check that makes writing them in place safe.
#include "common/buffer.h"

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

}  // namespace
}  // namespace tessera

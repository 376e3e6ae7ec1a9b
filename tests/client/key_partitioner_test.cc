// Placement of keys on servers (KeyPartitioner), as MXNet places them.
#include "worker/client/key_partitioner.h"

#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(KeyPartitionerTest, SmallArraysLiveWholeOnOneServer) {
  KeyPartitioner p(3, 1000);
  std::vector<int> per_server(3, 0);
  for (uint64_t key = 0; key < 300; ++key) {
    std::vector<KeyPart> parts = p.Partition(key, 999);
    ASSERT_EQ(parts.size(), 1u);
    EXPECT_EQ(parts[0].offset, 0u);
    EXPECT_EQ(parts[0].length, 999u);
    EXPECT_EQ(parts[0].server_rank, p.ServerOf(key));
    ++per_server[parts[0].server_rank];
  }
  for (int count : per_server) EXPECT_GT(count, 60) << "hash spreads keys";
}

TEST(KeyPartitionerTest, BigArraysSplitIntoNearlyEqualContiguousParts) {
  KeyPartitioner p(2, 1000000);
  std::vector<KeyPart> parts = p.Partition(99, 1200 * 1200);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].server_rank, 0);
  EXPECT_EQ(parts[0].offset, 0u);
  EXPECT_EQ(parts[0].length, 720000u);
  EXPECT_EQ(parts[1].server_rank, 1);
  EXPECT_EQ(parts[1].offset, 720000u);
  EXPECT_EQ(parts[1].length, 720000u);
  KeyPartitioner q(3, 10);
  parts = q.Partition(1, 11);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].length + parts[1].length + parts[2].length, 11u);
  EXPECT_EQ(parts[1].offset, parts[0].length);
  EXPECT_EQ(parts[2].offset, parts[0].length + parts[1].length);
  EXPECT_TRUE(q.Partition(1, 0).empty());
}

TEST(KeyPartitionerTest, ChunksCutPartsIntoSlicesOnTheSameServer) {
  KeyPartitioner p(2, 1000);
  const std::vector<KeyPart> chunks =
      KeyPartitioner::Chunk(p.Partition(7, 2500), 600);
  // Parts [0, 1250) on server 0 and [1250, 2500) on server 1, in 600s.
  ASSERT_EQ(chunks.size(), 6u);
  const uint64_t offsets[] = {0, 600, 1200, 1250, 1850, 2450};
  const uint64_t lengths[] = {600, 600, 50, 600, 600, 50};
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].server_rank, i < 3 ? 0 : 1) << i;
    EXPECT_EQ(chunks[i].offset, offsets[i]) << i;
    EXPECT_EQ(chunks[i].length, lengths[i]) << i;
  }
  // Parts no longer than the chunk stay whole.
  EXPECT_EQ(KeyPartitioner::Chunk(p.Partition(7, 999), 999).size(), 1u);
}

}  // namespace
}  // namespace tessera

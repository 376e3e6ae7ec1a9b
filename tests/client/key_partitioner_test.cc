// Placement of keys on servers (KeyPartitioner), as MXNet places them.
#include "worker/client/key_partitioner.h"

#include <vector>

#include "common/key_layout.h"
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

// Servers check the place a worker's init names against the layout
// (common/key_layout.h, issue #46): every slice a worker makes, split or
// whole, in chunks or not, is one the layout names its server for, and no
// other server but the key's home or the owner of the slice's split part
// (the bound that chooses between them is the workers').
TEST(KeyPartitionerTest, EverySliceIsOneTheLayoutNamesItsServerFor) {
  for (int servers = 1; servers <= 5; ++servers) {
    for (uint64_t bound : {uint64_t{1}, uint64_t{7}, uint64_t{1000}}) {
      const KeyPartitioner p(servers, bound);
      const KeyPartitioner split_all(servers, 1);
      for (uint64_t key = 0; key < 12; ++key) {
        for (uint64_t length : {uint64_t{1}, uint64_t{3}, uint64_t{11},
                                uint64_t{999}, uint64_t{2500}}) {
          for (uint64_t chunk : {uint64_t{7}, uint64_t{600}, length}) {
            for (const KeyPart& part :
                 KeyPartitioner::Chunk(p.Partition(key, length), chunk)) {
              wire::KeySlice slice;
              slice.set_key(key);
              slice.set_offset(part.offset);
              slice.set_length(part.length);
              slice.set_total_length(length);
              EXPECT_TRUE(MayBeFirstMember(part.server_rank, slice, servers));
              for (int rank = 0; rank < servers; ++rank) {
                // The key's home, or the server whose part of the key
                // split over every server holds the slice.
                bool named = rank == p.ServerOf(key);
                for (const KeyPart& split : split_all.Partition(key, length)) {
                  named |=
                      split.server_rank == rank &&
                      split.offset <= part.offset &&
                      part.offset + part.length <= split.offset + split.length;
                }
                EXPECT_EQ(MayBeFirstMember(rank, slice, servers), named)
                    << "rank " << rank << " of " << servers << ", key " << key
                    << " [" << part.offset << ", +" << part.length << ") of "
                    << length << ", bound " << bound;
              }
            }
          }
        }
      }
    }
  }
  // A hashed key's slice: only the rank its offset names.
  wire::KeySlice hashed;
  hashed.set_key(5);
  hashed.set_offset(2);
  hashed.set_row_length(8);
  EXPECT_TRUE(MayBeFirstMember(2, hashed, 3));
  EXPECT_FALSE(MayBeFirstMember(0, hashed, 3));
  EXPECT_FALSE(MayBeFirstMember(1, hashed, 3));
  // Parts of any total, past what a product of total and rank holds.
  EXPECT_EQ(SplitPartBegin(UINT64_MAX, 3, 3), UINT64_MAX);
  EXPECT_EQ(SplitPartBegin(UINT64_MAX, 1, 2), UINT64_MAX / 2);
  EXPECT_EQ(SplitPartBegin(2500, 1, 2), 1250u);
}

}  // namespace
}  // namespace tessera

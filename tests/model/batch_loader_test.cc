// Tests of BatchLoader: sharding, deterministic shuffling, batch contents, the
// bound on the prefetch queue and shutdown.
#include "worker/trainer/batch_loader.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// n images of 2x2 whose first pixel is the item's index and whose label is
// index % 10.
LabeledImages Items(int n) {
  LabeledImages d;
  d.count = n;
  d.rows = 2;
  d.cols = 2;
  for (int i = 0; i < n; ++i) {
    d.pixels.insert(d.pixels.end(), {static_cast<uint8_t>(i), 255, 0, 51});
    d.labels.push_back(static_cast<uint8_t>(i % 10));
  }
  return d;
}

int ItemOf(const Batch& b, int row) {
  return static_cast<int>(b.images[row * 4] * 255.0f + 0.5f);
}

// All batches of all epochs, as item indices per epoch.
std::vector<std::vector<int>> Drain(BatchLoader& loader, int epochs) {
  std::vector<std::vector<int>> out(epochs);
  for (int e = 0; e < epochs; ++e) {
    int index = 0;
    while (std::optional<Batch> b = loader.Next()) {
      EXPECT_EQ(b->epoch, e);
      EXPECT_EQ(b->index, index++);
      for (int r = 0; r < b->size; ++r) out[e].push_back(ItemOf(*b, r));
    }
    EXPECT_EQ(index, loader.batches_per_epoch());
  }
  EXPECT_FALSE(loader.Next().has_value());
  return out;
}

BatchLoader::Options Opts(int batch, int rank, int workers, uint64_t seed,
                          int epochs) {
  BatchLoader::Options o;
  o.batch_size = batch;
  o.rank = rank;
  o.num_workers = workers;
  o.seed = seed;
  o.epochs = epochs;
  return o;
}

TEST(BatchLoaderTest, ShardsAreDisjointAndCoverTheSet) {
  for (int workers : {1, 2, 3, 7}) {
    std::vector<int> seen(103, 0);
    for (int r = 0; r < workers; ++r) {
      for (int i : BatchLoader::ShardIndices(103, r, workers)) {
        EXPECT_EQ(i % workers, r);
        ++seen[i];
      }
    }
    EXPECT_EQ(seen, std::vector<int>(103, 1)) << workers << " workers";
  }
}

TEST(BatchLoaderTest, EpochOrderIsADeterministicPermutation) {
  const std::vector<int> shard = BatchLoader::ShardIndices(1000, 1, 3);
  const std::vector<int> a = BatchLoader::EpochOrder(shard, 42, 0);
  EXPECT_EQ(a, BatchLoader::EpochOrder(shard, 42, 0));
  EXPECT_NE(a, BatchLoader::EpochOrder(shard, 42, 1));
  EXPECT_NE(a, BatchLoader::EpochOrder(shard, 43, 0));
  EXPECT_NE(a, shard);
  std::vector<int> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, shard);
}

TEST(BatchLoaderTest, WorkersTogetherSeeEveryItemOncePerEpoch) {
  const LabeledImages data = Items(48);
  std::vector<std::vector<std::vector<int>>> per_worker;
  for (int r = 0; r < 2; ++r) {
    BatchLoader loader(&data, Opts(6, r, 2, 5, 3));
    EXPECT_EQ(loader.batches_per_epoch(), 4);
    EXPECT_EQ(loader.samples_per_epoch(), 24);
    per_worker.push_back(Drain(loader, 3));
  }
  for (int e = 0; e < 3; ++e) {
    std::multiset<int> all(per_worker[0][e].begin(), per_worker[0][e].end());
    all.insert(per_worker[1][e].begin(), per_worker[1][e].end());
    std::vector<int> expected(48);
    for (int i = 0; i < 48; ++i) expected[i] = i;
    EXPECT_EQ(std::vector<int>(all.begin(), all.end()), expected)
        << "epoch " << e;
    for (int i : per_worker[1][e]) EXPECT_EQ(i % 2, 1);
  }
  EXPECT_NE(per_worker[0][0], per_worker[0][1]);  // reshuffled each epoch
}

TEST(BatchLoaderTest, UnequalShardsRunTheSameNumberOfSteps) {
  const LabeledImages data = Items(50);  // shards of 17, 17 and 16
  for (int r = 0; r < 3; ++r) {
    BatchLoader loader(&data, Opts(5, r, 3, 1, 2));
    EXPECT_EQ(loader.batches_per_epoch(), 3) << r;
    const std::vector<std::vector<int>> items = Drain(loader, 2);
    EXPECT_EQ(items[0].size(), 15u);
    EXPECT_EQ(std::set<int>(items[0].begin(), items[0].end()).size(), 15u);
  }
  // A shard smaller than a batch still gives one (short) batch.
  BatchLoader small(&data, Opts(64, 0, 3, 1, 1));
  EXPECT_EQ(small.batches_per_epoch(), 1);
  std::optional<Batch> b = small.Next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->size, 16);
  EXPECT_FALSE(small.Next().has_value());
}

TEST(BatchLoaderTest, SameSeedSameBatchesOtherSeedOthers) {
  const LabeledImages data = Items(60);
  BatchLoader a(&data, Opts(4, 0, 1, 9, 2));
  BatchLoader b(&data, Opts(4, 0, 1, 9, 2));
  BatchLoader c(&data, Opts(4, 0, 1, 10, 2));
  const auto da = Drain(a, 2), db = Drain(b, 2), dc = Drain(c, 2);
  EXPECT_EQ(da, db);
  EXPECT_NE(da, dc);
}

TEST(BatchLoaderTest, BatchesHoldScaledPixelsAndLabels) {
  const LabeledImages data = Items(20);
  BatchLoader::Options o = Opts(20, 0, 1, 0, 1);
  o.shuffle = false;
  BatchLoader loader(&data, o);
  std::optional<Batch> b = loader.Next();
  ASSERT_TRUE(b.has_value());
  ASSERT_EQ(b->size, 20);
  ASSERT_EQ(b->images.size(), 80u);
  for (int r = 0; r < 20; ++r) {
    EXPECT_EQ(ItemOf(*b, r), r);
    EXPECT_FLOAT_EQ(b->images[r * 4 + 1], 1.0f);
    EXPECT_FLOAT_EQ(b->images[r * 4 + 2], 0.0f);
    EXPECT_FLOAT_EQ(b->images[r * 4 + 3], 0.2f);
    EXPECT_EQ(b->labels[r], r % 10);
  }
}

TEST(BatchLoaderTest, PrefetchQueueIsBounded) {
  const LabeledImages data = Items(200);
  BatchLoader::Options o = Opts(2, 0, 1, 3, 50);
  o.prefetch_depth = 3;
  BatchLoader loader(&data, o);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (loader.queued() < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(loader.queued(), 3u) << "the loader never filled its queue";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(loader.queued(), 3u);
  const auto items = Drain(loader, 50);
  EXPECT_EQ(items[49].size(), 200u);
  EXPECT_LE(loader.peak_queued(), 3u);
}

TEST(BatchLoaderTest, DestructorStopsABlockedProducer) {
  const LabeledImages data = Items(100);
  BatchLoader::Options o = Opts(1, 0, 1, 3, 1000);
  o.prefetch_depth = 1;
  const auto start = std::chrono::steady_clock::now();
  {
    BatchLoader loader(&data, o);
    ASSERT_TRUE(loader.Next().has_value());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(BatchLoaderTest, ValidateNamesTheBadField) {
  EXPECT_EQ(BatchLoader::Validate(Opts(0, 0, 1, 0, 1), 10).message(),
            "batch_size must be positive, got 0");
  EXPECT_EQ(BatchLoader::Validate(Opts(1, 2, 2, 0, 1), 10).message(),
            "rank must be in 0..1, got 2");
  EXPECT_EQ(BatchLoader::Validate(Opts(1, 0, 0, 0, 1), 10).message(),
            "num_workers must be positive, got 0");
  EXPECT_EQ(BatchLoader::Validate(Opts(1, 0, 4, 0, 1), 3).message(),
            "a data set of 3 items leaves worker shards empty with 4 workers");
  EXPECT_TRUE(BatchLoader::Validate(Opts(8, 3, 4, 0, 1), 4).ok());
}

}  // namespace
}  // namespace tessera

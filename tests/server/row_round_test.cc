// RowRound: a dist_sync round of a row-sparse key holds, sums and hands to the
// update only the rows some push named (issue #15: the update of a round
// touches the rows present, not the whole matrix), in both summing modes.
#include <cstdint>
#include <vector>

#include "common/buffer.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"
#include "server/round_engine.h"

namespace tessera {
namespace {

constexpr uint64_t kRowLength = 4;

std::vector<float> Rows(const std::vector<float>& firsts) {
  std::vector<float> v;
  for (float f : firsts)
    for (uint64_t j = 0; j < kRowLength; ++j) v.push_back(f + j);
  return v;
}

class RowRoundTest : public ::testing::TestWithParam<SyncRound::Mode> {};

TEST_P(RowRoundTest, SumHoldsOnlyTheRowsPushedAndForgetsThemAfterFinish) {
  RowRound round(/*num_workers=*/2, kRowLength, GetParam());
  const wire::Header request;
  // A big round: rows 0..999 from rank 0, row 5 (again) from rank 1.
  std::vector<uint64_t> all(1000);
  for (uint64_t i = 0; i < all.size(); ++i) all[i] = i;
  const std::vector<float> ones(all.size() * kRowLength, 1.0f);
  round.Add(0, all.data(), all.size(), ones.data(), request);
  const uint64_t five = 5;
  const std::vector<float> five_values = Rows({10});
  round.Add(1, &five, 1, five_values.data(), request);
  ASSERT_TRUE(round.complete());
  RowRound::Sum big = round.Finish();
  ASSERT_EQ(big.rows.size(), all.size());
  EXPECT_EQ(big.values[5 * kRowLength + 2], 1.0f + 12.0f);

  // The next round names three rows (one twice): its sum has those three,
  // in first-push order, and nothing left from the round before.
  const std::vector<uint64_t> a = {700, 3};
  const std::vector<uint64_t> b = {3, 42, 3};
  const std::vector<float> va = Rows({1, 2}), vb = Rows({100, 200, 300});
  round.Add(1, a.data(), a.size(), va.data(), request);
  round.Add(0, b.data(), b.size(), vb.data(), request);
  ASSERT_TRUE(round.complete());
  RowRound::Sum small = round.Finish();
  EXPECT_EQ(small.rows, (std::vector<uint64_t>{700, 3, 42}));
  for (uint64_t j = 0; j < kRowLength; ++j) {
    EXPECT_EQ(small.values[0 * kRowLength + j], 1.0f + j);
    EXPECT_EQ(small.values[1 * kRowLength + j], (2.0f + j) + (100.0f + j) + (300.0f + j));
    EXPECT_EQ(small.values[2 * kRowLength + j], 200.0f + j);
  }

  // A round in which no worker names a row hands nothing to the update.
  round.Add(0, nullptr, 0, nullptr, request);
  round.Add(1, nullptr, 0, nullptr, request);
  EXPECT_TRUE(round.Finish().rows.empty());
}

// One worker whose ids increase: its push is the round's sum as it came (the
// sum points into the push's own frame, which the Sum holds), with no
// accumulator. Ids out of order or repeated go through the sum as before:
// repeats added, first-push order.
TEST_P(RowRoundTest, OneWorkersIncreasingPushIsTheSumWithoutACopy) {
  RowRound round(/*num_workers=*/1, kRowLength, GetParam());
  const wire::Header request;
  const std::vector<float> v = Rows({1, 2, 3});
  Buffer frame = Buffer::CopyOf(v.data(), v.size() * sizeof(float));
  const float* at = frame.floats();
  round.Add(0, std::vector<uint64_t>{2, 9, 40}, frame, request);
  frame = Buffer();
  ASSERT_TRUE(round.complete());
  RowRound::Sum sum = round.Finish();
  EXPECT_EQ(sum.rows, (std::vector<uint64_t>{2, 9, 40}));
  EXPECT_EQ(sum.values, at);
  EXPECT_EQ(std::vector<float>(sum.values, sum.values + v.size()), v);
  EXPECT_FALSE(sum.push.empty());
  EXPECT_FALSE(round.complete());

  const std::vector<float> w = Rows({10, 20, 30});
  round.Add(0, std::vector<uint64_t>{9, 2, 9},
            Buffer::CopyOf(w.data(), w.size() * sizeof(float)), request);
  RowRound::Sum summed = round.Finish();
  EXPECT_EQ(summed.rows, (std::vector<uint64_t>{9, 2}));
  EXPECT_TRUE(summed.push.empty());
  for (uint64_t j = 0; j < kRowLength; ++j) {
    EXPECT_EQ(summed.values[0 * kRowLength + j], (10.0f + j) + (30.0f + j));
    EXPECT_EQ(summed.values[1 * kRowLength + j], 20.0f + j);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, RowRoundTest,
                         ::testing::Values(SyncRound::Mode::kExact,
                                           SyncRound::Mode::kArrival));

}  // namespace
}  // namespace tessera

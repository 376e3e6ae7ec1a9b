// RowRound: a dist_sync round of a row-sparse key holds, sums and hands to the
// update only the rows some push named (issue #15: the update of a round
// touches the rows present, not the whole matrix), in both summing modes.
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/buffer.h"
#include "common/compression/two_bit.h"
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
    EXPECT_EQ(small.values[1 * kRowLength + j],
              (2.0f + j) + (100.0f + j) + (300.0f + j));
    EXPECT_EQ(small.values[2 * kRowLength + j], 200.0f + j);
  }

  // A round in which no worker names a row hands nothing to the update.
  round.Add(0, nullptr, 0, nullptr, request);
  round.Add(1, nullptr, 0, nullptr, request);
  EXPECT_TRUE(round.Finish().rows.empty());
}

// One worker whose ids increase: its push is the round's sum as it came (the
// sum's rows point into the push's own frames, which the Sum holds), with no
// accumulator, whatever the number of frames. Ids out of order or repeated go
// through the sum as before: repeats added, first-push order, frames or not.
TEST_P(RowRoundTest, OneWorkersIncreasingPushIsTheSumWithoutACopy) {
  RowRound round(/*num_workers=*/1, kRowLength, GetParam());
  const wire::Header request;
  const std::vector<float> v = Rows({1, 2, 3});
  std::vector<Buffer> frames = {
      Buffer::CopyOf(v.data(), 2 * kRowLength * sizeof(float)),
      Buffer::CopyOf(v.data() + 2 * kRowLength, kRowLength * sizeof(float))};
  const float* at[3] = {frames[0].floats(), frames[0].floats() + kRowLength,
                        frames[1].floats()};
  round.Add(0, std::vector<uint64_t>{2, 9, 40}, std::move(frames), request);
  ASSERT_TRUE(round.complete());
  RowRound::Sum sum = round.Finish();
  EXPECT_EQ(sum.rows, (std::vector<uint64_t>{2, 9, 40}));
  ASSERT_EQ(sum.push.size(), 2u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(sum.row(i, kRowLength), at[i]) << i;
    EXPECT_EQ(std::vector<float>(sum.row(i, kRowLength),
                                 sum.row(i, kRowLength) + kRowLength),
              std::vector<float>(v.begin() + i * kRowLength,
                                 v.begin() + (i + 1) * kRowLength));
  }
  EXPECT_FALSE(round.complete());

  const std::vector<float> w = Rows({10, 20, 30});
  std::vector<Buffer> two = {
      Buffer::CopyOf(w.data(), kRowLength * sizeof(float)),
      Buffer::CopyOf(w.data() + kRowLength, 2 * kRowLength * sizeof(float))};
  round.Add(0, std::vector<uint64_t>{9, 2, 9}, std::move(two), request);
  ASSERT_TRUE(round.complete());
  RowRound::Sum summed = round.Finish();
  EXPECT_EQ(summed.rows, (std::vector<uint64_t>{9, 2}));
  EXPECT_TRUE(summed.push.empty());
  for (uint64_t j = 0; j < kRowLength; ++j) {
    EXPECT_EQ(summed.row(0, kRowLength)[j], (10.0f + j) + (30.0f + j));
    EXPECT_EQ(summed.row(1, kRowLength)[j], 20.0f + j);
  }
}

// 2-bit row pushes: counted into the sum (exact mode) or decoded and added
// (arrival mode); either way the sum of each row is that of the decoded
// values, rows in first-push order, and a payload that does not decode adds
// nothing and counts for no one.
TEST_P(RowRoundTest, TwoBitRowPushesSumTheirDecodedValues) {
  RowRound round(/*num_workers=*/2, kRowLength, GetParam());
  const wire::Header request;
  const float t = 0.5f;
  auto code = [&](const std::vector<float>& g, std::vector<float>* decoded) {
    std::vector<float> residual(g.size(), 0.0f);
    Buffer wire =
        Buffer::Allocate(compression::TwoBitCompressedBytes(g.size()));
    EXPECT_TRUE(compression::TwoBitQuantize(g.data(), residual.data(), g.size(),
                                            t, wire.mutable_data())
                    .ok());
    decoded->resize(g.size());
    EXPECT_TRUE(compression::TwoBitDequantize(wire.data(), wire.size(),
                                              g.size(), t, decoded->data())
                    .ok());
    return wire;
  };
  std::vector<float> da, db;
  const Buffer a = code({1, -1, 0, 2, /**/ -3, 0.1f, 0.7f, -0.6f}, &da);
  const Buffer b =
      code({0.6f, 0.6f, -0.6f, 0, /**/ 9, 9, 9, 9, /**/ 1, 1, 1, 1}, &db);
  Buffer bad = Buffer::CopyOf(a.data(), a.size());
  bad.mutable_data()[0] = 0x40;  // a 0b01 code
  EXPECT_EQ(round.AddTwoBit(0, {5, 8}, bad, t, request).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_FALSE(round.Contributed(0));
  ASSERT_TRUE(round.AddTwoBit(0, {5, 8}, a, t, request).ok());
  ASSERT_TRUE(round.AddTwoBit(1, {8, 2, 5}, b, t, request).ok());
  ASSERT_TRUE(round.complete());
  RowRound::Sum sum = round.Finish();
  EXPECT_EQ(sum.rows, (std::vector<uint64_t>{5, 8, 2}));
  for (uint64_t j = 0; j < kRowLength; ++j) {
    EXPECT_EQ(sum.values[0 * kRowLength + j], da[j] + db[8 + j]) << j;
    EXPECT_EQ(sum.values[1 * kRowLength + j], da[4 + j] + db[j]) << j;
    EXPECT_EQ(sum.values[2 * kRowLength + j], db[4 + j]) << j;
  }
}

// A row whose values are all -0 sums to -0 in the exact mode, as ExactSum's
// rule for zeros says (+0 unless every input was -0), also for rows that
// appear in the middle of a round.
TEST(RowRoundExactTest, ARowOfNegativeZerosSumsToNegativeZero) {
  RowRound round(/*num_workers=*/2, kRowLength);
  const wire::Header request;
  const std::vector<float> nz(2 * kRowLength, -0.0f);
  const std::vector<float> mixed = {-0.0f, 0.0f, -0.0f, -0.0f};
  const uint64_t a[] = {3, 9}, b[] = {9};
  round.Add(0, a, 2, nz.data(), request);
  round.Add(1, b, 1, mixed.data(), request);
  RowRound::Sum sum = round.Finish();
  ASSERT_EQ(sum.rows, (std::vector<uint64_t>{3, 9}));
  for (uint64_t j = 0; j < kRowLength; ++j) {
    EXPECT_TRUE(std::signbit(sum.row(0, kRowLength)[j])) << j;
    EXPECT_EQ(std::signbit(sum.row(1, kRowLength)[j]), j != 1) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, RowRoundTest,
                         ::testing::Values(SyncRound::Mode::kExact,
                                           SyncRound::Mode::kArrival));

}  // namespace
}  // namespace tessera

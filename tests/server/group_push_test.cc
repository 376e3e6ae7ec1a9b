// A local group's pushes at a KVServer in one process (issue #47,
// docs/local_groups.md): a push naming its group mates counts for each of
// them, exactly; one naming anyone else, or carrying counts out of range, is
// refused with an error naming what was wrong, and so is a member's own push
// of a dense dist_sync key (it would stall the key's rounds).
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/compression/counts.h"
#include "common/compression/two_bit.h"
#include "common/wire_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mpfr.h"
#include "server/exact_sum.h"
#include "server/kv_server.h"
#include "tests/support/kv_messages.h"
#include "tests/support/server_harness.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kWorkers = 4;

class GroupPushTest : public ::testing::Test {
 protected:
  GroupPushTest() : h_(kWorkers) {
    // Workers 0 and 1 share a host; so do 2 and 3.
    h_.server().set_local_groups({{0, 1}, {0, 1}, {2, 3}, {2, 3}});
  }

  KVServer& server() { return h_.server(); }
  std::optional<Message> NextReply() { return h_.NextReply(); }
  size_t Pending() { return h_.Pending(); }

  // Sends `m`; returns its answer's status (after the round, for a push).
  absl::Status Send(Message m) {
    server().Handle(std::move(m));
    std::optional<Message> reply = NextReply();
    if (!reply.has_value()) return absl::DeadlineExceededError("no reply");
    last_ = *reply;
    return FromWire(reply->header.status());
  }
  // Whether the last reply says its push was refused before the server took
  // its number (its worker then marks the key out of step).
  bool LastUntaken() const { return last_.header.push_untaken(); }
  void Init(std::vector<float> value, bool sync = true) {
    absl::Status s = Send(testing::Init(kKey, value, sync));
    ASSERT_TRUE(s.ok()) << s;
  }
  void SetTwoBit(float threshold) {
    absl::Status s = Send(testing::SetTwoBit(threshold));
    ASSERT_TRUE(s.ok()) << s;
  }
  static Message FloatPush(int rank, uint64_t seq,
                           const std::vector<float>& grad,
                           const std::vector<int>& mates) {
    Message m = testing::Push(rank, kKey, seq, grad);
    for (int r : mates) m.header.add_group_ranks(r);
    return m;
  }
  static Message CountsPush(int rank, uint64_t seq,
                            const std::vector<int8_t>& counts, float threshold,
                            const std::vector<int>& mates) {
    Message m = testing::KeyMessage(wire::KV_PUSH, rank, kKey, counts.size());
    m.header.set_push_seq(seq);
    for (int r : mates) m.header.add_group_ranks(r);
    wire::DataFrame* d = m.header.add_frames();
    d->set_encoding(wire::DataFrame::COUNTS8);
    d->set_num_values(counts.size());
    d->set_num_bytes(counts.size());
    d->set_threshold(threshold);
    m.data.push_back(Buffer::CopyOf(counts.data(), counts.size()));
    return m;
  }
  // The same counts packed two a byte (COUNTS4).
  static Message Counts4Push(int rank, uint64_t seq,
                             const std::vector<int32_t>& counts,
                             float threshold, const std::vector<int>& mates) {
    std::vector<uint8_t> packed((counts.size() + 1) / 2);
    compression::PackCounts4(counts.data(), counts.size(), packed.data());
    Message m = CountsPush(rank, seq, {}, threshold, mates);
    m.header.mutable_slice()->set_length(counts.size());
    m.header.mutable_slice()->set_total_length(counts.size());
    m.header.mutable_frames(0)->set_encoding(wire::DataFrame::COUNTS4);
    m.header.mutable_frames(0)->set_num_values(counts.size());
    m.header.mutable_frames(0)->set_num_bytes(packed.size());
    m.data[0] = Buffer::CopyOf(packed.data(), packed.size());
    return m;
  }
  std::vector<float> PullValues(int rank, uint64_t length) {
    EXPECT_TRUE(Send(testing::Pull(rank, kKey, length, /*push_seq=*/1)).ok());
    return testing::ValuesOf(last_);
  }

  static constexpr uint64_t kKey = 7;
  testing::ServerHarness h_;
  Message last_;
};

TEST_F(GroupPushTest, TwoGroupPushesCompleteARoundOfFourWorkers) {
  Init({0, 0});
  server().Handle(FloatPush(0, 0, {1.5f, -2.0f}, {1}));
  EXPECT_EQ(Pending(), 0u);  // the round waits for workers 2 and 3
  EXPECT_TRUE(Send(FloatPush(3, 0, {0.25f, 4.0f}, {2})).ok());
  std::optional<Message> first = NextReply();
  ASSERT_TRUE(first.has_value());
  EXPECT_TRUE(FromWire(first->header.status()).ok());
  // No optimizer: the store becomes the round's sum.
  EXPECT_EQ(PullValues(0, 2), (std::vector<float>{1.75f, 2.0f}));
  EXPECT_EQ(server().stats().rounds_applied(), 1u);
  EXPECT_EQ(server().stats().pushes_applied(), 2u);
}

// What a group adds to a float32 round, exactly (docs/local_groups.md): each
// group's sum is its members' values added in float32 in local-rank order
// (LocalGroup's sum), and the server adds the groups' sums exactly and
// rounds once: RN(sum over groups of fl(a + b)), checked against GNU MPFR.
TEST_F(GroupPushTest, FloatGroupSumsRoundOnceEachThenTheServerSumsExactly) {
  constexpr size_t kN = 2000;
  std::mt19937 rng(47);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<std::vector<float>> grad(kWorkers, std::vector<float>(kN));
  for (auto& g : grad)
    for (float& v : g) v = std::ldexp(mantissa(rng), exponent(rng));
  // Element 0: the group's rounding made visible. Without groups the round
  // is 1e8 + 1 - 1e8 + 1 = 2; in float32 each group's 1e8 + 1 is 1e8.
  grad[0][0] = 1e8f, grad[1][0] = 1.0f, grad[2][0] = -1e8f, grad[3][0] = 1.0f;
  std::vector<float> first(kN), second(kN);
  for (size_t j = 0; j < kN; ++j) {
    first[j] = grad[0][j] + grad[1][j];
    second[j] = grad[2][j] + grad[3][j];
  }
  Init(std::vector<float>(kN, 0.0f));
  server().Handle(FloatPush(0, 0, first, {1}));
  ASSERT_TRUE(Send(FloatPush(2, 0, second, {3})).ok());
  ASSERT_TRUE(NextReply().has_value());
  const std::vector<float> got = PullValues(0, kN);
  ASSERT_EQ(got.size(), kN);
  mpfr_t acc;
  mpfr_init2(acc, 1200);  // exact for any sum of floats here
  size_t differs_from_flat = 0;
  for (size_t j = 0; j < kN; ++j) {
    mpfr_set_flt(acc, first[j], MPFR_RNDN);
    mpfr_add_d(acc, acc, second[j], MPFR_RNDN);  // exact
    const float want = mpfr_get_flt(acc, MPFR_RNDN);
    EXPECT_EQ(got[j], want) << "value " << j;
    mpfr_set_zero(acc, 1);
    for (int w = 0; w < kWorkers; ++w)
      mpfr_add_d(acc, acc, grad[w][j], MPFR_RNDN);
    if (mpfr_get_flt(acc, MPFR_RNDN) != got[j]) ++differs_from_flat;
  }
  mpfr_clear(acc);
  EXPECT_EQ(got[0], 0.0f);  // the flat job's round gives 2
  // How often the group's roundings change the round's float32 result, on
  // these values (printed for docs/local_groups.md).
  std::printf(
      "grouped float sums that differ from the flat job's: %zu of %zu\n",
      differs_from_flat, kN);
  EXPECT_GT(differs_from_flat, 0u);
}

// A member's own push of a dense dist_sync key (no group_ranks) would count
// for it in a round its group's push also covers: the round then waits for
// its mate's push, which waits behind it (Contributed), for ever. Refused
// before its number is taken; the group's push then completes the round.
TEST_F(GroupPushTest, AGroupMembersOwnPushOfADenseSyncKeyIsRefused) {
  Init({0});
  absl::Status s = Send(FloatPush(1, 0, {5.0f}, {}));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(std::string(s.message()),
            "push of key 7 from worker 1 carries only its own push, but "
            "worker 1 is in the local group of workers 0, 1, whose pushes of "
            "a dense dist_sync key come one per group, naming the other "
            "members (docs/local_groups.md): taken, it would stall the "
            "key's rounds");
  EXPECT_TRUE(LastUntaken()) << "refused before its number was taken";
  // So is a later number (held, it would wait for its missing pushes).
  s = Send(FloatPush(2, 3, {5.0f}, {}));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("from worker 2 carries only its own push, but worker "
                        "2 is in the local group of workers 2, 3,"));
  EXPECT_TRUE(LastUntaken());
  server().Handle(FloatPush(0, 0, {1.0f}, {1}));
  ASSERT_TRUE(Send(FloatPush(3, 0, {2.0f}, {2})).ok())
      << "the round of workers 0 to 3 stalled";
  ASSERT_TRUE(NextReply().has_value());
  EXPECT_EQ(PullValues(0, 1), (std::vector<float>{3.0f}));
  EXPECT_EQ(server().stats().rounds_applied(), 1u);
  EXPECT_EQ(server().stats().pushes_applied(), 2u);
  EXPECT_EQ(Pending(), 0u);
}

// What a member still pushes for itself (docs/local_groups.md): the rows of
// a row-sparse key, a dist_async push (no round to stall) and a dist_ssp
// store's push (its workers leave their groups). Each is taken.
TEST_F(GroupPushTest, AMembersOwnPushOfAKeyItsGroupDoesNotPushIsTaken) {
  ASSERT_TRUE(Send(testing::SetOptimizer("sgd lr=1")).ok());
  Message init = testing::KeyMessage(wire::KV_INIT, 0, kKey, /*rows=*/2);
  init.header.mutable_slice()->set_row_length(1);
  init.header.mutable_kv_options()->set_sync_mode(true);  // no value: zeros
  ASSERT_TRUE(Send(std::move(init)).ok());
  for (int rank = 0; rank < kWorkers; ++rank) {
    Message push = testing::KeyMessage(wire::KV_PUSH, rank, kKey, 2);
    push.header.mutable_slice()->set_row_length(1);
    const uint64_t row = rank % 2;
    wire::DataFrame* ids = push.header.add_frames();
    ids->set_encoding(wire::DataFrame::RAW);
    ids->set_num_bytes(sizeof(row));
    push.data.push_back(Buffer::CopyOf(&row, sizeof(row)));
    AddFloatFrame(&push, testing::Floats({1.0f}));
    server().Handle(std::move(push));
  }
  for (int i = 0; i < kWorkers; ++i) {
    std::optional<Message> r = NextReply();
    ASSERT_TRUE(r.has_value()) << "the row key's round stalled";
    EXPECT_TRUE(FromWire(r->header.status()).ok());
  }
  EXPECT_EQ(server().stats().rounds_applied(), 1u);
  ASSERT_TRUE(Send(testing::Init(kKey + 1, {0.0f}, /*sync=*/false)).ok());
  absl::Status s = Send(testing::Push(1, kKey + 1, 0, {2.0f}));
  EXPECT_TRUE(s.ok()) << s;
  Message ssp = testing::Init(kKey + 2, {0.0f}, /*sync=*/false);
  ssp.header.mutable_kv_options()->set_bounded_staleness(true);
  ssp.header.mutable_kv_options()->set_staleness(2);
  ASSERT_TRUE(Send(std::move(ssp)).ok());
  s = Send(testing::Push(1, kKey + 2, 0, {2.0f}));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(server().stats().pushes_applied(), 6u);
}

TEST_F(GroupPushTest, APushNamingAnotherGroupsWorkersIsRefused) {
  Init({0});
  absl::Status s = Send(FloatPush(0, 0, {1.0f}, {2}));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("push of key 7 from worker 0 carries the pushes of "
                        "worker(s) 2; its local group's other members are 1"));
  EXPECT_TRUE(LastUntaken());
  // Naming itself, or only part of a larger group, is refused the same way.
  s = Send(FloatPush(2, 0, {1.0f}, {2, 3}));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("worker(s) 2, 3; its local group's other members "
                        "are 3"));
  EXPECT_EQ(server().stats().pushes_applied(), 0u);
}

TEST_F(GroupPushTest, AWorkerInNoGroupCannotSpeakForOthers) {
  server().set_local_groups({{}, {}, {2, 3}, {2, 3}});
  Init({0});
  absl::Status s = Send(FloatPush(0, 0, {1.0f}, {1}));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("its local group's other members are none"));
}

TEST_F(GroupPushTest, CountsGiveTheSameBitsAsTheMembersTwoBitPushes) {
  SetTwoBit(0.375f);
  Init({0, 0, 0, 0, 0});
  // What four workers' 2-bit pushes of these gradients sum to, exactly.
  const std::vector<std::vector<float>> grads = {
      {0.5f, -0.4f, 0.1f, 0.9f, -1.0f},
      {0.4f, 0.4f, -0.5f, 0.0f, -0.5f},
      {-0.6f, 0.3f, 0.38f, 0.5f, -2.0f},
      {0.7f, -0.1f, 0.4f, 0.376f, -0.4f}};
  ExactSum flat(5);
  std::vector<int32_t> codes(5, 0), group_a(5, 0), group_b(5, 0);
  for (int w = 0; w < kWorkers; ++w) {
    std::vector<float> residual(5, 0.0f);
    std::vector<uint8_t> packed(compression::TwoBitCompressedBytes(5));
    ASSERT_TRUE(compression::TwoBitQuantize(grads[w].data(), residual.data(), 5,
                                            0.375f, packed.data())
                    .ok());
    ASSERT_TRUE(flat.AddTwoBit(packed.data(), packed.size(), 0.375f).ok());
    std::vector<float> c(5);
    ASSERT_TRUE(compression::TwoBitDequantize(packed.data(), packed.size(), 5,
                                              1.0f, c.data())
                    .ok());
    for (int i = 0; i < 5; ++i) (w < 2 ? group_a : group_b)[i] += c[i];
  }
  const float* expected = flat.Finish();
  std::vector<int8_t> a(group_a.begin(), group_a.end());
  std::vector<int8_t> b(group_b.begin(), group_b.end());
  server().Handle(CountsPush(1, 0, a, 0.375f, {0}));
  EXPECT_TRUE(Send(CountsPush(2, 0, b, 0.375f, {3})).ok());
  ASSERT_TRUE(NextReply().has_value());
  std::vector<float> got = PullValues(1, 5);
  ASSERT_EQ(got.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(got[i], expected[i]) << "value " << i;
  EXPECT_EQ(got, (std::vector<float>{0.75f, 0.0f, 0.375f, 1.125f, -1.5f}));
}

TEST(Counts4Test, EveryCountFromMinus8To7RoundTrips) {
  std::vector<int32_t> counts;
  for (int c = -8; c <= 7; ++c) counts.push_back(c);
  counts.push_back(-3);  // an odd count: the last byte's high half is 0
  std::vector<uint8_t> packed(9);
  compression::PackCounts4(counts.data(), counts.size(), packed.data());
  EXPECT_EQ(packed[0], 0x98);  // -8 (0x8) low, -7 (0x9) high
  EXPECT_EQ(packed[8], 0x0d);  // -3, and nothing
  std::vector<int8_t> back(counts.size());
  compression::UnpackCounts4(packed.data(), counts.size(), back.data());
  EXPECT_EQ(std::vector<int32_t>(back.begin(), back.end()), counts);
}

TEST_F(GroupPushTest, FourBitCountsGiveTheSameSumAsEightBitOnes) {
  SetTwoBit(0.375f);
  Init({0, 0, 0, 0, 0});
  server().Handle(Counts4Push(1, 0, {2, -1, 0, 1, -2}, 0.375f, {0}));
  EXPECT_TRUE(Send(CountsPush(2, 0, {0, 1, 1, 1, 0}, 0.375f, {3})).ok());
  ASSERT_TRUE(NextReply().has_value());
  EXPECT_EQ(PullValues(1, 5),
            (std::vector<float>{0.75f, 0.0f, 0.375f, 0.75f, -0.75f}));
  // A count no member could give: -3 from a group of 2.
  absl::Status s = Send(Counts4Push(1, 1, {-3, 0, 0, 0, 0}, 0.375f, {0}));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("count -3 at value 0 from a group of 2"));
  // A frame of the wrong size for its values (the refused push above left
  // its number, 1, to the next).
  Message short_frame = Counts4Push(1, 1, {1, 1, 1, 1, 1}, 0.375f, {0});
  short_frame.data[0] = Buffer::CopyOf("\x11\x11", 2);
  short_frame.header.mutable_frames(0)->set_num_bytes(2);
  s = Send(std::move(short_frame));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("2 bytes of 4-bit counts of threshold 0.375; expected "
                        "3 of 0.375"));
}

TEST_F(GroupPushTest, CountsWithoutTwoBitAreRefused) {
  Init({0, 0});
  absl::Status s = Send(CountsPush(0, 0, {1, 0}, 0.375f, {1}));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("counts of 2-bit codes come only in a local group's "
                        "push with 2-bit compression set"));
}

TEST_F(GroupPushTest, CountsBeyondTheGroupOrOfAnotherThresholdAreRefused) {
  SetTwoBit(0.375f);
  Init({0, 0});
  absl::Status s = Send(CountsPush(0, 0, {1, -3}, 0.375f, {1}));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("count -3 at value 1 from a group of 2"));
  // A payload refused before its number was taken: the next push is still 0.
  s = Send(CountsPush(0, 0, {1, 1}, 0.5f, {1}));
  EXPECT_THAT(
      std::string(s.message()),
      HasSubstr("2 bytes of 8-bit counts of threshold 0.5; expected 2 of "
                "0.375"));
  EXPECT_EQ(server().stats().pushes_applied(), 0u);
}

// A malformed group push is refused before its number is taken, so the
// worker's count of pushes stays where it was: the correct push of the same
// number is then taken (not answered as a copy of a push taken before), and
// the round is its exact sum.
TEST_F(GroupPushTest, AMalformedGroupPushLeavesItsNumberToTheCorrectOne) {
  SetTwoBit(0.375f);
  Init({0, 0, 0, 0, 0});
  // 4-bit counts sent as 8-bit ones.
  Message wrong_frame = Counts4Push(1, 0, {2, -1, 0, 1, -2}, 0.375f, {0});
  wrong_frame.header.mutable_frames(0)->set_encoding(wire::DataFrame::COUNTS8);
  absl::Status s = Send(std::move(wrong_frame));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(std::string(s.message()),
            "push of key 7: 3 bytes of 8-bit counts of threshold 0.375; "
            "expected 5 of 0.375");
  EXPECT_TRUE(LastUntaken());
  // A count no group of 2 gives.
  s = Send(Counts4Push(1, 0, {2, -1, 3, 1, -2}, 0.375f, {0}));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(std::string(s.message()),
            "push of key 7: count 3 at value 2 from a group of 2 (at most 2 "
            "each way)");
  EXPECT_TRUE(LastUntaken());
  // A frame of another number of values than the slice's.
  Message short_frame = Counts4Push(1, 0, {2, -1, 0, 1, -2}, 0.375f, {0});
  short_frame.header.mutable_frames(0)->set_num_values(4);
  s = Send(std::move(short_frame));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(std::string(s.message()),
            "push of key 7 has 4 values; the key has 5 here");
  EXPECT_TRUE(LastUntaken());
  // The correct push, number 0 still: in the open round, answered with it.
  server().Handle(Counts4Push(1, 0, {2, -1, 0, 1, -2}, 0.375f, {0}));
  EXPECT_EQ(Pending(), 0u) << "answered as a copy of a push taken before";
  ASSERT_TRUE(Send(CountsPush(2, 0, {0, 1, 1, 1, 0}, 0.375f, {3})).ok());
  ASSERT_TRUE(NextReply().has_value()) << "the round did not complete";
  EXPECT_EQ(PullValues(1, 5),
            (std::vector<float>{0.75f, 0.0f, 0.375f, 0.75f, -0.75f}));
  EXPECT_EQ(server().stats().rounds_applied(), 1u);
  EXPECT_EQ(server().stats().pushes_applied(), 2u);
}

TEST_F(GroupPushTest, RowKeysTakeNoGroupPush) {
  Message init = testing::KeyMessage(wire::KV_INIT, 0, kKey, /*rows=*/2);
  init.header.mutable_slice()->set_row_length(2);
  init.header.mutable_kv_options()->set_sync_mode(true);  // no value: zeros
  absl::Status inited = Send(std::move(init));
  ASSERT_TRUE(inited.ok()) << inited;
  Message push = FloatPush(0, 0, {1.0f, 1.0f}, {1});
  push.header.mutable_slice()->set_row_length(2);
  absl::Status s = Send(std::move(push));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("a local group's push is taken only for dense "
                        "dist_sync and dist_async keys"));
}

// dist_async without an optimizer is found after the group push's number
// was taken: refused, but counted (its reply does not say untaken), so the
// next push of the group is number 1, and it is answered at once.
TEST_F(GroupPushTest, AnAsyncGroupPushWithoutAnOptimizerIsRefusedButCounted) {
  Init({1.0f, 1.0f}, /*sync=*/false);
  absl::Status s = Send(FloatPush(0, 0, {2.0f, -4.0f}, {1}));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(std::string(s.message()),
            "dist_async needs an optimizer on the servers: call "
            "set_optimizer before pushing");
  EXPECT_FALSE(LastUntaken());
  s = Send(FloatPush(0, 1, {2.0f, -4.0f}, {1}));
  EXPECT_EQ(std::string(s.message()),
            "dist_async needs an optimizer on the servers: call "
            "set_optimizer before pushing")
      << "push 1 waits for push 0";
  EXPECT_EQ(PullValues(0, 2), (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(server().stats().pushes_applied(), 0u);
}

TEST_F(GroupPushTest, AsyncAppliesAGroupSumOnce) {
  ASSERT_TRUE(Send(testing::SetOptimizer("sgd lr=0.5")).ok());
  Init({1.0f, 1.0f}, /*sync=*/false);
  EXPECT_TRUE(Send(FloatPush(0, 0, {2.0f, -4.0f}, {1})).ok());
  EXPECT_EQ(PullValues(0, 2), (std::vector<float>{0.0f, 3.0f}));
  EXPECT_EQ(server().stats().pushes_applied(), 1u);
}

}  // namespace
}  // namespace tessera

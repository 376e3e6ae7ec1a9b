// PulledCopy against the server's PullShadow: the copy a worker builds from
// compressed pull replies is the shadow bit for bit; a reply delivered twice
// is applied once; malformed replies are DataLoss and change nothing.
#include "worker/client/pulled_copy.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/compression/two_bit.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/pull_shadow.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

Buffer Floats(const std::vector<float>& v) {
  return Buffer::CopyOf(v.data(), v.size() * sizeof(float));
}

// A pull from `copy` answered by `shadow` (as KVServer does).
Message Ask(PullShadow& shadow, const Buffer& weights, const PulledCopy& copy) {
  wire::Header request;
  request.set_pull_compressed(true);
  request.set_pull_chain(copy.chain());
  request.set_pull_version(copy.version());
  Message reply;
  reply.header.set_command(wire::KV_PULL);
  reply.header.set_is_response(true);
  reply.header.set_sender(8);
  shadow.Answer(weights, request, &reply);
  // As it travels: encoded and decoded.
  absl::StatusOr<std::vector<Buffer>> parts = EncodeMessage(reply);
  EXPECT_TRUE(parts.ok()) << parts.status();
  absl::StatusOr<Message> back = DecodeMessage(*std::move(parts));
  EXPECT_TRUE(back.ok()) << back.status();
  return *std::move(back);
}

std::vector<float> Values(const PulledCopy& copy, size_t n) {
  std::vector<float> out(n);
  copy.CopyTo(out.data());
  return out;
}

bool SameBits(const std::vector<float>& a, const Buffer& b) {
  return a.size() * sizeof(float) == b.size() &&
         std::memcmp(a.data(), b.data(), b.size()) == 0;
}

TEST(PulledCopyTest, CopiesFollowTheShadowBitForBitThroughManyChanges) {
  constexpr size_t kN = 1003;  // not a multiple of 16
  std::mt19937 rng(5);
  std::normal_distribution<float> step(0.0f, 1e-2f);
  std::vector<float> w(kN);
  for (float& v : w) v = step(rng) * 100;
  Buffer weights = Floats(w);
  PullShadow shadow(weights, /*chain=*/77);
  PulledCopy every_round(kN), every_third(kN), late(kN);
  ASSERT_TRUE(every_round.Apply(Ask(shadow, weights, every_round)).ok());
  EXPECT_EQ(every_round.version(), 1u);
  for (int round = 0; round < 40; ++round) {
    for (float& v : w) v += step(rng);  // the round's update
    weights = Floats(w);
    shadow.MarkChanged();
    Message reply = Ask(shadow, weights, every_round);
    EXPECT_EQ(reply.data.size(), 1u) << "one version's change";
    EXPECT_EQ(reply.data[0].size(), compression::TwoBitCompressedBytes(kN));
    ASSERT_TRUE(every_round.Apply(reply).ok());
    ASSERT_TRUE(SameBits(Values(every_round, kN), shadow.shadow()))
        << "round " << round;
    if (round % 3 == 2) {
      ASSERT_TRUE(every_third.Apply(Ask(shadow, weights, every_third)).ok());
      ASSERT_TRUE(SameBits(Values(every_third, kN), shadow.shadow()));
    }
  }
  // Error feedback: what was not sent yet keeps going out, so the copies
  // approach the weights (here within a few steps' size).
  double err = 0;
  const std::vector<float> got = Values(every_round, kN);
  for (size_t i = 0; i < kN; ++i) err = std::max<double>(err, std::fabs(got[i] - w[i]));
  EXPECT_LT(err, 0.1);
  // A copy that never pulled gets the shadow whole, then changes again.
  Message whole = Ask(shadow, weights, late);
  ASSERT_EQ(whole.header.pull_from_version(), 0u);
  ASSERT_TRUE(late.Apply(whole).ok());
  EXPECT_TRUE(SameBits(Values(late, kN), shadow.shadow()));
}

TEST(PulledCopyTest, AReplyDeliveredTwiceIsAppliedOnce) {
  std::vector<float> w = {1, 2, 3, 4, 5};
  Buffer weights = Floats(w);
  PullShadow shadow(weights, 9);
  PulledCopy copy(5);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  w = {1.5f, 1, 3, 4.25f, 5};
  weights = Floats(w);
  shadow.MarkChanged();
  const Message reply = Ask(shadow, weights, copy);
  ASSERT_TRUE(copy.Apply(reply).ok());
  const std::vector<float> once = Values(copy, 5);
  ASSERT_TRUE(copy.Apply(reply).ok()) << "a repeat is not an error";
  EXPECT_EQ(Values(copy, 5), once);
  EXPECT_TRUE(SameBits(once, shadow.shadow()));
}

TEST(PulledCopyTest, MalformedRepliesAreDataLossAndChangeNothing) {
  constexpr size_t kN = 40;
  std::vector<float> w(kN, 1.0f);
  Buffer weights = Floats(w);
  PullShadow shadow(weights, 3);
  PulledCopy copy(kN);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  w[7] = 2.0f;
  weights = Floats(w);
  shadow.MarkChanged();
  const Message good = Ask(shadow, weights, copy);
  ASSERT_EQ(good.data.size(), 1u);
  const std::vector<float> before = Values(copy, kN);

  auto expect_loss = [&](Message m, const char* why, const char* text) {
    absl::Status s = copy.Apply(m);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << why;
    EXPECT_THAT(std::string(s.message()), HasSubstr(text)) << why;
    EXPECT_EQ(Values(copy, kN), before) << why << ": nothing applied";
    EXPECT_EQ(copy.chain(), 0u) << why << ": the next pull takes it whole";
  };
  Message bad_code = good;
  bad_code.data[0] = Buffer::CopyOf(good.data[0].data(), good.data[0].size());
  bad_code.data[0].mutable_data()[0] = 0x40;  // a 0b01 code
  expect_loss(bad_code, "bad code", "frame 0");
  // The copy was reset by the failure; bring it back for the next cases.
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  const std::vector<float> current = Values(copy, kN);
  Message wrong_size = good;
  wrong_size.data[0] = Buffer::CopyOf(good.data[0].data(), 4);
  wrong_size.header.mutable_frames(0)->set_num_bytes(4);
  absl::Status s = copy.Apply(wrong_size);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Values(copy, kN), current);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  Message other_chain = good;
  other_chain.header.set_pull_chain(12345);
  s = copy.Apply(other_chain);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("chain"));
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  Message bad_threshold = good;
  bad_threshold.header.mutable_frames(0)->set_threshold(-1.0f);
  EXPECT_EQ(copy.Apply(bad_threshold).code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  Message too_few = good;
  too_few.header.set_pull_version(good.header.pull_version() + 1);
  EXPECT_EQ(copy.Apply(too_few).code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  EXPECT_TRUE(SameBits(Values(copy, kN), shadow.shadow()));
}

TEST(PullShadowTest, AnotherChainOrAVersionPastTheHistoryGetsTheShadowWhole) {
  std::vector<float> w(20, 0.0f);
  Buffer weights = Floats(w);
  PullShadow shadow(weights, 42);
  PulledCopy copy(20);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  for (size_t round = 0; round < PullShadow::kHistory + 2; ++round) {
    w[round % 20] += 1.0f;
    weights = Floats(w);
    shadow.MarkChanged();
    wire::Header probe;  // somebody else pulls: a version per round
    probe.set_pull_compressed(true);
    Message ignored;
    shadow.Answer(weights, probe, &ignored);
  }
  const Message reply = Ask(shadow, weights, copy);
  EXPECT_EQ(reply.header.pull_from_version(), 0u) << "fell behind the history";
  ASSERT_TRUE(copy.Apply(reply).ok());
  EXPECT_TRUE(SameBits(Values(copy, 20), shadow.shadow()));
  // A restarted server: another chain; the worker's copy is not trusted.
  PullShadow restarted(weights, 43);
  const Message whole = Ask(restarted, weights, copy);
  EXPECT_EQ(whole.header.pull_from_version(), 0u);
  EXPECT_EQ(whole.header.pull_chain(), 43u);
}

TEST(PullShadowTest, NonFiniteWeightsAreSentWhole) {
  std::vector<float> w(8, 1.0f);
  Buffer weights = Floats(w);
  PullShadow shadow(weights, 1);
  PulledCopy copy(8);
  ASSERT_TRUE(copy.Apply(Ask(shadow, weights, copy)).ok());
  w[3] = std::numeric_limits<float>::infinity();
  weights = Floats(w);
  shadow.MarkChanged();
  const Message reply = Ask(shadow, weights, copy);
  EXPECT_EQ(reply.header.pull_from_version(), 0u);
  ASSERT_TRUE(copy.Apply(reply).ok());
  EXPECT_EQ(Values(copy, 8), w);
}

}  // namespace
}  // namespace tessera

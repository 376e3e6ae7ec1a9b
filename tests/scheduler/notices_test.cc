// The scheduler's notices (scheduler/notices.h): sent until acknowledged,
// resent at doubling waits up to 8x the time-out, replaced by a table that
// covers them, dropped by peer or command.
#include "scheduler/notices.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

constexpr int kScheduler = 1;
constexpr int kProvisional = 1000000;

struct Sent {
  int peer;
  Message msg;
};

class NoticesTest : public ::testing::Test {
 protected:
  NoticesTest()
      : notices_(
            Notices::Settings{true, absl::Seconds(1), kScheduler, kProvisional},
            [this](int peer, const Message& msg) {
              sent_.push_back({peer, msg});
              return absl::OkStatus();
            },
            [](int peer) { return "node " + std::to_string(peer); },
            &resends_) {}

  static Message Table(std::vector<int> ids) {
    Message m;
    m.header.set_command(wire::NODE_TABLE);
    for (int id : ids) m.header.mutable_node_table()->add_nodes()->set_id(id);
    return m;
  }
  static Message Command(wire::Command c) {
    Message m;
    m.header.set_command(c);
    return m;
  }
  static wire::Header Ack(const Message& notice, int sender) {
    wire::Header h;
    h.set_command(notice.header.command());
    h.set_request_id(notice.header.request_id());
    h.set_sender(sender);
    h.set_is_response(true);
    return h;
  }

  std::vector<Sent> sent_;
  Counter resends_;
  Notices notices_;
  const absl::Time t0_ = absl::FromUnixSeconds(1000);
};

TEST_F(NoticesTest, SentWithItsAddressAndKeptUntilItsNodeAcknowledges) {
  notices_.Send(9, Table({8, 9}), t0_);
  ASSERT_EQ(sent_.size(), 1u);
  const Message& m = sent_[0].msg;
  EXPECT_EQ(sent_[0].peer, 9);
  EXPECT_EQ(m.header.request_id(), 1u);
  EXPECT_EQ(m.header.sender(), kScheduler);
  EXPECT_EQ(m.header.recipient(), 9);
  EXPECT_EQ(m.header.plane(), wire::CONTROL);
  EXPECT_EQ(notices_.size(), 1u);
  EXPECT_EQ(notices_.next_resend(), t0_ + absl::Seconds(1));
  // Another node's acknowledgement, or one of another command, is none.
  EXPECT_FALSE(notices_.Acknowledge(Ack(m, 8)).has_value());
  wire::Header other = Ack(m, 9);
  other.set_command(wire::BARRIER);
  EXPECT_FALSE(notices_.Acknowledge(other).has_value());
  other = Ack(m, 9);
  other.set_request_id(2);
  EXPECT_FALSE(notices_.Acknowledge(other).has_value());
  std::optional<Message> acked = notices_.Acknowledge(Ack(m, 9));
  ASSERT_TRUE(acked.has_value());
  EXPECT_EQ(acked->header.node_table().nodes_size(), 2);
  EXPECT_TRUE(notices_.empty());
  EXPECT_FALSE(notices_.Acknowledge(Ack(m, 9)).has_value());  // only once
}

TEST_F(NoticesTest, ANodeWithoutAnIdYetAcknowledgesUnderAnySender) {
  notices_.Send(kProvisional + 3, Command(wire::TERMINATE), t0_);
  EXPECT_TRUE(notices_.Acknowledge(Ack(sent_[0].msg, 0)).has_value());
}

TEST_F(NoticesTest, ResentAtDoublingWaitsUpToEightTimesTheTimeout) {
  notices_.Send(9, Command(wire::TERMINATE), t0_);
  // Due at 1 s; then waits of 2, 4, 8, 8 s.
  std::vector<double> resent_at;
  for (int ms = 0; ms <= 40000; ms += 100) {
    const size_t before = sent_.size();
    notices_.ResendDue(t0_ + absl::Milliseconds(ms));
    if (sent_.size() > before) resent_at.push_back(ms / 1000.0);
  }
  EXPECT_EQ(resent_at, (std::vector<double>{1, 3, 7, 15, 23, 31, 39}));
  EXPECT_EQ(resends_.value(), 7u);
  for (const Sent& s : sent_) EXPECT_EQ(s.msg.header.request_id(), 1u);
}

TEST_F(NoticesTest, WithoutResendsEveryNoticeGoesOnce) {
  Notices once(
      Notices::Settings{false, absl::Seconds(1), kScheduler, kProvisional},
      [this](int peer, const Message& msg) {
        sent_.push_back({peer, msg});
        return absl::OkStatus();
      },
      [](int) { return std::string(); }, nullptr);
  once.Send(9, Command(wire::TERMINATE), t0_);
  once.ResendDue(t0_ + absl::Seconds(60));
  EXPECT_EQ(sent_.size(), 1u);
  EXPECT_EQ(once.size(), 1u);
}

TEST_F(NoticesTest, ATableReplacesThePendingTablesItCovers) {
  notices_.Send(9, Table({8, 9}), t0_);  // id 1
  notices_.Send(9, Table({10}), t0_);    // id 2: a change of another node
  notices_.Send(7, Table({8, 9}), t0_);  // id 3: another peer
  notices_.Send(9, Command(wire::HANDBACK), t0_);  // id 4
  // Covers 1 (8 and 9) but not 2 (10): 1 goes, 2 stays; 7's stays.
  notices_.Send(9, Table({8, 9, 11}), t0_);  // id 5
  EXPECT_EQ(notices_.size(), 4u);
  EXPECT_FALSE(notices_.Acknowledge(Ack(sent_[0].msg, 9)).has_value());
  EXPECT_TRUE(notices_.Acknowledge(Ack(sent_[1].msg, 9)).has_value());
  EXPECT_TRUE(notices_.Acknowledge(Ack(sent_[2].msg, 7)).has_value());
  EXPECT_EQ(notices_.Peers(10), (std::vector<int>{9, 9}));
}

TEST_F(NoticesTest, DroppedByPeerOrCommandAndClearedWhole) {
  notices_.Send(9, Command(wire::HANDBACK), t0_);
  notices_.Send(9, Table({9}), t0_);
  notices_.Send(7, Command(wire::HANDBACK), t0_);
  notices_.Send(6, Table({6}), t0_);
  EXPECT_EQ(notices_.Peers(3), (std::vector<int>{9, 9, 7}));
  notices_.DropTo(9);
  EXPECT_EQ(notices_.Peers(10), (std::vector<int>{7, 6}));
  notices_.DropCommand(wire::HANDBACK);
  EXPECT_EQ(notices_.Peers(10), (std::vector<int>{6}));
  notices_.Clear();
  EXPECT_TRUE(notices_.empty());
  EXPECT_EQ(notices_.next_resend(), absl::InfiniteFuture());
  const size_t before = sent_.size();
  notices_.ResendDue(t0_ + absl::Seconds(60));
  EXPECT_EQ(sent_.size(), before);
}

}  // namespace
}  // namespace tessera

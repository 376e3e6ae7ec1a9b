// Priorities in the queues (common/send_order.h, docs/priority.md): where a
// message goes in a queue, a server shard's BoundedQueue, and a sealed link's
// sending queue between two real transports on loopback: an urgent slice
// issued behind 100 MiB of less urgent ones goes out right after the one in
// progress, while FIFO sends it last.
#include "common/send_order.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/bounded_queue.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "common/transport.h"
#include "common/zmq_transport_internal.h"
#include "gtest/gtest.h"

namespace tessera {
namespace zmq_internal {

// How many messages a sealed link holds unsent (the first perhaps started).
class ZmqTransportTestPeer {
 public:
  explicit ZmqTransportTestPeer(Transport* transport)
      : t_(static_cast<ZmqTransport*>(transport)) {}
  size_t Waiting(int peer) {
    std::shared_ptr<ZmqTransport::Sender> link;
    {
      absl::MutexLock lock(&t_->senders_mu_);
      auto it = t_->senders_.find(peer);
      if (it == t_->senders_.end()) return 0;
      link = it->second;
    }
    absl::MutexLock lock(&link->mu);
    return link->pending.size();
  }

 private:
  ZmqTransport* t_;
};

}  // namespace zmq_internal
namespace {

OrderTag Tag(int32_t priority, uint64_t key) {
  OrderTag t;
  t.ordered = true;
  t.priority = priority;
  t.has_key = true;
  t.key = key;
  return t;
}

// Where `tag` goes among `queued` (std::nullopt: an entry that started).
size_t At(const std::vector<std::optional<OrderTag>>& queued,
          const OrderTag& tag) {
  return OrderedPosition(queued.begin(), queued.end(), tag,
                         [](const std::optional<OrderTag>& e) { return e; });
}

TEST(SendOrderTest, AnUrgentMessagePassesLessUrgentOnesOfOtherKeys) {
  EXPECT_EQ(At({Tag(0, 1), Tag(-1, 2), Tag(-2, 3)}, Tag(5, 9)), 0u);
  EXPECT_EQ(At({Tag(0, 1), Tag(-1, 2), Tag(-2, 3)}, Tag(-1, 9)), 2u);
  // FIFO among equals.
  EXPECT_EQ(At({Tag(3, 1), Tag(3, 2)}, Tag(3, 9)), 2u);
}

TEST(SendOrderTest, ItNeverPassesTheStartedOneItsOwnKeyOrAnUnorderedOne) {
  EXPECT_EQ(At({std::nullopt, Tag(-1, 2)}, Tag(5, 9)), 1u);
  EXPECT_EQ(At({Tag(-1, 1), Tag(-1, 9), Tag(-1, 3)}, Tag(5, 9)), 2u);
  EXPECT_EQ(At({Tag(-1, 1), OrderTag{}, Tag(-1, 3)}, Tag(5, 9)), 2u);
  // A message without a priority goes last, whatever is queued.
  EXPECT_EQ(At({Tag(-1, 1), Tag(-2, 3)}, OrderTag{}), 2u);
  EXPECT_EQ(At({}, Tag(5, 9)), 0u);
}

TEST(SendOrderTest, ABoundedQueuePopsTheMoreUrgentFirst) {
  BoundedQueue<int> q(16);
  ASSERT_TRUE(q.Push(1, 0, Tag(-3, 1)));
  ASSERT_TRUE(q.Push(2, 0, Tag(-2, 2)));
  ASSERT_TRUE(q.Push(3));  // no priority: keeps its place
  ASSERT_TRUE(q.Push(4, 0, Tag(-5, 4)));
  ASSERT_TRUE(q.Push(5, 0, Tag(0, 5)));
  ASSERT_TRUE(q.Push(6, 0, Tag(-9, 2)));  // key 2 again
  ASSERT_TRUE(q.Push(7, 0, Tag(9, 2)));   // behind key 2's earlier one
  std::vector<int> popped;
  for (int i = 0; i < 7; ++i) popped.push_back(*q.Pop());
  EXPECT_EQ(popped, (std::vector<int>{2, 1, 3, 5, 4, 6, 7}));
}

TEST(SendOrderTest, PrioritiesOutsideTheRangeAreRefusedNamingThem) {
  EXPECT_TRUE(CheckPriority(kMaxPriority, "p").ok());
  EXPECT_TRUE(CheckPriority(kMinPriority, "p").ok());
  absl::Status bad = CheckPriority(kMaxPriority + 1, "the priority of key 7");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(),
            "the priority of key 7 is 1000000001: expected an integer from "
            "-1000000000 to 1000000000 (higher is more urgent)");
}

constexpr int kServer = 8;
constexpr int kWorker = 9;
constexpr int kSlices = 100;
constexpr size_t kSliceBytes = 1 << 20;
constexpr uint64_t kUrgentKey = 1;

std::unique_ptr<Transport> Make(const JobKeySet& job, Role role,
                                int64_t credit_bytes) {
  auto security = std::make_shared<ConnectionSecurity>();
  security->keys = *ParseKeyFile(FormatKeyFile(job, role), "test");
  ZmqTransportOptions options;
  options.security = security;
  options.credit_bytes = credit_bytes;
  options.linger = absl::ZeroDuration();
  return NewZmqTransport(options);
}

Message Slice(uint64_t key, std::optional<int32_t> priority,
              const Buffer& data) {
  Message m;
  m.header.set_command(wire::KV_PUSH);
  m.header.set_plane(wire::DATA);
  m.header.set_sender(kWorker);
  m.header.set_recipient(kServer);
  m.header.mutable_slice()->set_key(key);
  if (priority.has_value()) m.header.set_priority(*priority);
  wire::DataFrame* d = m.header.add_frames();
  d->set_encoding(wire::DataFrame::RAW);
  d->set_num_bytes(data.size());
  m.data.push_back(data);
  return m;
}

class SealedSendOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = Make(job_, Role::kServer, credit_bytes_);
    worker_ = Make(job_, Role::kWorker, credit_bytes_);
    absl::StatusOr<int> port = server_->Bind("127.0.0.1", 0);
    ASSERT_TRUE(port.ok()) << port.status();
    ASSERT_TRUE(worker_->Bind("127.0.0.1", 0).ok());
    worker_->SetPeerIdentity(
        kServer, {Role::kServer, server_->node_key(), server_->sealed_port()});
    server_->SetPeerIdentity(
        kWorker, {Role::kWorker, worker_->node_key(), worker_->sealed_port()});
    ASSERT_TRUE(worker_->Connect(kServer, "127.0.0.1", *port).ok());
  }
  void TearDown() override {
    worker_->Close();
    server_->Close();
  }

  // Sends kSlices slices of 1 MiB (keys 100.., priority -1 or none) while
  // the server reads nothing, waits for the link to stall (what went out
  // fills ZeroMQ's and the kernel's buffers), then the urgent slice. Returns
  // its place among what the server receives, and sets `gone` to the
  // slices that had left the link's queue before it was sent.
  size_t UrgentPlace(std::optional<int32_t> slices,
                     std::optional<int32_t> urgent, size_t* gone) {
    const Buffer data =
        Buffer::CopyOf(std::string(kSliceBytes, 'x').data(), kSliceBytes);
    for (int i = 0; i < kSlices; ++i)
      EXPECT_TRUE(worker_->Send(kServer, Slice(100 + i, slices, data)).ok());
    zmq_internal::ZmqTransportTestPeer peer(worker_.get());
    size_t waiting = peer.Waiting(kServer);
    for (int stable = 0; stable < 10;) {  // unchanged for 500 ms
      absl::SleepFor(absl::Milliseconds(50));
      const size_t now = peer.Waiting(kServer);
      stable = now == waiting ? stable + 1 : 0;
      waiting = now;
    }
    *gone = kSlices - waiting;
    const float small[4] = {1, 2, 3, 4};
    EXPECT_TRUE(worker_
                    ->Send(kServer, Slice(kUrgentKey, urgent,
                                          Buffer::CopyOf(small, sizeof(small))))
                    .ok());
    size_t place = kSlices + 1;
    for (size_t i = 0; i <= kSlices; ++i) {
      absl::StatusOr<Message> m = server_->Receive(absl::Seconds(20));
      if (!m.ok()) {
        ADD_FAILURE() << "message " << i << " not received: " << m.status();
        break;
      }
      if (m->header.slice().key() == kUrgentKey) place = i;
    }
    return place;
  }

  // 0: the kernel's own socket buffers (ZmqTransportOptions::credit_bytes).
  int64_t credit_bytes_ = 0;
  const JobKeySet job_ = GenerateJobKeys().value();
  std::unique_ptr<Transport> server_;
  std::unique_ptr<Transport> worker_;
};

// The link stalls with some slices gone (into ZeroMQ's 1 MiB of sealed
// records ahead of the socket, the kernel's socket buffers and the
// receiver's 64-record queue) and the rest waiting as references. The urgent
// slice then goes right after the one being sealed: at most one slice more
// than had gone. Without priorities it is the last of all.
TEST_F(SealedSendOrderTest, AnUrgentSliceGoesAfterTheOneInProgress) {
  size_t gone = 0;
  const size_t place = UrgentPlace(-1, 0, &gone);
  EXPECT_LT(gone, static_cast<size_t>(kSlices) / 2)
      << "the link did not stall: nothing to pass";
  EXPECT_LE(place, gone + 1) << gone << " slices had gone";
  std::printf(
      "%zu of %d slices had gone when the urgent one was sent; it "
      "arrived as message %zu\n",
      gone, kSlices, place);
}

TEST_F(SealedSendOrderTest, WithoutPrioritiesTheQueueIsFifo) {
  size_t gone = 0;
  EXPECT_EQ(UrgentPlace(std::nullopt, std::nullopt, &gone),
            static_cast<size_t>(kSlices));
}

// With a credit of 256 KiB the link holds at most: the 1 MiB of sealed
// records ahead of the socket, each end's socket buffer (Linux doubles the
// size asked for, to count its bookkeeping), and the receiver's queue of
// credit / record records (at least 4). The urgent slice passes everything
// else.
class CreditedSendOrderTest : public SealedSendOrderTest {
 protected:
  CreditedSendOrderTest() { credit_bytes_ = 256 << 10; }
};

TEST_F(CreditedSendOrderTest, AnUrgentSliceWaitsForAtMostTheCredit) {
  size_t gone = 0;
  const size_t place = UrgentPlace(-1, 0, &gone);
  const int64_t record = ZmqTransportOptions().sealed_record_bytes;
  const int64_t queue = std::max<int64_t>(4, credit_bytes_ / record);
  const int64_t held =
      zmq_internal::kBacklogLimit + 2 * 2 * credit_bytes_ + queue * record;
  // What the link holds, in whole slices, and the one being sealed.
  const size_t most = static_cast<size_t>(
      (held + static_cast<int64_t>(kSliceBytes) - 1) / kSliceBytes + 1);
  EXPECT_LE(gone, most) << "the credit did not bound what left the queue";
  EXPECT_LE(place, gone + 1) << gone << " slices had gone";
  std::printf(
      "credit %lld bytes: %zu of %d slices had gone (at most %zu); the urgent "
      "one arrived as message %zu\n",
      static_cast<long long>(credit_bytes_), gone, kSlices, most, place);
}

}  // namespace
}  // namespace tessera

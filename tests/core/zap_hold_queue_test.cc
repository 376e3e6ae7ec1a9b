// The ZAP handler's hold queue alone (common/zap_hold_queue.h), with room
// for 6 held answers and 4 per address: one address's share, a full queue
// that refuses the newest of the address holding the most, and arrival
// order kept for expiry. Built into sealed_admission_test.
#include "common/zap_hold_queue.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// A request from `address`, named `name` (its routing id), claiming `key`.
ZapRequest Held(const std::string& name, const std::string& address,
                absl::Time until = absl::InfiniteFuture(),
                const std::string& key = "k") {
  ZapRequest r;
  r.routing_id = name;
  r.key = key;
  r.frames = {"1.0", "1",     "tessera-sealed", address,
              "",    "PLAIN", "worker:x",       "password"};
  r.until = until;
  return r;
}

TEST(ZapHoldQueueTest, OneAddressHoldsAtMostItsShare) {
  ZapHoldQueue queue(ZapHoldQueue::Limits{6, 4});
  std::string why;
  for (int i = 0; i < 4; ++i)
    EXPECT_FALSE(queue.Hold(Held(absl::StrCat("a", i), "A"), &why));
  std::optional<ZapRequest> refused = queue.Hold(Held("a4", "A"), &why);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->routing_id, "a4");
  EXPECT_EQ(why, "4 connections from A already wait for their keys");
  EXPECT_EQ(queue.size(), 4u);
  EXPECT_EQ(queue.held_from("A"), 4u);
}

TEST(ZapHoldQueueTest, AFullQueueRefusesTheNewestOfTheBiggestHolder) {
  ZapHoldQueue queue(ZapHoldQueue::Limits{6, 4});
  std::string why;
  for (int i = 0; i < 4; ++i)
    EXPECT_FALSE(queue.Hold(Held(absl::StrCat("a", i), "A"), &why));
  for (int i = 0; i < 2; ++i)
    EXPECT_FALSE(queue.Hold(Held(absl::StrCat("b", i), "B"), &why));
  // Full: C takes A's newest slot, then A's next newest.
  std::optional<ZapRequest> refused = queue.Hold(Held("c0", "C"), &why);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->routing_id, "a3");
  EXPECT_EQ(why,
            "6 connections already wait for their keys, 4 from A (the most); "
            "its newest gives up its slot to one from C");
  refused = queue.Hold(Held("c1", "C"), &why);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->routing_id, "a2");
  // A, B and C hold 2 each: no one holds more than C, so C's third waits
  // not.
  refused = queue.Hold(Held("c2", "C"), &why);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->routing_id, "c2");
  EXPECT_EQ(why,
            "6 connections already wait for their keys, none from an address "
            "with more than 2 of them (C)");
  EXPECT_EQ(queue.size(), 6u);
  EXPECT_EQ(queue.held_from("A"), 2u);
  EXPECT_EQ(queue.held_from("C"), 2u);
  std::vector<std::string> order;
  for (const ZapRequest& r : queue.TakeAll()) order.push_back(r.routing_id);
  EXPECT_EQ(order,
            (std::vector<std::string>{"a0", "a1", "b0", "b1", "c0", "c1"}));
  EXPECT_EQ(queue.size(), 0u);
  EXPECT_EQ(queue.held_from("A"), 0u);
}

TEST(ZapHoldQueueTest, ExpiredOnesGoInArrivalOrderAndAReheldOneKeepsItsPlace) {
  ZapHoldQueue queue(ZapHoldQueue::Limits{6, 4});
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::string why;
  for (int i = 0; i < 4; ++i) {
    EXPECT_FALSE(queue.Hold(
        Held(absl::StrCat("r", i), "A", t0 + absl::Seconds(i)), &why));
  }
  std::vector<ZapRequest> all = queue.TakeAll();
  ASSERT_EQ(all.size(), 4u);
  // Held again in another order: arrival order stays.
  for (int i : {2, 0, 3, 1}) EXPECT_FALSE(queue.Hold(std::move(all[i]), &why));
  std::vector<std::string> expired;
  for (const ZapRequest& r : queue.TakeExpired(t0 + absl::Seconds(1)))
    expired.push_back(r.routing_id);
  EXPECT_EQ(expired, (std::vector<std::string>{"r0", "r1"}));
  EXPECT_EQ(queue.size(), 2u);
  EXPECT_EQ(queue.held_from("A"), 2u);
}

TEST(ZapHoldQueueTest, TakeKeyGivesThatKeysRequestsOnly) {
  ZapHoldQueue queue(ZapHoldQueue::Limits{6, 4});
  std::string why;
  const absl::Time never = absl::InfiniteFuture();
  EXPECT_FALSE(queue.Hold(Held("a0", "A", never, "K1"), &why));
  EXPECT_FALSE(queue.Hold(Held("b0", "B", never, "K2"), &why));
  EXPECT_FALSE(queue.Hold(Held("a1", "A", never, "K1"), &why));
  EXPECT_TRUE(queue.TakeKey("K3").empty());
  std::vector<std::string> taken;
  for (const ZapRequest& r : queue.TakeKey("K1")) taken.push_back(r.routing_id);
  EXPECT_EQ(taken, (std::vector<std::string>{"a0", "a1"}));
  EXPECT_EQ(queue.size(), 1u);
  EXPECT_EQ(queue.held_from("A"), 0u);
  EXPECT_TRUE(queue.TakeKey("K1").empty());
  ASSERT_EQ(queue.TakeKey("K2").size(), 1u);
  EXPECT_EQ(queue.size(), 0u);
}

}  // namespace
}  // namespace tessera

// HashedTable (server/hashed_table.h) and HashedSpec (common/hashed_spec.h):
// admission exactly at the threshold, expiry exactly at the stated age, the
// capacity bound under a stream of new ids (least recently pushed evicted,
// refused when every row is from this round), initial rows the same for every
// table, and a snapshot that restores the table, its recency order and its
// admission counts bit for bit.
#include "server/hashed_table.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/hashed_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/optimizer.h"

namespace tessera {
namespace {

constexpr uint64_t kLen = 4;

HashedSpec Spec(const std::string& text) {
  absl::StatusOr<HashedSpec> s = HashedSpec::Parse(text);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : HashedSpec();
}

// One round: `ids` (distinct), each named by `sightings` pushes, gradient
// all `g`; no optimizer: each row becomes its gradient.
void Round(HashedTable& t, const std::vector<uint64_t>& ids, float g = 1.0f,
           uint32_t sightings = 1, const Optimizer* opt = nullptr) {
  const std::vector<float> grad(kLen, g);
  t.ApplyRound(
      ids, std::vector<uint32_t>(ids.size(), sightings),
      [&](size_t) { return grad.data(); }, opt, t.round() + 1);
}

std::vector<float> Row(const HashedTable& t, uint64_t id) {
  std::vector<float> r(kLen);
  t.Read(id, r.data());
  return r;
}

TEST(HashedSpecTest, ParsesPrintsAndNamesBadOptions) {
  const HashedSpec s = Spec(
      "init=normal mean=0.5 std=0.25 seed=7 admit_after=3 expire_after=10 "
      "capacity=100");
  EXPECT_EQ(s.init, HashedSpec::Init::kNormal);
  EXPECT_EQ(s.admit_after, 3u);
  EXPECT_EQ(s.expire_after, 10u);
  EXPECT_EQ(s.capacity, 100u);
  EXPECT_EQ(Spec(s.ToString()).ToString(), s.ToString());
  const HashedSpec d = Spec("");
  EXPECT_EQ(d.init, HashedSpec::Init::kZeros);
  EXPECT_EQ(d.admit_after, 1u);
  EXPECT_EQ(d.capacity, 0u);
  auto error = [](const std::string& text) {
    return std::string(HashedSpec::Parse(text).status().message());
  };
  EXPECT_EQ(error("init=gauss"),
            "hashed key option init: expected zeros, uniform or normal, got "
            "'gauss'");
  EXPECT_EQ(error("admit_after=0"),
            "hashed key option admit_after: expected a whole number >= 1, got "
            "'0'");
  EXPECT_EQ(error("capacity=-1"),
            "hashed key option capacity: expected a whole number >= 0, got "
            "'-1'");
  EXPECT_EQ(error("std=nan"),
            "hashed key option std: expected a finite number, got 'nan'");
  EXPECT_EQ(error("init=uniform low=1 high=0"),
            "hashed key options: low=1 must not exceed high=0");
  EXPECT_NE(error("init=uniform low=-3e38 high=3e38").find("must be a finite"),
            std::string::npos);
  EXPECT_NE(error("colour=red").find("unknown option 'colour'"),
            std::string::npos);
  EXPECT_NE(error("seed").find("expected name=value"), std::string::npos);
}

TEST(HashedSpecTest, InitialRowsAreAFunctionOfSeedIdAndColumnAlone) {
  const HashedSpec u = Spec("init=uniform low=-2 high=3 seed=11");
  const HashedSpec n = Spec("init=normal mean=1 std=0.5 seed=11");
  const HashedSpec other_seed = Spec("init=uniform low=-2 high=3 seed=12");
  double sum = 0, sq = 0;
  int differ = 0;
  const int kIds = 20000;
  for (int i = 0; i < kIds; ++i) {
    const uint64_t id = 0x9e3779b97f4a7c15ULL * (i + 1);
    const float v = u.InitialValue(id, 3);
    EXPECT_GE(v, -2.0f);
    EXPECT_LE(v, 3.0f);
    EXPECT_EQ(v, u.InitialValue(id, 3));  // the same on every call
    differ += v != other_seed.InitialValue(id, 3);
    const double z = n.InitialValue(id, 0);
    sum += z;
    sq += z * z;
  }
  EXPECT_GT(differ, kIds * 99 / 100);
  const double mean = sum / kIds, sd = std::sqrt(sq / kIds - mean * mean);
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_NEAR(sd, 0.5, 0.02);
  EXPECT_EQ(Spec("").InitialValue(42, 0), 0.0f);
  // Ids spread over servers evenly whatever their values.
  std::vector<int> per(3, 0);
  for (uint64_t id = 0; id < 30000; ++id) ++per[HashedServerOf(id << 20, 3)];
  for (int c : per) EXPECT_NEAR(c, 10000, 400);
}

TEST(HashedTableTest, AnIdGetsARowExactlyAtItsAdmitAfterthPush) {
  HashedTable t(kLen, Spec("init=uniform low=0 high=1 seed=3 admit_after=3"));
  const std::vector<float> init = Row(t, 77);
  Round(t, {77});  // 1 push
  EXPECT_FALSE(t.Has(77));
  EXPECT_EQ(t.SketchCount(77), 1u);
  EXPECT_EQ(Row(t, 77), init) << "a pull of an id without a row: its init";
  Round(t, {77});  // 2
  EXPECT_FALSE(t.Has(77));
  EXPECT_EQ(t.counts().dropped, 2u);
  Round(t, {77});  // 3: admitted, and this round's gradient applied
  ASSERT_TRUE(t.Has(77));
  EXPECT_EQ(Row(t, 77), std::vector<float>(kLen, 1.0f));
  EXPECT_EQ(t.counts().admitted, 1u);
  // Two pushes in one round count twice: admitted in its second round.
  Round(t, {5}, 1.0f, /*sightings=*/2);
  EXPECT_FALSE(t.Has(5));
  Round(t, {5});
  EXPECT_TRUE(t.Has(5));
}

TEST(HashedTableTest, ARowExpiresExactlyExpireAfterRoundsAfterItsLastPush) {
  HashedTable t(kLen, Spec("expire_after=2"));
  Round(t, {1, 2});  // round 1
  Round(t, {2});     // round 2
  EXPECT_TRUE(t.Has(1)) << "1 round untouched";
  Round(t, {3});  // round 3: 1 was last pushed in round 1 = 3 - 2
  EXPECT_FALSE(t.Has(1));
  EXPECT_TRUE(t.Has(2));
  EXPECT_EQ(t.counts().expired, 1u);
  Round(t, {});  // round 4: 2 last pushed in round 2
  EXPECT_FALSE(t.Has(2));
  EXPECT_TRUE(t.Has(3));
  EXPECT_EQ(Row(t, 2), std::vector<float>(kLen, 0.0f)) << "back to its init";
  // The largest expire_after means never, not an overflow.
  HashedTable never(kLen, Spec("expire_after=18446744073709551615"));
  Round(never, {1});
  Round(never, {});
  EXPECT_TRUE(never.Has(1));
}

TEST(HashedTableTest, AtCapacityTheLeastRecentlyPushedGoesFirst) {
  HashedTable t(kLen, Spec("capacity=3"));
  Round(t, {10, 20, 30});  // round 1
  Round(t, {20});          // round 2: 20 is the most recent
  Round(t, {40});          // round 3: evicts the least recent of round 1
  EXPECT_EQ(t.rows(), 3u);
  EXPECT_EQ(t.counts().evicted, 1u);
  EXPECT_TRUE(t.Has(20));
  EXPECT_TRUE(t.Has(40));
  // Round 1's new rows were made in increasing id order, each the most
  // recent when made: 10 is the least recent.
  EXPECT_FALSE(t.Has(10));
  EXPECT_TRUE(t.Has(30));
  Round(t, {50, 60});  // evicts 30, then 20
  EXPECT_FALSE(t.Has(30));
  EXPECT_FALSE(t.Has(20));
  // Four new ids in one round with room for three and every row pushed in
  // this round: the largest is refused.
  Round(t, {1, 2, 3, 4});
  EXPECT_EQ(t.rows(), 3u);
  EXPECT_TRUE(t.Has(1) && t.Has(2) && t.Has(3));
  EXPECT_FALSE(t.Has(4));
  EXPECT_EQ(t.counts().refused, 1u);
}

// An adversary pushes 500 new ids every round; a valid worker pushes its
// 20 ids every round. Memory stays under the bound, the valid ids keep their
// rows (and their training), and with admit_after=2 the one-off ids never get
// one.
TEST(HashedTableTest, AStreamOfNewIdsStaysUnderTheBound) {
  for (const char* spec : {"capacity=200", "capacity=200 admit_after=2"}) {
    HashedTable t(kLen, Spec(spec));
    std::vector<uint64_t> valid;
    for (uint64_t i = 0; i < 20; ++i) valid.push_back(1000000 + i);
    uint64_t next = 1;
    uint64_t peak = 0;
    for (int r = 0; r < 50; ++r) {
      std::vector<uint64_t> ids = valid;
      for (int k = 0; k < 500; ++k) ids.push_back((next++) << 32);
      Round(t, ids, 1.0f);
      ASSERT_LE(t.rows(), 200u) << spec;
      peak = std::max(peak, t.bytes());
      // (With admit_after=2 the valid ids get rows in their second round.)
      for (uint64_t id : valid)
        if (r > 0) {
          ASSERT_TRUE(t.Has(id)) << spec << " round " << r;
        }
    }
    // Rows are 16 B here: the bound is the rows' chunks and metadata, and
    // the sketch (8 MiB) when admit_after > 1.
    const bool admission =
        std::string(spec).find("admit_after") != std::string::npos;
    EXPECT_LT(peak, (admission ? uint64_t{8} << 20 : 0) + (uint64_t{1} << 20))
        << spec;
    if (admission) {
      EXPECT_EQ(t.rows(), 20u);
      EXPECT_EQ(t.counts().dropped, 20u + 50u * 500u);
    } else {
      EXPECT_GT(t.counts().evicted + t.counts().refused, 0u);
    }
  }
}

TEST(HashedTableTest, OptimizerStateIsPerRowAndStartsAtZero) {
  std::unique_ptr<Optimizer> sgd =
      *Optimizer::Create("sgd lr=0.5 momentum=0.5 wd=0");
  HashedTable t(kLen, Spec("init=uniform low=1 high=2 seed=1"));
  const std::vector<float> init = Row(t, 9);
  Round(t, {9}, 1.0f, 1, sgd.get());
  Round(t, {9}, 1.0f, 1, sgd.get());
  // m1 = -0.5, w1 = init - 0.5; m2 = 0.5 * -0.5 - 0.5 = -0.75, w2 = w1 - 0.75.
  for (uint64_t j = 0; j < kLen; ++j)
    EXPECT_EQ(Row(t, 9)[j], (init[j] - 0.5f) - 0.75f) << j;
}

TEST(HashedTableTest, SnapshotRestoresRowsOrderAndCountsBitForBit) {
  std::unique_ptr<Optimizer> adam = *Optimizer::Create("adam lr=0.1");
  const HashedSpec spec = Spec(
      "init=normal std=0.1 seed=9 admit_after=2 expire_after=5 capacity=40");
  HashedTable a(kLen, spec);
  std::mt19937_64 rng(4);
  auto round_ids = [&rng]() {
    std::vector<uint64_t> ids;
    for (int k = 0; k < 30; ++k) ids.push_back(rng() % 100);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
  };
  for (int r = 0; r < 12; ++r) Round(a, round_ids(), 0.5f, 1, adam.get());
  wire::HashedState saved;
  a.Snapshot(&saved);
  HashedTable b(kLen, spec);
  ASSERT_TRUE(b.Restore(saved).ok());
  for (int r = 0; r < 12; ++r) {
    const std::vector<uint64_t> ids = round_ids();
    Round(a, ids, 0.25f, 1, adam.get());
    Round(b, ids, 0.25f, 1, adam.get());
  }
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.counts().admitted, b.counts().admitted);
  EXPECT_EQ(a.counts().evicted, b.counts().evicted);
  EXPECT_EQ(a.counts().expired, b.counts().expired);
  EXPECT_EQ(a.counts().dropped, b.counts().dropped);
  for (uint64_t id = 0; id < 100; ++id) {
    EXPECT_EQ(a.Has(id), b.Has(id)) << id;
    EXPECT_EQ(a.SketchCount(id), b.SketchCount(id)) << id;
    const std::vector<float> ra = Row(a, id), rb = Row(b, id);
    EXPECT_EQ(std::memcmp(ra.data(), rb.data(), kLen * sizeof(float)), 0) << id;
  }
  // A checkpoint of another shape is refused.
  HashedTable wrong(kLen + 1, spec);
  EXPECT_EQ(wrong.Restore(saved).code(), absl::StatusCode::kDataLoss);
  // So is one (a file, or a transfer from another server) that repeats an
  // id, holds more rows than the capacity or more optimizer states than an
  // optimizer keeps; the table keeps what it had (issue #46).
  const uint64_t rows = b.rows();
  auto refused = [&](const wire::HashedState& bad, const std::string& why) {
    const absl::Status s = b.Restore(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << why << ": " << s;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(why));
    EXPECT_EQ(b.rows(), rows);
  };
  ASSERT_GE(saved.ids_size(), 2);
  wire::HashedState twice = saved;
  twice.set_ids(1, twice.ids(0));
  refused(twice, absl::StrCat("holds id ", saved.ids(0), " twice"));
  wire::HashedState over = saved;
  const size_t row_bytes = kLen * sizeof(float);
  while (over.ids_size() <= 40) {
    over.add_ids(1000 + over.ids_size());
    over.add_last_round(0);
    over.mutable_rows()->append(row_bytes, '\0');
    for (std::string& st : *over.mutable_optimizer_state())
      st.append(row_bytes, '\0');
  }
  refused(over, "41 rows, more than its capacity=40");
  wire::HashedState states = saved;
  while (states.optimizer_state_size() <= 8)
    states.add_optimizer_state(std::string(saved.ids_size() * row_bytes, '\0'));
  refused(states, "9 optimizer states per row");
}

}  // namespace
}  // namespace tessera

// LocalGroup (issue #47): real processes of one host, forked by the test,
// summing through one shared-memory segment. Each child reports what it saw
// through a pipe; the parent checks every child's text and exit status.
#include "worker/client/local_group.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

std::string UniqueName() {
  static int next = 0;
  return absl::StrCat("/tessera-group-test-", getpid(), "-", next++);
}

bool SegmentExists(const std::string& name) {
  struct stat st;
  return stat(absl::StrCat("/dev/shm", name).c_str(), &st) == 0;
}

struct Child {
  std::string said;  // what the child wrote to its pipe
  int status = 0;    // waitpid's
};

// Forks `size` members; member r joins with `options` (rank r) and runs
// `body`, whose returned text the parent receives. Reaps every child within
// 60 s (then kills what is left).
std::vector<Child> RunGroup(
    const LocalGroup::Options& options,
    const std::function<std::string(LocalGroup&)>& body) {
  std::vector<int> pids, reads;
  for (int r = 0; r < options.size; ++r) {
    int fds[2];
    if (pipe(fds) != 0) abort();
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      LocalGroup::Options mine = options;
      mine.rank = r;
      absl::StatusOr<std::unique_ptr<LocalGroup>> group =
          LocalGroup::Join(mine);
      const std::string said =
          group.ok() ? body(**group)
                     : absl::StrCat("join: ", group.status().message());
      if (write(fds[1], said.data(), said.size()) < 0) _exit(3);
      close(fds[1]);
      group = absl::StatusOr<std::unique_ptr<LocalGroup>>();
      _exit(0);
    }
    close(fds[1]);
    pids.push_back(pid);
    reads.push_back(fds[0]);
  }
  std::vector<Child> children(options.size);
  for (int r = 0; r < options.size; ++r) {
    char buf[4096];
    ssize_t got;
    while ((got = read(reads[r], buf, sizeof(buf))) > 0) {
      children[r].said.append(buf, static_cast<size_t>(got));
    }
    close(reads[r]);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int r = 0; r < options.size; ++r) {
    while (waitpid(pids[r], &children[r].status, WNOHANG) == 0) {
      if (absl::Now() > deadline) kill(pids[r], SIGKILL);
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return children;
}

// Member r's contribution: values whose sums depend on the order of the
// additions (1e8 + 1 - 1e8 is 0 or 1 in float by order).
float Value(int rank, size_t j) {
  static const float kMix[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.5f, -0.25f};
  return kMix[(rank + j) % 6] + static_cast<float>(j % 97) * 0.125f;
}

// What the group must give: the additions in member order.
std::vector<float> Expected(int size, size_t n) {
  std::vector<float> sum(n);
  for (size_t j = 0; j < n; ++j) {
    float acc = Value(0, j);
    for (int r = 1; r < size; ++r) acc += Value(r, j);
    sum[j] = acc;
  }
  return sum;
}

std::string CheckEqual(const std::vector<float>& got,
                       const std::vector<float>& want, size_t first,
                       size_t last) {
  for (size_t j = first; j < last; ++j) {
    if (std::memcmp(&got[j], &want[j], sizeof(float)) != 0) {
      return absl::StrCat("element ", j, ": ", got[j], ", expected ", want[j]);
    }
  }
  return "ok";
}

TEST(LocalGroupTest, AllReduceAddsInMemberOrderWhoeverArrivesFirst) {
  for (int size : {1, 2, 4}) {
    // 64-float windows: 1000 elements go in 16 of them.
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      LocalGroup::Options o;
      o.name = UniqueName();
      o.size = size;
      o.capacity = 256;
      const std::vector<float> want = Expected(size, n);
      std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
        std::mt19937 rng(g.rank() * 7919 + static_cast<int>(n));
        std::string said;
        for (int round = 0; round < 3; ++round) {
          std::vector<float> data(n);
          for (size_t j = 0; j < n; ++j) data[j] = Value(g.rank(), j);
          absl::SleepFor(absl::Microseconds(rng() % 3000));
          if (absl::Status s = g.AllReduce(data.data(), n); !s.ok()) {
            return std::string(s.message());
          }
          said = CheckEqual(data, want, 0, n);
          if (said != "ok") break;
        }
        return said;
      });
      for (int r = 0; r < size; ++r) {
        EXPECT_EQ(children[r].said, "ok")
            << "size " << size << " n " << n << " member " << r;
        EXPECT_TRUE(WIFEXITED(children[r].status) &&
                    WEXITSTATUS(children[r].status) == 0);
      }
      EXPECT_FALSE(SegmentExists(o.name)) << o.name;
    }
  }
}

TEST(LocalGroupTest, ReduceScatterFillsEachMembersShareOnly) {
  LocalGroup::Options o;
  o.name = UniqueName();
  o.size = 4;
  o.capacity = 128;      // 32 floats a window; shares cross windows
  const size_t n = 103;  // uneven: shares of 25, 26, 26, 26
  const std::vector<float> want = Expected(4, n);
  std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
    std::vector<float> data(n);
    for (size_t j = 0; j < n; ++j) data[j] = Value(g.rank(), j);
    const std::vector<float> before = data;
    if (absl::Status s = g.ReduceScatter(data.data(), n); !s.ok()) {
      return std::string(s.message());
    }
    const auto [first, last] = g.Share(n, g.rank());
    std::string said = CheckEqual(data, want, first, last);
    if (said == "ok") said = CheckEqual(data, before, 0, first);
    if (said == "ok") said = CheckEqual(data, before, last, n);
    return absl::StrCat(said, " ", first, "-", last);
  });
  EXPECT_EQ(children[0].said, "ok 0-25");
  EXPECT_EQ(children[1].said, "ok 25-51");
  EXPECT_EQ(children[2].said, "ok 51-77");
  EXPECT_EQ(children[3].said, "ok 77-103");
}

TEST(LocalGroupTest, IntegerCodesSumExactlyAndAllGatherSpreadsShares) {
  LocalGroup::Options o;
  o.name = UniqueName();
  o.size = 3;
  o.capacity = 64;  // 16 elements a window
  const size_t n = 50;
  std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
    // 2-bit codes as the group would sum them: -1, 0 or +1 per member.
    std::vector<int32_t> codes(n);
    for (size_t j = 0; j < n; ++j) {
      codes[j] = static_cast<int32_t>((j + g.rank()) % 3) - 1;
    }
    if (absl::Status s = g.AllReduce(codes.data(), n); !s.ok()) {
      return std::string(s.message());
    }
    for (size_t j = 0; j < n; ++j) {
      // (j % 3 - 1) + ((j + 1) % 3 - 1) + ((j + 2) % 3 - 1) = 0 for every j.
      if (codes[j] != 0) return absl::StrCat("code ", j, ": ", codes[j]);
    }
    // Each member's share holds its rank + 1; gathered, element j holds the
    // rank of the member whose share it is, + 1.
    std::vector<float> shares(n, -1.0f);
    const auto [first, last] = g.Share(n, g.rank());
    for (size_t j = first; j < last; ++j) shares[j] = g.rank() + 1.0f;
    if (absl::Status s = g.AllGather(shares.data(), n); !s.ok()) {
      return std::string(s.message());
    }
    std::string gathered;
    for (int m = 0; m < g.size(); ++m) {
      const auto [a, b] = g.Share(n, m);
      for (size_t j = a; j < b; ++j) {
        if (shares[j] != m + 1.0f) return absl::StrCat("share ", j);
      }
      absl::StrAppend(&gathered, m == 0 ? "" : ",", a, "-", b);
    }
    return gathered;
  });
  for (const Child& c : children) EXPECT_EQ(c.said, "0-16,16-33,33-50");
}

// GatherRanges right after AllReduce, many times over, with one member
// slowed before reading its result: a member that started the gather wrote
// into the results' region while a slower one still read its AllReduce from
// it (found in a 4-worker job: a count of 58 from a group of 4).
TEST(LocalGroupTest, GatherRangesRightAfterAnAllReduceLeavesItsResultAlone) {
  LocalGroup::Options o;
  o.name = UniqueName();
  o.size = 3;
  o.capacity = 64;  // 16 elements a window
  const size_t n = 40;
  std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
    for (int round = 0; round < 200; ++round) {
      std::vector<int32_t> ones(n, 1);
      if (absl::Status s = g.AllReduce(ones.data(), n); !s.ok())
        return std::string(s.message());
      for (size_t j = 0; j < n; ++j) {
        if (ones[j] != 3)
          return absl::StrCat("round ", round, " element ", j, ": ", ones[j]);
      }
      // Member m owns elements j with j % 3 == m, holding 1000 + j.
      std::vector<float> values(n, -1.0f);
      std::vector<std::pair<size_t, size_t>> mine;
      for (size_t j = g.rank(); j < n; j += 3) {
        values[j] = 1000.0f + j;
        mine.emplace_back(j, j + 1);
      }
      if (g.rank() == 0) absl::SleepFor(absl::Microseconds(50));
      if (absl::Status s = g.GatherRanges(values.data(), n, mine); !s.ok())
        return std::string(s.message());
      for (size_t j = 0; j < n; ++j) {
        if (values[j] != 1000.0f + j)
          return absl::StrCat("round ", round, " gathered ", j, ": ",
                              values[j]);
      }
    }
    return std::string("ok");
  });
  for (const Child& c : children) EXPECT_EQ(c.said, "ok");
}

TEST(LocalGroupTest, AMemberKilledMidRoundEndsTheOthersCallsNamingIt) {
  LocalGroup::Options o;
  o.name = UniqueName();
  o.size = 3;
  o.timeout = absl::Seconds(60);  // the death is seen long before this
  std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
    std::vector<float> data(10, 1.0f);
    if (absl::Status s = g.AllReduce(data.data(), 10); !s.ok()) {
      return absl::StrCat("first: ", s.message());
    }
    if (g.rank() == 2) raise(SIGKILL);
    const absl::Time start = absl::Now();
    absl::Status s = g.AllReduce(data.data(), 10);
    const bool soon = absl::Now() - start < absl::Seconds(10);
    // Once broken, the group stays broken.
    absl::Status again = g.Barrier();
    return absl::StrCat(s.ToString(), soon ? " (soon)" : " (late)",
                        again.message() == s.message() ? " same" : " other");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(children[r].said.find("UNAVAILABLE: member 2 (pid ") == 0)
        << children[r].said;
    EXPECT_NE(children[r].said.find(
                  absl::StrCat(") of local group ", o.name,
                               " ended; the group cannot go on (soon) same")),
              std::string::npos)
        << children[r].said;
  }
  EXPECT_TRUE(WIFSIGNALED(children[2].status));
  EXPECT_EQ(children[2].said, "");
  EXPECT_FALSE(SegmentExists(o.name));
}

TEST(LocalGroupTest, AMemberThatNeverArrivesIsNamedAtTheTimeOut) {
  LocalGroup::Options o;
  o.name = UniqueName();
  o.size = 2;
  o.timeout = absl::Milliseconds(300);
  std::vector<Child> children = RunGroup(o, [&](LocalGroup& g) {
    if (g.rank() == 1) {
      absl::SleepFor(absl::Seconds(1));
      return std::string(g.Barrier().ToString());
    }
    return g.Barrier().ToString();
  });
  const std::string late = absl::StrCat("DEADLINE_EXCEEDED: member 1 (pid ");
  EXPECT_EQ(children[0].said.find(late), 0u) << children[0].said;
  EXPECT_NE(children[0].said.find(absl::StrCat(") of local group ", o.name,
                                               " did not arrive within 300ms")),
            std::string::npos);
  // The late member learns the same when it arrives.
  EXPECT_EQ(children[1].said, children[0].said);
}

TEST(LocalGroupTest, AMemberToldAnotherSizeIsRefusedNamingBoth) {
  // Member 0 makes a group of 2; member 1 is told 3 members.
  LocalGroup::Options wrong;
  wrong.name = UniqueName();
  wrong.size = 2;
  wrong.timeout = absl::Seconds(1);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    LocalGroup::Options zero = wrong;
    zero.rank = 0;
    absl::StatusOr<std::unique_ptr<LocalGroup>> g = LocalGroup::Join(zero);
    const std::string said = g.ok() ? "joined" : g.status().ToString();
    if (write(fds[1], said.data(), said.size()) < 0) _exit(3);
    _exit(0);
  }
  close(fds[1]);
  absl::SleepFor(absl::Milliseconds(100));
  LocalGroup::Options three = wrong;
  three.size = 3;
  three.rank = 1;
  absl::StatusOr<std::unique_ptr<LocalGroup>> mine = LocalGroup::Join(three);
  EXPECT_EQ(mine.status().ToString(),
            absl::StrCat("FAILED_PRECONDITION: local group ", wrong.name,
                         " was made for 2 members of 8388608 bytes; this "
                         "member (rank 1) was told 3 members of 8388608 "
                         "bytes"));
  std::string zero_said;
  char buf[512];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof(buf))) > 0) zero_said.append(buf, got);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(
      zero_said.find("DEADLINE_EXCEEDED: member 1 (pid 0) of local group "), 0u)
      << zero_said;
  EXPECT_FALSE(SegmentExists(wrong.name));
}

TEST(LocalGroupTest, BadOptionsNameThemselves) {
  LocalGroup::Options o;
  o.name = "tessera";
  EXPECT_EQ(LocalGroup::Join(o).status().message(),
            "local group name 'tessera': expected '/' and 1-199 characters "
            "without '/'");
  o.name = "/a/b";
  EXPECT_EQ(LocalGroup::Join(o).status().message(),
            "local group name '/a/b': expected '/' and 1-199 characters "
            "without '/'");
  o.name = UniqueName();
  o.size = 65;
  EXPECT_EQ(LocalGroup::Join(o).status().message(),
            "local group size 65: expected 1 to 64");
  o.size = 4;
  o.rank = 4;
  EXPECT_EQ(LocalGroup::Join(o).status().message(),
            "local group rank 4: expected 0 to 3");
  o.rank = 0;
  o.capacity = 100;
  EXPECT_EQ(LocalGroup::Join(o).status().message(),
            "local group capacity 100: expected a positive multiple of 64");
}

}  // namespace
}  // namespace tessera

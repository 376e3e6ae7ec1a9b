// A worker of ssp_cluster_test (issue #49): checks dist_ssp's bound from
// outside, in a real job, and exits 0 when every pulled value kept it, 1
// naming the first value that did not.
//
//   ssp_worker STORE STEPS MAX_DELAY_MS
//
// STORE is dist_ssp (its bound from TESSERA_STALENESS, or SSP_SET_STALENESS=s
// through KVWorker::SetStaleness) or dist_sync (every value checked exact).
// With the servers' optimizer "sgd lr=-1" each push is added to the weights.
// Two keys: key 0 of W x 1000 values (split over the servers when
// TESSERA_BIGARRAY_BOUND is below that, and into slices by
// TESSERA_CHUNK_BYTES) and key 1 of W values. Value j counts the pushes of
// rank j mod W: rank r pushes 1 there and 0 elsewhere. So a pulled value
// says, for every rank, how many of its pushes to that part of the key the
// weights reflect.
//
// Each step: a random sleep of up to MAX_DELAY_MS (5x as long on rank
// SSP_SLOW_RANK, the straggler), a push of each key, a pull of each (all in
// flight at once; the pull carries the pushes before it), the wait. The pull
// of step t is made at clock c = t + 1 (this worker's pushes to the key).
// Checked, for every value of rank q:
//   q == this rank:  exactly c (its own pushes, no more)
//   dist_sync:       exactly c (the round's sum)
//   dist_ssp:        c - s <= value <= c + s + 1. The lower bound is the
//                    servers' promise (no push of q numbered below c - s is
//                    missing); the upper one follows from it, since q pulls
//                    before each next push: q's pull at clock k waited for
//                    this rank's k - s, and this rank had made c, so k <= c +
//                    s and q pushed at most k + 1.
// With SSP_LEAVE=R:K (TESSERA_ELASTIC) rank R leaves the job after K steps
// and the others go on: a value of rank R is then checked against
// min(bound, K), all of its K pushes having been applied before it left.
//
// A worker joining an elastic job (SSP_JOIN=R:K:PATH, SSP_WIDTH=W, the job's
// most workers, for the keys' sizes): every rank but R pauses after K
// steps ("paused after K steps") until the file PATH exists; rank R is the
// joiner, started by the test while they are paused. It starts at their
// clock K (the slowest's), so its value counts its pushes since: its pull
// of step t is at clock K + t + 1, and a value of rank R stands for K more
// pushes than it counts. Before any push it pulls every key, which must be
// exactly K for the others and 0 for itself ("first pull exact"); it runs
// STEPS - K steps. The others check rank R's values as 0 up to clock K
// (not in the job yet), within the bound after.
//
// Prints "ssp_worker rank R: STEPS steps, N values checked, most behind B,
// most ahead A" (over the other ranks: c - value and value - c).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tessera/kv_worker.h"

namespace {

using tessera::KVWorker;
using tessera::OpHandle;

int Fail(const std::string& what) {
  std::fprintf(stderr, "ssp_worker: %s\n", what.c_str());
  return 1;
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t n = 0;
  return v != nullptr && absl::SimpleAtoi(v, &n) ? n : fallback;
}

struct Plan {
  std::string store;
  int steps = 0;
  int max_delay_ms = 0;
  int64_t staleness = 0;
  int slow_rank = -1;
  int leave_rank = -1;
  int leave_after = 0;
  int join_rank = -1;  // SSP_JOIN
  int64_t join_clock = 0;
  std::string resume_file;
};

struct Tally {
  uint64_t checked = 0;
  int64_t behind = 0;
  int64_t ahead = 0;
};

// Checks one pulled value of `key` at clock `c`; an error message or "".
std::string Check(const Plan& plan, int rank, int workers, uint64_t key,
                  int64_t c, const std::vector<float>& value, Tally* tally) {
  for (size_t j = 0; j < value.size(); ++j) {
    const int q = static_cast<int>(j % workers);
    int64_t lo = c, hi = c;
    if (q != rank && plan.store == "dist_ssp") {
      lo = std::max<int64_t>(0, c - plan.staleness);
      hi = c + plan.staleness + 1;
    }
    if (q == plan.leave_rank) {
      lo = std::min<int64_t>(lo, plan.leave_after);
      hi = std::min<int64_t>(hi, plan.leave_after);
    }
    // The joiner's value counts its pushes from its starting clock.
    const int64_t base =
        q == plan.join_rank && c > plan.join_clock ? plan.join_clock : 0;
    if (q == plan.join_rank && c <= plan.join_clock) lo = hi = 0;
    const int64_t v = static_cast<int64_t>(value[j]) + base;
    if (static_cast<float>(v - base) != value[j] || v < lo || v > hi) {
      char line[256];
      std::snprintf(line, sizeof(line),
                    "rank %d: BOUND VIOLATED: pull of key %llu at clock %lld: "
                    "value %zu (rank %d's pushes) is %g, expected %lld..%lld",
                    rank, static_cast<unsigned long long>(key),
                    static_cast<long long>(c), j, q, value[j],
                    static_cast<long long>(lo), static_cast<long long>(hi));
      return line;
    }
    ++tally->checked;
    if (q != rank && q != plan.leave_rank &&
        (q != plan.join_rank || c > plan.join_clock)) {
      tally->behind = std::max(tally->behind, c - v);
      tally->ahead = std::max(tally->ahead, v - c);
    }
  }
  return "";
}

// One step: the pushes and pulls of both keys, all in flight at once.
absl::Status Step(KVWorker& kv, const std::vector<std::vector<float>>& grads,
                  std::vector<std::vector<float>>* pulled) {
  std::vector<OpHandle> ops;
  for (uint64_t k = 0; k < grads.size(); ++k) {
    absl::StatusOr<OpHandle> h = kv.PushAsync(k, grads[k]);
    if (!h.ok()) return h.status();
    ops.push_back(*h);
  }
  for (uint64_t k = 0; k < grads.size(); ++k) {
    absl::StatusOr<OpHandle> h = kv.PullAsync(k, absl::MakeSpan((*pulled)[k]));
    if (!h.ok()) return h.status();
    ops.push_back(*h);
  }
  absl::Status first;
  for (OpHandle h : ops) {
    absl::Status s = kv.Wait(h);
    if (first.ok()) first = s;
  }
  return first;
}

// The joiner's pull of every key before its first push, at clock K: exactly
// K pushes of every other rank (they wait at K), none of its own.
std::string FirstPullExact(KVWorker& kv, const Plan& plan, int rank, int w,
                           std::vector<std::vector<float>>* pulled) {
  for (uint64_t k = 0; k < pulled->size(); ++k) {
    if (absl::Status s = kv.Pull(k, absl::MakeSpan((*pulled)[k])); !s.ok())
      return s.ToString();
    for (size_t j = 0; j < (*pulled)[k].size(); ++j) {
      const int q = static_cast<int>(j % w);
      const float want = q == rank ? 0.0f : static_cast<float>(plan.join_clock);
      if ((*pulled)[k][j] != want) {
        char line[160];
        std::snprintf(line, sizeof(line),
                      "rank %d: first pull of key %llu: value %zu is %g, "
                      "expected %g",
                      rank, static_cast<unsigned long long>(k), j,
                      (*pulled)[k][j], want);
        return line;
      }
    }
  }
  std::printf("ssp_worker rank %d: joined at clock %lld, first pull exact\n",
              rank, static_cast<long long>(plan.join_clock));
  std::fflush(stdout);
  return "";
}

// The others' pause for the joiner: until the test's file exists (60 s).
std::string PauseForJoiner(const Plan& plan, int rank) {
  std::printf("ssp_worker rank %d: paused after %lld steps\n", rank,
              static_cast<long long>(plan.join_clock));
  std::fflush(stdout);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    if (std::FILE* f = std::fopen(plan.resume_file.c_str(), "r")) {
      std::fclose(f);
      return "";
    }
    if (absl::Now() > deadline) return "no " + plan.resume_file + " in 60 s";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

int Run(const Plan& plan) {
  absl::StatusOr<std::unique_ptr<KVWorker>> created =
      KVWorker::Create(plan.store);
  if (!created.ok()) return Fail(created.status().ToString());
  KVWorker& kv = **created;
  const int rank = kv.rank();
  const int w = static_cast<int>(EnvInt("SSP_WIDTH", kv.num_workers()));
  if (const char* s = std::getenv("SSP_SET_STALENESS")) {
    if (absl::Status set = kv.SetStaleness(std::atoll(s)); !set.ok())
      return Fail(set.ToString());
  }
  if (absl::Status s = kv.SetOptimizer("sgd lr=-1"); !s.ok())
    return Fail(s.ToString());
  const std::vector<size_t> lengths = {static_cast<size_t>(w) * 1000,
                                       static_cast<size_t>(w)};
  std::vector<std::vector<float>> grads, pulled;
  for (uint64_t k = 0; k < lengths.size(); ++k) {
    if (absl::Status s = kv.Init(k, std::vector<float>(lengths[k], 0.0f));
        !s.ok()) {
      return Fail(s.ToString());
    }
    grads.emplace_back(lengths[k], 0.0f);
    for (size_t j = rank; j < lengths[k]; j += w) grads[k][j] = 1.0f;
    pulled.emplace_back(lengths[k], 0.0f);
  }
  std::mt19937 rng(
      static_cast<uint32_t>(rank * 7919 + absl::ToUnixMicros(absl::Now())));
  const int max_delay = plan.max_delay_ms * (rank == plan.slow_rank ? 5 : 1);
  std::uniform_int_distribution<int> delay(0, std::max(0, max_delay));
  Tally tally;
  const bool joiner = rank == plan.join_rank;
  const int64_t start = joiner ? plan.join_clock : 0;  // its first clock
  if (joiner) {
    std::string bad = FirstPullExact(kv, plan, rank, w, &pulled);
    if (!bad.empty()) return Fail(bad);
    tally.checked += lengths[0] + lengths[1];
  }
  for (int t = 0; t < plan.steps - start; ++t) {
    if (plan.join_rank >= 0 && !joiner && t == plan.join_clock) {
      std::string bad = PauseForJoiner(plan, rank);
      if (!bad.empty()) return Fail(bad);
    }
    if (rank == plan.leave_rank && t == plan.leave_after) {
      if (absl::Status s = kv.Leave(); !s.ok()) return Fail(s.ToString());
      std::printf("ssp_worker rank %d: left after %d steps\n", rank, t);
      return 0;
    }
    absl::SleepFor(absl::Milliseconds(delay(rng)));
    if (absl::Status s = Step(kv, grads, &pulled); !s.ok())
      return Fail(s.ToString());
    for (uint64_t k = 0; k < pulled.size(); ++k) {
      std::string bad =
          Check(plan, rank, w, k, start + t + 1, pulled[k], &tally);
      if (!bad.empty()) return Fail(bad);
    }
  }
  std::printf(
      "ssp_worker rank %d: %d steps, %llu values checked, most behind %lld, "
      "most ahead %lld\n",
      rank, plan.steps, static_cast<unsigned long long>(tally.checked),
      static_cast<long long>(tally.behind),
      static_cast<long long>(tally.ahead));
  std::fflush(stdout);
  if (absl::Status s = kv.Close(); !s.ok()) return Fail(s.ToString());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Plan plan;
  if (argc != 4 || !absl::SimpleAtoi(argv[2], &plan.steps) ||
      !absl::SimpleAtoi(argv[3], &plan.max_delay_ms)) {
    return Fail("usage: ssp_worker dist_ssp|dist_sync STEPS MAX_DELAY_MS");
  }
  plan.store = argv[1];
  plan.staleness = EnvInt("SSP_SET_STALENESS", EnvInt("TESSERA_STALENESS", 0));
  plan.slow_rank = static_cast<int>(EnvInt("SSP_SLOW_RANK", -1));
  if (const char* leave = std::getenv("SSP_LEAVE")) {
    std::vector<std::string> parts = absl::StrSplit(leave, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &plan.leave_rank) ||
        !absl::SimpleAtoi(parts[1], &plan.leave_after)) {
      return Fail("SSP_LEAVE: expected RANK:STEPS");
    }
  }
  if (const char* join = std::getenv("SSP_JOIN")) {
    std::vector<std::string> parts = absl::StrSplit(join, ':');
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &plan.join_rank) ||
        !absl::SimpleAtoi(parts[1], &plan.join_clock)) {
      return Fail("SSP_JOIN: expected RANK:STEPS:PATH");
    }
    plan.resume_file = parts[2];
  }
  return Run(plan);
}

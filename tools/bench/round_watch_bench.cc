// What the hang doctor (issue #31) costs a server: RoundWatch::PushTaken, taken
// once per dist_sync push (one lock, a map entry, a histogram), in nanoseconds
// per push from 1 and from 4 threads (the update threads of a server), next to
// an absl::Now() read and an empty lock/unlock of an absl::Mutex in the same
// run; and what one GET /debug/pending costs with many open rounds (filling
// the proto and printing its JSON), in milliseconds, with its size.
//
//   round_watch_bench [WORKERS] [KEYS]     # default 16 workers, 1000 keys
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/debug_pending.h"
#include "server/round_watch.h"
#include "tools/bench/nanos_per.h"

using tessera::bench::NanosPer;

int main(int argc, char** argv) {
  int workers = 16, keys = 1000;
  if ((argc > 1 && (!absl::SimpleAtoi(argv[1], &workers) || workers < 1)) ||
      (argc > 2 && (!absl::SimpleAtoi(argv[2], &keys) || keys < 1))) {
    std::fprintf(stderr, "usage: round_watch_bench [WORKERS] [KEYS]\n");
    return 2;
  }
  tessera::RoundWatch::Options options;
  options.check_every = absl::ZeroDuration();
  tessera::RoundWatch watch(workers, options);
  constexpr int kPushes = 2000000;
  volatile int64_t sink = 0;
  const double clock =
      NanosPer(kPushes, [&](int) { sink = absl::ToUnixNanos(absl::Now()); });
  absl::Mutex mu;
  const double lock = NanosPer(kPushes, [&](int) { absl::MutexLock l(&mu); });
  // Rounds of `workers` pushes over `keys` keys, as a server's update thread
  // sees them; RoundDone closes each.
  auto pushes = [&](int thread, int n) {
    const absl::Time started = absl::Now();
    for (int i = 0; i < n; ++i) {
      const uint64_t key = thread * keys + (i / workers) % keys;
      const int rank = i % workers;
      watch.PushTaken(key, 0, rank, started, absl::Now());
      if (rank == workers - 1) watch.RoundDone(key, 0, started, absl::Now());
    }
  };
  const double one = NanosPer(1, [&](int) { pushes(0, kPushes); }) / kPushes;
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] { pushes(t + 1, kPushes / 4); });
  for (std::thread& t : threads) t.join();
  const double four = absl::ToDoubleNanoseconds(absl::Now() - start) / kPushes;
  // Every key's round open, half its workers in.
  const absl::Time started = absl::Now();
  for (int k = 0; k < keys; ++k)
    for (int r = 0; r < workers / 2 + 1; ++r)
      watch.PushTaken(100000 + k, 0, r, started, started);
  std::string json;
  const int kAsks = 20;
  const double fill_ms = NanosPer(kAsks,
                                  [&](int) {
                                    tessera::wire::DebugPending p;
                                    watch.Fill(&p, absl::Now());
                                    json = tessera::PendingJson(p);
                                  }) /
                         1e6;
  std::printf("round_watch_bench: %d workers, %d keys\n", workers, keys);
  std::printf(
      "  baseline: absl::Now() %.1f ns, empty mutex lock+unlock %.1f ns\n",
      clock, lock);
  std::printf(
      "  PushTaken (+ RoundDone per round): %.1f ns per push on 1 thread, "
      "%.1f ns per push (wall) on 4 threads\n",
      one, four);
  std::printf(
      "  /debug/pending with %d open rounds: %.2f ms per ask, %zu bytes of "
      "JSON\n",
      keys, fill_ms, json.size());
  return sink == 42 ? 1 : 0;
}

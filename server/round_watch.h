// RoundWatch: whom a server's dist_sync rounds wait for.
//
// The update threads tell it when a push joins a round and when a round
// completes. It keeps the open rounds where any thread can read them
// (/debug/pending), each rank's arrival lag (from the round's first push to
// that rank's push: the histogram tessera_server_arrival_lag_seconds{rank},
// and a mean over recent rounds, slowest rank first), and, from a thread of
// its own, logs a round that has waited longer than
//
//   max(late_factor x the median of the slice's last 16 rounds, late_min)
//   (10 x late_min until the slice has completed a round)
//
// as one line per key naming the ranks it waits for, e.g.
//
//   dist_sync round of key 3 has waited 1.2s for rank 1 (10x the key's
//   recent median round of 12ms; ranks in: 0, 2)
//
// and about the same round again only when its wait has doubled.
//
//   RoundWatch watch(/*num_workers=*/4, RoundWatch::Options());
//   watch.PushTaken(key, offset, rank, round_started, absl::Now());
//   watch.RoundDone(key, offset, round_started, absl::Now());
//   watch.Fill(&pending, absl::Now());       // GET /debug/pending
//
// Thread-safety: thread-safe (one lock, taken once per dist_sync push).
#ifndef TESSERA_SERVER_ROUND_WATCH_H_
#define TESSERA_SERVER_ROUND_WATCH_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/tessera.pb.h"

namespace tessera {

class RoundWatch {
 public:
  struct Options {
    double late_factor = 10;
    absl::Duration late_min = absl::Seconds(1);
    // How often the watch thread looks; zero: no thread (tests call
    // CheckLate themselves).
    absl::Duration check_every = absl::Milliseconds(200);
  };
  // Rounds of the last this many completed per slice give its median.
  static constexpr size_t kRecentRounds = 16;
  // /debug/pending lists the oldest this many open rounds and the this many
  // slices holding most messages (and counts them all).
  static constexpr size_t kMaxListed = 200;

  RoundWatch(int num_workers, Options options);
  ~RoundWatch();
  RoundWatch(const RoundWatch&) = delete;
  RoundWatch& operator=(const RoundWatch&) = delete;

  // `rank`'s push joined the open round of the slice (key, offset), which
  // started at `round_started` (its first push). `count_lag`: the push counts
  // in the rank's lag (once per key and round: on the key's first slice on
  // this server, as a push counts once however many slices it has).
  void PushTaken(uint64_t key, uint64_t offset, int rank,
                 absl::Time round_started, absl::Time now,
                 bool count_lag = true);
  // The slice's open round completed.
  void RoundDone(uint64_t key, uint64_t offset, absl::Time round_started,
                 absl::Time now);
  // Elastic jobs: whether `rank` is in the job. A rank out of it is never
  // named as missing from a round.
  void SetInJob(int rank, bool in_job);
  // The slice holds `count` waiting messages (reported when it changed).
  void Waiting(uint64_t key, uint64_t offset, size_t count);

  // Open rounds (oldest first), waiting messages and rank lags into `out`.
  void Fill(wire::DebugPending* out, absl::Time now) const;
  // The late rounds' lines (one per key), as logged by the watch thread;
  // each round is reported again only once its wait has doubled.
  std::vector<std::string> CheckLate(absl::Time now);

 private:
  using Slice = std::pair<uint64_t, uint64_t>;  // key, offset
  struct Open {
    absl::Time started;
    std::vector<bool> in;                               // by rank
    absl::Duration next_report = absl::ZeroDuration();  // 0: not yet late
  };
  struct Lag {
    double mean_s = 0;
    uint64_t rounds = 0;
    Histogram* histogram = nullptr;
  };

  absl::Duration ThresholdLocked(const Slice& slice) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration MedianLocked(const Slice& slice) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const int num_workers_;
  const Options options_;

  mutable absl::Mutex mu_;
  std::map<Slice, Open> open_ ABSL_GUARDED_BY(mu_);
  std::map<Slice, std::deque<absl::Duration>> recent_ ABSL_GUARDED_BY(mu_);
  std::map<Slice, size_t> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<Lag> lag_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> in_job_ ABSL_GUARDED_BY(mu_);  // by rank
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
  CollectorHandles metric_handles_;  // last: removed first
};

}  // namespace tessera

#endif  // TESSERA_SERVER_ROUND_WATCH_H_

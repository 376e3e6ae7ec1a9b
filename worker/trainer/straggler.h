// Straggler: makes a worker slow on purpose, for experiments with stragglers
// (dist_ssp against dist_sync, issue #49): every `every`-th step's compute
// takes `factor` times as long, the extra slept before it, so that its
// pushes come late as a slow machine's would. tessera-worker's --slow-every
// and --slow-factor.
//
//   Straggler straggler(/*every=*/5, /*factor=*/5);
//   absl::SleepFor(straggler.Delay(step));  // before step `step` (0-based)
//   ... forward and backward ...
//   straggler.Observe(compute_time);
//
// The delay is (factor - 1) times the mean compute time of the steps
// observed (the first slow step after at least one was observed), on steps
// every-1, 2*every-1, ... (the 5th, 10th, ... with every = 5).
//
// Thread-safety: none (one training loop).
#ifndef TESSERA_WORKER_TRAINER_STRAGGLER_H_
#define TESSERA_WORKER_TRAINER_STRAGGLER_H_

#include <cstdint>

#include "absl/time/time.h"

namespace tessera {

class Straggler {
 public:
  // every = 0: never slow. REQUIRES: every >= 0, factor >= 1.
  Straggler(int every, double factor) : every_(every), factor_(factor) {}

  // How long to sleep before step `step` (the steps this worker ran so far).
  absl::Duration Delay(int64_t step) const;
  // A step's compute time (forward and backward, without the sleep).
  void Observe(absl::Duration compute);

 private:
  const int every_;
  const double factor_;
  absl::Duration total_ = absl::ZeroDuration();
  int64_t observed_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_STRAGGLER_H_

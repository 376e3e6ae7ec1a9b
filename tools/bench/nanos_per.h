// NanosPer: the mean wall time of n calls of f(i), in nanoseconds, for the
// micro-benchmarks of tools/bench (trace_event_bench, round_watch_bench).
//
//   const double ns = NanosPer(1000000, [&](int i) { work(i); });
#ifndef TESSERA_TOOLS_BENCH_NANOS_PER_H_
#define TESSERA_TOOLS_BENCH_NANOS_PER_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera::bench {

template <typename F>
double NanosPer(int n, F&& f) {
  const absl::Time start = absl::Now();
  for (int i = 0; i < n; ++i) f(i);
  return absl::ToDoubleNanoseconds(absl::Now() - start) / n;
}

}  // namespace tessera::bench

#endif  // TESSERA_TOOLS_BENCH_NANOS_PER_H_

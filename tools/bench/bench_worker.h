// The worker side of tessera-bench: a process of a real Tessera job
// (DMLC_ROLE=worker) that times push, pull and pushpull through the public
// KVWorker API and prints one line per measurement on stdout for the parent to
// collect:
//
//   BENCH rank=0 op=push size=1048576 inflight=4 iters=800 seconds=0.41
//   p50_us=0 p99_us=0
//
//   WorkerPlan plan;   // from the parent's --worker command line
//   return RunBenchWorker(plan);
//
// Every worker of the job runs the same plan in the same order: dist_sync
// rounds need the same number of pushes per key from each worker, so iteration
// counts are fixed by the parent, not by a clock.
#ifndef TESSERA_TOOLS_BENCH_BENCH_WORKER_H_
#define TESSERA_TOOLS_BENCH_BENCH_WORKER_H_

#include <cstddef>
#include <string>
#include <vector>

namespace tessera::bench {

struct WorkerPlan {
  std::vector<size_t> sizes;     // bytes of float values per key
  std::vector<int> iterations;   // per size: timed operations per measurement
  std::vector<std::string> ops;  // "push", "pull", "pullview", "pushpull"
  std::vector<int> inflight;     // outstanding requests, e.g. {1, 4}
  std::string optimizer = "none";
};

// One line of a worker's report.
struct WorkerSample {
  int rank = 0;
  std::string op;
  size_t size = 0;
  int inflight = 1;
  int iterations = 0;
  double seconds = 0;
  double p50_us = 0;  // of blocking operations (in-flight 1 only)
  double p99_us = 0;
};

std::string FormatSample(const WorkerSample& s);
// False when `line` is not a BENCH line.
bool ParseSample(const std::string& line, WorkerSample* s);

// Joins the job from the DMLC_* environment and runs `plan`; returns the exit
// code.
int RunBenchWorker(const WorkerPlan& plan);

}  // namespace tessera::bench

#endif  // TESSERA_TOOLS_BENCH_BENCH_WORKER_H_

// The same-run baseline of tessera-bench: raw ZeroMQ between two processes on
// loopback, with the messaging pattern Tessera itself uses (a small header
// frame plus a zero-copy data frame over PUSH/PULL sockets), so the KV figures
// can be read as ratios to it.
//
//   RawZmqPlan plan{SelfExecutable(), {4096, 1 << 20}, /*seconds=*/0.5};
//   absl::StatusOr<std::vector<RawZmqFigures>> raw = MeasureRawZmq(plan);
//   // the peer process runs: tessera-bench
//   --raw-peer=<data_port>,<control_port>
//
// MeasureRawZmq spawns the peer, which streams to this process; not
// thread-safe.
#ifndef TESSERA_TOOLS_BENCH_RAW_ZMQ_H_
#define TESSERA_TOOLS_BENCH_RAW_ZMQ_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/bench/bench_util.h"

namespace tessera::bench {

struct RawZmqPlan {
  std::string self_exe;  // tessera-bench, re-executed as the peer
  std::vector<size_t> sizes;
  double seconds = 0.5;   // per size, for the stream and the round trips each
  bool ack_cost = false;  // also time transfers that wait for a small ack each
  bool two_way = true;    // also stream both ways at once
  // Every socket CURVE-encrypted (fresh keys, no ZAP handler): what ZeroMQ's
  // encryption alone costs.
  bool curve = false;
  std::string log_path;   // peer's stderr
};

struct RawZmqFigures {
  size_t size = 0;
  double gbps = 0;  // one-way stream, messages of `size` bytes, GB/s (1e9 B/s)
  double gbps_before = 0,
         gbps_after = 0;  // the two runs a CombineRuns mean came from
  LatencyStats rtt;       // `size` bytes there, `size` bytes back
  double rtt_p50_before_us = 0,
         rtt_p50_after_us = 0;  // the two runs a CombineRuns mean came from
  // Both directions at once (each process sends and receives), GB/s per
  // direction: the context for pushpull, which moves each value both ways.
  double two_way_gbps = 0;
  // --ack-cost: one message in flight, each answered by a 16-byte ack.
  double acked_gbps = 0;
  LatencyStats acked;
};

absl::StatusOr<std::vector<RawZmqFigures>> MeasureRawZmq(
    const RawZmqPlan& plan);

// The mean of a run before and one after the jobs (the machine's load drifts).
std::vector<RawZmqFigures> CombineRuns(const std::vector<RawZmqFigures>& before,
                                       const std::vector<RawZmqFigures>& after);

// The peer's side; returns the process exit code.
int RunRawZmqPeer(int data_port, int control_port);

// Single-thread memcpy of `size` bytes, GB/s, over about `seconds`.
double MeasureMemcpy(size_t size, double seconds);

}  // namespace tessera::bench

#endif  // TESSERA_TOOLS_BENCH_RAW_ZMQ_H_

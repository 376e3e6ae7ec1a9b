// Small helpers shared by the parts of tessera-bench: clocks, percentiles, size
// names, child processes.
//
//   std::vector<double> us = ...;
//   LatencyStats l = Percentiles(us);                 // p50 / p99
//   absl::StatusOr<size_t> s = ParseSize("64K");      // 65536
//   absl::StatusOr<ChildProcess> c = SpawnProcess({exe, "--worker"}, env,
//   /*capture=*/true);
//
// Thread-compatible; the process helpers are meant for the bench's main thread.
#ifndef TESSERA_TOOLS_BENCH_BENCH_UTIL_H_
#define TESSERA_TOOLS_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::bench {

// Seconds on a monotonic clock.
double NowSeconds();

struct LatencyStats {
  double p50_us = 0;
  double p99_us = 0;
};
// Percentiles of durations in microseconds; zeros when `us` is empty.
LatencyStats Percentiles(std::vector<double> us);

// "4K", "64KB", "1M", "16MB", "4096" -> bytes. InvalidArgument otherwise.
absl::StatusOr<size_t> ParseSize(const std::string& text);
// 4096 -> "4 KB", 1048576 -> "1 MB".
std::string SizeName(size_t bytes);

// The median of `v` (the mean of the two middle values for an even count; 0
// when empty).
double Median(std::vector<double> v);

// True when `arg` is --name=VALUE; then *value is VALUE.
bool TakeFlag(const std::string& arg, const std::string& name,
              std::string* value);

// Splits "a,b,c" (empty items dropped).
std::vector<std::string> SplitList(const std::string& text);

// Path of the running executable.
std::string SelfExecutable();
// A TCP port on 127.0.0.1 that was free a moment ago.
int FreeLoopbackPort();
// `name` if it is executable, else the first match on PATH, else "".
std::string FindExecutable(const std::vector<std::string>& candidates,
                           const std::string& name);

struct ChildProcess {
  pid_t pid = -1;
  int stdout_fd = -1;  // read end of the child's stdout when captured, else -1
  std::string name;
};

// Starts argv[0] with the current environment plus `env`. The child's stdout
// goes to a pipe when `capture_stdout`, else to `log_path` (stderr too; ""
// keeps the parent's).
absl::StatusOr<ChildProcess> SpawnProcess(
    const std::vector<std::string>& argv,
    const std::map<std::string, std::string>& env, bool capture_stdout,
    const std::string& log_path);

// Waits for the child; returns its exit code (128+signal when killed) or -1 on
// time-out.
int WaitProcess(const ChildProcess& child, absl::Duration timeout);
// SIGKILLs the child (and its process group) and reaps it.
void KillProcess(const ChildProcess& child);

}  // namespace tessera::bench

#endif  // TESSERA_TOOLS_BENCH_BENCH_UTIL_H_

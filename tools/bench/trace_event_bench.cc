// What one trace event costs the thread that records it (common/trace.h):
// a span with tracing off, a complete event, and an async begin/end pair with
// tracing on, in nanoseconds per event, next to absl::Now() alone (the clock
// read every event takes). Events are recorded into a temporary file's
// buffers and discarded (not written).
//
//   trace_event_bench [EVENTS]     # default 2000000
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "common/trace.h"
#include "tools/bench/nanos_per.h"

using tessera::bench::NanosPer;

int main(int argc, char** argv) {
  using namespace tessera::trace;
  int n = 2000000;
  if (argc > 1 && (!absl::SimpleAtoi(argv[1], &n) || n < 1)) {
    std::fprintf(stderr, "usage: trace_event_bench [EVENTS]\n");
    return 2;
  }
  volatile int64_t sink = 0;
  const double clock = NanosPer(n, [&](int) { sink = NowNanos(); });
  const double off = NanosPer(n, [&](int i) {
    Span span("kv", "wait");
    span.Arg("op", i);
  });
  const std::string dir =
      std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp";
  setenv("TESSERA_TRACE_MAX_EVENTS", std::to_string(3 * n + 10).c_str(), 1);
  if (!Start(dir + "/trace-event-bench-{rank}.json", "bench").ok()) return 1;
  const double span = NanosPer(n, [&](int i) {
    Span s("kv", "wait");
    s.Arg("op", i);
  });
  const double pair = NanosPer(n, [&](int i) {
    AsyncBegin("kv", "push", i, {{"key", 3}, {"bytes", 4096}, {"server", 0}});
    AsyncEnd("kv", "push", i, {{"ok", 1}});
  });
  ResetForTesting();  // nothing written
  std::printf("clock read (absl::GetCurrentTimeNanos)   %6.1f ns\n", clock);
  std::printf("Span, tracing off                        %6.1f ns\n", off);
  std::printf("Span (complete event), tracing on        %6.1f ns\n", span);
  std::printf("async begin + end (one request's span)   %6.1f ns\n", pair);
  return 0;
}

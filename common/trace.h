// Trace: a timeline of what a process did, written as Chrome trace-event JSON
// (opens in Perfetto, ui.perfetto.dev, and chrome://tracing) when
// TESSERA_TRACE=FILE is set. `{rank}` and `{role}` in FILE are replaced (the
// rank is known once the node joined, "-" before; the scheduler's is 0).
//
//   trace::StartFromEnvironment("worker");        // Node and the daemons do it
//   {
//     trace::Span span("kv", "wait");             // a complete ("X") event
//     span.Arg("op", 12);
//     ...
//   }
//   uint64_t id = trace::NewId();
//   trace::AsyncBegin("kv", "push", id, {{"key", 3}, {"bytes", 4096}});
//   trace::AsyncEnd("kv", "push", id);             // maybe on another thread
//
// Recording costs little: when tracing is off, a span is one relaxed atomic
// load; when on, an event is a fixed-size record appended to the calling
// thread's buffer under that buffer's own (uncontended) lock. Nothing is
// formatted or written until the process exits (std::atexit) or Flush is
// called. At most TESSERA_TRACE_MAX_EVENTS events (default 2,000,000, about
// 200 MB) are kept; later ones are counted and dropped, and the file says how
// many.
//
// Names, categories and argument names must be string literals (they are
// kept as pointers). Timestamps are wall-clock microseconds, so traces of the
// processes of one job line up when opened together.
//
// Thread-safety: everything is thread-safe.
#ifndef TESSERA_COMMON_TRACE_H_
#define TESSERA_COMMON_TRACE_H_

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace tessera::trace {

namespace internal {
extern std::atomic<bool> enabled;
}  // namespace internal

inline bool Enabled() {
  return internal::enabled.load(std::memory_order_relaxed);
}

// An event's numeric arguments: (literal name, value).
using Arg = std::pair<const char*, int64_t>;
inline constexpr int kMaxArgs = 4;

// Starts recording when TESSERA_TRACE is set (once per process; later calls
// only update the role). InvalidArgument naming the variable when the file
// cannot be created (checked now, not at exit).
absl::Status StartFromEnvironment(const std::string& role);
// Starts recording into `path_pattern` (tests, tools).
absl::Status Start(const std::string& path_pattern, const std::string& role);
// The node's identity, for the file name and the process name in the trace
// ("worker 1").
void SetIdentity(const std::string& role, int rank);
// The calling thread's name in the trace ("update 0", "receiver") and, cut
// to 15 characters, the system's (top -H, perf), traced or not.
void SetThreadName(const std::string& name);

// Writes the file now (again at exit, with what came since). Returns the
// path written, or an error naming it.
absl::Status Flush();
// Stops recording and forgets everything (tests).
void ResetForTesting();

// A process-unique id for async events.
uint64_t NewId();
// Wall-clock now, in nanoseconds since the Unix epoch.
int64_t NowNanos();

void Complete(const char* category, const char* name, int64_t start_ns,
              int64_t end_ns, std::initializer_list<Arg> args = {});
void AsyncBegin(const char* category, const char* name, uint64_t id,
                std::initializer_list<Arg> args = {});
void AsyncEnd(const char* category, const char* name, uint64_t id,
              std::initializer_list<Arg> args = {});
// An async span whose begin and end are both known now (e.g. a round that
// started at a remembered time).
void AsyncSpan(const char* category, const char* name, uint64_t id,
               int64_t start_ns, int64_t end_ns,
               std::initializer_list<Arg> args = {});

// A complete event from construction to destruction, on this thread.
class Span {
 public:
  Span(const char* category, const char* name)
      : category_(category), name_(name), start_(Enabled() ? NowNanos() : 0) {}
  ~Span() {
    if (start_ != 0) End();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Adds an argument (at most kMaxArgs; more are ignored).
  void Arg(const char* name, int64_t value) {
    if (num_args_ < kMaxArgs) args_[num_args_++] = {name, value};
  }

 private:
  void End();
  const char* category_;
  const char* name_;
  const int64_t start_;
  trace::Arg args_[kMaxArgs];
  int num_args_ = 0;
};

}  // namespace tessera::trace

#endif  // TESSERA_COMMON_TRACE_H_

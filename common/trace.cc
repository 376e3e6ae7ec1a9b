#include "common/trace.h"

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace tessera::trace {

namespace internal {
std::atomic<bool> enabled{false};
}  // namespace internal

namespace {

constexpr int64_t kDefaultMaxEvents = 2000000;

struct Event {
  const char* category;
  const char* name;
  char phase;  // 'X' complete, 'b'/'e' async begin/end
  int num_args;
  int64_t ts_ns;
  int64_t dur_ns;  // 'X'
  uint64_t id;     // 'b', 'e'
  Arg args[kMaxArgs];
};

struct ThreadBuffer {
  absl::Mutex mu;
  std::vector<Event> events ABSL_GUARDED_BY(mu);
  std::string name ABSL_GUARDED_BY(mu);
  int tid = 0;
  uint64_t generation = 0;
};

struct State {
  absl::Mutex mu;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers ABSL_GUARDED_BY(mu);
  std::string pattern ABSL_GUARDED_BY(mu);
  std::string role ABSL_GUARDED_BY(mu);
  int rank ABSL_GUARDED_BY(mu) = -1;
  int next_tid ABSL_GUARDED_BY(mu) = 1;
  bool at_exit ABSL_GUARDED_BY(mu) = false;
  std::atomic<uint64_t> generation{1};
  std::atomic<int64_t> recorded{0};
  std::atomic<int64_t> dropped{0};
  int64_t max_events = kDefaultMaxEvents;
  std::atomic<uint64_t> next_id{1};
};

State& GlobalState() {
  static State* state = new State;  // lives as long as the process
  return *state;
}

thread_local std::shared_ptr<ThreadBuffer> this_thread_buffer;

ThreadBuffer* ThisThread() {
  State& s = GlobalState();
  const uint64_t generation = s.generation.load(std::memory_order_relaxed);
  if (this_thread_buffer == nullptr ||
      this_thread_buffer->generation != generation) {
    auto buffer = std::make_shared<ThreadBuffer>();
    buffer->generation = generation;
    {
      absl::MutexLock lock(&buffer->mu);
      buffer->events.reserve(1024);
    }
    absl::MutexLock lock(&s.mu);
    buffer->tid = s.next_tid++;
    s.buffers.push_back(buffer);
    this_thread_buffer = std::move(buffer);
  }
  return this_thread_buffer.get();
}

void Record(const Event& e) {
  State& s = GlobalState();
  if (s.recorded.fetch_add(1, std::memory_order_relaxed) >= s.max_events) {
    s.dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ThreadBuffer* b = ThisThread();
  absl::MutexLock lock(&b->mu);
  b->events.push_back(e);
}

Event MakeEvent(const char* category, const char* name, char phase,
                int64_t ts_ns, std::initializer_list<Arg> args) {
  Event e;
  e.category = category;
  e.name = name;
  e.phase = phase;
  e.ts_ns = ts_ns;
  e.dur_ns = 0;
  e.id = 0;
  e.num_args = 0;
  for (const Arg& a : args) {
    if (e.num_args == kMaxArgs) break;
    e.args[e.num_args++] = a;
  }
  return e;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string Micros(int64_t ns) {
  return absl::StrFormat("%d.%03d", ns / 1000, ns % 1000);
}

std::string ResolvePath(const std::string& pattern, const std::string& role,
                        const std::string& rank) {
  return absl::StrReplaceAll(pattern, {{"{rank}", rank}, {"{role}", role}});
}

void FlushAtExit() { (void)Flush(); }

}  // namespace

absl::Status Start(const std::string& path_pattern, const std::string& role) {
  State& s = GlobalState();
  {
    absl::MutexLock lock(&s.mu);
    if (!s.pattern.empty()) {
      s.role = role;
      return absl::OkStatus();
    }
    // Checked now rather than when the job is over.
    const std::string probe =
        ResolvePath(path_pattern, role, "probe") + ".probe";
    FILE* f = std::fopen(probe.c_str(), "a");
    if (f == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TESSERA_TRACE='", path_pattern,
          "': expected a writable file path (cannot create ", probe, ")"));
    }
    std::fclose(f);
    std::remove(probe.c_str());
    s.pattern = path_pattern;
    s.role = role;
    if (const char* max = std::getenv("TESSERA_TRACE_MAX_EVENTS")) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(max, &n) || n < 0) {
        s.pattern.clear();
        return absl::InvalidArgumentError(
            absl::StrCat("TESSERA_TRACE_MAX_EVENTS='", max,
                         "': expected a whole number >= 0"));
      }
      s.max_events = n;
    }
    if (!s.at_exit) {
      s.at_exit = true;
      std::atexit(FlushAtExit);
    }
  }
  internal::enabled.store(true);
  return absl::OkStatus();
}

absl::Status StartFromEnvironment(const std::string& role) {
  const char* pattern = std::getenv("TESSERA_TRACE");
  if (pattern == nullptr || *pattern == '\0') return absl::OkStatus();
  return Start(pattern, role);
}

void SetIdentity(const std::string& role, int rank) {
  State& s = GlobalState();
  absl::MutexLock lock(&s.mu);
  s.role = role;
  s.rank = rank;
}

void SetThreadName(const std::string& name) {
  // The system's name too (top -H, perf, /proc/PID/task/TID/comm), at most
  // 15 characters; not the main thread's, which is the process's name
  // (pgrep, pkill, ps).
  if (gettid() != getpid()) {
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  }
  if (!Enabled()) return;
  ThreadBuffer* b = ThisThread();
  absl::MutexLock lock(&b->mu);
  b->name = name;
}

uint64_t NewId() {
  return GlobalState().next_id.fetch_add(1, std::memory_order_relaxed);
}

int64_t NowNanos() { return absl::GetCurrentTimeNanos(); }

void Complete(const char* category, const char* name, int64_t start_ns,
              int64_t end_ns, std::initializer_list<Arg> args) {
  if (!Enabled()) return;
  Event e = MakeEvent(category, name, 'X', start_ns, args);
  e.dur_ns = end_ns - start_ns;
  Record(e);
}

void AsyncBegin(const char* category, const char* name, uint64_t id,
                std::initializer_list<Arg> args) {
  if (!Enabled()) return;
  Event e = MakeEvent(category, name, 'b', NowNanos(), args);
  e.id = id;
  Record(e);
}

void AsyncEnd(const char* category, const char* name, uint64_t id,
              std::initializer_list<Arg> args) {
  if (!Enabled()) return;
  Event e = MakeEvent(category, name, 'e', NowNanos(), args);
  e.id = id;
  Record(e);
}

void AsyncSpan(const char* category, const char* name, uint64_t id,
               int64_t start_ns, int64_t end_ns,
               std::initializer_list<Arg> args) {
  if (!Enabled()) return;
  Event b = MakeEvent(category, name, 'b', start_ns, args);
  b.id = id;
  Record(b);
  Event e = MakeEvent(category, name, 'e', end_ns, {});
  e.id = id;
  Record(e);
}

void Span::End() {
  if (!Enabled()) return;
  Event e = MakeEvent(category_, name_, 'X', start_, {});
  e.dur_ns = NowNanos() - start_;
  e.num_args = num_args_;
  for (int i = 0; i < num_args_; ++i) e.args[i] = args_[i];
  Record(e);
}

absl::Status Flush() {
  State& s = GlobalState();
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::string path, role;
  int rank;
  {
    absl::MutexLock lock(&s.mu);
    if (s.pattern.empty()) return absl::OkStatus();
    buffers = s.buffers;
    role = s.role;
    rank = s.rank;
    path = ResolvePath(s.pattern, role, rank < 0 ? "-" : absl::StrCat(rank));
  }
  const int pid = getpid();
  const std::string process =
      rank < 0 || role == "scheduler" ? role : absl::StrCat(role, " ", rank);
  const std::string tmp = absl::StrCat(path, ".tmp");
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    const absl::Status error = absl::UnavailableError(
        absl::StrCat("TESSERA_TRACE: cannot write ", tmp));
    TESSERA_LOG(ERROR) << error.message();
    return error;
  }
  std::string out;
  out.reserve(1 << 20);
  absl::StrAppend(&out, "{\"traceEvents\":[\n",
                  "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", pid,
                  ",\"tid\":0,\"args\":{\"name\":", JsonString(process), "}}");
  int64_t written = 0;
  for (const auto& b : buffers) {
    absl::MutexLock lock(&b->mu);
    if (!b->name.empty()) {
      absl::StrAppend(&out,
                      ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", pid,
                      ",\"tid\":", b->tid,
                      ",\"args\":{\"name\":", JsonString(b->name), "}}");
    }
    for (const Event& e : b->events) {
      absl::StrAppend(&out, ",\n{\"name\":", JsonString(e.name),
                      ",\"cat\":", JsonString(e.category), ",\"ph\":\"",
                      std::string(1, e.phase), "\",\"ts\":", Micros(e.ts_ns),
                      ",\"pid\":", pid, ",\"tid\":", b->tid);
      if (e.phase == 'X') absl::StrAppend(&out, ",\"dur\":", Micros(e.dur_ns));
      if (e.phase != 'X') absl::StrAppendFormat(&out, ",\"id\":\"0x%x\"", e.id);
      if (e.num_args > 0) {
        out += ",\"args\":{";
        for (int i = 0; i < e.num_args; ++i) {
          absl::StrAppend(&out, i == 0 ? "" : ",", JsonString(e.args[i].first),
                          ":", e.args[i].second);
        }
        out += "}";
      }
      out += "}";
      ++written;
      if (out.size() > (1 << 20)) {
        std::fwrite(out.data(), 1, out.size(), f);
        out.clear();
      }
    }
  }
  absl::StrAppend(&out, "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{",
                  "\"role\":", JsonString(role), ",\"rank\":", rank,
                  ",\"events\":", written,
                  ",\"dropped_events\":", s.dropped.load(), "}}\n");
  std::fwrite(out.data(), 1, out.size(), f);
  const bool ok = std::fflush(f) == 0;
  std::fclose(f);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status error = absl::UnavailableError(
        absl::StrCat("TESSERA_TRACE: cannot write ", path));
    TESSERA_LOG(ERROR) << error.message();
    return error;
  }
  if (s.dropped.load() > 0) {
    TESSERA_LOG(WARNING) << "TESSERA_TRACE: " << s.dropped.load()
                         << " events past TESSERA_TRACE_MAX_EVENTS="
                         << s.max_events << " were not recorded";
  }
  return absl::OkStatus();
}

void ResetForTesting() {
  State& s = GlobalState();
  internal::enabled.store(false);
  absl::MutexLock lock(&s.mu);
  s.buffers.clear();
  s.pattern.clear();
  s.role.clear();
  s.rank = -1;
  s.recorded.store(0);
  s.dropped.store(0);
  s.max_events = kDefaultMaxEvents;
  s.generation.fetch_add(1);
}

}  // namespace tessera::trace

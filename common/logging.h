// Minimal process-wide logging to stderr.
//
// Every line is prefixed with the time and the node's tag (e.g. "server 1").
// PS_VERBOSE raises the verbosity: 1 logs connections and control messages, 2
// every message.
//
//   tessera::SetLogTag("worker 0");
//   tessera::SetLogVerbosity(options.verbose);
//   TESSERA_LOG(INFO) << "connected to " << endpoint;
//   TESSERA_VLOG(1) << "barrier done";
//
// Thread-safe: each statement writes its line with a single write(2).
#ifndef TESSERA_COMMON_LOGGING_H_
#define TESSERA_COMMON_LOGGING_H_

#include <cstdint>
#include <sstream>
#include <string>

namespace tessera {

enum class LogLevel { kInfo, kWarning, kError };

void SetLogTag(const std::string& tag);
void SetLogVerbosity(int verbosity);
int LogVerbosity();

// Whether the `n`-th occurrence (from 1) of a repeated warning is logged: the
// first 20, then the 32nd, 64th, 128th, ... A peer that floods a node with
// what it drops (counted elsewhere) cannot flood its log too.
inline bool LogOccurrence(uint64_t n) { return n <= 20 || (n & (n - 1)) == 0; }

namespace internal {
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace internal

}  // namespace tessera

#define TESSERA_LOG_INFO ::tessera::LogLevel::kInfo
#define TESSERA_LOG_WARNING ::tessera::LogLevel::kWarning
#define TESSERA_LOG_ERROR ::tessera::LogLevel::kError
#define TESSERA_LOG(level) \
  ::tessera::internal::LogLine(TESSERA_LOG_##level).stream()
#define TESSERA_VLOG(v)                  \
  if (::tessera::LogVerbosity() < (v)) { \
  } else                                 \
    ::tessera::internal::LogLine(::tessera::LogLevel::kInfo).stream()

#endif  // TESSERA_COMMON_LOGGING_H_

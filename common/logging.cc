#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace tessera {
namespace {
std::mutex tag_mu;
std::string& Tag() {
  static std::string* tag = new std::string("tessera");
  return *tag;
}
std::atomic<int> verbosity{0};
}  // namespace

void SetLogTag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(tag_mu);
  Tag() = tag;
}
void SetLogVerbosity(int v) { verbosity.store(v); }
int LogVerbosity() { return verbosity.load(std::memory_order_relaxed); }

namespace internal {
LogLine::~LogLine() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const int millis =
      static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                           now.time_since_epoch())
                           .count() %
                       1000);
  std::tm tm;
  localtime_r(&secs, &tm);
  char stamp[32];
  std::snprintf(stamp, sizeof(stamp), "%02d:%02d:%02d.%03d", tm.tm_hour,
                tm.tm_min, tm.tm_sec, millis);
  const char* level = level_ == LogLevel::kError     ? " ERROR"
                      : level_ == LogLevel::kWarning ? " WARNING"
                                                     : "";
  std::string tag;
  {
    std::lock_guard<std::mutex> lock(tag_mu);
    tag = Tag();
  }
  std::string line = std::string(stamp) + " [" + tag + "]" + level + " " +
                     stream_.str() + "\n";
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}
}  // namespace internal
}  // namespace tessera

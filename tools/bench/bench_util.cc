#include "tools/bench/bench_util.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace tessera::bench {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

bool TakeFlag(const std::string& arg, const std::string& name,
              std::string* value) {
  const std::string prefix = absl::StrCat("--", name, "=");
  if (!absl::StartsWith(arg, prefix)) return false;
  *value = arg.substr(prefix.size());
  return true;
}

double NowSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

LatencyStats Percentiles(std::vector<double> us) {
  LatencyStats s;
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  auto at = [&us](double q) {
    const size_t i =
        static_cast<size_t>(std::ceil(q * static_cast<double>(us.size()))) - 1;
    return us[std::min(i, us.size() - 1)];
  };
  s.p50_us = at(0.50);
  s.p99_us = at(0.99);
  return s;
}

absl::StatusOr<size_t> ParseSize(const std::string& text) {
  std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  if (!t.empty() && t.back() == 'B') t.pop_back();
  size_t scale = 1;
  if (!t.empty() && (t.back() == 'K' || t.back() == 'M' || t.back() == 'G')) {
    scale = t.back() == 'K'   ? 1024
            : t.back() == 'M' ? 1024 * 1024
                              : size_t{1} << 30;
    t.pop_back();
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(t), &n) || n == 0 ||
      n * scale % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "size '", text,
        "': expected a positive multiple of 4 bytes such as 4K, 1M, 4096"));
  }
  return n * scale;
}

std::string SizeName(size_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0)
    return absl::StrCat(bytes >> 20, " MB");
  if (bytes >= 1024 && bytes % 1024 == 0)
    return absl::StrCat(bytes >> 10, " KB");
  return absl::StrCat(bytes, " B");
}

std::vector<std::string> SplitList(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipWhitespace());
}

std::string SelfExecutable() {
  char buf[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

std::string FindExecutable(const std::vector<std::string>& candidates,
                           const std::string& name) {
  for (const std::string& c : candidates) {
    if (!c.empty() && access(c.c_str(), X_OK) == 0) return c;
  }
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const std::string full = absl::StrCat(dir, "/", name);
    if (access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

absl::StatusOr<ChildProcess> SpawnProcess(
    const std::vector<std::string>& argv,
    const std::map<std::string, std::string>& env, bool capture_stdout,
    const std::string& log_path) {
  int pipe_fds[2] = {-1, -1};
  if (capture_stdout && pipe(pipe_fds) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0)
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    setpgid(0, 0);
    if (!log_path.empty()) {
      const int fd =
          open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        if (!capture_stdout) dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
    }
    if (capture_stdout) {
      dup2(pipe_fds[1], 1);
      close(pipe_fds[0]);
      close(pipe_fds[1]);
    }
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  ChildProcess child;
  child.pid = pid;
  child.name = argv[0];
  if (capture_stdout) {
    close(pipe_fds[1]);
    child.stdout_fd = pipe_fds[0];
  }
  return child;
}

int WaitProcess(const ChildProcess& child, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(child.pid, &status, WNOHANG);
    if (r == child.pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (r < 0) return -1;
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void KillProcess(const ChildProcess& child) {
  if (child.pid <= 0) return;
  kill(-child.pid, SIGKILL);
  kill(child.pid, SIGKILL);
  int status = 0;
  waitpid(child.pid, &status, 0);
}

}  // namespace tessera::bench

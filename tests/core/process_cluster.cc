#include "tests/core/process_cluster.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tessera::testing {

std::string BinaryPath(const std::string& relative) {
  const char* dir = std::getenv("TESSERA_BUILD_DIR");
  return absl::StrCat(dir ? dir : ".", "/", relative);
}

std::string SourcePath(const std::string& relative) {
  const char* dir = std::getenv("TESSERA_SOURCE_DIR");
  return absl::StrCat(dir ? dir : ".", "/", relative);
}

namespace {

// Binds a TCP socket to 127.0.0.1:port (0: any) and returns the port bound, or
// -1 if it is taken.
int TryBind(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int bound = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      bound = ntohs(addr.sin_port);
  }
  close(fd);
  return bound;
}

}  // namespace

// A port that is free now, chosen below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range). The kernel hands ports from that
// range to every bind to port 0 and every outgoing connection, so a port found
// there could be taken by any process between this check and the daemon's
// bind (seen: a scheduler's "Address already in use" while other jobs ran).
// Below the range only another test choosing the same port can take it; a
// process never gets the same port twice.
int FreePort() {
  static std::mutex mu;
  static std::set<int> given;
  std::lock_guard<std::mutex> lock(mu);
  int ephemeral_low = 32768, ephemeral_high = 60999;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> ephemeral_low >> ephemeral_high;
  constexpr int kLowest = 10000;
  if (ephemeral_low - kLowest >= 1000) {
    std::mt19937 rng(static_cast<uint32_t>(getpid()) ^
                     static_cast<uint32_t>(absl::GetCurrentTimeNanos()));
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int port =
          kLowest + static_cast<int>(rng() % (ephemeral_low - kLowest));
      if (given.count(port) > 0) continue;
      if (TryBind(port) == port) {
        given.insert(port);
        return port;
      }
    }
  }
  return TryBind(0);  // no room below the range: what the kernel picks
}

void UseJobKey(void* socket, const JobKeySet& keys, Role client,
               Role server) {
  const std::string& server_key = keys.of(server).public_key;
  const std::string& public_key = keys.of(client).public_key;
  const std::string& secret_key = keys.of(client).secret_key;
  zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, server_key.data(),
                 server_key.size());
  zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, public_key.data(),
                 public_key.size());
  zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret_key.data(),
                 secret_key.size());
}

ProcessCluster::ProcessCluster() {
  char tmpl[] = "/tmp/tessera-test-XXXXXX";
  dir_ = mkdtemp(tmpl);
  absl::StatusOr<JobKeySet> keys = GenerateJobKeys();
  if (!keys.ok()) {
    std::fprintf(stderr, "ProcessCluster: %s\n",
                 std::string(keys.status().message()).c_str());
    std::abort();
  }
  keys_ = *keys;
  const std::string key_dir = dir_ + "/keys";
  absl::Status written = mkdir(key_dir.c_str(), 0700) == 0
                             ? WriteKeyFiles(keys_, key_dir)
                             : absl::InternalError("mkdir " + key_dir);
  if (!written.ok()) {
    std::fprintf(stderr, "ProcessCluster: %s\n",
                 std::string(written.message()).c_str());
    std::abort();
  }
  port_ = FreePort();
  env_["DMLC_PS_ROOT_URI"] = "127.0.0.1";
  env_["DMLC_PS_ROOT_PORT"] = std::to_string(port_);
}

ProcessCluster::~ProcessCluster() {
  KillAll();
  std::string cmd = "rm -rf " + dir_;
  if (std::system(cmd.c_str()) != 0) {
  }
}

std::string ProcessCluster::KeyFile(Role role) const {
  return absl::StrCat(dir_, "/keys/", RoleName(role), ".key");
}

void ProcessCluster::Start(int servers, int workers,
                           const std::vector<std::string>& worker_argv) {
  env_["DMLC_NUM_SERVER"] = std::to_string(servers);
  env_["DMLC_NUM_WORKER"] = std::to_string(workers);
  Spawn("scheduler", {BinaryPath("scheduler/tessera-scheduler")},
        {{"DMLC_ROLE", "scheduler"}});
  for (int i = 0; i < servers; ++i) {
    Spawn(absl::StrCat("server ", i), {BinaryPath("server/tessera-server")},
          {{"DMLC_ROLE", "server"}});
  }
  for (int i = 0; i < workers; ++i) {
    Spawn(absl::StrCat("worker ", i), worker_argv, {{"DMLC_ROLE", "worker"}});
  }
}

Child& ProcessCluster::Spawn(const std::string& name,
                             const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& extra) {
  Child child;
  child.name = name;
  std::string file = name;
  for (char& c : file) c = c == ' ' ? '_' : c;
  child.log_path = absl::StrCat(dir_, "/", file, "-", children_.size(), ".log");
  std::map<std::string, std::string> env = env_;
  for (const auto& [k, v] : extra) env[k] = v;
  if (env.count("TESSERA_KEY_FILE") == 0 && env.count("TESSERA_KEY_DIR") == 0)
    env["TESSERA_KEY_DIR"] = dir_ + "/keys";
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    const int fd =
        open(child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  child.pid = pid;
  children_.push_back(child);
  return children_.back();
}

bool ProcessCluster::Wait(Child& child, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!child.exited) {
    int status = 0;
    const pid_t r = waitpid(child.pid, &status, WNOHANG);
    if (r == child.pid) {
      child.exited = true;
      child.status = status;
      break;
    }
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

bool ProcessCluster::WaitAll(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (Child& c : children_) {
    if (!Wait(c, std::max(absl::ZeroDuration(), deadline - absl::Now())))
      return false;
  }
  return true;
}

Child& ProcessCluster::Find(const std::string& name) {
  for (Child& c : children_) {
    if (c.name == name) return c;
  }
  std::abort();
}

int ProcessCluster::ExitCode(const Child& child) {
  if (!child.exited) return -1;
  if (WIFEXITED(child.status)) return WEXITSTATUS(child.status);
  if (WIFSIGNALED(child.status)) return 128 + WTERMSIG(child.status);
  return -1;
}

std::string ProcessCluster::Log(const Child& child) {
  std::ifstream in(child.log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ProcessCluster::AllLogs() const {
  std::string all;
  for (const Child& c : children_) {
    absl::StrAppend(&all, "----- ", c.name, " (exit ", ExitCode(c), ")\n",
                    Log(c));
  }
  return all;
}

void ProcessCluster::KillAll() {
  for (Child& c : children_) {
    if (!c.exited) kill(-c.pid, SIGKILL);
  }
  for (Child& c : children_) {
    if (!c.exited) {
      waitpid(c.pid, &c.status, 0);
      c.exited = true;
    }
  }
}

}  // namespace tessera::testing

// ProcessCluster: starts a real Tessera job on loopback for tests: a
// tessera-scheduler, servers and worker programs as child processes, each with
// its DMLC_* environment and its output captured to a file. Every process is
// killed when the cluster is destroyed, also when the test fails. Each cluster
// has fresh job keys (mode 0600 in a 0700 folder of its own): a process gets
// TESSERA_KEY_FILE of the role its DMLC_ROLE names, so jobs run secured as
// launch.py's do (Env("TESSERA_INSECURE", "1") turns that off).
//
//   ProcessCluster c;
//   c.Env("PS_HEARTBEAT_TIMEOUT", "3");
//   c.Start(/*servers=*/2, /*workers=*/3,
//   {BinaryPath("tests/core/kv_check_worker"), "barrier", "5"});
//   std::vector<ProcessCluster::Exit> exits = c.WaitAll(absl::Seconds(60));
#ifndef TESSERA_TESTS_CORE_PROCESS_CLUSTER_H_
#define TESSERA_TESTS_CORE_PROCESS_CLUSTER_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/curve_keys.h"

namespace tessera::testing {

// Path of a built binary, relative to the build directory (TESSERA_BUILD_DIR).
std::string BinaryPath(const std::string& relative);
// Path of a source file (TESSERA_SOURCE_DIR).
std::string SourcePath(const std::string& relative);
// A TCP port that was free a moment ago.
int FreePort();

// Makes a raw ZeroMQ socket (before its zmq_connect) a CURVE client holding
// `client`'s key of `keys`, for a receiving socket of role `server`: a peer
// with a role's credentials, for tests that send raw frames into a secured
// job.
void UseJobKey(void* socket, const JobKeySet& keys, Role client, Role server);

struct Child {
  std::string name;  // "scheduler", "server 0", "worker 1"
  pid_t pid = -1;
  std::string log_path;
  bool exited = false;
  int status = 0;  // waitpid status
};

class ProcessCluster {
 public:
  ProcessCluster();
  ~ProcessCluster();

  // Environment for every process started after this call.
  void Env(const std::string& name, const std::string& value) {
    env_[name] = value;
  }
  int port() const { return port_; }
  // The job's keys, and the key file of one role (for peers a test makes).
  const JobKeySet& keys() const { return keys_; }
  std::string KeyFile(Role role) const;
  // A folder of this cluster's own that is removed with it.
  const std::string& dir() const { return dir_; }

  // Starts the scheduler, `servers` servers and `workers` copies of
  // worker_argv.
  void Start(int servers, int workers,
             const std::vector<std::string>& worker_argv);
  // Starts one process with the cluster's environment plus `extra`.
  Child& Spawn(const std::string& name, const std::vector<std::string>& argv,
               const std::map<std::string, std::string>& extra);

  // Waits until every process has exited or the deadline passes; returns false
  // on time-out (the processes are left running for the destructor to kill).
  bool WaitAll(absl::Duration timeout);
  // Waits for one process.
  bool Wait(Child& child, absl::Duration timeout);

  std::vector<Child>& children() { return children_; }
  Child& Find(const std::string& name);
  // Exit code, or 128+signal when killed; -1 while running.
  static int ExitCode(const Child& child);
  static std::string Log(const Child& child);
  // All logs, for failure messages.
  std::string AllLogs() const;
  void KillAll();

 private:
  std::string dir_;
  JobKeySet keys_;
  int port_ = 0;
  std::map<std::string, std::string> env_;
  std::vector<Child> children_;
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_CORE_PROCESS_CLUSTER_H_

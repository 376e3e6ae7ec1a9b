#include "common/daemon.h"

#include <sys/prctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/debug_pending.h"
#include "common/logging.h"

namespace tessera {

absl::StatusOr<Options> StartDaemon(Role role) {
  // Before any thread: SIGUSR1 is then waited for by one thread of its own.
  StartPendingDumpThread();
  absl::StatusOr<Options> options = Options::FromEnvironment();
  if (!options.ok()) return options.status();
  if (options->role != role) {
    return absl::InvalidArgumentError(
        absl::StrCat("DMLC_ROLE='", RoleName(options->role), "': expected ",
                     RoleName(role)));
  }
  SetLogTag(RoleName(role));
  SetLogVerbosity(options->verbose);
  // The daemon's memory holds the job's secret key and its links' keys: no
  // core dump carries them, and no other process of the user attaches
  // (ptrace) to read them, unless TESSERA_CORE_DUMPS=1 asks for a core
  // (debugging). Also makes /proc/PID's files root's.
  if (!options->core_dumps && prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    return absl::InternalError(
        absl::StrCat("prctl(PR_SET_DUMPABLE, 0): ", std::strerror(errno),
                     " (TESSERA_CORE_DUMPS=1 runs without it)"));
  }
  // A daemon holds a connection (and ZeroMQ a descriptor or two) per peer,
  // and the scheduler a link watch more: 1,024, a common soft limit, is
  // short of a 256-worker, 32-server job. Up to the hard limit, as asked of
  // no one.
  constexpr rlim_t kEnoughFiles = 1 << 20;  // /proc/sys/fs/nr_open's default
  if (rlimit files; getrlimit(RLIMIT_NOFILE, &files) == 0 &&
                    files.rlim_cur < std::min(files.rlim_max, kEnoughFiles)) {
    const rlim_t was = files.rlim_cur;
    files.rlim_cur = std::min(files.rlim_max, kEnoughFiles);
    if (setrlimit(RLIMIT_NOFILE, &files) == 0) {
      TESSERA_VLOG(1) << "open files: limit raised from " << was << " to "
                      << files.rlim_cur << " (RLIMIT_NOFILE's hard limit)";
    }
  }
  // Debian's Abseil is built without NDEBUG, which leaves the mutex deadlock
  // detector (a debugging aid: a lock-order graph updated on every lock) on;
  // in-process tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return options;
}

int ExitWith(const char* program, const absl::Status& status, int code) {
  std::cerr << program << ": " << status.message() << "\n";
  return code;
}

}  // namespace tessera

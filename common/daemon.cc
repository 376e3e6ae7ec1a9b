#include "common/daemon.h"

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

// Daemon: the start every Tessera daemon's main() shares (tessera-scheduler,
// tessera-server): its configuration from the DMLC_* environment, checked to
// be its own role, and its logging.
//
//   absl::StatusOr<Options> options = StartDaemon(Role::kServer);
//   if (!options.ok()) return ExitWith("tessera-server", options.status(), 2);
//
// Exit codes of the daemons: 0 the job is done, 1 it failed, 2 a bad
// configuration (one line on stderr naming what is wrong).
#ifndef TESSERA_COMMON_DAEMON_H_
#define TESSERA_COMMON_DAEMON_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/options.h"

namespace tessera {

// Reads the options from the environment, checks that DMLC_ROLE is `role`,
// and sets up logging (the role as the log tag, PS_VERBOSE). InvalidArgument
// naming the variable otherwise.
absl::StatusOr<Options> StartDaemon(Role role);

// Prints "<program>: <message>" on stderr and returns `code` (for main's
// return).
int ExitWith(const char* program, const absl::Status& status, int code);

}  // namespace tessera

#endif  // TESSERA_COMMON_DAEMON_H_

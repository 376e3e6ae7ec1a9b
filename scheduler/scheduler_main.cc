// tessera-scheduler: forms a Tessera job from the DMLC_* environment and
// watches it. Exit codes: 0 job done, 1 job failed (missing or dead node), 2
// bad configuration.
#include <iostream>

#include "common/logging.h"
#include "common/options.h"
#include "scheduler/scheduler.h"

int main() {
  absl::StatusOr<tessera::Options> options =
      tessera::Options::FromEnvironment();
  if (!options.ok()) {
    std::cerr << "tessera-scheduler: " << options.status().message() << "\n";
    return 2;
  }
  if (options->role != tessera::Role::kScheduler) {
    std::cerr << "tessera-scheduler: DMLC_ROLE='"
              << tessera::RoleName(options->role) << "': expected scheduler\n";
    return 2;
  }
  tessera::SetLogTag("scheduler");
  tessera::SetLogVerbosity(options->verbose);
  tessera::Scheduler scheduler(*options);
  absl::StatusOr<int> port = scheduler.Bind();
  if (!port.ok()) {
    std::cerr << "tessera-scheduler: " << port.status().message() << "\n";
    return 2;
  }
  absl::Status result = scheduler.Run();
  if (!result.ok()) {
    std::cerr << "tessera-scheduler: " << result.message() << "\n";
    return 1;
  }
  return 0;
}

// tessera-scheduler: forms a Tessera job from the DMLC_* environment and
// watches it. Exit codes: 0 job done, 1 job failed (missing or dead node), 2
// bad configuration.
#include "common/daemon.h"
#include "common/options.h"
#include "scheduler/scheduler.h"

int main() {
  constexpr char kProgram[] = "tessera-scheduler";
  absl::StatusOr<tessera::Options> options =
      tessera::StartDaemon(tessera::Role::kScheduler);
  if (!options.ok()) return tessera::ExitWith(kProgram, options.status(), 2);
  tessera::Scheduler scheduler(*options);
  absl::StatusOr<int> port = scheduler.Bind();
  if (!port.ok()) return tessera::ExitWith(kProgram, port.status(), 2);
  absl::Status result = scheduler.Run();
  return result.ok() ? 0 : tessera::ExitWith(kProgram, result, 1);
}

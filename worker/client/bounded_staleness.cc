// KVClient's dist_ssp settings (see worker/client/kv_client_internal.h for
// the rooms): the store's staleness bound, from TESSERA_STALENESS or
// SetStaleness, and what each key's KV_INIT tells the servers of it. The
// rule itself is the servers' (server/staleness.h): a pull carries this
// worker's pushes to its key (push_seq), which is its clock.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/options.h"
#include "common/status_macros.h"
#include "worker/client/kv_client.h"

namespace tessera {

void KVClient::UseBoundedStaleness(int64_t staleness) {
  // Before the store is handed out (KVWorker::Create): dist_ssp counts each
  // worker's pushes, so its workers push for themselves, every member of a
  // local group alike (docs/local_groups.md).
  if (group_ != nullptr) {
    TESSERA_LOG(INFO) << "dist_ssp: this worker leaves its local group and "
                         "pushes for itself (a dist_ssp server counts each "
                         "worker's pushes)";
    group_.reset();
  }
  absl::MutexLock lock(&mu_);
  ssp_ = true;
  staleness_ = staleness;
}

absl::Status KVClient::SetStaleness(int64_t staleness) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (staleness < 0 || staleness > kMaxStaleness) {
    return absl::InvalidArgumentError(
        absl::StrCat("staleness ", staleness, ": expected a whole number of ",
                     "steps in 0..", kMaxStaleness));
  }
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "set_staleness must be called before the first init");
  }
  absl::MutexLock lock(&mu_);
  if (!ssp_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "set_staleness: this store is ", sync_ ? "dist_sync" : "dist_async",
        "; a staleness bound is dist_ssp's"));
  }
  staleness_ = staleness;
  return absl::OkStatus();
}

absl::Status KVClient::CheckStaleness() const {
  absl::MutexLock lock(&mu_);
  if (ssp_ && staleness_ < 0) {
    return absl::FailedPreconditionError(
        "dist_ssp needs a staleness bound: set TESSERA_STALENESS or call "
        "set_staleness before the first init");
  }
  return absl::OkStatus();
}

void KVClient::SetKeyMode(wire::KVOptions* options) const {
  options->set_sync_mode(sync_);
  absl::MutexLock lock(&mu_);
  if (!ssp_) return;
  options->set_bounded_staleness(true);
  options->set_staleness(static_cast<uint32_t>(staleness_));
}

}  // namespace tessera

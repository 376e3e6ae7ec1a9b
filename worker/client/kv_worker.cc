// KVWorker::Create and the blocking forms (include/tessera/kv_worker.h); the
// implementation is KVClient (worker/client/kv_client.h).
#include "tessera/kv_worker.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/client/kv_client.h"
#include "worker/client/pulled_value_rep.h"

namespace tessera {

absl::StatusOr<std::unique_ptr<KVWorker>> KVWorker::Create(
    const std::string& type) {
  if (type != "dist_sync" && type != "dist_async" && type != "dist_ssp" &&
      type != "dist_device_sync") {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV store type '", type,
        "': expected dist_sync, dist_async, dist_ssp or dist_device_sync"));
  }
  TESSERA_ASSIGN_OR_RETURN(Options options, Options::FromEnvironment());
  // MXNet's dist_device_sync: dist_sync with the workers of a host summed
  // there first (docs/local_groups.md), whatever TESSERA_LOCAL_GROUP says.
  if (type == "dist_device_sync") options.local_group = true;
  SetLogVerbosity(options.verbose);
  // Debian's Abseil is built without NDEBUG, which leaves the mutex deadlock
  // detector (a debugging aid: a lock-order graph updated on every lock) on;
  // it was about a quarter of the worker's instructions per small operation.
  // Tests, which build KVClient directly, keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  TESSERA_ASSIGN_OR_RETURN(
      std::unique_ptr<KVClient> client,
      KVClient::Create(options,
                       type == "dist_sync" || type == "dist_device_sync"));
  if (type == "dist_ssp") client->UseBoundedStaleness(options.staleness);
  return std::unique_ptr<KVWorker>(std::move(client));
}

KVWorker::~KVWorker() = default;

absl::Status KVWorker::Push(uint64_t key, absl::Span<const float> grad) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PushAsync(key, grad));
  return Wait(h);
}

absl::Status KVWorker::Pull(uint64_t key, absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PullAsync(key, out));
  return Wait(h);
}

absl::StatusOr<PulledValue> KVWorker::PullView(uint64_t key) {
  PulledValue value;
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PullViewAsync(key, &value));
  TESSERA_RETURN_IF_ERROR(Wait(h));
  return value;
}

size_t PulledValue::size() const { return rep_ == nullptr ? 0 : rep_->length; }

size_t PulledValue::num_parts() const {
  return rep_ == nullptr ? 0 : rep_->offsets.size();
}

size_t PulledValue::offset(size_t i) const { return rep_->offsets.at(i); }

absl::Span<const float> PulledValue::part(size_t i) const {
  const Buffer& frame = rep_->frames.at(i);
  return absl::MakeConstSpan(frame.floats(), frame.num_floats());
}

absl::Span<const float> PulledValue::span() const {
  if (num_parts() != 1) return {};
  return part(0);
}

absl::Status PulledValue::CopyTo(absl::Span<float> out) const {
  if (out.size() != size()) {
    return absl::InvalidArgumentError(absl::StrCat("copy of a pulled value of ",
                                                   size(), " values into ",
                                                   out.size(), " values"));
  }
  for (size_t i = 0; i < num_parts(); ++i) {
    absl::Span<const float> p = part(i);
    std::copy(p.begin(), p.end(), out.begin() + offset(i));
  }
  return absl::OkStatus();
}

absl::Status KVWorker::PushPull(uint64_t key, absl::Span<const float> grad,
                                absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PushPullAsync(key, grad, out));
  return Wait(h);
}

absl::Status KVWorker::PushRows(uint64_t key,
                                absl::Span<const uint64_t> row_ids,
                                absl::Span<const float> rows) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PushRowsAsync(key, row_ids, rows));
  return Wait(h);
}

absl::Status KVWorker::PullRows(uint64_t key,
                                absl::Span<const uint64_t> row_ids,
                                absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PullRowsAsync(key, row_ids, out));
  return Wait(h);
}

}  // namespace tessera

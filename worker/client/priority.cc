// KVClient's priorities (docs/priority.md): each key's, and where they go on
// the wire.
#include "absl/strings/str_cat.h"
#include "common/send_order.h"
#include "common/status_macros.h"
#include "worker/client/kv_client.h"

namespace tessera {

absl::Status KVClient::SetPriority(uint64_t key, int64_t priority) {
  const std::string what = absl::StrCat("the priority of key ", key);
  TESSERA_RETURN_IF_ERROR(CheckPriority(priority, what.c_str()));
  absl::MutexLock lock(&priority_mu_);
  auto it = priorities_.find(key);
  if (it == priorities_.end()) {
    return absl::NotFoundError(
        absl::StrCat("cannot set the priority of key ", key,
                     ": it is not initialised here (Init it first)"));
  }
  it->second = static_cast<int32_t>(priority);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KVClient::Priority(uint64_t key) const {
  absl::ReaderMutexLock lock(&priority_mu_);
  auto it = priorities_.find(key);
  if (it == priorities_.end()) {
    return absl::NotFoundError(
        absl::StrCat("key ", key, " is not initialised here: no priority"));
  }
  return it->second;
}

void KVClient::Prioritise(Message* msg) const {
  const wire::Command cmd = msg->header.command();
  if (!options_.send_priority || !msg->header.has_slice() ||
      (cmd != wire::KV_PUSH && cmd != wire::KV_PULL &&
       cmd != wire::KV_PUSHPULL)) {
    return;
  }
  absl::ReaderMutexLock lock(&priority_mu_);
  auto it = priorities_.find(msg->header.slice().key());
  if (it != priorities_.end()) msg->header.set_priority(it->second);
}

}  // namespace tessera

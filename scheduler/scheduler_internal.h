// The scheduler's private helpers that its rooms share (not installed, not
// for other code). Scheduler's methods live in one file per room
// (docs/architecture.md):
//   scheduler.cc     the loop, messages in and out, barriers' and notices'
//                    hand-off (scheduler/barriers.h, scheduler/notices.h),
//                    the end of the job
//   registration.cc  the roster: registration, identity and node keys, ids
//                    and ranks, rejoins, spares held, elastic workers joining
//   membership.cc    deaths and what they do: liveness, lost links, fail-over,
//                    spares placed, workers leaving, servers leaving, hand-back
#ifndef TESSERA_SCHEDULER_SCHEDULER_INTERNAL_H_
#define TESSERA_SCHEDULER_SCHEDULER_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/message.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace scheduler_internal {

constexpr int kProvisionalBase = 1000000;

// The start of a sealed node key (32 raw bytes) in hex, for log lines.
inline std::string SealedKeyText(const std::string& key) {
  return absl::StrCat(absl::BytesToHexString(key.substr(0, 6)), "...");
}

// The id under which the scheduler talks to a node that has registered but has
// no id yet. Like a real id, its parity says the node's role (even: a server,
// odd: a worker), which a secured transport needs to pick the key the node's
// socket must prove it holds.
inline int ProvisionalId(int index, wire::Role role) {
  return kProvisionalBase + 2 * index + (role == wire::WORKER ? 1 : 0);
}
// Indexes of the provisional ids used for a moment to turn a node away.
constexpr int kLateIndex = 499998;
constexpr int kFinishedIndex = 499999;
// Spares' provisional ids count down from here (one per spare of the job).
constexpr int kSpareIndex = 499997;

// An abort; `registrations` names the registrations it answers (Register.
// nonce) for nodes that have no id yet (proto/tessera.proto, Abort).
inline Message AbortMessage(const std::string& reason,
                            absl::Span<const uint64_t> registrations = {}) {
  Message abort;
  abort.header.set_command(wire::ABORT);
  abort.header.set_sender(kSchedulerId);
  abort.header.set_plane(wire::CONTROL);
  abort.header.mutable_abort()->set_reason(reason);
  for (uint64_t nonce : registrations)
    abort.header.mutable_abort()->add_registrations(nonce);
  return abort;
}

}  // namespace scheduler_internal
}  // namespace tessera

#endif  // TESSERA_SCHEDULER_SCHEDULER_INTERNAL_H_

// SenderCheck: whether a message may come from the connection it came on.
//
// In a secured job every connection is authenticated with one role's key
// (scheduler, server or worker; see curve_keys.h), and the receiving transport
// checks each message's claims against that role before anyone reads it:
//
//   absl::Status ok = CheckClaimedSender(msg.header, Role::kWorker);
//   if (!ok.ok()) { /* count, warn naming the key, drop */ }
//
// The rules: the claimed sender id belongs to the key's role (1 the
// scheduler, even ids from 8 servers, odd ids from 9 workers; 0, "no id yet",
// only from servers and workers); the scheduler's messages (node tables, the
// job's end, answers to requests) come only with the scheduler's key, and the
// nodes' requests and acknowledgements only with a node's key; a registration
// claims the key's own role. PermissionDenied says which rule broke.
#ifndef TESSERA_COMMON_SENDER_CHECK_H_
#define TESSERA_COMMON_SENDER_CHECK_H_

#include "absl/status/status.h"
#include "common/options.h"
#include "proto/tessera.pb.h"

namespace tessera {

absl::Status CheckClaimedSender(const wire::Header& header, Role key_role);

}  // namespace tessera

#endif  // TESSERA_COMMON_SENDER_CHECK_H_

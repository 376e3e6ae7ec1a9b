#include "common/sender_check.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/curve_keys.h"
#include "common/message.h"

namespace tessera {
namespace {

// Commands whose request the scheduler sends and whose response a node sends
// (acknowledgements); for the other control commands it is the other way
// round.
bool IsSchedulerNotice(wire::Command command) {
  return command == wire::NODE_TABLE || command == wire::NODE_DEAD ||
         command == wire::TERMINATE || command == wire::ABORT;
}

bool IsNodeRequest(wire::Command command) {
  return command == wire::REGISTER || command == wire::BARRIER ||
         command == wire::HEARTBEAT || command == wire::WORKER_DONE ||
         command == wire::WORKER_LEAVE || command == wire::SERVER_LEAVE;
}

// The node role whose messages `command` carries, either way: a server's
// replication, catch-up, hand-back and goodbye, a worker's end and goodbye.
// (The scheduler's side of them is checked with the other control commands.)
std::optional<Role> NodeRoleOf(wire::Command command) {
  switch (command) {
    case wire::CAUGHT_UP:
    case wire::HANDBACK:
    case wire::SERVER_LEAVE:
    case wire::KV_REPLICATE:
    case wire::KV_TRANSFER:
      return Role::kServer;
    case wire::WORKER_DONE:
    case wire::WORKER_LEAVE:
      return Role::kWorker;
    default:
      return std::nullopt;
  }
}

absl::Status Denied(Role key_role, const std::string& why) {
  return absl::PermissionDeniedError(
      absl::StrCat(why, ", but it came with the ", RoleName(key_role), " key"));
}

}  // namespace

absl::Status CheckClaimedSender(const wire::Header& h, Role key_role) {
  const int sender = h.sender();
  if (sender == 0) {
    if (key_role == Role::kScheduler) {
      return Denied(key_role,
                    "it claims no sender id (a node not yet in the "
                    "job)");
    }
  } else {
    std::optional<Role> claimed = RoleOfNodeId(sender);
    if (!claimed.has_value()) {
      return Denied(key_role, absl::StrCat("it claims sender ", sender,
                                           ", which no node can have"));
    }
    if (*claimed != key_role) {
      return Denied(key_role, absl::StrCat("it claims sender ", sender, " (a ",
                                           RoleName(*claimed), ")"));
    }
  }
  if (std::optional<Role> only = NodeRoleOf(h.command());
      only.has_value() && key_role != Role::kScheduler && key_role != *only) {
    // A compromised worker sending a server's reports (a replacement caught
    // up, a hand-back done) or replica updates, or a server a worker's
    // (issue #46's rogue-node harness).
    return Denied(key_role,
                  absl::StrCat(wire::Command_Name(h.command()), " is a ",
                               RoleName(*only), "'s message"));
  }
  if (h.plane() == wire::CONTROL) {
    const wire::Command command = h.command();
    const bool from_scheduler =
        (IsSchedulerNotice(command) && !h.is_response()) ||
        (IsNodeRequest(command) && h.is_response());
    const bool from_node = (IsSchedulerNotice(command) && h.is_response()) ||
                           (IsNodeRequest(command) && !h.is_response());
    if (from_scheduler && key_role != Role::kScheduler) {
      return Denied(key_role, absl::StrCat("only the scheduler sends ",
                                           wire::Command_Name(command),
                                           h.is_response() ? " answers" : ""));
    }
    if (from_node && key_role == Role::kScheduler) {
      return Denied(key_role, absl::StrCat("the scheduler never sends ",
                                           wire::Command_Name(command),
                                           h.is_response() ? " acknowledgements"
                                                           : " requests"));
    }
    if (command == wire::REGISTER && !h.is_response()) {
      // Only a node not yet in the job registers, unsealed, over a connection
      // of its own key, which the scheduler checks against its roster. A
      // sealed registration (its seal binds it to a node id) would pass by
      // the roster (issue #46).
      if (sender != 0) {
        return absl::PermissionDeniedError(absl::StrCat(
            "it claims sender ", sender,
            "; a registration claims no sender (it comes unsealed, from a "
            "node not yet in the job)"));
      }
      const wire::Role role = h.register_().node().role();
      const bool matches =
          (role == wire::SERVER && key_role == Role::kServer) ||
          (role == wire::WORKER && key_role == Role::kWorker);
      if (!matches) {
        return Denied(key_role,
                      absl::StrCat("it registers as ", wire::Role_Name(role)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tessera

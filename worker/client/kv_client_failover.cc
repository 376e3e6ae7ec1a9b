// KVClient's fail-over room: what a worker does when the node table changes
// under it. A hand-back or a death moves slices to other servers (ServerRoutes
// says where; what waited is resent there), and a restarted server gets the
// replay of what it lost (ReplayLog). The rest of KVClient is in
// worker/client/kv_client.cc, key_init.cc and row_ops.cc.
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/message.h"
#include "worker/client/kv_client.h"
#include "worker/client/kv_client_internal.h"

namespace tessera {

void KVClient::ServersChanged() {
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;  // Start reads the states once it has the node
  // A hand-back: the server that answered these slices holds what was sent
  // to it since it stopped taking pushes; it goes to the one answering now.
  for (int first : routes_.Update(node->server_states()))
    tracker_->ResendNowTo(ServerId(first), absl::InfiniteFuture());
}

void KVClient::FailOver(int server) {
  if (!IsServerId(server)) return;
  // A table change can come while Node::Start still runs (node_ is not set
  // yet): Start reads the states then, and nothing was sent to replay.
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;
  // The table read here may already hold later changes (a hand-back that
  // came in the same table): the slices whose acting primary moved are
  // resent too, not only what waited for the dead server.
  const std::vector<int> moved = routes_.Update(node->server_states());
  if (options_.single_copy) {
    // One copy: a server that answered for slices is gone only after they
    // moved (a death ends the job).
    TESSERA_LOG(INFO) << node->Describe(server)
                      << " left; its key slices moved to the next server, and "
                         "what waited for it is sent there now";
  } else {
    TESSERA_LOG(WARNING) << node->Describe(server)
                         << " died; its key slices' next replicas answer for "
                            "them, and what waited for it is sent to them now";
  }
  tracker_->ResendNowTo(server, absl::InfiniteFuture());
  for (int first : moved) {
    if (ServerId(first) != server)
      tracker_->ResendNowTo(ServerId(first), absl::InfiniteFuture());
  }
}

void KVClient::ReplayTo(int server) {
  if (!IsServerId(server)) return;
  std::vector<ReplayLog::Entry> replay = replay_log_.For(RankOfId(server));
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;  // during Start: nothing sent yet
  TESSERA_LOG(INFO) << node->Describe(server) << " restarted; replaying "
                    << replay.size() << " message(s) to it";
  // The replay goes first, then what was in flight: a pull in flight must
  // reach the restarted server after the pushes it follows, or it is answered
  // before they are applied (a stale value; fault_test under TSan, where the
  // replay took longer than the resend thread's tick).
  const absl::Time replay_start = absl::Now();
  for (ReplayLog::Entry& e : replay)
    SendPart(0, e.part, std::move(e.msg), nullptr, e.ref, /*replayed=*/true);
  tracker_->ResendNowTo(server, replay_start);
}

}  // namespace tessera

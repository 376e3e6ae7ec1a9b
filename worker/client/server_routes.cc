#include "worker/client/server_routes.h"

#include <utility>

namespace tessera {

ServerRoutes::ServerRoutes(int num_servers, int chain_length, bool single_copy)
    : servers_(num_servers), chain_(chain_length), single_copy_(single_copy) {}

int ServerRoutes::Route(int server, Message* msg) const {
  if (chain_ <= 1 || !IsServerId(server)) return server;
  // A slice's chain: its primary p, then p+1, ..., p+chain-1. A request
  // goes to the first live member (an init for place j to the first live
  // one from j on), which learns its place from the init (and takes it only
  // where the key's layout puts the slice, common/key_layout.h).
  const bool init = msg->header.command() == wire::KV_INIT;
  const int place = init ? static_cast<int>(msg->header.replica()) : 0;
  const SliceChain slice =
      SliceChain::Around(RankOfId(server), place, servers_, chain_);
  absl::MutexLock lock(&mu_);
  if (states_.empty()) return server;
  if (!init || single_copy_) {
    // The acting primary; with one copy it holds the slice's only copy, and
    // its init goes there too.
    const int primary = slice.Primary(states_);
    if (primary < 0) return server;
    if (init) msg->header.set_replica(slice.PlaceOf(primary));
    return ServerId(primary);
  }
  for (int n = 0; n < chain_; ++n) {
    const int i = (place + n) % chain_;
    const int rank = slice.RankAt(i);
    if (states_[rank].dead) continue;
    msg->header.set_replica(i);
    return ServerId(rank);
  }
  return server;  // none left: the scheduler ends the job
}

std::vector<int> ServerRoutes::Update(std::vector<ServerState> states) {
  std::vector<int> moved;  // first ranks whose acting primary changed
  absl::MutexLock lock(&mu_);
  std::vector<ServerState> before = std::exchange(states_, std::move(states));
  if (chain_ > 1 && before.size() == states_.size()) {
    for (int first = 0; first < servers_; ++first) {
      const SliceChain slice(first, servers_, chain_);
      if (slice.Primary(before) != slice.Primary(states_)) {
        moved.push_back(first);
      }
    }
  }
  return moved;
}

}  // namespace tessera

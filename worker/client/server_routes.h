// Where a worker's requests for a server's key slices go when the slices have
// chains (TESSERA_REPLICAS > 1, or one copy that moves between servers): the
// acting primary of the slice's chain as the node table's server states say
// (common/replica_chain.h), an init to the first live member from the place
// it is for. Without chains, or before the table has any server state, a
// request goes to the server its partition names.
//
// Thread-safe: callers' threads route, the node's receiver thread updates.
#ifndef TESSERA_WORKER_CLIENT_SERVER_ROUTES_H_
#define TESSERA_WORKER_CLIENT_SERVER_ROUTES_H_

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/message.h"
#include "common/replica_chain.h"

namespace tessera {

class ServerRoutes {
 public:
  // `chain_length`: the servers holding each slice (1: no chains);
  // `single_copy`: one copy that moves (its init goes where the slice is).
  ServerRoutes(int num_servers, int chain_length, bool single_copy);

  // The node id a request for `server`'s slices goes to now. An init's chain
  // place is set in `msg` (the server it goes to learns its place from it).
  int Route(int server, Message* msg) const ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the table's server states (one per rank); returns the first ranks
  // of the chains whose acting primary changed since the last update (none
  // at the first, or when the number of servers changed).
  std::vector<int> Update(std::vector<ServerState> states)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int servers_;
  const int chain_;
  const bool single_copy_;
  mutable absl::Mutex mu_;
  // The table's server states (empty until the first update).
  std::vector<ServerState> states_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_SERVER_ROUTES_H_

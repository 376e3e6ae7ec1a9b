// Who answers for a replicated key slice (TESSERA_REPLICAS = R > 1).
//
// A slice whose partition names server rank p has the chain p, p+1, ...,
// p+R-1 (mod the servers). Each server rank has a state in the node table:
// dead, catching up (a replacement still receiving its slices), and when it
// joined (0: when the job formed; k: the k-th replacement of the job). The
// members answer in chain order, except that replacements come after the
// members that held the slice before them, in the order they joined: a
// replacement that caught up becomes a backup, and the server answering
// for the slice keeps answering until it dies (no hand-back in the middle
// of a round). The first member that is neither dead nor catching up is the
// slice's acting primary; every server and worker computes it from the same
// table. A replacement that caught up is then given its place back at a
// round boundary (`restored`, after the hand-back the scheduler runs; see
// server/replication.h): from then on it orders as a member since the start.
#ifndef TESSERA_COMMON_REPLICA_CHAIN_H_
#define TESSERA_COMMON_REPLICA_CHAIN_H_

#include <cstdint>
#include <vector>

namespace tessera {

struct ServerState {
  bool dead = false;
  bool catching_up = false;
  uint32_t joined = 0;
  bool restored = false;  // a replacement whose hand-back completed

  // Holds its slices: may answer for them, and counts for their survival.
  bool holds() const { return !dead && !catching_up; }
};

// The ranks of the chain whose first member is `first_rank`, in the order
// they answer. `states` has one entry per server rank (missing ones count
// as members since the start).
std::vector<int> ChainOrder(int first_rank, int num_servers, int replicas,
                            const std::vector<ServerState>& states);

// The first member of that order that holds the slice, or -1.
int ActingPrimary(int first_rank, int num_servers, int replicas,
                  const std::vector<ServerState>& states);

// The first rank of the chain in which server rank `rank` has place `place`
// (0: the chain's first member; a worker's init names the place it is for).
int ChainFirst(int rank, int place, int num_servers);

// Whether server rank `member` belongs to the chain whose first member is
// `first_rank` (its `replicas` ranks; every rank when replicas >= servers).
bool InChain(int first_rank, int num_servers, int replicas, int member);

}  // namespace tessera

#endif  // TESSERA_COMMON_REPLICA_CHAIN_H_

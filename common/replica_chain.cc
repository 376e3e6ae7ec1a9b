#include "common/replica_chain.h"

#include <algorithm>

namespace tessera {

std::vector<int> ChainOrder(int first_rank, int num_servers, int replicas,
                            const std::vector<ServerState>& states) {
  std::vector<int> chain;
  if (num_servers <= 0) return chain;
  for (int i = 0; i < replicas && i < num_servers; ++i)
    chain.push_back((first_rank + i) % num_servers);
  auto joined = [&](int rank) {
    if (rank >= static_cast<int>(states.size()) || states[rank].restored)
      return 0u;
    return states[rank].joined;
  };
  std::stable_sort(chain.begin(), chain.end(),
                   [&](int a, int b) { return joined(a) < joined(b); });
  return chain;
}

int ActingPrimary(int first_rank, int num_servers, int replicas,
                  const std::vector<ServerState>& states) {
  // ChainOrder's first member that holds the slice, without building it (a
  // worker routes every request through this; with one copy the chain is
  // every server rank): the holder that joined first, members since the
  // start (or given their place back) before replacements, ties in chain
  // order.
  int best = -1;
  uint32_t best_joined = 0;
  for (int i = 0; i < replicas && i < num_servers; ++i) {
    const int rank = (first_rank + i) % num_servers;
    if (rank >= static_cast<int>(states.size())) return rank;
    const ServerState& s = states[rank];
    if (!s.holds()) continue;
    const uint32_t joined = s.restored ? 0u : s.joined;
    if (joined == 0) return rank;
    if (best < 0 || joined < best_joined) {
      best = rank;
      best_joined = joined;
    }
  }
  return best;
}

int ChainFirst(int rank, int place, int num_servers) {
  if (num_servers <= 0) return rank;
  return ((rank - place) % num_servers + num_servers) % num_servers;
}

bool InChain(int first_rank, int num_servers, int replicas, int member) {
  if (num_servers <= 0 || member < 0 || member >= num_servers) return false;
  const int offset =
      ((member - first_rank) % num_servers + num_servers) % num_servers;
  return offset < replicas;
}

}  // namespace tessera

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
  for (int rank : ChainOrder(first_rank, num_servers, replicas, states)) {
    if (rank >= static_cast<int>(states.size()) || states[rank].holds())
      return rank;
  }
  return -1;
}

}  // namespace tessera

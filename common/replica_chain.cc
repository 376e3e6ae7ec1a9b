#include "common/replica_chain.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tessera {

uint64_t StatesDigest(const std::vector<ServerState>& states) {
  // FNV-1a over each rank's fields.
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(states.size());
  for (const ServerState& s : states) {
    // A dead rank's other fields route nothing (SliceChain skips dead
    // ranks), and nodes may hold different ones: a notice of its last
    // replacement can be overtaken by that replacement's death.
    if (s.dead) {
      mix(1);
      continue;
    }
    mix((s.catching_up ? 2 : 0) | (s.restored ? 4 : 0));
    mix(s.joined);
  }
  return h;
}
namespace {

// x mod n in [0, n) for any x (n > 0).
int Mod(int x, int n) { return (x % n + n) % n; }

}  // namespace

SliceChain::SliceChain(int first_rank, int num_servers, int length)
    : first_(num_servers > 0 ? Mod(first_rank, num_servers) : first_rank),
      servers_(num_servers),
      size_(std::max(0, std::min(length, num_servers))) {}

SliceChain SliceChain::Around(int rank, int place, int num_servers,
                              int length) {
  return SliceChain(rank - place, num_servers, length);
}

int SliceChain::RankAt(int place) const {
  return servers_ > 0 ? Mod(first_ + place, servers_) : first_;
}

int SliceChain::PlaceOf(int rank) const {
  if (servers_ <= 0 || rank < 0 || rank >= servers_) return -1;
  const int place = Mod(rank - first_, servers_);
  return place < size_ ? place : -1;
}

std::vector<int> SliceChain::Order(
    const std::vector<ServerState>& states) const {
  // A dead rank answers nothing, and its `joined` is not in the view
  // (StatesDigest): nodes may hold different ones, so ordering by it would
  // give them different orders. It is left out.
  std::vector<int> chain;
  for (int i = 0; i < size_; ++i) {
    const int rank = RankAt(i);
    if (rank < static_cast<int>(states.size()) && states[rank].dead) continue;
    chain.push_back(rank);
  }
  auto joined = [&](int rank) {
    if (rank >= static_cast<int>(states.size()) || states[rank].restored)
      return 0u;
    return states[rank].joined;
  };
  std::stable_sort(chain.begin(), chain.end(),
                   [&](int a, int b) { return joined(a) < joined(b); });
  return chain;
}

int SliceChain::Primary(const std::vector<ServerState>& states) const {
  // Order()'s first member that holds the slice, without building it (a
  // worker routes every request through this; with one copy the chain is
  // every server rank): the holder that joined first, members since the
  // start (or given their place back) before replacements, ties in chain
  // order.
  int best = -1;
  uint32_t best_joined = 0;
  for (int i = 0; i < size_; ++i) {
    const int rank = RankAt(i);
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

std::string SliceChain::Members() const {
  std::string out;
  for (int i = 0; i < size_; ++i)
    absl::StrAppend(&out, i == 0 ? "" : ", ", RankAt(i));
  return out;
}

}  // namespace tessera

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
#include <string>
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

// A digest of a table's server states (every field of a live rank, only the
// death of a dead one, whose other fields route nothing and may differ
// between nodes): two servers agree on who holds what when their digests
// are equal.
uint64_t StatesDigest(const std::vector<ServerState>& states);

// One key slice's chain: the server ranks that hold it, and which of them
// answers given the table's states. Servers, workers and the scheduler ask
// it; nothing else does the chain's arithmetic.
//
// With `length` L and S server ranks, the chain whose first member is f is
// f, f+1, ..., f+min(L,S)-1 (mod S); a member's place is its offset from f.
// A worker sees a slice by its partition's rank (the first member), a server
// by its own rank and the place it holds (a stored key's replica).
class SliceChain {
 public:
  // The chain whose first member is `first_rank`. A single-copy job's chain
  // is every server rank (length = num_servers).
  SliceChain(int first_rank, int num_servers, int length);
  // The chain in which server rank `rank` holds place `place`.
  static SliceChain Around(int rank, int place, int num_servers, int length);

  int first() const { return first_; }
  // Members: min(length, num_servers).
  int size() const { return size_; }
  // The member at `place` (any place; taken modulo the servers).
  int RankAt(int place) const;
  // The place of server rank `rank`, or -1 if it is not a member.
  int PlaceOf(int rank) const;
  bool Contains(int rank) const { return PlaceOf(rank) >= 0; }

  // The live members in the order they answer (a dead one answers nothing,
  // and its fields other than its death are not in StatesDigest's view, so
  // nodes may hold different ones). `states` has one entry per server rank
  // (missing ones count as members since the start). Depends only on what
  // StatesDigest covers.
  std::vector<int> Order(const std::vector<ServerState>& states) const;
  // The first member of that order that holds the slice (the acting
  // primary), or -1 if none does.
  int Primary(const std::vector<ServerState>& states) const;
  // "3, 0, 1": the members in place order, for messages.
  std::string Members() const;

 private:
  int first_;
  int servers_;
  int size_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_REPLICA_CHAIN_H_

// Where a key's slices live: the layout a worker's KeyPartitioner
// (worker/client/key_partitioner.h) makes, as every node can compute it. A
// key shorter than the workers' TESSERA_BIGARRAY_BOUND lives whole on its
// home server, SplitMix64(key) mod the servers (in consecutive slices there,
// TESSERA_CHUNK_BYTES); a longer one is split into one contiguous part per
// server, part s being [total * s / S, total * (s+1) / S); a hashed key has
// one slice on every server, its offset that server's rank. The server a
// slice's layout names is the first member of its chain
// (common/replica_chain.h): a server checks a worker's word on its place in
// that chain against it (server/chain_replication.cc).
//
//   const int home = KeyHome(key, num_servers);
//   const uint64_t begin = SplitPartBegin(total, part, num_servers);
//   if (!MayBeFirstMember(rank, slice, num_servers)) { ... refuse ... }
#ifndef TESSERA_COMMON_KEY_LAYOUT_H_
#define TESSERA_COMMON_KEY_LAYOUT_H_

#include <cstdint>

#include "proto/tessera.pb.h"

namespace tessera {

// The server rank that holds `key` whole (a key that is not split).
// REQUIRES: num_servers >= 1.
int KeyHome(uint64_t key, int num_servers);

// The first element (or row) of part `part` of a key of `total` split over
// `num_servers`: total * part / num_servers, rounded down, without overflow
// for any total. REQUIRES: num_servers >= 1, 0 <= part <= num_servers.
uint64_t SplitPartBegin(uint64_t total, int part, int num_servers);

// Whether a worker's layout can name server rank `first` for `slice` (a
// KV_INIT's; offsets and lengths in elements, or rows for a row-sparse key):
// a hashed key's slice when `first` is its offset; any other when `first`
// is the key's home, or the slice lies within `first`'s split part. The
// bound that chooses between the two is the workers' setting, which other
// nodes need not share, so either counts. Pure; any thread.
bool MayBeFirstMember(int first, const wire::KeySlice& slice, int num_servers);

}  // namespace tessera

#endif  // TESSERA_COMMON_KEY_LAYOUT_H_

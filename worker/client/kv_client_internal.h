// KVClient's private constants and helpers that its rooms share (not
// installed, not for other code). KVClient's methods live in one file per
// room (docs/architecture.md):
//   kv_client.cc  start and end, settings, the dense push and pull paths,
//                 waiting, fail-over to a slice's next replica
//   key_init.cc   a key's init (dense, row-sparse, hashed), and a restarted
//                 or joining worker's resume of the rounds
//   row_ops.cc    row-sparse and hashed pushes and pulls
//   bounded_staleness.cc  dist_ssp's staleness bound and what key inits
//                 tell the servers of it
// Where a slice's requests go is ServerRoutes (worker/client/server_routes.h);
// what is in flight and resent is RequestTracker.
#ifndef TESSERA_WORKER_CLIENT_KV_CLIENT_INTERNAL_H_
#define TESSERA_WORKER_CLIENT_KV_CLIENT_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/options.h"

namespace tessera {
namespace client_internal {

// What the workers of a job together keep in flight to one server of one
// big push, in bytes: each worker's share, in slices, is its window (at least
// one). A server therefore holds about this much of a push in flight however
// many workers push at once.
constexpr int64_t kServerInflightBytes = int64_t{64} << 20;

// A row-sparse key's part on a server is cut into slices of about this many
// chunks of rows (64 MiB of rows with the default 1 MiB TESSERA_CHUNK_BYTES):
// each slice is a round of its own, so a server sums and applies one slice of
// a push while the next arrives, and the worker copies one slice of a pull
// while the server gathers the next; a push of a few rows still goes as a few
// messages.
constexpr uint64_t kRowSliceChunks = 64;

inline int PushWindow(const Options& options) {
  const int64_t share =
      kServerInflightBytes /
      (int64_t{std::max(1, options.num_workers)} * options.chunk_bytes);
  return static_cast<int>(std::clamp<int64_t>(share, 1, 64));
}

// A row push's slices to one server carry only the rows they name, from a
// few bytes to kRowSliceChunks chunks each. Its slices go at most this many
// bytes (over the largest slice, at least two slices) at a time, so that what
// the worker sends next (its pull of the same rows, issued right after the
// push: kv.push(); kv.pull()) is not queued behind the whole push on the
// connection: the server answers the pull of one slice while the next slices
// of the push arrive. (At 16 slices of 6.4 MB sent at once, every pull request
// reached the server after the last push, 30 ms into an 80 ms push + pull.)
constexpr uint64_t kRowPushInflightChunks = 16;

// The tag of the workers' barrier that ends the init of `key`.
inline std::string InitBarrier(uint64_t key) {
  return absl::StrCat("init ", key);
}

}  // namespace client_internal
}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_KV_CLIENT_INTERNAL_H_

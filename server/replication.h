// Replication of key slices (TESSERA_REPLICAS = R > 1, issue #28).
//
// Every key slice has a chain of R servers: its primary, the server rank p
// that the key's partition names (KeyPartitioner, HashedServerOf), then ranks
// p+1, ..., p+R-1 (mod the servers), its backups. A worker sends a slice's
// KV_INIT to every member (header.replica: its place in the chain) and every
// other request to the first member still alive: the primary, or after it
// died the next replica. A server does not take its place on the worker's
// word (issue #46): the chain the place puts it in must start at a server
// the key's layout can name for the slice (common/key_layout.h), and a
// slice it holds keeps the place it was made at (CheckInitPlace).
//
// Replicate after aggregation. The primary sums a round as it always did;
// after applying it, it sends the update to every live backup as a
// KV_REPLICATE numbered replica_seq (the slice's updates, from 0), carrying
// what the update was (the kind's engine decides: the rounded sum a dense
// slice's optimizer took, or with no optimizer the new value; a row slice's
// ids and summed rows; a hashed slice's ids, sightings and rows) and the
// exactly-once counts the slice holds after it (per worker rank). A backup
// applies updates in order with the same optimizer, so it holds the same
// bits, and answers each. The primary answers the round's pushes only when
// every live backup holds the update: what a worker saw answered is on every
// live replica. Pulls are not held: a round's result is a function of its
// pushes, and a worker whose push was not answered sends it again.
//
// dist_async: each applied push is an update; it is answered once every live
// backup holds it. Two backups (R > 2) could each hold a different last
// update when the primary dies, and in dist_async nothing recomputes it the
// same way; R > 2 therefore needs dist_sync keys (an async key's init is
// refused otherwise). dist_ssp slices replicate as dist_async ones; in an
// elastic job a worker's entry into one (its starting clock, and that the
// bound waits for it) is an update of its own, without frames, answered once
// every live backup holds it (KVServer::ReplicateEntry).
//
// Failover. The scheduler declares a server dead (heartbeats) and tells every
// live node in a table change (NodeInfo.dead). For each slice the first live
// member of its chain answers from then on: a backup that becomes it
// ("promoted") replays the requests it held, and workers resend what was
// outstanding to it. Its state is that of the last update it holds; a push
// of a later round is not in its counts, so the resent pushes are taken and
// the round is summed again, exactly, to the same bits; a push it holds is a
// duplicate and answered. (Summed in arrival order, TESSERA_SYNC_SUM=arrival,
// it would be other bits, while a second backup that held the dead primary's
// update keeps it: arrival sums allow R <= 2, common/options.cc.) Losing every member of a chain ends the job, naming
// the slices (scheduler).
//
// Replacements. A server that takes a dead server's rank (a spare,
// TESSERA_SPARE=1, held by the scheduler until then; or the dead server
// restarted; or, with TESSERA_MAX_SERVERS, a server added to a rank that had
// none) is marked catching_up in a table change, with `joined` the
// number of replacements so far. Chains answer in their order with the
// replacements last, in the order they joined (common/replica_chain.h): the
// server answering for a slice keeps answering until it dies or hands the
// slice back (below). The
// replacement asks every live server for the slices of its chains
// (KV_TRANSFER without a slice, again every PS_RESEND_TIMEOUT until done); a
// server sends one KV_TRANSFER per slice it answers for whose chain holds
// the replacement (a ServerCheckpoint of that slice: weights, optimizer
// state, exactly-once counts, its replica_seq) and then the count, which
// answers that ask and names those slices (server/catch_up.h). From the
// transfer on it sends that replacement the slice's updates too, but its
// answers to workers wait for it only once the replacement answered the
// transfer (holds the slice). When every live server's count is in and
// every slice it named came from it, the replacement reports CAUGHT_UP and the scheduler tells everyone: it holds
// its slices and counts for their survival again (a second death of the
// chain's other member fails over to it). Until then a death that leaves
// only the replacement ends the job.
//
// Hand-back. Once a replacement caught up, the scheduler gives it back its
// place in its chains' order (HANDBACK, one at a time): every live server
// computes the slices whose acting primary the replacement becomes
// (ServerState.restored) and that it answers for now; each such slice stops
// taking pushes at its next round boundary (at once when its round is empty,
// or for a dist_async slice) and holds later ones, still answering pulls.
// When every such slice stopped and its backups hold every update it made,
// the server tells the scheduler; when all did, the scheduler marks the
// replacement restored in a table change. The replacement, holding every
// update, answers from then on; the old server is a backup, and the workers
// send what waited there to the replacement (a push it counted already is a
// duplicate). A change of the servers before that (a death, a leave, another
// replacement) makes the scheduler start a new attempt, which replaces the
// old one on every server; a server recomputes its moving slices at each
// change (one that no longer moves takes its held pushes), a notice that
// overtook its change waits for it, and the rank's death ends it. From its
// report to the end a server keeps its moving slices stopped, so no slice
// is answered by two servers. Only the moving slices pause, for about a
// round.
//
// One copy (TESSERA_MAX_SERVERS with TESSERA_REPLICAS=1; set_replication's
// `single_copy`). The chain of a slice is every server rank from its own on,
// and places the slice only: its acting primary holds the one copy, a
// worker sends the slice's init there alone, and the primary sends updates
// only to a server it is moving the slice to (a transfer in flight or held),
// whose answers count once it holds the slice. A server that joins catches
// up as a replacement does, on the slices it will answer for only
// (MovesTo), and takes them in a hand-back; the old primary then drops its
// copy (a request for it that still comes is dropped: the worker sends it
// to the new primary), and takes an init only for a slice it answers for.
// A server leaves (SIGTERM) in a hand-back marked `leave`: it
// sends each slice it answers for to the server that answers for it without
// it, stops it at its round boundary, and reports once that server holds the
// slice and every update; then the scheduler marks it left. An init of a
// slice that is moving is not taken (the worker sends it again). A death of
// a server that answers for slices ends the job.
//
// Gaps. A backup that gets an update past the next one answers with what it
// holds (FailedPrecondition, replica_seq: its count): the primary resends
// the next update if it still keeps it, or else sends the slice whole, as
// to a replacement (a backup that missed updates every other replica
// answered, e.g. after a promotion with R >= 3).
//
// This file: the update's wire form for row slices, and what a primary keeps
// of an update until its backups hold it.
#ifndef TESSERA_SERVER_REPLICATION_H_
#define TESSERA_SERVER_REPLICATION_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/buffer.h"
#include "common/message.h"
#include "proto/tessera.pb.h"

namespace tessera {

// An update of rows as a KV_REPLICATE carries it: a RAW frame of uint64 row
// ids (the slice's own rows, or a hashed key's ids), with `sightings` a RAW
// frame of uint32 (hashed keys: how many pushes named each), then one
// float32 frame of the rows, row_length values each, in the ids' order.
void AddRowUpdate(Message* out, const std::vector<uint64_t>& ids,
                  const std::vector<uint32_t>* sightings,
                  const std::function<const float*(size_t)>& row,
                  uint64_t row_length);
// Appends `from`'s data frames and their descriptors to `to`.
void MoveFrames(Message&& from, Message* to);
struct RowUpdate {
  std::vector<uint64_t> ids;
  std::vector<uint32_t> sightings;  // hashed keys
  const float* values = nullptr;    // ids.size() x row_length, in `msg`
};
// DataLoss when `msg` is not such an update.
absl::StatusOr<RowUpdate> ParseRowUpdate(const Message& msg,
                                         uint64_t row_length,
                                         bool with_sightings);

// What a primary keeps of one update until every live backup holds it.
struct PendingUpdate {
  uint64_t seq = 0;
  Message update;                      // KV_REPLICATE, kept for resends
  std::vector<wire::Header> requests;  // the pushes it answers
  Buffer weights;  // the value a KV_PUSHPULL answer carries (dense)
  // The requests were answered (every backup that holds the slice holds
  // it); kept until a replacement receiving the slice holds it too.
  bool answered = false;
  absl::Time sent;
  absl::Duration wait;  // until the next resend
};

}  // namespace tessera

#endif  // TESSERA_SERVER_REPLICATION_H_

// A replacement server's catch-up: the room that asks the live servers for
// the slices this server will hold and knows when all of them came.
//
// A server that takes a rank in a running job (a spare, a restarted or an
// added server; server/replication.h, "Replacements") holds none of its
// slices. It asks every live server for them (KV_TRANSFER without a slice),
// again every PS_RESEND_TIMEOUT until that server has sent all it said it
// sends: each answers with one KV_TRANSFER per slice and then the count,
// which names those slices (key, offset). When every live server's count is
// in and every slice it named was taken from it, the catch-up is done and
// reports once (the server then tells the scheduler CAUGHT_UP).
//
// A death during the catch-up moves slices to other servers, so the counts
// given so far are stale: Restart forgets them and the live servers are
// asked again (slices taken stay taken). A count answering an ask made
// before the Restart (late, or replayed), or an ask never made, is dropped.
// Naming the slices, not only counting them, keeps a slice taken before the
// death from standing in for another the new count names.
//
// Thread-safe: the slices arrive on the shard threads, the counts on the
// server's receiving thread, and the asking runs on a thread of its own.
//
//   CatchUp catch_up;
//   catch_up.Start({.rank = 2, .num_servers = 3, .resend = absl::Seconds(1),
//                   .states = [&] { return node.server_states(); },
//                   .ask = [&](int r, uint64_t id) { SendTransferAsk(r, id); },
//                   .caught_up = [&] { ReportCaughtUp(); }});
//   catch_up.Took(0, key, offset, bytes); catch_up.Check();
//   catch_up.Counted(0, id, {{key, offset}});  // server 0 sent its one slice
//                                              // (ask `id`): done, reported
#ifndef TESSERA_SERVER_CATCH_UP_H_
#define TESSERA_SERVER_CATCH_UP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/replica_chain.h"

namespace tessera {

class CatchUp {
 public:
  using SliceId = std::pair<uint64_t, uint64_t>;  // (key, offset)

  struct Options {
    int rank = 0;                              // this server's rank
    int num_servers = 1;                       // server ranks in the job
    absl::Duration resend = absl::Seconds(1);  // between two asks
    // The table's server states now (one per rank).
    std::function<std::vector<ServerState>()> states;
    // Asks server `rank` for its slices (request id `id`, from 1 on), under
    // the view `view` of the table (StatesDigest of `states`).
    std::function<void(int rank, uint64_t id, uint64_t view)> ask;
    // Called once, when every live server sent all it counted.
    std::function<void()> caught_up;
  };

  CatchUp() = default;
  CatchUp(const CatchUp&) = delete;
  CatchUp& operator=(const CatchUp&) = delete;
  ~CatchUp() { Stop(); }

  // Starts asking, on a thread of its own. False (nothing done) if a
  // catch-up was started before or Stop was called.
  bool Start(Options options);
  // Started and not yet done: slices new to this server are taken.
  bool active() const;
  // Server `rank`, answering ask `request_id` under table view `view`, said
  // it sends `slices`. Then checks. Dropped (false) when the ask was made
  // before the last Restart, of another server or never, under another view,
  // or before the ask whose count was taken last.
  bool Counted(int rank, uint64_t request_id, uint64_t view,
               std::vector<SliceId> slices);
  // Slice (key, offset) of `bytes` bytes came from server `rank` (a slice
  // taken twice counts once). Check afterwards.
  void Took(int rank, uint64_t key, uint64_t offset, size_t bytes);
  // Reports (once, outside the lock) if every live server sent all it
  // counted, each count made under the current view of the table.
  void Check();
  // A server died: the counts are stale; the live servers are asked again.
  void Restart();
  // Ends the asking; joins the thread. Idempotent.
  void Stop();

 private:
  void Loop();
  // Server `rank` said which slices it sends, and all of them came from it.
  bool SentAll(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto m = missing_.find(rank);
    return m != missing_.end() && m->second == 0;
  }

  // The asking thread stops waiting out `resend`: done, stopped, or asked
  // to ask again.
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return done_ || stopped_ || ask_again_;
  }

  mutable absl::Mutex mu_;
  Options options_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool ask_again_ ABSL_GUARDED_BY(mu_) = false;  // Restart: ask at once
  absl::Time started_at_ ABSL_GUARDED_BY(mu_);
  // The last ask's id (one sequence for all servers, from 1), and the first
  // made since the last Restart: counts answering older asks are stale.
  uint64_t asked_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t current_from_ ABSL_GUARDED_BY(mu_) = 1;
  // The asks made since the last Restart, by id: the server asked. And per
  // server, the ask its count in counted_ answered (a later count replaces
  // it, an earlier one is dropped).
  struct Ask {
    int rank;
    uint64_t view;
  };
  std::map<uint64_t, Ask> asked_of_ ABSL_GUARDED_BY(mu_);
  std::map<int, uint64_t> answered_ ABSL_GUARDED_BY(mu_);
  // Per server rank: the slices it said it sends, those taken from it, and
  // how many of the first are not among the second (0: it sent all).
  std::map<int, std::set<SliceId>> counted_ ABSL_GUARDED_BY(mu_);
  // Per server rank: the view of the table its count was made under (Check
  // takes a count only under the view it judges).
  std::map<int, uint64_t> counted_view_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::set<SliceId>> taken_ ABSL_GUARDED_BY(mu_);
  std::map<int, size_t> missing_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // Start's; joined by Stop
  // Held by Stop while it joins: a second Stop returns only once joined.
  absl::Mutex stop_mu_ ABSL_ACQUIRED_BEFORE(mu_);
};

}  // namespace tessera

#endif  // TESSERA_SERVER_CATCH_UP_H_

// dist_ssp, bounded staleness (the "bounded delay" consistency of Li et al.,
// OSDI'14; docs/consistency.md): a key's pushes are applied on arrival with
// the servers' optimizer, as in dist_async, but a worker's pull made after c
// pushes to the key (its clock for the key, which every pull carries as
// push_seq) is answered only once every rank in the job has had at least
// c - s of its pushes to that slice applied. A worker therefore never reads
// weights that miss a push more than s steps older than its own, and the
// fastest worker runs at most s + 1 pushes ahead of the slowest.
//
//   StalenessGate gate(/*staleness=*/3);           // one per dist_ssp slice
//   if (!gate.Open(clock, ledger, counts)) { gate.Hold(...); ... hold it }
//   StalenessStats stats(/*num_workers=*/4);       // one per server: metrics
//   stats.Pushed(rank, ledger.received(rank));
//   stats.Holding(sender, request_id, {key, offset, ...}, absl::Now());
//   stats.Fill(&pending, absl::Now());              // GET /debug/pending
//
// A rank counts (holds others back) while it is in the job: a worker that
// left an elastic job, or was declared dead, stops counting when the server
// hears of it (KVServer::WorkerLeft), and the pulls it held are answered.
//
// Thread-safety: a StalenessGate belongs to its slice (one thread at a time,
// as the slice's StoredKey); StalenessStats is thread-safe (its held pulls
// behind one lock, taken when a pull is held, offered again or answered).
#ifndef TESSERA_SERVER_STALENESS_H_
#define TESSERA_SERVER_STALENESS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/tessera.pb.h"
#include "server/delivery.h"

namespace tessera {

class StalenessGate {
 public:
  explicit StalenessGate(uint32_t staleness) : staleness_(staleness) {}

  uint32_t staleness() const { return staleness_; }

  // Whether a pull made after `clock` pushes of its worker may be answered:
  // every rank `counts` accepts has had at least clock - s pushes taken
  // (`ledger`, the slice's).
  bool Open(uint64_t clock, const PushLedger& ledger,
            const std::function<bool(int)>& counts) const;
  // The counting rank with the fewest pushes taken (-1 when none counts),
  // and the spread: the most pushes any counting rank has taken minus that.
  struct Span {
    int slowest_rank = -1;
    uint64_t slowest = 0;
    uint64_t spread = 0;
  };
  static Span Measure(const PushLedger& ledger,
                      const std::function<bool(int)>& counts);

  // The pulls the gate holds (for their held time): Hold returns true when
  // the request (`sender`, `request_id`) was not held yet; Release returns
  // how long it was held, or nothing when it was not; Forget drops
  // `sender`'s (their requests were answered otherwise) and returns how
  // many.
  bool Hold(int sender, uint64_t request_id, absl::Time now);
  std::optional<absl::Duration> Release(int sender, uint64_t request_id,
                                        absl::Time now);
  size_t Forget(int sender);
  size_t held() const { return held_.size(); }

 private:
  const uint32_t staleness_;
  std::map<std::pair<int, uint64_t>, absl::Time> held_;
};

// A server's account of its dist_ssp slices (docs/metrics.md): per worker
// rank its clock (the most pushes of it any dist_ssp slice here has taken),
// the spread between the fastest and the slowest rank in the job, and the
// pulls the bound held and for how long.
class StalenessStats {
 public:
  explicit StalenessStats(int num_workers);
  StalenessStats(const StalenessStats&) = delete;
  StalenessStats& operator=(const StalenessStats&) = delete;

  // A dist_ssp slice took a push of `rank`; it has now taken `count`.
  void Pushed(int rank, uint64_t count);
  // `rank` left (or joined) the job: the spread leaves it out (takes it in).
  void SetInJob(int rank, bool in_job);
  // A pull was held for the first time; a held pull was answered after
  // `held`; `n` held pulls were answered otherwise (their worker left).
  void Held();
  void Released(absl::Duration held);
  void Dropped(size_t n);

  uint64_t clock(int rank) const;
  // The fastest clock minus the slowest, over the ranks in the job that
  // pushed to a dist_ssp slice here (0 when fewer than two did).
  uint64_t spread() const;
  int64_t waiting() const { return waiting_.load(); }

  // The hang doctor's view (/debug/pending): each held pull, whom it waits
  // for (the slowest rank in the job) and by how many steps. Holding adds
  // or refreshes one (a held pull offered again, the slowest moved);
  // NotHolding drops one answered, NotHoldingAny a sender's on a slice.
  struct HeldPull {
    uint64_t key = 0;
    uint64_t offset = 0;
    int rank = -1;  // the puller's
    wire::Command command = wire::KV_PULL;
    uint64_t clock = 0;
    uint32_t staleness = 0;
    int held_by = -1;  // StalenessGate::Span's slowest_rank
    uint64_t held_by_pushes = 0;
  };
  // The oldest this many are listed (all are counted).
  static constexpr size_t kMaxListed = 200;
  void Holding(int sender, uint64_t request_id, const HeldPull& pull,
               absl::Time now);
  void NotHolding(uint64_t key, uint64_t offset, int sender,
                  uint64_t request_id);
  void NotHoldingAny(uint64_t key, uint64_t offset, int sender);
  // The held pulls, oldest first, into `out` (held_pulls, held_pulls_total).
  void Fill(wire::DebugPending* out, absl::Time now) const;

 private:
  // (key, offset, sender, request id).
  using HeldId = std::tuple<uint64_t, uint64_t, int, uint64_t>;
  struct HeldEntry {
    HeldPull pull;
    absl::Time since;
  };
  const int num_workers_;
  std::unique_ptr<std::atomic<uint64_t>[]> clock_;
  std::unique_ptr<std::atomic<bool>[]> pushed_;
  std::unique_ptr<std::atomic<bool>[]> in_job_;
  std::atomic<int64_t> waiting_{0};
  mutable absl::Mutex held_mu_;
  std::map<HeldId, HeldEntry> held_ ABSL_GUARDED_BY(held_mu_);
  Counter* const held_total_;
  Histogram* const held_seconds_;
  CollectorHandles handles_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_STALENESS_H_

// The scheduler's barriers: one open barrier per group (servers, workers, or
// both), released when every member of the group is in it, answered again
// when a node repeats a released request, and reported when late.
//
// Who the group's members are is the job's membership, which the scheduler
// keeps: it answers `expected` (how many a barrier of the group waits for),
// `finished` (workers that have finished: in every later barrier of the
// worker group) and `missing` (the members not in the open barrier, for
// reports). Single-threaded: the scheduler's loop owns it.
#ifndef TESSERA_SCHEDULER_BARRIERS_H_
#define TESSERA_SCHEDULER_BARRIERS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/tessera.pb.h"

namespace tessera {

// "servers", "workers" or "servers and workers".
const char* BarrierGroupName(int group);

class Barriers {
 public:
  struct Membership {
    std::function<int(int group)> expected;
    std::function<int()> finished;
    std::function<std::vector<std::string>(int group)> missing;
  };
  struct Settings {
    // A barrier is late past max(late_min, late_factor x the median of the
    // group's recent barriers), or 10 x late_min before any was released.
    absl::Duration late_min = absl::Seconds(1);
    double late_factor = 10;
  };
  // Answers a node's barrier request (OK) by its request id.
  using ReleaseFn = std::function<void(int peer, uint64_t request_id)>;

  // `released` counts every release (may be null).
  Barriers(Membership membership, Settings settings, ReleaseFn release,
           Counter* released);

  // Node `sender`, a member of `group` (checked by the caller), enters the
  // group's barrier with request `request_id`. `join_if_open`: a restarted
  // node that enters only a barrier the others have not passed yet (one
  // with `tag` already released is answered at once).
  void Enter(int sender, uint64_t request_id, int group, const std::string& tag,
             bool join_if_open, absl::Time now = absl::Now());
  // Node `id` waits in no barrier any more (it died or left).
  void Leave(int id);
  // And its released requests are forgotten too (a joiner under a freed id).
  void Forget(int id);
  // Releases every barrier whose group now has all its members in (after a
  // death or a departure shrank it).
  void ReleaseComplete(absl::Time now = absl::Now());
  // Logs the barriers that have waited past their threshold, each again
  // once its wait has doubled.
  void CheckLate(absl::Time now);
  // Whether node `id` waits in `group`'s open barrier.
  bool Waits(int group, int id) const;
  // The open barriers, for /debug/pending.
  void Fill(wire::DebugPending* out, absl::Time now) const;

 private:
  static constexpr size_t kRecent = 16;
  void Release(int group, absl::Time now);
  // Members present in `group`'s barrier (finished workers count in the
  // worker group).
  int Present(int group) const;

  const Membership membership_;
  const Settings settings_;
  const ReleaseFn release_;
  Counter* const released_;
  std::map<int, std::map<int, uint64_t>> waiting_;  // group -> id -> request
  std::map<int, uint64_t> released_request_;  // id -> its last released one
  std::map<int, std::string> tag_;            // group -> its open one's tag
  // group -> the tags of its barriers released so far (a restarted node's
  // join_if_open request for one of them is answered at once).
  std::map<int, std::set<std::string>> released_tags_;
  // By group: when its open barrier started, when it is reported again, and
  // the last kRecent durations of its barriers.
  std::map<int, absl::Time> opened_;
  std::map<int, absl::Duration> next_report_;
  std::map<int, std::deque<absl::Duration>> recent_;
};

}  // namespace tessera

#endif  // TESSERA_SCHEDULER_BARRIERS_H_

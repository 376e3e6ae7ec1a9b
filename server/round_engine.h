// SyncRound: one key's open dist_sync round on a server. Every worker
// contributes one push per round; when all have, the round's sum goes to the
// update (the optimizer, or the store itself with no optimizer) and the held
// replies go out.
//
// Each push is added on arrival (a 2-bit push decoded straight in) and its
// frame released, so a round holds one accumulator, not one push per worker:
// memory does not grow with the number of workers. By default the sum is
// exact and rounded once (ExactSum), so it is the same bits whatever order the
// pushes arrive in; the "arrival" mode adds in float32 in arrival order
// instead (half the memory, faster, not reproducible). With one worker its
// push is the sum, without an accumulator.
//
//   SyncRound round(/*num_workers=*/3, /*length=*/n);
//   if (!round.Contributed(rank))
//     TESSERA_RETURN_IF_ERROR(round.AddFloats(rank, frame, header));
//   if (round.complete()) {
//     SyncRound::Sum sum = round.Finish();     // opens the next round
//     ...update with sum.values...
//     round.Release();                         // the accumulator's memory
//     for (const wire::Header& h : round.TakeRequests()) ...reply...
//   }
//
// Thread-safety: none; owned with its key (see KVServer).
#ifndef TESSERA_SERVER_ROUND_ENGINE_H_
#define TESSERA_SERVER_ROUND_ENGINE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/buffer.h"
#include "proto/tessera.pb.h"
#include "server/exact_sum.h"

namespace tessera {

// Elastic jobs (TESSERA_ELASTIC): which worker ranks a dist_sync round waits
// for. Rounds are numbered from 0 (round() is the open one's number, the
// rounds completed).
//
// A rank that joins the job enters every slice at the same round number, so
// that it is at the same step in every key (entering each slice's round under
// way put a joiner a step ahead in one key and not in another, and workers
// that push key after key then waited for each other): it announces the
// round (EnterAt), which each slice takes when its open round is not past
// it; the slice waits for the rank from that round on, and its pushes wait
// until then (Early). A joiner that announced nothing (a slice made after
// it entered) is a member from its first push, which enters the round under
// way (Enter). A rank that leaves stays a member of the open round only if
// it pushed to it. Without elastic changes every rank is a member of every
// round.
class RoundMembers {
 public:
  static constexpr uint64_t kNoEntry = UINT64_MAX;

  explicit RoundMembers(int num_workers)
      : in_job_(num_workers, true),
        joining_(num_workers, false),
        in_round_(num_workers, true),
        enter_at_(num_workers, kNoEntry),
        members_(num_workers),
        nominal_(num_workers) {}

  void Leave(int rank, bool pushed) {
    const bool member = in_job_[rank] || joining_[rank];
    joining_[rank] = false;
    enter_at_[rank] = kNoEntry;
    in_job_[rank] = false;
    if (member && !pushed && in_round_[rank]) {
      in_round_[rank] = false;
      --members_;
    }
  }
  // `rank` joined the job: it may push, and is waited for from the round it
  // enters at (EnterAt), or from its first push.
  void Join(int rank) {
    if (in_job_[rank]) return;
    joining_[rank] = true;
    enter_at_[rank] = kNoEntry;
  }
  // A joining `rank` enters at round `at`: true when taken (the open round
  // is not past it; the open round waits for it when it is `at`), false when
  // the open round is already past it. A later call with another round
  // replaces the earlier (before the rank pushed). `pushed`: the open round
  // holds a push of the rank (its earlier holder's, who left), so it cannot
  // be entered. True for a rank already in the rounds (a resent
  // announcement), false for one out of the job.
  bool EnterAt(int rank, uint64_t at, bool pushed) {
    if (!joining_[rank]) return in_job_[rank];
    // Entries only move later: a late copy of an earlier try changes nothing.
    if (enter_at_[rank] != kNoEntry && at < enter_at_[rank]) return true;
    if (at < round_ || (at == round_ && pushed)) return false;
    if (enter_at_[rank] == round_ && at != round_ && in_round_[rank]) {
      in_round_[rank] = false;  // it announced the open round, now a later one
      --members_;
    }
    enter_at_[rank] = at;
    if (at == round_ && !in_round_[rank]) {
      in_round_[rank] = true;
      ++members_;
    }
    return true;
  }
  // A joining rank's push comes before the round it entered at: it waits.
  bool Early(int rank) const {
    return joining_[rank] && enter_at_[rank] != kNoEntry &&
           round_ < enter_at_[rank];
  }
  // `rank` pushes to the open round: a joining rank becomes a member of it
  // (and of every later round).
  void Enter(int rank) {
    if (!joining_[rank]) return;
    joining_[rank] = false;
    enter_at_[rank] = kNoEntry;
    in_job_[rank] = true;
    if (!in_round_[rank]) {
      in_round_[rank] = true;
      ++members_;
    }
  }
  // Replication: a rank's place in the slice's rounds as one number, which
  // a backup or a replacement takes from the slice's primary: out of the
  // job, in its rounds, joining without a round named, or joining at round
  // k (kEnterAtBase + k).
  static constexpr uint64_t kStateOut = 0;
  static constexpr uint64_t kStateIn = 1;
  static constexpr uint64_t kStateJoining = 2;
  static constexpr uint64_t kEnterAtBase = 3;
  uint64_t State(int rank) const {
    if (in_job_[rank]) return kStateIn;
    if (!joining_[rank]) return kStateOut;
    return enter_at_[rank] == kNoEntry ? kStateJoining
                                       : kEnterAtBase + enter_at_[rank];
  }
  // Takes a State of the primary's for the rounds from the open one on (a
  // backup's open round holds no push; a replacement's neither).
  void SetState(int rank, uint64_t state) {
    in_job_[rank] = state == kStateIn;
    joining_[rank] = state >= kStateJoining;
    enter_at_[rank] = state >= kEnterAtBase ? state - kEnterAtBase : kNoEntry;
    const bool in =
        in_job_[rank] || (joining_[rank] && enter_at_[rank] == round_);
    if (in != in_round_[rank]) {
      in_round_[rank] = in;
      members_ += in ? 1 : -1;
    }
  }
  int size() const { return static_cast<int>(in_job_.size()); }
  // Joined the job and not yet in its rounds.
  bool Joining(int rank) const { return joining_[rank]; }
  // Out of the job: left, or not joined (its pushes are refused).
  bool Out(int rank) const { return !in_job_[rank] && !joining_[rank]; }
  // Ranks the open round waits for.
  int count() const { return members_; }
  // The open round's number: rounds completed. A backup counts the rounds
  // its primary completed, a restored slice those its checkpoint holds.
  uint64_t round() const { return round_; }
  void set_round(uint64_t round) { round_ = round; }
  // The round is over: the next one's members are the ranks in the job and
  // the joiners that entered at it.
  void NextRound() {
    ++round_;
    members_ = 0;
    for (size_t r = 0; r < in_job_.size(); ++r) {
      in_round_[r] = in_job_[r] || (joining_[r] && enter_at_[r] == round_);
      members_ += in_round_[r] ? 1 : 0;
    }
  }
  // The job's own number of workers (DMLC_NUM_WORKER), which an optimizer's
  // rescale_grad is set for; a round of `pushes` is scaled by nominal / pushes
  // (1 when they are equal).
  void set_nominal(int nominal) { nominal_ = nominal; }
  float Scale(int pushes) const {
    return pushes > 0 && pushes != nominal_
               ? static_cast<float>(nominal_) / static_cast<float>(pushes)
               : 1.0f;
  }

 private:
  std::vector<bool> in_job_;
  std::vector<bool> joining_;
  std::vector<bool> in_round_;
  std::vector<uint64_t> enter_at_;  // joining ranks: the announced round
  int members_;
  int nominal_;
  uint64_t round_ = 0;
};

class SyncRound {
 public:
  enum class Mode { kExact, kArrival };
  SyncRound(int num_workers, uint64_t length, Mode mode = Mode::kExact)
      : length_(length),
        mode_(mode),
        contributed_(num_workers, false),
        members_(num_workers) {}

  // Elastic jobs (RoundMembers): `rank` left the job (it stays in the open
  // round only if it pushed to it; complete() may then hold), or joined it (a
  // member from its first push on).
  void Leave(int rank) { members_.Leave(rank, contributed_[rank]); }
  void Join(int rank) { members_.Join(rank); }
  bool EnterAt(int rank, uint64_t at) {
    return members_.EnterAt(rank, at, contributed_[rank]);
  }
  RoundMembers& members() { return members_; }
  const RoundMembers& members() const { return members_; }

  // True when `rank` has contributed to the open round.
  bool Contributed(int rank) const { return contributed_[rank]; }
  // Adds `rank`'s push to the open round; `request` is answered when the
  // round completes. `values`: length float32 values; `packed`: a 2-bit
  // payload of length values (DataLoss, nothing added, when malformed).
  // REQUIRES: !Contributed(rank).
  absl::Status AddFloats(int rank, const Buffer& values,
                         const wire::Header& request);
  absl::Status AddTwoBit(int rank, const Buffer& packed, float threshold,
                         const wire::Header& request);
  // A repeat of `sender`'s push in the open round (a restarted worker's new
  // life, or a resent copy under a new request id): the newest header is the
  // one answered.
  void ReplaceRequest(int sender, const wire::Header& request);
  // A local group's push (docs/local_groups.md): `packed` holds length int8
  // counts of `threshold` (the group's sum of 2-bit codes), added exactly as
  // that many 2-bit pushes would be. InvalidArgument (nothing added) for a
  // frame of another size. REQUIRES: !Contributed(rank), two or more workers.
  absl::Status AddCounts(int rank, const Buffer& counts, float threshold,
                         const wire::Header& request);
  // `rank`'s push of the open round came in a group mate's push (its sum
  // holds it): the rank has contributed, with no request of its own to
  // answer. REQUIRES: !Contributed(rank).
  void Cover(int rank) {
    if (contributed_[rank]) return;  // counted once, however often named
    contributed_[rank] = true;
    ++count_;
  }

  int count() const { return count_; }
  // Every member of the round has pushed (a round with no push is never
  // complete, even when every worker left).
  bool complete() const { return count_ > 0 && count_ >= members_.count(); }

  struct Sum {
    const float* values = nullptr;  // length floats
    // With one worker, the push itself (values points into it): the store may
    // keep it instead of copying. Empty otherwise (values is the
    // accumulator's, valid until the next Add).
    Buffer push;
    // Finish(true) of a round of 2-bit pushes whose counts fit int8: one
    // count per value (the value is CountsToFloats of it and `threshold`).
    Buffer counts;
    float threshold = 0;
  };
  // The round's sum; the round is open again, empty. REQUIRES: complete().
  // `want_counts`: also the counts, when the round counted 2-bit pushes.
  // `rescale`: a round of m pushes in a job of n workers (DMLC_NUM_WORKER,
  // RoundMembers::set_nominal; workers left or joined an elastic job) gives
  // its sum times n / m (the rounded sum multiplied in float32, no counts),
  // so that an optimizer's rescale_grad set for n workers still takes the
  // mean.
  Sum Finish(bool want_counts = false, bool rescale = false);
  // The requests to answer, in the order they arrived.
  std::vector<wire::Header> TakeRequests();

  // Gives the accumulator's memory back once the sum Finish returned has been
  // used, so that a server holds accumulators only for its open rounds (at
  // most the slices in flight), not for every slice of every key.
  void Release();

  // Bytes the round holds now (the accumulator).
  uint64_t bytes() const {
    return sum_ != nullptr ? sum_->bytes() : arrival_.size();
  }

 private:
  void Contribute(int rank, const wire::Header& request);

  const uint64_t length_;
  const Mode mode_;
  std::vector<bool> contributed_;
  RoundMembers members_;
  std::vector<wire::Header> requests_;
  int count_ = 0;
  Buffer scaled_;                  // Finish(_, true) of a partial round
  std::unique_ptr<ExactSum> sum_;  // two or more workers
  Buffer arrival_;                 // Mode::kArrival: the float32 sum so far
  Buffer single_;                  // one worker: its push
};

// RowRound: the open dist_sync round of a row-sparse key slice. Each worker
// contributes one push of some rows (any number, ids repeating or not); the
// round's sum holds only the rows some push touched, each summed as
// SyncRound sums (exact, rounded once, unless Mode::kArrival).
//
//   RowRound round(/*num_workers=*/3, /*row_length=*/1024);
//   round.Add(rank, local_rows, num_rows, values, header);  // rows relative
//   if (round.complete()) {
//     RowRound::Sum sum = round.Finish();   // sum.rows[i] -> sum.values + i*L
//   }
class RowRound {
 public:
  RowRound(int num_workers, uint64_t row_length,
           SyncRound::Mode mode = SyncRound::Mode::kExact)
      : row_length_(row_length),
        mode_(mode),
        contributed_(num_workers, false),
        members_(num_workers),
        exact_(0) {}

  // As SyncRound's.
  void Leave(int rank) { members_.Leave(rank, contributed_[rank]); }
  void Join(int rank) { members_.Join(rank); }
  bool EnterAt(int rank, uint64_t at) {
    return members_.EnterAt(rank, at, contributed_[rank]);
  }
  RoundMembers& members() { return members_; }
  const RoundMembers& members() const { return members_; }

  bool Contributed(int rank) const { return contributed_[rank]; }
  // Adds `rank`'s push: `count` rows (ids relative to the slice) whose
  // values follow one another in `values`. REQUIRES: !Contributed(rank).
  void Add(int rank, const uint64_t* rows, size_t count, const float* values,
           const wire::Header& request);
  // The same, from a push the round may keep: with one worker and ids in
  // strictly increasing order the push is the round's sum as it is (no
  // accumulator, no copy); otherwise as Add. `parts` hold the rows' values
  // one after another, each part whole rows (a push's frames).
  void Add(int rank, std::vector<uint64_t> rows, std::vector<Buffer> parts,
           const wire::Header& request);
  // Adds `rank`'s 2-bit push of rows.size() rows: `packed` codes their
  // values one row after another (MXNet's format, `threshold`), counted
  // straight into the sum (ExactSum::AddTwoBitAt) without decoding them to
  // floats first. DataLoss (nothing added) when the payload does not decode.
  absl::Status AddTwoBit(int rank, std::vector<uint64_t> rows,
                         const Buffer& packed, float threshold,
                         const wire::Header& request);
  void ReplaceRequest(int sender, const wire::Header& request);
  int count() const { return count_; }
  bool complete() const { return count_ > 0 && count_ >= members_.count(); }
  struct Sum {
    std::vector<uint64_t> rows;  // the rows some push touched
    // Row i's row_length values: values + i x row_length (valid until the
    // next Add), or, for one worker's push kept whole, row_values[i], which
    // point into `push` (valid while it lives).
    const float* values = nullptr;
    std::vector<const float*> row_values;
    std::vector<Buffer> push;
    const float* row(size_t i, uint64_t row_length) const {
      return row_values.empty() ? values + i * row_length : row_values[i];
    }
  };
  // The round's sum; the round is open again, empty. REQUIRES: complete().
  // `rescale` as SyncRound::Finish's.
  Sum Finish(bool rescale = false);
  std::vector<wire::Header> TakeRequests();

 private:
  // Adds count rows (ids relative to the slice) to the sum.
  void AddRows(const uint64_t* rows, size_t count, const float* values);
  void Contribute(int rank, const wire::Header& request);

  const uint64_t row_length_;
  const SyncRound::Mode mode_;
  std::vector<bool> contributed_;
  RoundMembers members_;
  std::vector<wire::Header> requests_;
  int count_ = 0;
  absl::flat_hash_map<uint64_t, uint64_t> slot_;  // row -> slot
  std::vector<uint64_t> rows_;                    // slot -> row
  ExactSum exact_;                                // Mode::kExact
  std::vector<float> arrival_;                    // Mode::kArrival
  std::vector<float> scratch_;                    // the last Finish's values
  // One worker: its push, kept as the sum (rows_ holds its ids).
  std::vector<Buffer> single_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_ROUND_ENGINE_H_

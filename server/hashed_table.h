// HashedTable: the rows of one hashed row key on one server (issue #29): ids
// are arbitrary 64-bit values, rows exist only for ids that were admitted, and
// the table holds at most `capacity` of them.
//
//   HashedTable t(/*row_length=*/16, spec);
//   t.Read(id, out);                       // its row, or its initial row
//   t.ApplyRound(ids, sightings, grad, optimizer.get());
//
// A round (a dist_sync round's sum, or one dist_async push) is applied in one
// deterministic order, whatever order its pushes arrived in:
//   1. every id that has a row is touched: its row is now the most recently
//      pushed (ids in increasing order);
//   2. the other ids are counted in the admission sketch (a count-min sketch,
//      4 x 2^20 16-bit counters, conservative update: it never counts an id
//      short; collisions can count it early; every count halves after
//      10 x 2^20 sightings, TinyLFU's aging), by the number of pushes that
//      named them; an id whose count reaches admit_after is admitted, the rest
//      are dropped (their gradients are not applied; counted in `dropped`);
//   3. rows last pushed expire_after or more rounds ago are evicted (counted
//      in `expired`): a row pushed in round r and not after is gone at the end
//      of round r + expire_after;
//   4. admitted ids get rows, in increasing order: at capacity the least
//      recently pushed row is evicted first (counted in `evicted`), unless it
//      was pushed in this round, when the id is refused (`refused`);
//   5. every id with a row is updated: the optimizer on its gradient (rows and
//      their optimizer state start as the initializer and zeros), or, with no
//      optimizer, the row becomes the round's sum.
// Pulls never create rows: an id without one reads its initial row, the row
// it would be created with.
//
// Memory: per row its floats (and the optimizer's state), plus 55-70 bytes
// (id, last round, LRU links, index entry); the sketch, only when
// admit_after > 1, 8 MiB.
//
// Thread-safety: none; owned by its key's engine.
#ifndef TESSERA_SERVER_HASHED_TABLE_H_
#define TESSERA_SERVER_HASHED_TABLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/hashed_spec.h"
#include "proto/tessera.pb.h"
#include "server/optimizer.h"

namespace tessera {

class HashedTable {
 public:
  HashedTable(uint64_t row_length, const HashedSpec& spec);

  struct Counts {
    uint64_t admitted = 0;  // rows created
    uint64_t evicted = 0;   // rows evicted to make room (capacity)
    uint64_t expired = 0;   // rows evicted for age (expire_after)
    uint64_t refused = 0;   // admitted ids left without a row (at capacity)
    uint64_t dropped = 0;   // pushed ids not admitted yet
  };
  const Counts& counts() const { return counts_; }
  uint64_t rows() const { return index_.size(); }
  uint64_t round() const { return round_; }
  uint64_t row_length() const { return row_length_; }
  const HashedSpec& spec() const { return spec_; }
  bool Has(uint64_t id) const { return index_.contains(id); }

  // Writes id's row, or its initial row when it has none (row_length floats).
  void Read(uint64_t id, float* out) const;

  // Applies one round: ids[i] (distinct) with gradient grad(i), named by
  // sightings[i] pushes; `step` is the optimizer's t. `optimizer` null: rows
  // become the sums.
  void ApplyRound(const std::vector<uint64_t>& ids,
                  const std::vector<uint32_t>& sightings,
                  const std::function<const float*(size_t)>& grad,
                  const Optimizer* optimizer, uint64_t step);

  // The table as a checkpoint holds it (rows in recency order, the sketch,
  // the counts), and back. Restore: DataLoss when it does not fit this
  // table's row length and spec.
  void Snapshot(wire::HashedState* out) const;
  absl::Status Restore(const wire::HashedState& in);

  // Bytes held: rows, optimizer state, per-row metadata, index, sketch.
  uint64_t bytes() const;

  // The admission sketch's count of an id (tests).
  uint32_t SketchCount(uint64_t id) const;

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  static constexpr uint64_t kChunkRows = 256;
  // Optimizer states per row a checkpoint may hold (Adam keeps 2).
  static constexpr int kMaxStateSlots = 8;

  float* RowAt(uint32_t slot) const;
  float* StateAt(int k, uint32_t slot);
  uint32_t NewSlot();
  void Unlink(uint32_t slot);
  void PushFront(uint32_t slot);
  void Evict(uint32_t slot);
  void AddSightings(uint64_t id, uint32_t n);
  // ApplyRound's steps (the numbers of the header's list), in round_.
  // 1, 2: the ids with rows (`order`: ids' indexes by increasing id) are
  // touched and go to `update` with their slots; the others are counted, and
  // those admitted go to `admitted`.
  void TouchOrAdmit(const std::vector<uint64_t>& ids,
                    const std::vector<uint32_t>& sightings,
                    const std::vector<size_t>& order,
                    std::vector<size_t>* admitted,
                    std::vector<std::pair<size_t, uint32_t>>* update);
  // 3: rows last pushed expire_after or more rounds ago are evicted.
  void Expire();
  // 4: the `admitted` ids get rows (added to `update`), or are refused.
  void AddRows(const std::vector<uint64_t>& ids,
               const std::vector<size_t>& admitted,
               std::vector<std::pair<size_t, uint32_t>>* update);
  // 5: each (index, slot) of `update` is updated with grad(index).
  void UpdateRows(const std::vector<std::pair<size_t, uint32_t>>& update,
                  const std::function<const float*(size_t)>& grad,
                  const Optimizer* optimizer, uint64_t step);
  size_t SketchIndex(int row, uint64_t id) const;

  const uint64_t row_length_;
  const HashedSpec spec_;
  uint64_t round_ = 0;
  Counts counts_;
  absl::flat_hash_map<uint64_t, uint32_t> index_;  // id -> slot
  // Per slot: its id, the round it was last pushed in, LRU links (head: the
  // most recent).
  std::vector<uint64_t> id_;
  std::vector<uint64_t> last_round_;
  std::vector<uint32_t> prev_, next_;
  std::vector<uint32_t> free_;
  uint32_t head_ = kNone, tail_ = kNone;
  std::vector<std::unique_ptr<float[]>> chunks_;  // kChunkRows rows each
  // Optimizer state: state_[k][chunk], allocated when first needed.
  std::vector<std::vector<std::unique_ptr<float[]>>> state_;
  uint64_t sketch_width_ = 0;     // 0: no sketch (admit_after 1)
  std::vector<uint16_t> sketch_;  // 4 x sketch_width_
  uint64_t sketch_added_ = 0;     // sightings since the counts last halved
};

}  // namespace tessera

#endif  // TESSERA_SERVER_HASHED_TABLE_H_

#include "server/hashed_table.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/split_mix.h"

namespace tessera {
namespace {

constexpr int kSketchRows = 4;

// 2^20 counters a row: 8 MiB for the four rows, whatever the capacity (the ids
// it counts are the ones without rows, which a capacity does not bound).
uint64_t SketchWidth(const HashedSpec& spec) {
  return spec.admit_after <= 1 ? 0 : uint64_t{1} << 20;
}

}  // namespace

HashedTable::HashedTable(uint64_t row_length, const HashedSpec& spec)
    : row_length_(row_length),
      spec_(spec),
      sketch_width_(SketchWidth(spec)),
      sketch_(kSketchRows * sketch_width_, 0) {}

float* HashedTable::RowAt(uint32_t slot) const {
  return chunks_[slot / kChunkRows].get() + (slot % kChunkRows) * row_length_;
}

float* HashedTable::StateAt(int k, uint32_t slot) {
  auto& chunks = state_[k];
  const size_t c = slot / kChunkRows;
  while (chunks.size() <= c)
    chunks.push_back(std::make_unique<float[]>(kChunkRows * row_length_));
  return chunks[c].get() + (slot % kChunkRows) * row_length_;
}

uint32_t HashedTable::NewSlot() {
  if (!free_.empty()) {
    const uint32_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  const uint32_t slot = static_cast<uint32_t>(id_.size());
  id_.push_back(0);
  last_round_.push_back(0);
  prev_.push_back(kNone);
  next_.push_back(kNone);
  if (slot / kChunkRows >= chunks_.size())
    chunks_.push_back(std::make_unique<float[]>(kChunkRows * row_length_));
  return slot;
}

void HashedTable::Unlink(uint32_t slot) {
  if (prev_[slot] != kNone) {
    next_[prev_[slot]] = next_[slot];
  } else {
    head_ = next_[slot];
  }
  if (next_[slot] != kNone) {
    prev_[next_[slot]] = prev_[slot];
  } else {
    tail_ = prev_[slot];
  }
  prev_[slot] = next_[slot] = kNone;
}

void HashedTable::PushFront(uint32_t slot) {
  prev_[slot] = kNone;
  next_[slot] = head_;
  if (head_ != kNone) prev_[head_] = slot;
  head_ = slot;
  if (tail_ == kNone) tail_ = slot;
}

void HashedTable::Evict(uint32_t slot) {
  Unlink(slot);
  index_.erase(id_[slot]);
  free_.push_back(slot);
}

size_t HashedTable::SketchIndex(int row, uint64_t id) const {
  const uint64_t h = SplitMix64(id ^ (0x9e3779b97f4a7c15ULL * (row + 1)));
  return static_cast<size_t>(row) * sketch_width_ + (h & (sketch_width_ - 1));
}

uint32_t HashedTable::SketchCount(uint64_t id) const {
  if (sketch_width_ == 0) return 0;
  uint32_t m = UINT32_MAX;
  for (int r = 0; r < kSketchRows; ++r)
    m = std::min<uint32_t>(m, sketch_[SketchIndex(r, id)]);
  return m;
}

void HashedTable::AddSightings(uint64_t id, uint32_t n) {
  // Conservative update: only the counters at the minimum grow, to it + n.
  const uint32_t target = std::min<uint32_t>(SketchCount(id) + n, 65535);
  for (int r = 0; r < kSketchRows; ++r) {
    uint16_t& c = sketch_[SketchIndex(r, id)];
    c = static_cast<uint16_t>(std::max<uint32_t>(c, target));
  }
  // Aging (TinyLFU's reset): after 10 x width sightings every count halves,
  // so that ids seen once long ago do not fill the sketch and let any new id
  // in: an id must gather its admit_after pushes within about that window.
  sketch_added_ += n;
  if (sketch_added_ >= 10 * sketch_width_) {
    for (uint16_t& c : sketch_) c = static_cast<uint16_t>(c >> 1);
    sketch_added_ = 0;
  }
}

void HashedTable::Read(uint64_t id, float* out) const {
  auto it = index_.find(id);
  if (it != index_.end()) {
    std::memcpy(out, RowAt(it->second), row_length_ * sizeof(float));
    return;
  }
  for (uint64_t j = 0; j < row_length_; ++j) out[j] = spec_.InitialValue(id, j);
}

void HashedTable::ApplyRound(const std::vector<uint64_t>& ids,
                             const std::vector<uint32_t>& sightings,
                             const std::function<const float*(size_t)>& grad,
                             const Optimizer* optimizer, uint64_t step) {
  ++round_;
  std::vector<size_t> order(ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&ids](size_t a, size_t b) { return ids[a] < ids[b]; });
  std::vector<size_t> admitted;  // indexes into ids, increasing id
  std::vector<std::pair<size_t, uint32_t>> update;  // (index, slot)
  TouchOrAdmit(ids, sightings, order, &admitted, &update);
  Expire();
  AddRows(ids, admitted, &update);
  UpdateRows(update, grad, optimizer, step);
}

void HashedTable::TouchOrAdmit(
    const std::vector<uint64_t>& ids, const std::vector<uint32_t>& sightings,
    const std::vector<size_t>& order, std::vector<size_t>* admitted,
    std::vector<std::pair<size_t, uint32_t>>* update) {
  const uint64_t r = round_;
  // 1, 2: touch the rows there are; count the others, admit or drop them.
  for (size_t i : order) {
    auto it = index_.find(ids[i]);
    if (it != index_.end()) {
      Unlink(it->second);
      PushFront(it->second);
      last_round_[it->second] = r;
      update->emplace_back(i, it->second);
      continue;
    }
    bool admit = spec_.admit_after <= 1;
    if (!admit) {
      AddSightings(ids[i], sightings[i]);
      admit = SketchCount(ids[i]) >= spec_.admit_after;
    }
    if (admit) {
      admitted->push_back(i);
    } else {
      ++counts_.dropped;
    }
  }
}

void HashedTable::Expire() {
  const uint64_t r = round_;
  // 3: expire.
  if (spec_.expire_after > 0) {
    // r - last >= expire_after (last <= r: no overflow for a huge value).
    while (tail_ != kNone && r - last_round_[tail_] >= spec_.expire_after) {
      Evict(tail_);
      ++counts_.expired;
    }
  }
}

void HashedTable::AddRows(const std::vector<uint64_t>& ids,
                          const std::vector<size_t>& admitted,
                          std::vector<std::pair<size_t, uint32_t>>* update) {
  const uint64_t r = round_;
  // 4: new rows, at capacity in place of the least recently pushed.
  for (size_t i : admitted) {
    if (spec_.capacity != 0 && index_.size() >= spec_.capacity) {
      if (tail_ == kNone || last_round_[tail_] == r) {
        ++counts_.refused;
        continue;
      }
      Evict(tail_);
      ++counts_.evicted;
    }
    const uint32_t slot = NewSlot();
    id_[slot] = ids[i];
    last_round_[slot] = r;
    index_.emplace(ids[i], slot);
    PushFront(slot);
    float* row = RowAt(slot);
    for (uint64_t j = 0; j < row_length_; ++j)
      row[j] = spec_.InitialValue(ids[i], j);
    for (size_t k = 0; k < state_.size(); ++k)
      std::memset(StateAt(static_cast<int>(k), slot), 0,
                  row_length_ * sizeof(float));
    ++counts_.admitted;
    update->emplace_back(i, slot);
  }
}

void HashedTable::UpdateRows(
    const std::vector<std::pair<size_t, uint32_t>>& update,
    const std::function<const float*(size_t)>& grad, const Optimizer* optimizer,
    uint64_t step) {
  // 5: the update.
  const int slots = optimizer == nullptr ? 0 : optimizer->state_slots();
  if (static_cast<int>(state_.size()) < slots) {
    // The optimizer's state appears: zeros for every row there is.
    const size_t before = state_.size();
    state_.resize(slots);
    for (size_t k = before; k < state_.size(); ++k) {
      for (size_t c = 0; c < chunks_.size(); ++c)
        state_[k].push_back(
            std::make_unique<float[]>(kChunkRows * row_length_));
    }
  }
  std::vector<float*> state(slots);
  for (const auto& [i, slot] : update) {
    float* row = RowAt(slot);
    if (optimizer == nullptr) {
      std::memcpy(row, grad(i), row_length_ * sizeof(float));
      continue;
    }
    for (int k = 0; k < slots; ++k) state[k] = StateAt(k, slot);
    optimizer->Update(row, grad(i), row_length_, state.data(), step);
  }
}

void HashedTable::Snapshot(wire::HashedState* out) const {
  out->set_spec(spec_.ToString());
  out->set_row_length(row_length_);
  out->set_round(round_);
  // Rows from the least to the most recently pushed: Restore pushes each to
  // the front, rebuilding the same order.
  std::string rows;
  rows.reserve(index_.size() * row_length_ * sizeof(float));
  std::vector<std::string> state(state_.size());
  for (uint32_t slot = tail_; slot != kNone; slot = prev_[slot]) {
    out->add_ids(id_[slot]);
    out->add_last_round(last_round_[slot]);
    rows.append(reinterpret_cast<const char*>(RowAt(slot)),
                row_length_ * sizeof(float));
    for (size_t k = 0; k < state_.size(); ++k) {
      const float* s = state_[k][slot / kChunkRows].get() +
                       (slot % kChunkRows) * row_length_;
      state[k].append(reinterpret_cast<const char*>(s),
                      row_length_ * sizeof(float));
    }
  }
  out->set_rows(std::move(rows));
  for (std::string& s : state) out->add_optimizer_state(std::move(s));
  out->set_sketch(reinterpret_cast<const char*>(sketch_.data()),
                  sketch_.size() * sizeof(uint16_t));
  out->set_sketch_added(sketch_added_);
  out->set_admitted(counts_.admitted);
  out->set_evicted(counts_.evicted);
  out->set_expired(counts_.expired);
  out->set_refused(counts_.refused);
  out->set_dropped(counts_.dropped);
}

absl::Status HashedTable::Restore(const wire::HashedState& in) {
  const uint64_t n = static_cast<uint64_t>(in.ids_size());
  const uint64_t row_bytes = row_length_ * sizeof(float);
  if (in.row_length() != row_length_ || in.spec() != spec_.ToString() ||
      static_cast<uint64_t>(in.last_round_size()) != n ||
      in.rows().size() != n * row_bytes ||
      in.sketch().size() != sketch_.size() * sizeof(uint16_t)) {
    return absl::DataLossError(absl::StrCat(
        "hashed key checkpoint does not match: ", n, " ids, ", in.rows().size(),
        " row bytes, rows of ", in.row_length(), " (want ", row_length_,
        "), spec '", in.spec(), "' (want '", spec_.ToString(), "')"));
  }
  for (const std::string& s : in.optimizer_state()) {
    if (s.size() != n * row_bytes)
      return absl::DataLossError("hashed key checkpoint: optimizer state size");
  }
  // A checkpoint or a transfer comes from another process (a server of the
  // job, or a file): checked whole before anything is replaced.
  if (spec_.capacity != 0 && n > spec_.capacity) {
    return absl::DataLossError(
        absl::StrCat("hashed key checkpoint holds ", n,
                     " rows, more than its capacity=", spec_.capacity));
  }
  if (in.optimizer_state_size() > kMaxStateSlots) {
    return absl::DataLossError(
        absl::StrCat("hashed key checkpoint holds ", in.optimizer_state_size(),
                     " optimizer states per row; an optimizer keeps at most ",
                     kMaxStateSlots));
  }
  {
    absl::flat_hash_set<uint64_t> seen;
    seen.reserve(n);
    for (uint64_t id : in.ids()) {
      if (!seen.insert(id).second) {
        return absl::DataLossError(
            absl::StrCat("hashed key checkpoint holds id ", id, " twice"));
      }
    }
  }
  // Start from an empty table of the same shape.
  index_.clear();
  id_.clear();
  last_round_.clear();
  prev_.clear();
  next_.clear();
  free_.clear();
  chunks_.clear();
  state_.clear();
  head_ = tail_ = kNone;
  counts_ = Counts();
  round_ = in.round();
  state_.resize(in.optimizer_state_size());
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t slot = NewSlot();
    id_[slot] = in.ids(i);
    last_round_[slot] = in.last_round(i);
    index_.emplace(in.ids(i), slot);
    PushFront(slot);
    std::memcpy(RowAt(slot), in.rows().data() + i * row_bytes, row_bytes);
    for (int k = 0; k < in.optimizer_state_size(); ++k) {
      std::memcpy(StateAt(k, slot),
                  in.optimizer_state(k).data() + i * row_bytes, row_bytes);
    }
  }
  if (!sketch_.empty())
    std::memcpy(sketch_.data(), in.sketch().data(), in.sketch().size());
  sketch_added_ = in.sketch_added();
  counts_.admitted = in.admitted();
  counts_.evicted = in.evicted();
  counts_.expired = in.expired();
  counts_.refused = in.refused();
  counts_.dropped = in.dropped();
  return absl::OkStatus();
}

uint64_t HashedTable::bytes() const {
  uint64_t chunk_bytes = kChunkRows * row_length_ * sizeof(float);
  uint64_t b = chunks_.size() * chunk_bytes;
  for (const auto& k : state_) b += k.size() * chunk_bytes;
  b += id_.capacity() * (sizeof(uint64_t) * 2 + sizeof(uint32_t) * 2);
  b += free_.capacity() * sizeof(uint32_t);
  b += index_.capacity() * (sizeof(std::pair<uint64_t, uint32_t>) + 1);
  b += sketch_.size() * sizeof(uint16_t);
  return b;
}

}  // namespace tessera

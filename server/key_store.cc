#include "server/key_store.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tessera {

StoredKey::StoredKey(const wire::KeySlice& slice, bool sync, int num_workers,
                     WaitingLimits limits, SyncRound::Mode sum_mode)
    : key(slice.key()),
      offset(slice.offset()),
      length(slice.length() *
             (slice.row_length() == 0 ? 1 : slice.row_length())),
      total_length(slice.total_length()),
      row_length(slice.row_length()),
      hashed_spec(slice.hashed_spec()),
      sync(sync),
      ledger(num_workers),
      waiting(limits),
      engine(MakeSliceEngine(*this, num_workers, sum_mode)) {}

absl::Status StoredKey::CheckSlice(const wire::KeySlice& slice) const {
  if (slice.row_length() != row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", slice.key(), " is ", row_length == 0 ? "dense" : "row-sparse",
        row_length == 0 ? "" : absl::StrCat(" (rows of ", row_length, ")"),
        ": a ", slice.row_length() == 0 ? "dense" : "row",
        " call cannot use it"));
  }
  const uint64_t held = row_length == 0 ? length : rows();
  if (slice.offset() == offset && slice.length() == held &&
      slice.total_length() == total_length) {
    return absl::OkStatus();
  }
  const char* unit = row_length == 0 ? "elements" : "rows";
  return absl::InvalidArgumentError(absl::StrCat(
      "key ", slice.key(), ": request for ", unit, " [", slice.offset(), ", +",
      slice.length(), ") of ", slice.total_length(), " but this server holds [",
      offset, ", +", held, ") of ", total_length));
}

void StoredKey::ApplyUpdate(const Optimizer& optimizer, const float* grad) {
  if (!weights.unique())
    weights = Buffer::CopyOf(weights.data(), weights.size());
  const int slots = optimizer.state_slots();
  if (static_cast<int>(optimizer_state.size()) != slots)
    optimizer_state.assign(slots, std::vector<float>(length, 0.0f));
  std::vector<float*> state;
  for (auto& v : optimizer_state) state.push_back(v.data());
  optimizer.Update(weights.mutable_floats(), grad, length, state.data(),
                   ++steps);
  WeightsChanged();
}

void StoredKey::ApplyRowUpdates(const Optimizer& optimizer,
                                const std::vector<uint64_t>& rows,
                                const float* grad) {
  const uint64_t l = row_length;
  ApplyRowUpdates(optimizer, rows,
                  [grad, l](size_t i) { return grad + i * l; });
}

void StoredKey::ApplyRowUpdates(
    const Optimizer& optimizer, const std::vector<uint64_t>& rows,
    const std::function<const float*(size_t)>& row_grad) {
  if (rows.empty()) return;
  if (!weights.unique())
    weights = Buffer::CopyOf(weights.data(), weights.size());
  const int slots = optimizer.state_slots();
  if (static_cast<int>(optimizer_state.size()) != slots)
    optimizer_state.assign(slots, std::vector<float>(length, 0.0f));
  const uint64_t step = ++steps;
  std::vector<float*> state(slots);
  float* w = weights.mutable_floats();
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint64_t at = rows[i] * row_length;
    for (int k = 0; k < slots; ++k) state[k] = optimizer_state[k].data() + at;
    optimizer.Update(w + at, row_grad(i), row_length, state.data(), step);
  }
  WeightsChanged();
}

void StoredKey::Snapshot(wire::CheckpointKey* out) const {
  out->set_key(key);
  out->set_offset(offset);
  out->set_length(row_length == 0 ? length : rows());
  out->set_total_length(total_length);
  out->set_sync_mode(sync);
  out->set_weights(weights.data(), weights.size());
  for (const std::vector<float>& slot : optimizer_state)
    out->add_optimizer_state(slot.data(), slot.size() * sizeof(float));
  out->set_steps(steps);
  out->set_row_length(row_length);
  out->set_replica(replica);
  out->set_replica_seq(replica_seq);
  for (int r = 0; r < ledger.num_workers(); ++r) {
    const bool open = sync && engine->Contributed(r);
    out->add_received(ledger.received(r) - (open ? 1 : 0));
  }
  if (sync) out->set_rounds(engine->RoundNumber());
  if (ssp != nullptr) {
    out->set_bounded_staleness(true);
    out->set_staleness(ssp->staleness());
  }
  engine->Snapshot(out);
}

StoredKey* KeyStore::Find(uint64_t key, uint64_t offset) {
  auto it = keys_.find({key, offset});
  return it == keys_.end() ? nullptr : it->second.get();
}

StoredKey* KeyStore::Find(const wire::KeySlice& slice) {
  return Find(slice.key(), slice.offset());
}

StoredKey* KeyStore::Create(const wire::KeySlice& slice, bool sync) {
  auto& slot = keys_[{slice.key(), slice.offset()}];
  slot = std::make_unique<StoredKey>(slice, sync, num_workers_, limits_,
                                     sum_mode_);
  if (nominal_ != 0) slot->engine->SetNominal(nominal_);
  for (int r = 0; r < static_cast<int>(left_.size()); ++r) {
    if (left_[r] || joined_[r]) slot->engine->Leave(r);
    // A joiner is waited for from its first push to the slice on, whenever
    // the slice was made.
    if (joined_[r]) slot->engine->Join(r);
  }
  return slot.get();
}

void KeyStore::SetElastic(int nominal) {
  nominal_ = nominal;
  for (int r = nominal; r < num_workers_; ++r) left_[r] = true;
  for (auto& [id, key] : keys_) {
    key->engine->SetNominal(nominal);
    for (int r = nominal; r < num_workers_; ++r) key->engine->Leave(r);
  }
}

void KeyStore::WorkerJoined(int rank) {
  if (rank < 0 || rank >= num_workers_) return;
  left_[rank] = false;
  joined_[rank] = true;
  for (auto& [id, key] : keys_) key->engine->Join(rank);
}

void KeyStore::WorkerLeft(int rank) {
  if (rank < 0 || rank >= num_workers_) return;
  left_[rank] = true;
  joined_[rank] = false;
  for (auto& [id, key] : keys_) key->engine->Leave(rank);
}

bool KeyStore::IsFirstSlice(const StoredKey& key) const {
  auto it = keys_.lower_bound({key.key, 0});
  return it != keys_.end() && it->second.get() == &key;
}

bool KeyStore::IsFirstSlice(
    const StoredKey& key,
    const std::function<bool(const StoredKey&)>& counts) const {
  for (auto it = keys_.lower_bound({key.key, 0});
       it != keys_.end() && it->first.first == key.key; ++it) {
    if (it->second.get() == &key) return true;
    if (counts(*it->second)) return false;
  }
  return false;
}

absl::Status KeyStore::Restore(const wire::CheckpointKey& k) {
  // A checkpoint file or a peer's state transfer: sizes checked without
  // overflow before anything is taken from it.
  const uint64_t per_row = k.row_length() == 0 ? 1 : k.row_length();
  if (k.length() >
      (std::numeric_limits<uint64_t>::max() / sizeof(float)) / per_row) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of key ", k.key(), ": ", k.length(), " x ",
                     per_row, " values is more than this machine can address"));
  }
  const uint64_t values = k.length() * per_row;
  if (!k.has_hashed() && (k.offset() > k.total_length() ||
                          k.length() > k.total_length() - k.offset())) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of key ", k.key(), ": slice ", k.offset(), "+",
                     k.length(), " outside its array of ", k.total_length()));
  }
  if (k.weights().size() != values * sizeof(float) ||
      k.received_size() != num_workers_) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint of key ", k.key(), " does not match: ", k.weights().size(),
        " weight bytes for ", k.length(), " values, ", k.received_size(),
        " worker counts for ", num_workers_,
        " workers (was the job's DMLC_NUM_WORKER changed?)"));
  }
  std::vector<std::vector<float>> state;
  for (const std::string& slot : k.optimizer_state()) {
    if (slot.size() != values * sizeof(float)) {
      return absl::DataLossError(
          absl::StrCat("checkpoint of key ", k.key(), ": optimizer state of ",
                       slot.size(), " bytes for ", values, " values"));
    }
    std::vector<float> v(values);
    std::memcpy(v.data(), slot.data(), slot.size());
    state.push_back(std::move(v));
  }
  wire::KeySlice slice;
  slice.set_key(k.key());
  slice.set_offset(k.offset());
  slice.set_length(k.length());
  slice.set_total_length(k.total_length());
  slice.set_row_length(k.row_length());
  if (k.has_hashed()) slice.set_hashed_spec(k.hashed().spec());
  StoredKey* key = Create(slice, k.sync_mode());
  key->weights = Buffer::CopyOf(k.weights().data(), k.weights().size());
  key->optimizer_state = std::move(state);
  key->steps = k.steps();
  key->replica = k.replica();
  key->replica_seq = k.replica_seq();
  for (int r = 0; r < num_workers_; ++r) key->ledger.Restore(r, k.received(r));
  if (k.sync_mode()) key->engine->SetRoundNumber(k.rounds());
  if (k.bounded_staleness())
    key->ssp = std::make_unique<StalenessGate>(k.staleness());
  return key->engine->Restore(k);
}

absl::Status KeyStore::HoldOrphan(const wire::KeySlice& slice, Message& msg,
                                  bool* duplicate) {
  WaitingMessages& held =
      orphans_.try_emplace({slice.key(), slice.offset()}, limits_)
          .first->second;
  *duplicate = held.Holds(msg.header.sender(), msg.header.request_id(),
                          msg.header.generation());
  if (*duplicate) return absl::OkStatus();
  return held.Hold(slice.key(), msg);
}

bool KeyStore::HoldsOrphan(const wire::KeySlice& slice, int sender,
                           uint64_t request_id, uint64_t generation) const {
  auto it = orphans_.find({slice.key(), slice.offset()});
  return it != orphans_.end() &&
         it->second.Holds(sender, request_id, generation);
}

void KeyStore::AdoptOrphans(StoredKey* key) {
  auto it = orphans_.find({key->key, key->offset});
  if (it == orphans_.end()) return;
  key->waiting = std::move(it->second);
  orphans_.erase(it);
  key->progress = true;
}

}  // namespace tessera

// KVClient's key inits and resumes (see worker/client/kv_client_internal.h
// for the rooms): a dense, row-sparse or hashed key's init on every server
// of its slices' chains, and a restarted or joining worker's re-entry into
// the rounds (how many pushes each server holds of it).
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/logging.h"
#include "common/send_order.h"
#include "common/status_macros.h"
#include "worker/client/kv_client.h"
#include "worker/client/kv_client_internal.h"

namespace tessera {

using client_internal::InitBarrier;
using client_internal::kRowSliceChunks;
using client_internal::PushWindow;

absl::Status KVClient::Init(uint64_t key, absl::Span<const float> value) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", key, ": empty value"));
  }
  return InitKey(
      key, value.data(), value.size(), /*row_length=*/0,
      KeyPartitioner::Chunk(partitioner_.Partition(key, value.size()),
                            DenseChunk(value.size())));
}

absl::Status KVClient::InitRows(uint64_t key, const float* value,
                                uint64_t num_rows, uint64_t row_length) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (num_rows == 0 || row_length == 0 ||
      num_rows > (uint64_t{1} << 40) / row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init of row-sparse key ", key, ": ", num_rows, " rows of ", row_length,
        " values; expected at least one row and one value"));
  }
  // Split by rows, so every server holds whole rows, and each server's part
  // in slices of whole rows (kRowSliceChunks); a push or pull carries only the
  // rows it names, to each slice (a push: to every slice, which counts it
  // toward its round even without rows).
  const uint64_t slice_rows = std::max<uint64_t>(
      1, kRowSliceChunks * static_cast<uint64_t>(options_.chunk_bytes) /
             (row_length * sizeof(float)));
  return InitKey(
      key, value, num_rows * row_length, row_length,
      KeyPartitioner::Chunk(
          partitioner_.PartitionRows(key, num_rows, row_length), slice_rows));
}

absl::Status KVClient::InitHashed(uint64_t key, uint64_t row_length,
                                  const std::string& options) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (row_length == 0 || row_length > (uint64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of hashed key ", key, ": rows of ", row_length,
                     " values; expected 1..16777216"));
  }
  absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(options);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init of hashed key ", key, ": ", spec.status().message()));
  }
  // One slice on every server (offset: the server's rank, length and total
  // 0); ids go to HashedServerOf(id).
  std::vector<KeyPart> parts;
  for (int s = 0; s < options_.num_servers; ++s)
    parts.push_back({s, static_cast<uint64_t>(s), 0});
  return InitKey(key, nullptr, 0, row_length, std::move(parts),
                 spec->ToString());
}

absl::Status KVClient::InitKey(uint64_t key, const float* value,
                               uint64_t length, uint64_t row_length,
                               std::vector<KeyPart> parts,
                               const std::string& hashed_spec) {
  const uint64_t total = row_length == 0 ? length : length / row_length;
  TESSERA_RETURN_IF_ERROR(CheckStaleness());
  TESSERA_RETURN_IF_ERROR(
      DeclareKey(key, length, row_length, parts, !hashed_spec.empty()));
  // A restarted worker, or one joining an elastic job (generation > 0): its
  // rank's pushes may be on the servers already, and the others have passed
  // the init barriers.
  bool ask_after_init = false;
  if (node_->generation() > 0) {
    std::optional<absl::Status> rejoined =
        RejoinStoredKey(key, total, row_length);
    if (rejoined.has_value()) return *rejoined;
    // Not (wholly) on the servers: this worker died while the job was still
    // initialising, or joined it then; do what a first life does. A joiner
    // asks again once the key is stored, to enter its rounds.
    ask_after_init = true;
  }
  absl::Status stored = absl::OkStatus();
  if (rank() == 0)
    stored = StoreKey(key, value, total, row_length, parts, hashed_spec);
  absl::Status barrier = node_->Barrier(kGroupWorkers, InitBarrier(key));
  if (!stored.ok()) {
    ForgetKey(key);
    return stored;
  }
  if (barrier.ok() && ask_after_init) {
    RequestTracker::RejoinReplies rejoin;
    if (absl::Status asked = RejoinKey(key, total, row_length, &rejoin);
        !asked.ok()) {
      ForgetKey(key);
      return asked;
    }
    if (rejoin.joining) {
      if (absl::Status entered = EnterJoined(key, total, row_length, rejoin);
          !entered.ok()) {
        ForgetKey(key);
        return entered;
      }
    }
  }
  return barrier;
}

absl::Status KVClient::DeclareKey(uint64_t key, uint64_t length,
                                  uint64_t row_length,
                                  const std::vector<KeyPart>& parts,
                                  bool hashed) {
  std::map<int, int> slices_per_server;
  bool windowed = false;
  for (const KeyPart& part : parts)
    windowed |= ++slices_per_server[part.server_rank] > PushWindow(options_);
  {
    absl::MutexLock lock(&mu_);
    if (keys_.count(key) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("key ", key, " is already initialised"));
    }
    KeyInfo& info = keys_[key];
    info.length = length;
    info.row_length = row_length;
    info.parts = parts;
    info.windowed = windowed;
    info.hashed = hashed;
    info.group_first = group_parts_;
    group_parts_ += parts.size();
    if (two_bit_ && row_length == 0) info.residual.assign(length, 0.0f);
    if (pull_two_bit_ && row_length == 0) {
      for (const KeyPart& part : parts)
        info.pulled.push_back(std::make_shared<PulledCopy>(part.length));
    }
  }
  replay_log_.DeclareKey(key, parts);
  {
    absl::MutexLock lock(&priority_mu_);
    const int64_t before = declared_keys_++;
    last_declared_ = key;
    priorities_.try_emplace(
        key, static_cast<int32_t>(-std::min(before, kMaxPriority)));
  }
  return absl::OkStatus();
}

void KVClient::ForgetKey(uint64_t key) {
  replay_log_.ForgetKey(key);
  {
    // The default order stays every worker's: a key forgotten (its init
    // failed) and declared again takes the same number.
    absl::MutexLock lock(&priority_mu_);
    if (priorities_.erase(key) > 0 && declared_keys_ > 0 &&
        last_declared_ == key)
      --declared_keys_;
  }
  absl::MutexLock lock(&mu_);
  keys_.erase(key);
}

void KVClient::EnterLater(uint64_t key,
                          const RequestTracker::RejoinReplies& rejoin) {
  absl::MutexLock lock(&mu_);
  KeyInfo& info = keys_[key];
  info.next_seq = rejoin.resume_min;
  if (entered_) {
    // Declared after this worker entered the others (a key made while the
    // job runs): its first push enters the round under way.
    return;
  }
  info.enter_seq = rejoin.resume_max;
  info.open_round = rejoin.open_round_max;
  entering_.push_back(key);
  entering_pending_.store(true, std::memory_order_release);
}

absl::Status KVClient::EnterJoined(
    uint64_t key, uint64_t total, uint64_t row_length,
    const RequestTracker::RejoinReplies& rejoin) {
  bool ssp = false;
  {
    absl::MutexLock lock(&mu_);
    ssp = ssp_;
  }
  if (!ssp) {
    EnterLater(key, rejoin);
    return absl::OkStatus();
  }
  // dist_ssp: no rounds to align, each key has its own clock. The key is
  // entered now, at the largest clock its slices named (each the slowest
  // in the job there), so that every slice numbers this worker's pushes
  // alike and its first pull already waits as a pull at that clock does.
  const uint64_t clock = rejoin.resume_max;
  const std::vector<EnteringKey> keys = {
      {key, total, row_length, clock, Parts(key)}};
  {
    absl::MutexLock entering(&enter_mu_);
    RequestTracker::RejoinReplies replies;
    TESSERA_RETURN_IF_ERROR(SendEntry(keys, rejoin.open_round_max, &replies));
  }
  {
    absl::MutexLock lock(&mu_);
    keys_[key].next_seq = clock;
  }
  TESSERA_LOG(INFO) << "joined the job (generation " << node_->generation()
                    << "): dist_ssp key " << key << " starts at clock " << clock
                    << " (the slowest worker's)";
  return absl::OkStatus();
}

std::optional<absl::Status> KVClient::RejoinStoredKey(uint64_t key,
                                                      uint64_t total,
                                                      uint64_t row_length) {
  RequestTracker::RejoinReplies rejoin;
  absl::Status found = RejoinKey(key, total, row_length, &rejoin);
  if (found.ok()) {
    if (rejoin.joining) {
      if (absl::Status entered = EnterJoined(key, total, row_length, rejoin);
          !entered.ok()) {
        ForgetKey(key);
        return entered;
      }
    } else {
      absl::MutexLock lock(&mu_);
      keys_[key].next_seq = rejoin.resume_min;
      // Before the first push all keys resume together
      // (SettleResumeLocked); a key declared after that keeps its own count,
      // and so does every key of a worker that joined.
      if (resume_ != Resume::kSettled && !entered_ && entering_.empty())
        resume_ = Resume::kPending;
    }
    TESSERA_VLOG(1) << "key " << key << ": the servers took "
                    << rejoin.resume_min << " push(es) of this rank before"
                    << (rejoin.joining ? " it joined" : " the restart");
    // The others may wait for this rank in this key's init barrier (it died
    // before reaching it); the scheduler joins it only then.
    return node_->JoinBarrierIfOpen(kGroupWorkers, InitBarrier(key));
  }
  if (!absl::IsNotFound(found)) {
    ForgetKey(key);
    return found;
  }
  return std::nullopt;
}

absl::Status KVClient::StoreKey(uint64_t key, const float* value,
                                uint64_t total, uint64_t row_length,
                                const std::vector<KeyPart>& parts,
                                const std::string& hashed_spec) {
  const uint64_t op = tracker_->NewOp();
  const uint64_t unit = row_length == 0 ? 1 : row_length;
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    Message msg = SliceMessage(wire::KV_INIT, key, part, total, row_length);
    msg.header.mutable_slice()->set_hashed_spec(hashed_spec);
    SetKeyMode(msg.header.mutable_kv_options());
    if (value != nullptr) {
      AddFloatFrame(&msg, Buffer::CopyOf(value + part.offset * unit,
                                         part.length * unit * sizeof(float)));
    }
    // Replicated jobs: every server of the slice's chain holds it.
    for (int j = 1; j < options_.replicas; ++j) {
      Message copy = msg;
      copy.header.set_replica(j);
      KeyPart backup = part;
      backup.server_rank = (part.server_rank + j) % options_.num_servers;
      SendPart(op, backup, std::move(copy), nullptr);
    }
    SendPart(op, part, std::move(msg), nullptr, {key, i, true});
  }
  return tracker_->Wait(op, absl::StrCat("init of key ", key));
}

uint64_t KVClient::ResumeRound() {
  absl::MutexLock lock(&mu_);
  SettleResumeLocked();
  return resume_round_;
}

void KVClient::SettleResumeLocked() {
  if (resume_ != Resume::kPending) return;
  resume_ = Resume::kSettled;
  // A worker that joined numbers each key's pushes on its own (EnterRounds).
  if (entered_ || !entering_.empty()) return;
  uint64_t resume = UINT64_MAX;
  for (const auto& [key, info] : keys_)
    resume = std::min(resume, info.next_seq);
  if (keys_.empty()) resume = 0;
  for (auto& [key, info] : keys_) info.next_seq = resume;
  resume_round_ = resume;
  if (options_.restart_count > 0) {
    TESSERA_LOG(INFO) << "restarted (TESSERA_RESTART_COUNT="
                      << options_.restart_count << "): resuming at round "
                      << resume;
  } else {
    TESSERA_LOG(INFO) << "joined the job (generation " << node_->generation()
                      << "): resuming at round " << resume;
  }
}

absl::Status KVClient::RejoinKey(uint64_t key, uint64_t total,
                                 uint64_t row_length,
                                 RequestTracker::RejoinReplies* replies) {
  const uint64_t op = tracker_->NewOp();
  for (const KeyPart& part : Parts(key)) {
    // The slice as the key was made (a row-sparse or hashed key's row length
    // too: the server checks it).
    Message msg = SliceMessage(wire::KV_INIT, key, part, total, row_length);
    msg.header.set_rejoin(true);
    SendPart(op, part, std::move(msg), nullptr);
  }
  return tracker_->Wait(op, absl::StrCat("rejoin of key ", key), replies);
}

absl::Status KVClient::EnterRounds() {
  if (!entering_pending_.load(std::memory_order_acquire))
    return absl::OkStatus();
  // One thread announces; a push on another waits for it here.
  absl::MutexLock entering(&enter_mu_);
  std::vector<EnteringKey> keys;
  uint64_t at = 0;
  {
    absl::MutexLock lock(&mu_);
    if (entering_.empty()) return absl::OkStatus();
    TESSERA_ASSIGN_OR_RETURN(at, EntryRoundLocked(&keys));
  }
  // Every slice is entered at the same round, so that this worker is at the
  // same step in every key; a slice already past it refuses, and the entry
  // goes again, later, to all (a slice that took the earlier round takes
  // the later one instead: nothing was pushed yet).
  constexpr int kTries = 10;
  for (int attempt = 1;; ++attempt) {
    RequestTracker::RejoinReplies replies;
    TESSERA_RETURN_IF_ERROR(SendEntry(keys, at, &replies));
    if (!replies.entry_refused) {
      FinishEntry(keys, at, attempt);
      return absl::OkStatus();
    }
    if (attempt == kTries) {
      return absl::DeadlineExceededError(absl::StrCat(
          "joining the job: the servers' rounds passed the round this worker "
          "entered at ",
          kTries, " times (last ", at, ", the furthest slice at ",
          replies.open_round_max, ")"));
    }
    // Later each time: a job whose rounds are fast needs a wider margin.
    at = std::max(at, replies.open_round_max) + 2 + attempt;
  }
}

absl::StatusOr<uint64_t> KVClient::EntryRoundLocked(
    std::vector<EnteringKey>* keys) {
  uint64_t low = UINT64_MAX, high = 0, low_key = 0, high_key = 0;
  for (uint64_t key : entering_) {
    const KeyInfo& info = keys_.at(key);
    const uint64_t total =
        info.row_length == 0 ? info.length : info.length / info.row_length;
    keys->push_back({key, total, info.row_length, info.enter_seq, info.parts});
    if (info.open_round < low) low = info.open_round, low_key = key;
    if (info.open_round >= high) high = info.open_round, high_key = key;
  }
  // The round numbers are each slice's own count of its rounds: they name
  // one step in every key when every key was pushed once a step from the
  // job's start (keys still in a step differ by one).
  if (high > low + 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "joining the job: the keys' rounds are too far apart to enter them "
        "at one step (key ",
        low_key, " at round ", low, ", key ", high_key, " at round ", high,
        "); a worker joins a job whose keys were all pushed once a step "
        "from its start (docs/faults.md, \"Workers join\")"));
  }
  // Two rounds past the furthest slice the rejoins saw: the slices most
  // likely have not passed it by the time the entry reaches them.
  return high + 2;
}

absl::Status KVClient::SendEntry(const std::vector<EnteringKey>& keys,
                                 uint64_t at,
                                 RequestTracker::RejoinReplies* replies) {
  const uint64_t op = tracker_->NewOp();
  for (const EnteringKey& k : keys) {
    for (const KeyPart& part : k.parts) {
      Message msg =
          SliceMessage(wire::KV_INIT, k.key, part, k.total, k.row_length);
      msg.header.set_rejoin(true);
      msg.header.set_enter(true);
      msg.header.set_enter_round(at);
      msg.header.set_push_seq(k.seq);
      SendPart(op, part, std::move(msg), nullptr);
    }
  }
  return tracker_->Wait(op, "entry into the job's rounds", replies);
}

void KVClient::FinishEntry(const std::vector<EnteringKey>& keys, uint64_t at,
                           int attempt) {
  TESSERA_LOG(INFO) << "joined the job (generation " << node_->generation()
                    << "): in every key's rounds "
                    << "from round " << at << " (" << keys.size() << " key(s)"
                    << (attempt > 1 ? ", entry try " : "")
                    << (attempt > 1 ? absl::StrCat(attempt) : "") << ")";
  absl::MutexLock lock(&mu_);
  // Its pushes are numbered from where the slices now count them. Only
  // the keys entered: one declared meanwhile waits for the next push.
  for (const EnteringKey& k : keys) {
    KeyInfo& info = keys_.at(k.key);
    info.next_seq = k.seq;
    entering_.erase(std::remove(entering_.begin(), entering_.end(), k.key),
                    entering_.end());
  }
  entered_ = true;
  entering_pending_.store(!entering_.empty(), std::memory_order_release);
}

}  // namespace tessera

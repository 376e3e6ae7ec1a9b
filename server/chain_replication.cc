// KVServer's chain replication (server/replication.h says what it does): a
// slice's place in its chain, its updates sent to the live backups and their
// answers, a backup taking them in order, gaps and resends.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/key_layout.h"
#include "common/logging.h"
#include "common/wire_status.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"

namespace tessera {

void KVServer::set_replication(int rank, int num_servers, int replicas,
                               absl::Duration resend_timeout,
                               bool single_copy) {
  rank_ = rank;
  num_servers_ = std::max(num_servers, 1);
  replicas_ = std::clamp(replicas, 1, num_servers_);
  single_copy_ = single_copy && replicas_ > 1;
  replica_resend_ = resend_timeout;
  for (auto& shard : shards_) shard->states.assign(num_servers_, ServerState());
}

void KVServer::MakeReplicated(StoredKey* key, uint32_t replica) {
  if (replicas_ <= 1) return;
  key->replicated = true;
  key->replica = replica;
  key->acked.assign(replicas_, 0);
  key->transfer.assign(replicas_, StoredKey::kNoTransfer);
  key->transfer_sent.assign(replicas_, absl::InfinitePast());
  // A slice made while a hand-back runs (its shard's part may be done
  // already): one that moves takes no push from the start (its round is
  // empty), as the others past their boundary.
  Shard* shard = ShardOf(key->key);
  if (Moves(*shard, *key)) {
    key->yield = StoredKey::kYielded;
    shard->yielding.push_back(key);
  }
}

absl::Status KVServer::CheckInitPlace(const wire::Header& init,
                                      const StoredKey* held) const {
  const wire::KeySlice& slice = init.slice();
  const uint32_t place = init.replica();
  if (held != nullptr) {
    // Held already: the place is the one it was made at (by an init that
    // passed this check, or by its primary's transfer).
    if (!held->replicated || place == held->replica) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "init of key ", slice.key(), " offset ", slice.offset(), " as replica ",
        place, ", but this server holds replica ", held->replica,
        " of the slice (chain ", ChainOf(*held).Members(), ")"));
  }
  if (place != 0 &&
      (replicas_ <= 1 || place >= static_cast<uint32_t>(replicas_))) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", slice.key(), " as replica ", place,
                     ", but this server holds ", replicas_,
                     " replica(s) of a slice (TESSERA_REPLICAS)"));
  }
  if (replicas_ <= 1) return absl::OkStatus();
  // The chain the init puts this server in must be one a worker's layout
  // makes for the slice: its first member is the server the layout names.
  const SliceChain chain = SliceChain::Around(rank_, static_cast<int>(place),
                                              num_servers_, replicas_);
  if (MayBeFirstMember(chain.first(), slice, num_servers_)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "init of key ", slice.key(), " offset ", slice.offset(), " (length ",
      slice.length(), " of ", slice.total_length(), ") as replica ", place,
      " of the chain ", chain.Members(), ", but the key's layout names server ",
      chain.first(), " for no such slice (the key's home is server ",
      KeyHome(slice.key(), num_servers_), ")"));
}

absl::Status KVServer::CheckAsyncChain(const wire::Header& init) const {
  if (init.replica() == 0) return absl::OkStatus();
  if (!init.kv_options().sync_mode() && replicas_ > 2 && !single_copy_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dist_async key ", init.slice().key(),
        " with TESSERA_REPLICAS=", replicas_,
        ": an async key has at most 2 replicas (two backups could "
        "each hold a different last update when the primary dies)"));
  }
  return absl::OkStatus();
}

void KVServer::RefuseMisplacedInit(const Message& msg,
                                   const absl::Status& why) {
  const uint64_t n = ++misplaced_inits_;
  if (LogOccurrence(n)) {
    TESSERA_LOG(WARNING) << "refused an init from node " << msg.header.sender()
                         << " (worker " << RankOfId(msg.header.sender())
                         << "): " << why.message() << " (misplaced init #" << n
                         << ")";
  }
  Reply(msg, why);
}

void KVServer::DropMisplaced(const wire::Header& h, const char* what,
                             const SliceChain& chain, int primary) {
  const uint64_t n = ++misplaced_server_messages_;
  if (!LogOccurrence(n)) return;
  TESSERA_LOG(WARNING) << "dropped " << what << " " << h.replica_seq()
                       << " of key " << h.slice().key() << " offset "
                       << h.slice().offset() << " from server "
                       << RankOfId(h.sender()) << " (node id " << h.sender()
                       << "): the slice's chain is [" << chain.Members()
                       << "] and its primary here is server " << primary
                       << ", the only one that sends its " << what
                       << "s (misplaced server message #" << n << ")";
}

bool KVServer::CountsFor(const StoredKey& key) const {
  const Shard& shard = *ShardOf(key.key);
  if (replicas_ <= 1) return shard.store.IsFirstSlice(key);
  // Of the slices this server answers for.
  return Active(shard, key) &&
         shard.store.IsFirstSlice(
             key, [&](const StoredKey& k) { return Active(shard, k); });
}

SliceChain KVServer::ChainOf(const StoredKey& key) const {
  return SliceChain::Around(rank_, static_cast<int>(key.replica), num_servers_,
                            replicas_);
}

bool KVServer::Active(const Shard& shard, const StoredKey& key) const {
  if (!key.replicated) return true;
  return ChainOf(key).Primary(shard.states) == rank_;
}

std::vector<int> KVServer::LiveBackups(const Shard& shard,
                                       const StoredKey& key) const {
  // Every other member that holds the slice, or receives it (a replacement
  // this server sent it to): the order of the chain does not matter here.
  std::vector<int> backups;
  for (int place = 0; place < replicas_; ++place) {
    if (place == static_cast<int>(key.replica)) continue;
    const int rank = ChainOf(key).RankAt(place);
    const ServerState& state = shard.states[rank];
    if (state.dead) continue;
    // With one copy only a server the slice is moving to receives it.
    if ((state.catching_up || single_copy_) &&
        key.transfer[place] == StoredKey::kNoTransfer) {
      continue;
    }
    backups.push_back(rank);
  }
  return backups;
}

bool KVServer::AnswerWaitsFor(const Shard& shard, const StoredKey& key,
                              int place) const {
  // A replacement counts once it holds the slice (its transfer answered); a
  // member that holds its slices always counts, also while a slice is being
  // sent to it whole (a gap): answers wait for it.
  // With one copy a member receives only slices moving to it: the same.
  return (!shard.states[ChainOf(key).RankAt(place)].catching_up &&
          !single_copy_) ||
         key.transfer[place] == StoredKey::kTransferHeld;
}

void KVServer::SendUpdate(int rank, const Message& update) {
  Message copy = update;  // shares the frames
  absl::Status sent = send_(ServerId(rank), std::move(copy));
  if (!sent.ok()) {
    ++failed_server_sends_;
    TESSERA_VLOG(1) << "update of key " << update.header.slice().key()
                    << " to server " << rank << ": " << sent.message();
  }
}

bool KVServer::CarriesMembers(const StoredKey& key) const {
  return elastic_ && (key.sync || key.ssp != nullptr);
}

PendingUpdate KVServer::NewUpdate(StoredKey* key) {
  PendingUpdate p;
  p.seq = key->replica_seq++;
  p.update.header.set_command(wire::KV_REPLICATE);
  p.update.header.mutable_slice()->set_key(key->key);
  p.update.header.mutable_slice()->set_offset(key->offset);
  p.update.header.set_replica_seq(p.seq);
  for (int r = 0; r < key->ledger.num_workers(); ++r)
    p.update.header.add_replica_counts(key->ledger.received(r));
  if (CarriesMembers(*key))
    key->engine->MemberStates(p.update.header.mutable_replica_members());
  return p;
}

void KVServer::SendNewUpdate(StoredKey* key, PendingUpdate p) {
  Shard* shard = ShardOf(key->key);
  p.sent = absl::Now();
  p.wait = replica_resend_;
  const std::vector<int> backups = LiveBackups(*shard, *key);
  for (int rank : backups) SendUpdate(rank, p.update);
  key->unacked.push_back(std::move(p));
  // With no live backup left the update is answered at once.
  AnswerReplicated(shard, key);
}

void KVServer::Replicate(StoredKey* key, std::vector<wire::Header> requests) {
  PendingUpdate p = NewUpdate(key);
  key->engine->TakeUpdate(&p.update);
  for (const wire::Header& h : requests) {
    if (key->engine->AnswersWithWeights(h.command())) p.weights = key->weights;
  }
  p.requests = std::move(requests);
  SendNewUpdate(key, std::move(p));
}

void KVServer::ReplicateEntry(StoredKey* key, const wire::Header& entry) {
  // No frames: the weights are as the last update left them.
  PendingUpdate p = NewUpdate(key);
  p.requests.push_back(entry);
  SendNewUpdate(key, std::move(p));
}

bool KVServer::JoinPendingUpdate(StoredKey* key, const Message& msg) {
  if (key->unacked.empty()) return false;
  const int rank = RankOfId(msg.header.sender());
  for (PendingUpdate& p : key->unacked) {
    if (p.answered) continue;
    if (msg.header.push_seq() >= p.update.header.replica_counts(rank)) continue;
    // The push's update: answered with it, once the backups hold it.
    for (const wire::Header& h : p.requests) {
      if (h.sender() == msg.header.sender() &&
          h.request_id() == msg.header.request_id()) {
        Acknowledge(msg);
        return true;
      }
    }
    p.requests.push_back(msg.header);
    if (key->engine->AnswersWithWeights(msg.header.command()) &&
        p.weights.empty()) {
      p.weights = key->weights;  // newer than the update's at worst
    }
    Acknowledge(msg);
    return true;
  }
  return false;
}

void KVServer::AnswerReplicated(Shard* shard, StoredKey* key) {
  const std::vector<int> backups = LiveBackups(*shard, *key);
  // Answered in order once every backup holding the slice holds the update;
  // kept until every backup it was sent to holds it (a replacement
  // receiving the slice may miss one and wait for its resend).
  bool answering = true;
  for (PendingUpdate& p : key->unacked) {
    if (p.answered) continue;
    for (int rank : backups) {
      const int place = ChainOf(*key).PlaceOf(rank);
      if (AnswerWaitsFor(*shard, *key, place) && key->acked[place] <= p.seq) {
        answering = false;
        break;
      }
    }
    if (!answering) break;
    for (const wire::Header& h : p.requests) {
      Message request;
      request.header = h;
      Reply(request, absl::OkStatus(),
            key->engine->AnswersWithWeights(h.command()) ? p.weights : Buffer(),
            key);
    }
    p.requests.clear();
    p.weights = Buffer();
    p.answered = true;
  }
  while (!key->unacked.empty() && key->unacked.front().answered) {
    const uint64_t seq = key->unacked.front().seq;
    bool held = true;
    for (int rank : backups) {
      if (key->acked[ChainOf(*key).PlaceOf(rank)] <= seq) {
        held = false;
        break;
      }
    }
    if (!held) break;
    key->unacked.pop_front();
  }
}

void KVServer::TakeReplica(Shard* shard, Message&& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) {
    // Its init (sent by the workers to every replica) has not come: the
    // primary sends the update again.
    TESSERA_VLOG(1) << "update of key " << h.slice().key() << " offset "
                    << h.slice().offset() << " for a slice not held here";
    return;
  }
  // Only from the slice's primary as this server sees the chain: a server
  // declared dead must not change what its successor now answers for.
  const int from = RankOfId(h.sender());
  const int primary = ChainOf(*key).Primary(shard->states);
  if (from != primary || primary == rank_) {
    DropMisplaced(h, "update", ChainOf(*key), primary);
    return;
  }
  auto answer = [&](const absl::Status& status) {
    Message reply = NewReply(msg, status, nullptr);
    reply.header.set_replica_seq(h.replica_seq());
    SendReply(msg, std::move(reply));
  };
  if (h.replica_seq() < key->replica_seq) {
    answer(absl::OkStatus());  // held already; the answer was lost
    return;
  }
  if (h.replica_seq() > key->replica_seq) {
    // A gap: an earlier update was lost, or this backup missed updates its
    // primary no longer keeps (a promotion with R >= 3). Saying how many it
    // holds makes the primary resend the next one, or send the slice whole.
    Message reply = NewReply(
        msg,
        absl::FailedPreconditionError(absl::StrCat(
            "update ", h.replica_seq(), " of key ", key->key,
            " is ahead of this server, which holds ", key->replica_seq)),
        nullptr);
    reply.header.set_replica_seq(key->replica_seq);
    SendReply(msg, std::move(reply));
    return;
  }
  if (h.replica_counts_size() != key->ledger.num_workers()) {
    ++malformed_;
    answer(absl::DataLossError(absl::StrCat(
        "update of key ", key->key, " carries ", h.replica_counts_size(),
        " push counts for ", key->ledger.num_workers(), " workers")));
    return;
  }
  // A dist_ssp slice's update without frames changes no weight: a joiner's
  // entry (ReplicateEntry), its counts and members only.
  const bool entry =
      key->ssp != nullptr && msg.data.empty() && h.frames_size() == 0;
  if (absl::Status applied =
          entry ? absl::OkStatus()
                : key->engine->ApplyReplica(msg, settings(), *this);
      !applied.ok()) {
    ++malformed_;
    answer(applied);
    return;
  }
  for (int r = 0; r < key->ledger.num_workers(); ++r) {
    key->ledger.SetReceived(r, h.replica_counts(r));
    // A backup's clocks follow its primary's (tessera_server_ssp_clock).
    if (key->ssp != nullptr && h.replica_counts(r) > 0) SspPushTaken(*key, r);
  }
  // A dist_sync slice's update is one of its primary's rounds: a backup
  // promoted later numbers its rounds as the primary did.
  if (key->sync) key->engine->SetRoundNumber(key->engine->RoundNumber() + 1);
  TakeMembers(key, h.replica_members(), "update");
  ++key->replica_seq;
  ++replica_updates_;
  answer(absl::OkStatus());
}

void KVServer::TakeMembers(
    StoredKey* key, const google::protobuf::RepeatedField<uint64_t>& states,
    const char* what) {
  if (states.empty() || (!key->sync && key->ssp == nullptr)) return;
  if (states.size() != key->ledger.num_workers()) {
    const uint64_t n = ++malformed_;
    if (LogOccurrence(++malformed_warnings_)) {
      TESSERA_LOG(WARNING) << what << " of key " << key->key << " offset "
                           << key->offset << " carries " << states.size()
                           << " worker states for " << key->ledger.num_workers()
                           << " workers: ignored (malformed message #" << n
                           << ")";
    }
    return;
  }
  const KeyStore& store = ShardOf(key->key)->store;
  for (int r = 0; r < states.size(); ++r) {
    // The scheduler's word on a worker may reach the primary after this
    // server: a rank this server heard leave stays out, and one it heard
    // join is not put out (a joiner not waited for yet is safe either way).
    if (store.Left(r) && states[r] != RoundMembers::kStateOut) continue;
    if (store.Joined(r) && states[r] == RoundMembers::kStateOut) continue;
    key->engine->SetMemberState(r, states[r]);
  }
}

void KVServer::ReplicaAnswered(Shard* shard, const Message& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) return;
  const int rank = RankOfId(h.sender());
  const int place = ChainOf(*key).PlaceOf(rank);
  if (place < 0 || place == static_cast<int>(key->replica)) return;
  const absl::Status status = FromWire(h.status());
  if (absl::IsFailedPrecondition(status)) {
    // The backup holds h.replica_seq() updates and got a later one.
    const uint64_t held = h.replica_seq();
    if (held >= key->replica_seq) return;
    key->acked[place] = std::max(key->acked[place], held);
    if (!key->unacked.empty() && key->unacked.front().seq <= held) {
      // Kept updates are consecutive: the next one it needs is at this index.
      PendingUpdate& p = key->unacked[held - key->unacked.front().seq];
      const absl::Time now = absl::Now();
      if (now - p.sent >= absl::Milliseconds(10)) {  // not just sent
        SendUpdate(rank, p.update);
        ++replica_resends_;
        p.sent = now;
      }
    } else if (key->transfer[place] != StoredKey::kTransferSent) {
      TESSERA_LOG(WARNING) << "server " << rank << " holds " << held
                           << " updates of key " << key->key << " offset "
                           << key->offset << ", fewer than this server keeps "
                           << "for resending: sending it the slice whole";
      SendTransfer(key, place);
    }
    return;
  }
  if (!status.ok()) {
    TESSERA_LOG(WARNING) << "server " << rank << " refused update "
                         << h.replica_seq() << " of key " << key->key << ": "
                         << status.message();
    return;
  }
  // It cannot hold an update not made yet.
  if (h.replica_seq() >= key->replica_seq) return;
  key->acked[place] = std::max(key->acked[place], h.replica_seq() + 1);
  AnswerReplicated(shard, key);
}

void KVServer::ResendUpdates(Shard* shard, StoredKey* key) {
  if (key->unacked.empty()) return;
  const absl::Time now = absl::Now();
  const std::vector<int> backups = LiveBackups(*shard, *key);
  for (PendingUpdate& p : key->unacked) {
    if (now - p.sent < p.wait) continue;
    for (int rank : backups) {
      if (key->acked[ChainOf(*key).PlaceOf(rank)] > p.seq) continue;
      SendUpdate(rank, p.update);
      ++replica_resends_;
    }
    p.sent = now;
    p.wait = std::min(p.wait * 2, replica_resend_ * 8);
  }
}

}  // namespace tessera

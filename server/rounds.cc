// KVServer's slice data path (see server/kv_server_shard.h for the rooms):
// a slice's init and a restarted worker's rejoin, the rounds (pushes taken,
// summed and applied, pulls answered, what waits held and replayed), the
// checkpoint's snapshot and restore, and the workers of an elastic job.
#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/hashed_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"
#include "server/pull_shadow.h"

namespace tessera {

void KVServer::Init(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  StoredKey* held = shard->store.Find(slice);
  // The place in the slice's chain is checked, not taken from the worker.
  if (absl::Status placed = CheckInitPlace(msg.header, held); !placed.ok()) {
    RefuseMisplacedInit(msg, placed);
    return;
  }
  if (held != nullptr) {
    AnswerRepeatedInit(held, msg);
    return;
  }
  if (absl::Status chained = CheckAsyncChain(msg.header); !chained.ok()) {
    Reply(msg, chained);
    return;
  }
  if (absl::Status ssp = CheckStalenessInit(msg.header); !ssp.ok()) {
    Reply(msg, ssp);
    return;
  }
  if (single_copy_ && !TakesInit(*shard, msg.header)) {
    // One copy, and the slice is moving to another server: not made here
    // (this server may have reported its part, and the new one would never
    // get it). The worker sends the init again, and after the move it goes
    // there.
    TESSERA_VLOG(1) << "init of key " << slice.key() << " offset "
                    << slice.offset()
                    << " not taken: another server answers for the slice, or "
                       "will";
    return;
  }
  shard->moved_away.erase({slice.key(), slice.offset()});
  if (slice.row_length() != 0 && slice.length() == 0 &&
      slice.total_length() == 0) {
    InitHashed(shard, std::move(msg));
    return;
  }
  InitValued(shard, std::move(msg));
}

void KVServer::AnswerRepeatedInit(StoredKey* key, const Message& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (key->hashed() && !msg.header.rejoin() &&
      slice.hashed_spec() != key->hashed_spec) {
    // A hashed key made again with other options (rank 0's are the key's;
    // a restarted rank 0 must bring the same).
    Reply(msg, absl::AlreadyExistsError(absl::StrCat(
                   "hashed key ", slice.key(), " exists with options '",
                   key->hashed_spec, "', not '", slice.hashed_spec(), "'")));
    return;
  }
  if (key->CheckSlice(slice).ok()) {
    // A resent init, or one replayed to a server restored from a
    // checkpoint: the key is there; its value is not touched.
    ++duplicates_;
    Reply(msg, absl::OkStatus(), Buffer(), key);
  } else {
    Reply(msg,
          absl::AlreadyExistsError(absl::StrCat(
              "key ", slice.key(), " is already initialised with [",
              key->offset, ", +", key->length, ") of ", key->total_length)));
  }
}

void KVServer::InitHashed(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  // A hashed row key: no value; its rows come with its ids.
  absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(slice.hashed_spec());
  if (!spec.ok() || !msg.data.empty() ||
      slice.row_length() > (uint64_t{1} << 24)) {
    Reply(msg, absl::InvalidArgumentError(
                   absl::StrCat("init of hashed key ", slice.key(), ": ",
                                spec.ok() ? "malformed slice or value"
                                          : spec.status().message())));
    return;
  }
  StoredKey* key =
      shard->store.Create(slice, msg.header.kv_options().sync_mode());
  key->weights = Buffer::Allocate(0);
  MakeReplicated(key, msg.header.replica());
  MakeBoundedStaleness(key, msg.header.kv_options());
  Reply(msg, absl::OkStatus(), Buffer(), key);
  OfferSlice(shard, key);
  shard->store.AdoptOrphans(key);
  Replay(key);
}

void KVServer::InitValued(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  // A row-sparse key's init without a value means zeros.
  const uint64_t values =
      slice.length() * (slice.row_length() == 0 ? 1 : slice.row_length());
  const bool zeros = slice.row_length() != 0 && msg.data.empty();
  if ((!zeros && (msg.data.size() != 1 ||
                  msg.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
                  msg.header.frames(0).num_values() != values)) ||
      slice.length() == 0 ||
      (slice.row_length() != 0 &&
       (values / slice.row_length() != slice.length() ||
        values > (uint64_t{1} << 40) / sizeof(float))) ||
      slice.offset() + slice.length() > slice.total_length() ||
      slice.offset() + slice.length() < slice.offset()) {
    Reply(msg, absl::InvalidArgumentError(absl::StrCat(
                   "init of key ", slice.key(), ": malformed slice or value")));
    return;
  }
  Buffer zeroed;
  if (zeros) {
    // Nothing crossed the wire for it: the size is only the header's word.
    try {
      zeroed = Buffer::Allocate(values * sizeof(float));
    } catch (const std::bad_alloc&) {
      Reply(msg, absl::ResourceExhaustedError(absl::StrCat(
                     "init of key ", slice.key(), ": cannot allocate ",
                     values * sizeof(float), " bytes for its rows")));
      return;
    }
    std::memset(zeroed.mutable_data(), 0, zeroed.size());
  }
  StoredKey* key =
      shard->store.Create(slice, msg.header.kv_options().sync_mode());
  MakeReplicated(key, msg.header.replica());
  MakeBoundedStaleness(key, msg.header.kv_options());
  if (zeros) {
    key->weights = std::move(zeroed);
  } else {
    key->weights = Buffer::CopyOf(msg.data[0].data(), msg.data[0].size());
  }
  // With the key: a checkpointing server's reply tells the worker to keep the
  // init for a replay.
  Reply(msg, absl::OkStatus(), Buffer(), key);
  OfferSlice(shard, key);
  // Messages a recovering server held for this key go next, in order.
  shard->store.AdoptOrphans(key);
  Replay(key);
}

void KVServer::Rejoin(Shard* shard, Message&& msg) {
  // A restarted worker asks where its pushes to this key resume.
  const wire::KeySlice& slice = msg.header.slice();
  StoredKey* key = shard->store.Find(slice);
  if (key == nullptr) {
    Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                " is not on this server")));
    return;
  }
  if (absl::Status same = key->CheckSlice(slice); !same.ok()) {
    Reply(msg, same);
    return;
  }
  const int rank = RankOfId(msg.header.sender());
  if (msg.header.enter()) {
    EnterRounds(key, std::move(msg));
    return;
  }
  // What the earlier life left waiting here (a pull, a push behind a missing
  // one) is dropped: nobody waits for its reply, and the new life pushes again
  // from the count reported now.
  const size_t dropped = key->waiting.DropEarlierLives(msg.header.sender(),
                                                       msg.header.generation());
  if (dropped != 0) SspForget(key, msg.header.sender());
  // A joiner of a dist_ssp slice starts at the slowest clock in the job
  // (its entry makes every slice of the key agree on the largest).
  const bool joining = key->engine->Joining(rank);
  msg.header.set_push_seq(key->ssp != nullptr && joining
                              ? SspJoinClock(*key, rank)
                              : key->ledger.received(rank));
  // A worker joining an elastic job learns where the rounds are, to choose
  // the round it enters every slice at.
  msg.header.set_open_round(key->engine->RoundNumber());
  // dist_async slices too: a joiner reusing the rank of a worker that left
  // mid-push numbers its pushes from the largest count (its entry), or its
  // first push to a slice that counted more would be taken as a duplicate.
  msg.header.set_joining(joining);
  Reply(msg, absl::OkStatus());
  if (dropped != 0) {
    TESSERA_VLOG(1) << "key " << slice.key() << ": dropped " << dropped
                    << " waiting message(s) of node " << msg.header.sender()
                    << "'s earlier life";
    key->progress = true;  // what waited behind them may go now
    Replay(key);
  }
}

void KVServer::EnterRounds(StoredKey* key, Message&& msg) {
  // A worker joining an elastic job enters the slice's rounds at the round it
  // names, the same in every slice (RoundMembers::EnterAt).
  const int rank = RankOfId(msg.header.sender());
  if (key->engine->Left(rank)) {
    Reply(msg, NotInJob(rank));
    return;
  }
  if (key->ssp != nullptr && key->replicated &&
      key->yield == StoredKey::kYielded) {
    // Past its hand-back boundary a slice makes no update (its backups hold
    // every one it made), and a dist_ssp entry is one: not taken here. The
    // worker sends it again, to the server answering for the slice then.
    TESSERA_VLOG(1) << "entry of worker " << rank << " into key " << key->key
                    << " offset " << key->offset
                    << " not taken: the slice is being handed back";
    return;
  }
  const bool joining = key->engine->Joining(rank);
  const bool taken =
      !key->sync || key->engine->EnterAt(rank, msg.header.enter_round());
  // Its pushes are numbered from push_seq here (the largest count of its rank
  // among the key's slices: a worker that left may have pushed to some
  // slices of a key and not others before it went).
  if (taken && joining && msg.header.push_seq() > key->ledger.received(rank))
    key->ledger.SetReceived(rank, msg.header.push_seq());
  // dist_ssp: the joiner is at its starting clock (SspJoinClock, the largest
  // over the key's slices); the bound waits for it from now on.
  if (key->ssp != nullptr) {
    key->engine->Enter(rank);
    if (joining) SspPushTaken(*key, rank);
  }
  // Refused: the reply's open round is past the round asked (the open round
  // itself when a push of the rank's earlier holder is in it).
  msg.header.set_open_round(taken ? key->engine->RoundNumber()
                                  : std::max(key->engine->RoundNumber(),
                                             msg.header.enter_round() + 1));
  msg.header.set_joining(key->engine->Joining(rank));
  TESSERA_VLOG(1) << "key " << key->key << " offset " << key->offset
                  << ": worker " << rank << " enters at round "
                  << msg.header.enter_round() << " (open round "
                  << key->engine->RoundNumber()
                  << "): " << (taken ? "taken" : "too late");
  // dist_ssp, replicated: the entry (the rank's count, and that the bound
  // waits for it) is an update of its own, answered once the backups hold
  // it, so that a promoted backup waits for the joiner from its clock too.
  // (A dist_sync entry goes with the next round's update.) Only where this
  // server answers for the slice: a backup numbers no update.
  if (key->ssp != nullptr && key->replicated &&
      Active(*ShardOf(key->key), *key)) {
    ReplicateEntry(key, msg.header);
  } else {
    Reply(msg, absl::OkStatus());
  }
  // An earlier entry at the open round, moved later: the round may be
  // complete without it.
  if (key->sync && key->engine->RoundComplete()) CompleteRound(key, -1);
  key->progress = true;
  Replay(key);
}

bool KVServer::TryProcess(StoredKey* key, Message& msg) {
  // A backup holds a worker's request until it answers for the slice (the
  // worker heard of the primary's death before this server did).
  if (key->replicated && !Active(*ShardOf(key->key), *key)) return false;
  // A hand-back: past its round boundary the slice takes no new push (the
  // server taking it back will); pulls are still answered, and so is a push
  // taken before the boundary that comes again (its answer was lost with a
  // connection). Held, that copy would keep its worker from its pushes to
  // the slices still waiting for their boundary, and the hand-back would
  // wait for them for ever (a one-copy leave under killed connections).
  if (key->yield == StoredKey::kYielded &&
      msg.header.command() != wire::KV_PULL) {
    const bool taken_before =
        (msg.header.command() == wire::KV_PUSH ||
         msg.header.command() == wire::KV_PUSHPULL) &&
        key->ledger.Classify(RankOfId(msg.header.sender()),
                             msg.header.push_seq()) == PushLedger::kDuplicate;
    if (!taken_before) return false;
  }
  if (key->engine->Left(RankOfId(msg.header.sender()))) {
    // Held before its worker left the job (elastic): not taken now.
    SspForget(key, msg.header.sender());
    RefuseUntaken(msg, NotInJob(RankOfId(msg.header.sender())));
    return true;
  }
  if (msg.header.command() == wire::KV_PULL) {
    const int rank = RankOfId(msg.header.sender());
    // Read your own pushes: a pull waits for the pushes its worker made before
    // it, however it overtook them (a resend reaching a restarted server
    // before the replay does).
    if (msg.header.push_seq() > key->ledger.received(rank)) return false;
    if (key->sync && key->engine->Contributed(rank))
      return false;  // sees this round's result
    // dist_ssp: waits until no rank in the job is more than s pushes behind.
    if (key->ssp != nullptr &&
        SspCheck(key, msg, msg.header.push_seq()) == SspVerdict::kWait)
      return false;
    if (CountsFor(*key)) MetricsOf(key).pulls->Increment();
    Message reply = NewReply(msg, absl::OkStatus(), key);
    if (absl::Status pulled = key->engine->Pull(msg, &reply, *this);
        !pulled.ok()) {
      Reply(msg, pulled);
    } else {
      SendReply(msg, std::move(reply));
    }
    return true;
  }
  return TryPush(key, msg);
}

bool KVServer::TryPush(StoredKey* key, Message& msg) {
  const int rank = RankOfId(msg.header.sender());
  // Exactly once: the worker numbers its pushes to this key.
  const PushLedger::Verdict order =
      key->ledger.Classify(rank, msg.header.push_seq());
  if (order == PushLedger::kDuplicate) return AnswerTakenPush(key, msg);
  // A group member's own push of a key its group pushes: refused whatever
  // its number (held, it would wait for ever as well).
  if (absl::Status own = CheckOwnPush(*key, msg); !own.ok()) {
    RefuseUntaken(msg, own);
    return true;
  }
  if (order == PushLedger::kAhead)
    return false;  // an earlier push of this worker is missing
  if (key->sync && key->engine->Contributed(rank))
    return false;  // belongs to the next round
  if (msg.header.group_ranks_size() > 0) {
    if (absl::Status group = CheckGroupPush(*key, msg); !group.ok()) {
      RefuseUntaken(msg, group);
      return true;
    }
    for (int mate : msg.header.group_ranks())
      if (key->sync && key->engine->Contributed(mate)) return false;
  }
  // A joiner's push before the round it entered at waits for it; its first
  // push in the rounds makes it a member (one that announced no round enters
  // the round under way).
  if (key->sync && key->engine->Early(rank)) return false;
  // The payload is checked before the push's number is taken: a refused push
  // leaves its worker's count as it was, so that a correct push of the same
  // number is taken, not answered as a copy of one taken before. Every
  // refusal above is before Take too (RefuseUntaken); after it, only what the
  // engine cannot do with a push it took (SliceEngine::Push), which counts.
  const Settings s = settings();
  if (absl::Status payload = key->engine->CheckPush(msg, s); !payload.ok()) {
    if (absl::IsDataLoss(payload)) CountMalformed();  // does not decode
    RefuseUntaken(msg, payload);
    return true;
  }
  // dist_ssp: a joiner that pushes without an entry is counted from here.
  if (key->sync || key->ssp != nullptr) key->engine->Enter(rank);
  key->ledger.Take(rank);
  key->progress = true;
  if (key->sync && key->engine->RoundEmpty()) key->round_started = absl::Now();
  absl::StatusOr<SliceEngine::Pushed> pushed = key->engine->Push(msg, s, *this);
  if (!pushed.ok()) {
    Reply(msg, pushed.status());
    return true;
  }
  return AnswerPush(key, msg, *pushed);
}

bool KVServer::AnswerPush(StoredKey* key, Message& msg,
                          SliceEngine::Pushed pushed) {
  const int rank = RankOfId(msg.header.sender());
  const wire::Command cmd = msg.header.command();
  CountPush(*key);
  if (key->sync)
    watch_.PushTaken(key->key, key->offset, rank, key->round_started,
                     absl::Now(), CountsFor(*key));
  switch (pushed) {
    case SliceEngine::Pushed::kApplied:
      if (CountsFor(*key)) ++async_applied_;
      if (key->ssp != nullptr) SspPushTaken(*key, rank);
      if (key->ssp != nullptr && cmd == wire::KV_PUSHPULL &&
          SspCheck(key, msg, msg.header.push_seq() + 1) == SspVerdict::kWait) {
        // Applied; its answer (the weights) waits for the bound as a pull
        // made after it would, held and then answered as a taken push.
        if (key->replicated) Replicate(key, {});
        return false;
      }
      if (key->replicated) {
        Replicate(key, {msg.header});
        break;
      }
      Reply(msg, absl::OkStatus(),
            key->engine->AnswersWithWeights(cmd) ? key->weights : Buffer(),
            key);
      break;
    case SliceEngine::Pushed::kAdded:
      // Held until the round completes, whose answer lets the worker's next
      // slice go: a worker is then at most its window of slices ahead of the
      // slowest, so a server holds accumulators only for that many slices of
      // a key, not for all of them (ExactSum::Release). An acknowledgement
      // on receipt let the fastest worker open every slice of a big key.
      break;
    case SliceEngine::Pushed::kRoundComplete:
      CompleteRound(key, rank);
      break;
  }
  return true;
}

absl::Status KVServer::CheckGroupPush(const StoredKey& key,
                                      const Message& msg) const {
  const int rank = RankOfId(msg.header.sender());
  std::vector<int> mates;
  if (rank >= 0 && static_cast<size_t>(rank) < local_groups_.size()) {
    for (int r : local_groups_[rank])
      if (r != rank) mates.push_back(r);
  }
  const std::vector<int> named(msg.header.group_ranks().begin(),
                               msg.header.group_ranks().end());
  if (named != mates) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push of key ", key.key, " from worker ", rank,
        " carries the pushes of worker(s) ", absl::StrJoin(named, ", "),
        "; its local group's other members are ",
        mates.empty() ? "none" : absl::StrJoin(mates, ", ")));
  }
  if (key.ssp != nullptr || !key.engine->TakesGroupPushes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push of key ", key.key, " from worker ", rank,
        ": a local group's push is taken only for dense dist_sync and "
        "dist_async keys"));
  }
  return absl::OkStatus();
}

absl::Status KVServer::CheckOwnPush(const StoredKey& key,
                                    const Message& msg) const {
  // Only a dense dist_sync slice counts a group's push for its members in a
  // round: there a member's own push would hold its place in the round its
  // group's push also fills, and the round would wait for ever (row-sparse,
  // hashed, dist_async and dist_ssp slices take each worker's own push).
  if (msg.header.group_ranks_size() > 0 || !key.sync || key.ssp != nullptr ||
      !key.engine->TakesGroupPushes()) {
    return absl::OkStatus();
  }
  const int rank = RankOfId(msg.header.sender());
  if (rank < 0 || static_cast<size_t>(rank) >= local_groups_.size() ||
      local_groups_[rank].size() < 2) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "push of key ", key.key, " from worker ", rank,
      " carries only its own push, but worker ", rank,
      " is in the local group of workers ",
      absl::StrJoin(local_groups_[rank], ", "),
      ", whose pushes of a dense dist_sync key come one per group, naming "
      "the other members (docs/local_groups.md): taken, it would stall the "
      "key's rounds"));
}

void KVServer::CompleteRound(StoredKey* key, int last_rank) {
  SliceEngine::Round round = key->engine->FinishRound(settings());
  update_duration_->ObserveDuration(round.update_end - round.update_start);
  watch_.RoundDone(key->key, key->offset, key->round_started, round.update_end);
  TraceRound(*key, round.update_start, round.update_end, last_rank);
  // Like pushes, a round of a key counts once, on its first slice here.
  if (CountsFor(*key)) {
    ++rounds_applied_;
    MetricsOf(key).rounds->Increment();
    round_duration_->ObserveDuration(round.update_end - key->round_started);
  }
  if (key->replicated) {
    Replicate(key, std::move(round.requests));
  } else {
    for (const wire::Header& h : round.requests) {
      Message request;
      request.header = h;
      Reply(request, absl::OkStatus(),
            key->engine->AnswersWithWeights(h.command()) ? key->weights
                                                         : Buffer(),
            key);
    }
  }
  key->engine->AfterRound();
  key->progress = true;
  // A hand-back waited for this boundary: no later push is taken here.
  if (key->yield == StoredKey::kYielding) key->yield = StoredKey::kYielded;
}

void KVServer::Replay(StoredKey* key) {
  // Replay what waited for a finished round, in order; a worker's later
  // messages stay behind the first of its messages that must wait again.
  // Replaying can finish another round, which calls for another pass.
  while (key->progress) {
    key->progress = false;
    key->waiting.Replay([&](Message& m) { return TryProcess(key, m); });
  }
  ReportWaiting(key);
}

void KVServer::CountPush(StoredKey& key) {
  // A push comes in one slice per TESSERA_CHUNK_BYTES: it counts once.
  if (!CountsFor(key)) return;
  ++pushes_applied_;
  MetricsOf(&key).pushes->Increment();
  absl::MutexLock lock(&key_counts_mu_);
  ++key_pushes_[key.key];
}

void KVServer::Snapshot(std::function<void(wire::ServerCheckpoint)> done) {
  struct Job {
    absl::Mutex mu;
    wire::ServerCheckpoint saved ABSL_GUARDED_BY(mu);
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    std::function<void(wire::ServerCheckpoint)> done;
  };
  auto job = std::make_shared<Job>();
  job->done = std::move(done);
  {
    absl::MutexLock lock(&job->mu);
    const Settings s = settings();
    job->saved.set_optimizer_spec(s.optimizer_spec);
    job->saved.set_compression_type(s.compression);
    job->saved.set_compression_threshold(s.threshold);
    job->saved.set_rounds_applied(updates_applied());
    job->remaining = shards_.size();
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [job](Shard* shard) {
      absl::MutexLock lock(&job->mu);
      for (const auto& [id, key] : shard->store.keys())
        key->Snapshot(job->saved.add_keys());
      if (--job->remaining == 0) job->done(std::move(job->saved));
    });
  }
}

void KVServer::MarkDurable(
    std::shared_ptr<const wire::ServerCheckpoint> saved) {
  ++checkpoints_;
  for (auto& shard : shards_) {
    Post(shard.get(), [saved](Shard* shard) {
      for (const wire::CheckpointKey& k : saved->keys()) {
        StoredKey* key = shard->store.Find(k.key(), k.offset());
        if (key == nullptr) continue;
        for (int r = 0; r < key->ledger.num_workers() && r < k.received_size();
             ++r) {
          key->ledger.set_durable(r, k.received(r));
        }
      }
    });
  }
}

std::pair<std::vector<float>, uint64_t> KVServer::ShadowForTesting(
    uint64_t key, uint64_t offset) {
  absl::Notification done;
  std::pair<std::vector<float>, uint64_t> out;
  Post(ShardOf(key), [&](Shard* shard) {
    StoredKey* k = shard->store.Find(key, offset);
    const PullShadow* shadow =
        k == nullptr ? nullptr : k->engine->pull_shadow();
    if (shadow != nullptr) {
      const Buffer& s = shadow->shadow();
      out.first.assign(s.floats(), s.floats() + s.num_floats());
      out.second = shadow->version();
    }
    done.Notify();
  });
  done.WaitForNotification();
  return out;
}

absl::Status KVServer::InstallSettings(const wire::ServerCheckpoint& saved,
                                       const char* what) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(saved.optimizer_spec());
  if (!opt.ok()) {
    return absl::DataLossError(absl::StrCat(what, " names optimizer '",
                                            saved.optimizer_spec(),
                                            "': ", opt.status().message()));
  }
  absl::MutexLock lock(&settings_mu_);
  settings_.optimizer = std::shared_ptr<const Optimizer>(std::move(*opt));
  settings_.optimizer_spec =
      settings_.optimizer ? settings_.optimizer->spec() : "none";
  settings_.compression =
      saved.compression_type().empty() ? "none" : saved.compression_type();
  settings_.threshold = saved.compression_threshold();
  return absl::OkStatus();
}

absl::Status KVServer::Restore(const wire::ServerCheckpoint& saved) {
  TESSERA_RETURN_IF_ERROR(InstallSettings(saved, "checkpoint"));
  std::map<uint64_t, std::pair<uint64_t, uint64_t>>
      first;  // key: offset, pushes
  for (const wire::CheckpointKey& k : saved.keys()) {
    if (absl::Status s = ShardOf(k.key())->store.Restore(k); !s.ok()) return s;
    num_keys_.fetch_add(1);
    uint64_t total = 0;
    for (uint64_t n : k.received()) total += n;
    auto [it, added] = first.try_emplace(k.key(), k.offset(), total);
    if (!added && k.offset() < it->second.first)
      it->second = {k.offset(), total};
  }
  if (replicas_ > 1) {
    for (auto& shard : shards_) {
      for (const auto& [id, key] : shard->store.keys()) {
        const uint64_t seq = key->replica_seq;
        MakeReplicated(key.get(), key->replica);
        key->replica_seq = seq;
      }
    }
  }
  for (const auto& [key, at] : first)
    SeriesFor(key)->pushes->Increment(at.second);
  {
    absl::MutexLock lock(&key_counts_mu_);
    for (const auto& [key, at] : first) key_pushes_[key] = at.second;
  }
  recovering_.store(true);
  return absl::OkStatus();
}

void KVServer::CheckWorkersFinished() {
  int done = static_cast<int>(finished_workers_.size());
  for (int r : left_workers_) done += finished_workers_.count(r) == 0 ? 1 : 0;
  if (done != num_workers_ || workers_finished_reported_) return;
  workers_finished_reported_ = true;
  TESSERA_VLOG(1) << "every worker finished with this server (or left)";
  if (on_workers_finished_) on_workers_finished_();
}

void KVServer::set_elastic(int nominal) {
  elastic_ = true;
  for (int r = nominal; r < num_workers_; ++r) {
    left_workers_.insert(r);
    watch_.SetInJob(r, false);
    ssp_stats_.SetInJob(r, false);
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [nominal](Shard* s) { s->store.SetElastic(nominal); });
  }
}

void KVServer::WorkerJoined(int rank) {
  if (rank < 0 || rank >= num_workers_) return;
  left_workers_.erase(rank);
  finished_workers_.erase(rank);
  watch_.SetInJob(rank, true);
  ssp_stats_.SetInJob(rank, true);
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      s->store.WorkerJoined(rank);
      for (auto& [id, key] : s->store.keys()) Replay(key.get());
    });
  }
}

void KVServer::WorkerLeft(int rank) {
  if (rank < 0 || rank >= num_workers_ || !left_workers_.insert(rank).second)
    return;
  LeaveRounds(rank);
  CheckWorkersFinished();
}

void KVServer::LeaveRounds(int rank) {
  watch_.SetInJob(rank, false);
  ssp_stats_.SetInJob(rank, false);
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      s->store.WorkerLeft(rank);
      for (auto& [id, key] : s->store.keys()) {
        StoredKey* k = key.get();
        if (k->sync && k->engine->RoundComplete()) CompleteRound(k, -1);
        // dist_ssp: the pulls that waited for the rank may go now.
        if (k->ssp != nullptr) k->progress = true;
        Replay(k);
      }
    });
  }
}

}  // namespace tessera

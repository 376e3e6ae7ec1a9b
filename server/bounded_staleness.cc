// KVServer's dist_ssp room (see server/kv_server_shard.h for the rooms;
// the rule and its metrics are server/staleness.h): a slice's gate made at
// its init, the one question the data path asks of it (may this pull, or
// this pushpull's answer, be answered now?), and the clocks its pushes move.
#include <algorithm>
#include <functional>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/options.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"

namespace tessera {

absl::Status KVServer::CheckStalenessInit(const wire::Header& init) const {
  const wire::KVOptions& o = init.kv_options();
  if (!o.bounded_staleness()) return absl::OkStatus();
  if (o.sync_mode()) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", init.slice().key(),
                     ": a key is dist_sync or dist_ssp, not both"));
  }
  if (o.staleness() > kMaxStaleness) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init of dist_ssp key ", init.slice().key(), ": staleness ",
        o.staleness(), ": expected a whole number of steps in 0..",
        kMaxStaleness));
  }
  return absl::OkStatus();
}

void KVServer::MakeBoundedStaleness(StoredKey* key,
                                    const wire::KVOptions& options) {
  if (!options.bounded_staleness()) return;
  key->ssp = std::make_unique<StalenessGate>(options.staleness());
  TESSERA_VLOG(1) << "key " << key->key << " offset " << key->offset
                  << ": dist_ssp, staleness " << options.staleness();
}

namespace {

// The ranks the bound waits for on a slice: those in the job. A rank out of
// it (left, or declared dead) holds nobody back, and neither does a joiner
// until it entered the slice at its starting clock (EnterRounds).
std::function<bool(int)> Counting(const SliceEngine& engine) {
  return [&engine](int r) { return !engine.Left(r) && !engine.Joining(r); };
}

}  // namespace

uint64_t KVServer::SspJoinClock(const StoredKey& key, int rank) const {
  const StalenessGate::Span span =
      StalenessGate::Measure(key.ledger, Counting(*key.engine));
  const uint64_t own = key.ledger.received(rank);
  return span.slowest_rank < 0 ? own : std::max(own, span.slowest);
}

KVServer::SspVerdict KVServer::SspCheck(StoredKey* key, const Message& msg,
                                        uint64_t clock) {
  StalenessGate& gate = *key->ssp;
  const int sender = msg.header.sender();
  const uint64_t id = msg.header.request_id();
  const bool open = gate.Open(clock, key->ledger, Counting(*key->engine));
  const absl::Time now = absl::Now();
  if (!open) {
    if (gate.Hold(sender, id, now)) ssp_stats_.Held();
    // For the hang doctor: whom it waits for now.
    const StalenessGate::Span span =
        StalenessGate::Measure(key->ledger, Counting(*key->engine));
    ssp_stats_.Holding(sender, id,
                       {.key = key->key,
                        .offset = key->offset,
                        .rank = RankOfId(sender),
                        .command = msg.header.command(),
                        .clock = clock,
                        .staleness = gate.staleness(),
                        .held_by = span.slowest_rank,
                        .held_by_pushes = span.slowest},
                       now);
    return SspVerdict::kWait;
  }
  std::optional<absl::Duration> held = gate.Release(sender, id, now);
  if (!held.has_value()) return SspVerdict::kAnswer;
  ssp_stats_.Released(*held);
  ssp_stats_.NotHolding(key->key, key->offset, sender, id);
  return SspVerdict::kAnswerHeld;
}

void KVServer::SspPushTaken(const StoredKey& key, int rank) {
  ssp_stats_.Pushed(rank, key.ledger.received(rank));
}

void KVServer::SspForget(StoredKey* key, int sender) {
  if (key->ssp == nullptr) return;
  if (const size_t n = key->ssp->Forget(sender); n != 0) {
    ssp_stats_.Dropped(n);
    ssp_stats_.NotHoldingAny(key->key, key->offset, sender);
  }
}

bool KVServer::AnswerTakenPush(StoredKey* key, Message& msg) {
  const int rank = RankOfId(msg.header.sender());
  const wire::Command cmd = msg.header.command();
  const uint64_t seq = msg.header.push_seq();
  if (key->ssp != nullptr && cmd == wire::KV_PUSHPULL &&
      seq + 1 == key->ledger.received(rank)) {
    // dist_ssp: a pushpull's answer brings the weights a pull made after
    // its push would; this one may be the copy held for the bound since
    // its push was applied (not a duplicate then).
    switch (SspCheck(key, msg, seq + 1)) {
      case SspVerdict::kWait:
        return false;
      case SspVerdict::kAnswerHeld:
        if (JoinPendingUpdate(key, msg)) return true;
        Reply(msg, absl::OkStatus(), key->weights, key);
        return true;
      case SspVerdict::kAnswer:
        break;
    }
  }
  ++duplicates_;
  if (JoinPendingUpdate(key, msg)) return true;
  if (key->sync && seq + 1 == key->ledger.received(rank) &&
      key->engine->Contributed(rank)) {
    // In the open round; answered when it completes. The newest copy is
    // the one answered: a restarted worker's repeat of its earlier life's
    // push carries a request id the old one did not.
    key->engine->ReplaceRequest(msg.header.sender(), msg.header);
    Acknowledge(msg);
  } else {
    Reply(msg, absl::OkStatus(),
          cmd == wire::KV_PUSHPULL ? key->weights : Buffer(), key);
  }
  return true;
}

}  // namespace tessera

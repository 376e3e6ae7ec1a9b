// KVServer's reactions to the node table's server changes
// (server/replication.h: "Failover", "Hand-back", "One copy"): a death
// promotes backups, and a replacement that caught up is given its place back
// (or a leaving server hands its slices on) at each slice's round boundary.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"

namespace tessera {

void KVServer::ServerDied(int rank) {
  if (replicas_ <= 1 || rank < 0 || rank >= num_servers_) return;
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      std::vector<ServerState> states = s->states;
      if (rank >= static_cast<int>(states.size())) return;
      states[rank].dead = true;
      ApplyStates(s, std::move(states));
    });
  }
}

void KVServer::UpdateServers(std::vector<ServerState> states) {
  if (replicas_ <= 1 || static_cast<int>(states.size()) != num_servers_) return;
  for (auto& shard : shards_) {
    Post(shard.get(), [this, states](Shard* s) { ApplyStates(s, states); });
  }
  // A catch-up in progress: a death moves slices to other servers, so the
  // counts given so far are stale; the live servers are asked again.
  catch_up_.Restart();
}

void KVServer::ApplyStates(Shard* s, std::vector<ServerState> states) {
  std::vector<ServerState> before = std::move(s->states);
  if (before.size() != states.size())
    before.assign(states.size(), ServerState());
  s->states = std::move(states);
  std::vector<int> died, replaced;
  for (int r = 0; r < num_servers_; ++r) {
    if (s->states[r].dead && !before[r].dead) died.push_back(r);
    if (s->states[r].joined != before[r].joined) replaced.push_back(r);
  }
  uint64_t promoted = 0, handed_back = 0;
  std::vector<std::pair<uint64_t, uint64_t>> gone;  // one copy: given away
  for (const auto& [id, owned] : s->store.keys()) {
    StoredKey* key = owned.get();
    if (!key->replicated) continue;
    for (int r : replaced) {
      // A new process at that place: it holds nothing of what was sent.
      const int place = ChainOf(*key).PlaceOf(r);
      if (place < 0 || place == static_cast<int>(key->replica)) continue;
      key->transfer[place] = StoredKey::kNoTransfer;
      key->acked[place] = 0;
    }
    const bool was_active = [&] {
      std::swap(s->states, before);
      const bool a = Active(*s, *key);
      std::swap(s->states, before);
      return a;
    }();
    if (was_active && !Active(*s, *key)) {
      ++handed_back;
      if (single_copy_) gone.push_back({key->key, key->offset});
    }
    if (Active(*s, *key)) {
      if (!was_active) {
        ++promoted;
        key->progress = true;  // what it held for the dead primary
      }
      AnswerReplicated(s, key);  // no longer waits for the dead one
      Replay(key);
    }
  }
  if (handed_back != 0) {
    slices_handed_back_ += handed_back;
    TESSERA_LOG(INFO)
        << "hand-back: " << handed_back
        << (single_copy_
                ? " key slice(s) of this server's moved to the server that "
                  "joined (this server drops its copy)"
                : " key slice(s) of this server's are answered by the "
                  "replacement that took back its place");
  }
  if (promoted != 0) {
    promoted_ += promoted;
    if (died.empty()) {
      TESSERA_LOG(INFO) << "hand-back: this server answers for " << promoted
                        << (single_copy_ ? " key slice(s) moved to it"
                                         : " key slice(s) of its chains again");
    } else if (single_copy_) {
      // One copy: a server that held slices leaves only once they moved
      // (a death ends the job).
      TESSERA_LOG(INFO) << "server(s) " << absl::StrJoin(died, ", ")
                        << " left: this server now answers for " << promoted
                        << " key slice(s) that moved here";
    } else {
      TESSERA_LOG(WARNING) << "server(s) " << absl::StrJoin(died, ", ")
                           << " died: this server now answers for " << promoted
                           << " of their key slices";
    }
  }
  HandbackAfterChange(s);  // before the erase: it releases yielding slices
  // One copy: the new server holds every update (the hand-back waited for
  // it) and no update comes here any more: the copy is dropped, and with it
  // the requests it held (their workers send them to the new server).
  for (const auto& [key, offset] : gone) {
    s->store.Erase(key, offset);
    s->moved_away.insert({key, offset});
    ++moved_away_;
  }
}

void KVServer::HandBack(int rank, uint64_t epoch,
                        std::function<void(uint64_t epoch)> ready, bool leave) {
  if (replicas_ <= 1 || rank < 0 || rank >= num_servers_ ||
      (rank == rank_ && !leave) || (leave && !single_copy_) ||
      epoch <= handback_seen_) {
    return;
  }
  if (leave && rank == rank_) {
    TESSERA_LOG(INFO) << "leaving: moving this server's key slices to the "
                         "servers that answer for them without it";
  }
  handback_seen_ = epoch;
  auto job = std::make_shared<HandbackJob>();
  job->epoch = epoch;
  job->ready = std::move(ready);
  {
    absl::MutexLock lock(&job->mu);
    job->remaining = shards_.size();
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank, job, leave](Shard* s) {
      StartYield(s, rank, leave, job);
    });
  }
}

void KVServer::StartYield(Shard* s, int rank, bool leave,
                          const std::shared_ptr<HandbackJob>& job) {
  // A later attempt replaces an earlier one (its slices that still move stay
  // stopped).
  if (rank >= static_cast<int>(s->states.size())) return;
  s->handback_rank = rank;
  s->handback_leave = leave;
  s->handback = job;
  Reyield(s);
}

bool KVServer::Waiting(const Shard& s) const {
  // The table as this shard knows it says the rank holds its slices and has
  // not its place back (a notice can come before the change it follows).
  const ServerState& r = s.states[s.handback_rank];
  if (s.handback_leave) return r.holds();  // not left yet
  return r.holds() && !r.restored;
}

std::vector<ServerState> KVServer::StatesAfter(const Shard& s) const {
  std::vector<ServerState> after = s.states;
  if (s.handback_leave) {
    after[s.handback_rank].dead = true;
  } else {
    after[s.handback_rank].restored = true;
  }
  return after;
}

void KVServer::Reyield(Shard* s) {
  std::vector<StoredKey*> before = std::move(s->yielding);
  s->yielding.clear();
  if (Waiting(*s)) {
    for (const auto& [id, owned] : s->store.keys()) {
      StoredKey* key = owned.get();
      if (!Moves(*s, *key)) continue;
      if (key->yield == StoredKey::kNotYielding) {
        key->yield = !key->sync || key->engine->RoundEmpty()
                         ? StoredKey::kYielded
                         : StoredKey::kYielding;
      }
      s->yielding.push_back(key);
    }
  }
  // Slices that no longer move take their held pushes.
  for (StoredKey* key : before) {
    if (std::find(s->yielding.begin(), s->yielding.end(), key) !=
        s->yielding.end()) {
      continue;
    }
    ReleaseYield(s, key);
  }
  CheckYield(s);
}

void KVServer::ReleaseYield(Shard* s, StoredKey* key) {
  const bool held = key->yield == StoredKey::kYielded;
  key->yield = StoredKey::kNotYielding;
  if (held && Active(*s, *key)) {
    key->progress = true;
    Replay(key);
  }
}

bool KVServer::Moves(const Shard& s, const StoredKey& key) const {
  if (s.handback_rank < 0 || !key.replicated || !Active(s, key)) return false;
  return ChainOf(key).Primary(StatesAfter(s)) != rank_;
}

bool KVServer::TakesInit(const Shard& s, const wire::Header& init) const {
  const SliceChain chain = SliceChain::Around(
      rank_, static_cast<int>(init.replica()), num_servers_, replicas_);
  if (chain.Primary(s.states) != rank_) return false;
  // And it stays here through the hand-back running on the shard.
  return s.handback_rank < 0 || !Waiting(s) ||
         chain.Primary(StatesAfter(s)) == rank_;
}

bool KVServer::MovesTo(const Shard& s, const StoredKey& key, int rank) const {
  // Replacement `rank` once it has its place back.
  std::vector<ServerState> after = s.states;
  after[rank].catching_up = false;
  after[rank].restored = true;
  return ChainOf(key).Primary(after) == rank;
}

void KVServer::OfferSlice(Shard* s, StoredKey* key) {
  // One copy: a slice made while a replacement is on its way to answering
  // for it goes to it at once (the workers send its init to one server).
  if (!single_copy_ || !key->replicated || !Active(*s, *key)) return;
  for (int rank = 0; rank < num_servers_; ++rank) {
    const ServerState& r = s->states[rank];
    if (rank == rank_ || r.dead || r.joined == 0 || r.restored) continue;
    if (MovesTo(*s, *key, rank)) SendTransfer(key, ChainOf(*key).PlaceOf(rank));
  }
}

void KVServer::CheckYield(Shard* s) {
  if (s->handback == nullptr || s->handback_rank < 0 || !Waiting(*s)) return;
  bool done = true;
  const std::vector<ServerState> after =
      single_copy_ ? StatesAfter(*s) : std::vector<ServerState>();
  for (StoredKey* key : s->yielding) {
    if (key->yield != StoredKey::kYielded) done = false;
    if (single_copy_) {
      // The one copy must be where it moves before it moves (the leaver
      // sends it; an old primary sends a slice made after the catch-up).
      const int to = ChainOf(*key).Primary(after);
      const int place = to < 0 ? -1 : ChainOf(*key).PlaceOf(to);
      if (place < 0) {
        done = false;  // no server to take it: never reported as moved
      } else if (key->transfer[place] != StoredKey::kTransferHeld) {
        done = false;
        if (key->transfer[place] == StoredKey::kNoTransfer ||
            absl::Now() - key->transfer_sent[place] > 8 * replica_resend_) {
          SendTransfer(key, place);
        }
      }
    }
    if (!key->unacked.empty()) {
      done = false;
      ResendUpdates(s, key);  // due ones only: the hand-back waits for them
    }
  }
  if (!done) return;
  std::shared_ptr<HandbackJob> job = std::move(s->handback);
  s->handback = nullptr;  // reported; the slices stay stopped until the end
  bool last = false;
  {
    absl::MutexLock lock(&job->mu);
    last = --job->remaining == 0;
  }
  if (last) job->ready(job->epoch);
}

void KVServer::EndYield(Shard* s) {
  std::vector<StoredKey*> yielding = std::move(s->yielding);
  s->yielding.clear();
  s->handback = nullptr;
  s->handback_rank = -1;
  s->handback_leave = false;
  for (StoredKey* key : yielding) ReleaseYield(s, key);
}

void KVServer::HandbackAfterChange(Shard* s) {
  if (s->handback_rank < 0) return;
  const ServerState& r = s->states[s->handback_rank];
  // A leave ends when its rank left (a leaver may have been given its place
  // back long before); a hand-back when the rank has its place, or died.
  if (r.dead || (r.restored && !s->handback_leave)) {
    // Done (the rank answers now), or given up (it died): the scheduler
    // starts another, if any, with a new notice.
    EndYield(s);
    return;
  }
  // Otherwise the hand-back goes on over the new table: a death may change
  // which slices move; a notice that came before the change it follows
  // starts now. A change the scheduler made after starting it gives it up
  // there, and a new notice replaces it here.
  Reyield(s);
}

}  // namespace tessera

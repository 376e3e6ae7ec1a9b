// Scheduler's membership after the job formed (see
// scheduler/scheduler_internal.h for the rooms): nodes that stop
// heart-beating or whose links are lost, what a death does (a worker's in an
// elastic job, a server's fail-over to its replicas, a spare placed in its
// rank, the job's end), a server leaving, and the hand-back that gives a
// replacement its place back.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/net_util.h"
#include "common/replica_chain.h"
#include "common/silence.h"
#include "scheduler/scheduler.h"
#include "scheduler/scheduler_internal.h"

namespace tessera {

using scheduler_internal::AbortMessage;

void Scheduler::HandleServerLeave(int sender, const wire::Header& h) {
  if (ended_) {
    Reply(sender, h, absl::OkStatus());  // the job is over: nothing to leave
    return;
  }
  if (!IsServerId(sender) || options_.chain_length() < 2) {
    Reply(sender, h,
          absl::FailedPreconditionError(
              "only a server of a replicated job (TESSERA_REPLICAS >= 2) or "
              "of one started with TESSERA_MAX_SERVERS leaves before the "
              "job's end: its key slices fail over to their replicas, or "
              "move to the other servers"));
    return;
  }
  if (options_.single_copy) {
    const wire::NodeInfo& n = nodes_[sender];
    if (n.catching_up() || (n.joined() != 0 && !n.restored())) {
      // A server added that answers for nothing yet: nothing moves.
      FailOver(sender, "left the job (it said goodbye)", /*goodbye=*/true);
      Reply(sender, h, absl::OkStatus());
      return;
    }
    if (leaving_.count(sender) == 0) {
      if (absl::Status alone = LastHolder(sender); !alone.ok()) {
        Reply(sender, h, alone);
        return;
      }
    }
    // Answered once its slices moved (a repeat of the request waits too).
    if (leaving_.emplace(sender, h).second) {
      TESSERA_LOG(INFO) << Describe(n)
                        << " asks to leave the job: its key slices move to "
                           "the next server first (TESSERA_REPLICAS=1)";
    }
    MaybeHandBack();
    return;
  }
  if (nodes_[sender].catching_up()) {
    Reply(sender, h,
          absl::FailedPreconditionError(
              "a replacement server leaves once it has caught up (its key "
              "slices are not all here yet)"));
    return;
  }
  if (std::optional<std::pair<int, std::string>> lost = LostChain(sender)) {
    Reply(sender, h,
          absl::FailedPreconditionError(absl::StrCat(
              Describe(nodes_[sender]),
              " cannot leave: the key slices placed "
              "on server ",
              lost->first,
              " would have no live replica left "
              "(servers ",
              lost->second, ", TESSERA_REPLICAS=", options_.replicas, ")")));
    return;
  }
  FailOver(sender, "left the job (it said goodbye)", /*goodbye=*/true);
  Reply(sender, h, absl::OkStatus());
}

void Scheduler::CheckLiveness(absl::Time now) {
  // Silence is judged up to when the scheduler last took everything waiting
  // for it (common/silence.h): a scheduler held up by its own backlog does
  // not declare the nodes it has not read yet dead.
  const absl::Time heard_until = transport_->caught_up_at();
  absl::Duration oldest = absl::ZeroDuration();
  for (const auto& [id, seen] : last_seen_) {
    if (done_workers_.count(id) == 0) oldest = std::max(oldest, now - seen);
  }
  metrics_.oldest_heartbeat_age->Set(absl::ToDoubleSeconds(oldest));
  for (const auto& [id, seen] : last_seen_) {
    if (done_workers_.count(id) != 0) continue;
    const Silence silent = MeasureSilence(seen, heard_until, now);
    if (!silent.TooLong(options_.heartbeat_timeout)) continue;
    DeclareDead(
        id, absl::StrCat(
                "stopped heart-beating: nothing heard for ",
                silent.Describe(now, heard_until), " (PS_HEARTBEAT_TIMEOUT=",
                absl::FormatDuration(options_.heartbeat_timeout), ")"));
    return;  // one at a time: the table changed
  }
}

bool Scheduler::SurvivesDeathOf(const wire::NodeInfo& n) const {
  if (n.role() == wire::WORKER) {
    // WorkersInJob() still counts `n`.
    return options_.elastic() && WorkersInJob() - 1 >= options_.elastic_min;
  }
  // A one-copy server may hold the only copy of its slices; a replicated
  // one is survived while every chain keeps a server.
  return n.role() == wire::SERVER && options_.chain_length() > 1 &&
         !options_.single_copy && !LostChain(n.id()).has_value();
}

void Scheduler::DeclareDead(int id, const std::string& reason) {
  const wire::NodeInfo dead = nodes_[id];
  metrics_.dead_nodes->Increment();
  if (dead.role() == wire::SERVER && options_.chain_length() > 1) {
    FailOver(id, reason);
    return;
  }
  if (dead.role() == wire::WORKER && options_.elastic()) {
    WorkerLeaves(id, /*goodbye=*/false, reason);
    return;
  }
  EndJobForDeathOf(dead, reason);
}

void Scheduler::EndJobForDeathOf(const wire::NodeInfo& node,
                                 const std::string& why) {
  Message notice;
  notice.header.set_command(wire::NODE_DEAD);
  *notice.header.mutable_node_dead()->mutable_node() = node;
  notice.header.mutable_node_dead()->set_reason(why);
  EndJob(absl::UnavailableError(
             absl::StrCat(Describe(node), " ", why, "; ending the job")),
         notice, LivePeers(node.id()));
}

void Scheduler::CheckLostLinks(absl::Time now) {
  for (const Transport::LostLink& lost : transport_->TakeLostLinks()) {
    if (ended_) return;
    auto it = nodes_.find(lost.peer);
    if (it == nodes_.end() || it->second.dead() ||
        done_workers_.count(lost.peer) != 0 ||
        last_seen_.count(lost.peer) == 0) {
      continue;  // not a live member the heartbeats watch
    }
    // Where the job goes on without the node (an elastic job's worker, a
    // server with replicas), it goes on now. Elsewhere the node's death ends
    // the job, and a restart (launch.py --restarts, or by hand) may take
    // its rank back first: the heartbeats' time-out still decides.
    if (!SurvivesDeathOf(it->second)) {
      TESSERA_VLOG(1) << Describe(it->second) << ": its connection at "
                      << lost.endpoint << " closed and connecting again was "
                      << "refused; waiting for a restart or the heartbeat "
                      << "time-out";
      continue;
    }
    // ZeroMQ's failed reconnects do not say why they failed: the node's
    // port refusing, or this process out of descriptors, no route, a
    // firewall. One connection attempt of our own tells them apart: only a
    // port that answers "nothing listens here" makes the node dead before
    // its heartbeats do (the review of issue #46's link watch).
    if (const TcpProbe probe = ProbeTcp(lost.endpoint, absl::Milliseconds(200));
        probe != TcpProbe::kRefused) {
      TESSERA_LOG(WARNING)
          << Describe(it->second) << ": its connection at " << lost.endpoint
          << " closed and connecting again failed, but a probe of its port "
          << "was " << TcpProbeName(probe) << ", not refused; the heartbeats "
          << "decide (PS_HEARTBEAT_TIMEOUT="
          << absl::FormatDuration(options_.heartbeat_timeout) << ")";
      continue;
    }
    DeclareDead(
        lost.peer,
        absl::StrCat("is gone: its connection closed and ", lost.refused,
                     " attempts to connect again to ", lost.endpoint,
                     " were refused within ",
                     absl::FormatDuration(
                         absl::Trunc(now - lost.closed, absl::Milliseconds(1))),
                     " (not waiting for PS_HEARTBEAT_TIMEOUT=",
                     absl::FormatDuration(options_.heartbeat_timeout), ")"));
  }
}

std::vector<int> Scheduler::LivePeers(int except) const {
  std::vector<int> peers;
  for (const auto& [peer, info] : nodes_) {
    if (peer != except && !info.dead()) peers.push_back(peer);
  }
  return peers;
}

std::optional<std::pair<int, std::string>> Scheduler::LostChain(
    int without) const {
  // Server rank r's slices live on ranks r, r+1, ..., r+replicas-1 (mod the
  // servers): a chain with no live server left has lost its slices.
  const int servers = options_.num_servers;
  std::vector<bool> alive(servers, false);
  for (const auto& [peer, n] : nodes_) {
    if (peer != without && n.role() == wire::SERVER && !n.dead() &&
        !n.catching_up() && n.rank() >= 0 && n.rank() < servers) {
      alive[n.rank()] =
          true;  // holds its slices (a replacement once caught up)
    }
  }
  for (int first = 0; first < servers; ++first) {
    const SliceChain chain(first, servers, options_.replicas);
    bool held = false;
    for (int i = 0; i < chain.size(); ++i)
      held = held || alive[chain.RankAt(i)];
    if (!held) return std::make_pair(first, chain.Members());
  }
  return std::nullopt;
}

void Scheduler::FailOver(int id, const std::string& reason, bool goodbye,
                         bool moved) {
  GiveUpHandback();
  wire::NodeInfo& dead = nodes_[id];
  dead.set_dead(true);
  dead.set_left(goodbye);
  last_seen_.erase(id);
  notices_.DropTo(id);
  std::string gone;
  if (options_.single_copy) {
    // One copy: a server that answers for slices holds their only copy; a
    // replacement not yet in its place holds nothing the others lack.
    if (!moved && !dead.catching_up() &&
        (dead.joined() == 0 || dead.restored())) {
      gone = absl::StrCat(
          "; it held the only copy of the key slices it answered for "
          "(TESSERA_REPLICAS=1; a server leaves such a job by SIGTERM, which "
          "moves them first)");
    }
  } else if (std::optional<std::pair<int, std::string>> lost = LostChain(id)) {
    gone = absl::StrCat("; every replica of the key slices placed on server ",
                        lost->first, " is gone (servers ", lost->second,
                        ", TESSERA_REPLICAS=", options_.replicas, ")");
  }
  if (!gone.empty()) {
    EndJobForDeathOf(dead, absl::StrCat(reason, gone));
    return;
  }
  if (!options_.single_copy) {
    TESSERA_LOG(WARNING) << Describe(dead) << " " << reason
                         << "; its key slices fail over to their next replica "
                            "(TESSERA_REPLICAS="
                         << options_.replicas << ")";
  } else if (moved) {
    TESSERA_LOG(INFO) << Describe(dead) << " " << reason
                      << "; the next server answers for its key slices, "
                         "which moved there first";
  } else {
    TESSERA_LOG(WARNING) << Describe(dead) << " " << reason
                         << "; it answered for no key slice yet (its slices "
                            "stay where they are)";
  }
  metrics_.failovers->Increment();
  if (goodbye) metrics_.servers_left->Increment();
  const Message change = ChangeMessage(dead);
  for (int peer : LivePeers(id)) notices_.Send(peer, change);
  // A joining worker's table no longer waits for it.
  std::vector<int> ready;
  for (auto& [joiner, servers] : join_waits_) {
    if (servers.erase(id) != 0 && servers.empty()) ready.push_back(joiner);
  }
  for (int joiner : ready) SendJoinerTable(joiner);
  // A barrier of servers may have waited only for it.
  barriers_.ReleaseComplete();
  PlaceSpares();
  MaybeHandBack();
}

void Scheduler::WorkerLeaves(int id, bool goodbye, const std::string& reason) {
  wire::NodeInfo& node = nodes_[id];
  node.set_dead(true);
  node.set_left(goodbye);
  last_seen_.erase(id);
  join_waits_.erase(id);
  notices_.DropTo(id);
  barriers_.Leave(id);
  metrics_.workers_left->Increment();
  const int remaining = WorkersInJob();
  metrics_.workers_in_job->Set(remaining);
  const std::string bounds =
      absl::StrCat(options_.elastic_min, ":", options_.elastic_max);
  if (remaining < options_.elastic_min) {
    const std::string why = absl::StrCat(
        reason, "; ", remaining, " worker(s) left in the job, fewer than ",
        "TESSERA_ELASTIC's minimum of ", options_.elastic_min, " (", bounds,
        ")");
    EndJobForDeathOf(node, why);
    return;
  }
  TESSERA_LOG(WARNING) << Describe(node) << " " << reason
                       << "; the job goes on with " << remaining << " of "
                       << options_.num_workers
                       << " worker(s) (TESSERA_ELASTIC=" << bounds
                       << "): the rounds it has not pushed to complete "
                          "without it";
  const Message change = ChangeMessage(node);
  for (int peer : LivePeers(id)) notices_.Send(peer, change);
  // A barrier of workers may have waited only for it.
  barriers_.ReleaseComplete();
  EndJobIfWorkersDone("every worker still in the job finished; job done");
}

void Scheduler::PlaceSpares() {
  if (ended_) return;
  for (auto& [id, n] : nodes_) {
    if (spares_.empty()) break;
    if (n.role() != wire::SERVER || !n.dead()) continue;
    Registration spare = spares_.front();
    spares_.pop_front();
    metrics_.spares->Set(static_cast<double>(spares_.size()));
    Replace(id, spare);
  }
}

void Scheduler::Replace(int id, const Registration& with) {
  GiveUpHandback();
  wire::NodeInfo& node = nodes_[id];
  const wire::NodeInfo before = node;
  node.set_host(with.info.host());
  node.set_port(with.info.port());
  node.set_generation(
      std::max(before.generation() + 1, with.info.generation()));
  node.set_dead(false);
  node.set_left(false);  // a server that left: its rank taken again
  node.set_catching_up(true);
  node.set_restored(false);
  node.set_joined(++replacements_);
  node.set_metrics_port(with.info.metrics_port());
  if (!node.node_key().empty())
    sealed_key_holder_[node.node_key()] = kRetiredKey;
  node.set_node_key(with.info.node_key());
  if (!with.info.node_key().empty())
    sealed_key_holder_[with.info.node_key()] = id;
  node.set_sealed_port(with.info.sealed_port());
  if (!with.key.empty()) node_key_of_[id] = with.key;
  registered_at_.insert({with.info.host(), with.info.port()});
  last_seen_[id] = absl::Now();
  metrics_.replacements->Increment();
  (void)LinkTo(id, node);
  const bool had_none = before.port() == 0;
  // The pid ties a spare's or an added server's name in launch.py ("spare
  // 0 (pid 42)") to the rank it now has.
  TESSERA_LOG(WARNING)
      << Describe(node) << " (host "
      << (with.hostname.empty() ? with.info.host() : with.hostname)
      << (with.pid > 0 ? absl::StrCat(", pid ", with.pid) : std::string())
      << (had_none ? ") takes server rank "
                   : ") replaces the dead server of rank ")
      << node.rank() << (had_none ? ", which had no server" : "")
      << " (replacement " << node.joined()
      << (options_.single_copy ? "); the servers answering for the key slices "
                                 "it will answer for send them to it"
                               : "); it catches up on the rank's key slices "
                                 "from their replicas");
  const Message change = ChangeMessage(node);
  for (const auto& [peer, n] : nodes_) {
    if (n.dead()) continue;
    notices_.Send(peer, peer == id ? TableMessage(id) : change);
  }
  MaybeHandBack();
}

void Scheduler::CaughtUp(int id) {
  wire::NodeInfo& node = nodes_[id];
  if (node.role() != wire::SERVER || !node.catching_up()) return;  // repeated
  GiveUpHandback();
  node.set_catching_up(false);
  TESSERA_LOG(INFO) << Describe(node)
                    << " caught up: it holds the key slices of rank "
                    << node.rank() << " again (replacement " << node.joined()
                    << ")";
  const Message change = ChangeMessage(node);
  for (int peer : LivePeers(-1)) notices_.Send(peer, change);
  MaybeHandBack();
}

void Scheduler::GiveUpHandback() {
  if (!handback_) return;
  // Every server gives up its part at the table change that follows.
  TESSERA_VLOG(1) << "hand-back " << handback_->epoch << " of "
                  << Describe(nodes_[handback_->id])
                  << " given up: the servers changed; it starts again";
  handback_.reset();
  // Its notices are not sent again (a server takes a late one only while
  // the rank it names still waits for its place).
  notices_.DropCommand(wire::HANDBACK);
}

void Scheduler::RetryHandback(absl::Time now) {
  std::string waiting;
  for (int id : handback_->waiting)
    absl::StrAppend(&waiting, waiting.empty() ? "" : ", ",
                    Describe(nodes_[id]));
  TESSERA_LOG(WARNING) << "hand-back " << handback_->epoch << " of "
                       << Describe(nodes_[handback_->id]) << " has waited "
                       << absl::FormatDuration(absl::Trunc(
                              now - handback_->started, absl::Milliseconds(1)))
                       << " for " << waiting << "; it starts again";
  metrics_.handback_retries->Increment();
  GiveUpHandback();
  MaybeHandBack();
}

void Scheduler::MaybeHandBack() {
  if (ended_ || handback_ || options_.chain_length() < 2) return;
  for (const auto& [id, n] : nodes_) {
    if (n.role() == wire::SERVER && !n.dead() && !n.catching_up() &&
        n.joined() != 0 && !n.restored()) {
      StartHandback(id, /*leave=*/false);
      return;
    }
  }
  // One copy: a leave, once no server is catching up (one at a time, after
  // the replacements' hand-backs).
  for (const auto& [id, n] : nodes_) {
    if (n.role() == wire::SERVER && !n.dead() && n.catching_up()) return;
  }
  for (auto it = leaving_.begin(); it != leaving_.end();) {
    if (nodes_[it->first].dead()) {
      it = leaving_.erase(it);  // died meanwhile: the job ended
      continue;
    }
    // The server that was to take its slices (one added, not yet in its
    // place) may have gone since it asked.
    if (absl::Status alone = LastHolder(it->first); !alone.ok()) {
      Reply(it->first, it->second, alone);
      it = leaving_.erase(it);
      continue;
    }
    StartHandback(it->first, /*leave=*/true);
    return;
  }
}

absl::Status Scheduler::LastHolder(int id) const {
  // Another live server that holds, or will hold, key slices and stays.
  for (const auto& [peer, other] : nodes_) {
    if (peer != id && other.role() == wire::SERVER && !other.dead() &&
        !other.catching_up() && leaving_.count(peer) == 0) {
      return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      Describe(nodes_.at(id)),
      " cannot leave: it is the last server that holds key slices, and they "
      "would have nowhere to go (TESSERA_REPLICAS=1)"));
}

void Scheduler::StartHandback(int id, bool leave) {
  const wire::NodeInfo& n = nodes_[id];
  Handback h;
  h.id = id;
  h.leave = leave;
  h.epoch = ++handback_epochs_;
  h.started = absl::Now();
  Message notice;
  notice.header.set_command(wire::HANDBACK);
  notice.header.set_handback_rank(n.rank());
  notice.header.set_handback_epoch(h.epoch);
  notice.header.set_handback_leave(leave);
  for (const auto& [peer, other] : nodes_) {
    // A replacement still catching up answers for nothing: no part; nor has
    // the rank taking back its place, but a leaver has (it sends its slices).
    if ((peer == id && !leave) || other.role() != wire::SERVER ||
        other.dead() || other.catching_up()) {
      continue;
    }
    h.waiting.insert(peer);
    notices_.Send(peer, notice);
  }
  TESSERA_VLOG(1) << (leave ? "leave " : "hand-back ") << h.epoch << ": "
                  << Describe(n)
                  << (leave ? " moves its key slices" : " takes back its place")
                  << "; waiting for " << h.waiting.size() << " server(s)";
  const bool none = h.waiting.empty();
  handback_ = std::move(h);
  if (none) HandbackDone(-1, handback_->epoch);
}

void Scheduler::HandbackDone(int sender, uint64_t epoch) {
  if (!handback_ || handback_->epoch != epoch) return;  // given up, or late
  handback_->waiting.erase(sender);
  if (!handback_->waiting.empty()) return;
  const int id = handback_->id;
  const absl::Duration took = absl::Now() - handback_->started;
  const bool leave = handback_->leave;
  handback_.reset();
  if (leave) {
    auto it = leaving_.find(id);
    if (it == leaving_.end()) return;
    const wire::Header request = it->second;
    leaving_.erase(it);
    metrics_.handbacks->Increment();
    FailOver(id,
             absl::StrCat("left the job (it said goodbye; its key slices "
                          "moved in ",
                          absl::FormatDuration(took), ")"),
             /*goodbye=*/true, /*moved=*/true);
    Reply(id, request, absl::OkStatus());
    return;
  }
  wire::NodeInfo& node = nodes_[id];
  node.set_restored(true);
  metrics_.handbacks->Increment();
  if (options_.single_copy) {
    TESSERA_LOG(INFO) << Describe(node)
                      << " answers for the key slices moved to it (server "
                      << node.rank() << " of " << options_.num_servers
                      << ", replacement " << node.joined() << ", hand-back in "
                      << absl::FormatDuration(took) << ")";
  } else {
    TESSERA_LOG(INFO) << Describe(node)
                      << " took back its place in the chains of its key "
                         "slices (replacement "
                      << node.joined() << ", hand-back in "
                      << absl::FormatDuration(took)
                      << "): it answers for the slices of rank " << node.rank()
                      << " again";
  }
  const Message change = ChangeMessage(node);
  for (int peer : LivePeers(-1)) notices_.Send(peer, change);
  MaybeHandBack();
}

}  // namespace tessera

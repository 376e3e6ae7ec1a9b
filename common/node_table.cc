// Node's table of the job's nodes (part of Node; see common/node.h): the
// links and identities a table gives, the changes a table after the first
// brings (peers that died, restarted, joined or changed state), and what
// the owner reads of it.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/node.h"

namespace tessera {

void Node::InstallIdentity(const wire::NodeInfo& n) {
  PeerIdentity identity;
  identity.role = n.role() == wire::SERVER ? Role::kServer : Role::kWorker;
  identity.node_key = n.node_key();
  identity.sealed_port = n.sealed_port();
  transport_->SetPeerIdentity(n.id(), identity);
}

void Node::InstallSchedulerIdentity(const wire::NodeTable& table) {
  if (table.scheduler_node_key().empty()) return;
  PeerIdentity identity;
  identity.role = Role::kScheduler;
  identity.node_key = table.scheduler_node_key();
  transport_->SetPeerIdentity(kSchedulerId, identity);
}

bool Node::WantsLink(int peer_id) const {
  if (peer_id == id_ || peer_id == kSchedulerId) return false;
  // Workers talk to servers; servers answer workers and, in a replicated
  // job, send updates to the servers after them. Workers need no link to
  // workers.
  if (options_.role == Role::kWorker) return IsServerId(peer_id);
  return IsWorkerId(peer_id) ||
         (options_.chain_length() > 1 && IsServerId(peer_id));
}

bool Node::AdoptFirstTable(const wire::NodeTable& table) {
  absl::MutexLock lock(&mu_);
  if (have_table_) return false;
  local_group_nonce_ = table.local_group_nonce();
  local_group_split_ = table.local_group_split();
  int my_id = 0, my_rank = -1;
  for (const wire::NodeInfo& n : table.nodes()) {
    nodes_[n.id()] = n;
    if (n.host() == address_ && n.port() == port_) {
      my_id = n.id();
      my_rank = n.rank();
    }
  }
  if (my_id == 0) {
    TESSERA_LOG(WARNING) << "node table does not list this node (" << address_
                         << ":" << port_ << "); ignored";
    return false;
  }
  // The key partition has one part per server rank: a node counting
  // other ranks than the job would send keys to the wrong servers.
  const int job_servers = table.num_servers();
  if (job_servers != 0 && job_servers != options_.num_servers) {
    failure_ = absl::InvalidArgumentError(absl::StrCat(
        "the job has ", job_servers,
        " server rank(s) but this node was "
        "started with ",
        options_.num_servers,
        " (DMLC_NUM_SERVER, and TESSERA_MAX_SERVERS when set, must be the "
        "scheduler's on every node)"));
    TESSERA_LOG(ERROR) << failure_.message();
    return false;
  }
  id_ = my_id;
  rank_ = my_rank;
  // A worker joining an elastic job gets a generation of its own (its
  // rank's earlier life, if any, had a lower one): its messages are told
  // from that life's by it, as a restarted node's are.
  generation_.store(
      std::max<uint64_t>(options_.restart_count, nodes_[my_id].generation()));
  // The peers' node keys go to the transport before anything is sent
  // under this id (the acknowledgement HandleNodeTable sends next is sealed
  // with them) and before Join connects to the peers.
  InstallSchedulerIdentity(table);
  for (const auto& [peer, info] : nodes_) {
    if (WantsLink(peer) && !info.dead()) InstallIdentity(info);
  }
  have_table_ = true;
  return true;
}

void Node::UpdateTable(const wire::NodeTable& table) {
  TableChanges changes;
  {
    absl::MutexLock lock(&mu_);
    for (const wire::NodeInfo& n : table.nodes()) ApplyTableEntry(n, &changes);
  }
  EndHandbackOnServerChange(changes);
  if (changes.self_dead) {
    Fail(absl::UnavailableError(
        "the scheduler declared this node dead (silent past "
        "PS_HEARTBEAT_TIMEOUT); its key slices failed over to their replicas"));
    return;
  }
  AnnounceTableChanges(changes);
}

void Node::ApplyTableEntry(const wire::NodeInfo& n, TableChanges* changes) {
  if (n.id() == id_ && !n.dead()) {
    ApplyOwnEntry(n, changes);
    return;
  }
  if (n.dead()) {
    if (n.id() == id_) {
      changes->self_dead = true;
      return;
    }
    ApplyDeath(n, changes);
    return;
  }
  auto it = nodes_.find(n.id());
  if (it == nodes_.end() && n.role() == wire::WORKER && n.joined() != 0) {
    AddJoinedWorker(n, changes);
    return;
  }
  if (it == nodes_.end() || n.generation() < it->second.generation()) return;
  if (n.generation() == it->second.generation()) {
    // The same process: a replacement that caught up, or took back its
    // place (hand-back).
    if (n.catching_up() != it->second.catching_up() ||
        n.restored() != it->second.restored()) {
      it->second = n;
      changes->changed.push_back(n.id());
    }
    return;
  }
  ApplyNewLife(n, &it->second, changes);
}

void Node::ApplyOwnEntry(const wire::NodeInfo& n, TableChanges* changes) {
  auto self = nodes_.find(id_);
  if (self != nodes_.end() && n.generation() >= self->second.generation()) {
    const bool state_changed = n.catching_up() != self->second.catching_up() ||
                               n.restored() != self->second.restored();
    self->second = n;
    if (!n.catching_up()) report_caught_up_ = false;
    if (state_changed && n.role() == wire::SERVER) changes->self_changed = true;
  }
}

void Node::ApplyDeath(const wire::NodeInfo& n, TableChanges* changes) {
  auto known = nodes_.find(n.id());
  if (known == nodes_.end() || known->second.dead() ||
      n.generation() < known->second.generation()) {
    return;  // known, or an earlier life's death (since replaced)
  }
  known->second.set_dead(true);
  known->second.set_left(n.left());
  // Nothing more goes to it (what was queued is dropped); and from a
  // node that died, not one that left (whose last words may still be
  // on their way), nothing sealed is taken any more.
  if (WantsLink(n.id())) {
    if (n.left()) {
      transport_->Disconnect(n.id());
    } else {
      transport_->ForgetPeer(n.id());
    }
  }
  changes->died.push_back(n.id());
}

void Node::AddJoinedWorker(const wire::NodeInfo& n, TableChanges* changes) {
  // Elastic jobs: a worker joined under a rank never used before.
  nodes_[n.id()] = n;
  if (WantsLink(n.id())) {
    InstallIdentity(n);
    absl::Status linked = transport_->Connect(n.id(), n.host(), n.port());
    if (!linked.ok()) {
      TESSERA_LOG(WARNING) << "cannot connect to joining worker " << n.id()
                           << ": " << linked.message();
    }
  }
  changes->joined.push_back(n.id());
}

void Node::ApplyNewLife(const wire::NodeInfo& n, wire::NodeInfo* known,
                        TableChanges* changes) {
  // A replacement server in a replicated job (a new process under a
  // dead server's rank) is a state change, not a restart: nothing is
  // replayed to it.
  const bool replacement =
      n.role() == wire::SERVER && n.joined() != known->joined();
  // Elastic jobs: a new worker under the rank of one that left.
  const bool worker_join =
      n.role() == wire::WORKER && n.joined() != known->joined();
  if (replacement && !known->dead()) {
    // Its death's notice was replaced by this one: it died first.
    if (WantsLink(n.id())) transport_->Disconnect(n.id());
    changes->died.push_back(n.id());
  }
  *known = n;
  if (replacement) changes->changed.push_back(n.id());
  if (!WantsLink(n.id())) return;
  InstallIdentity(n);
  // A fresh socket: what was queued for the old process is dropped (the
  // requests are resent or replayed).
  absl::Status linked = transport_->Connect(n.id(), n.host(), n.port());
  if (!linked.ok()) {
    TESSERA_LOG(WARNING) << "cannot reconnect to restarted node " << n.id()
                         << ": " << linked.message();
  }
  if (worker_join) {
    changes->joined.push_back(n.id());
  } else if (!replacement) {
    changes->restarted.push_back(n.id());
  }
}

void Node::EndHandbackOnServerChange(const TableChanges& changes) {
  // A change of the servers ends this server's part of a hand-back (done,
  // or given up by the scheduler).
  bool servers_changed = changes.self_changed || !changes.changed.empty();
  for (int peer : changes.died) servers_changed |= IsServerId(peer);
  if (servers_changed) {
    absl::MutexLock lock(&mu_);
    report_handback_ = 0;
  }
}

void Node::AnnounceTableChanges(const TableChanges& changes) {
  for (int peer : changes.died) AnnounceDeath(peer);
  for (int peer : changes.changed) AnnounceServerChange(peer);
  if (changes.self_changed && callbacks_.on_server_change)
    callbacks_.on_server_change(id_);
  for (int peer : changes.joined) {
    TESSERA_LOG(INFO) << Describe(peer)
                      << " joined the job (TESSERA_ELASTIC): a member of the "
                         "rounds from the next one";
    if (callbacks_.on_peer_join) callbacks_.on_peer_join(peer);
  }
  for (int peer : changes.restarted) {
    TESSERA_LOG(INFO) << Describe(peer) << " restarted (generation " << [&] {
      absl::MutexLock lock(&mu_);
      return nodes_[peer].generation();
    }() << ")";
    if (callbacks_.on_peer_restart) callbacks_.on_peer_restart(peer);
  }
}

void Node::AnnounceDeath(int peer) {
  const wire::NodeInfo gone = [&] {
    absl::MutexLock lock(&mu_);
    return nodes_[peer];
  }();
  if (gone.role() == wire::WORKER) {
    TESSERA_LOG(WARNING) << Describe(peer)
                         << (gone.left() ? " left the job"
                                         : " was declared dead")
                         << "; the rounds it has not pushed to complete "
                            "without it (TESSERA_ELASTIC)";
  } else if (gone.left() && options_.single_copy) {
    TESSERA_LOG(INFO) << Describe(peer)
                      << " left the job; its key slices moved to the next "
                         "server first";
  } else {
    TESSERA_LOG(WARNING) << Describe(peer)
                         << (gone.left() ? " left the job"
                                         : " was declared dead")
                         << "; its key slices fail over to their replicas";
  }
  if (callbacks_.on_peer_dead) callbacks_.on_peer_dead(peer);
}

void Node::AnnounceServerChange(int peer) {
  const wire::NodeInfo info = [&] {
    absl::MutexLock lock(&mu_);
    return nodes_[peer];
  }();
  TESSERA_LOG(INFO) << Describe(peer)
                    << (info.catching_up()
                            ? " replaces a dead server; it catches up on "
                              "the key slices of its rank"
                        : info.restored()
                            ? " took back its place in its key slices' "
                              "chains (hand-back)"
                            : " caught up: it holds its key slices");
  if (callbacks_.on_server_change) callbacks_.on_server_change(peer);
}

std::string Node::Describe(int node_id) const {
  if (node_id == kSchedulerId)
    return absl::StrCat("scheduler (id 1 at ", scheduler_address_, ")");
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return absl::StrCat("node ", node_id);
  const wire::NodeInfo& n = it->second;
  return absl::StrCat(n.role() == wire::SERVER ? "server " : "worker ",
                      n.rank(), " (id ", n.id(), " at ", n.host(), ":",
                      n.port(), ")");
}

std::vector<bool> Node::dead_servers() const {
  std::vector<bool> dead(options_.num_servers, false);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (n.role() == wire::SERVER && n.dead() && n.rank() >= 0 &&
        n.rank() < options_.num_servers) {
      dead[n.rank()] = true;
    }
  }
  return dead;
}

Node::WorkerChanges Node::worker_changes() const {
  WorkerChanges changes;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (n.role() != wire::WORKER || n.rank() < 0) continue;
    if (n.dead()) {
      changes.out.push_back(n.rank());
    } else if (n.joined() != 0) {
      changes.joined.push_back(n.rank());
    }
  }
  return changes;
}

std::vector<ServerState> Node::server_states() const {
  std::vector<ServerState> states(options_.num_servers);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (n.role() != wire::SERVER || n.rank() < 0 ||
        n.rank() >= options_.num_servers) {
      continue;
    }
    ServerState& s = states[n.rank()];
    s.dead = n.dead();
    s.catching_up = n.catching_up();
    s.joined = n.joined();
    s.restored = n.restored();
  }
  return states;
}

bool Node::catching_up() const {
  absl::MutexLock lock(&mu_);
  auto self = nodes_.find(id_);
  return self != nodes_.end() && self->second.catching_up();
}

void Node::ReportCaughtUp() {
  {
    absl::MutexLock lock(&mu_);
    auto self = nodes_.find(id_);
    if (self == nodes_.end() || !self->second.catching_up()) return;
    report_caught_up_ = true;
  }
  Message msg;
  msg.header.set_command(wire::CAUGHT_UP);
  msg.header.set_request_id(next_request_.fetch_add(1));
  (void)SendControl(std::move(msg));
}

void Node::ReportHandback(uint64_t epoch) {
  {
    absl::MutexLock lock(&mu_);
    report_handback_ = epoch;
  }
  Message msg;
  msg.header.set_command(wire::HANDBACK);
  msg.header.set_request_id(next_request_.fetch_add(1));
  msg.header.set_handback_epoch(epoch);
  (void)SendControl(std::move(msg));
}

Node::LocalPlace Node::local_place() const {
  LocalPlace place;
  absl::MutexLock lock(&mu_);
  place.split = local_group_split_;
  auto self = nodes_.find(id_);
  if (self == nodes_.end() || self->second.local_size() < 2) return place;
  place.group = self->second.local_group();
  place.rank = self->second.local_rank();
  place.size = self->second.local_size();
  place.nonce = local_group_nonce_;
  return place;
}

std::vector<std::vector<int>> Node::local_groups() const {
  std::vector<std::vector<int>> mates(options_.num_workers);
  std::map<uint32_t, std::vector<int>> by_group;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (n.role() != wire::WORKER || n.local_group() == 0 || n.rank() < 0 ||
        n.rank() >= options_.num_workers) {
      continue;
    }
    by_group[n.local_group()].push_back(n.rank());
  }
  for (auto& [group, ranks] : by_group) {
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    for (int r : ranks) mates[r] = ranks;
  }
  return mates;
}

}  // namespace tessera

// Scheduler's roster (see scheduler/scheduler_internal.h for the rooms): a
// node's registration and its identity (the connection key it proved, the
// sealed node key it brings), ids and ranks when the job forms, spares held,
// a restarted node's rejoin, and a worker joining an elastic job.
#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/curve_keys.h"
#include "common/logging.h"
#include "common/sealed_link.h"
#include "scheduler/local_groups.h"
#include "scheduler/scheduler.h"
#include "scheduler/scheduler_internal.h"

namespace tessera {

using scheduler_internal::AbortMessage;
using scheduler_internal::kFinishedIndex;
using scheduler_internal::kLateIndex;
using scheduler_internal::kSpareIndex;
using scheduler_internal::ProvisionalId;
using scheduler_internal::SealedKeyText;

std::vector<wire::NodeInfo> AssignIds(std::vector<wire::NodeInfo> nodes) {
  // A registration's rank is its place in its launcher's start order
  // (DMLC_TASK_ID), or negative when it has none: those come after, by
  // address (a job started by hand ranks by address alone).
  auto key = [](const wire::NodeInfo& n) {
    const bool ordered = n.rank() >= 0;
    return std::make_tuple(static_cast<int>(n.role()), !ordered,
                           ordered ? n.rank() : 0, n.host(), n.port());
  };
  std::stable_sort(nodes.begin(), nodes.end(),
                   [&key](const wire::NodeInfo& a, const wire::NodeInfo& b) {
                     return key(a) < key(b);
                   });
  int server_rank = 0, worker_rank = 0;
  for (wire::NodeInfo& n : nodes) {
    if (n.role() == wire::SERVER) {
      n.set_rank(server_rank);
      n.set_id(ServerId(server_rank++));
    } else {
      n.set_rank(worker_rank);
      n.set_id(WorkerId(worker_rank++));
    }
  }
  return nodes;
}

void Scheduler::SendJoinerTable(int joiner) {
  join_waits_.erase(joiner);
  auto node = nodes_.find(joiner);
  if (ended_ || node == nodes_.end() || node->second.dead()) return;
  TESSERA_VLOG(1) << "every server knows " << Describe(node->second)
                  << "; sending it its table";
  notices_.Send(joiner, TableMessage(joiner));
}

void Scheduler::JoinWorker(const Registration& r, int id) {
  const std::string bounds =
      absl::StrCat(options_.elastic_min, ":", options_.elastic_max);
  if (id < 0) {
    for (int rank = 0; rank < options_.elastic_max && id < 0; ++rank) {
      auto it = nodes_.find(WorkerId(rank));
      if (it == nodes_.end() || it->second.dead()) id = WorkerId(rank);
    }
  }
  if (id < 0 || WorkersInJob() >= options_.elastic_max) {
    const std::string why =
        absl::StrCat("the job already has its most workers, ",
                     options_.elastic_max, " (TESSERA_ELASTIC=", bounds, ")");
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "turned away a worker at " << r.info.host() << ":"
                         << r.info.port() << ": " << why;
    AbortRegistration(ProvisionalId(kLateIndex, r.info.role()), r.info,
                      r.nonces, why);
    return;
  }
  wire::NodeInfo& node = nodes_[id];
  const bool reused = node.id() == id;  // a rank that left
  if (reused && !node.node_key().empty())
    sealed_key_holder_[node.node_key()] = kRetiredKey;
  const uint64_t generation = std::max<uint64_t>(
      reused ? node.generation() + 1 : 1, r.info.generation());
  node = r.info;
  node.set_id(id);
  node.set_rank(RankOfId(id));
  node.set_generation(generation);
  node.set_dead(false);
  node.set_left(false);
  node.set_catching_up(false);
  node.set_joined(++worker_joins_);
  if (!node.node_key().empty()) sealed_key_holder_[node.node_key()] = id;
  if (!r.key.empty()) {
    node_key_of_[id] = r.key;
    registered_keys_.insert(r.key);
  }
  registered_at_.insert({node.host(), node.port()});
  last_seen_[id] = absl::Now();
  done_workers_.erase(id);
  barriers_.Forget(id);
  (void)LinkTo(id, node);
  metrics_.workers_joined->Increment();
  metrics_.workers_in_job->Set(WorkersInJob());
  TESSERA_LOG(INFO)
      << Describe(node) << " (host "
      << (r.hostname.empty() ? node.host() : r.hostname) << ", pid " << r.pid
      << ") joins the job (join " << node.joined() << "): " << WorkersInJob()
      << " of at most " << options_.elastic_max
      << " worker(s) in it (TESSERA_ELASTIC=" << bounds
      << "); it enters every key's rounds at the same round, before its first "
         "push";
  // The servers first: the joiner's table (and so its first request) goes
  // once every live server holds its entry, so that no server refuses it
  // as a worker out of the job.
  const Message change = ChangeMessage(node);
  std::set<int> servers;
  for (const auto& [peer, n] : nodes_) {
    if (n.dead() || n.role() != wire::SERVER) continue;
    servers.insert(peer);
    notices_.Send(peer, change);
  }
  if (servers.empty()) {
    notices_.Send(id, TableMessage(id));
  } else {
    join_waits_[id] = std::move(servers);
  }
}

std::string Scheduler::SealedKeyHolder(const std::string& key) const {
  if (key.empty()) return std::string();
  if (key == transport_->node_key()) return "the scheduler";
  auto it = sealed_key_holder_.find(key);
  if (it == sealed_key_holder_.end()) return std::string();
  if (it->second == kRetiredKey) return "an earlier life of a node";
  return DescribePeer(it->second);
}

void Scheduler::HandleRegister(const Message& msg) {
  const wire::Register& reg = msg.header.register_();
  const wire::NodeInfo& info = reg.node();
  const std::string& key = msg.connection_key;
  metrics_.registrations->Increment();
  if (!RegistrationAdmissible(msg)) return;
  if (formed_ && RestartOfKnownNode(info, key, reg.nonce())) return;
  if (!NewToTheJob(info, key, reg.nonce())) return;
  Registration r;
  r.info = info;
  // The scheduler places workers in local groups (FormLocalGroups).
  r.info.clear_local_group();
  r.info.clear_local_rank();
  r.info.clear_local_size();
  r.key = key;
  r.provisional_id =
      reg.spare()
          ? ProvisionalId(kSpareIndex - static_cast<int>(spares_.size()) -
                              static_cast<int>(replacements_),
                          info.role())
          : ProvisionalId(static_cast<int>(registered_.size()), info.role());
  r.hostname = reg.hostname();
  r.pid = reg.pid();
  r.nonces = {reg.nonce()};
  if (reg.spare()) {
    HoldSpare(r);
    return;
  }
  if (formed_ && options_.elastic() && info.role() == wire::WORKER) {
    JoinWorker(r, /*id=*/-1);
    return;
  }
  if (formed_) {
    TurnAway(r, "the job is already formed; no node of this role is missing");
    return;
  }
  RegisterBeforeFormation(r);
}

void Scheduler::RegisterBeforeFormation(const Registration& r) {
  const wire::NodeInfo& info = r.info;
  const std::string& key = r.key;
  const int count = registered_by_role_[info.role()];
  const int wanted = info.role() == wire::SERVER ? options_.servers_at_start()
                                                 : options_.num_workers;
  if (count >= wanted && options_.elastic() && info.role() == wire::WORKER) {
    // An elastic job's worker past DMLC_NUM_WORKER before the job formed:
    // it joins once the job has formed (at most MAX - DMLC_NUM_WORKER are
    // held).
    if (static_cast<int>(early_joiners_.size()) >=
        options_.elastic_max - options_.num_workers) {
      TurnAway(r, absl::StrCat("the job will have its most workers, ",
                               options_.elastic_max,
                               " (TESSERA_ELASTIC=", options_.elastic_min, ":",
                               options_.elastic_max, "), once it formed"));
      return;
    }
    TESSERA_LOG(INFO) << "worker at " << info.host() << ":" << info.port()
                      << " came before the job formed, past DMLC_NUM_WORKER ("
                      << wanted << "); it joins once the job has formed";
    // Its keys are taken now, as any registration's: one key, one node.
    if (!key.empty()) registered_keys_.insert(key);
    if (!info.node_key().empty())
      sealed_key_holder_[info.node_key()] = r.provisional_id;
    early_joiners_.push_back(r);
    return;
  }
  if (count >= wanted) {
    TurnAway(r,
             absl::StrCat("too many ",
                          info.role() == wire::SERVER ? "servers" : "workers",
                          ": expected ", wanted));
    return;
  }
  TESSERA_VLOG(1) << "registered "
                  << (info.role() == wire::SERVER ? "server" : "worker")
                  << " at " << info.host() << ":" << info.port() << " (host "
                  << r.hostname << ", pid " << r.pid << ")";
  registered_at_.insert({info.host(), info.port()});
  if (!key.empty()) registered_keys_.insert(key);
  if (!info.node_key().empty())
    sealed_key_holder_[info.node_key()] = r.provisional_id;
  ++registered_by_role_[info.role()];
  registered_.push_back(r);
  (info.role() == wire::SERVER ? metrics_.registered_servers
                               : metrics_.registered_workers)
      ->Add(1);
  if (static_cast<int>(registered_.size()) ==
      options_.servers_at_start() + options_.num_workers) {
    FormJob();
  }
}

// The checks every registration passes first: well formed, in time, with a
// connection key where nodes have their own, and a sealed node key that can
// be one. False: dropped, or answered here.
bool Scheduler::RegistrationAdmissible(const Message& msg) {
  const wire::NodeInfo& info = msg.header.register_().node();
  if ((info.role() != wire::SERVER && info.role() != wire::WORKER) ||
      info.host().empty() || info.port() <= 0 || info.port() > 65535) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored malformed registration: "
                         << DebugString(msg);
    return false;
  }
  if (ended_) {
    // Too late for this job (a node started or restarted after its end was
    // decided, or one registered before the start-up deadline asking again):
    // told each time, naming the registration; it registers again if the
    // abort is lost.
    AbortRegistration(ProvisionalId(kLateIndex, info.role()), info,
                      {msg.header.register_().nonce()}, end_reason_);
    return false;
  }
  // A node registers with a key of its own (launch.py's), or with its
  // role's, which the transport allows only when the job has no roster.
  if (msg.connection_key.empty() && transport_->nodes_have_own_keys()) {
    // The transport lets no such registration through (a role key's is
    // dropped, a sealed one too); should one come, it names no node.
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port()
                         << " without a connection key: every node of this "
                            "job registers with a key of its own";
    return false;
  }
  if (!transport_->node_key().empty()) {
    // A sealed job: the key its peers will seal to it with. Stored keys are
    // canonical, so that comparing bytes compares keys.
    if (std::string problem = sealed::NodeKeyProblem(info.node_key());
        !problem.empty()) {
      metrics_.ignored_messages->Increment();
      TESSERA_LOG(WARNING) << "ignored a registration of "
                           << DescribeRegistering(info)
                           << ": its sealed node key "
                           << SealedKeyText(info.node_key())
                           << " cannot be a node key: " << problem;
      return false;
    }
  }
  return true;
}

std::string Scheduler::DescribeRegistering(const wire::NodeInfo& info) const {
  std::string out = absl::StrCat("the node at ", info.host(), ":", info.port());
  for (const auto& [id, node] : nodes_) {
    if (node.role() == info.role() && node.host() == info.host() &&
        node.port() == info.port()) {
      absl::StrAppend(&out, ", ", Describe(node), "'s address");
    }
  }
  return out;
}

// A formed job: a registration from the address of one of its nodes is that
// node asking again for its table, an old life's, or its restart (Rejoin),
// if its keys are its own. True: handled here.
bool Scheduler::RestartOfKnownNode(const wire::NodeInfo& info,
                                   const std::string& key, uint64_t nonce) {
  for (auto& [id, node] : nodes_) {
    if (node.role() != info.role() || node.host() != info.host() ||
        node.port() != info.port()) {
      continue;
    }
    auto known = node_key_of_.find(id);
    if (known != node_key_of_.end() && known->second != key) {
      metrics_.ignored_messages->Increment();
      TESSERA_LOG(WARNING) << "ignored a registration as " << Describe(node)
                           << " (generation " << info.generation()
                           << ") with node key "
                           << (key.empty() ? "(none)" : KeyPrefix(key))
                           << ": that node registered with "
                           << KeyPrefix(known->second);
      return true;
    }
    if (info.generation() < node.generation()) return true;  // an old life's
    if (info.generation() == node.generation()) {
      // It asks again: the table we sent it was lost with a connection.
      (void)transport_->Send(id, TableMessage(id));
      return true;
    }
    if (std::string holder = SealedKeyHolder(info.node_key());
        !holder.empty()) {
      metrics_.ignored_messages->Increment();
      TESSERA_LOG(WARNING) << "ignored a registration as " << Describe(node)
                           << " (generation " << info.generation()
                           << "): its sealed node key "
                           << SealedKeyText(info.node_key()) << " is " << holder
                           << "'s";
      return true;
    }
    Rejoin(id, info, nonce);
    return true;
  }
  return false;
}

// Neither registered nor held yet, with keys no other node holds. False:
// a duplicate (it asks again) or another node's keys.
bool Scheduler::NewToTheJob(const wire::NodeInfo& info, const std::string& key,
                            uint64_t nonce) {
  if (registered_at_.count({info.host(), info.port()}) != 0) {
    NoteNonce(info, key, nonce);
    return false;  // duplicate
  }
  for (const Registration& held : early_joiners_) {
    if (held.info.host() == info.host() && held.info.port() == info.port()) {
      NoteNonce(info, key, nonce);
      return false;  // held until the job forms; it asks again
    }
  }
  if (!key.empty() && registered_keys_.count(key) != 0) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port() << " with node key " << KeyPrefix(key)
                         << ", which another node registered with";
    return false;
  }
  if (std::string holder = SealedKeyHolder(info.node_key()); !holder.empty()) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port() << ": its sealed node key "
                         << SealedKeyText(info.node_key()) << " is " << holder
                         << "'s";
    return false;
  }
  return true;
}

// A node turned away is told over a link of a moment; one that stays is
// linked to once, under its id, when the job forms (each link to a node
// is a handshake: at 288 nodes a second one each cost 0.5 s of CPU).
void Scheduler::TurnAway(const Registration& r, const std::string& why) {
  AbortRegistration(r.provisional_id, r.info, r.nonces, why);
}

void Scheduler::NoteNonce(const wire::NodeInfo& info, const std::string& key,
                          uint64_t nonce) {
  constexpr size_t kMaxNonces = 8;  // a node restarted more often: the first
  auto note = [&](Registration& r) {
    // Only a process presenting the registration's key: another could fill
    // its list and leave a genuine restart unnamed.
    if (r.info.host() != info.host() || r.info.port() != info.port() ||
        r.key != key)
      return false;
    if (absl::c_linear_search(r.nonces, nonce) || r.nonces.size() >= kMaxNonces)
      return false;
    r.nonces.push_back(nonce);
    return true;
  };
  for (Registration& r : registered_) {
    if (note(r)) return;
  }
  for (Registration& r : early_joiners_) {
    if (note(r)) return;
  }
  for (Registration& r : spares_) {
    if (note(r)) return;
  }
}

void Scheduler::AbortRegistration(int provisional, const wire::NodeInfo& info,
                                  absl::Span<const uint64_t> nonces,
                                  const std::string& why) {
  absl::Status connected = LinkTo(provisional, info);
  if (!connected.ok()) {
    TESSERA_LOG(WARNING) << "cannot reach registering node at " << info.host()
                         << ":" << info.port() << ": " << connected.message();
    return;
  }
  // Dropping the link at once loses nothing: on a link this fresh (nothing
  // sealed ahead of its socket) Send seals a message this small before it
  // returns, none of it left for the seal pool, and ZeroMQ keeps sending
  // for its linger (2 s) after the socket closes (sealed_cluster_test
  // ATurnedAwayServerHearsItsAbortAtOnce).
  (void)transport_->Send(provisional, AbortMessage(why, nonces));
  transport_->Disconnect(provisional);
}

// A spare server (TESSERA_SPARE=1): held until a server dies.
void Scheduler::HoldSpare(const Registration& r) {
  const wire::NodeInfo& info = r.info;
  const std::string& key = r.key;
  if (info.role() != wire::SERVER || options_.chain_length() < 2) {
    TurnAway(r,
             "a spare (TESSERA_SPARE=1) is a server of a job with "
             "TESSERA_REPLICAS >= 2 or TESSERA_MAX_SERVERS; this job has "
             "TESSERA_REPLICAS=" +
                 std::to_string(options_.replicas) +
                 " and no TESSERA_MAX_SERVERS");
    return;
  }
  for (const Registration& held : spares_) {
    if (held.info.host() == info.host() && held.info.port() == info.port()) {
      NoteNonce(info, r.key, r.nonces.front());
      return;  // it asks again
    }
  }
  TESSERA_LOG(INFO) << "spare server at " << info.host() << ":" << info.port()
                    << " (host " << r.hostname << ", pid " << r.pid
                    << ") waits for a server to die";
  if (!key.empty()) registered_keys_.insert(key);
  if (!info.node_key().empty())
    sealed_key_holder_[info.node_key()] = r.provisional_id;
  spares_.push_back(r);
  metrics_.spares->Set(static_cast<double>(spares_.size()));
  if (formed_) PlaceSpares();
}

void Scheduler::RejoinReplicatedServer(int id, const wire::NodeInfo& info,
                                       uint64_t nonce) {
  wire::NodeInfo& node = nodes_[id];
  // A replicated server's new process holds none of its slices: its old
  // life is dead (its slices fail over, or the job ends), and the new one
  // takes the rank back as a replacement and catches up, unless a spare
  // took it first.
  if (!node.dead()) {
    FailOver(id, absl::StrCat("restarted (generation ", info.generation(),
                              ") without its key slices"));
    if (ended_) return;
  }
  if (!nodes_[id].dead()) {
    AbortRegistration(ProvisionalId(kFinishedIndex, info.role()), info, {nonce},
                      absl::StrCat("a spare took the rank of ", Describe(node),
                                   "; not needed"));
    return;
  }
  Registration r;
  r.info = info;
  r.nonces = {nonce};
  r.key = node_key_of_.count(id) != 0 ? node_key_of_[id] : std::string();
  Replace(id, r);
}

void Scheduler::Rejoin(int id, const wire::NodeInfo& info, uint64_t nonce) {
  wire::NodeInfo& node = nodes_[id];
  if (node.role() == wire::SERVER && options_.chain_length() > 1) {
    RejoinReplicatedServer(id, info, nonce);
    return;
  }
  if (node.dead() && node.role() == wire::WORKER && options_.elastic()) {
    // A worker of an elastic job that left, started again: it joins anew
    // under its old rank (if still free).
    Registration r;
    r.info = info;
    r.nonces = {nonce};
    r.key = node_key_of_.count(id) != 0 ? node_key_of_[id] : std::string();
    JoinWorker(r, id);
    return;
  }
  if (node.dead()) {
    // Its slices failed over to their replicas; an empty server cannot take
    // them back (nor yet join as a backup). A worker of an elastic job left
    // the rounds, which went on without it.
    AbortRegistration(
        ProvisionalId(kFinishedIndex, info.role()), info, {nonce},
        absl::StrCat(Describe(node),
                     node.role() == wire::WORKER
                         ? (node.left() ? " left the job"
                                        : " was declared dead and left the job")
                         : " was declared dead and its key slices failed over "
                           "to their replicas",
                     node.role() == wire::WORKER
                         ? " (TESSERA_ELASTIC); joining a running job is not "
                           "supported yet"
                         : "; it cannot rejoin"));
    return;
  }
  if (done_workers_.count(id) != 0) {
    // It had finished; a new life would wait in barriers nobody else joins.
    AbortRegistration(
        ProvisionalId(kFinishedIndex, info.role()), info, {nonce},
        absl::StrCat(Describe(node),
                     " restarted after it had finished; nothing to rejoin"));
    return;
  }
  node.set_generation(info.generation());
  // The new process seals with a key of its own: its old life's is refused.
  // Its old key is retired, not freed: claiming it again would give its
  // receivers a fresh link state for records captured from the old life.
  if (!node.node_key().empty())
    sealed_key_holder_[node.node_key()] = kRetiredKey;
  node.set_node_key(info.node_key());
  if (!info.node_key().empty()) sealed_key_holder_[info.node_key()] = id;
  node.set_sealed_port(info.sealed_port());
  last_seen_[id] = absl::Now();
  // A fresh link: nothing queued for the old process goes to the new one.
  (void)LinkTo(id, node);
  TESSERA_LOG(INFO) << Describe(node) << " restarted (generation "
                    << info.generation() << "); it rejoins the job";
  // The nodes that link to it must learn of the new generation (workers
  // replay to a restarted server): one entry each, as a notice; the new
  // process gets its whole table.
  const Message change = ChangeMessage(node);
  for (const auto& [peer, n] : nodes_) {
    if (n.dead()) continue;
    if (peer == id) {
      notices_.Send(peer, TableMessage(id));
    } else if (n.role() != node.role() ||
               (n.role() == wire::SERVER && options_.chain_length() > 1)) {
      notices_.Send(peer, change);
    }
  }
}

namespace {

// TESSERA_MAX_SERVERS (`most` > `present`): the servers of `infos` (ranked 0
// to present - 1) take ranks spread over the most, so that every chain holds
// one; the other ranks wait for servers (dead in the table, their slices
// answered by their replicas) and are returned, their entries added.
std::vector<int> SpreadServersOverRanks(int most, int present,
                                        std::vector<wire::NodeInfo>* infos) {
  std::vector<int> waiting_ranks;
  if (present >= most) return waiting_ranks;
  std::vector<bool> taken(most, false);
  for (wire::NodeInfo& n : *infos) {
    if (n.role() != wire::SERVER) continue;
    const int rank =
        static_cast<int>(static_cast<int64_t>(n.rank()) * most / present);
    n.set_rank(rank);
    n.set_id(ServerId(rank));
    taken[rank] = true;
  }
  for (int rank = 0; rank < most; ++rank) {
    if (taken[rank]) continue;
    wire::NodeInfo absent;
    absent.set_id(ServerId(rank));
    absent.set_role(wire::SERVER);
    absent.set_rank(rank);
    absent.set_dead(true);
    infos->push_back(absent);
    waiting_ranks.push_back(rank);
  }
  return waiting_ranks;
}

}  // namespace

void Scheduler::FormJob() {
  std::vector<wire::NodeInfo> infos;
  std::map<std::pair<std::string, int>, std::string> keys;  // by host, port
  for (const Registration& r : registered_) {
    infos.push_back(r.info);
    if (!r.key.empty()) keys[{r.info.host(), r.info.port()}] = r.key;
  }
  infos = AssignIds(std::move(infos));
  local_group_split_ = FormLocalGroups(options_, &infos);
  // TESSERA_MAX_SERVERS: ranks that wait for a server.
  const std::vector<int> waiting_ranks = SpreadServersOverRanks(
      options_.num_servers, options_.servers_at_start(), &infos);
  for (const wire::NodeInfo& n : infos) {
    auto it = keys.find({n.host(), n.port()});
    if (it != keys.end()) node_key_of_[n.id()] = it->second;
  }
  const absl::Time now = absl::Now();
  // By id now, not provisional id; the spares and the early joiners keep
  // theirs until they have a rank: every registered key stays in the index.
  sealed_key_holder_.clear();
  auto keep = [&](const Registration& r) {
    if (!r.info.node_key().empty())
      sealed_key_holder_[r.info.node_key()] = r.provisional_id;
  };
  for (const Registration& r : spares_) keep(r);
  for (const Registration& r : early_joiners_) keep(r);
  for (const wire::NodeInfo& n : infos) {
    nodes_[n.id()] = n;
    if (Absent(n)) continue;
    if (confirmed_.count(n.id()) == 0) unconfirmed_at_formation_.insert(n.id());
    if (!n.node_key().empty()) sealed_key_holder_[n.node_key()] = n.id();
    last_seen_[n.id()] = now;
    (void)LinkTo(n.id(), n);
  }
  for (const Registration& r : registered_)
    transport_->Disconnect(r.provisional_id);
  formed_ = true;
  formed_at_ = absl::Now();
  metrics_.formed->Set(1);
  metrics_.workers_in_job->Set(WorkersInJob());
  for (const auto& [id, info] : nodes_) {
    if (Absent(info)) continue;
    absl::Status sent = transport_->Send(id, TableMessage(id));
    if (!sent.ok())
      TESSERA_LOG(WARNING) << "send to " << Describe(info) << ": "
                           << sent.message();
  }
  TESSERA_VLOG(1) << "job formed: " << options_.servers_at_start()
                  << " server(s), " << options_.num_workers << " worker(s)";
  for (const wire::NodeInfo& n : infos) TESSERA_VLOG(1) << "  " << Describe(n);
  if (!waiting_ranks.empty()) {
    TESSERA_LOG(INFO) << "job formed with " << options_.servers_at_start()
                      << " of at most " << options_.num_servers
                      << " server(s) (TESSERA_MAX_SERVERS): server rank(s) "
                      << absl::StrJoin(waiting_ranks, ", ")
                      << " wait for a server (TESSERA_SPARE=1, launch.py "
                         "--add-servers); "
                      << (options_.single_copy
                              ? "the next rank with a server answers for "
                                "their key slices until then"
                              : "their key slices' replicas answer for them "
                                "until then");
  }
  std::vector<Registration> early;
  early.swap(early_joiners_);
  for (const Registration& r : early) JoinWorker(r, /*id=*/-1);
  PlaceSpares();  // servers that came early for ranks without one
}

}  // namespace tessera

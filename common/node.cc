#include "common/node.h"

#include <sodium.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/debug_pending.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/status_macros.h"
#include "common/trace.h"
#include "common/wire_status.h"

namespace tessera {

namespace {

// Register.nonce: 64 random bits, never 0 (an abort naming no registration).
uint64_t RegistrationNonce() {
  uint64_t nonce = 0;
  if (sodium_init() < 0) std::abort();  // no randomness to be had
  while (nonce == 0) randombytes_buf(&nonce, sizeof(nonce));
  return nonce;
}

}  // namespace

Node::Node(const Options& options, Callbacks callbacks,
           std::unique_ptr<Transport> transport)
    : options_(options),
      callbacks_(std::move(callbacks)),
      transport_(std::move(transport)),
      nonce_(RegistrationNonce()),
      next_request_(FirstRequestId(options.restart_count)),
      generation_(options.restart_count),
      heartbeats_sent_(MetricsRegistry::Global().GetCounter(
          "tessera_node_heartbeats_sent_total",
          "Heartbeats this node sent to the scheduler.")),
      control_resends_(MetricsRegistry::Global().GetCounter(
          "tessera_node_control_resends_total",
          "Control requests (registration, barriers, leaving) sent to the "
          "scheduler again for want of an answer.")) {}

absl::StatusOr<std::unique_ptr<Node>> Node::Start(
    const Options& options, Callbacks callbacks,
    std::unique_ptr<Transport> transport) {
  if (options.role == Role::kScheduler) {
    return absl::InvalidArgumentError(
        "Node is for servers and workers, not the scheduler");
  }
  if (transport == nullptr) {
    TESSERA_ASSIGN_OR_RETURN(transport, NewZmqTransportForNode(options));
  }
  std::unique_ptr<Node> node(
      new Node(options, std::move(callbacks), std::move(transport)));
  absl::Status joined = node->Join();
  if (!joined.ok()) {
    node->Stop();
    return joined;
  }
  return node;
}

Node::~Node() { Stop(); }

absl::Status Node::Join() {
  TESSERA_RETURN_IF_ERROR(trace::StartFromEnvironment(RoleName(options_.role)));
  TESSERA_RETURN_IF_ERROR(BindAndConnect());
  receiver_ = std::thread([this] {
    trace::SetThreadName("receiver");
    ReceiveLoop();
  });
  TESSERA_RETURN_IF_ERROR(RegisterAndAwaitTable());
  SetLogTag(absl::StrCat(RoleName(options_.role), " ", rank_));
  trace::SetIdentity(RoleName(options_.role), rank_);
  metric_handles_.push_back(MetricsRegistry::Global().AddCollector(
      "tessera_node_info",
      "This node of the job: its role, rank and id (value 1).",
      MetricType::kGauge,
      [role = std::string(RoleName(options_.role)), rank = rank_,
       id = id_](MetricSamples* out) {
        out->push_back({{{"role", role},
                         {"rank", absl::StrCat(rank)},
                         {"id", absl::StrCat(id)}},
                        1});
      }));
  pending_section_ = DebugPendingRegistry::Global().Add(
      [role = std::string(RoleName(options_.role)), rank = rank_, id = id_,
       host = address_](wire::DebugPending* out) {
        out->set_role(role);
        out->set_rank(rank);
        out->set_id(id);
        out->set_host(host);
      });
  InstallPendingDump();
  TESSERA_VLOG(1) << "joined as id " << id_ << " rank " << rank_ << " at "
                  << address_ << ":" << port_;
  if (options_.heartbeat_interval > absl::ZeroDuration()) {
    heartbeat_ = std::thread([this] {
      trace::SetThreadName("heartbeat");
      HeartbeatLoop();
    });
  } else {
    TESSERA_LOG(WARNING) << "PS_HEARTBEAT_INTERVAL=0: heartbeats are off, so "
                            "a dead scheduler or peer is never detected and "
                            "this node may wait for it forever";
  }
  return absl::OkStatus();
}

absl::Status Node::BindAndConnect() {
  absl::StatusOr<std::string> scheduler_ip = ResolveHost(options_.root_uri);
  if (!scheduler_ip.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("DMLC_PS_ROOT_URI='", options_.root_uri,
                     "': ", scheduler_ip.status().message()));
  }
  TESSERA_ASSIGN_OR_RETURN(address_,
                           AdvertisedAddress(options_, *scheduler_ip));
  absl::StatusOr<int> port = transport_->Bind(address_, options_.port);
  if (!port.ok()) {
    if (options_.port != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("PORT=", options_.port, ": ", port.status().message()));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot listen on address ", address_,
        " (DMLC_NODE_HOST / DMLC_INTERFACE): ", port.status().message()));
  }
  port_ = *port;
  TESSERA_ASSIGN_OR_RETURN(metrics_http_,
                           StartMetricsServer(options_, address_));
  metric_handles_ =
      AddTransportCollectors(&MetricsRegistry::Global(), transport_.get());
  scheduler_address_ = absl::StrCat(*scheduler_ip, ":", options_.root_port);
  TESSERA_RETURN_IF_ERROR(
      transport_->Connect(kSchedulerId, *scheduler_ip, options_.root_port));
  TESSERA_VLOG(1) << RoleName(options_.role) << " advertises " << address_
                  << ":" << port_ << "; scheduler at " << scheduler_address_;
  absl::MutexLock lock(&mu_);
  last_scheduler_contact_ = absl::Now();
  return absl::OkStatus();
}

Message Node::RegisterMessage() const {
  Message reg;
  reg.header.set_command(wire::REGISTER);
  reg.header.set_generation(options_.restart_count);
  wire::NodeInfo* info = reg.header.mutable_register_()->mutable_node();
  info->set_role(options_.role == Role::kServer ? wire::SERVER : wire::WORKER);
  // No rank yet: the scheduler gives it. What it carries instead is the
  // process's place in its launcher's start order (DMLC_TASK_ID, -1: none),
  // by which the scheduler ranks it (AssignIds).
  info->set_rank(options_.task_id);
  info->set_host(address_);
  info->set_port(port_);
  info->set_generation(options_.restart_count);
  reg.header.mutable_register_()->set_spare(options_.spare);
  reg.header.mutable_register_()->set_nonce(nonce_);
  // Secured jobs: the key this process seals with and where its peers'
  // sealed records go (the scheduler hands both on in the node table).
  info->set_node_key(transport_->node_key());
  info->set_sealed_port(transport_->sealed_port());
  if (metrics_http_ != nullptr) info->set_metrics_port(metrics_http_->port());
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  reg.header.mutable_register_()->set_hostname(hostname);
  reg.header.mutable_register_()->set_pid(getpid());
  reg.header.set_plane(wire::CONTROL);
  return reg;
}

absl::Status Node::RegisterAndAwaitTable() {
  const Message reg = RegisterMessage();
  TESSERA_RETURN_IF_ERROR(transport_->Send(kSchedulerId, reg));
  // The scheduler gives up at its own start deadline and tells us (when it can
  // reach us); wait a moment longer so its reason arrives first.
  // A spare waits until a server dies or the job ends (the scheduler tells
  // it either way).
  const absl::Duration wait = options_.spare
                                  ? absl::InfiniteDuration()
                                  : options_.start_timeout + absl::Seconds(1);
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return have_table_ || !failure_.ok() || terminated_;
  };
  // The table can be lost with a connection that broke; the scheduler sends
  // it again to a node that registers again.
  AwaitAskingAgain(absl::Condition(&ready), absl::Now() + wait, [&] {
    TESSERA_VLOG(1) << "no node table yet; registering again";
    (void)transport_->Send(kSchedulerId, reg);
  });
  if (!failure_.ok()) return failure_;
  if (!have_table_ && terminated_) {
    return absl::CancelledError(
        "the job ended before this spare server was needed");
  }
  if (!have_table_) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no node table from the scheduler at ", scheduler_address_, " within ",
        absl::FormatDuration(wait), " (this node advertises ", address_, ":",
        port_,
        "; is the scheduler running, can it reach that address, and do "
        "all nodes use this job's keys: TESSERA_KEY_FILE / TESSERA_KEY_DIR, "
        "TESSERA_AUTH_ONLY, TESSERA_INSECURE?)"));
  }
  for (const auto& [peer_id, info] : nodes_) {
    // A dead peer gets nothing (a server rank of a TESSERA_MAX_SERVERS job
    // that has no server yet has no address either).
    if (!WantsLink(peer_id) || info.dead()) continue;
    TESSERA_RETURN_IF_ERROR(
        transport_->Connect(peer_id, info.host(), info.port()));
  }
  return absl::OkStatus();
}

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

void Node::UpdateTable(const wire::NodeTable& table) {
  std::vector<int> restarted;
  std::vector<int> died;
  std::vector<int> changed;  // replacements taking a rank, or caught up
  std::vector<int> joined;   // elastic jobs: workers joining
  bool self_dead = false;
  bool self_changed = false;
  {
    absl::MutexLock lock(&mu_);
    for (const wire::NodeInfo& n : table.nodes()) {
      if (n.id() == id_ && !n.dead()) {
        auto self = nodes_.find(id_);
        if (self != nodes_.end() &&
            n.generation() >= self->second.generation()) {
          const bool state_changed =
              n.catching_up() != self->second.catching_up() ||
              n.restored() != self->second.restored();
          self->second = n;
          if (!n.catching_up()) report_caught_up_ = false;
          if (state_changed && n.role() == wire::SERVER) self_changed = true;
        }
        continue;
      }
      if (n.dead()) {
        if (n.id() == id_) {
          self_dead = true;
          continue;
        }
        auto known = nodes_.find(n.id());
        if (known == nodes_.end() || known->second.dead() ||
            n.generation() < known->second.generation()) {
          continue;  // known, or an earlier life's death (since replaced)
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
        died.push_back(n.id());
        continue;
      }
      auto it = nodes_.find(n.id());
      if (it == nodes_.end() && n.role() == wire::WORKER && n.joined() != 0) {
        // Elastic jobs: a worker joined under a rank never used before.
        nodes_[n.id()] = n;
        if (WantsLink(n.id())) {
          InstallIdentity(n);
          absl::Status linked = transport_->Connect(n.id(), n.host(), n.port());
          if (!linked.ok()) {
            TESSERA_LOG(WARNING) << "cannot connect to joining worker "
                                 << n.id() << ": " << linked.message();
          }
        }
        joined.push_back(n.id());
        continue;
      }
      if (it == nodes_.end() || n.generation() < it->second.generation())
        continue;
      if (n.generation() == it->second.generation()) {
        // The same process: a replacement that caught up, or took back its
        // place (hand-back).
        if (n.catching_up() != it->second.catching_up() ||
            n.restored() != it->second.restored()) {
          it->second = n;
          changed.push_back(n.id());
        }
        continue;
      }
      // A replacement server in a replicated job (a new process under a
      // dead server's rank) is a state change, not a restart: nothing is
      // replayed to it.
      const bool replacement =
          n.role() == wire::SERVER && n.joined() != it->second.joined();
      // Elastic jobs: a new worker under the rank of one that left.
      const bool worker_join =
          n.role() == wire::WORKER && n.joined() != it->second.joined();
      if (replacement && !it->second.dead()) {
        // Its death's notice was replaced by this one: it died first.
        if (WantsLink(n.id())) transport_->Disconnect(n.id());
        died.push_back(n.id());
      }
      it->second = n;
      if (replacement) changed.push_back(n.id());
      if (!WantsLink(n.id())) continue;
      InstallIdentity(n);
      // A fresh socket: what was queued for the old process is dropped (the
      // requests are resent or replayed).
      absl::Status linked = transport_->Connect(n.id(), n.host(), n.port());
      if (!linked.ok()) {
        TESSERA_LOG(WARNING) << "cannot reconnect to restarted node " << n.id()
                             << ": " << linked.message();
      }
      if (worker_join) {
        joined.push_back(n.id());
      } else if (!replacement) {
        restarted.push_back(n.id());
      }
    }
  }
  {
    // A change of the servers ends this server's part of a hand-back (done,
    // or given up by the scheduler).
    bool servers_changed = self_changed || !changed.empty();
    for (int peer : died) servers_changed |= IsServerId(peer);
    if (servers_changed) {
      absl::MutexLock lock(&mu_);
      report_handback_ = 0;
    }
  }
  if (self_dead) {
    Fail(absl::UnavailableError(
        "the scheduler declared this node dead (silent past "
        "PS_HEARTBEAT_TIMEOUT); its key slices failed over to their replicas"));
    return;
  }
  for (int peer : died) {
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
  for (int peer : changed) {
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
  if (self_changed && callbacks_.on_server_change)
    callbacks_.on_server_change(id_);
  for (int peer : joined) {
    TESSERA_LOG(INFO) << Describe(peer)
                      << " joined the job (TESSERA_ELASTIC): a member of the "
                         "rounds from the next one";
    if (callbacks_.on_peer_join) callbacks_.on_peer_join(peer);
  }
  for (int peer : restarted) {
    TESSERA_LOG(INFO) << Describe(peer) << " restarted (generation " << [&] {
      absl::MutexLock lock(&mu_);
      return nodes_[peer].generation();
    }() << ")";
    if (callbacks_.on_peer_restart) callbacks_.on_peer_restart(peer);
  }
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

void Node::StartDelivery() {
  absl::MutexLock lock(&mu_);
  deliver_ = true;
}

absl::Status Node::Send(int peer, Message msg) {
  msg.header.set_sender(id_);
  msg.header.set_recipient(peer);
  msg.header.set_generation(generation_.load(std::memory_order_relaxed));
  msg.header.set_plane(wire::DATA);
  return transport_->Send(peer, msg);
}

absl::Status Node::SendControl(Message msg) {
  msg.header.set_sender(id_);
  msg.header.set_recipient(kSchedulerId);
  msg.header.set_generation(generation_.load(std::memory_order_relaxed));
  msg.header.set_plane(wire::CONTROL);
  return transport_->Send(kSchedulerId, msg);
}

absl::Status Node::CallScheduler(wire::Command command, wire::Header extra,
                                 absl::Duration timeout,
                                 const std::string& what) {
  const uint64_t request = next_request_.fetch_add(1);
  Message msg;
  msg.header = std::move(extra);
  msg.header.set_command(command);
  msg.header.set_request_id(request);
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return failure_;
    waiters_[request] = Waiter();
  }
  absl::Status sent = SendControl(msg);
  // No caller will receive the answer for this thread.
  WakeReceiver();
  absl::MutexLock lock(&mu_);
  if (!sent.ok()) {
    waiters_.erase(request);
    return sent;
  }
  auto ready = [this, request]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return waiters_[request].done || !failure_.ok() || stopping_ || terminated_;
  };
  // The reply can be lost with a connection that broke (`ss -K`, a peer's
  // restart): the same request goes again, and the scheduler answers a repeat
  // without counting it twice.
  AwaitAskingAgain(absl::Condition(&ready), absl::Now() + timeout, [&] {
    TESSERA_VLOG(1) << what
                    << ": no answer from the scheduler yet; asking again";
    (void)SendControl(msg);
  });
  Waiter waiter = waiters_[request];
  waiters_.erase(request);
  if (waiter.done) return waiter.status;
  if (!failure_.ok()) return failure_;
  if (terminated_) {
    // The job ended: every worker finished, this one included (the answer to
    // its WORKER_DONE was lost, or the scheduler left before sending it).
    if (command == wire::WORKER_DONE) return absl::OkStatus();
    return absl::CancelledError(absl::StrCat(what, ": the job has ended"));
  }
  if (stopping_)
    return absl::CancelledError(absl::StrCat(what, ": node stopped"));
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": no answer from the scheduler at ", scheduler_address_,
      " within ", absl::FormatDuration(timeout)));
}

void Node::AwaitAskingAgain(const absl::Condition& ready, absl::Time deadline,
                            const std::function<void()>& ask_again) {
  absl::Duration wait =
      options_.resend ? options_.resend_timeout : absl::InfiniteDuration();
  while (
      !mu_.AwaitWithDeadline(ready, std::min(deadline, absl::Now() + wait))) {
    if (absl::Now() >= deadline) return;
    mu_.Unlock();
    control_resends_->Increment();
    ask_again();
    mu_.Lock();
    wait = std::min(wait * 2, options_.resend_timeout * 8);
  }
}

absl::Status Node::Barrier(int group, const std::string& tag) {
  wire::Header extra;
  extra.mutable_barrier()->set_group(group);
  extra.mutable_barrier()->set_tag(tag);
  return CallScheduler(
      wire::BARRIER, std::move(extra), options_.request_timeout,
      absl::StrCat("barrier of group ", group, tag.empty() ? "" : " (", tag,
                   tag.empty() ? "" : ")"));
}

absl::Status Node::JoinBarrierIfOpen(int group, const std::string& tag) {
  wire::Header extra;
  extra.mutable_barrier()->set_group(group);
  extra.mutable_barrier()->set_tag(tag);
  extra.mutable_barrier()->set_join_if_open(true);
  return CallScheduler(
      wire::BARRIER, std::move(extra), options_.request_timeout,
      absl::StrCat("rejoining barrier ", tag, " of group ", group));
}

absl::Status Node::Finish() {
  TESSERA_RETURN_IF_ERROR(CallScheduler(wire::WORKER_DONE, wire::Header(),
                                        options_.request_timeout,
                                        "leaving the job"));
  MarkPartDone();
  // Stay until the end is announced, so the scheduler hears this worker
  // acknowledge it and need not wait out its deadline.
  WakeReceiver();
  absl::MutexLock lock(&mu_);
  auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return terminated_ || !failure_.ok() || stopping_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ended),
                            options_.request_timeout)) {
    TESSERA_LOG(WARNING) << "this worker finished but the job's end was not "
                            "announced within "
                         << absl::FormatDuration(options_.request_timeout)
                         << " (TESSERA_TIMEOUT); leaving";
    return absl::OkStatus();
  }
  if (!failure_.ok()) return failure_;
  return absl::OkStatus();
}

absl::Status Node::Leave() {
  if (options_.role == Role::kServer) {
    TESSERA_RETURN_IF_ERROR(CallScheduler(wire::SERVER_LEAVE, wire::Header(),
                                          options_.request_timeout,
                                          "leaving the job"));
    absl::MutexLock lock(&mu_);
    part_done_ = true;
    left_ = true;  // WaitForTerminate returns
    return absl::OkStatus();
  }
  TESSERA_RETURN_IF_ERROR(CallScheduler(wire::WORKER_LEAVE, wire::Header(),
                                        options_.request_timeout,
                                        "leaving the elastic job"));
  MarkPartDone();
  return absl::OkStatus();
}

void Node::MarkPartDone() {
  absl::MutexLock lock(&mu_);
  part_done_ = true;
}

absl::Status Node::WaitForTerminate() {
  WakeReceiver();
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return terminated_ || left_ || !failure_.ok() || stopping_;
  };
  mu_.Await(absl::Condition(&ready));
  if (!failure_.ok()) return failure_;
  if (terminated_ || left_) return absl::OkStatus();
  return absl::CancelledError("node stopped");
}

absl::Status Node::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

void Node::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok() || terminated_ || stopping_) return;
    failure_ = status;
  }
  TESSERA_LOG(ERROR) << status.message();
  if (callbacks_.on_failure) callbacks_.on_failure(status);
}

void Node::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    heartbeat_cv_.SignalAll();
  }
  {
    absl::MutexLock lock(&receive_mu_);
    receive_stopped_ = true;
    receiver_cv_.SignalAll();
  }
  stop_.store(true);
  if (heartbeat_.joinable()) heartbeat_.join();
  transport_->Close();
  if (receiver_.joinable()) receiver_.join();
  metrics_http_.reset();
}

int Node::metrics_port() const {
  return metrics_http_ == nullptr ? 0 : metrics_http_->port();
}

void Node::ReceiveLoop() {
  while (AwaitReceiverTurn()) {
    ReceiveResult r;
    do {
      r = ReceiveAndDispatch(kReceiverPoll);
      if (r == ReceiveResult::kClosed && stop_.load()) break;
    } while (!caller_waiting_.load(std::memory_order_acquire) && !stop_.load());
    EndReceiverTurn();
  }
}

bool Node::AwaitReceiverTurn() {
  absl::MutexLock lock(&receive_mu_);
  // A condition variable, not Mutex::Await: a parked thread would make every
  // caller's unlock of receive_mu_ evaluate its condition.
  while (true) {
    if (receive_stopped_) return false;
    const absl::Time now = absl::Now();
    const absl::Time turn = caller_received_ + kCallerGrace;
    if (receiving_ == Receiver::kNone && (receiver_wanted_ || now >= turn)) {
      receiving_ = Receiver::kThread;
      receiver_wanted_ = false;
      caller_waiting_.store(false, std::memory_order_relaxed);
      return true;
    }
    if (receiving_ == Receiver::kNone) {
      // A caller received a moment ago and will likely again: leave it the
      // transport for the rest of the grace.
      receiver_cv_.WaitWithDeadline(&receive_mu_, turn);
    } else if (receiver_wanted_) {
      // A caller receives (its receive has a time-out); it signals when it
      // hands the transport back.
      receiver_cv_.Wait(&receive_mu_);
    } else {
      // A caller receives: look again after the grace, not at every hand-back
      // (that would wake this thread once per round trip).
      receiver_cv_.WaitWithDeadline(&receive_mu_, now + kCallerGrace);
    }
  }
}

void Node::EndReceiverTurn() {
  bool wanted;
  {
    absl::MutexLock lock(&receive_mu_);
    receiving_ = Receiver::kNone;
    wanted = caller_waiting_.exchange(false, std::memory_order_relaxed);
    // The caller that asked receives next; this thread waits out the grace.
    if (wanted) caller_received_ = absl::Now();
  }
  if (wanted && callbacks_.on_receiver_free) callbacks_.on_receiver_free();
}

void Node::WakeReceiver() {
  absl::MutexLock lock(&receive_mu_);
  if (receiving_ == Receiver::kThread) return;
  receiver_wanted_ = true;
  receiver_cv_.Signal();
}

Node::ReceiveResult Node::ReceiveOnCaller(absl::Duration timeout) {
  {
    absl::MutexLock lock(&receive_mu_);
    if (receive_stopped_) return ReceiveResult::kClosed;
    if (receiving_ != Receiver::kNone) {
      if (receiving_ == Receiver::kThread)
        caller_waiting_.store(true, std::memory_order_release);
      return ReceiveResult::kBusy;
    }
    receiving_ = Receiver::kCaller;
  }
  const ReceiveResult r = ReceiveAndDispatch(timeout);
  {
    absl::MutexLock lock(&receive_mu_);
    receiving_ = Receiver::kNone;
    caller_received_ = absl::Now();
    if (receiver_wanted_) receiver_cv_.Signal();
  }
  return r;
}

Node::ReceiveResult Node::ReceiveAndDispatch(absl::Duration timeout) {
  // Messages held before StartDelivery go first, to keep order.
  std::vector<Message> early;
  {
    absl::MutexLock lock(&mu_);
    if (deliver_ && !held_.empty()) early.swap(held_);
  }
  for (Message& m : early) {
    if (callbacks_.on_data) callbacks_.on_data(std::move(m));
  }
  absl::StatusOr<Message> msg = transport_->Receive(timeout);
  if (!msg.ok()) {
    if (absl::IsDeadlineExceeded(msg.status())) return ReceiveResult::kTimedOut;
    // Cancelled after Close; any other error is the transport's failure.
    return ReceiveResult::kClosed;
  }
  if (msg->header.sender() == kSchedulerId) {
    absl::MutexLock lock(&mu_);
    last_scheduler_contact_ = absl::Now();
  }
  if (msg->header.plane() != wire::DATA) {
    HandleControl(*std::move(msg));
    return ReceiveResult::kReceived;
  }
  if (options_.drop_percent > 0) {
    // PS_DROP_MSG: lose some data-plane messages on purpose (tests of
    // the resend path). xorshift32, seeded per process.
    if (drop_state_ == 0) drop_state_ = static_cast<uint32_t>(getpid()) | 1;
    drop_state_ ^= drop_state_ << 13;
    drop_state_ ^= drop_state_ >> 17;
    drop_state_ ^= drop_state_ << 5;
    if (static_cast<int>(drop_state_ % 100) < options_.drop_percent) {
      TESSERA_VLOG(2) << "PS_DROP_MSG dropped " << DebugString(*msg);
      return ReceiveResult::kReceived;
    }
  }
  bool direct = false;
  std::vector<Message> ready;
  {
    absl::MutexLock lock(&mu_);
    // Once delivery started and what was held went, messages go straight to
    // the owner (only the receiving thread adds to held_).
    direct = deliver_ && held_.empty();
    if (!direct) {
      held_.push_back(*std::move(msg));
      if (deliver_) ready.swap(held_);
    }
  }
  if (!callbacks_.on_data) return ReceiveResult::kReceived;
  if (direct) callbacks_.on_data(*std::move(msg));
  for (Message& m : ready) callbacks_.on_data(std::move(m));
  return ReceiveResult::kReceived;
}

void Node::HandleControl(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.sender() != kSchedulerId) {
    TESSERA_LOG(WARNING) << "ignored control message from node " << h.sender()
                         << ": " << DebugString(msg);
    return;
  }
  TESSERA_VLOG(1) << "control: " << DebugString(msg);
  // What ends the job, and node tables, are kept by the scheduler until
  // acknowledged; every copy is acknowledged (an acknowledgement can be lost
  // too).
  auto acknowledge = [this, &h] {
    Message ack;
    ack.header.set_command(h.command());
    ack.header.set_request_id(h.request_id());
    ack.header.set_is_response(true);
    (void)SendControl(std::move(ack));
  };
  switch (h.command()) {
    case wire::NODE_TABLE: {
      // A table after the first says which peers restarted.
      bool update = false;
      {
        absl::MutexLock lock(&mu_);
        update = have_table_;
      }
      if (update) {
        UpdateTable(h.node_table());
        acknowledge();
        return;
      }
      absl::MutexLock lock(&mu_);
      if (have_table_) return;
      int my_id = 0, my_rank = -1;
      for (const wire::NodeInfo& n : h.node_table().nodes()) {
        nodes_[n.id()] = n;
        if (n.host() == address_ && n.port() == port_) {
          my_id = n.id();
          my_rank = n.rank();
        }
      }
      if (my_id == 0) {
        TESSERA_LOG(WARNING) << "node table does not list this node ("
                             << address_ << ":" << port_ << "); ignored";
        return;
      }
      // The key partition has one part per server rank: a node counting
      // other ranks than the job would send keys to the wrong servers.
      const int job_servers = h.node_table().num_servers();
      if (job_servers != 0 && job_servers != options_.num_servers) {
        failure_ = absl::InvalidArgumentError(absl::StrCat(
            "the job has ", job_servers,
            " server rank(s) but this node was "
            "started with ",
            options_.num_servers,
            " (DMLC_NUM_SERVER, and TESSERA_MAX_SERVERS when set, must be the "
            "scheduler's on every node)"));
        TESSERA_LOG(ERROR) << failure_.message();
        return;
      }
      id_ = my_id;
      rank_ = my_rank;
      // A worker joining an elastic job gets a generation of its own (its
      // rank's earlier life, if any, had a lower one): its messages are told
      // from that life's by it, as a restarted node's are.
      generation_.store(std::max<uint64_t>(options_.restart_count,
                                           nodes_[my_id].generation()));
      // The peers' node keys go to the transport before anything is sent
      // under this id (the acknowledgement below is sealed with them) and
      // before Join connects to the peers.
      InstallSchedulerIdentity(h.node_table());
      for (const auto& [peer, info] : nodes_) {
        if (WantsLink(peer) && !info.dead()) InstallIdentity(info);
      }
      have_table_ = true;
    }
      // Confirms that the scheduler's messages reach the address this node
      // advertises.
      acknowledge();
      return;
    case wire::BARRIER:
    case wire::WORKER_DONE:
    case wire::WORKER_LEAVE:
    case wire::SERVER_LEAVE:
    case wire::HEARTBEAT: {
      if (!h.is_response()) return;
      absl::MutexLock lock(&mu_);
      auto it = waiters_.find(h.request_id());
      if (it != waiters_.end()) {
        it->second.done = true;
        it->second.status = FromWire(h.status());
      }
      return;
    }
    case wire::NODE_DEAD: {
      // As for TERMINATE below: acknowledged before the failure is seen.
      acknowledge();
      const wire::NodeInfo& dead = h.node_dead().node();
      Fail(absl::UnavailableError(
          absl::StrCat(dead.role() == wire::SERVER ? "server " : "worker ",
                       dead.rank(), " (id ", dead.id(), " at ", dead.host(),
                       ":", dead.port(), ") died: ", h.node_dead().reason())));
      return;
    }
    case wire::ABORT: {
      // Only an abort for this node: sent to its id, or answering its
      // registration (it may have an id by the time that answer comes). The
      // scheduler aborts registrations at the address they name, which may
      // be another node's (issue #46).
      const bool mine =
          (id_ != 0 && h.recipient() == id_) ||
          absl::c_linear_search(h.abort().registrations(), nonce_);
      if (!mine) {
        const uint64_t n = ++foreign_aborts_;
        if (n <= 10 || n % 1000 == 0) {
          TESSERA_LOG(WARNING)
              << "ignored abort #" << n << " for "
              << (id_ != 0 ? absl::StrCat("node id ", h.recipient())
                           : std::string("another registration"))
              << " (this node: "
              << (id_ != 0 ? absl::StrCat("id ", id_)
                           : std::string("no id yet"))
              << "): " << h.abort().reason();
        }
        return;
      }
      acknowledge();
      Fail(absl::AbortedError(
          absl::StrCat("the scheduler ended the job: ", h.abort().reason())));
      return;
    }
    case wire::HANDBACK:
      acknowledge();
      if (callbacks_.on_handback)
        callbacks_.on_handback(h.handback_rank(), h.handback_epoch(),
                               h.handback_leave());
      return;
    case wire::TERMINATE: {
      // Acknowledge first: the thread waiting for the end may close the
      // transport as soon as it sees terminated_, and the acknowledgement
      // would then never leave (the scheduler waits out its deadline).
      acknowledge();
      {
        absl::MutexLock lock(&mu_);
        terminated_ = true;
      }
      return;
    }
    default:
      TESSERA_LOG(WARNING) << "ignored unexpected control message "
                           << DebugString(msg);
  }
}

void Node::HeartbeatLoop() {
  const absl::Duration interval = options_.heartbeat_interval;
  const absl::Duration timeout = options_.heartbeat_timeout;
  absl::Time next = absl::Now();
  while (!stop_.load()) {
    absl::Status failed;
    bool beat = false;
    {
      absl::MutexLock lock(&mu_);
      if (terminated_ || !failure_.ok() || stopping_) return;
      const absl::Time now = absl::Now();
      const absl::Duration silent = now - last_scheduler_contact_;
      if (silent > timeout && part_done_) {
        // This node's work is complete (a worker the scheduler counted as
        // done, a server every worker said goodbye to): a scheduler lost
        // after that does not make a finished job a failure.
        TESSERA_LOG(WARNING)
            << "the scheduler (id 1 at " << scheduler_address_
            << ") went silent for " << absl::FormatDuration(silent)
            << " after this node finished its part; leaving without failure";
        terminated_ = true;
        return;
      }
      if (silent > timeout) {
        failed = absl::UnavailableError(
            absl::StrCat("the scheduler (id 1 at ", scheduler_address_,
                         ") stopped answering heartbeats for ",
                         absl::FormatDuration(silent)));
      } else if (now >= next) {
        next = now + interval;
        beat = true;
      } else {
        // Sleep until the next heartbeat is due or the silence would pass
        // the time-out, whichever is first (Stop wakes it): one wake-up per
        // interval, not 20 a second, which adds up with hundreds of
        // processes on one machine.
        heartbeat_cv_.WaitWithDeadline(
            &mu_, std::min(next, last_scheduler_contact_ + timeout +
                                     absl::Milliseconds(1)));
        continue;
      }
    }
    if (!failed.ok()) {
      Fail(failed);
      return;
    }
    if (beat) {
      Message hb;
      hb.header.set_command(wire::HEARTBEAT);
      hb.header.set_request_id(next_request_.fetch_add(1));
      if (SendControl(std::move(hb)).ok()) heartbeats_sent_->Increment();
      bool report = false;
      uint64_t handback = 0;
      {
        absl::MutexLock lock(&mu_);
        report = report_caught_up_;
        handback = report_handback_;
      }
      if (handback != 0) {
        Message done;
        done.header.set_command(wire::HANDBACK);
        done.header.set_request_id(next_request_.fetch_add(1));
        done.header.set_handback_epoch(handback);
        (void)SendControl(std::move(done));
      }
      if (report) {
        // Until the table says so: the first report may have been lost.
        Message caught_up;
        caught_up.header.set_command(wire::CAUGHT_UP);
        caught_up.header.set_request_id(next_request_.fetch_add(1));
        (void)SendControl(std::move(caught_up));
      }
    }
  }
}

}  // namespace tessera

#include "scheduler/scheduler.h"

#include <sys/resource.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/curve_keys.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/replica_chain.h"
#include "common/sealed_link.h"
#include "common/trace.h"
#include "common/wire_status.h"

namespace tessera {
namespace {

constexpr int kProvisionalBase = 1000000;

// The start of a sealed node key (32 raw bytes) in hex, for log lines.
std::string SealedKeyText(const std::string& key) {
  return absl::StrCat(absl::BytesToHexString(key.substr(0, 6)), "...");
}

// The id under which the scheduler talks to a node that has registered but has
// no id yet. Like a real id, its parity says the node's role (even: a server,
// odd: a worker), which a secured transport needs to pick the key the node's
// socket must prove it holds.
int ProvisionalId(int index, wire::Role role) {
  return kProvisionalBase + 2 * index + (role == wire::WORKER ? 1 : 0);
}
// Indexes of the provisional ids used for a moment to turn a node away.
constexpr int kLateIndex = 499998;
constexpr int kFinishedIndex = 499999;
// Spares' provisional ids count down from here (one per spare of the job).
constexpr int kSpareIndex = 499997;

Message AbortMessage(const std::string& reason) {
  Message abort;
  abort.header.set_command(wire::ABORT);
  abort.header.set_sender(kSchedulerId);
  abort.header.set_plane(wire::CONTROL);
  abort.header.mutable_abort()->set_reason(reason);
  return abort;
}

}  // namespace

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

Scheduler::Metrics::Metrics() {
  MetricsRegistry& r = MetricsRegistry::Global();
  heartbeats = r.GetCounter("tessera_scheduler_heartbeats_received_total",
                            "Heartbeats received from servers and workers.");
  dead_nodes = r.GetCounter(
      "tessera_scheduler_dead_nodes_total",
      "Nodes declared dead for want of heartbeats (each ends the job, but "
      "a server of a replicated job whose slices have a live replica and a "
      "worker of an elastic job while enough remain).");
  failovers = r.GetCounter(
      "tessera_scheduler_failovers_total",
      "Servers declared dead (or that left) whose key slices failed over to "
      "a replica (TESSERA_REPLICAS > 1).");
  servers_left = r.GetCounter(
      "tessera_scheduler_servers_left_total",
      "Servers of a replicated job that left it (SIGTERM: SERVER_LEAVE), "
      "their key slices failing over to a replica.");
  replacements = r.GetCounter(
      "tessera_scheduler_replacements_total",
      "Dead servers whose rank a spare or a restarted server took "
      "(TESSERA_REPLICAS > 1; it then catches up by state transfer).");
  handbacks = r.GetCounter(
      "tessera_scheduler_handbacks_total",
      "Replacement servers that took back their place in their key slices' "
      "chains once caught up (a hand-back at a round boundary; "
      "TESSERA_REPLICAS > 1).");
  handback_retries = r.GetCounter(
      "tessera_scheduler_handback_retries_total",
      "Hand-backs started again because a server had not reported its part "
      "within 10 s (a lost report, or a round boundary that did not come).");
  spares = r.GetGauge("tessera_scheduler_spare_servers",
                      "Spare servers (TESSERA_SPARE=1) waiting for a server "
                      "to die.");
  barriers_released = r.GetCounter("tessera_scheduler_barriers_released_total",
                                   "Barriers released (once per group).");
  notice_resends = r.GetCounter(
      "tessera_scheduler_notice_resends_total",
      "Notices (node tables, the job's end) sent again for want of an "
      "acknowledgement.");
  ignored_messages = r.GetCounter(
      "tessera_scheduler_ignored_messages_total",
      "Messages the scheduler dropped: data-plane messages, malformed "
      "registrations.");
  registrations = r.GetCounter(
      "tessera_scheduler_registrations_total",
      "Registrations received (first lives, restarts and repeats).");
  registered_servers =
      r.GetGauge("tessera_scheduler_registered_nodes",
                 "Nodes registered, by role.", {{"role", "server"}});
  registered_workers =
      r.GetGauge("tessera_scheduler_registered_nodes",
                 "Nodes registered, by role.", {{"role", "worker"}});
  finished_workers = r.GetGauge("tessera_scheduler_finished_workers",
                                "Workers that have finished their work.");
  workers_in_job = r.GetGauge(
      "tessera_scheduler_workers_in_job",
      "Workers in the job's membership: registered and not left (an elastic "
      "job's workers leave by goodbye or death, TESSERA_ELASTIC).");
  workers_joined = r.GetCounter(
      "tessera_scheduler_workers_joined_total",
      "Workers that joined an elastic job (TESSERA_ELASTIC) while it ran.");
  workers_left = r.GetCounter(
      "tessera_scheduler_workers_left_total",
      "Workers of an elastic job (TESSERA_ELASTIC) that left while it ran: "
      "said goodbye or were declared dead.");
  formed = r.GetGauge("tessera_scheduler_job_formed",
                      "1 once every node registered and got the node table.");
  oldest_heartbeat_age = r.GetGauge(
      "tessera_scheduler_oldest_heartbeat_age_seconds",
      "Seconds since the node heard from longest ago was last heard from "
      "(a node is declared dead past PS_HEARTBEAT_TIMEOUT).");
}

Scheduler::Scheduler(const Options& options,
                     std::unique_ptr<Transport> transport)
    : options_(options),
      transport_(std::move(transport)),
      notices_(
          Notices::Settings{options.resend, options.resend_timeout,
                            kSchedulerId, kProvisionalBase},
          [this](int peer, const Message& msg) {
            return transport_->Send(peer, msg);
          },
          [this](int peer) { return DescribePeer(peer); },
          metrics_.notice_resends),
      barriers_(
          Barriers::Membership{
              [this](int group) { return ExpectedInBarrier(group); },
              [this] { return static_cast<int>(done_workers_.size()); },
              [this](int group) { return MissingFromBarrier(group); }},
          Barriers::Settings{options.late_min, options.late_factor},
          [this](int peer, uint64_t request_id) {
            wire::Header request;
            request.set_command(wire::BARRIER);
            request.set_request_id(request_id);
            Reply(peer, request, absl::OkStatus());
          },
          metrics_.barriers_released) {}

Scheduler::~Scheduler() {
  metrics_http_.reset();
  metric_handles_.clear();
  if (transport_ != nullptr) transport_->Close();
}

absl::StatusOr<int> Scheduler::Bind() {
  if (absl::Status traced = trace::StartFromEnvironment("scheduler");
      !traced.ok()) {
    return traced;
  }
  trace::SetIdentity("scheduler", 0);
  trace::SetThreadName("scheduler");
  if (transport_ == nullptr) {
    absl::StatusOr<std::unique_ptr<Transport>> made =
        NewZmqTransportForNode(options_);
    if (!made.ok()) return made.status();
    transport_ = *std::move(made);
  }
  absl::StatusOr<std::string> ip = ResolveHost(options_.root_uri);
  if (!ip.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DMLC_PS_ROOT_URI='", options_.root_uri, "': ", ip.status().message()));
  }
  absl::StatusOr<int> port = transport_->Bind(*ip, options_.root_port);
  if (!port.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DMLC_PS_ROOT_PORT=", options_.root_port, " (DMLC_PS_ROOT_URI='",
        options_.root_uri, "'): ", port.status().message()));
  }
  bound_address_ = absl::StrCat(*ip, ":", *port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      StartMetricsServer(options_, *ip);
  if (!http.ok()) return http.status();
  metrics_http_ = *std::move(http);
  metric_handles_ =
      AddTransportCollectors(&MetricsRegistry::Global(), transport_.get());
  pending_section_ = DebugPendingRegistry::Global().Add(
      [this](wire::DebugPending* out) { FillPending(out); });
  InstallPendingDump();
  TESSERA_VLOG(1) << "scheduler listening on " << bound_address_
                  << ", waiting for " << options_.servers_at_start()
                  << " server(s) and " << options_.num_workers << " worker(s)";
  return port;
}

std::string Scheduler::Describe(const wire::NodeInfo& n) const {
  return absl::StrCat(n.role() == wire::SERVER ? "server " : "worker ",
                      n.rank(), " (id ", n.id(), " at ", n.host(), ":",
                      n.port(), ")");
}

std::string Scheduler::MissingNodes() const {
  int servers = 0, workers = 0;
  for (const Registration& r : registered_) {
    (r.info.role() == wire::SERVER ? servers : workers)++;
  }
  std::string missing;
  if (workers < options_.num_workers) {
    absl::StrAppend(&missing, options_.num_workers - workers, " of ",
                    options_.num_workers, " worker(s)");
  }
  if (servers < options_.servers_at_start()) {
    absl::StrAppend(&missing, missing.empty() ? "" : " and ",
                    options_.servers_at_start() - servers, " of ",
                    options_.servers_at_start(), " server(s)");
  }
  return missing;
}

absl::Status Scheduler::Run() {
  const absl::Time start = absl::Now();
  last_formation_report_ = start;
  while (true) {
    absl::StatusOr<Message> msg = transport_->Receive(absl::Milliseconds(50));
    if (msg.ok()) {
      Handle(*std::move(msg));
    } else if (absl::IsCancelled(msg.status())) {
      return absl::CancelledError("scheduler stopped");
    }
    const absl::Time now = absl::Now();
    notices_.ResendDue(now);
    if (pending_wanted_.load(std::memory_order_relaxed)) MakePending(now);
    if (ended_) {
      if (!Ending(now)) {
        // Every node acknowledged the end (or the deadline passed): what is
        // still queued (answers to the last heartbeats of nodes that have
        // left) can only wait out the linger.
        transport_->DiscardUnsent();
        TESSERA_LOG(INFO) << "handled " << received_ << " messages ("
                          << heartbeats_ << " heartbeats) in "
                          << absl::FormatDuration(absl::Trunc(
                                 now - start, absl::Milliseconds(1)))
                          << ", " << ThreadCpuMillis()
                          << " ms of CPU on the scheduler's thread";
        return result_;
      }
      continue;
    }
    if (!formed_ && now - start > options_.start_timeout) {
      const std::string reason = absl::StrCat(
          "start-up deadline of ", absl::FormatDuration(options_.start_timeout),
          " passed: ", MissingNodes(),
          " never registered (TESSERA_START_TIMEOUT)");
      std::vector<int> peers;
      for (const Registration& r : registered_) {
        // Registered nodes are linked to only now, to be told.
        if (LinkTo(r.provisional_id, r.info).ok()) {
          peers.push_back(r.provisional_id);
        }
      }
      EndJob(absl::DeadlineExceededError(reason), AbortMessage(reason), peers);
      continue;
    }
    if (!formed_ && now - last_formation_report_ >= kFormationReportInterval) {
      // A slow formation says what it waits for, so that a user who started
      // too few nodes (or whose nodes cannot reach us) sees it before the
      // deadline ends the job.
      last_formation_report_ = now;
      TESSERA_LOG(INFO) << "waiting for " << MissingNodes() << " to register ("
                        << absl::FormatDuration(
                               absl::Trunc(now - start, absl::Seconds(1)))
                        << " so far; start-up deadline "
                        << absl::FormatDuration(options_.start_timeout)
                        << ", TESSERA_START_TIMEOUT)";
    }
    if (formed_ && !unconfirmed_at_formation_.empty() &&
        now > std::max(start + options_.start_timeout,
                       formed_at_ + absl::Seconds(2))) {
      // A node registered, so it reaches us; we never heard it confirm the
      // table, so we do not reach it: the address it advertises is wrong for
      // this network. (The nodes of the formed job only: one that joins or
      // takes a rank later is not held to the start-up deadline.)
      std::string unconfirmed;
      for (int id : unconfirmed_at_formation_) {
        absl::StrAppend(&unconfirmed, unconfirmed.empty() ? "" : ", ",
                        Describe(nodes_[id]));
      }
      const std::string reason = absl::StrCat(
          "start-up deadline of ", absl::FormatDuration(options_.start_timeout),
          " passed: the scheduler cannot reach the address advertised by ",
          unconfirmed, " (check DMLC_INTERFACE / DMLC_NODE_HOST on that host)");
      // Only the nodes that confirmed can hear (and acknowledge) the abort.
      EndJob(absl::DeadlineExceededError(reason), AbortMessage(reason),
             std::vector<int>(confirmed_.begin(), confirmed_.end()));
      continue;
    }
    if (formed_ && now - last_late_check_ >= kLivenessEvery) {
      last_late_check_ = now;
      barriers_.CheckLate(now);
      if (handback_ && now - handback_->started >= options_.handback_retry)
        RetryHandback(now);
    }
    if (formed_ && options_.heartbeat_interval > absl::ZeroDuration() &&
        now - last_liveness_check_ >= kLivenessEvery) {
      last_liveness_check_ = now;
      CheckLiveness(now);
      if (!ended_) CheckLostLinks(now);
    }
  }
}

bool Scheduler::Acknowledged(const wire::Header& h) {
  std::optional<Message> acknowledged = notices_.Acknowledge(h);
  if (!acknowledged) return false;
  std::vector<int> ready;
  if (!join_waits_.empty() && h.command() == wire::NODE_TABLE) {
    // A server holding a joining worker's entry (this change, or a later one
    // that replaced it): the joiner's table may go once every server does.
    for (const wire::NodeInfo& n : acknowledged->header.node_table().nodes()) {
      auto waiting = join_waits_.find(n.id());
      auto node = nodes_.find(n.id());
      if (waiting == join_waits_.end() || node == nodes_.end() ||
          n.generation() < node->second.generation()) {
        continue;
      }
      if (waiting->second.erase(h.sender()) != 0 && waiting->second.empty())
        ready.push_back(n.id());
    }
  }
  for (int joiner : ready) SendJoinerTable(joiner);
  return true;
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
    const int provisional = ProvisionalId(kLateIndex, r.info.role());
    if (LinkTo(provisional, r.info).ok()) {
      (void)transport_->Send(provisional, AbortMessage(why));
      transport_->Disconnect(provisional);
    }
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

void Scheduler::EndJob(const absl::Status& result, const Message& end,
                       const std::vector<int>& peers) {
  ended_ = true;
  result_ = result;
  end_reason_ = end.header.command() == wire::TERMINATE
                    ? "the job has already ended"
                    : std::string(result.message());
  end_deadline_ = absl::Now() + options_.heartbeat_timeout;
  notices_.Clear();  // tables no longer matter
  for (int peer : peers) notices_.Send(peer, end);
  // Spares never joined: told once over a link of a moment (a spare that
  // misses it is stopped by its launcher).
  for (const Registration& spare : spares_) {
    if (!LinkTo(spare.provisional_id, spare.info).ok()) continue;
    Message told = end.header.command() == wire::TERMINATE
                       ? end
                       : AbortMessage(end_reason_);
    if (end.header.command() == wire::TERMINATE) {
      told.header.set_recipient(spare.provisional_id);
      told.header.set_sender(kSchedulerId);
      told.header.set_plane(wire::CONTROL);
    }
    (void)transport_->Send(spare.provisional_id, told);
  }
  spares_.clear();
  metrics_.spares->Set(0);
}

bool Scheduler::Ending(absl::Time now) {
  if (notices_.empty()) return false;
  if (now < end_deadline_) return true;
  // At most kNamed nodes by name: a job of thousands would log a page.
  constexpr size_t kNamed = 20;
  std::string silent;
  for (int peer : notices_.Peers(kNamed))
    absl::StrAppend(&silent, silent.empty() ? "" : ", ", DescribePeer(peer));
  if (notices_.size() > kNamed)
    absl::StrAppend(&silent, " and ", notices_.size() - kNamed, " more");
  TESSERA_LOG(WARNING) << "leaving without an acknowledgement of the job's "
                          "end from "
                       << silent << " within "
                       << absl::FormatDuration(options_.heartbeat_timeout)
                       << " (PS_HEARTBEAT_TIMEOUT)";
  return false;
}

std::string Scheduler::SealedKeyHolder(const std::string& key) const {
  if (key.empty()) return std::string();
  if (key == transport_->node_key()) return "the scheduler";
  auto it = sealed_key_holder_.find(key);
  if (it == sealed_key_holder_.end()) return std::string();
  if (it->second == kRetiredKey) return "an earlier life of a node";
  return DescribePeer(it->second);
}

std::string Scheduler::DescribePeer(int id) const {
  auto it = nodes_.find(id);
  if (it != nodes_.end()) return Describe(it->second);
  for (const Registration& r : registered_) {
    if (r.provisional_id == id) {
      return absl::StrCat("the node at ", r.info.host(), ":", r.info.port());
    }
  }
  return absl::StrCat("node ", id);
}

void Scheduler::Handle(Message&& msg) {
  const wire::Header& h = msg.header;
  ++received_;
  if (h.plane() != wire::CONTROL) {
    ++malformed_;
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a data-plane message: "
                         << DebugString(msg);
    return;
  }
  if (h.command() == wire::REGISTER) {
    HandleRegister(msg);
    return;
  }
  const bool acknowledgement = h.is_response() && Acknowledged(h);
  const int sender = h.sender();
  if (!formed_ || nodes_.count(sender) == 0) {
    if (!acknowledgement) {
      TESSERA_LOG(WARNING) << "ignored message from unknown node " << sender
                           << ": " << DebugString(msg);
    }
    return;
  }
  if (nodes_[sender].dead()) {
    if (nodes_[sender].left()) {
      // Its goodbye was taken: a repeat of it (the answer was lost) is
      // answered again; what else it sends while it stops (a heartbeat) is
      // not its business any more, nor an abort's.
      if (h.command() == wire::WORKER_LEAVE ||
          h.command() == wire::SERVER_LEAVE) {
        Reply(sender, h, absl::OkStatus());
      }
      return;
    }
    // Declared dead, yet it speaks (it was cut off, not gone): its slices
    // answer elsewhere now (its rounds go on without it), so it must not go
    // on. Told at each message.
    if (!acknowledgement) {
      Message abort = AbortMessage(
          nodes_[sender].role() == wire::WORKER
              ? "this worker was declared dead (silent past "
                "PS_HEARTBEAT_TIMEOUT) and left the job (TESSERA_ELASTIC); "
                "the rounds go on without it"
              : "this server was declared dead (silent past "
                "PS_HEARTBEAT_TIMEOUT) and its key slices failed over to "
                "their replicas");
      abort.header.set_recipient(sender);
      (void)transport_->Send(sender, abort);
    }
    return;
  }
  last_seen_[sender] = absl::Now();
  // A node learns its id from the table, so any message sent under that id
  // confirms the table arrived, even when the NODE_TABLE reply itself was
  // lost with a connection that `ss -K` or a partition broke.
  confirmed_.insert(sender);
  unconfirmed_at_formation_.erase(sender);
  switch (h.command()) {
    case wire::NODE_TABLE:
    case wire::TERMINATE:
    case wire::ABORT:
    case wire::NODE_DEAD:
      if (!acknowledgement && h.request_id() != 0) {
        TESSERA_VLOG(1) << "a repeated acknowledgement: " << DebugString(msg);
      }
      return;
    case wire::CAUGHT_UP:
      CaughtUp(sender);
      return;
    case wire::HANDBACK:
      if (!acknowledgement && !h.is_response())
        HandbackDone(sender, h.handback_epoch());
      return;
    case wire::HEARTBEAT:
      ++heartbeats_;
      metrics_.heartbeats->Increment();
      Reply(sender, h, absl::OkStatus());
      return;
    case wire::BARRIER:
      HandleBarrier(sender, h);
      return;
    case wire::WORKER_DONE:
      HandleWorkerDone(sender, h);
      return;
    case wire::WORKER_LEAVE:
      if (!IsWorkerId(sender) || !options_.elastic()) {
        Reply(sender, h,
              absl::FailedPreconditionError(
                  "only a worker of an elastic job (TESSERA_ELASTIC) leaves "
                  "before the job's end"));
        return;
      }
      if (done_workers_.count(sender) != 0) {
        Reply(sender, h, absl::OkStatus());  // finished: nothing to leave
        return;
      }
      WorkerLeaves(sender, /*goodbye=*/true, "left the job (it said goodbye)");
      // Its part is done, even when the others' job ends for want of
      // workers now.
      Reply(sender, h, absl::OkStatus());
      return;
    case wire::SERVER_LEAVE:
      HandleServerLeave(sender, h);
      return;
    default:
      TESSERA_LOG(WARNING) << "ignored unexpected message " << DebugString(msg);
  }
}

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

void Scheduler::HandleBarrier(int sender, const wire::Header& h) {
  const int group = h.barrier().group();
  if (group <= 0 || group > kGroupAll) {
    Reply(
        sender, h,
        absl::InvalidArgumentError(absl::StrCat("bad barrier group ", group)));
    return;
  }
  const bool member = (IsServerId(sender) && (group & kGroupServers)) ||
                      (IsWorkerId(sender) && (group & kGroupWorkers));
  if (!member) {
    Reply(sender, h,
          absl::InvalidArgumentError("node is not in the barrier's group"));
    return;
  }
  barriers_.Enter(sender, h.request_id(), group, h.barrier().tag(),
                  h.barrier().join_if_open());
}

std::vector<std::string> Scheduler::MissingFromBarrier(int group) const {
  std::vector<std::string> missing;
  for (const auto& [id, n] : nodes_) {
    const bool member = (n.role() == wire::SERVER && (group & kGroupServers)) ||
                        (n.role() == wire::WORKER && (group & kGroupWorkers));
    if (!member || done_workers_.count(id) != 0 || n.dead()) continue;
    if (barriers_.Waits(group, id)) continue;
    missing.push_back(Describe(n));
  }
  return missing;
}

void Scheduler::MakePending(absl::Time now) {
  wire::DebugPending p;
  p.set_role("scheduler");
  p.set_id(kSchedulerId);
  p.set_host(bound_address_);
  barriers_.Fill(&p, now);
  for (const auto& [id, n] : nodes_) {
    wire::NodeStatus* s = p.add_nodes();
    s->set_id(id);
    s->set_role(n.role() == wire::SERVER ? "server" : "worker");
    s->set_rank(n.rank());
    s->set_host(n.host());
    s->set_port(n.port());
    s->set_generation(n.generation());
    if (n.metrics_port() > 0) {
      s->set_metrics_url(
          absl::StrContains(n.host(), ':')
              ? absl::StrCat("http://[", n.host(), "]:", n.metrics_port())
              : absl::StrCat("http://", n.host(), ":", n.metrics_port()));
    }
    auto seen = last_seen_.find(id);
    if (seen != last_seen_.end())
      s->set_last_heard_s(absl::ToDoubleSeconds(now - seen->second));
  }
  absl::MutexLock lock(&pending_mu_);
  pending_ = std::move(p);
  pending_made_ = pending_asked_;
  pending_made_at_ = absl::Now();
  pending_wanted_.store(false, std::memory_order_relaxed);
  pending_cv_.SignalAll();
}

void Scheduler::FillPending(wire::DebugPending* out) {
  absl::MutexLock lock(&pending_mu_);
  // At most one a second is made: asking often costs Run nothing more.
  if (pending_made_ > 0 && absl::Now() - pending_made_at_ < absl::Seconds(1)) {
    out->MergeFrom(pending_);
    return;
  }
  const uint64_t ticket = ++pending_asked_;
  pending_wanted_.store(true, std::memory_order_relaxed);
  // Run makes it between two messages (within its 50 ms receive); a
  // scheduler that has stopped leaves the last one (or none).
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  while (pending_made_ < ticket) {
    if (pending_cv_.WaitWithDeadline(&pending_mu_, deadline)) break;
  }
  out->MergeFrom(pending_);
  out->set_role("scheduler");
  out->set_id(kSchedulerId);
}

void Scheduler::HandleWorkerDone(int sender, const wire::Header& h) {
  if (!IsWorkerId(sender)) {
    Reply(sender, h, absl::InvalidArgumentError("only workers finish"));
    return;
  }
  done_workers_.insert(sender);
  metrics_.finished_workers->Set(static_cast<double>(done_workers_.size()));
  Reply(sender, h, absl::OkStatus());
  TESSERA_VLOG(1) << Describe(nodes_[sender]) << " finished ("
                  << done_workers_.size() << "/" << options_.num_workers << ")";
  if (!ended_ && AllWorkersDone()) {
    Message term;
    term.header.set_command(wire::TERMINATE);
    TESSERA_VLOG(1) << "all workers finished; job done";
    EndJob(absl::OkStatus(), term, LivePeers(/*except=*/0));
  }
}

void Scheduler::HandleRegister(const Message& msg) {
  const wire::Register& reg = msg.header.register_();
  const wire::NodeInfo& info = reg.node();
  metrics_.registrations->Increment();
  if ((info.role() != wire::SERVER && info.role() != wire::WORKER) ||
      info.host().empty() || info.port() <= 0 || info.port() > 65535) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored malformed registration: "
                         << DebugString(msg);
    return;
  }
  if (ended_ && !formed_) {
    // Registered before the start-up deadline and asks again for its table:
    // the abort notice it was sent reaches it (or is resent).
    if (registered_at_.count({info.host(), info.port()}) != 0) return;
  }
  if (ended_) {
    // Too late for this job (a node started or restarted after its end was
    // decided): told once per registration; it registers again if the abort
    // is lost.
    const int provisional = ProvisionalId(kLateIndex, info.role());
    if (LinkTo(provisional, info).ok()) {
      (void)transport_->Send(provisional, AbortMessage(end_reason_));
      transport_->Disconnect(provisional);
    }
    return;
  }
  // A node registers with a key of its own (launch.py's), or with its
  // role's, which the transport allows only when the job has no roster.
  const std::string& key = msg.connection_key;
  if (key.empty() && transport_->nodes_have_own_keys()) {
    // The transport lets no such registration through (a role key's is
    // dropped, a sealed one too); should one come, it names no node.
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port()
                         << " without a connection key: every node of this "
                            "job registers with a key of its own";
    return;
  }
  if (!transport_->node_key().empty()) {
    // A sealed job: the key its peers will seal to it with. Stored keys are
    // canonical, so that comparing bytes compares keys.
    if (std::string problem = sealed::NodeKeyProblem(info.node_key());
        !problem.empty()) {
      metrics_.ignored_messages->Increment();
      TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                           << info.port() << ": its sealed node key "
                           << SealedKeyText(info.node_key())
                           << " cannot be a node key: " << problem;
      return;
    }
  }
  if (formed_) {
    for (auto& [id, node] : nodes_) {
      if (node.role() != info.role() || node.host() != info.host() ||
          node.port() != info.port()) {
        continue;
      }
      auto known = node_key_of_.find(id);
      if (known != node_key_of_.end() && known->second != key) {
        metrics_.ignored_messages->Increment();
        TESSERA_LOG(WARNING)
            << "ignored a registration as " << Describe(node) << " (generation "
            << info.generation() << ") with node key "
            << (key.empty() ? "(none)" : KeyPrefix(key))
            << ": that node registered with " << KeyPrefix(known->second);
        return;
      }
      if (info.generation() < node.generation()) return;  // an old life's
      if (info.generation() == node.generation()) {
        // It asks again: the table we sent it was lost with a connection.
        (void)transport_->Send(id, TableMessage(id));
        return;
      }
      if (std::string holder = SealedKeyHolder(info.node_key());
          !holder.empty()) {
        metrics_.ignored_messages->Increment();
        TESSERA_LOG(WARNING)
            << "ignored a registration as " << Describe(node) << " (generation "
            << info.generation() << "): its sealed node key "
            << SealedKeyText(info.node_key()) << " is " << holder << "'s";
        return;
      }
      Rejoin(id, info);
      return;
    }
  }
  if (registered_at_.count({info.host(), info.port()}) != 0)
    return;  // duplicate
  for (const Registration& held : early_joiners_) {
    if (held.info.host() == info.host() && held.info.port() == info.port())
      return;  // held until the job forms; it asks again
  }
  if (!key.empty() && registered_keys_.count(key) != 0) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port() << " with node key " << KeyPrefix(key)
                         << ", which another node registered with";
    return;
  }
  if (std::string holder = SealedKeyHolder(info.node_key()); !holder.empty()) {
    metrics_.ignored_messages->Increment();
    TESSERA_LOG(WARNING) << "ignored a registration at " << info.host() << ":"
                         << info.port() << ": its sealed node key "
                         << SealedKeyText(info.node_key()) << " is " << holder
                         << "'s";
    return;
  }
  Registration r;
  r.info = info;
  r.key = key;
  r.provisional_id =
      reg.spare()
          ? ProvisionalId(kSpareIndex - static_cast<int>(spares_.size()) -
                              static_cast<int>(replacements_),
                          info.role())
          : ProvisionalId(static_cast<int>(registered_.size()), info.role());
  r.hostname = reg.hostname();
  r.pid = reg.pid();
  // A node turned away is told over a link of a moment; one that stays is
  // linked to once, under its id, when the job forms (each link to a node
  // is a handshake: at 288 nodes a second one each cost 0.5 s of CPU).
  auto turn_away = [&](const std::string& why) {
    absl::Status connected = LinkTo(r.provisional_id, info);
    if (!connected.ok()) {
      TESSERA_LOG(WARNING) << "cannot reach registering node at " << info.host()
                           << ":" << info.port() << ": " << connected.message();
      return;
    }
    (void)transport_->Send(r.provisional_id, AbortMessage(why));
    transport_->Disconnect(r.provisional_id);
  };
  if (reg.spare()) {
    if (info.role() != wire::SERVER || options_.chain_length() < 2) {
      turn_away(
          "a spare (TESSERA_SPARE=1) is a server of a job with "
          "TESSERA_REPLICAS >= 2 or TESSERA_MAX_SERVERS; this job has "
          "TESSERA_REPLICAS=" +
          std::to_string(options_.replicas) + " and no TESSERA_MAX_SERVERS");
      return;
    }
    for (const Registration& held : spares_) {
      if (held.info.host() == info.host() && held.info.port() == info.port())
        return;  // it asks again
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
    return;
  }
  if (formed_ && options_.elastic() && info.role() == wire::WORKER) {
    JoinWorker(r, /*id=*/-1);
    return;
  }
  if (formed_) {
    turn_away("the job is already formed; no node of this role is missing");
    return;
  }
  const int count = registered_by_role_[info.role()];
  const int wanted = info.role() == wire::SERVER ? options_.servers_at_start()
                                                 : options_.num_workers;
  if (count >= wanted && options_.elastic() && info.role() == wire::WORKER) {
    // An elastic job's worker past DMLC_NUM_WORKER before the job formed:
    // it joins once the job has formed (at most MAX - DMLC_NUM_WORKER are
    // held).
    if (static_cast<int>(early_joiners_.size()) >=
        options_.elastic_max - options_.num_workers) {
      turn_away(absl::StrCat("the job will have its most workers, ",
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
    turn_away(absl::StrCat("too many ",
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

void Scheduler::Rejoin(int id, const wire::NodeInfo& info) {
  wire::NodeInfo& node = nodes_[id];
  if (node.role() == wire::SERVER && options_.chain_length() > 1) {
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
      Message abort = AbortMessage(absl::StrCat(
          "a spare took the rank of ", Describe(node), "; not needed"));
      const int provisional = ProvisionalId(kFinishedIndex, info.role());
      if (LinkTo(provisional, info).ok()) {
        (void)transport_->Send(provisional, abort);
        transport_->Disconnect(provisional);
      }
      return;
    }
    Registration r;
    r.info = info;
    r.key = node_key_of_.count(id) != 0 ? node_key_of_[id] : std::string();
    Replace(id, r);
    return;
  }
  if (node.dead() && node.role() == wire::WORKER && options_.elastic()) {
    // A worker of an elastic job that left, started again: it joins anew
    // under its old rank (if still free).
    Registration r;
    r.info = info;
    r.key = node_key_of_.count(id) != 0 ? node_key_of_[id] : std::string();
    JoinWorker(r, id);
    return;
  }
  if (node.dead()) {
    // Its slices failed over to their replicas; an empty server cannot take
    // them back (nor yet join as a backup). A worker of an elastic job left
    // the rounds, which went on without it.
    Message abort = AbortMessage(absl::StrCat(
        Describe(node),
        node.role() == wire::WORKER
            ? (node.left() ? " left the job"
                           : " was declared dead and left the job")
            : " was declared dead and its key slices failed over to their "
              "replicas",
        node.role() == wire::WORKER
            ? " (TESSERA_ELASTIC); joining a running job is not supported "
              "yet"
            : "; it cannot rejoin"));
    const int provisional = ProvisionalId(kFinishedIndex, info.role());
    if (LinkTo(provisional, info).ok()) {
      (void)transport_->Send(provisional, abort);
      transport_->Disconnect(provisional);
    }
    return;
  }
  if (done_workers_.count(id) != 0) {
    // It had finished; a new life would wait in barriers nobody else joins.
    Message abort = AbortMessage(absl::StrCat(
        Describe(node), " restarted after it had finished; nothing to rejoin"));
    const int provisional = ProvisionalId(kFinishedIndex, info.role());
    if (LinkTo(provisional, info).ok()) {
      (void)transport_->Send(provisional, abort);
      transport_->Disconnect(provisional);
    }
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

// CPU time (user + system) of the calling thread, in milliseconds: the
// scheduler's own cost per message (ZeroMQ's I/O thread not included).
int64_t Scheduler::ThreadCpuMillis() {
  struct rusage u;
  if (getrusage(RUSAGE_THREAD, &u) != 0) return -1;
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1000 +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1000;
}

// The node table one node needs: the peers it links to (a worker the
// servers, a server the workers) and its own entry, by which it learns its id
// and rank. Workers never talk to workers nor servers to servers, so a job
// sends 2 W S entries when it forms instead of (W + S)^2: at 9,000 workers and
// 1,000 servers 18 million instead of 100 million (docs/capacity.md).
absl::Status Scheduler::LinkTo(int id, const wire::NodeInfo& n) {
  PeerIdentity identity;
  identity.role = n.role() == wire::SERVER ? Role::kServer : Role::kWorker;
  identity.node_key = n.node_key();
  identity.sealed_port = n.sealed_port();
  transport_->SetPeerIdentity(id, identity);
  return transport_->Connect(id, n.host(), n.port());
}

Message Scheduler::TableMessage(int for_id) const {
  Message table;
  table.header.set_command(wire::NODE_TABLE);
  table.header.set_sender(kSchedulerId);
  table.header.set_recipient(for_id);
  table.header.set_plane(wire::CONTROL);
  table.header.mutable_node_table()->set_scheduler_node_key(
      transport_->node_key());
  table.header.mutable_node_table()->set_num_servers(options_.num_servers);
  table.header.mutable_node_table()->set_num_workers(options_.num_workers);
  const wire::Role role = nodes_.at(for_id).role();
  // Replicated jobs: a server sends each update to the next servers.
  const bool servers_link = role == wire::SERVER && options_.chain_length() > 1;
  for (const auto& [peer, n] : nodes_) {
    if (peer == for_id || n.role() != role || servers_link)
      *table.header.mutable_node_table()->add_nodes() = n;
  }
  return table;
}

// A table of one entry, for nodes that hold theirs already: a restarted
// node's new generation (the node reconnects to it).
Message Scheduler::ChangeMessage(const wire::NodeInfo& changed) const {
  Message table;
  table.header.set_command(wire::NODE_TABLE);
  table.header.set_sender(kSchedulerId);
  table.header.set_plane(wire::CONTROL);
  table.header.mutable_node_table()->set_num_servers(options_.num_servers);
  table.header.mutable_node_table()->set_num_workers(options_.num_workers);
  table.header.mutable_node_table()->set_scheduler_node_key(
      transport_->node_key());
  *table.header.mutable_node_table()->add_nodes() = changed;
  return table;
}

void Scheduler::FormJob() {
  std::vector<wire::NodeInfo> infos;
  std::map<std::pair<std::string, int>, std::string> keys;  // by host, port
  for (const Registration& r : registered_) {
    infos.push_back(r.info);
    if (!r.key.empty()) keys[{r.info.host(), r.info.port()}] = r.key;
  }
  infos = AssignIds(std::move(infos));
  std::vector<int> waiting_ranks;
  if (options_.servers_at_start() < options_.num_servers) {
    // TESSERA_MAX_SERVERS: the servers take ranks spread over the most, so
    // that every chain holds one; the other ranks wait for servers (dead in
    // the table, their slices answered by their replicas).
    const int most = options_.num_servers,
              present = options_.servers_at_start();
    std::vector<bool> taken(most, false);
    for (wire::NodeInfo& n : infos) {
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
      infos.push_back(absent);
      waiting_ranks.push_back(rank);
    }
  }
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

void Scheduler::Reply(int peer, const wire::Header& request,
                      const absl::Status& status) {
  Message reply;
  reply.header.set_command(request.command());
  reply.header.set_request_id(request.request_id());
  reply.header.set_is_response(true);
  reply.header.set_sender(kSchedulerId);
  reply.header.set_recipient(peer);
  reply.header.set_plane(wire::CONTROL);
  if (!status.ok()) ToWire(status, reply.header.mutable_status());
  absl::Status sent = transport_->Send(peer, reply);
  if (!sent.ok())
    TESSERA_LOG(WARNING) << "reply to node " << peer << ": " << sent.message();
}

void Scheduler::Broadcast(const Message& msg, int except) {
  for (const auto& [id, info] : nodes_) {
    if (id == except || Absent(info)) continue;
    Message copy = msg;
    copy.header.set_recipient(id);
    absl::Status sent = transport_->Send(id, copy);
    if (!sent.ok())
      TESSERA_LOG(WARNING) << "send to " << Describe(info) << ": "
                           << sent.message();
  }
}

void Scheduler::CheckLiveness(absl::Time now) {
  absl::Duration oldest = absl::ZeroDuration();
  for (const auto& [id, seen] : last_seen_) {
    if (done_workers_.count(id) == 0) oldest = std::max(oldest, now - seen);
  }
  metrics_.oldest_heartbeat_age->Set(absl::ToDoubleSeconds(oldest));
  for (const auto& [id, seen] : last_seen_) {
    if (done_workers_.count(id) != 0) continue;
    const absl::Duration silent = now - seen;
    if (silent <= options_.heartbeat_timeout) continue;
    DeclareDead(id, absl::StrCat(
                        "stopped heart-beating: nothing heard for ",
                        absl::FormatDuration(silent), " (PS_HEARTBEAT_TIMEOUT=",
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

bool Scheduler::AllWorkersDone() const {
  for (const auto& [id, n] : nodes_) {
    if (n.role() == wire::WORKER && !n.dead() && done_workers_.count(id) == 0)
      return false;
  }
  return formed_;
}

int Scheduler::WorkersInJob() const {
  int count = 0;
  for (const auto& [id, n] : nodes_)
    if (n.role() == wire::WORKER && !n.dead()) ++count;
  return count;
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
  if (!ended_ && AllWorkersDone()) {
    Message term;
    term.header.set_command(wire::TERMINATE);
    TESSERA_VLOG(1) << "every worker still in the job finished; job done";
    EndJob(absl::OkStatus(), term, LivePeers(/*except=*/0));
  }
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

int Scheduler::ExpectedInBarrier(int group) const {
  int expected = 0;
  if (group & kGroupServers) {
    expected += options_.num_servers;
    for (const auto& [id, n] : nodes_)
      if (n.role() == wire::SERVER && n.dead()) --expected;
  }
  if (group & kGroupWorkers) expected += WorkersInJob();
  return expected;
}

}  // namespace tessera

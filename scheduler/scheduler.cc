#include "scheduler/scheduler.h"

#include <sys/resource.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/replica_chain.h"
#include "common/trace.h"
#include "common/wire_status.h"
#include "scheduler/scheduler_internal.h"

namespace tessera {
using scheduler_internal::AbortMessage;
using scheduler_internal::kProvisionalBase;

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
    absl::StatusOr<Message> msg = NextMessage();
    if (msg.ok()) {
      Handle(*std::move(msg));
    } else if (absl::IsCancelled(msg.status())) {
      return absl::CancelledError("scheduler stopped");
    }
    const absl::Time now = absl::Now();
    notices_.ResendDue(now);
    if (pending_wanted_.load(std::memory_order_relaxed)) MakePending(now);
    if (ended_) {
      if (Ending(now)) continue;
      // Registrations set aside are still answered (turned away).
      while (!waiting_registrations_.empty()) {
        Handle(std::move(waiting_registrations_.front().second));
        waiting_registrations_.pop_front();
      }
      return Finished(start, now);
    }
    if (!formed_) {
      WatchFormation(start, now);
      continue;
    }
    if (!unconfirmed_at_formation_.empty() &&
        now > std::max(start + options_.start_timeout,
                       formed_at_ + absl::Seconds(2))) {
      EndForUnreachableNodes();
      continue;
    }
    if (now - last_late_check_ >= kLivenessEvery) {
      last_late_check_ = now;
      barriers_.CheckLate(now);
      if (handback_ && now - handback_->started >= options_.handback_retry)
        RetryHandback(now);
    }
    if (options_.heartbeat_interval > absl::ZeroDuration() &&
        now - last_liveness_check_ >= kLivenessEvery) {
      last_liveness_check_ = now;
      CheckLiveness(now);
      if (!ended_) CheckLostLinks(now);
    }
  }
}

absl::StatusOr<Message> Scheduler::NextMessage() {
  while (true) {
    const bool waiting = !waiting_registrations_.empty();
    if (waiting &&
        absl::Now() - waiting_registrations_.front().first >= kRegistrationWait)
      break;
    // With registrations set aside, a receive only looks (a zero time-out
    // would not even look: Transport::Receive returns at its deadline).
    absl::StatusOr<Message> msg = transport_->Receive(
        waiting ? absl::Milliseconds(1) : absl::Milliseconds(50));
    if (!msg.ok()) {
      if (waiting && !absl::IsCancelled(msg.status())) break;
      return msg;
    }
    if (msg->header.command() != wire::REGISTER) return msg;
    waiting_registrations_.emplace_back(absl::Now(), *std::move(msg));
  }
  Message next = std::move(waiting_registrations_.front().second);
  waiting_registrations_.pop_front();
  return next;
}

absl::Status Scheduler::Finished(absl::Time start, absl::Time now) {
  // Every node acknowledged the end (or the deadline passed): what is
  // still queued (answers to the last heartbeats of nodes that have
  // left) can only wait out the linger.
  transport_->DiscardUnsent();
  TESSERA_LOG(INFO) << "handled " << received_ << " messages (" << heartbeats_
                    << " heartbeats) in "
                    << absl::FormatDuration(
                           absl::Trunc(now - start, absl::Milliseconds(1)))
                    << ", " << ThreadCpuMillis()
                    << " ms of CPU on the scheduler's thread, ignored messages "
                    << metrics_.ignored_messages->value();
  return result_;
}

void Scheduler::WatchFormation(absl::Time start, absl::Time now) {
  if (now - start > options_.start_timeout) {
    const std::string reason = absl::StrCat(
        "start-up deadline of ", absl::FormatDuration(options_.start_timeout),
        " passed: ", MissingNodes(),
        " never registered (TESSERA_START_TIMEOUT)");
    std::vector<int> peers;
    // Registered nodes have no id yet: the abort names their
    // registrations.
    Message abort = AbortMessage(reason);
    for (const Registration& r : registered_) {
      // Registered nodes are linked to only now, to be told.
      if (LinkTo(r.provisional_id, r.info).ok()) {
        peers.push_back(r.provisional_id);
        for (uint64_t nonce : r.nonces)
          abort.header.mutable_abort()->add_registrations(nonce);
      }
    }
    EndJob(absl::DeadlineExceededError(reason), abort, peers);
    return;
  }
  if (now - last_formation_report_ >= kFormationReportInterval) {
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
}

void Scheduler::EndForUnreachableNodes() {
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
                       : AbortMessage(end_reason_, spare.nonces);
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
    AnswerDeadNode(sender, h, acknowledgement);
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
      HandleWorkerLeave(sender, h);
      return;
    case wire::SERVER_LEAVE:
      HandleServerLeave(sender, h);
      return;
    default:
      TESSERA_LOG(WARNING) << "ignored unexpected message " << DebugString(msg);
  }
}

// A message from a node declared dead: a left node's repeated goodbye is
// answered again; any other message of a dead node is answered with an abort.
void Scheduler::AnswerDeadNode(int sender, const wire::Header& h,
                               bool acknowledgement) {
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
}

// An elastic job's worker saying goodbye before the job's end.
void Scheduler::HandleWorkerLeave(int sender, const wire::Header& h) {
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
  EndJobIfWorkersDone("all workers finished; job done");
}

void Scheduler::EndJobIfWorkersDone(const char* why) {
  if (ended_ || !AllWorkersDone()) return;
  Message term;
  term.header.set_command(wire::TERMINATE);
  TESSERA_VLOG(1) << why;
  EndJob(absl::OkStatus(), term, LivePeers(/*except=*/0));
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
  table.header.mutable_node_table()->set_local_group_nonce(local_group_nonce_);
  table.header.mutable_node_table()->set_local_group_split(local_group_split_);
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

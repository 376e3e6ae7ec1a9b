// Node's start and end (part of Node; see common/node.h): joining the job
// (binding, registering, waiting for the node table), sending, failing,
// waiting for the job's end and stopping.
#include "common/node.h"

#include <sodium.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/debug_pending.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/process_info.h"
#include "common/status_macros.h"
#include "common/trace.h"

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
          "scheduler again for want of an answer.")),
      foreign_control_metric_(MetricsRegistry::Global().GetCounter(
          "tessera_node_foreign_control_messages_total",
          "Control messages dropped because a node other than the scheduler "
          "sent them (only the scheduler sends nodes control messages).")) {}

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
  if (options_.role == Role::kWorker && options_.local_group)
    info->set_local_key(SharedMemoryPlace());
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

}  // namespace tessera

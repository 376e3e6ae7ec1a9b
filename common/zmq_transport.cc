// ZmqTransport's links and sending (zmq_transport_internal.h): binding,
// connecting with each socket's CURVE / PLAIN set-up, frames out, closing;
// and the factory functions of transport.h.
#include <malloc.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/net_util.h"
#include "common/status_macros.h"
#include "common/zmq_transport_internal.h"

namespace tessera {
namespace zmq_internal {
namespace {

// Data frames below this size are copied into ZeroMQ's message rather than
// lent to it.
constexpr size_t kCopyBelowBytes = 16 << 10;

// What CURVE adds to each frame on the wire (the MESSAGE command's name and
// nonce, the box's MAC, a flags byte): ZMQ_MAXMSGSIZE counts these bytes too.
constexpr int64_t kCurveFrameOverhead = 33;

void ReleaseBuffer(void* /*data*/, void* hint) {
  delete static_cast<std::shared_ptr<const void>*>(hint);
}

}  // namespace

ZmqTransport::ZmqTransport(const ZmqTransportOptions& options)
    : options_(options) {
  if (options.metrics != nullptr)
    counters_ = std::make_unique<MessageCounters>(options.metrics);
  context_ = zmq_ctx_new();
  zmq_ctx_set(context_, ZMQ_IO_THREADS, options.io_threads);
  zmq_ctx_set(context_, ZMQ_IPV6, 1);
  // A watched link is three sockets (the sender, its monitor's end and
  // ours): past ZeroMQ's default of 1,023 sockets at about 340 nodes.
  // A sealed link is three too until its first handshake's outcome is read
  // (WatchHandshakes), all of them at start: room for 2,700 peers (the
  // context keeps 12 bytes a socket of room; past it a link goes unwatched
  // and a refusal is found when a record finds no pipe).
  if (options.watch_links) {
    zmq_ctx_set(context_, ZMQ_MAX_SOCKETS, 1 << 16);
  } else if (Sealed()) {
    zmq_ctx_set(context_, ZMQ_MAX_SOCKETS, 1 << 13);
  }
  link_watch_ = std::make_unique<LinkWatch>(context_);
  if (Sealed()) SetUpSealing();
}

ZmqTransport::~ZmqTransport() {
  Close();
  // zmq_ctx_term waits in poll() for the context's threads, and a signal
  // (a handler's, or a stop and continue: SIGSTOP/SIGCONT make poll fail
  // with EINTR even without one) interrupts it with EINTR; it is to be
  // called again (zmq_ctx_term(3)). Returning then left the reaper and I/O
  // threads unjoined and the context undeleted (ThreadSanitizer reported
  // the reaper as a leaked thread of an exiting tessera-server).
  while (zmq_ctx_term(context_) != 0 && zmq_errno() == EINTR) {
  }
}

absl::StatusOr<int> ZmqTransport::Bind(const std::string& ip, int port) {
  absl::MutexLock lock(&recv_mu_);
  if (receiver_ == nullptr) {
    // The handler is up before the socket exists: a CURVE server without
    // one would take any client key.
    if (options_.security != nullptr && zap_ == nullptr) {
      TESSERA_ASSIGN_OR_RETURN(
          zap_,
          ZapHandler::Start(
              context_, options_.security, admission_, options_.admission_hold,
              ZapHoldQueue::Limits{
                  .max_per_address = std::max<size_t>(
                      64, options_.admission_holds_per_address)}));
      zap_counts_.store(zap_.get());
    }
    receiver_ = zmq_socket(context_, ZMQ_PULL);
    ConfigureSocket(receiver_);
    SecureReceiver(receiver_);
    // Back-pressure: past this many messages queued from one peer, ZeroMQ
    // stops reading its connection and TCP's window closes on the sender.
    zmq_setsockopt(receiver_, ZMQ_RCVHWM, &kReceiveHighWaterMark,
                   sizeof(kReceiveHighWaterMark));
    if (options_.credit_bytes > 0) {
      const int credit = static_cast<int>(options_.credit_bytes);
      zmq_setsockopt(receiver_, ZMQ_RCVBUF, &credit, sizeof(credit));
    }
    LimitMainLane(receiver_);
  }
  const std::string endpoint = TcpEndpoint(ip, port);
  if (zmq_bind(receiver_, endpoint.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind ", endpoint, ": ", ZmqError()));
  }
  const int bound_port = BoundPort(receiver_, port);
  if (Sealed() && own_role() != Role::kScheduler && !sealed_lane_bound_) {
    TESSERA_RETURN_IF_ERROR(BindSealedLane(ip));
  }
  return bound_port;
}

absl::Status ZmqTransport::Connect(int peer, const std::string& ip, int port) {
  auto sender = std::make_shared<Sender>();
  sender->unsent_dropped = unsent_dropped_;
  sender->peer = peer;
  sender->blocks = blocks_;
  void* socket = zmq_socket(context_, ZMQ_PUSH);
  if (socket == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot make a socket to node ", peer, ": ", ZmqError()));
  }
  ConfigureSocket(socket);
  std::string endpoint;
  std::optional<PeerLink> link;  // set: the link is sealed
  if (absl::Status aimed = AimSocket(socket, peer, ip, port, &endpoint, &link);
      !aimed.ok()) {
    zmq_close(socket);
    return aimed;
  }
  LimitSending(socket);
  if (zmq_connect(socket, endpoint.c_str()) != 0) {
    const std::string err = ZmqError();
    zmq_close(socket);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", endpoint, ": ", err));
  }
  sender->endpoint = endpoint;
  {
    absl::MutexLock lock(&sender->mu);
    sender->socket = socket;
    if (link.has_value()) sender->handshakes = WatchHandshakes(socket);
    sender->dialled_at = absl::Now();
    if (pool_ != nullptr) ArmBacklog(sender, *sender->backlog);
  }
  TESSERA_VLOG(1) << "connecting to node " << peer << " at " << endpoint;
  if (before_link_replaced_) before_link_replaced_();
  std::shared_ptr<Sender> old;
  {
    absl::MutexLock lock(&senders_mu_);
    // After the connect: a failed one leaves the link it would have
    // replaced watched. (Connecting is asynchronous: nothing is missed.)
    // With the swap, under senders_mu_: a refused link's new socket
    // (Redial) is watched in its place only while it is the peer's link,
    // and its link number is below this one's.
    std::optional<uint32_t> number;
    if (link.has_value()) {
      number = TakeLinkNumber();
      // The link it would replace stays (its socket closes with `sender`).
      if (!number.has_value()) return NoLinkNumberLeft(peer);
    }
    std::shared_ptr<std::atomic<bool>> stopped;
    if (options_.watch_links)
      stopped = link_watch_->Watch(peer, socket, endpoint);
    {
      absl::MutexLock hold(&sender->mu);
      if (options_.watch_links) sender->monitor_stopped = std::move(stopped);
      if (link.has_value()) {
        sender->sealer = NewSealer(*link, *number);
        sender->key = link->key;
      }
    }
    old = std::exchange(senders_[peer], sender);
  }
  return absl::OkStatus();
}

absl::Status ZmqTransport::AimSocket(void* socket, int peer,
                                     const std::string& ip, int port,
                                     std::string* endpoint,
                                     std::optional<PeerLink>* link) {
  if (Sealed() && peer != kSchedulerId) {
    // A worker or server: its sealed lane.
    *link = LinkTo(peer);
    if (!link->has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no node key for node ", peer, ": its node table entry has none"));
    }
    SealedLaneCredentials(socket, **link);
    *endpoint = TcpEndpoint(ip, (*link)->sealed_port);
    return absl::OkStatus();
  }
  *endpoint = TcpEndpoint(ip, port);
  TESSERA_RETURN_IF_ERROR(SecureSender(socket, peer));
  // Sealed once the node table brings the scheduler's node key.
  if (Sealed() && peer == kSchedulerId) *link = LinkTo(peer);
  return absl::OkStatus();
}

void ZmqTransport::Disconnect(int peer) {
  std::shared_ptr<Sender> gone;  // closed after the lock
  absl::MutexLock lock(&senders_mu_);
  link_watch_->Unwatch(peer);
  if (auto it = senders_.find(peer); it != senders_.end()) {
    gone = std::move(it->second);
    senders_.erase(it);
  }
}

void ZmqTransport::ForgetPeer(int peer) {
  if (opener_ != nullptr) opener_->RemovePeer(peer);
  if (admission_ != nullptr) admission_->RemovePeer(peer);
  if (link_keys_ != nullptr) ForgetLink(peer);
  Disconnect(peer);
}

absl::Status ZmqTransport::Send(int peer, const Message& msg) {
  std::shared_ptr<Sender> sender;
  {
    absl::MutexLock lock(&senders_mu_);
    auto it = senders_.find(peer);
    if (it == senders_.end()) {
      return absl::UnavailableError(
          absl::StrCat("no connection to node ", peer));
    }
    sender = it->second;
  }
  absl::StatusOr<size_t> header_size = CheckForEncoding(msg);
  if (!header_size.ok()) return header_size.status();
  if (LogVerbosity() >= 2) TESSERA_LOG(INFO) << "send " << DebugString(msg);
  {
    // Sealed messages that went out are released after the lock: their
    // frames' owners may take their own locks (a worker's request tracker
    // unpins an operation), and must never run under a link's.
    std::vector<sealed::SealJob> sent_jobs;
    bool refused = false;
    {
      absl::MutexLock lock(&sender->mu);
      absl::Status sent =
          sender->sealer != nullptr
              ? SendSealed(*sender, msg, *header_size, &sent_jobs)
              : SendFrames(*sender, peer, msg, *header_size);
      if (!sent.ok()) return sent;
      refused = sender->refused;
    }
    // The message waits for the link's new connection.
    if (refused) Redial(sender);
  }
  if (counters_ != nullptr) {
    uint64_t bytes = *header_size;
    for (const Buffer& part : msg.data) bytes += part.size();
    counters_->Sent(msg.header.command(), bytes);
  }
  return absl::OkStatus();
}

absl::Status ZmqTransport::SendFrames(Sender& sender, int peer,
                                      const Message& msg, size_t header_size) {
  // The header is serialized straight into its frame.
  zmq_msg_t header;
  zmq_msg_init_size(&header, header_size);
  if (!SerializeHeader(msg, zmq_msg_data(&header), header_size)) {
    zmq_msg_close(&header);
    return absl::InternalError("cannot serialize message header");
  }
  if (zmq_msg_send(&header, sender.socket, msg.data.empty() ? 0 : ZMQ_SNDMORE) <
      0) {
    const std::string err = ZmqError();
    zmq_msg_close(&header);
    return absl::UnavailableError(absl::StrCat(
        "cannot send to node ", peer, " at ", sender.endpoint, ": ", err));
  }
  for (size_t i = 0; i < msg.data.size(); ++i) {
    const Buffer& part = msg.data[i];
    zmq_msg_t zmsg;
    if (part.size() < kCopyBelowBytes) {
      // Small parts are copied: cheaper than a reference-counted hand-off.
      zmq_msg_init_size(&zmsg, part.size());
      if (part.size() > 0)
        std::memcpy(zmq_msg_data(&zmsg), part.data(), part.size());
    } else {
      auto* hint = new std::shared_ptr<const void>(part.owner());
      zmq_msg_init_data(&zmsg, const_cast<uint8_t*>(part.data()), part.size(),
                        ReleaseBuffer, hint);
    }
    const int flags = i + 1 < msg.data.size() ? ZMQ_SNDMORE : 0;
    if (zmq_msg_send(&zmsg, sender.socket, flags) < 0) {
      const std::string err = ZmqError();
      zmq_msg_close(&zmsg);
      // A half-sent multi-part message is discarded by ZeroMQ with the
      // socket's pending parts; report the failure to the caller.
      return absl::UnavailableError(absl::StrCat(
          "cannot send to node ", peer, " at ", sender.endpoint, ": ", err));
    }
  }
  return absl::OkStatus();
}

void ZmqTransport::DiscardUnsent() {
  // Released after the locks (their frames' owners may lock).
  std::vector<std::deque<sealed::SealJob>> dropped;
  discard_unsent_.store(true);  // a refused link's new socket too
  absl::MutexLock lock(&senders_mu_);
  const int zero = 0;
  for (auto& [peer, sender] : senders_) {
    absl::MutexLock hold(&sender->mu);
    unsent_dropped_->fetch_add(sender->pending.size());
    dropped.push_back(std::move(sender->pending));
    sender->pending.clear();
    zmq_setsockopt(sender->socket, ZMQ_LINGER, &zero, sizeof(zero));
  }
}

void ZmqTransport::Close() {
  if (closed_.exchange(true)) return;
  // What waits to be sealed is dropped with the links, as ZeroMQ drops
  // what is queued on a closed socket after the linger.
  if (pool_ != nullptr) pool_->Stop();
  {
    // The senders first: each stops its monitor as it goes (~Sender).
    absl::MutexLock lock(&senders_mu_);
    senders_.clear();
  }
  // Every socket closes before zmq_ctx_term, which waits for them.
  link_watch_->CloseAll();
  absl::MutexLock lock(&recv_mu_);
  if (receiver_ != nullptr) {
    zmq_close(receiver_);
    receiver_ = nullptr;
  }
  if (zap_ != nullptr) zap_->Stop();
}

void ZmqTransport::ConfigureSocket(void* socket) {
  const int linger_ms =
      static_cast<int>(absl::ToInt64Milliseconds(options_.linger));
  zmq_setsockopt(socket, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
  const int ipv6 = 1;
  zmq_setsockopt(socket, ZMQ_IPV6, &ipv6, sizeof(ipv6));
  zmq_setsockopt(socket, ZMQ_RECONNECT_IVL, &kReconnectMs,
                 sizeof(kReconnectMs));
  zmq_setsockopt(socket, ZMQ_RECONNECT_IVL_MAX, &kReconnectMaxMs,
                 sizeof(kReconnectMaxMs));
}

int ZmqTransport::BoundPort(void* socket, int port) {
  char last[256] = {0};
  size_t size = sizeof(last);
  zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &size);
  const std::string bound(last);
  const size_t colon = bound.rfind(':');
  TESSERA_VLOG(1) << "listening on " << bound;
  return colon == std::string::npos ? port
                                    : std::atoi(bound.c_str() + colon + 1);
}

void ZmqTransport::LimitMainLane(void* socket) {
  // -1 (no bound) is set too: the sealed lane's bind leaves its own bound
  // on the socket for later binds.
  const int64_t max_bytes = options_.max_message_bytes <= 0
                                ? -1
                                : options_.max_message_bytes +
                                      (Encrypted() ? kCurveFrameOverhead : 0);
  zmq_setsockopt(socket, ZMQ_MAXMSGSIZE, &max_bytes, sizeof(max_bytes));
}

void ZmqTransport::SecureReceiver(void* socket) {
  if (options_.security == nullptr) return;
  const JobKeys& keys = options_.security->keys;
  const int on = 1;
  if (options_.security->encrypt) {
    zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &on, sizeof(on));
    zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, keys.secret_key.data(),
                   keys.secret_key.size());
  } else {
    zmq_setsockopt(socket, ZMQ_PLAIN_SERVER, &on, sizeof(on));
  }
  zmq_setsockopt(socket, ZMQ_ZAP_DOMAIN, ZapHandler::kMainDomain,
                 std::strlen(ZapHandler::kMainDomain));
}

void ZmqTransport::LimitSending(void* socket) {
  const int hwm = 100000;
  zmq_setsockopt(socket, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  const int timeout_ms =
      static_cast<int>(absl::ToInt64Milliseconds(options_.send_timeout));
  zmq_setsockopt(socket, ZMQ_SNDTIMEO, &timeout_ms, sizeof(timeout_ms));
  if (options_.credit_bytes > 0) {
    const int credit = static_cast<int>(options_.credit_bytes);
    zmq_setsockopt(socket, ZMQ_SNDBUF, &credit, sizeof(credit));
  }
}

absl::Status ZmqTransport::SecureSender(void* socket, int peer) {
  if (options_.security == nullptr) return absl::OkStatus();
  std::optional<Role> role = RoleOfNodeId(peer);
  if (!role.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node id ", peer, " belongs to no role; its key is unknown"));
  }
  const JobKeys& keys = options_.security->keys;
  if (options_.security->encrypt) {
    const std::string& server_key = keys.public_key(*role);
    // A node's own key, when launch.py gave it one, says which node it is.
    const bool own = !keys.node_secret_key.empty();
    const std::string& public_key =
        own ? keys.node_public_key : keys.public_key(keys.role);
    const std::string& secret_key =
        own ? keys.node_secret_key : keys.secret_key;
    zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, server_key.data(),
                   server_key.size());
    zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, public_key.data(),
                   public_key.size());
    zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret_key.data(),
                   secret_key.size());
  } else {
    const std::string user = RoleName(keys.role);
    const SecretString password = PlainPassword(keys, *role);
    zmq_setsockopt(socket, ZMQ_PLAIN_USERNAME, user.data(), user.size());
    zmq_setsockopt(socket, ZMQ_PLAIN_PASSWORD, password.data(),
                   password.size());
  }
  return absl::OkStatus();
}

}  // namespace zmq_internal

namespace {

// ZeroMQ mallocs one block per received data frame. With glibc's defaults a
// block above the (adaptive) mmap threshold is mapped and unmapped per message,
// and freeing several large blocks at once trims the heap top back to the
// kernel, so a process holding a few frames at a time (a server's weights, a
// worker's in-flight pulls) pays page faults and page zeroing on every message:
// 1 MB pushes with 4 in flight ran at 0.4x raw ZeroMQ. Keep frames up to 32 MB
// (glibc's largest mmap threshold) in the heap and the heap grown. Skipped when
// the user tunes malloc through the environment.
void KeepLargeFramesInHeap() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("GLIBC_TUNABLES") != nullptr ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
      return;
    }
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  });
}

}  // namespace

std::unique_ptr<Transport> NewZmqTransport(const ZmqTransportOptions& options) {
  KeepLargeFramesInHeap();
  return std::make_unique<zmq_internal::ZmqTransport>(options);
}

std::unique_ptr<Transport> NewZmqTransportForFrames(int64_t max_frame_bytes) {
  ZmqTransportOptions options;
  options.max_message_bytes = max_frame_bytes;
  return NewZmqTransport(options);
}

absl::StatusOr<std::unique_ptr<Transport>> NewZmqTransportForNode(
    const Options& node_options) {
  ZmqTransportOptions options;
  options.max_message_bytes = node_options.max_frame_bytes;
  options.sealed_port = node_options.sealed_port;
  options.credit_bytes = node_options.send_credit_bytes;
  TESSERA_ASSIGN_OR_RETURN(options.security,
                           LoadConnectionSecurity(node_options));
  options.metrics = &MetricsRegistry::Global();
  options.watch_links = node_options.role == Role::kScheduler;
  // Where the scheduler's claims on the sealed lane come from (a failure
  // to resolve is the node's to report, at BindAndConnect).
  if (absl::StatusOr<std::string> scheduler =
          ResolveHost(node_options.root_uri);
      scheduler.ok())
    options.scheduler_address = *std::move(scheduler);
  // Every process of the job may be on one host (a local job: all from
  // 127.0.0.1), and each connects once to this node's sealed lane, perhaps
  // before the table names it: a 256-worker local job's connections were
  // refused at 64 from one address. The scheduler, spares and restarts: 8.
  options.admission_holds_per_address =
      static_cast<size_t>(std::max(0, node_options.num_workers) +
                          std::max(0, node_options.num_servers) + 8);
  return NewZmqTransport(options);
}

}  // namespace tessera

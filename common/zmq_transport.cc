// ZeroMQ transport: one bound PULL socket receives, one PUSH socket per peer
// sends. Secured (options.security): the PULL socket is a CURVE server (PLAIN
// with TESSERA_AUTH_ONLY) whose ZAP handler admits only the job's role keys,
// each PUSH socket a CURVE client of the peer role's key, and every received
// message's claimed sender is checked against its connection's key.
#include <malloc.h>
#include <zmq.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/sender_check.h"
#include "common/status_macros.h"
#include "common/transport.h"
#include "common/zap_handler.h"

namespace tessera {
namespace {

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

// Messages a receiving socket queues per peer before it stops reading that
// peer's connection. Bounds inbound memory at this many of the largest frame a
// peer sends (TESSERA_MAX_MESSAGE_BYTES at most) per connection.
constexpr int kReceiveHighWaterMark = 64;

// Data frames below this size are copied into ZeroMQ's message rather than
// lent to it.
constexpr size_t kCopyBelowBytes = 16 << 10;

// What CURVE adds to each frame on the wire (the MESSAGE command's name and
// nonce, the box's MAC, a flags byte): ZMQ_MAXMSGSIZE counts these bytes too.
constexpr int64_t kCurveFrameOverhead = 33;

// Keeps a received zmq_msg_t alive for as long as Buffers reference its bytes.
struct ReceivedPart {
  zmq_msg_t msg;
  ~ReceivedPart() { zmq_msg_close(&msg); }
};

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

void ReleaseBuffer(void* /*data*/, void* hint) {
  delete static_cast<std::shared_ptr<const void>*>(hint);
}

class ZmqTransport : public Transport {
 public:
  explicit ZmqTransport(const ZmqTransportOptions& options)
      : options_(options) {
    if (options.metrics != nullptr)
      counters_ = std::make_unique<MessageCounters>(options.metrics);
    context_ = zmq_ctx_new();
    zmq_ctx_set(context_, ZMQ_IO_THREADS, options.io_threads);
    zmq_ctx_set(context_, ZMQ_IPV6, 1);
  }

  ~ZmqTransport() override {
    Close();
    zmq_ctx_term(context_);
  }

  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    absl::MutexLock lock(&recv_mu_);
    if (receiver_ == nullptr) {
      // The handler is up before the socket exists: a CURVE server without
      // one would take any client key.
      if (options_.security != nullptr && zap_ == nullptr) {
        TESSERA_ASSIGN_OR_RETURN(
            zap_, ZapHandler::Start(context_, options_.security));
        zap_counts_.store(zap_.get());
      }
      receiver_ = zmq_socket(context_, ZMQ_PULL);
      ConfigureSocket(receiver_);
      SecureReceiver(receiver_);
      // Back-pressure: past this many messages queued from one peer, ZeroMQ
      // stops reading its connection and TCP's window closes on the sender.
      zmq_setsockopt(receiver_, ZMQ_RCVHWM, &kReceiveHighWaterMark,
                     sizeof(kReceiveHighWaterMark));
      if (options_.max_message_bytes > 0) {
        const int64_t max_bytes =
            options_.max_message_bytes +
            (Encrypted() ? kCurveFrameOverhead : 0);
        zmq_setsockopt(receiver_, ZMQ_MAXMSGSIZE, &max_bytes,
                       sizeof(max_bytes));
      }
    }
    const std::string endpoint = TcpEndpoint(ip, port);
    if (zmq_bind(receiver_, endpoint.c_str()) != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot bind ", endpoint, ": ", ZmqError()));
    }
    char last[256] = {0};
    size_t size = sizeof(last);
    zmq_getsockopt(receiver_, ZMQ_LAST_ENDPOINT, last, &size);
    const std::string bound(last);
    const size_t colon = bound.rfind(':');
    const int bound_port = colon == std::string::npos
                               ? port
                               : std::atoi(bound.c_str() + colon + 1);
    TESSERA_VLOG(1) << "listening on " << bound;
    return bound_port;
  }

  absl::Status Connect(int peer, const std::string& ip, int port) override {
    const std::string endpoint = TcpEndpoint(ip, port);
    auto sender = std::make_shared<Sender>();
    sender->socket = zmq_socket(context_, ZMQ_PUSH);
    ConfigureSocket(sender->socket);
    if (absl::Status secured = SecureSender(sender->socket, peer);
        !secured.ok()) {
      return secured;
    }
    const int hwm = 100000;
    zmq_setsockopt(sender->socket, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    const int timeout_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options_.send_timeout));
    zmq_setsockopt(sender->socket, ZMQ_SNDTIMEO, &timeout_ms,
                   sizeof(timeout_ms));
    if (zmq_connect(sender->socket, endpoint.c_str()) != 0) {
      const std::string err = ZmqError();
      zmq_close(sender->socket);
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", endpoint, ": ", err));
    }
    sender->endpoint = endpoint;
    TESSERA_VLOG(1) << "connecting to node " << peer << " at " << endpoint;
    std::shared_ptr<Sender> old;
    {
      absl::MutexLock lock(&senders_mu_);
      old = std::exchange(senders_[peer], sender);
    }
    return absl::OkStatus();
  }

  void Disconnect(int peer) override {
    absl::MutexLock lock(&senders_mu_);
    senders_.erase(peer);
  }

  absl::Status Send(int peer, const Message& msg) override {
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
    // The header is serialized straight into its frame.
    zmq_msg_t header;
    zmq_msg_init_size(&header, *header_size);
    if (!SerializeHeader(msg, zmq_msg_data(&header), *header_size)) {
      zmq_msg_close(&header);
      return absl::InternalError("cannot serialize message header");
    }
    absl::MutexLock lock(&sender->mu);
    if (zmq_msg_send(&header, sender->socket,
                     msg.data.empty() ? 0 : ZMQ_SNDMORE) < 0) {
      const std::string err = ZmqError();
      zmq_msg_close(&header);
      return absl::UnavailableError(absl::StrCat(
          "cannot send to node ", peer, " at ", sender->endpoint, ": ", err));
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
      if (zmq_msg_send(&zmsg, sender->socket, flags) < 0) {
        const std::string err = ZmqError();
        zmq_msg_close(&zmsg);
        // A half-sent multi-part message is discarded by ZeroMQ with the
        // socket's pending parts; report the failure to the caller.
        return absl::UnavailableError(absl::StrCat(
            "cannot send to node ", peer, " at ", sender->endpoint, ": ", err));
      }
    }
    if (counters_ != nullptr) {
      uint64_t bytes = *header_size;
      for (const Buffer& part : msg.data) bytes += part.size();
      counters_->Sent(msg.header.command(), bytes);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    absl::MutexLock lock(&recv_mu_);
    if (receiver_ == nullptr)
      return absl::FailedPreconditionError("Receive before Bind");
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (closed_.load()) return absl::CancelledError("transport closed");
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration())
        return absl::DeadlineExceededError("no message");
      // A blocking receive with a time-out, rather than zmq_poll and then a
      // receive, saves a system call and a pass over the socket's commands per
      // message.
      const int wait_ms = static_cast<int>(std::min<int64_t>(
          100, std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
      if (wait_ms != receive_timeout_ms_) {
        zmq_setsockopt(receiver_, ZMQ_RCVTIMEO, &wait_ms, sizeof(wait_ms));
        receive_timeout_ms_ = wait_ms;
      }
      // The header frame is parsed where ZeroMQ put it (and freed after);
      // data frames stay in ZeroMQ's memory for as long as Buffers use them.
      ReceivedPart header;
      zmq_msg_init(&header.msg);
      if (zmq_msg_recv(&header.msg, receiver_, 0) < 0) {
        const int err = zmq_errno();
        if (err != EAGAIN && err != EINTR) {
          return absl::InternalError(
              absl::StrCat("zmq_msg_recv: ", ZmqError()));
        }
        continue;
      }
      std::vector<Buffer> parts;
      bool more = zmq_msg_more(&header.msg);
      bool failed = false;
      size_t received = 1;
      std::string user_id;  // the key its connection was authenticated with
      if (options_.security != nullptr) {
        const char* id = zmq_msg_gets(&header.msg, "User-Id");
        if (id != nullptr) user_id = id;
      }
      while (more) {
        auto part = std::make_shared<ReceivedPart>();
        zmq_msg_init(&part->msg);
        if (zmq_msg_recv(&part->msg, receiver_, 0) < 0) {
          failed = true;
          break;
        }
        more = zmq_msg_more(&part->msg);
        if (++received > options_.limits.max_frames + 1) {
          // More parts than any message may have: the rest is read and freed
          // at once, not collected, and the message is dropped below.
          if (received == options_.limits.max_frames + 2) parts.clear();
          continue;
        }
        const void* data = zmq_msg_data(&part->msg);
        const size_t size = zmq_msg_size(&part->msg);
        if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0) {
          parts.push_back(Buffer::CopyOf(data, size));
        } else {
          parts.push_back(Buffer::Wrap(
              data, size, std::shared_ptr<const void>(part, part.get())));
        }
      }
      if (failed) continue;
      if (received > options_.limits.max_frames + 1) {
        const uint64_t n = ++malformed_;
        TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                             << received << " parts; at most "
                             << options_.limits.max_frames + 1
                             << " are allowed";
        continue;
      }
      absl::StatusOr<Message> msg =
          DecodeMessage(zmq_msg_data(&header.msg), zmq_msg_size(&header.msg),
                        std::move(parts), options_.limits);
      if (!msg.ok()) {
        const uint64_t n = ++malformed_;
        TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                             << msg.status().message();
        continue;
      }
      if (options_.security != nullptr && !SenderMatchesKey(*msg, user_id))
        continue;
      if (LogVerbosity() >= 2)
        TESSERA_LOG(INFO) << "recv " << DebugString(*msg);
      if (counters_ != nullptr) {
        uint64_t bytes = zmq_msg_size(&header.msg);
        for (const Buffer& part : msg->data) bytes += part.size();
        counters_->Received(msg->header.command(), bytes);
      }
      return msg;
    }
  }

  uint64_t malformed_count() const override { return malformed_.load(); }
  uint64_t wrong_sender_count() const override {
    return wrong_sender_.load();
  }
  uint64_t refused_connection_count() const override {
    const ZapHandler* zap = zap_counts_.load();
    return zap == nullptr ? 0 : zap->refused_count();
  }

  void Close() override {
    if (closed_.exchange(true)) return;
    {
      absl::MutexLock lock(&senders_mu_);
      senders_.clear();
    }
    absl::MutexLock lock(&recv_mu_);
    if (receiver_ != nullptr) {
      zmq_close(receiver_);
      receiver_ = nullptr;
    }
    if (zap_ != nullptr) zap_->Stop();
  }

 private:
  struct Sender {
    absl::Mutex mu;
    void* socket = nullptr;
    std::string endpoint;
    ~Sender() {
      if (socket != nullptr) zmq_close(socket);
    }
  };

  void ConfigureSocket(void* socket) {
    const int linger_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options_.linger));
    zmq_setsockopt(socket, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
    const int ipv6 = 1;
    zmq_setsockopt(socket, ZMQ_IPV6, &ipv6, sizeof(ipv6));
    const int reconnect_ms = 100, reconnect_max_ms = 1000;
    zmq_setsockopt(socket, ZMQ_RECONNECT_IVL, &reconnect_ms,
                   sizeof(reconnect_ms));
    zmq_setsockopt(socket, ZMQ_RECONNECT_IVL_MAX, &reconnect_max_ms,
                   sizeof(reconnect_max_ms));
  }

  bool Encrypted() const {
    return options_.security != nullptr && options_.security->encrypt;
  }

  void SecureReceiver(void* socket) {
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
    static constexpr char kDomain[] = "tessera";
    zmq_setsockopt(socket, ZMQ_ZAP_DOMAIN, kDomain, sizeof(kDomain) - 1);
  }

  // A PUSH socket to `peer` authenticates with this node's role key and, with
  // CURVE, authenticates the peer by its role's public key.
  absl::Status SecureSender(void* socket, int peer) {
    if (options_.security == nullptr) return absl::OkStatus();
    std::optional<Role> role = RoleOfNodeId(peer);
    if (!role.has_value()) {
      zmq_close(socket);
      return absl::InvalidArgumentError(absl::StrCat(
          "node id ", peer, " belongs to no role; its key is unknown"));
    }
    const JobKeys& keys = options_.security->keys;
    if (options_.security->encrypt) {
      const std::string& server_key = keys.public_key(*role);
      const std::string& own_key = keys.public_key(keys.role);
      zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, server_key.data(),
                     server_key.size());
      zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, own_key.data(),
                     own_key.size());
      zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, keys.secret_key.data(),
                     keys.secret_key.size());
    } else {
      const std::string user = RoleName(keys.role);
      const std::string password = PlainPassword(keys, *role);
      zmq_setsockopt(socket, ZMQ_PLAIN_USERNAME, user.data(), user.size());
      zmq_setsockopt(socket, ZMQ_PLAIN_PASSWORD, password.data(),
                     password.size());
    }
    return absl::OkStatus();
  }

  // False (counted, warned about) when `msg` claims a sender its connection's
  // key may not speak for.
  bool SenderMatchesKey(const Message& msg, const std::string& user_id) {
    std::optional<Role> role =
        options_.security->keys.RoleOfKey(user_id);
    absl::Status allowed =
        role.has_value()
            ? CheckClaimedSender(msg.header, *role)
            : absl::PermissionDeniedError("its connection has no key");
    if (allowed.ok()) return true;
    const uint64_t n = ++wrong_sender_;
    TESSERA_LOG(WARNING) << "dropped message #" << n << " from key "
                         << (user_id.empty() ? "(none)" : KeyPrefix(user_id))
                         << ": " << allowed.message() << ": "
                         << DebugString(msg);
    return false;
  }

  const ZmqTransportOptions options_;
  std::unique_ptr<MessageCounters> counters_;  // null: not counted
  void* context_ = nullptr;
  absl::Mutex recv_mu_;
  std::unique_ptr<ZapHandler> zap_ ABSL_GUARDED_BY(recv_mu_);
  // zap_ for counting without recv_mu_ (Receive holds it while it waits);
  // zap_ lives as long as the transport.
  std::atomic<const ZapHandler*> zap_counts_{nullptr};
  void* receiver_ ABSL_GUARDED_BY(recv_mu_) = nullptr;
  int receive_timeout_ms_ ABSL_GUARDED_BY(recv_mu_) = -1;
  absl::Mutex senders_mu_;
  std::map<int, std::shared_ptr<Sender>> senders_ ABSL_GUARDED_BY(senders_mu_);
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> wrong_sender_{0};
};

}  // namespace

std::unique_ptr<Transport> NewZmqTransport(const ZmqTransportOptions& options) {
  KeepLargeFramesInHeap();
  return std::make_unique<ZmqTransport>(options);
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
  TESSERA_ASSIGN_OR_RETURN(options.security,
                           LoadConnectionSecurity(node_options));
  options.metrics = &MetricsRegistry::Global();
  return NewZmqTransport(options);
}

}  // namespace tessera

// ZmqTransport's receiving side (zmq_transport_internal.h): frames and sealed
// records off its sockets, decoded into Messages, and the checks of who sent
// each one.
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/sender_check.h"
#include "common/zmq_transport_internal.h"

namespace tessera::zmq_internal {
namespace {

// A record of the sealed layer: one ZeroMQ frame starting with its magic. No
// header frame starts so: a protobuf field tag of 'T' (field 10, wire type 4)
// is never valid at a message's start.
bool IsSealedRecord(const zmq_msg_t* msg) {
  return zmq_msg_size(const_cast<zmq_msg_t*>(msg)) >= sealed::kRecordOverhead &&
         std::memcmp(zmq_msg_data(const_cast<zmq_msg_t*>(msg)), "TSL1", 4) == 0;
}

// Whether `msg` came over a connection to the sealed lane (the ZAP handler
// marks them: ZapHandler::kLaneProperty).
bool OnSealedLane(zmq_msg_t* msg) {
  const char* lane = zmq_msg_gets(msg, ZapHandler::kLaneProperty);
  return lane != nullptr && std::strcmp(lane, ZapHandler::kSealedDomain) == 0;
}

}  // namespace

absl::StatusOr<Message> ZmqTransport::Receive(absl::Duration timeout) {
  absl::MutexLock lock(&recv_mu_);
  if (receiver_ == nullptr)
    return absl::FailedPreconditionError("Receive before Bind");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (closed_.load()) return absl::CancelledError("transport closed");
    if (!ready_.empty()) {
      Message msg = std::move(ready_.front());
      ready_.pop_front();
      return Deliver(std::move(msg));
    }
    if (opener_ != nullptr) {
      std::vector<Message> released;
      opener_->ReleaseParked(&released);
      for (Message& m : released) ready_.push_back(std::move(m));
      if (!ready_.empty()) continue;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration())
      return absl::DeadlineExceededError("no message");
    const int wait_ms = static_cast<int>(std::min<int64_t>(
        100, std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
    // A blocking receive with a time-out, rather than zmq_poll and then a
    // receive, saves a system call and a pass over the socket's commands per
    // message. The sealed lane is the same socket (BindSealedLane).
    if (wait_ms != receive_timeout_ms_) {
      zmq_setsockopt(receiver_, ZMQ_RCVTIMEO, &wait_ms, sizeof(wait_ms));
      receive_timeout_ms_ = wait_ms;
    }
    if (!ReceiveOne()) {
      NoteCaughtUp();  // it waited and nothing came
    } else if (absl::ToUnixNanos(absl::Now()) -
                   caught_up_ns_.load(std::memory_order_relaxed) >
               kCaughtUpCheckNs) {
      int events = 0;
      size_t size = sizeof(events);
      if (zmq_getsockopt(receiver_, ZMQ_EVENTS, &events, &size) == 0 &&
          (events & ZMQ_POLLIN) == 0) {
        NoteCaughtUp();
      }
    }
  }
}

void ZmqTransport::NoteCaughtUp() {
  caught_up_ns_.store(absl::ToUnixNanos(absl::Now()),
                      std::memory_order_relaxed);
}

Message ZmqTransport::Deliver(Message msg) {
  if (LogVerbosity() >= 2) TESSERA_LOG(INFO) << "recv " << DebugString(msg);
  if (counters_ != nullptr) {
    uint64_t bytes = msg.header.ByteSizeLong();
    for (const Buffer& part : msg.data) bytes += part.size();
    counters_->Received(msg.header.command(), bytes);
  }
  return msg;
}

bool ZmqTransport::ReceiveOne() {
  void* const socket = receiver_;
  // The first frame stays where ZeroMQ put it: a header is parsed from it
  // (and freed after), a record opened in it.
  auto first = std::make_shared<ReceivedPart>();
  zmq_msg_init(&first->msg);
  if (zmq_msg_recv(&first->msg, socket, 0) < 0) {
    const int err = zmq_errno();
    if (err != EAGAIN && err != EINTR) {
      TESSERA_LOG(WARNING) << "zmq_msg_recv: " << ZmqError();
    }
    return false;
  }
  std::string user_id;      // the key its connection was authenticated with
  uint64_t connection = 0;  // and that connection's number
  if (options_.security != nullptr) {
    // "KEY#CONNECTION" (ZapHandler).
    const char* id = zmq_msg_gets(&first->msg, "User-Id");
    if (id != nullptr) {
      absl::string_view text = id;
      const size_t hash = text.rfind('#');
      if (hash != absl::string_view::npos &&
          absl::SimpleAtoi(text.substr(hash + 1), &connection)) {
        text = text.substr(0, hash);
      }
      user_id = std::string(text);
    }
  }
  const bool more = zmq_msg_more(&first->msg);
  const bool sealed_lane = OnSealedLane(&first->msg);
  if (opener_ != nullptr && !more && IsSealedRecord(&first->msg)) {
    OpenRecord(std::move(first), user_id, connection, sealed_lane);
    return true;
  }
  if (sealed_lane) {
    // The sealed lane carries records only.
    DrainParts(socket, more);
    const uint64_t n = ++malformed_;
    TESSERA_LOG(WARNING) << "dropped malformed message #" << n
                         << ": the sealed lane carries sealed records only";
    return true;
  }
  std::vector<Buffer> parts;
  if (!ReceiveDataParts(socket, more, &parts)) return true;
  FileMessage(*first, std::move(parts), std::move(user_id));
  return true;
}

void ZmqTransport::OpenRecord(std::shared_ptr<ReceivedPart> first,
                              const std::string& user_id, uint64_t connection,
                              bool sealed_lane) {
  if (!sealed_lane && own_role() != Role::kScheduler) {
    // Only the scheduler takes records on its own (CURVE) port, from the
    // nodes it registered; a worker's or server's peers, the scheduler
    // included, seal to its sealed lane, whose connections are each bound to
    // one node key. Records there could be of any key (a holder of a role key
    // filling the parking queue with made-up ones).
    const uint64_t n = ++malformed_;
    TESSERA_LOG(WARNING) << "dropped malformed message #" << n
                         << ": a sealed record on this node's own port; "
                            "records go to its sealed lane";
    return;
  }
  std::optional<Role> role;
  std::optional<sealed::Key32> connection_key;
  if (sealed_lane) {
    Role claimed;
    sealed::Key32 key;
    if (sealed::ParseAdmissionUser(user_id, &claimed, &key)) {
      role = claimed;
      connection_key = key;
    }
  } else {
    role = options_.security->keys.RoleOfKey(user_id);
  }
  if (!role.has_value()) {
    // The ZAP handler gives every connection a role key (on the sealed
    // lane, a role and a node key).
    ++malformed_;
    return;
  }
  sealed::Record record;
  record.data = static_cast<uint8_t*>(zmq_msg_data(&first->msg));
  record.size = zmq_msg_size(&first->msg);
  record.owner = first;
  record.connection_role = *role;
  record.connection = connection;
  record.connection_key = connection_key;
  std::vector<Message> opened;
  opener_->Accept(std::move(record), &opened);
  for (Message& m : opened) ready_.push_back(std::move(m));
}

bool ZmqTransport::ReceiveDataParts(void* socket, bool more,
                                    std::vector<Buffer>* parts) {
  bool next = more;
  size_t received = 1;
  while (next) {
    auto part = std::make_shared<ReceivedPart>();
    zmq_msg_init(&part->msg);
    if (zmq_msg_recv(&part->msg, socket, 0) < 0) return false;
    next = zmq_msg_more(&part->msg);
    if (++received > options_.limits.max_frames + 1) {
      // More parts than any message may have: the rest is read and freed
      // at once, not collected, and the message is dropped below.
      if (received == options_.limits.max_frames + 2) parts->clear();
      continue;
    }
    const void* data = zmq_msg_data(&part->msg);
    const size_t size = zmq_msg_size(&part->msg);
    if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0) {
      parts->push_back(Buffer::CopyOf(data, size));
    } else {
      parts->push_back(Buffer::Wrap(
          data, size, std::shared_ptr<const void>(part, part.get())));
    }
  }
  if (received > options_.limits.max_frames + 1) {
    const uint64_t n = ++malformed_;
    TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                         << received << " parts; at most "
                         << options_.limits.max_frames + 1 << " are allowed";
    return false;
  }
  return true;
}

void ZmqTransport::FileMessage(ReceivedPart& first, std::vector<Buffer> parts,
                               std::string user_id) {
  absl::StatusOr<Message> msg =
      DecodeMessage(zmq_msg_data(&first.msg), zmq_msg_size(&first.msg),
                    std::move(parts), options_.limits);
  if (!msg.ok()) {
    const uint64_t n = ++malformed_;
    TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                         << msg.status().message();
    return;
  }
  if (options_.security != nullptr && !SenderMatchesKey(*msg, user_id)) return;
  if (opener_ != nullptr && !UnsealedAllowed(*msg, user_id)) return;
  if (options_.security != nullptr &&
      !options_.security->keys.IsRoleKey(user_id)) {
    msg->connection_key = std::move(user_id);
  }
  ready_.push_back(*std::move(msg));
}

void ZmqTransport::DrainParts(void* socket, bool more) {
  while (more) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, socket, 0) < 0) {
      zmq_msg_close(&part);
      return;
    }
    more = zmq_msg_more(&part);
    zmq_msg_close(&part);
  }
}

bool ZmqTransport::UnsealedAllowed(const Message& msg,
                                   const std::string& user_id) {
  const JobKeys& keys = options_.security->keys;
  if (own_role() == Role::kScheduler && msg.header.sender() == 0) {
    if (keys.node_keys.empty() || !keys.IsRoleKey(user_id)) return true;
    // launch.py gave every node a key of its own: a role's key, which
    // every node of the role holds, does not say which node registers.
    const uint64_t n = ++wrong_sender_;
    TESSERA_LOG(WARNING)
        << "dropped message #" << n << " from key " << KeyPrefix(user_id)
        << ": it registers with the " << RoleName(*keys.RoleOfKey(user_id))
        << " key, but every node of this job registers with a key of its "
        << "own (the scheduler's key file lists them): " << DebugString(msg);
    return false;
  }
  const uint64_t n = ++unsealed_;
  if (ShouldLog(n)) {
    TESSERA_LOG(WARNING)
        << "dropped unsealed message #" << n << ": in a sealed job only "
        << "a registration comes unsealed; every other message comes "
        << "sealed with its sender's node key: " << DebugString(msg);
  }
  return false;
}

bool ZmqTransport::SenderMatchesKey(const Message& msg,
                                    const std::string& user_id) {
  std::optional<Role> role = options_.security->keys.RoleOfKey(user_id);
  absl::Status allowed =
      role.has_value()
          ? CheckClaimedSender(msg.header, *role)
          : absl::PermissionDeniedError("its connection has no key");
  if (allowed.ok()) return true;
  const uint64_t n = ++wrong_sender_;
  TESSERA_LOG(WARNING) << "dropped message #" << n << " from key "
                       << (user_id.empty() ? "(none)" : KeyPrefix(user_id))
                       << ": " << allowed.message() << ": " << DebugString(msg);
  return false;
}

}  // namespace tessera::zmq_internal

// ZmqTransport's new connections for refused sealed links
// (zmq_transport_internal.h).
//
// When a peer's ZAP handler refuses a connection (a sealed lane whose table
// does not name this node within its hold, or that refuses under a flood of
// others), libzmq 4.3.4 takes the refusal for a protocol error and ends the
// connecting session for good (session_base_t::engine_error): the PUSH
// socket keeps no pipe, its queued records are freed unsent, and every later
// send would wait out the send time-out, for ever, though the peer would
// admit a new connection. ZeroMQ says so to no one but a socket monitor; the
// transport learns it when a record finds no room and nothing of the
// socket's is left in ZeroMQ (ZmqRecordSink::refused), which costs nothing
// while links are healthy (no monitor, no thread). The link then gets a new
// socket, its messages waiting meanwhile, and the messages that waited in
// the refused connection are counted as dropped (unsent_dropped_count).
// Nothing is sent, nothing is refused again: a link that sends nothing
// after a refusal is made again at its next message. A new connection that
// cannot be made (no socket; the peer's node key gone from the table, or
// another: a new life, whose link Connect makes) is tried again after the
// back-off, and meanwhile at most kMaxWaitingWhileRefused messages wait.
// A new connection takes a new link number, with the look at which link is
// the peer's: a link that Connect replaces never takes one above its
// replacement's (the peer would take the replacement's records for replays).
#include <zmq.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/zmq_transport_internal.h"

namespace tessera::zmq_internal {

absl::Duration ZmqTransport::NextDialWait(Sender& sender, absl::Time now) {
  const absl::Duration first = absl::Milliseconds(kReconnectMs);
  const absl::Duration most = absl::Milliseconds(kReconnectMaxMs);
  // As ZeroMQ's reconnect interval: from when the last socket was made (or
  // the last attempt failed), 100 ms, doubling while refusals come quickly,
  // up to 1 s.
  sender.backoff =
      sender.backoff == absl::ZeroDuration() || now - sender.dialled_at >= most
          ? first
          : std::min(sender.backoff * 2, most);
  return std::max(absl::ZeroDuration(),
                  sender.dialled_at + sender.backoff - now);
}

void ZmqTransport::Redial(const std::shared_ptr<Sender>& sender) {
  absl::Duration wait;
  size_t dropped = 0;
  {
    absl::MutexLock lock(&sender->mu);
    if (!sender->refused || sender->redialing) return;
    sender->redialing = true;
    wait = NextDialWait(*sender, absl::Now());
    // Handed to ZeroMQ whole and not known to have gone out: freed with the
    // refused connection's pipe.
    dropped = sender->unconfirmed.size();
    sender->unconfirmed.clear();
  }
  unsent_dropped_->fetch_add(dropped);
  const uint64_t n = refusals_seen_.fetch_add(1) + 1;
  if (ShouldLog(n)) {
    TESSERA_LOG(WARNING)
        << "the connection to node " << sender->peer << " at "
        << sender->endpoint
        << " was refused by its ZAP handler (its node table does not name "
           "this node yet, or it refused under load; refusal #"
        << n << "): " << dropped
        << " message(s) that waited in it dropped; connecting again in "
        << absl::FormatDuration(wait)
        << (n == kLogDropsFirst ? " (from now on one line per 1000)" : "");
  }
  DialAfter(sender, wait);
}

void ZmqTransport::DialAfter(const std::shared_ptr<Sender>& sender,
                             absl::Duration wait) {
  if (wait > absl::ZeroDuration() && pool_ != nullptr) {
    std::weak_ptr<Sender> weak = sender;
    pool_->ScheduleAfter(wait, [this, weak] {
      if (std::shared_ptr<Sender> s = weak.lock(); s != nullptr) Dial(s);
    });
    return;
  }
  Dial(sender);
}

void ZmqTransport::DialFailed(const std::shared_ptr<Sender>& sender,
                              const absl::Status& why) {
  {
    absl::MutexLock lock(&senders_mu_);
    auto it = senders_.find(sender->peer);
    // Forgotten or replaced: its waiting messages go with it.
    if (it == senders_.end() || it->second != sender) return;
  }
  absl::Duration wait;
  {
    absl::MutexLock lock(&sender->mu);
    // This attempt ends and the next is on its way (`redialing` stays set
    // for it: a Send's Redial would start a second), after the back-off from
    // now, which grows while attempts fail. Left refused, the link's
    // messages wait for it, at most kMaxWaitingWhileRefused (SendSealed).
    const absl::Time now = absl::Now();
    sender->dialled_at = now;
    wait = NextDialWait(*sender, now);
  }
  const uint64_t n = failed_dials_.fetch_add(1) + 1;
  if (ShouldLog(n)) {
    TESSERA_LOG(WARNING) << "cannot connect to node " << sender->peer << " at "
                         << sender->endpoint
                         << " again after a refusal (failure #" << n
                         << "): " << why.message() << "; trying again in "
                         << absl::FormatDuration(wait)
                         << (n == kLogDropsFirst
                                 ? " (from now on one line per 1000)"
                                 : "");
  }
  DialAfter(sender, wait);
}

void ZmqTransport::Dial(const std::shared_ptr<Sender>& sender) {
  if (closed_.load()) return;  // closing: the link goes with it
  const int peer = sender->peer;
  std::optional<PeerLink> link;
  absl::StatusOr<void*> made = DialSocket(*sender, &link);
  if (!made.ok()) {
    // Tried again after the back-off, until the table's next word on the
    // peer (its key back, a new life's link, or its end) settles it.
    DialFailed(sender, made.status());
    return;
  }
  void* socket = *made;
  auto backlog = std::make_shared<Backlog>();
  if (pool_ != nullptr) ArmBacklog(sender, *backlog);
  std::shared_ptr<std::atomic<bool>> stopped;
  std::optional<uint32_t> number;
  {
    absl::MutexLock lock(&senders_mu_);
    auto it = senders_.find(peer);
    if (it == senders_.end() || it->second != sender) {
      // Forgotten or replaced meanwhile: its waiting messages go with it.
      zmq_close(socket);
      return;
    }
    // With the look: a Connect that replaces this link takes a higher one.
    number = TakeLinkNumber();
    if (number.has_value() && options_.watch_links)
      stopped = link_watch_->Watch(peer, socket, sender->endpoint);
  }
  if (!number.has_value()) {
    zmq_close(socket);
    DialFailed(sender, NoLinkNumberLeft(peer));
    return;
  }
  void* old = nullptr;
  std::shared_ptr<std::atomic<bool>> old_stopped;
  bool refused = false;
  {
    std::vector<sealed::SealJob> finished;  // released after the lock
    absl::MutexLock lock(&sender->mu);
    EndHandshakeWatch(sender->socket, &sender->handshakes);
    old = std::exchange(sender->socket, socket);
    sender->handshakes = WatchHandshakes(socket);
    old_stopped = std::exchange(sender->monitor_stopped, std::move(stopped));
    sender->sealer = NewSealer(*link, *number);  // fresh keys
    sender->backlog = std::move(backlog);
    sender->dialled_at = absl::Now();
    sender->refused = false;
    sender->redialing = false;
    redials_.fetch_add(1);
    if (absl::Status pumped = Pump(*sender, &finished); !pumped.ok())
      TESSERA_LOG(WARNING) << pumped.message();
    refused = sender->refused;
  }
  if (old != nullptr) CloseSocket(old, old_stopped);
  TESSERA_VLOG(1) << "connecting to node " << peer << " at " << sender->endpoint
                  << " again";
  if (refused) Redial(sender);
}

absl::StatusOr<void*> ZmqTransport::DialSocket(Sender& sender,
                                               std::optional<PeerLink>* link) {
  sealed::Key32 key;
  {
    absl::MutexLock lock(&sender.mu);
    key = sender.key;
  }
  // The credentials Connect gave the refused socket, made again (a link to
  // the scheduler is CURVE, and sealed inside), to the same node key: a new
  // key is a new life of the peer, whose link Connect makes (what waited
  // for the old one is not for it).
  *link = LinkTo(sender.peer);
  if (!link->has_value())
    return absl::FailedPreconditionError("its node key is gone");
  if ((*link)->key != key) {
    return absl::FailedPreconditionError(
        "its node key changed (a new life of the node, linked anew)");
  }
  void* socket = zmq_socket(context_, ZMQ_PUSH);
  if (socket == nullptr)
    return absl::UnavailableError(absl::StrCat("no socket: ", ZmqError()));
  ConfigureSocket(socket);
  if (discard_unsent_.load()) {
    const int zero = 0;
    zmq_setsockopt(socket, ZMQ_LINGER, &zero, sizeof(zero));
  }
  absl::Status secured = absl::OkStatus();
  if (sender.peer == kSchedulerId) {
    secured = SecureSender(socket, sender.peer);
  } else {
    SealedLaneCredentials(socket, **link);
  }
  LimitSending(socket);
  if (secured.ok() && zmq_connect(socket, sender.endpoint.c_str()) != 0)
    secured = absl::UnavailableError(ZmqError());
  if (!secured.ok()) {
    zmq_close(socket);
    return secured;
  }
  return socket;
}

void* ZmqTransport::WatchHandshakes(void* socket) {
  // A socket has one monitor: a watched link's is LinkWatch's.
  if (options_.watch_links) return nullptr;
  const std::string address = absl::StrCat("inproc://tessera-handshakes-",
                                           next_handshake_watch_.fetch_add(1));
  // As LinkWatch's readers: unbounded (ZeroMQ's I/O thread sends events
  // blocking) and connected before the monitor starts.
  void* reader = zmq_socket(context_, ZMQ_PAIR);
  if (reader == nullptr) return nullptr;
  const int zero = 0;
  zmq_setsockopt(reader, ZMQ_LINGER, &zero, sizeof(zero));
  zmq_setsockopt(reader, ZMQ_RCVHWM, &zero, sizeof(zero));
  if (zmq_connect(reader, address.c_str()) != 0 ||
      zmq_socket_monitor(socket, address.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                             ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0) {
    // Refusals are then found when a record finds no pipe.
    zmq_close(reader);
    return nullptr;
  }
  return reader;
}

void ZmqTransport::ReadHandshakes(Sender& sender) {
  while (sender.handshakes != nullptr) {
    // An event is two parts: 16-bit event and 32-bit value, then the
    // endpoint.
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, sender.handshakes, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&part);
      return;
    }
    uint16_t event = 0;
    if (zmq_msg_size(&part) >= sizeof(event))
      std::memcpy(&event, zmq_msg_data(&part), sizeof(event));
    bool more = zmq_msg_more(&part) != 0;
    zmq_msg_close(&part);
    while (more) {
      zmq_msg_init(&part);
      more = zmq_msg_recv(&part, sender.handshakes, ZMQ_DONTWAIT) >= 0 &&
             zmq_msg_more(&part) != 0;
      zmq_msg_close(&part);
    }
    // Refused: ZeroMQ ends the connection for good, though it may keep its
    // pipe (taking records that go nowhere) until the socket is next used
    // and its linger has passed. Admitted: a later refusal (a reconnection
    // refused) is found when a record finds no pipe.
    if (event != ZMQ_EVENT_HANDSHAKE_SUCCEEDED) sender.refused = true;
    EndHandshakeWatch(sender.socket, &sender.handshakes);
  }
}

void ZmqTransport::EndHandshakeWatch(void* socket, void** reader) {
  if (*reader == nullptr) return;
  // The monitor stops before its reader closes: no event is on its way to
  // it then.
  zmq_socket_monitor(socket, nullptr, 0);
  zmq_close(*reader);
  *reader = nullptr;
}

}  // namespace tessera::zmq_internal

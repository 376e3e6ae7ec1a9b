// ZmqTransport: the ZeroMQ transport behind NewZmqTransport (transport.h),
// declared here for the files that define its methods, one concern each:
//   zmq_transport.cc          links and sending: binding, connecting (the
//                             CURVE / PLAIN set-up of each socket), frames out,
//                             closing, and the factory functions;
//   zmq_transport_receive.cc  receiving: frames and records in, and the checks
//                             of who sent each message;
//   zmq_transport_sealing.cc  the sealed lane: node keys, sealers, and the pump
//                             that seals what ZeroMQ has room for;
//   zmq_transport_redial.cc   a new connection for a sealed link whose
//                             connection the peer's ZAP handler refused.
// Its helpers are rooms of their own: SealPool (seal_pool.h), ZmqRecordSink
// and BlockCache (zmq_record_sink.h), LinkWatch (link_watch.h).
// Not for users: they call NewZmqTransport*.
//
// One bound PULL socket receives, one PUSH socket per peer sends. Secured
// (options.security): the PULL socket is a CURVE server (PLAIN with
// TESSERA_AUTH_ONLY) whose ZAP handler admits only the job's role keys, and
// every received message's claimed sender is checked against its connection's
// key. By default (encrypt) links to and from the scheduler are CURVE, and a
// worker or server binds its PULL socket a second time, as its sealed lane
// (PLAIN-authenticated with a password of each pair of processes,
// sealed_admission.h; its connections marked by the ZAP handler's
// kLaneProperty), where its peers' messages
// arrive as records sealed with AES-256-GCM under per-link keys
// (sealed_link.h); nodes seal what they send the scheduler too, inside CURVE,
// so that every message after the node table is bound to the node key of the
// process that sent it.
//
// Thread-safety: as Transport's. recv_mu_ guards the receiving side,
// senders_mu_ the links, each Sender's mu what is sent on it.
#ifndef TESSERA_COMMON_ZMQ_TRANSPORT_INTERNAL_H_
#define TESSERA_COMMON_ZMQ_TRANSPORT_INTERNAL_H_

#include <zmq.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/link_watch.h"
#include "common/message_counters.h"
#include "common/seal_pool.h"
#include "common/sealed_admission.h"
#include "common/sealed_link.h"
#include "common/transport.h"
#include "common/zap_handler.h"
#include "common/zmq_record_sink.h"

namespace tessera::zmq_internal {

inline std::string ZmqError() { return zmq_strerror(zmq_errno()); }

// Messages a receiving socket queues per peer before it stops reading that
// peer's connection. Bounds inbound memory at this many of the largest frame a
// peer sends (TESSERA_MAX_MESSAGE_BYTES at most) per connection.
constexpr int kReceiveHighWaterMark = 64;

// Drops of the sealed layer and of unsealed messages are logged one by one up
// to this many, then one line per kLogDropsEvery.
constexpr uint64_t kLogDropsFirst = 20;
constexpr uint64_t kLogDropsEvery = 1000;

inline bool ShouldLog(uint64_t n) {
  return n <= kLogDropsFirst || n % kLogDropsEvery == 0;
}

// ZeroMQ's reconnect interval for every socket (ZMQ_RECONNECT_IVL, doubling
// up to ZMQ_RECONNECT_IVL_MAX), which a refused sealed link's new connection
// follows too (zmq_transport_redial.cc).
constexpr int kReconnectMs = 100;
constexpr int kReconnectMaxMs = 1000;

// Messages, and bytes of them, a sealed link keeps while it waits for a new
// connection (its connection refused): past either Send says Unavailable.
// The bytes are references to the senders' frames, kept alive while they
// wait; a worker keeps about 64 MiB of one push in flight per server. One
// message alone waits whatever its size.
constexpr size_t kMaxWaitingWhileRefused = 4096;
constexpr uint64_t kMaxBytesWaitingWhileRefused = uint64_t{256} << 20;

// Keeps a received zmq_msg_t alive for as long as Buffers reference its bytes.
struct ReceivedPart {
  zmq_msg_t msg;
  ~ReceivedPart() { zmq_msg_close(&msg); }
};

class ZmqTransport : public Transport {
 public:
  explicit ZmqTransport(const ZmqTransportOptions& options);
  ~ZmqTransport() override;

  absl::StatusOr<int> Bind(const std::string& ip, int port) override;
  absl::Time caught_up_at() const override {
    return absl::FromUnixNanos(caught_up_ns_.load(std::memory_order_relaxed));
  }
  absl::Status Connect(int peer, const std::string& ip, int port) override;
  void Disconnect(int peer) override;
  void ForgetPeer(int peer) override;
  absl::Status Send(int peer, const Message& msg) override;
  absl::StatusOr<Message> Receive(absl::Duration timeout) override;

  uint64_t malformed_count() const override { return malformed_.load(); }
  uint64_t wrong_sender_count() const override {
    return wrong_sender_.load() +
           (opener_ != nullptr ? opener_->counts().wrong_sender : 0);
  }
  uint64_t unsent_dropped_count() const override {
    return unsent_dropped_->load();
  }
  uint64_t refused_connection_count() const override {
    const ZapHandler* zap = zap_counts_.load();
    return zap == nullptr ? 0 : zap->refused_count();
  }
  uint64_t redial_count() const override { return redials_.load(); }

  std::string node_key() const override;
  int sealed_port() const override { return sealed_port_.load(); }
  bool nodes_have_own_keys() const override {
    return options_.security != nullptr &&
           !options_.security->keys.node_keys.empty();
  }
  void SetPeerIdentity(int peer, const PeerIdentity& identity) override;
  SealedDrops sealed_drops() const override;

  std::vector<LostLink> TakeLostLinks() override {
    return link_watch_->TakeLostLinks();
  }
  void DiscardUnsent() override;
  void Close() override;

 private:
  // Tests reach the links through it (tests/core/sealed_redial_test.cc).
  friend class ZmqTransportTestPeer;

  struct Sender {
    absl::Mutex mu;
    // A refused sealed link gets a new one (zmq_transport_redial.cc).
    void* socket ABSL_GUARDED_BY(mu) = nullptr;
    std::string endpoint;  // set before the link is shared
    int peer = 0;
    // Set on a sealed link: every message goes as records, sealed to the
    // peer's node key `key` (a new connection is made only to that key).
    std::unique_ptr<sealed::Sealer> sealer ABSL_GUARDED_BY(mu);
    sealed::Key32 key ABSL_GUARDED_BY(mu) = {};
    // Messages (the first perhaps part-sealed) waiting for room in ZeroMQ.
    std::deque<sealed::SealJob> pending ABSL_GUARDED_BY(mu);
    // The socket's (a new socket has a new one).
    std::shared_ptr<Backlog> backlog ABSL_GUARDED_BY(mu) =
        std::make_shared<Backlog>();
    std::shared_ptr<BlockCache> blocks;  // the transport's
    // Set once the socket's monitor (a watched link) has stopped for good:
    // its reader may close then (TakeLostLinks), never before.
    std::shared_ptr<std::atomic<bool>> monitor_stopped ABSL_GUARDED_BY(mu);
    // The transport's count of messages dropped unsent (Send said OK).
    std::shared_ptr<std::atomic<uint64_t>> unsent_dropped;
    // Sealed links (zmq_transport_redial.cc): the end, in
    // backlog->allocated, of each message handed whole to ZeroMQ on this
    // socket and not yet known to have gone out; when the socket was made;
    // whether its connection was refused (pending then waits for the new
    // one), and whether the new one is on its way; the wait before it.
    std::deque<int64_t> unconfirmed ABSL_GUARDED_BY(mu);
    absl::Time dialled_at ABSL_GUARDED_BY(mu) = absl::Now();
    bool refused ABSL_GUARDED_BY(mu) = false;
    bool redialing ABSL_GUARDED_BY(mu) = false;
    absl::Duration backoff ABSL_GUARDED_BY(mu);
    // Until its first handshake's outcome is read (a sealed link that is
    // not watched): the reader of the socket's monitor (WatchHandshakes).
    void* handshakes ABSL_GUARDED_BY(mu) = nullptr;
    ~Sender() {
      absl::MutexLock hold(&mu);
      if (unsent_dropped != nullptr) unsent_dropped->fetch_add(pending.size());
      EndHandshakeWatch(socket, &handshakes);
      if (socket != nullptr) CloseSocket(socket, monitor_stopped);
    }
  };
  // Closes a sender's socket; `monitor_stopped`: the flag of its monitor
  // (a watched link), or null.
  static void CloseSocket(void* socket,
                          const std::shared_ptr<std::atomic<bool>>& stopped) {
    if (stopped != nullptr) {
      // Before the socket goes: ZeroMQ's I/O thread sends its events
      // blocking, so no event may be left on its way to a reader that
      // closes. The reader's end is still open (unbounded) here.
      zmq_socket_monitor(socket, nullptr, 0);
      stopped->store(true);
    }
    zmq_close(socket);
  }

  // What sealing to a peer needs.
  struct PeerLink {
    Role role;
    sealed::Key32 key;
    sealed::PeerSecrets secrets;  // filled by LinkTo
    int sealed_port;
  };

  Role own_role() const { return options_.security->keys.role; }
  // Ends `peer`'s entry of links_ and the key agreements LinkKeys kept for
  // its key. Sealed() only.
  void ForgetLink(int peer) ABSL_LOCKS_EXCLUDED(senders_mu_);

  bool Sealed() const {
    return options_.security != nullptr && options_.security->encrypt;
  }

  bool Encrypted() const {
    return options_.security != nullptr && options_.security->encrypt;
  }

  // Links and sending (zmq_transport.cc).
  void ConfigureSocket(void* socket);
  static int BoundPort(void* socket, int port);
  void SecureReceiver(void* socket);
  // The main lane's bound on a message (TESSERA_MAX_MESSAGE_BYTES).
  void LimitMainLane(void* socket);
  // A PUSH socket to `peer` authenticates with this node's role key and, with
  // CURVE, authenticates the peer by its role's public key.
  absl::Status SecureSender(void* socket, int peer);
  // A sender's socket's bound on its queue and its send time-out.
  void LimitSending(void* socket);
  absl::Status SendFrames(Sender& sender, int peer, const Message& msg,
                          size_t header_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu);

  // Receiving (zmq_transport_receive.cc).
  // Counts and logs a received message on its way out of the transport.
  Message Deliver(Message msg);
  // Nothing waits to be read now (caught_up_at()).
  void NoteCaughtUp();
  // Takes one message (all its frames) off receiver_, waiting at most its
  // receive time-out, and files what it yields into ready_: a sealed record
  // goes to the opener, a message of frames is decoded and checked. False
  // when nothing was there (or it failed).
  bool ReceiveOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_);
  // Hands the sealed record in `first` to the opener, which files the
  // messages it completes into ready_.
  // `sealed_lane`: it came on the sealed lane, whose User-Id names the
  // connection's role and node key ("worker:<Z85>", sealed_admission.h);
  // else on the CURVE lane, whose User-Id is a key of the job.
  void OpenRecord(std::shared_ptr<ReceivedPart> first,
                  const std::string& user_id, uint64_t connection,
                  bool sealed_lane) ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_);
  // Receives the data parts that follow a header (`more`: there are some)
  // into `parts`. False (logged when malformed) when the message is dropped.
  bool ReceiveDataParts(void* socket, bool more, std::vector<Buffer>* parts);
  // Decodes the message of header `first` and `parts`, and files it into
  // ready_ if its connection's key `user_id` may send it.
  void FileMessage(ReceivedPart& first, std::vector<Buffer> parts,
                   std::string user_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_);
  void DrainParts(void* socket, bool more);
  // In a sealed job only a node's registration (before it has an id, over
  // CURVE to the scheduler) comes unsealed: anything else must be bound to
  // the node key of the process that sent it.
  bool UnsealedAllowed(const Message& msg, const std::string& user_id);
  // False (counted, warned about) when `msg` claims a sender its connection's
  // key may not speak for.
  bool SenderMatchesKey(const Message& msg, const std::string& user_id);

  // Sealing (zmq_transport_sealing.cc).
  void SetUpSealing();
  // The node key to seal with: options_.node_secret's, or a fresh one.
  sealed::NodeKey OwnNodeKey() const;
  absl::Status BindSealedLane(const std::string& ip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_);
  // Gives `socket` (a new link's to `peer`) its credentials: those of the
  // peer's sealed lane (a worker or server, `*link` set), or CURVE / PLAIN
  // (the scheduler, `*link` set once the table gave its node key, for the
  // sealer inside; or a job without sealing). `*endpoint`: the sealed lane's
  // at `ip` (its port from the node table), or `ip`:`port`.
  // FailedPrecondition when a worker or server has no node key.
  absl::Status AimSocket(void* socket, int peer, const std::string& ip,
                         int port, std::string* endpoint,
                         std::optional<PeerLink>* link);
  // The number of a new link; every link's is above those taken before
  // (taken with the look at which link is the peer's, so that a link being
  // replaced never takes a higher one than its replacement). nullopt once
  // all 2^32 - 1 are taken (logged): a number, and with it a link key and
  // its nonces, would repeat, so no link is made any more.
  std::optional<uint32_t> TakeLinkNumber()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(senders_mu_);
  // What a link that cannot be made because of that says.
  static absl::Status NoLinkNumberLeft(int peer);
  // The sealed lane's PLAIN credentials of `link`'s pair, on `socket`.
  void SealedLaneCredentials(void* socket, const PeerLink& link);
  // The link to `peer` with its key agreements (made the first time);
  // nullopt when the node table gave it no key, or one of small order.
  std::optional<PeerLink> LinkTo(int peer);
  // A new link to `link`'s peer: its own number (TakeLinkNumber), so its key
  // is fresh.
  std::unique_ptr<sealed::Sealer> NewSealer(const PeerLink& link,
                                            uint32_t number);
  // Queues `msg` on a sealed link and seals what ZeroMQ has room for now;
  // the pool seals the rest as records go out. Unavailable when the link
  // waits for a new connection with kMaxWaitingWhileRefused messages.
  absl::Status SendSealed(Sender& sender, const Message& msg,
                          size_t header_size,
                          std::vector<sealed::SealJob>* sent_jobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu);
  // Seals the link's waiting messages while ZeroMQ holds less than
  // kBacklogLimit of its records; when it holds more, the free callback of
  // the record that brings it down to kBacklogResume hands the link to the
  // pool.
  // Jobs that are done (or failed) move to `finished`, for the caller to
  // release once it has let go of sender.mu.
  static absl::Status Pump(Sender& sender,
                           std::vector<sealed::SealJob>* finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu);
  // Gives `backlog` (the link's, or its new socket's) the way back to the
  // link: the pool pumps it when records have gone out.
  void ArmBacklog(const std::shared_ptr<Sender>& sender, Backlog& backlog);
  // Pumps the link on a pool thread; a refused connection is made again.
  void PumpLater(const std::weak_ptr<Sender>& weak);

  // A new connection for a refused link (zmq_transport_redial.cc).
  // Watches the first handshake of `socket` (a sealed link's, not one that
  // LinkWatch watches): the reader of its monitor, or null.
  void* WatchHandshakes(void* socket);
  // Reads what the link's handshake watch said: refused (sender.refused)
  // or admitted; either ends the watch.
  static void ReadHandshakes(Sender& sender)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu);
  static void EndHandshakeWatch(void* socket, void** reader);
  // Counts what waited in the refused connection and makes the link a new
  // socket, now or (when refusals come quickly) after the back-off, on the
  // pool. Nothing when the link is not refused or already redialing.
  void Redial(const std::shared_ptr<Sender>& sender)
      ABSL_LOCKS_EXCLUDED(sender->mu, senders_mu_);
  // The back-off before the link's next socket (set in sender.backoff), and
  // what is left of it at `now`.
  static absl::Duration NextDialWait(Sender& sender, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu);
  // Dials after `wait` on the pool (now, when it is zero).
  void DialAfter(const std::shared_ptr<Sender>& sender, absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(sender->mu, senders_mu_);
  // A redial failed (`why`): logs it and tries again after the back-off, the
  // link left refused (its messages wait, bounded: SendSealed).
  void DialFailed(const std::shared_ptr<Sender>& sender,
                  const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(sender->mu, senders_mu_);
  // Makes the new socket and hands it the waiting messages, unless the
  // link was forgotten or replaced meanwhile, its peer's node key is no
  // longer the one it sealed to (a new life of the peer, whose link Connect
  // makes), or the transport closed.
  void Dial(const std::shared_ptr<Sender>& sender)
      ABSL_LOCKS_EXCLUDED(sender->mu, senders_mu_);
  // A new socket for `sender`, secured and connected as Connect's, to the
  // node key it sealed to; `*link` its peer's.
  absl::StatusOr<void*> DialSocket(Sender& sender,
                                   std::optional<PeerLink>* link)
      ABSL_LOCKS_EXCLUDED(sender.mu, senders_mu_);

  const ZmqTransportOptions options_;
  std::unique_ptr<MessageCounters> counters_;  // null: not counted
  void* context_ = nullptr;
  absl::Mutex recv_mu_;
  std::unique_ptr<ZapHandler> zap_ ABSL_GUARDED_BY(recv_mu_);
  // zap_ for counting without recv_mu_ (Receive holds it while it waits);
  // zap_ lives as long as the transport.
  std::atomic<const ZapHandler*> zap_counts_{nullptr};
  void* receiver_ ABSL_GUARDED_BY(recv_mu_) = nullptr;
  // receiver_ is bound as the sealed lane too (BindSealedLane).
  bool sealed_lane_bound_ ABSL_GUARDED_BY(recv_mu_) = false;
  int receive_timeout_ms_ ABSL_GUARDED_BY(recv_mu_) = -1;
  // Messages received but not yet returned (a record can complete several).
  std::deque<Message> ready_ ABSL_GUARDED_BY(recv_mu_);
  // Messages Send took and dropped before ZeroMQ had them (Senders share
  // it: one may outlive its place in senders_ while a Send finishes).
  const std::shared_ptr<std::atomic<uint64_t>> unsent_dropped_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  absl::Mutex senders_mu_;
  std::map<int, std::shared_ptr<Sender>> senders_ ABSL_GUARDED_BY(senders_mu_);
  std::map<int, PeerLink> links_ ABSL_GUARDED_BY(senders_mu_);
  // Watched links (options_.watch_links): what each one's monitor said.
  std::unique_ptr<LinkWatch> link_watch_;  // set in the constructor
  std::atomic<bool> closed_{false};
  std::atomic<bool> discard_unsent_{false};  // DiscardUnsent was called
  std::atomic<uint64_t> malformed_{0};
  // caught_up_at(), as Unix ns; from construction until the first receive.
  std::atomic<int64_t> caught_up_ns_{absl::ToUnixNanos(absl::Now())};
  // A blocking receive that returned a message does not say whether more
  // wait: after one, when caught_up_ns_ is older than this, the socket is
  // asked (ZMQ_EVENTS), at most that often.
  static constexpr int64_t kCaughtUpCheckNs = 20'000'000;
  std::atomic<uint64_t> wrong_sender_{0};
  std::atomic<uint64_t> unsealed_{0};
  std::atomic<uint64_t> refusals_seen_{0};  // by this node's links
  std::atomic<uint64_t> redials_{0};
  std::atomic<uint64_t> failed_dials_{0};  // redials that failed (logged)

  // Sealing (Sealed() only; set in the constructor, then read-only).
  std::shared_ptr<const sealed::LinkKeys> link_keys_;
  std::unique_ptr<sealed::SealedReceiver> opener_;
  // Who may connect to the sealed lane (the ZAP handler asks it); its
  // directory follows opener_'s.
  std::shared_ptr<sealed::Admission> admission_;
  // Outlives the ZeroMQ context: records' free callbacks, which run until
  // zmq_ctx_term returns, schedule on it.
  std::unique_ptr<SealPool> pool_;
  std::shared_ptr<BlockCache> blocks_;
  // 0: all taken (TakeLinkNumber; 0 is no link's).
  uint32_t next_link_ ABSL_GUARDED_BY(senders_mu_) = 1;
  std::atomic<uint64_t> next_handshake_watch_{0};
  std::atomic<int> sealed_port_{0};
  // Test-only (ZmqTransportTestPeer), set before Connect: runs in Connect
  // once the new link's socket has its credentials and before the link
  // replaces the peer's.
  std::function<void()> before_link_replaced_;
};

}  // namespace tessera::zmq_internal

#endif  // TESSERA_COMMON_ZMQ_TRANSPORT_INTERNAL_H_

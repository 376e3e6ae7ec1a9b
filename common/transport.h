// Transport: moves Messages between nodes. The ZeroMQ implementation binds one
// PULL socket per node and connects one PUSH socket per peer; tests run nodes
// inside one process over an in-memory one (tests/support/memory_network.h).
//
//   std::unique_ptr<Transport> t = NewZmqTransport();
//   absl::StatusOr<int> port = t->Bind("127.0.0.1", 0);   // any free port
//   t->Connect(kSchedulerId, "127.0.0.1", 9000);
//   t->Send(kSchedulerId, msg);
//   absl::StatusOr<Message> in = t->Receive(absl::Milliseconds(100));
//
// Thread-safety: Send/Connect/Disconnect may be called from any thread; Receive
// from one thread at a time. Data frames are sent without copying: a Buffer
// stays referenced until the transport has written it out.
#ifndef TESSERA_COMMON_TRANSPORT_H_
#define TESSERA_COMMON_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "common/metrics.h"
#include "common/options.h"

namespace tessera {

// What the node table says of a peer that seals (sealed_link.h).
struct PeerIdentity {
  Role role = Role::kWorker;
  std::string node_key;  // 32 bytes of X25519
  int sealed_port = 0;   // its sealed lane; 0 for the scheduler
};

// Records and messages a sealed transport dropped, by reason (see
// sealed::DropCounts), and unsealed messages a secured job refuses.
struct SealedDrops {
  uint64_t malformed = 0;
  uint64_t unauthentic = 0;
  uint64_t replayed = 0;
  uint64_t out_of_order = 0;
  uint64_t unknown_key = 0;
  uint64_t incomplete = 0;
  uint64_t wrong_sender = 0;
  uint64_t unsealed = 0;   // data or node messages that came without a seal
  uint64_t throttled = 0;  // from a connection whose records failed to open
  uint64_t total() const {
    return malformed + unauthentic + replayed + out_of_order + unknown_key +
           incomplete + wrong_sender + unsealed + throttled;
  }
};

// "12 (unauthentic 3, replayed 9)": the non-zero reasons, for exit summaries.
std::string DescribeSealedDrops(const SealedDrops& d);

class Transport {
 public:
  virtual ~Transport() = default;

  // Binds the receiving endpoint at ip:port (port 0: any free port) and returns
  // the port. Unavailable (with the OS error) when the address cannot be bound.
  virtual absl::StatusOr<int> Bind(const std::string& ip, int port) = 0;

  // Makes `peer` reachable at ip:port. Connecting is asynchronous: messages
  // queue until the connection is up. Reconnecting a known peer replaces its
  // address.
  virtual absl::Status Connect(int peer, const std::string& ip, int port) = 0;
  virtual void Disconnect(int peer) = 0;
  // Disconnect, and in a sealed job also forgets the peer's node key: its
  // records no longer open here (a node declared dead gets nowhere).
  virtual void ForgetPeer(int peer) { Disconnect(peer); }

  // Queues `msg` for `peer`. Unavailable when the peer is unknown or its queue
  // stayed full for the send time-out.
  virtual absl::Status Send(int peer, const Message& msg) = 0;

  // Returns the next well-formed message, waiting at most `timeout`. Malformed
  // messages are counted, logged and dropped. DeadlineExceeded on time-out,
  // Cancelled after Close.
  virtual absl::StatusOr<Message> Receive(absl::Duration timeout) = 0;

  // Number of malformed messages dropped so far.
  virtual uint64_t malformed_count() const = 0;

  // When a receive last found nothing waiting to be read: everything peers
  // sent before then has been taken. Silence is judged up to this time
  // (common/silence.h), so that a receiver held up by a backlog does not
  // take its own delay for its peers' (issue #46). InfiniteFuture where the
  // transport does not tell (silence is then judged by the clock). Any
  // thread.
  virtual absl::Time caught_up_at() const { return absl::InfiniteFuture(); }

  // Secured transports: messages dropped because their claimed sender did not
  // match the key of their connection (see sender_check.h), and connections
  // refused because the peer had no key of the job. 0 for the others.
  virtual uint64_t wrong_sender_count() const { return 0; }
  virtual uint64_t refused_connection_count() const { return 0; }
  // Messages Send took (it returned OK) that the transport then dropped
  // before they went out: still waiting to be sealed when their link was
  // replaced, forgotten or closed, or discarded (DiscardUnsent); or queued
  // in ZeroMQ for a sealed link's connection that the peer refused before
  // they went out (see redial_count). What ZeroMQ drops of its own queue
  // after the linger is not known here.
  virtual uint64_t unsent_dropped_count() const { return 0; }
  // Sealed links connected again because the peer's ZAP handler refused
  // their connection (its table did not name this node yet, or it refused
  // under load): ZeroMQ never connects a refused socket again, so the link
  // gets a new socket, 100 ms after the refused one was made, doubling up
  // to 1 s while refusals come quickly.
  virtual uint64_t redial_count() const { return 0; }

  // Sealed links (secured jobs; docs/security.md). The node key this
  // transport seals with (32 bytes, empty when it does not seal) and the
  // port of its sealed lane (0 when it has none, as the scheduler); a node
  // registers both, and the scheduler's goes into node tables.
  virtual std::string node_key() const { return std::string(); }
  // True when every node of the job has a node key of its own and the
  // scheduler a list of them (launch.py's jobs): a registration then comes
  // with its connection's key (Message::connection_key).
  virtual bool nodes_have_own_keys() const { return false; }
  virtual int sealed_port() const { return 0; }
  // What the node table says of `peer`. Call before Connect(peer): a link
  // to a worker or server goes to its sealed lane, sealed for its key. Records
  // sealed with the key are taken as `peer`'s, and its old key's refused.
  virtual void SetPeerIdentity(int peer, const PeerIdentity& identity) {}
  virtual SealedDrops sealed_drops() const { return SealedDrops(); }

  // A peer whose process is gone: the connection to it was closed by its end
  // and connecting again has been refused since (nothing listens at its
  // address any more). A live peer whose connection broke (a reset, a
  // killed connection) is connected to again; a silent or unreachable host
  // refuses nothing, and is left to the heartbeats.
  struct LostLink {
    int peer = 0;
    std::string endpoint;
    absl::Time closed;  // when the close was seen (read every 100 ms)
    int refused = 0;    // connection attempts refused since
  };
  // The watched links (ZmqTransportOptions::watch_links) lost since the last
  // call, each once per closing. Call from one thread (the scheduler's).
  virtual std::vector<LostLink> TakeLostLinks() { return {}; }

  // What is queued and not yet sent is dropped, now and when the transport
  // closes, instead of waiting out the linger for peers that have gone (the
  // scheduler, once every node acknowledged the job's end).
  virtual void DiscardUnsent() {}

  // Stops the transport; pending Receive calls return Cancelled.
  virtual void Close() = 0;
};

struct ZmqTransportOptions {
  int io_threads = 1;
  absl::Duration send_timeout = absl::Seconds(30);
  absl::Duration linger = absl::Seconds(2);
  int64_t max_message_bytes = -1;  // ZMQ_MAXMSGSIZE per part; -1: unlimited
  // The sealed lane's port (TESSERA_SEALED_PORT; 0: any free one).
  int sealed_port = 0;
  // How long the sealed lane holds a connection whose node key the node
  // table does not name yet before refusing it (ZapHandler's hold); tests
  // shorten it.
  absl::Duration admission_hold = absl::Seconds(10);
  // How many of those held connections one source address may have (the
  // rest of ZapHoldQueue::Limits: at most 4,096 in all). A host's processes
  // all come from its address, so a node of a job sets it to the job's
  // process count (NewZmqTransportForNode); never below 64.
  size_t admission_holds_per_address = 64;
  // The scheduler's IP address (DMLC_PS_ROOT_URI resolved), whose failed
  // scheduler claims on the sealed lane have a budget of their own
  // (sealed_admission.h); empty: not known.
  std::string scheduler_address;
  // Plaintext bytes per sealed record (sealed_link.h).
  size_t sealed_record_bytes = 256 << 10;
  // The credit (Options::send_credit_bytes): SO_SNDBUF of every sending
  // socket, SO_RCVBUF of the receiving one, and the sealed lane's receive
  // queue of credit / sealed_record_bytes records per peer, clamped to
  // [4, kReceiveHighWaterMark]. 0: the kernel's own buffers and a queue of
  // kReceiveHighWaterMark.
  int64_t credit_bytes = 0;
  CodecLimits limits;
  // Every socket authenticated with these keys and every received message's
  // sender checked against its connection's key; nullptr: none of it
  // (TESSERA_INSECURE=1). With encrypt (the default), links to and from the
  // scheduler are CURVE and links between workers and servers are sealed
  // (sealed_link.h) on a second, PLAIN-authenticated lane; nodes seal what
  // they send the scheduler too. Without encrypt (TESSERA_AUTH_ONLY=1),
  // PLAIN everywhere and nothing sealed.
  std::shared_ptr<const ConnectionSecurity> security;
  // Messages and bytes sent and received by command are counted here
  // (MessageCounters); nullptr: not counted.
  MetricsRegistry* metrics = nullptr;
  // The secret of the node key this transport seals with (32 bytes): tests
  // that seal records of its links themselves (the rogue-node harness).
  // Empty, as the daemons leave it: a fresh key made at start, never stored.
  SecretString node_secret;
  // Watch every link this transport connects (ZeroMQ's socket monitor) for
  // Transport::TakeLostLinks: the scheduler's, which learns of a killed
  // process from its closed, refusing port within a few hundred ms instead
  // of PS_HEARTBEAT_TIMEOUT.
  bool watch_links = false;
};

std::unique_ptr<Transport> NewZmqTransport(
    const ZmqTransportOptions& options = {});

// A ZeroMQ transport whose receiving socket refuses frames over
// `max_frame_bytes` (TESSERA_MAX_MESSAGE_BYTES): ZeroMQ drops the connection
// of a peer that sends one, so a bogus length never reaches an allocation.
std::unique_ptr<Transport> NewZmqTransportForFrames(int64_t max_frame_bytes);

// The transport of a scheduler, server or worker: NewZmqTransportForFrames
// with the security LoadConnectionSecurity(options) gives (keys from
// TESSERA_KEY_FILE / TESSERA_KEY_DIR, or none with TESSERA_INSECURE=1),
// counting its messages in MetricsRegistry::Global().
// InvalidArgument naming the variable when the keys are missing or unusable.
absl::StatusOr<std::unique_ptr<Transport>> NewZmqTransportForNode(
    const Options& options);

}  // namespace tessera

#endif  // TESSERA_COMMON_TRANSPORT_H_

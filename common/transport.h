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

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/curve_keys.h"
#include "common/message.h"
#include "common/metrics.h"
#include "common/options.h"

namespace tessera {

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

  // Queues `msg` for `peer`. Unavailable when the peer is unknown or its queue
  // stayed full for the send time-out.
  virtual absl::Status Send(int peer, const Message& msg) = 0;

  // Returns the next well-formed message, waiting at most `timeout`. Malformed
  // messages are counted, logged and dropped. DeadlineExceeded on time-out,
  // Cancelled after Close.
  virtual absl::StatusOr<Message> Receive(absl::Duration timeout) = 0;

  // Number of malformed messages dropped so far.
  virtual uint64_t malformed_count() const = 0;

  // Secured transports: messages dropped because their claimed sender did not
  // match the key of their connection (see sender_check.h), and connections
  // refused because the peer had no key of the job. 0 for the others.
  virtual uint64_t wrong_sender_count() const { return 0; }
  virtual uint64_t refused_connection_count() const { return 0; }

  // Stops the transport; pending Receive calls return Cancelled.
  virtual void Close() = 0;
};

struct ZmqTransportOptions {
  int io_threads = 1;
  absl::Duration send_timeout = absl::Seconds(30);
  absl::Duration linger = absl::Seconds(2);
  int64_t max_message_bytes = -1;  // ZMQ_MAXMSGSIZE per part; -1: unlimited
  CodecLimits limits;
  // Every socket authenticated with these keys (CURVE, or PLAIN when
  // !encrypt) and every received message's sender checked against its
  // connection's key; nullptr: none of it (TESSERA_INSECURE=1).
  std::shared_ptr<const ConnectionSecurity> security;
  // Messages and bytes sent and received by command are counted here
  // (MessageCounters); nullptr: not counted.
  MetricsRegistry* metrics = nullptr;
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

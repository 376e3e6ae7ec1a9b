// ZapHandler: the ZeroMQ authentication (ZAP, RFC 27) handler of one ZeroMQ
// context. A CURVE or PLAIN server socket asks it about every connecting peer;
// without a handler ZeroMQ accepts any client key, so a secured transport
// starts one before it binds.
//
//   absl::StatusOr<std::unique_ptr<ZapHandler>> zap =
//       ZapHandler::Start(context, security);
//   ... zmq_bind(receiver, ...);           // CURVE server, ZMQ_ZAP_DOMAIN set
//   (*zap)->Stop();                        // before zmq_ctx_term
//
// On the node's own port (ZAP domain kMainDomain) it accepts a CURVE client
// whose key is one of the job's three role keys (ConnectionSecurity::keys),
// or, with encrypt off (TESSERA_AUTH_ONLY=1), a PLAIN client whose username is
// a role and whose password is that role's (CheckPlainPassword); on the sealed
// lane (kSealedDomain, whose records are sealed, sealed_link.h) only such a
// PLAIN client. It gives the connection that role's public key (Z85) and the
// connection's number (from 1, in the order accepted) as its User-Id,
// "KEY#N", which every message received on it carries
// (zmq_msg_gets(msg, "User-Id")): the number tells one connection's records
// from another's (the sealed lane's parking quota, sealed_link.h). A sealed
// lane's connections also carry kLaneProperty.
// Anything else is refused (status 400) and counted; the first refusals are
// logged with the peer's address and key.
//
// Thread-safety: Start and Stop from one thread; refused_count from any.
#ifndef TESSERA_COMMON_ZAP_HANDLER_H_
#define TESSERA_COMMON_ZAP_HANDLER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "common/curve_keys.h"

namespace tessera {

class ZapHandler {
 public:
  static constexpr char kMainDomain[] = "tessera";
  static constexpr char kSealedDomain[] = "tessera-sealed";
  // The metadata property (zmq_msg_gets) the handler gives every message of
  // a sealed-lane connection, with the value kSealedDomain: the lane is a
  // second endpoint of the node's one receiving socket, so its messages are
  // told from the main lane's by this alone.
  static constexpr char kLaneProperty[] = "X-Tessera-Lane";

  // Binds inproc://zeromq.zap.01 in `context` and serves it on a thread of its
  // own. Unavailable when the endpoint cannot be bound (another handler in
  // this context).
  static absl::StatusOr<std::unique_ptr<ZapHandler>> Start(
      void* context, std::shared_ptr<const ConnectionSecurity> security);

  ~ZapHandler();

  // Stops the thread and closes the socket. Idempotent.
  void Stop();

  uint64_t refused_count() const { return refused_.load(); }

 private:
  ZapHandler(void* context, void* socket,
             std::shared_ptr<const ConnectionSecurity> security);
  void Serve();
  // Answers one request (its frames already received); true to accept.
  bool Decide(const std::vector<std::string>& request, std::string* user_id,
              std::string* why) const;

  void* context_;  // for Stop's wake-up
  void* socket_;
  const std::shared_ptr<const ConnectionSecurity> security_;
  // ExpectedPlainPassword of each role, by Role: computed once, not with an
  // X25519 per connection.
  std::array<SecretString, 3> passwords_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  uint64_t connections_ = 0;  // accepted; Serve's thread only
  std::thread thread_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_ZAP_HANDLER_H_

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
// a role and whose password is that role's (CheckPlainPassword); it gives the
// connection that role's public key (Z85) as its User-Id. On the sealed lane
// (kSealedDomain, whose records are sealed, sealed_link.h) it takes only a
// PLAIN client with a password of its own pair of processes, which the
// sealed::Admission checks (sealed_admission.h): the User-Id is then the
// client's role and verified node key, "worker:<Z85>", and the sealed
// receiver takes on that connection only records of that node key. A client
// whose node key this node does not know yet (its node table has not come)
// waits: its answer is held, and given once the key is known (within 10 ms
// of the change of the admission's directory that adds it: only the
// requests claiming an added key are decided again) or refused after
// `hold` (10 s, the parking time of records). Held answers are bounded in
// all and per source address (ZapHoldQueue, zap_hold_queue.h: 4,096 and 64),
// and a full queue refuses the newest of the address holding the most, not
// whoever comes next. ZeroMQ's ZAP requests are
// answered out of order (a ROUTER socket), so one waiting connection holds
// up no other. Every accepted connection's User-Id ends with its number
// (from 1, in the order accepted), "KEY#N": every message received on it
// carries it (zmq_msg_gets(msg, "User-Id")), and the number tells one
// connection's records from another's (the sealed lane's parking quota). A
// sealed lane's connections also carry kLaneProperty.
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
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/curve_keys.h"
#include "common/sealed_admission.h"
#include "common/zap_hold_queue.h"

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
  // `admission` decides the sealed lane's connections (none: all refused).
  static absl::StatusOr<std::unique_ptr<ZapHandler>> Start(
      void* context, std::shared_ptr<const ConnectionSecurity> security,
      std::shared_ptr<sealed::Admission> admission = nullptr,
      absl::Duration hold = absl::Seconds(10),
      ZapHoldQueue::Limits held_limits = ZapHoldQueue::Limits{});

  ~ZapHandler();

  // Stops the thread and closes the socket. Idempotent.
  void Stop();

  uint64_t refused_count() const { return refused_.load(); }
  // Connections whose answer is held now (their node key not yet known).
  size_t waiting_count() const { return waiting_.load(); }
  // Held requests decided again (those whose key the table added).
  uint64_t rechecked_count() const { return rechecked_.load(); }

 private:
  using Verdict = sealed::Admission::Verdict;
  using Request = ZapRequest;

  ZapHandler(void* context, void* socket,
             std::shared_ptr<const ConnectionSecurity> security,
             std::shared_ptr<sealed::Admission> admission, absl::Duration hold,
             ZapHoldQueue::Limits held_limits);
  void Serve();
  // Takes one request off the socket; false when there was none (or it was
  // cut short).
  bool ReceiveRequest(Request* request);
  // Decides one request (kWait: hold it).
  Verdict Decide(const std::vector<std::string>& request, std::string* user_id,
                 std::string* why) const;
  Verdict DecidePlain(const std::vector<std::string>& request, bool sealed_lane,
                      std::string* user_id, std::string* why) const;
  // Answers the held requests that can be now: admitted or refused (those
  // whose key the admission added since the last look), or past their time.
  void Revisit(absl::Time now);
  // Holds `request`, refused by Decide to wait (its key not known yet);
  // answers the request the hold queue refuses, if any.
  void Hold(Request request);
  void Answer(const Request& request, bool accept, std::string user_id,
              const std::string& why);

  void* context_;  // for Stop's wake-up
  void* socket_;
  const std::shared_ptr<const ConnectionSecurity> security_;
  const std::shared_ptr<sealed::Admission> admission_;
  const absl::Duration hold_;
  // Held requests, and the admission's version when they were last
  // checked; Serve's thread only.
  ZapHoldQueue held_;
  uint64_t held_checked_at_ = 0;
  std::atomic<size_t> waiting_{0};
  std::atomic<uint64_t> rechecked_{0};
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

#include "common/zap_handler.h"

#include <zmq.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/trace.h"

namespace tessera {
namespace {

constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";
// Refusals logged one by one; after that one line per kLogEvery.
constexpr uint64_t kLogFirst = 20;
constexpr uint64_t kLogEvery = 1000;

// ZMTP's encoding of one metadata property (RFC 27's metadata frame): the
// name's length in one octet, the name, the value's length in four (network
// order), the value.
std::string Property(absl::string_view name, absl::string_view value) {
  std::string out(1, static_cast<char>(name.size()));
  absl::StrAppend(&out, name);
  const uint32_t size = static_cast<uint32_t>(value.size());
  for (int shift = 24; shift >= 0; shift -= 8)
    out.push_back(static_cast<char>((size >> shift) & 0xff));
  absl::StrAppend(&out, value);
  return out;
}

std::string Z85(const std::string& raw) {
  char text[kZ85KeyLength + 1];
  zmq_z85_encode(text, reinterpret_cast<const uint8_t*>(raw.data()), 32);
  return std::string(text, kZ85KeyLength);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ZapHandler>> ZapHandler::Start(
    void* context, std::shared_ptr<const ConnectionSecurity> security,
    std::shared_ptr<sealed::Admission> admission, absl::Duration hold,
    ZapHoldQueue::Limits held_limits) {
  // A ROUTER, not a REP: a held request (a sealed-lane client whose node key
  // is not known yet) must not hold up the answers of the others.
  void* socket = zmq_socket(context, ZMQ_ROUTER);
  if (socket == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("ZAP handler: zmq_socket: ", zmq_strerror(zmq_errno())));
  }
  const int linger = 0;
  zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(socket, kZapEndpoint) != 0) {
    const std::string err = zmq_strerror(zmq_errno());
    zmq_close(socket);
    return absl::UnavailableError(
        absl::StrCat("ZAP handler: cannot bind ", kZapEndpoint, ": ", err));
  }
  std::unique_ptr<ZapHandler> handler(
      new ZapHandler(context, socket, std::move(security), std::move(admission),
                     hold, held_limits));
  handler->thread_ = std::thread([h = handler.get()] {
    trace::SetThreadName("zap-handler");
    h->Serve();
  });
  return handler;
}

ZapHandler::ZapHandler(void* context, void* socket,
                       std::shared_ptr<const ConnectionSecurity> security,
                       std::shared_ptr<sealed::Admission> admission,
                       absl::Duration hold, ZapHoldQueue::Limits held_limits)
    : context_(context),
      socket_(socket),
      security_(std::move(security)),
      admission_(std::move(admission)),
      hold_(hold),
      held_(held_limits) {
  for (Role role : {Role::kScheduler, Role::kServer, Role::kWorker}) {
    passwords_[static_cast<int>(role)] =
        ExpectedPlainPassword(security_->keys, role);
  }
}

ZapHandler::~ZapHandler() { Stop(); }

void ZapHandler::Stop() {
  stop_.store(true);
  if (!thread_.joinable()) return;
  // Serve waits without a time-out (a wake-up every 50 ms in each of a
  // 289-process job's processes cost more CPU than its handshakes): a
  // request of one empty frame wakes it to see stop_. The handler's socket
  // is closed here, after the join, never by Serve: had Serve seen stop_ and
  // closed it first, the waker's connect would find the endpoint unbound and
  // wait as a pending inproc connection, which zmq_ctx_term then binds to
  // its own socket while the reaper ends the waker's pipes (a data race
  // inside libzmq 4.3.4, reported by TSan in CI at def5630).
  void* waker = zmq_socket(context_, ZMQ_REQ);
  if (waker != nullptr) {
    const int linger = 0;
    zmq_setsockopt(waker, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_connect(waker, kZapEndpoint) == 0)
      zmq_send(waker, "", 0, ZMQ_DONTWAIT);
  }
  thread_.join();
  if (waker != nullptr) zmq_close(waker);
  zmq_close(socket_);
}

ZapHandler::Verdict ZapHandler::Decide(const std::vector<std::string>& request,
                                       std::string* user_id,
                                       std::string* why) const {
  if (request.size() < 6 || request[0] != "1.0") {
    *why = "a malformed ZAP request";
    return Verdict::kRefuse;
  }
  const std::string& mechanism = request[5];
  const bool sealed_lane = request[2] == kSealedDomain;
  const bool plain = sealed_lane || !security_->encrypt;
  if (mechanism == "CURVE" && !plain) {
    if (request.size() != 7 || request[6].size() != 32) {
      *why = "a malformed CURVE credential";
      return Verdict::kRefuse;
    }
    const std::string key = Z85(request[6]);
    if (!security_->keys.RoleOfKey(key).has_value()) {
      *why = absl::StrCat("CURVE key ", KeyPrefix(key),
                          " is not one of this job's keys");
      return Verdict::kRefuse;
    }
    *user_id = key;
    return Verdict::kAdmit;
  }
  if (mechanism == "PLAIN" && plain) {
    return DecidePlain(request, sealed_lane, user_id, why);
  }
  *why = absl::StrCat("mechanism ", mechanism.substr(0, 16),
                      sealed_lane ? "; the sealed lane takes PLAIN only"
                      : security_->encrypt ? "; this node takes CURVE only"
                                           : "; this node takes PLAIN only "
                                             "(TESSERA_AUTH_ONLY=1)");
  return Verdict::kRefuse;
}

ZapHandler::Verdict ZapHandler::DecidePlain(
    const std::vector<std::string>& request, bool sealed_lane,
    std::string* user_id, std::string* why) const {
  if (request.size() != 8) {
    *why = "a malformed PLAIN credential";
    return Verdict::kRefuse;
  }
  if (sealed_lane) {
    // A password of the pair of processes, not of the roles (issue #46).
    if (admission_ == nullptr) {
      *why = "this node has no sealed lane";
      return Verdict::kRefuse;
    }
    // request[3]: the peer's address (RFC 27), which failed scheduler
    // claims are limited by.
    return admission_->Check(request[6], request[7], request[3], user_id, why);
  }
  for (Role role : {Role::kScheduler, Role::kServer, Role::kWorker}) {
    if (request[6] != RoleName(role)) continue;
    if (!SamePassword(passwords_[static_cast<int>(role)], request[7])) {
      *why = absl::StrCat("PLAIN user '", RoleName(role),
                          "' with a wrong password");
      return Verdict::kRefuse;
    }
    *user_id = security_->keys.public_key(role);
    return Verdict::kAdmit;
  }
  *why = absl::StrCat("PLAIN user '", request[6].substr(0, 32),
                      "' is no role of this job");
  return Verdict::kRefuse;
}

bool ZapHandler::ReceiveRequest(Request* request) {
  // Room for every frame up front: a vector that grew would leave short
  // strings' characters (a password) in freed memory.
  request->frames.reserve(10);
  bool more = true;
  int part_number = 0;
  while (more) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, socket_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&part);
      return false;
    }
    const char* data = static_cast<const char*>(zmq_msg_data(&part));
    const size_t size = zmq_msg_size(&part);
    // [routing id][empty delimiter][the request's frames]
    if (part_number == 0) {
      request->routing_id.assign(data, size);
    } else if (part_number > 1) {
      request->frames.emplace_back(data, size);
    }
    ++part_number;
    more = zmq_msg_more(&part);
    WipeBytes(zmq_msg_data(&part), size);  // a password
    zmq_msg_close(&part);
  }
  return part_number >= 2;
}

void ZapHandler::Answer(const Request& request, bool accept,
                        std::string user_id, const std::string& why) {
  // Each connection's number goes with its key, so that a receiver can tell
  // one connection's records from another's (the sealed lane's parking
  // quota): "KEY#N".
  if (accept) absl::StrAppend(&user_id, "#", ++connections_);
  if (!accept) {
    const uint64_t n = ++refused_;
    if (n <= kLogFirst || n % kLogEvery == 0) {
      const std::vector<std::string>& f = request.frames;
      TESSERA_LOG(WARNING) << "refused connection #" << n << " from "
                           << (f.size() > 3 ? f[3] : std::string("?")) << ": "
                           << why
                           << (n == kLogFirst
                                   ? " (from now on one line per 1000 refusals)"
                                   : "");
    }
  }
  const std::vector<std::string>& f = request.frames;
  const std::string reply[] = {request.routing_id,
                               "",
                               "1.0",
                               f.size() > 1 ? f[1] : std::string(),
                               accept ? "200" : "400",
                               accept ? "OK" : "not a key of this job",
                               user_id,
                               accept && f.size() > 2 && f[2] == kSealedDomain
                                   ? Property(kLaneProperty, kSealedDomain)
                                   : std::string()};
  constexpr size_t kParts = sizeof(reply) / sizeof(reply[0]);
  for (size_t i = 0; i < kParts; ++i) {
    zmq_send(socket_, reply[i].data(), reply[i].size(),
             i + 1 < kParts ? ZMQ_SNDMORE : 0);
  }
}

void ZapHandler::Hold(Request request) {
  // Decide waits only on a PLAIN hello whose user names a role and key.
  Role role;
  sealed::Key32 key;
  if (request.frames.size() > 6 &&
      sealed::ParseAdmissionUser(request.frames[6], &role, &key)) {
    request.key.assign(reinterpret_cast<const char*>(key.data()), key.size());
  }
  std::string why;
  if (std::optional<Request> refused = held_.Hold(std::move(request), &why))
    Answer(*refused, false, std::string(), why);
  waiting_.store(held_.size());
}

void ZapHandler::Revisit(absl::Time now) {
  if (admission_->version() != held_checked_at_) {
    // Only a key the table added can end a wait: the requests claiming one
    // are decided again, not all.
    std::vector<sealed::Key32> added;
    bool complete = false;
    held_checked_at_ =
        admission_->AddedSince(held_checked_at_, &added, &complete);
    std::vector<Request> recheck;
    if (!complete) recheck = held_.TakeAll();
    for (const sealed::Key32& key : added) {
      for (Request& r : held_.TakeKey(absl::string_view(
               reinterpret_cast<const char*>(key.data()), key.size())))
        recheck.push_back(std::move(r));
    }
    rechecked_.fetch_add(recheck.size());
    waiting_.store(held_.size());  // before any answer goes
    for (Request& r : recheck) {
      std::string user_id, why;
      const Verdict v = Decide(r.frames, &user_id, &why);
      if (v == Verdict::kWait) {
        Hold(std::move(r));  // its key added and gone again
      } else {
        Answer(r, v == Verdict::kAdmit, std::move(user_id), why);
      }
    }
  }
  for (Request& r : held_.TakeExpired(now)) {
    Answer(r, false, std::string(),
           absl::StrCat("PLAIN user '", r.frames[6].substr(0, 48),
                        "': no node of this node's table after waiting ",
                        absl::FormatDuration(hold_)));
  }
  waiting_.store(held_.size());
}

void ZapHandler::Serve() {
  while (!stop_.load()) {
    zmq_pollitem_t item = {socket_, 0, ZMQ_POLLIN, 0};
    // Without held requests, wait without a time-out (a wake-up every 50 ms
    // in each of a 289-process job's processes cost more CPU than its
    // handshakes; Stop wakes it); held ones are looked at every 10 ms.
    const int wait_ms = held_.size() == 0 ? -1 : 10;
    const bool ready =
        zmq_poll(&item, 1, wait_ms) > 0 && (item.revents & ZMQ_POLLIN) != 0;
    if (stop_.load()) break;  // Stop's wake-up, or a request at the end
    if (held_.size() != 0) Revisit(absl::Now());
    if (!ready) continue;
    Request request;
    if (!ReceiveRequest(&request)) continue;  // cut short: nothing to answer
    std::string user_id, why;
    const Verdict v = Decide(request.frames, &user_id, &why);
    if (v == Verdict::kWait) {
      request.until = absl::Now() + hold_;
      Hold(std::move(request));
      continue;
    }
    Answer(request, v == Verdict::kAdmit, std::move(user_id), why);
  }
  held_.TakeAll();  // wiped
  // The socket stays open (and its endpoint bound) until Stop has joined
  // this thread: see Stop.
}

}  // namespace tessera

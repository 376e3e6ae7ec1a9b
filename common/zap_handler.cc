#include "common/zap_handler.h"

#include <zmq.h>

#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
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
    void* context, std::shared_ptr<const ConnectionSecurity> security) {
  void* socket = zmq_socket(context, ZMQ_REP);
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
      new ZapHandler(context, socket, std::move(security)));
  handler->thread_ = std::thread([h = handler.get()] {
    trace::SetThreadName("zap-handler");
    h->Serve();
  });
  return handler;
}

ZapHandler::ZapHandler(void* context, void* socket,
                       std::shared_ptr<const ConnectionSecurity> security)
    : context_(context), socket_(socket), security_(std::move(security)) {
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
  // request of one empty frame wakes it to see stop_.
  void* waker = zmq_socket(context_, ZMQ_REQ);
  if (waker != nullptr) {
    const int linger = 0;
    zmq_setsockopt(waker, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_connect(waker, kZapEndpoint) == 0)
      zmq_send(waker, "", 0, ZMQ_DONTWAIT);
  }
  thread_.join();
  if (waker != nullptr) zmq_close(waker);
}

bool ZapHandler::Decide(const std::vector<std::string>& request,
                        std::string* user_id, std::string* why) const {
  if (request.size() < 6 || request[0] != "1.0") {
    *why = "a malformed ZAP request";
    return false;
  }
  const std::string& mechanism = request[5];
  const JobKeys& keys = security_->keys;
  const bool sealed_lane = request[2] == kSealedDomain;
  const bool plain = sealed_lane || !security_->encrypt;
  if (mechanism == "CURVE" && !plain) {
    if (request.size() != 7 || request[6].size() != 32) {
      *why = "a malformed CURVE credential";
      return false;
    }
    const std::string key = Z85(request[6]);
    if (!keys.RoleOfKey(key).has_value()) {
      *why = absl::StrCat("CURVE key ", KeyPrefix(key),
                          " is not one of this job's keys");
      return false;
    }
    *user_id = key;
    return true;
  }
  if (mechanism == "PLAIN" && plain) {
    if (request.size() != 8) {
      *why = "a malformed PLAIN credential";
      return false;
    }
    for (Role role : {Role::kScheduler, Role::kServer, Role::kWorker}) {
      if (request[6] != RoleName(role)) continue;
      if (!SamePassword(passwords_[static_cast<int>(role)], request[7])) {
        *why = absl::StrCat("PLAIN user '", RoleName(role),
                            "' with a wrong password");
        return false;
      }
      *user_id = keys.public_key(role);
      return true;
    }
    *why = absl::StrCat("PLAIN user '", request[6].substr(0, 32),
                        "' is no role of this job");
    return false;
  }
  *why = absl::StrCat("mechanism ", mechanism.substr(0, 16),
                      sealed_lane ? "; the sealed lane takes PLAIN only"
                      : security_->encrypt ? "; this node takes CURVE only"
                                           : "; this node takes PLAIN only "
                                             "(TESSERA_AUTH_ONLY=1)");
  return false;
}

void ZapHandler::Serve() {
  while (!stop_.load()) {
    zmq_pollitem_t item = {socket_, 0, ZMQ_POLLIN, 0};
    const int ready = zmq_poll(&item, 1, -1);
    if (stop_.load()) break;  // Stop's wake-up, or a request at the end
    if (ready <= 0 || (item.revents & ZMQ_POLLIN) == 0) continue;
    std::vector<std::string> request;
    // Room for every frame of a ZAP request (7) up front: a vector that grew
    // would leave short strings' characters (a password) in freed memory.
    request.reserve(8);
    // A PLAIN request carries the password presented (the right one, from
    // the job's own nodes): wiped on every way out, a request cut short too.
    absl::Cleanup wipe = [&request] {
      for (std::string& part : request) WipeString(&part);
    };
    bool more = true;
    while (more) {
      zmq_msg_t part;
      zmq_msg_init(&part);
      if (zmq_msg_recv(&part, socket_, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&part);
        break;
      }
      request.emplace_back(static_cast<const char*>(zmq_msg_data(&part)),
                           zmq_msg_size(&part));
      more = zmq_msg_more(&part);
      WipeBytes(zmq_msg_data(&part), zmq_msg_size(&part));  // a password
      zmq_msg_close(&part);
    }
    if (more) continue;  // a request cut short: nothing to answer
    std::string user_id, why;
    const bool accept = Decide(request, &user_id, &why);
    // Each connection's number goes with its key, so that a receiver can
    // tell one connection's records from another's (the sealed lane's
    // parking quota): "KEY#N".
    if (accept) absl::StrAppend(&user_id, "#", ++connections_);
    if (!accept) {
      const uint64_t n = ++refused_;
      if (n <= kLogFirst || n % kLogEvery == 0) {
        TESSERA_LOG(WARNING)
            << "refused connection #" << n << " from "
            << (request.size() > 3 ? request[3] : std::string("?")) << ": "
            << why
            << (n == kLogFirst ? " (from now on one line per 1000 refusals)"
                               : "");
      }
    }
    const std::string reply[] = {
        "1.0",
        request.size() > 1 ? request[1] : std::string(),
        accept ? "200" : "400",
        accept ? "OK" : "not a key of this job",
        user_id,
        accept && request.size() > 2 && request[2] == kSealedDomain
            ? Property(kLaneProperty, kSealedDomain)
            : std::string()};
    for (size_t i = 0; i < 6; ++i) {
      zmq_send(socket_, reply[i].data(), reply[i].size(),
               i + 1 < 6 ? ZMQ_SNDMORE : 0);
    }
  }
  zmq_close(socket_);
}

}  // namespace tessera

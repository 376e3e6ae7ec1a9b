// ZmqTransport's sealed lane (zmq_transport_internal.h): the node keys and
// per-link secrets, the lane a worker or server binds, the sealers of its
// links, and the pump that seals what ZeroMQ has room for (the rest waits for
// the SealPool).
#include <zmq.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/net_util.h"
#include "common/zmq_transport_internal.h"

namespace tessera::zmq_internal {

sealed::NodeKey ZmqTransport::OwnNodeKey() const {
  const SecretString& given = options_.node_secret;
  if (given.size() != 32) return sealed::NodeKey::Generate();
  sealed::Key32 secret;
  std::memcpy(secret.data(), given.data(), secret.size());
  sealed::NodeKey key = sealed::NodeKey::FromSecret(secret);
  WipeBytes(secret.data(), secret.size());
  return key;
}

void ZmqTransport::SetUpSealing() {
  const JobKeys& keys = options_.security->keys;
  std::optional<sealed::Key32> secret = sealed::KeyFromZ85(keys.secret_key);
  std::array<sealed::Key32, 3> publics;
  for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker}) {
    std::optional<sealed::Key32> p = sealed::KeyFromZ85(keys.public_key(r));
    if (p.has_value()) publics[static_cast<int>(r)] = *p;
  }
  // Key files are checked when read (ParseKeyFile, keys that decode and
  // agree), so this cannot fail for keys that got this far.
  std::optional<sealed::LinkKeys> link_keys =
      secret.has_value()
          ? sealed::LinkKeys::Make(OwnNodeKey(), keys.role, *secret, publics,
                                   options_.security->job_id)
          : std::nullopt;
  if (!link_keys.has_value()) {
    TESSERA_LOG(ERROR) << "the job's keys do not agree (X25519)";
    std::abort();
  }
  if (secret.has_value()) WipeBytes(secret->data(), secret->size());
  link_keys_ = std::make_shared<const sealed::LinkKeys>(*std::move(link_keys));
  sealed::SealedReceiver::Options o;
  o.keys = link_keys_;
  o.accept_first_scheduler = keys.role != Role::kScheduler;
  o.limits = options_.limits;
  o.max_frame_bytes = options_.max_message_bytes;
  o.on_drop = [](uint64_t n, const std::string& why) {
    if (ShouldLog(n)) {
      TESSERA_LOG(WARNING) << "dropped sealed record #" << n << ": " << why
                           << (n == kLogDropsFirst
                                   ? " (from now on one line per 1000)"
                                   : "");
    }
  };
  opener_ = std::make_unique<sealed::SealedReceiver>(std::move(o));
  admission_ = std::make_shared<sealed::Admission>(link_keys_,
                                                   options_.scheduler_address);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  pool_ = std::make_unique<SealPool>(std::clamp(cores, 1, 4));
  blocks_ =
      std::make_shared<BlockCache>(kRecordBlockHead + sealed::kRecordOverhead +
                                   options_.sealed_record_bytes);
}

absl::Status ZmqTransport::BindSealedLane(const std::string& ip) {
  // The sealed lane is a second endpoint of the receiving socket, not a
  // socket of its own: ZeroMQ gives each bind the options set before it, so
  // this one authenticates with PLAIN in the sealed domain and takes records
  // only as big as a record, and one blocking receive waits on both lanes (a
  // second socket cost a zmq_poll and two empty receives per wait, the most
  // of what a sealed job's 289 processes spent over an insecure one's). The
  // ZAP handler marks the lane's connections (kLaneProperty), so that what
  // they carry is told apart from the main lane's.
  const int on = 1;
  zmq_setsockopt(receiver_, ZMQ_PLAIN_SERVER, &on, sizeof(on));
  zmq_setsockopt(receiver_, ZMQ_ZAP_DOMAIN, ZapHandler::kSealedDomain,
                 std::strlen(ZapHandler::kSealedDomain));
  // A record holds at most a record's plaintext, or a header alone.
  const int64_t max_record = static_cast<int64_t>(
      sealed::kRecordOverhead + 16 + 8 +
      std::max(options_.sealed_record_bytes, options_.limits.max_header_bytes));
  zmq_setsockopt(receiver_, ZMQ_MAXMSGSIZE, &max_record, sizeof(max_record));
  // The credit bounds the records queued per peer too (a receiver that
  // falls behind holds no more than that of them), never below 4 records
  // and never above the queue without a credit: a credit only shrinks it.
  // Set only here, before the lane has a connection: ZeroMQ applies a new
  // RCVHWM to the pipes already attached, of both lanes.
  const int queue =
      options_.credit_bytes <= 0
          ? kReceiveHighWaterMark
          : static_cast<int>(std::clamp<int64_t>(
                options_.credit_bytes /
                    static_cast<int64_t>(options_.sealed_record_bytes),
                4, kReceiveHighWaterMark));
  zmq_setsockopt(receiver_, ZMQ_RCVHWM, &queue, sizeof(queue));
  const std::string endpoint = TcpEndpoint(ip, options_.sealed_port);
  const bool bound = zmq_bind(receiver_, endpoint.c_str()) == 0;
  const std::string err = bound ? std::string() : ZmqError();
  if (bound) sealed_port_.store(BoundPort(receiver_, options_.sealed_port));
  // Later binds of the main lane take its own options again.
  SecureReceiver(receiver_);
  LimitMainLane(receiver_);
  zmq_setsockopt(receiver_, ZMQ_RCVHWM, &kReceiveHighWaterMark,
                 sizeof(kReceiveHighWaterMark));
  if (!bound) {
    return absl::UnavailableError(absl::StrCat(
        "cannot bind the sealed lane at ", endpoint, ": ", err,
        options_.sealed_port != 0 ? " (TESSERA_SEALED_PORT)" : ""));
  }
  sealed_lane_bound_ = true;
  TESSERA_VLOG(1) << "sealed lane on port " << sealed_port_.load();
  return absl::OkStatus();
}

void ZmqTransport::SealedLaneCredentials(void* socket, const PeerLink& link) {
  // This pair's credentials (sealed_admission.h).
  const std::string user = sealed::Admission::User(*link_keys_);
  const SecretString password = sealed::Admission::Password(
      *link_keys_, link.secrets, link.role, link.key);
  zmq_setsockopt(socket, ZMQ_PLAIN_USERNAME, user.data(), user.size());
  zmq_setsockopt(socket, ZMQ_PLAIN_PASSWORD, password.data(), password.size());
}

std::optional<ZmqTransport::PeerLink> ZmqTransport::LinkTo(int peer) {
  std::optional<PeerLink> link;
  {
    absl::MutexLock lock(&senders_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return std::nullopt;
    link = it->second;
  }
  // The key agreements, the first time a link to this key is made.
  if (!link_keys_->ForPeer(link->key, &link->secrets)) {
    TESSERA_LOG(WARNING) << "node " << peer
                         << " has a node key of small order in the node "
                            "table; nothing is sealed to it";
    return std::nullopt;
  }
  return link;
}

std::optional<uint32_t> ZmqTransport::TakeLinkNumber() {
  if (next_link_ == 0) return std::nullopt;
  // The last (2^32 - 1) leaves 0: none is left.
  const uint32_t number = next_link_++;
  if (next_link_ == 0) {
    TESSERA_LOG(ERROR) << "this process has taken its last sealed link "
                          "number; it makes no link any more (restart it)";
  }
  return number;
}

absl::Status ZmqTransport::NoLinkNumberLeft(int peer) {
  return absl::FailedPreconditionError(absl::StrCat(
      "no link to node ", peer,
      ": this process has used all 2^32 - 1 sealed link numbers of its node "
      "key (a new link would repeat a link key); restart it for a new key"));
}

std::unique_ptr<sealed::Sealer> ZmqTransport::NewSealer(const PeerLink& link,
                                                        uint32_t number) {
  return std::make_unique<sealed::Sealer>(
      own_role(), link_keys_->public_key(), number,
      link_keys_->SendingSecret(link.secrets, link.role, link.key, number),
      options_.sealed_record_bytes);
}

void ZmqTransport::SetPeerIdentity(int peer, const PeerIdentity& identity) {
  if (!Sealed()) return;
  // A refused entry also ends what the node had (an earlier identity):
  // nothing is taken from it nor sealed to it any more.
  auto refuse = [&](const std::string& why) {
    TESSERA_LOG(WARNING) << why << "; its messages will not be taken";
    opener_->RemovePeer(peer);
    admission_->RemovePeer(peer);
    ForgetLink(peer);
  };
  if (identity.node_key.size() != 32) {
    refuse(absl::StrCat("node ", peer,
                        " has no node key of 32 bytes in the node table"));
    return;
  }
  sealed::Key32 key;
  std::memcpy(key.data(), identity.node_key.data(), key.size());
  // No key agreement yet: LinkTo and the opener make it when a link needs it
  // (a worker links to none of the table's other workers). A key of small
  // order is refused then; the scheduler refuses one at registration.
  if (key == link_keys_->public_key()) {
    refuse(absl::StrCat("node ", peer,
                        " has this node's own node key in the node table"));
    return;
  }
  if (absl::Status set = opener_->SetPeer(peer, identity.role, key);
      !set.ok()) {
    refuse(std::string(set.message()));
    return;
  }
  admission_->SetPeer(peer, identity.role, key);
  std::shared_ptr<Sender> scheduler_link;
  std::optional<sealed::Key32> replaced;  // the key it had, if another
  {
    absl::MutexLock lock(&senders_mu_);
    if (auto it = links_.find(peer);
        it != links_.end() && it->second.key != key)
      replaced = it->second.key;
    links_[peer] = PeerLink{identity.role, key, {}, identity.sealed_port};
    if (peer == kSchedulerId) {
      auto it = senders_.find(kSchedulerId);
      if (it != senders_.end()) scheduler_link = it->second;
    }
  }
  if (replaced.has_value()) link_keys_->Forget(*replaced);
  if (scheduler_link == nullptr) return;
  // From now on what goes to the scheduler is sealed.
  std::optional<PeerLink> link = LinkTo(kSchedulerId);
  if (!link.has_value()) return;
  absl::MutexLock lock(&senders_mu_);
  auto it = senders_.find(kSchedulerId);
  if (it == senders_.end() || it->second != scheduler_link) return;
  absl::MutexLock hold(&scheduler_link->mu);
  if (scheduler_link->sealer != nullptr) return;
  std::optional<uint32_t> number = TakeLinkNumber();
  if (!number.has_value()) {
    // Left unsealed: the scheduler drops what it sends (UnsealedAllowed).
    TESSERA_LOG(ERROR) << NoLinkNumberLeft(kSchedulerId).message();
    return;
  }
  scheduler_link->sealer = NewSealer(*link, *number);
  scheduler_link->key = link->key;
}

void ZmqTransport::ForgetLink(int peer) {
  std::optional<sealed::Key32> gone;
  {
    absl::MutexLock lock(&senders_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return;
    gone = it->second.key;
    links_.erase(it);
  }
  // LinkKeys keeps every key's agreements: a key gone from the table (its
  // process left, or restarted with a new key) would stay there for ever.
  link_keys_->Forget(*gone);
}

std::string ZmqTransport::node_key() const {
  if (!Sealed()) return std::string();
  const sealed::Key32& k = link_keys_->public_key();
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

SealedDrops ZmqTransport::sealed_drops() const {
  SealedDrops d;
  if (opener_ != nullptr) {
    const sealed::DropCounts c = opener_->counts();
    d.malformed = c.malformed;
    d.unauthentic = c.unauthentic;
    d.replayed = c.replayed;
    d.out_of_order = c.out_of_order;
    d.unknown_key = c.unknown_key;
    d.incomplete = c.incomplete;
    d.wrong_sender = c.wrong_sender;
    d.throttled = c.throttled;
  }
  d.unsealed = unsealed_.load();
  return d;
}

absl::Status ZmqTransport::SendSealed(Sender& sender, const Message& msg,
                                      size_t header_size,
                                      std::vector<sealed::SealJob>* sent_jobs) {
  if (sender.refused) {
    // Bounded while no connection takes them (a redial failing for long).
    uint64_t bytes = header_size;
    for (const Buffer& f : msg.data) bytes += f.size();
    for (const sealed::SealJob& queued : sender.pending) {
      bytes += queued.header.size();
      for (const Buffer& f : queued.frames) bytes += f.size();
    }
    // One message waits whatever its size: a bigger one is not lost for it.
    if (sender.pending.size() >= kMaxWaitingWhileRefused ||
        (!sender.pending.empty() && bytes > kMaxBytesWaitingWhileRefused)) {
      return absl::UnavailableError(absl::StrCat(
          "cannot send to node ", sender.peer, " at ", sender.endpoint,
          ": its connection was refused and ", sender.pending.size(),
          " messages already wait for a new one (at most ",
          kMaxWaitingWhileRefused, " messages and ",
          kMaxBytesWaitingWhileRefused >> 20, " MiB; this one would make ",
          bytes, " bytes)"));
    }
  }
  sealed::SealJob job;
  job.header.resize(header_size);
  if (!SerializeHeader(msg, job.header.data(), header_size))
    return absl::InternalError("cannot serialize message header");
  job.frames = msg.data;
  job.order = OrderTagOf(msg.header);
  const size_t at = OrderedPosition(
      sender.pending.begin(), sender.pending.end(), job.order,
      [](const sealed::SealJob& queued) {
        return queued.started ? std::nullopt
                              : std::optional<OrderTag>(queued.order);
      });
  sender.pending.insert(sender.pending.begin() + at, std::move(job));
  if (sender.backlog->waiting.load()) return absl::OkStatus();
  return Pump(sender, sent_jobs);
}

absl::Status ZmqTransport::Pump(Sender& sender,
                                std::vector<sealed::SealJob>* finished) {
  // A refused connection's messages wait for the new one (Redial).
  ReadHandshakes(sender);
  if (sender.refused) {
    // A message part-sealed on it goes again, whole.
    if (!sender.pending.empty()) {
      sender.pending.front().Restart();
    }
    return absl::OkStatus();
  }
  ZmqRecordSink sink(sender.socket, sender.backlog, sender.blocks);
  Backlog& backlog = *sender.backlog;
  while (!sender.pending.empty()) {
    sealed::SealJob& job = sender.pending.front();
    while (!job.done()) {
      if (backlog.bytes.load() >= kBacklogLimit) {
        backlog.waiting.store(true);
        // A record may have gone out between the two looks.
        if (backlog.bytes.load() >= kBacklogLimit) return absl::OkStatus();
        backlog.waiting.store(false);
      }
      if (absl::Status s = sender.sealer->SealNext(job, sink); !s.ok()) {
        if (sink.refused()) {
          // It goes again, whole, on the new connection.
          job.Restart();
          sender.refused = true;
          return absl::OkStatus();
        }
        finished->push_back(std::move(job));
        sender.pending.pop_front();
        return absl::UnavailableError(
            absl::StrCat("cannot send to node ", sender.peer, " at ",
                         sender.endpoint, ": ", s.message()));
      }
    }
    finished->push_back(std::move(job));
    sender.pending.pop_front();
    // Known to have gone out: what ZeroMQ took before the last send.
    while (!sender.unconfirmed.empty() &&
           sender.unconfirmed.front() <= backlog.confirmed) {
      sender.unconfirmed.pop_front();
    }
    sender.unconfirmed.push_back(backlog.allocated);
  }
  return absl::OkStatus();
}

void ZmqTransport::ArmBacklog(const std::shared_ptr<Sender>& sender,
                              Backlog& backlog) {
  std::weak_ptr<Sender> weak = sender;
  backlog.resume = [this, weak] { PumpLater(weak); };
}

void ZmqTransport::PumpLater(const std::weak_ptr<Sender>& weak) {
  // The pool runs nothing after the transport's Close (it stops first).
  pool_->Schedule([this, weak] {
    std::shared_ptr<Sender> s = weak.lock();
    if (s == nullptr) return;
    bool refused = false;
    {
      std::vector<sealed::SealJob> finished;  // released after the lock
      absl::MutexLock lock(&s->mu);
      if (absl::Status pumped = Pump(*s, &finished); !pumped.ok()) {
        TESSERA_LOG(WARNING) << pumped.message();
      }
      refused = s->refused;
    }
    if (refused) Redial(s);
  });
}

}  // namespace tessera::zmq_internal

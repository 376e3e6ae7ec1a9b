// ZeroMQ transport: one bound PULL socket receives, one PUSH socket per peer
// sends. Secured (options.security): the PULL socket is a CURVE server (PLAIN
// with TESSERA_AUTH_ONLY) whose ZAP handler admits only the job's role keys,
// and every received message's claimed sender is checked against its
// connection's key. By default (encrypt) links to and from the scheduler are
// CURVE, and a worker or server binds a second PULL socket, its sealed lane
// (PLAIN-authenticated with the role passwords), where its peers' messages
// arrive as records sealed with AES-256-GCM under per-link keys
// (sealed_link.h); nodes seal what they send the scheduler too, inside CURVE,
// so that every message after the node table is bound to the node key of the
// process that sent it.
#include <malloc.h>
#include <pthread.h>
#include <zmq.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/message_counters.h"
#include "common/net_util.h"
#include "common/sealed_link.h"
#include "common/sender_check.h"
#include "common/status_macros.h"
#include "common/transport.h"
#include "common/zap_handler.h"

namespace tessera {
namespace {

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

// Messages a receiving socket queues per peer before it stops reading that
// peer's connection. Bounds inbound memory at this many of the largest frame a
// peer sends (TESSERA_MAX_MESSAGE_BYTES at most) per connection.
constexpr int kReceiveHighWaterMark = 64;

// Data frames below this size are copied into ZeroMQ's message rather than
// lent to it.
constexpr size_t kCopyBelowBytes = 16 << 10;

// Drops of the sealed layer and of unsealed messages are logged one by one up
// to this many, then one line per kLogDropsEvery.
constexpr uint64_t kLogDropsFirst = 20;
constexpr uint64_t kLogDropsEvery = 1000;

bool ShouldLog(uint64_t n) {
  return n <= kLogDropsFirst || n % kLogDropsEvery == 0;
}

// A record of the sealed layer: one ZeroMQ frame starting with its magic. No
// header frame starts so: a protobuf field tag of 'T' (field 10, wire type 4)
// is never valid at a message's start.
bool IsSealedRecord(const zmq_msg_t* msg) {
  return zmq_msg_size(const_cast<zmq_msg_t*>(msg)) >= sealed::kRecordOverhead &&
         std::memcmp(zmq_msg_data(const_cast<zmq_msg_t*>(msg)), "TSL1", 4) == 0;
}

// What ZeroMQ holds of one sealed link's records. Each record's free callback
// (run by ZeroMQ once the record is written out, on its I/O thread) takes its
// bytes off, so that sealing runs at most kBacklogLimit ahead of the socket:
// what waits beyond that waits as references to the caller's frames, as an
// unsealed message would in ZeroMQ's queue, not as sealed copies (a server
// answering 16 workers' pulls of a 32 MB key would otherwise queue 512 MB of
// ciphertext).
constexpr int64_t kBacklogLimit = 1 << 20;
// Sealing resumes once the backlog is down to this.
constexpr int64_t kBacklogResume = 512 << 10;

class SealPool;

struct Backlog {
  std::atomic<int64_t> bytes{0};
  // Work of the link waits for room: the free callback that makes room
  // hands the link to the pool.
  std::atomic<bool> waiting{false};
  std::function<void()> resume;  // set once, before any record is sent
};

// Threads that go on sealing links whose work waited for room, so that a
// caller's Send returns once its message is queued, and several links are
// sealed at once on several cores.
class SealPool {
 public:
  explicit SealPool(int threads) : threads_(threads) {}
  ~SealPool() { Stop(); }

  void Schedule(std::function<void()> work) {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    queue_.push_back(std::move(work));
    if (workers_.size() < static_cast<size_t>(threads_) && idle_ == 0) {
      workers_.emplace_back([this] { Run(); });
    }
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      queue_.clear();
    }
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

 private:
  void Run() {
    // A thread started from ZeroMQ's I/O thread would keep its name.
    pthread_setname_np(pthread_self(), "tessera-seal");
    while (true) {
      std::function<void()> work;
      {
        absl::MutexLock lock(&mu_);
        ++idle_;
        mu_.Await(absl::Condition(
            +[](SealPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
              return p->stopped_ || !p->queue_.empty();
            },
            this));
        --idle_;
        if (stopped_) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }

  const int threads_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;  // added under mu_, joined in Stop
};

// Memory for full-size records, reused: records are sealed on many threads
// (callers, the pool) and freed on ZeroMQ's, and with glibc each thread
// allocating large blocks grows an arena of its own, so fresh blocks per
// record cost a server with 16 links about 60 MB more at its peak.
class BlockCache {
 public:
  explicit BlockCache(size_t block_bytes) : block_bytes_(block_bytes) {}
  ~BlockCache() {
    for (void* b : free_) std::free(b);
  }
  size_t block_bytes() const { return block_bytes_; }
  void* Take() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        void* b = free_.back();
        free_.pop_back();
        return b;
      }
    }
    return std::malloc(block_bytes_);
  }
  void Give(void* block) {
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kKeep) {
        free_.push_back(block);
        return;
      }
    }
    std::free(block);
  }

 private:
  static constexpr size_t kKeep = 64;
  const size_t block_bytes_;
  absl::Mutex mu_;
  std::vector<void*> free_ ABSL_GUARDED_BY(mu_);
};

// A record's memory: the link's backlog it counts in, then the record.
struct RecordBlock {
  std::shared_ptr<Backlog> backlog;
  std::shared_ptr<BlockCache> cache;  // set when the block came from it
  size_t size;
};
constexpr size_t kRecordBlockHead = 64;  // keeps the record 64-byte aligned
static_assert(sizeof(RecordBlock) <= kRecordBlockHead);

void FreeRecord(void* /*data*/, void* hint) {
  auto* block = static_cast<RecordBlock*>(hint);
  std::shared_ptr<Backlog> backlog = std::move(block->backlog);
  std::shared_ptr<BlockCache> cache = std::move(block->cache);
  const int64_t size = static_cast<int64_t>(block->size);
  block->~RecordBlock();
  if (cache != nullptr) {
    cache->Give(hint);
  } else {
    std::free(hint);
  }
  const int64_t left = backlog->bytes.fetch_sub(size) - size;
  if (left <= kBacklogResume && backlog->waiting.exchange(false))
    backlog->resume();
}

// Sends a link's sealed records, each one ZeroMQ message of one frame, so
// that ZeroMQ's I/O thread writes a record out while the next is sealed.
class ZmqRecordSink : public sealed::RecordSink {
 public:
  ZmqRecordSink(void* socket, std::shared_ptr<Backlog> backlog,
                std::shared_ptr<BlockCache> cache)
      : socket_(socket),
        backlog_(std::move(backlog)),
        cache_(std::move(cache)) {}
  ~ZmqRecordSink() override {
    if (block_ != nullptr) FreeRecord(nullptr, block_);
  }
  uint8_t* Allocate(size_t size) override {
    const bool cached =
        cache_ != nullptr && kRecordBlockHead + size == cache_->block_bytes();
    block_ = cached ? cache_->Take() : std::malloc(kRecordBlockHead + size);
    new (block_) RecordBlock{backlog_, cached ? cache_ : nullptr, size};
    backlog_->bytes.fetch_add(static_cast<int64_t>(size));
    size_ = size;
    return static_cast<uint8_t*>(block_) + kRecordBlockHead;
  }
  absl::Status Emit() override {
    zmq_msg_t msg;
    zmq_msg_init_data(&msg, static_cast<uint8_t*>(block_) + kRecordBlockHead,
                      size_, FreeRecord, block_);
    block_ = nullptr;  // the message owns it now
    if (zmq_msg_send(&msg, socket_, 0) < 0) {
      const std::string err = zmq_strerror(zmq_errno());
      zmq_msg_close(&msg);  // frees the record, takes its bytes off
      return absl::UnavailableError(err);
    }
    return absl::OkStatus();
  }

 private:
  void* socket_;
  std::shared_ptr<Backlog> backlog_;
  std::shared_ptr<BlockCache> cache_;
  void* block_ = nullptr;
  size_t size_ = 0;
};

// What CURVE adds to each frame on the wire (the MESSAGE command's name and
// nonce, the box's MAC, a flags byte): ZMQ_MAXMSGSIZE counts these bytes too.
constexpr int64_t kCurveFrameOverhead = 33;

// Keeps a received zmq_msg_t alive for as long as Buffers reference its bytes.
struct ReceivedPart {
  zmq_msg_t msg;
  ~ReceivedPart() { zmq_msg_close(&msg); }
};

// ZeroMQ mallocs one block per received data frame. With glibc's defaults a
// block above the (adaptive) mmap threshold is mapped and unmapped per message,
// and freeing several large blocks at once trims the heap top back to the
// kernel, so a process holding a few frames at a time (a server's weights, a
// worker's in-flight pulls) pays page faults and page zeroing on every message:
// 1 MB pushes with 4 in flight ran at 0.4x raw ZeroMQ. Keep frames up to 32 MB
// (glibc's largest mmap threshold) in the heap and the heap grown. Skipped when
// the user tunes malloc through the environment.
void KeepLargeFramesInHeap() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("GLIBC_TUNABLES") != nullptr ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
      return;
    }
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  });
}

void ReleaseBuffer(void* /*data*/, void* hint) {
  delete static_cast<std::shared_ptr<const void>*>(hint);
}

class ZmqTransport : public Transport {
 public:
  explicit ZmqTransport(const ZmqTransportOptions& options)
      : options_(options) {
    if (options.metrics != nullptr)
      counters_ = std::make_unique<MessageCounters>(options.metrics);
    context_ = zmq_ctx_new();
    zmq_ctx_set(context_, ZMQ_IO_THREADS, options.io_threads);
    zmq_ctx_set(context_, ZMQ_IPV6, 1);
    // A watched link is three sockets (the sender, its monitor's end and
    // ours): past ZeroMQ's default of 1,023 sockets at about 340 nodes.
    if (options.watch_links) zmq_ctx_set(context_, ZMQ_MAX_SOCKETS, 1 << 16);
    if (Sealed()) SetUpSealing();
  }

  ~ZmqTransport() override {
    Close();
    // zmq_ctx_term waits in poll() for the context's threads, and a signal
    // (a handler's, or a stop and continue: SIGSTOP/SIGCONT make poll fail
    // with EINTR even without one) interrupts it with EINTR; it is to be
    // called again (zmq_ctx_term(3)). Returning then left the reaper and I/O
    // threads unjoined and the context undeleted (ThreadSanitizer reported
    // the reaper as a leaked thread of an exiting tessera-server).
    while (zmq_ctx_term(context_) != 0 && zmq_errno() == EINTR) {
    }
  }

  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    absl::MutexLock lock(&recv_mu_);
    if (receiver_ == nullptr) {
      // The handler is up before the socket exists: a CURVE server without
      // one would take any client key.
      if (options_.security != nullptr && zap_ == nullptr) {
        TESSERA_ASSIGN_OR_RETURN(
            zap_, ZapHandler::Start(context_, options_.security));
        zap_counts_.store(zap_.get());
      }
      receiver_ = zmq_socket(context_, ZMQ_PULL);
      ConfigureSocket(receiver_);
      SecureReceiver(receiver_);
      // Back-pressure: past this many messages queued from one peer, ZeroMQ
      // stops reading its connection and TCP's window closes on the sender.
      zmq_setsockopt(receiver_, ZMQ_RCVHWM, &kReceiveHighWaterMark,
                     sizeof(kReceiveHighWaterMark));
      if (options_.max_message_bytes > 0) {
        const int64_t max_bytes = options_.max_message_bytes +
                                  (Encrypted() ? kCurveFrameOverhead : 0);
        zmq_setsockopt(receiver_, ZMQ_MAXMSGSIZE, &max_bytes,
                       sizeof(max_bytes));
      }
    }
    const std::string endpoint = TcpEndpoint(ip, port);
    if (zmq_bind(receiver_, endpoint.c_str()) != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot bind ", endpoint, ": ", ZmqError()));
    }
    const int bound_port = BoundPort(receiver_, port);
    if (Sealed() && own_role() != Role::kScheduler &&
        sealed_receiver_ == nullptr) {
      TESSERA_RETURN_IF_ERROR(BindSealedLane(ip));
    }
    return bound_port;
  }

  absl::Status Connect(int peer, const std::string& ip, int port) override {
    auto sender = std::make_shared<Sender>();
    sender->peer = peer;
    sender->blocks = blocks_;
    if (pool_ != nullptr) ArmBacklog(sender);
    sender->socket = zmq_socket(context_, ZMQ_PUSH);
    ConfigureSocket(sender->socket);
    std::string endpoint;
    if (Sealed() && peer != kSchedulerId) {
      // A worker or server: its sealed lane.
      std::optional<PeerLink> link = LinkTo(peer);
      if (!link.has_value()) {
        zmq_close(sender->socket);
        sender->socket = nullptr;
        return absl::FailedPreconditionError(absl::StrCat(
            "no node key for node ", peer, ": its node table entry has none"));
      }
      endpoint = TcpEndpoint(ip, link->sealed_port);
      const std::string user = RoleName(own_role());
      const std::string& password =
          plain_passwords_[static_cast<int>(link->role)];
      zmq_setsockopt(sender->socket, ZMQ_PLAIN_USERNAME, user.data(),
                     user.size());
      zmq_setsockopt(sender->socket, ZMQ_PLAIN_PASSWORD, password.data(),
                     password.size());
      absl::MutexLock lock(&sender->mu);
      sender->sealer = NewSealer(*link);
    } else {
      endpoint = TcpEndpoint(ip, port);
      if (absl::Status secured = SecureSender(sender->socket, peer);
          !secured.ok()) {
        sender->socket = nullptr;
        return secured;
      }
      if (Sealed() && peer == kSchedulerId) {
        // Sealed once the node table brings the scheduler's node key.
        if (std::optional<PeerLink> link = LinkTo(peer); link.has_value()) {
          absl::MutexLock lock(&sender->mu);
          sender->sealer = NewSealer(*link);
        }
      }
    }
    const int hwm = 100000;
    zmq_setsockopt(sender->socket, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    const int timeout_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options_.send_timeout));
    zmq_setsockopt(sender->socket, ZMQ_SNDTIMEO, &timeout_ms,
                   sizeof(timeout_ms));
    if (zmq_connect(sender->socket, endpoint.c_str()) != 0) {
      const std::string err = ZmqError();
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", endpoint, ": ", err));
    }
    // After the connect: a failed one leaves the link it would have
    // replaced watched. (Connecting is asynchronous: nothing is missed.)
    if (options_.watch_links) WatchLink(peer, *sender, endpoint);
    sender->endpoint = endpoint;
    TESSERA_VLOG(1) << "connecting to node " << peer << " at " << endpoint;
    std::shared_ptr<Sender> old;
    {
      absl::MutexLock lock(&senders_mu_);
      old = std::exchange(senders_[peer], sender);
    }
    return absl::OkStatus();
  }

  void Disconnect(int peer) override {
    Unwatch(peer);
    absl::MutexLock lock(&senders_mu_);
    senders_.erase(peer);
  }

  void ForgetPeer(int peer) override {
    Unwatch(peer);
    if (opener_ != nullptr) opener_->RemovePeer(peer);
    absl::MutexLock lock(&senders_mu_);
    senders_.erase(peer);
    links_.erase(peer);
  }

  absl::Status Send(int peer, const Message& msg) override {
    std::shared_ptr<Sender> sender;
    {
      absl::MutexLock lock(&senders_mu_);
      auto it = senders_.find(peer);
      if (it == senders_.end()) {
        return absl::UnavailableError(
            absl::StrCat("no connection to node ", peer));
      }
      sender = it->second;
    }
    absl::StatusOr<size_t> header_size = CheckForEncoding(msg);
    if (!header_size.ok()) return header_size.status();
    if (LogVerbosity() >= 2) TESSERA_LOG(INFO) << "send " << DebugString(msg);
    {
      // Sealed messages that went out are released after the lock: their
      // frames' owners may take their own locks (a worker's request tracker
      // unpins an operation), and must never run under a link's.
      std::vector<sealed::SealJob> sent_jobs;
      absl::MutexLock lock(&sender->mu);
      absl::Status sent =
          sender->sealer != nullptr
              ? SendSealed(*sender, msg, *header_size, &sent_jobs)
              : SendFrames(*sender, peer, msg, *header_size);
      if (!sent.ok()) return sent;
    }
    if (counters_ != nullptr) {
      uint64_t bytes = *header_size;
      for (const Buffer& part : msg.data) bytes += part.size();
      counters_->Sent(msg.header.command(), bytes);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
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
      if (sealed_receiver_ == nullptr) {
        // A blocking receive with a time-out, rather than zmq_poll and then
        // a receive, saves a system call and a pass over the socket's
        // commands per message.
        if (wait_ms != receive_timeout_ms_) {
          zmq_setsockopt(receiver_, ZMQ_RCVTIMEO, &wait_ms, sizeof(wait_ms));
          receive_timeout_ms_ = wait_ms;
        }
        ReceiveFrom(receiver_, 0);
        continue;
      }
      // Two sockets: take what either has without waiting, and poll both
      // only when neither has anything.
      if (ReceiveFrom(sealed_receiver_, ZMQ_DONTWAIT) ||
          ReceiveFrom(receiver_, ZMQ_DONTWAIT)) {
        continue;
      }
      zmq_pollitem_t items[2] = {{sealed_receiver_, 0, ZMQ_POLLIN, 0},
                                 {receiver_, 0, ZMQ_POLLIN, 0}};
      (void)zmq_poll(items, 2, wait_ms);
    }
  }

  uint64_t malformed_count() const override { return malformed_.load(); }
  uint64_t wrong_sender_count() const override {
    return wrong_sender_.load() +
           (opener_ != nullptr ? opener_->counts().wrong_sender : 0);
  }
  uint64_t refused_connection_count() const override {
    const ZapHandler* zap = zap_counts_.load();
    return zap == nullptr ? 0 : zap->refused_count();
  }

  std::string node_key() const override {
    if (!Sealed()) return std::string();
    const sealed::Key32& k = link_keys_->public_key();
    return std::string(reinterpret_cast<const char*>(k.data()), k.size());
  }
  int sealed_port() const override { return sealed_port_.load(); }
  bool nodes_have_own_keys() const override {
    return options_.security != nullptr &&
           !options_.security->keys.node_keys.empty();
  }

  void SetPeerIdentity(int peer, const PeerIdentity& identity) override {
    if (!Sealed()) return;
    // A refused entry also ends what the node had (an earlier identity):
    // nothing is taken from it nor sealed to it any more.
    auto refuse = [&](const std::string& why) {
      TESSERA_LOG(WARNING) << why << "; its messages will not be taken";
      opener_->RemovePeer(peer);
      absl::MutexLock lock(&senders_mu_);
      links_.erase(peer);
    };
    if (identity.node_key.size() != 32) {
      refuse(absl::StrCat("node ", peer,
                          " has no node key of 32 bytes in the node table"));
      return;
    }
    sealed::Key32 key;
    std::memcpy(key.data(), identity.node_key.data(), key.size());
    sealed::PeerSecrets secrets;
    if (!link_keys_->ForPeer(key, &secrets)) {
      refuse(absl::StrCat("node ", peer,
                          " has a node key of small order in the node table"));
      return;
    }
    if (key == link_keys_->public_key()) {
      refuse(absl::StrCat("node ", peer,
                          " has this node's own node key in the node table"));
      return;
    }
    if (absl::Status set = opener_->SetPeer(peer, identity.role, key, &secrets);
        !set.ok()) {
      refuse(std::string(set.message()));
      return;
    }
    std::shared_ptr<Sender> scheduler_link;
    {
      absl::MutexLock lock(&senders_mu_);
      links_[peer] =
          PeerLink{identity.role, key, secrets, identity.sealed_port};
      if (peer == kSchedulerId) {
        auto it = senders_.find(kSchedulerId);
        if (it != senders_.end()) scheduler_link = it->second;
      }
    }
    if (scheduler_link != nullptr) {
      // From now on what goes to the scheduler is sealed.
      absl::MutexLock lock(&scheduler_link->mu);
      if (scheduler_link->sealer == nullptr) {
        scheduler_link->sealer = NewSealer(
            PeerLink{identity.role, key, secrets, identity.sealed_port});
      }
    }
  }

  SealedDrops sealed_drops() const override {
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
    }
    d.unsealed = unsealed_.load();
    return d;
  }

  std::vector<LostLink> TakeLostLinks() override {
    std::vector<LostLink> lost;
    absl::MutexLock lock(&watch_mu_);
    CloseStoppedMonitorsLocked();
    for (auto& [peer, watch] : watches_) {
      uint16_t event = 0;
      while (NextEvent(watch.monitor, &event)) {
        switch (event) {
          case ZMQ_EVENT_DISCONNECTED:
            watch.closed = true;
            watch.closed_at = absl::Now();
            watch.retried = 0;
            watch.reported = false;
            break;
          case ZMQ_EVENT_CONNECT_RETRIED:
            if (watch.closed) ++watch.retried;
            break;
          case ZMQ_EVENT_CONNECTED:
          case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
            watch.closed = false;
            watch.retried = 0;
            break;
          default:
            break;
        }
      }
      // After a close ZeroMQ announces its reconnect (one CONNECT_RETRIED)
      // before trying; each one after that is an attempt that failed at
      // once (refused: a connection that hangs, to a host that dropped off
      // the network, ends no attempt).
      const int refused = watch.retried - 1;
      if (watch.closed && !watch.reported && refused >= kRefusalsForLost) {
        watch.reported = true;
        lost.push_back(
            LostLink{peer, watch.endpoint, watch.closed_at, refused});
      }
    }
    return lost;
  }

  void DiscardUnsent() override {
    // Released after the locks (their frames' owners may lock).
    std::vector<std::deque<sealed::SealJob>> dropped;
    absl::MutexLock lock(&senders_mu_);
    const int zero = 0;
    for (auto& [peer, sender] : senders_) {
      absl::MutexLock hold(&sender->mu);
      dropped.push_back(std::move(sender->pending));
      sender->pending.clear();
      zmq_setsockopt(sender->socket, ZMQ_LINGER, &zero, sizeof(zero));
    }
  }

  void Close() override {
    if (closed_.exchange(true)) return;
    // What waits to be sealed is dropped with the links, as ZeroMQ drops
    // what is queued on a closed socket after the linger.
    if (pool_ != nullptr) pool_->Stop();
    {
      // The senders first: each stops its monitor as it goes (~Sender).
      absl::MutexLock lock(&senders_mu_);
      senders_.clear();
    }
    {
      // Every socket closes before zmq_ctx_term, which waits for them.
      absl::MutexLock lock(&watch_mu_);
      for (auto& [peer, watch] : watches_) zmq_close(watch.monitor);
      watches_.clear();
      for (const RetiredMonitor& m : retired_monitors_) zmq_close(m.monitor);
      retired_monitors_.clear();
    }
    absl::MutexLock lock(&recv_mu_);
    if (receiver_ != nullptr) {
      zmq_close(receiver_);
      receiver_ = nullptr;
    }
    if (sealed_receiver_ != nullptr) {
      zmq_close(sealed_receiver_);
      sealed_receiver_ = nullptr;
    }
    if (zap_ != nullptr) zap_->Stop();
  }

 private:
  struct Sender {
    absl::Mutex mu;
    void* socket = nullptr;
    std::string endpoint;
    int peer = 0;
    // Set on a sealed link: every message goes as records.
    std::unique_ptr<sealed::Sealer> sealer ABSL_GUARDED_BY(mu);
    // Messages (the first perhaps part-sealed) waiting for room in ZeroMQ.
    std::deque<sealed::SealJob> pending ABSL_GUARDED_BY(mu);
    std::shared_ptr<Backlog> backlog = std::make_shared<Backlog>();
    std::shared_ptr<BlockCache> blocks;  // the transport's
    // Set once the socket's monitor (a watched link) has stopped for good:
    // its reader may close then (TakeLostLinks), never before.
    std::shared_ptr<std::atomic<bool>> monitor_stopped;
    ~Sender() {
      if (socket == nullptr) return;
      if (monitor_stopped != nullptr) {
        // Before the socket goes: ZeroMQ's I/O thread sends its events
        // blocking, so no event may be left on its way to a reader that
        // closes. The reader's end is still open (unbounded) here.
        zmq_socket_monitor(socket, nullptr, 0);
        monitor_stopped->store(true);
      }
      zmq_close(socket);
    }
  };

  // What sealing to a peer needs.
  struct PeerLink {
    Role role;
    sealed::Key32 key;
    sealed::PeerSecrets secrets;
    int sealed_port;
  };

  Role own_role() const { return options_.security->keys.role; }

  bool Sealed() const {
    return options_.security != nullptr && options_.security->encrypt;
  }

  void SetUpSealing() {
    const JobKeys& keys = options_.security->keys;
    std::optional<sealed::Key32> secret = sealed::KeyFromZ85(keys.secret_key);
    std::array<sealed::Key32, 3> publics;
    for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker}) {
      plain_passwords_[static_cast<int>(r)] = PlainPassword(keys, r);
      std::optional<sealed::Key32> p = sealed::KeyFromZ85(keys.public_key(r));
      if (p.has_value()) publics[static_cast<int>(r)] = *p;
    }
    // Key files are checked when read (ParseKeyFile, keys that decode and
    // agree), so this cannot fail for keys that got this far.
    std::optional<sealed::LinkKeys> link_keys =
        secret.has_value() ? sealed::LinkKeys::Make(sealed::NodeKey::Generate(),
                                                    keys.role, *secret, publics)
                           : std::nullopt;
    if (!link_keys.has_value()) {
      TESSERA_LOG(ERROR) << "the job's keys do not agree (X25519)";
      std::abort();
    }
    if (secret.has_value()) WipeBytes(secret->data(), secret->size());
    link_keys_ =
        std::make_shared<const sealed::LinkKeys>(*std::move(link_keys));
    sealed::SealedReceiver::Options o;
    o.keys = link_keys_;
    o.accept_first_scheduler = keys.role != Role::kScheduler;
    o.limits = options_.limits;
    o.max_frame_bytes = options_.max_message_bytes;
    o.on_drop = [](uint64_t n, const std::string& why) {
      if (ShouldLog(n)) {
        TESSERA_LOG(WARNING)
            << "dropped sealed record #" << n << ": " << why
            << (n == kLogDropsFirst ? " (from now on one line per 1000)" : "");
      }
    };
    opener_ = std::make_unique<sealed::SealedReceiver>(std::move(o));
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    pool_ = std::make_unique<SealPool>(std::clamp(cores, 1, 4));
    blocks_ = std::make_shared<BlockCache>(kRecordBlockHead +
                                           sealed::kRecordOverhead +
                                           options_.sealed_record_bytes);
  }

  absl::Status BindSealedLane(const std::string& ip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_) {
    sealed_receiver_ = zmq_socket(context_, ZMQ_PULL);
    ConfigureSocket(sealed_receiver_);
    const int on = 1;
    zmq_setsockopt(sealed_receiver_, ZMQ_PLAIN_SERVER, &on, sizeof(on));
    zmq_setsockopt(sealed_receiver_, ZMQ_ZAP_DOMAIN, ZapHandler::kSealedDomain,
                   std::strlen(ZapHandler::kSealedDomain));
    zmq_setsockopt(sealed_receiver_, ZMQ_RCVHWM, &kReceiveHighWaterMark,
                   sizeof(kReceiveHighWaterMark));
    // A record holds at most a record's plaintext, or a header alone.
    const int64_t max_record =
        static_cast<int64_t>(sealed::kRecordOverhead + 16 + 8 +
                             std::max(options_.sealed_record_bytes,
                                      options_.limits.max_header_bytes));
    zmq_setsockopt(sealed_receiver_, ZMQ_MAXMSGSIZE, &max_record,
                   sizeof(max_record));
    const std::string endpoint = TcpEndpoint(ip, options_.sealed_port);
    if (zmq_bind(sealed_receiver_, endpoint.c_str()) != 0) {
      const std::string err = ZmqError();
      zmq_close(sealed_receiver_);
      sealed_receiver_ = nullptr;
      return absl::UnavailableError(absl::StrCat(
          "cannot bind the sealed lane at ", endpoint, ": ", err,
          options_.sealed_port != 0 ? " (TESSERA_SEALED_PORT)" : ""));
    }
    sealed_port_.store(BoundPort(sealed_receiver_, options_.sealed_port));
    TESSERA_VLOG(1) << "sealed lane on port " << sealed_port_.load();
    return absl::OkStatus();
  }

  static int BoundPort(void* socket, int port) {
    char last[256] = {0};
    size_t size = sizeof(last);
    zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &size);
    const std::string bound(last);
    const size_t colon = bound.rfind(':');
    TESSERA_VLOG(1) << "listening on " << bound;
    return colon == std::string::npos ? port
                                      : std::atoi(bound.c_str() + colon + 1);
  }

  std::optional<PeerLink> LinkTo(int peer) {
    absl::MutexLock lock(&senders_mu_);
    auto it = links_.find(peer);
    if (it == links_.end()) return std::nullopt;
    return it->second;
  }

  // A new link to `peer`: its own number, so its key is fresh.
  std::unique_ptr<sealed::Sealer> NewSealer(const PeerLink& link) {
    const uint32_t number = next_link_.fetch_add(1);
    return std::make_unique<sealed::Sealer>(
        own_role(), link_keys_->public_key(), number,
        link_keys_->SendingSecret(link.secrets, link.role, link.key, number),
        options_.sealed_record_bytes);
  }

  // Queues `msg` on a sealed link and seals what ZeroMQ has room for now;
  // the pool seals the rest as records go out.
  absl::Status SendSealed(Sender& sender, const Message& msg,
                          size_t header_size,
                          std::vector<sealed::SealJob>* sent_jobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu) {
    sealed::SealJob job;
    job.header.resize(header_size);
    if (!SerializeHeader(msg, job.header.data(), header_size))
      return absl::InternalError("cannot serialize message header");
    job.frames = msg.data;
    sender.pending.push_back(std::move(job));
    if (sender.backlog->waiting.load()) return absl::OkStatus();
    return Pump(sender, sent_jobs);
  }

  // Seals the link's waiting messages while ZeroMQ holds less than
  // kBacklogLimit of its records; when it holds more, the free callback of
  // the record that brings it down to kBacklogResume hands the link to the
  // pool.
  // Jobs that are done (or failed) move to `finished`, for the caller to
  // release once it has let go of sender.mu.
  static absl::Status Pump(Sender& sender,
                           std::vector<sealed::SealJob>* finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu) {
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
          finished->push_back(std::move(job));
          sender.pending.pop_front();
          return absl::UnavailableError(
              absl::StrCat("cannot send to node ", sender.peer, " at ",
                           sender.endpoint, ": ", s.message()));
        }
      }
      finished->push_back(std::move(job));
      sender.pending.pop_front();
    }
    return absl::OkStatus();
  }

  // Gives the link's backlog the way back to it: the pool pumps it when
  // records have gone out.
  void ArmBacklog(const std::shared_ptr<Sender>& sender) {
    SealPool* pool = pool_.get();
    std::weak_ptr<Sender> weak = sender;
    sender->backlog->resume = [pool, weak] {
      pool->Schedule([weak] {
        std::shared_ptr<Sender> s = weak.lock();
        if (s == nullptr) return;
        std::vector<sealed::SealJob> finished;  // released after the lock
        absl::MutexLock lock(&s->mu);
        if (absl::Status pumped = Pump(*s, &finished); !pumped.ok()) {
          TESSERA_LOG(WARNING) << pumped.message();
        }
      });
    };
  }

  absl::Status SendFrames(Sender& sender, int peer, const Message& msg,
                          size_t header_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sender.mu) {
    // The header is serialized straight into its frame.
    zmq_msg_t header;
    zmq_msg_init_size(&header, header_size);
    if (!SerializeHeader(msg, zmq_msg_data(&header), header_size)) {
      zmq_msg_close(&header);
      return absl::InternalError("cannot serialize message header");
    }
    if (zmq_msg_send(&header, sender.socket,
                     msg.data.empty() ? 0 : ZMQ_SNDMORE) < 0) {
      const std::string err = ZmqError();
      zmq_msg_close(&header);
      return absl::UnavailableError(absl::StrCat(
          "cannot send to node ", peer, " at ", sender.endpoint, ": ", err));
    }
    for (size_t i = 0; i < msg.data.size(); ++i) {
      const Buffer& part = msg.data[i];
      zmq_msg_t zmsg;
      if (part.size() < kCopyBelowBytes) {
        // Small parts are copied: cheaper than a reference-counted hand-off.
        zmq_msg_init_size(&zmsg, part.size());
        if (part.size() > 0)
          std::memcpy(zmq_msg_data(&zmsg), part.data(), part.size());
      } else {
        auto* hint = new std::shared_ptr<const void>(part.owner());
        zmq_msg_init_data(&zmsg, const_cast<uint8_t*>(part.data()), part.size(),
                          ReleaseBuffer, hint);
      }
      const int flags = i + 1 < msg.data.size() ? ZMQ_SNDMORE : 0;
      if (zmq_msg_send(&zmsg, sender.socket, flags) < 0) {
        const std::string err = ZmqError();
        zmq_msg_close(&zmsg);
        // A half-sent multi-part message is discarded by ZeroMQ with the
        // socket's pending parts; report the failure to the caller.
        return absl::UnavailableError(absl::StrCat(
            "cannot send to node ", peer, " at ", sender.endpoint, ": ", err));
      }
    }
    return absl::OkStatus();
  }

  // Counts and logs a received message on its way out of the transport.
  Message Deliver(Message msg) {
    if (LogVerbosity() >= 2) TESSERA_LOG(INFO) << "recv " << DebugString(msg);
    if (counters_ != nullptr) {
      uint64_t bytes = msg.header.ByteSizeLong();
      for (const Buffer& part : msg.data) bytes += part.size();
      counters_->Received(msg.header.command(), bytes);
    }
    return msg;
  }

  // Takes one message (all its frames) off `socket` and files what it yields
  // into ready_: a sealed record goes to the opener, a message of frames is
  // decoded and checked. False when nothing was there (or it failed).
  bool ReceiveFrom(void* socket, int flags)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(recv_mu_) {
    // The first frame stays where ZeroMQ put it: a header is parsed from it
    // (and freed after), a record opened in it.
    auto first = std::make_shared<ReceivedPart>();
    zmq_msg_init(&first->msg);
    if (zmq_msg_recv(&first->msg, socket, flags) < 0) {
      const int err = zmq_errno();
      if (err != EAGAIN && err != EINTR) {
        TESSERA_LOG(WARNING) << "zmq_msg_recv: " << ZmqError();
      }
      return false;
    }
    std::string user_id;  // the key its connection was authenticated with
    if (options_.security != nullptr) {
      const char* id = zmq_msg_gets(&first->msg, "User-Id");
      if (id != nullptr) user_id = id;
    }
    const bool more = zmq_msg_more(&first->msg);
    if (opener_ != nullptr && !more && IsSealedRecord(&first->msg)) {
      std::optional<Role> role = options_.security->keys.RoleOfKey(user_id);
      if (!role.has_value()) {
        // The ZAP handler gives every connection a role key.
        ++malformed_;
        return true;
      }
      sealed::Record record;
      record.data = static_cast<uint8_t*>(zmq_msg_data(&first->msg));
      record.size = zmq_msg_size(&first->msg);
      record.owner = first;
      record.connection_role = *role;
      std::vector<Message> opened;
      opener_->Accept(std::move(record), &opened);
      for (Message& m : opened) ready_.push_back(std::move(m));
      return true;
    }
    if (socket == sealed_receiver_) {
      // The sealed lane carries records only.
      DrainParts(socket, more);
      const uint64_t n = ++malformed_;
      TESSERA_LOG(WARNING) << "dropped malformed message #" << n
                           << ": the sealed lane carries sealed records only";
      return true;
    }
    std::vector<Buffer> parts;
    bool failed = false;
    bool next = more;
    size_t received = 1;
    while (next) {
      auto part = std::make_shared<ReceivedPart>();
      zmq_msg_init(&part->msg);
      if (zmq_msg_recv(&part->msg, socket, 0) < 0) {
        failed = true;
        break;
      }
      next = zmq_msg_more(&part->msg);
      if (++received > options_.limits.max_frames + 1) {
        // More parts than any message may have: the rest is read and freed
        // at once, not collected, and the message is dropped below.
        if (received == options_.limits.max_frames + 2) parts.clear();
        continue;
      }
      const void* data = zmq_msg_data(&part->msg);
      const size_t size = zmq_msg_size(&part->msg);
      if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0) {
        parts.push_back(Buffer::CopyOf(data, size));
      } else {
        parts.push_back(Buffer::Wrap(
            data, size, std::shared_ptr<const void>(part, part.get())));
      }
    }
    if (failed) return true;
    if (received > options_.limits.max_frames + 1) {
      const uint64_t n = ++malformed_;
      TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                           << received << " parts; at most "
                           << options_.limits.max_frames + 1 << " are allowed";
      return true;
    }
    absl::StatusOr<Message> msg =
        DecodeMessage(zmq_msg_data(&first->msg), zmq_msg_size(&first->msg),
                      std::move(parts), options_.limits);
    if (!msg.ok()) {
      const uint64_t n = ++malformed_;
      TESSERA_LOG(WARNING) << "dropped malformed message #" << n << ": "
                           << msg.status().message();
      return true;
    }
    if (options_.security != nullptr && !SenderMatchesKey(*msg, user_id))
      return true;
    if (opener_ != nullptr && !UnsealedAllowed(*msg, user_id)) return true;
    if (options_.security != nullptr &&
        !options_.security->keys.IsRoleKey(user_id)) {
      msg->connection_key = std::move(user_id);
    }
    ready_.push_back(*std::move(msg));
    return true;
  }

  void DrainParts(void* socket, bool more) {
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

  // In a sealed job only a node's registration (before it has an id, over
  // CURVE to the scheduler) comes unsealed: anything else must be bound to
  // the node key of the process that sent it.
  bool UnsealedAllowed(const Message& msg, const std::string& user_id) {
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

  void ConfigureSocket(void* socket) {
    const int linger_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options_.linger));
    zmq_setsockopt(socket, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
    const int ipv6 = 1;
    zmq_setsockopt(socket, ZMQ_IPV6, &ipv6, sizeof(ipv6));
    const int reconnect_ms = 100, reconnect_max_ms = 1000;
    zmq_setsockopt(socket, ZMQ_RECONNECT_IVL, &reconnect_ms,
                   sizeof(reconnect_ms));
    zmq_setsockopt(socket, ZMQ_RECONNECT_IVL_MAX, &reconnect_max_ms,
                   sizeof(reconnect_max_ms));
  }

  // Starts watching the link to `peer` (its sender, connecting to
  // `endpoint`): ZeroMQ's monitor of the socket, read by TakeLostLinks. A
  // link that cannot be watched is only logged: the heartbeats still judge
  // its peer.
  //
  // ZeroMQ sends monitor events blocking, from its I/O thread, so a full
  // pipe, or one whose reader has closed, stops that thread and every link
  // with it (a scheduler stalled 20 s after a restart's reconnect, CI under
  // TSan at 4a9dde7). The reader is therefore unbounded (RCVHWM 0), connected
  // before the monitor starts (an inproc connect may come first), and closed
  // only once the sender's socket has stopped its monitor (~Sender).
  void WatchLink(int peer, Sender& sender, const std::string& endpoint) {
    absl::MutexLock lock(&watch_mu_);
    const std::string address =
        absl::StrCat("inproc://tessera-link-watch-", next_watch_++);
    void* monitor = zmq_socket(context_, ZMQ_PAIR);
    if (monitor == nullptr) {
      TESSERA_LOG(WARNING) << "cannot watch the link to node " << peer << ": "
                           << ZmqError();
      return;
    }
    const int zero = 0;
    zmq_setsockopt(monitor, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(monitor, ZMQ_RCVHWM, &zero, sizeof(zero));
    if (zmq_connect(monitor, address.c_str()) != 0 ||
        zmq_socket_monitor(sender.socket, address.c_str(),
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                               ZMQ_EVENT_CONNECT_RETRIED |
                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
      TESSERA_LOG(WARNING) << "cannot watch the link to node " << peer << ": "
                           << ZmqError();
      zmq_close(monitor);
      return;
    }
    sender.monitor_stopped = std::make_shared<std::atomic<bool>>(false);
    LinkWatch& watch = watches_[peer];
    if (watch.monitor != nullptr) {
      retired_monitors_.push_back({watch.monitor, std::move(watch.stopped)});
    }
    watch = LinkWatch();
    watch.monitor = monitor;
    watch.stopped = sender.monitor_stopped;
    watch.endpoint = endpoint;
  }

  void Unwatch(int peer) {
    absl::MutexLock lock(&watch_mu_);
    auto it = watches_.find(peer);
    if (it == watches_.end()) return;
    // Its socket may still send events until its Sender is gone.
    retired_monitors_.push_back(
        {it->second.monitor, std::move(it->second.stopped)});
    watches_.erase(it);
  }

  // Closes the readers of monitors that have stopped.
  void CloseStoppedMonitorsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) {
    std::erase_if(retired_monitors_, [](const RetiredMonitor& m) {
      if (!m.stopped->load()) return false;
      zmq_close(m.monitor);
      return true;
    });
  }

  // Reads the next event of a socket monitor without waiting: false when
  // there is none. An event is two parts (ZeroMQ 4: 16-bit event and 32-bit
  // value, then the endpoint), queued whole.
  static bool NextEvent(void* monitor, uint16_t* event) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, monitor, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&part);
      return false;
    }
    *event = 0;
    if (zmq_msg_size(&part) >= sizeof(*event))
      memcpy(event, zmq_msg_data(&part), sizeof(*event));
    bool more = zmq_msg_more(&part) != 0;
    zmq_msg_close(&part);
    while (more) {
      zmq_msg_init(&part);
      if (zmq_msg_recv(&part, monitor, ZMQ_DONTWAIT) < 0)
        more = false;
      else
        more = zmq_msg_more(&part) != 0;
      zmq_msg_close(&part);
    }
    return true;
  }

  bool Encrypted() const {
    return options_.security != nullptr && options_.security->encrypt;
  }

  void SecureReceiver(void* socket) {
    if (options_.security == nullptr) return;
    const JobKeys& keys = options_.security->keys;
    const int on = 1;
    if (options_.security->encrypt) {
      zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &on, sizeof(on));
      zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, keys.secret_key.data(),
                     keys.secret_key.size());
    } else {
      zmq_setsockopt(socket, ZMQ_PLAIN_SERVER, &on, sizeof(on));
    }
    zmq_setsockopt(socket, ZMQ_ZAP_DOMAIN, ZapHandler::kMainDomain,
                   std::strlen(ZapHandler::kMainDomain));
  }

  // A PUSH socket to `peer` authenticates with this node's role key and, with
  // CURVE, authenticates the peer by its role's public key. Closes the socket
  // on error.
  absl::Status SecureSender(void* socket, int peer) {
    if (options_.security == nullptr) return absl::OkStatus();
    std::optional<Role> role = RoleOfNodeId(peer);
    if (!role.has_value()) {
      zmq_close(socket);
      return absl::InvalidArgumentError(absl::StrCat(
          "node id ", peer, " belongs to no role; its key is unknown"));
    }
    const JobKeys& keys = options_.security->keys;
    if (options_.security->encrypt) {
      const std::string& server_key = keys.public_key(*role);
      // A node's own key, when launch.py gave it one, says which node it is.
      const bool own = !keys.node_secret_key.empty();
      const std::string& public_key =
          own ? keys.node_public_key : keys.public_key(keys.role);
      const std::string& secret_key =
          own ? keys.node_secret_key : keys.secret_key;
      zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, server_key.data(),
                     server_key.size());
      zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, public_key.data(),
                     public_key.size());
      zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret_key.data(),
                     secret_key.size());
    } else {
      const std::string user = RoleName(keys.role);
      const std::string& password =
          plain_passwords_[static_cast<int>(*role)].empty()
              ? PlainPassword(keys, *role)
              : plain_passwords_[static_cast<int>(*role)];
      zmq_setsockopt(socket, ZMQ_PLAIN_USERNAME, user.data(), user.size());
      zmq_setsockopt(socket, ZMQ_PLAIN_PASSWORD, password.data(),
                     password.size());
    }
    return absl::OkStatus();
  }

  // False (counted, warned about) when `msg` claims a sender its connection's
  // key may not speak for.
  bool SenderMatchesKey(const Message& msg, const std::string& user_id) {
    std::optional<Role> role = options_.security->keys.RoleOfKey(user_id);
    absl::Status allowed =
        role.has_value()
            ? CheckClaimedSender(msg.header, *role)
            : absl::PermissionDeniedError("its connection has no key");
    if (allowed.ok()) return true;
    const uint64_t n = ++wrong_sender_;
    TESSERA_LOG(WARNING) << "dropped message #" << n << " from key "
                         << (user_id.empty() ? "(none)" : KeyPrefix(user_id))
                         << ": " << allowed.message() << ": "
                         << DebugString(msg);
    return false;
  }

  const ZmqTransportOptions options_;
  std::unique_ptr<MessageCounters> counters_;  // null: not counted
  void* context_ = nullptr;
  absl::Mutex recv_mu_;
  std::unique_ptr<ZapHandler> zap_ ABSL_GUARDED_BY(recv_mu_);
  // zap_ for counting without recv_mu_ (Receive holds it while it waits);
  // zap_ lives as long as the transport.
  std::atomic<const ZapHandler*> zap_counts_{nullptr};
  void* receiver_ ABSL_GUARDED_BY(recv_mu_) = nullptr;
  void* sealed_receiver_ ABSL_GUARDED_BY(recv_mu_) = nullptr;
  int receive_timeout_ms_ ABSL_GUARDED_BY(recv_mu_) = -1;
  // Messages received but not yet returned (a record can complete several).
  std::deque<Message> ready_ ABSL_GUARDED_BY(recv_mu_);
  absl::Mutex senders_mu_;
  std::map<int, std::shared_ptr<Sender>> senders_ ABSL_GUARDED_BY(senders_mu_);
  std::map<int, PeerLink> links_ ABSL_GUARDED_BY(senders_mu_);
  // Watched links (options_.watch_links): what each one's monitor said.
  struct LinkWatch {
    void* monitor = nullptr;  // PAIR, connected to the sender's monitor
    std::shared_ptr<std::atomic<bool>> stopped;  // Sender::monitor_stopped
    std::string endpoint;
    bool closed = false;  // DISCONNECTED, not connected since
    absl::Time closed_at;
    int retried = 0;  // CONNECT_RETRIED since the close
    bool reported = false;
  };
  // Refused attempts after a close that make a link lost: two, 100-300 ms
  // apart (ZMQ_RECONNECT_IVL 100 ms, doubling).
  static constexpr int kRefusalsForLost = 2;
  absl::Mutex watch_mu_;
  std::map<int, LinkWatch> watches_ ABSL_GUARDED_BY(watch_mu_);
  // Monitor ends of links replaced or forgotten, open until their sender's
  // monitor has stopped.
  struct RetiredMonitor {
    void* monitor = nullptr;
    std::shared_ptr<std::atomic<bool>> stopped;
  };
  std::vector<RetiredMonitor> retired_monitors_ ABSL_GUARDED_BY(watch_mu_);
  uint64_t next_watch_ ABSL_GUARDED_BY(watch_mu_) = 0;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> wrong_sender_{0};
  std::atomic<uint64_t> unsealed_{0};

  // Sealing (Sealed() only; set in the constructor, then read-only).
  std::shared_ptr<const sealed::LinkKeys> link_keys_;
  std::array<SecretString, 3>
      plain_passwords_;  // what this role presents, by peer role
  std::unique_ptr<sealed::SealedReceiver> opener_;
  // Outlives the ZeroMQ context: records' free callbacks, which run until
  // zmq_ctx_term returns, schedule on it.
  std::unique_ptr<SealPool> pool_;
  std::shared_ptr<BlockCache> blocks_;
  std::atomic<uint32_t> next_link_{1};
  std::atomic<int> sealed_port_{0};
};

}  // namespace

std::unique_ptr<Transport> NewZmqTransport(const ZmqTransportOptions& options) {
  KeepLargeFramesInHeap();
  return std::make_unique<ZmqTransport>(options);
}

std::unique_ptr<Transport> NewZmqTransportForFrames(int64_t max_frame_bytes) {
  ZmqTransportOptions options;
  options.max_message_bytes = max_frame_bytes;
  return NewZmqTransport(options);
}

absl::StatusOr<std::unique_ptr<Transport>> NewZmqTransportForNode(
    const Options& node_options) {
  ZmqTransportOptions options;
  options.max_message_bytes = node_options.max_frame_bytes;
  options.sealed_port = node_options.sealed_port;
  TESSERA_ASSIGN_OR_RETURN(options.security,
                           LoadConnectionSecurity(node_options));
  options.metrics = &MetricsRegistry::Global();
  options.watch_links = node_options.role == Role::kScheduler;
  return NewZmqTransport(options);
}

}  // namespace tessera

// KVWorkerImpl: the client side of the key-value protocol (see
// include/tessera/kv_worker.h).
//
// An operation (push, pull, pushpull) becomes one request per server part of
// the key. Replies arrive on the node's receiver thread, which checks them,
// keeps pulled frames (zero-copy ZeroMQ memory) with the operation and counts
// it down; the thread in Wait copies them into the caller's buffer, outside the
// lock, so the receiver thread goes back to the socket at once and copies of
// several operations run in parallel. Pushed float values are sent without a
// copy: the frame borrows the caller's buffer and pins the operation until
// ZeroMQ has written it, so Wait returns only when the buffer is free again.
//
// Delivery (PS_RESEND=1, the default): every request is kept until its reply
// arrives and sent again when none came within PS_RESEND_TIMEOUT, the wait
// doubling up to 8x; TESSERA_RESEND_RETRIES unanswered sends in a row fail it
// with an error naming the server. A server that holds a request (a push
// waiting for its round) answers a resent copy with an acknowledgement, which
// restarts the count. Pushes carry their number per key (push_seq), so a
// server applies each exactly once. When servers checkpoint, a push's copy is
// kept after its reply until the server says a checkpoint holds it; when a
// server restarts, the worker replays its settings, its inits (rank 0) and the
// pushes the server's checkpoint lacks.
//
// A worker restarted into a running job (TESSERA_RESTART_COUNT > 0) keeps its
// rank (the scheduler knows it by its address). Its Init asks each server part
// how many of this rank's pushes to the key it took (KV_INIT with rejoin) and
// joins the workers' barrier only if they wait in an init barrier (the
// scheduler decides); its pushes are numbered on from the smallest such count
// over its keys (ResumeRound), so the first step it repeats is answered, not
// applied twice.
#include "tessera/kv_worker.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_gpu.h"
#include "common/key_partitioner.h"
#include "common/logging.h"
#include "common/node.h"
#include "common/status_macros.h"
#include "worker/client/device_copy.h"

namespace tessera {
namespace {

absl::Status FromWire(const wire::WireStatus& s) {
  if (s.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.code()), s.message());
}

class KVWorkerImpl : public KVWorker {
 public:
  KVWorkerImpl(const Options& options, bool sync)
      : options_(options),
        sync_(sync),
        partitioner_(options.num_servers, options.bigarray_bound),
        next_request_(FirstRequestId(options.restart_count)) {}

  ~KVWorkerImpl() override {
    stop_resender_.store(true);
    if (resender_.joinable()) resender_.join();
    if (node_ != nullptr) node_->Stop();
    for (auto& [key, info] : keys_) {
      gpu::DeviceFree(info.device_residual);
      gpu::DeviceFree(info.device_packed);
      gpu::PinnedFree(info.pinned);
    }
  }

  absl::Status Start() {
    Node::Callbacks callbacks;
    callbacks.on_data = [this](Message&& msg) { HandleReply(std::move(msg)); };
    callbacks.on_failure = [this](const absl::Status& status) {
      FailAll(status);
    };
    callbacks.on_peer_restart = [this](int peer) { ReplayTo(peer); };
    TESSERA_ASSIGN_OR_RETURN(node_,
                             Node::Start(options_, std::move(callbacks)));
    node_->StartDelivery();
    if (options_.resend) resender_ = std::thread([this] { ResendLoop(); });
    return absl::OkStatus();
  }

  int rank() const override { return node_->rank(); }
  int num_workers() const override { return options_.num_workers; }
  int num_servers() const override { return options_.num_servers; }
  bool is_sync() const override { return sync_; }

  absl::Status SetOptimizer(const std::string& spec) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    if (HaveKeys()) {
      return absl::FailedPreconditionError(
          "set_optimizer must be called before the first init");
    }
    Message msg;
    msg.header.set_command(wire::KV_SET_OPTIMIZER);
    msg.header.mutable_kv_options()->set_optimizer_spec(spec);
    TESSERA_RETURN_IF_ERROR(Broadcast(msg, "set_optimizer"));
    absl::MutexLock lock(&mu_);
    settings_msgs_[wire::KV_SET_OPTIMIZER] = std::move(msg);
    return absl::OkStatus();
  }

  absl::Status SetGradientCompression(const std::string& type,
                                      float threshold) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    if (type != "2bit" && type != "none") {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient compression type '", type, "': expected 2bit or none"));
    }
    if (type == "2bit" && !(threshold > 0 && std::isfinite(threshold))) {
      return absl::InvalidArgumentError(
          absl::StrCat("2-bit compression threshold ", threshold,
                       ": expected a number > 0"));
    }
    if (HaveKeys()) {
      return absl::FailedPreconditionError(
          "gradient compression must be set before the first init");
    }
    Message msg;
    msg.header.set_command(wire::KV_SET_COMPRESSION);
    msg.header.mutable_kv_options()->set_compression_type(type);
    msg.header.mutable_kv_options()->set_compression_threshold(threshold);
    TESSERA_RETURN_IF_ERROR(Broadcast(msg, "set_gradient_compression"));
    absl::MutexLock lock(&mu_);
    settings_msgs_[wire::KV_SET_COMPRESSION] = std::move(msg);
    two_bit_ = type == "2bit";
    threshold_ = threshold;
    return absl::OkStatus();
  }

  absl::Status Init(uint64_t key, absl::Span<const float> value) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    if (value.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("init of key ", key, ": empty value"));
    }
    {
      absl::MutexLock lock(&mu_);
      if (keys_.count(key) != 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("key ", key, " is already initialised"));
      }
      KeyInfo& info = keys_[key];
      info.length = value.size();
      info.parts = partitioner_.Partition(key, value.size());
      info.log.resize(info.parts.size());
      info.init.resize(info.parts.size());
      if (two_bit_) info.residual.assign(value.size(), 0.0f);
    }
    if (options_.restart_count > 0) {
      uint64_t resume = 0;
      absl::Status found = RejoinKey(key, value.size(), &resume);
      if (found.ok()) {
        {
          absl::MutexLock lock(&mu_);
          keys_[key].next_seq = resume;
          // Before the first push all keys resume together
          // (SettleResumeLocked); a key declared after that keeps its own
          // count.
          if (resume_ != Resume::kSettled) resume_ = Resume::kPending;
        }
        TESSERA_VLOG(1) << "key " << key << ": the servers took " << resume
                        << " push(es) of this rank before the restart";
        // The others may wait for this rank in this key's init barrier (it
        // died before reaching it); the scheduler joins it only then.
        return node_->Barrier(kGroupWorkers, Node::BarrierKind::kRejoinInit,
                              key);
      }
      if (!absl::IsNotFound(found)) {
        absl::MutexLock lock(&mu_);
        keys_.erase(key);
        return found;
      }
      // Not (wholly) on the servers: this worker died while the job was still
      // initialising; do what a first life does.
    }
    absl::Status stored = absl::OkStatus();
    if (rank() == 0) {
      const uint64_t op = NewOp();
      const std::vector<KeyPart> parts = Parts(key);
      for (size_t i = 0; i < parts.size(); ++i) {
        const KeyPart& part = parts[i];
        Message msg = SliceMessage(wire::KV_INIT, key, part, value.size());
        msg.header.mutable_kv_options()->set_sync_mode(sync_);
        AddFloatFrame(
            &msg, Buffer::CopyOf(value.data() + part.offset, part.length * 4));
        SendPart(op, part, std::move(msg), nullptr, PartRef{key, i});
      }
      stored = WaitOp(op, absl::StrCat("init of key ", key));
    }
    absl::Status barrier =
        node_->Barrier(kGroupWorkers, Node::BarrierKind::kInit, key);
    if (!stored.ok()) {
      absl::MutexLock lock(&mu_);
      keys_.erase(key);
      return stored;
    }
    return barrier;
  }

  uint64_t ResumeRound() override {
    absl::MutexLock lock(&mu_);
    SettleResumeLocked();
    return resume_round_;
  }

  absl::StatusOr<OpHandle> PushAsync(uint64_t key,
                                     absl::Span<const float> grad) override {
    return StartPush(wire::KV_PUSH, key, grad, absl::Span<float>());
  }

  absl::StatusOr<OpHandle> PushPullAsync(uint64_t key,
                                         absl::Span<const float> grad,
                                         absl::Span<float> out) override {
    if (out.size() != grad.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pushpull of key ", key, ": gradient has ", grad.size(),
                       " values but output has ", out.size()));
    }
    return StartPush(wire::KV_PUSHPULL, key, grad, out);
  }

  absl::StatusOr<OpHandle> PushDeviceAsync(uint64_t key,
                                           const float* device_grad, size_t len,
                                           void* cuda_stream) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    if (!gpu::DeviceAvailable()) {
      return absl::FailedPreconditionError(
          "push from GPU memory: no CUDA device available");
    }
    TESSERA_RETURN_IF_ERROR(CheckKey(key, len, "push"));
    KeyInfo* info;
    bool two_bit;
    float threshold;
    {
      absl::MutexLock lock(&mu_);
      info = &keys_[key];
      two_bit = two_bit_;
      threshold = threshold_;
    }
    absl::MutexLock device_lock(&device_mu_);
    const size_t packed_bytes =
        two_bit
            ? compression::TwoBitCompressedBytes(len) + 4 * info->parts.size()
            : len * sizeof(float);
    if (info->pinned == nullptr) {
      TESSERA_ASSIGN_OR_RETURN(info->pinned, gpu::PinnedAlloc(packed_bytes));
      if (two_bit) {
        TESSERA_ASSIGN_OR_RETURN(info->device_residual,
                                 gpu::DeviceAlloc(len * sizeof(float)));
        TESSERA_ASSIGN_OR_RETURN(info->device_packed,
                                 gpu::DeviceAlloc(packed_bytes));
      }
    }
    // Compress each server part on the GPU (residual stays there), then one
    // small copy.
    std::vector<std::pair<size_t, size_t>>
        spans;  // (byte offset in pinned, bytes)
    size_t offset = 0;
    for (const KeyPart& part : info->parts) {
      const size_t bytes = two_bit
                               ? compression::TwoBitCompressedBytes(part.length)
                               : part.length * sizeof(float);
      if (two_bit) {
        TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantizeDevice(
            device_grad + part.offset,
            static_cast<float*>(info->device_residual) + part.offset,
            part.length, threshold,
            static_cast<uint8_t*>(info->device_packed) + offset, cuda_stream));
      }
      spans.emplace_back(offset, bytes);
      offset += bytes;
    }
    const void* source =
        two_bit ? info->device_packed : static_cast<const void*>(device_grad);
    TESSERA_RETURN_IF_ERROR(
        gpu::CopyDeviceToHost(info->pinned, source, offset, cuda_stream));
    const uint64_t op = NewOp();
    const uint64_t seq = NextPushSeq(key);
    for (size_t i = 0; i < info->parts.size(); ++i) {
      const KeyPart& part = info->parts[i];
      Message msg = SliceMessage(wire::KV_PUSH, key, part, len);
      msg.header.set_push_seq(seq);
      Buffer payload =
          Buffer::CopyOf(static_cast<uint8_t*>(info->pinned) + spans[i].first,
                         spans[i].second);
      if (two_bit) {
        AddTwoBitFrame(&msg, std::move(payload), part.length);
      } else {
        AddFloatFrame(&msg, std::move(payload));
      }
      CountPushed(spans[i].second);
      SendPart(op, part, std::move(msg), nullptr, PartRef{key, i});
    }
    return op;
  }

  absl::StatusOr<OpHandle> PullAsync(uint64_t key,
                                     absl::Span<float> out) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    TESSERA_RETURN_IF_ERROR(CheckKey(key, out.size(), "pull"));
    const uint64_t op = NewOp();
    const std::vector<KeyPart> parts = Parts(key);
    for (size_t i = 0; i < parts.size(); ++i) {
      const KeyPart& part = parts[i];
      SendPart(op, part, SliceMessage(wire::KV_PULL, key, part, out.size()),
               out.data() + part.offset, PartRef{key, i});
    }
    {
      absl::MutexLock lock(&mu_);
      ++stats_.pulls;
    }
    return op;
  }

  absl::Status Wait(OpHandle handle) override {
    return WaitOp(handle, "operation");
  }

  absl::Status Barrier() override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    return node_->Barrier(kGroupWorkers);
  }

  absl::Status Close() override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    closed_ = true;
    absl::Status barrier = node_->Barrier(kGroupWorkers);
    if (barrier.ok()) {
      // Tells each server this worker is done with it; one that heard it from
      // every worker ends without failure should the scheduler then vanish.
      Message bye;
      bye.header.set_command(wire::KV_FINISH);
      absl::Status said = Broadcast(bye, "goodbye to the servers");
      if (!said.ok()) TESSERA_LOG(WARNING) << said.message();
    }
    absl::Status done = barrier.ok() ? node_->FinishWorker() : barrier;
    node_->Stop();
    return done;
  }

  KVWorkerStats stats() const override {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  // A push kept after its reply until the server's checkpoint holds it.
  struct LoggedPush {
    uint64_t seq = 0;
    Message msg;  // owns its bytes
  };
  struct KeyInfo {
    uint64_t length = 0;
    std::vector<KeyPart> parts;
    uint64_t next_seq = 0;  // push_seq of the next push
    // Per part, for replay to a restarted server that checkpoints: the init
    // (rank 0) and the pushes its checkpoint may lack, oldest first.
    std::vector<Message> init;
    std::vector<std::deque<LoggedPush>> log;
    std::vector<float> residual;  // 2-bit error feedback, host pushes
    void* device_residual = nullptr;
    void* device_packed = nullptr;
    void* pinned = nullptr;
  };
  struct PulledFrame {
    float* out = nullptr;
    Buffer values;
  };
  struct Op {
    int pending = 0;  // requests without a reply
    int pinned = 0;   // borrowed frames ZeroMQ still holds
    absl::Status status;
    std::string what;
    std::vector<PulledFrame> pulled;   // replies not yet copied to the caller
    uint64_t resume_seq = UINT64_MAX;  // rejoin: smallest push count replied
  };
  // Identifies the key part a request is about.
  struct PartRef {
    uint64_t key = 0;
    size_t index = 0;
    bool valid = true;
  };
  struct Request {
    uint64_t op = 0;       // 0: a replayed request nobody waits for
    float* out = nullptr;  // where pulled values go
    uint64_t length = 0;
    int server = 0;
    PartRef part{0, 0, false};
    bool replayed = false;
    bool rejoin = false;  // a restarted worker's KV_INIT
    // For resending (PS_RESEND=1).
    Message msg;
    absl::Time first_sent;
    absl::Time next_send;
    absl::Duration wait;
    int unanswered = 0;  // sends in a row without any answer
  };

  absl::Status CheckOpen() const {
    if (closed_) return absl::FailedPreconditionError("the KV store is closed");
    return node_->failure();
  }

  bool HaveKeys() const {
    absl::MutexLock lock(&mu_);
    return !keys_.empty();
  }

  std::vector<KeyPart> Parts(uint64_t key) const {
    absl::MutexLock lock(&mu_);
    return keys_.at(key).parts;
  }

  absl::Status CheckKey(uint64_t key, size_t len, const char* what) const {
    absl::MutexLock lock(&mu_);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      return absl::NotFoundError(
          absl::StrCat(what, " of key ", key,
                       ": the key was never initialised (call init first)"));
    }
    if (it->second.length != len) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of key ", key, " with ", len,
                       " values; the key has ", it->second.length));
    }
    return absl::OkStatus();
  }

  Message SliceMessage(wire::Command cmd, uint64_t key, const KeyPart& part,
                       uint64_t total) {
    Message msg;
    msg.header.set_command(cmd);
    wire::KeySlice* slice = msg.header.mutable_slice();
    slice->set_key(key);
    slice->set_offset(part.offset);
    slice->set_length(part.length);
    slice->set_total_length(total);
    return msg;
  }

  void CountPushed(uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    stats_.bytes_pushed += bytes;
  }

  uint64_t NextPushSeq(uint64_t key) {
    absl::MutexLock lock(&mu_);
    SettleResumeLocked();
    return keys_[key].next_seq++;
  }

  // After a restart: every key's pushes resume at the smallest count the
  // servers reported, so a step is repeated whole (its pushes the servers
  // already took are answered as duplicates).
  void SettleResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (resume_ != Resume::kPending) return;
    resume_ = Resume::kSettled;
    uint64_t resume = UINT64_MAX;
    for (const auto& [key, info] : keys_)
      resume = std::min(resume, info.next_seq);
    if (keys_.empty()) resume = 0;
    for (auto& [key, info] : keys_) info.next_seq = resume;
    resume_round_ = resume;
    TESSERA_LOG(INFO) << "restarted (TESSERA_RESTART_COUNT="
                      << options_.restart_count << "): resuming at round "
                      << resume;
  }

  // A restarted worker's Init: where this rank's pushes to `key` resume, the
  // smallest count over the key's server parts. NotFound when a server does
  // not hold the key.
  absl::Status RejoinKey(uint64_t key, uint64_t total, uint64_t* resume) {
    const uint64_t op = NewOp();
    for (const KeyPart& part : Parts(key)) {
      Message msg = SliceMessage(wire::KV_INIT, key, part, total);
      msg.header.set_rejoin(true);
      SendPart(op, part, std::move(msg), nullptr);
    }
    return WaitOp(op, absl::StrCat("rejoin of key ", key), resume);
  }

  absl::StatusOr<OpHandle> StartPush(wire::Command cmd, uint64_t key,
                                     absl::Span<const float> grad,
                                     absl::Span<float> out) {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "push"));
    bool two_bit;
    float threshold;
    std::vector<KeyPart> parts;
    float* residual = nullptr;
    uint64_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      two_bit = two_bit_;
      threshold = threshold_;
      parts = keys_[key].parts;
      residual = keys_[key].residual.data();
      SettleResumeLocked();
      seq = keys_[key].next_seq++;
      ++stats_.pushes;
    }
    const uint64_t op = NewOp();
    for (size_t i = 0; i < parts.size(); ++i) {
      const KeyPart& part = parts[i];
      Message msg = SliceMessage(cmd, key, part, grad.size());
      msg.header.set_push_seq(seq);
      if (two_bit) {
        Buffer packed =
            Buffer::Allocate(compression::TwoBitCompressedBytes(part.length));
        absl::Status s = compression::TwoBitQuantize(
            grad.data() + part.offset, residual + part.offset, part.length,
            threshold, packed.mutable_data());
        if (!s.ok()) {
          FailRequestless(op, s);
          break;
        }
        CountPushed(packed.size());
        AddTwoBitFrame(&msg, std::move(packed), part.length);
      } else {
        // Zero-copy: the frame borrows the caller's memory and pins the
        // operation.
        {
          absl::MutexLock lock(&mu_);
          ++ops_[op].pinned;
        }
        std::shared_ptr<const void> pin(nullptr,
                                        [this, op](const void*) { Unpin(op); });
        AddFloatFrame(
            &msg, Buffer::Wrap(grad.data() + part.offset,
                               part.length * sizeof(float), std::move(pin)));
        CountPushed(part.length * sizeof(float));
      }
      SendPart(op, part, std::move(msg),
               cmd == wire::KV_PUSHPULL ? out.data() + part.offset : nullptr,
               PartRef{key, i});
    }
    return op;
  }

  uint64_t NewOp() {
    absl::MutexLock lock(&mu_);
    const uint64_t op = next_op_++;
    ops_[op] = Op();
    return op;
  }

  void Unpin(uint64_t op) {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(op);
    if (it != ops_.end()) --it->second.pinned;
  }

  void FailRequestless(uint64_t op, const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (ops_[op].status.ok()) ops_[op].status = status;
  }

  // Sends one request of operation `op` (0: a replayed request); a failed send
  // fails the operation, unless the request is kept for resending.
  void SendPart(uint64_t op, const KeyPart& part, Message msg, float* out,
                PartRef ref = PartRef{0, 0, false}, bool replayed = false) {
    const uint64_t request = next_request_.fetch_add(1);
    msg.header.set_request_id(request);
    const int server = ServerId(part.server_rank);
    {
      absl::MutexLock lock(&mu_);
      Request& r = requests_[request];
      r.op = op;
      r.out = out;
      r.length = part.length;
      r.server = server;
      r.part = ref;
      r.replayed = replayed;
      r.rejoin = msg.header.rejoin();
      if (options_.resend) {
        r.msg = msg;  // the header and references to the same frames
        r.first_sent = absl::Now();
        r.wait = options_.resend_timeout;
        r.next_send = r.first_sent + r.wait;
        r.unanswered = 1;
      }
      if (op != 0) ++ops_[op].pending;
    }
    absl::Status sent = node_->Send(server, std::move(msg));
    if (!sent.ok() && !options_.resend) {
      absl::MutexLock lock(&mu_);
      requests_.erase(request);
      if (op == 0) return;
      Op& o = ops_[op];
      --o.pending;
      if (o.status.ok()) o.status = sent;
    }
  }

  absl::Status Broadcast(const Message& msg, const std::string& what) {
    const uint64_t op = NewOp();
    for (int s = 0; s < options_.num_servers; ++s) {
      KeyPart part{s, 0, 0};
      SendPart(op, part, msg, nullptr);
    }
    return WaitOp(op, what);
  }

  // Describes a request for errors: "push of key 3".
  static std::string What(const Message& msg) {
    const char* verb = "request";
    switch (msg.header.command()) {
      case wire::KV_INIT:
        verb = "init";
        break;
      case wire::KV_PUSH:
        verb = "push";
        break;
      case wire::KV_PULL:
        verb = "pull";
        break;
      case wire::KV_PUSHPULL:
        verb = "pushpull";
        break;
      case wire::KV_SET_OPTIMIZER:
        return "set_optimizer";
      case wire::KV_SET_COMPRESSION:
        return "set_gradient_compression";
      default:
        break;
    }
    return absl::StrCat(verb, " of key ", msg.header.slice().key());
  }

  // Sends again what got no answer in time; fails what exhausted its retries.
  void ResendLoop() {
    const absl::Duration tick =
        std::min(absl::Milliseconds(20), options_.resend_timeout / 4);
    const absl::Duration max_wait = options_.resend_timeout * 8;
    while (!stop_resender_.load()) {
      absl::SleepFor(tick);
      std::vector<std::pair<int, Message>> resend;
      std::vector<Message> dead;  // destroyed unlocked: may unpin an op
      {
        absl::MutexLock lock(&mu_);
        if (!failure_.ok()) continue;
        const absl::Time now = absl::Now();
        for (auto it = requests_.begin(); it != requests_.end();) {
          Request& r = it->second;
          if (now < r.next_send) {
            ++it;
            continue;
          }
          if (r.unanswered >= options_.resend_retries) {
            const absl::Status failed = absl::UnavailableError(absl::StrCat(
                What(r.msg), ": no answer from ", node_->Describe(r.server),
                " after ", r.unanswered, " sends over ",
                absl::FormatDuration(
                    absl::Trunc(now - r.first_sent, absl::Milliseconds(1))),
                " (PS_RESEND_TIMEOUT=",
                absl::ToInt64Milliseconds(options_.resend_timeout),
                "ms, TESSERA_RESEND_RETRIES=", options_.resend_retries, ")"));
            TESSERA_LOG(ERROR) << failed.message();
            if (r.op != 0) {
              Op& o = ops_[r.op];
              --o.pending;
              if (o.status.ok()) o.status = failed;
            }
            dead.push_back(std::move(r.msg));
            it = requests_.erase(it);
            continue;
          }
          ++r.unanswered;
          r.wait = std::min(r.wait * 2, max_wait);
          r.next_send = now + r.wait;
          ++stats_.resends;
          TESSERA_VLOG(1) << "resending " << What(r.msg) << " (request "
                          << it->first << ") to " << node_->Describe(r.server)
                          << ", send " << r.unanswered;
          resend.emplace_back(r.server, r.msg);
          ++it;
        }
      }
      for (auto& [server, msg] : resend) (void)node_->Send(server, msg);
    }
  }

  // A server restarted (from its checkpoint, or empty): send it again what it
  // may have lost, in order: settings, inits (rank 0), pushes its checkpoint
  // lacks, then the requests still waiting for it, at once.
  void ReplayTo(int server) {
    if (!IsServerId(server)) return;
    const int server_rank = RankOfId(server);
    std::vector<std::tuple<KeyPart, Message, PartRef>> replay;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [cmd, msg] : settings_msgs_)
        replay.emplace_back(KeyPart{server_rank, 0, 0}, msg,
                            PartRef{0, 0, false});
      for (const auto& [key, info] : keys_) {
        for (size_t i = 0; i < info.parts.size(); ++i) {
          if (info.parts[i].server_rank != server_rank) continue;
          if (i < info.init.size() && !info.init[i].data.empty())
            replay.emplace_back(info.parts[i], info.init[i], PartRef{key, i});
        }
      }
      for (const auto& [key, info] : keys_) {
        for (size_t i = 0; i < info.parts.size(); ++i) {
          if (info.parts[i].server_rank != server_rank) continue;
          for (const LoggedPush& p : info.log[i])
            replay.emplace_back(info.parts[i], p.msg, PartRef{key, i});
        }
      }
      const absl::Time now = absl::Now();
      for (auto& [id, r] : requests_) {
        if (r.server != server) continue;
        r.next_send = now;
        r.unanswered = 0;
        r.wait = options_.resend_timeout / 2;
      }
    }
    TESSERA_LOG(INFO) << node_->Describe(server) << " restarted; replaying "
                      << replay.size() << " message(s) to it";
    for (auto& [part, msg, ref] : replay) {
      SendPart(0, part, std::move(msg), nullptr, ref, /*replayed=*/true);
    }
  }

  // `resume_seq`, when given, receives the smallest push count that rejoin
  // replies carried.
  absl::Status WaitOp(uint64_t op, const std::string& what,
                      uint64_t* resume_seq = nullptr) {
    std::vector<PulledFrame> pulled;
    std::vector<Message> dead;  // destroyed unlocked: may unpin an op
    absl::Status status = WaitOpLocked(op, what, &pulled, &dead, resume_seq);
    if (status.ok()) {
      for (const PulledFrame& f : pulled)
        std::memcpy(f.out, f.values.data(), f.values.size());
    }
    return status;
  }

  // Waits for `op` and hands its pulled frames to the caller, who copies them
  // unlocked.
  absl::Status WaitOpLocked(uint64_t op, const std::string& what,
                            std::vector<PulledFrame>* pulled,
                            std::vector<Message>* dead, uint64_t* resume_seq) {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(op);
    if (it == ops_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown operation handle ", op));
    }
    auto done = [this, op]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      const Op& o = ops_.at(op);
      // After a failure, return at once: the borrowed memory is never read
      // again, because the job is over.
      return (o.pending == 0 && o.pinned == 0) || !failure_.ok();
    };
    const bool finished =
        mu_.AwaitWithTimeout(absl::Condition(&done), options_.request_timeout);
    Op result = std::move(ops_.at(op));
    if (!finished) {
      std::string silent;
      for (auto r = requests_.begin(); r != requests_.end();) {
        if (r->second.op != op) {
          ++r;
          continue;
        }
        absl::StrAppend(&silent, silent.empty() ? "" : ", ",
                        node_->Describe(r->second.server));
        dead->push_back(std::move(r->second.msg));
        r = requests_.erase(r);
      }
      if (result.pinned == 0) {
        ops_.erase(op);
      } else {
        ops_.at(op).pinned = result.pinned;
      }
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": no reply from ", silent.empty() ? "the servers" : silent,
          " within ", absl::FormatDuration(options_.request_timeout),
          " (TESSERA_TIMEOUT)"));
    }
    ops_.erase(op);
    if (!result.status.ok()) return result.status;
    if (result.pending != 0) return failure_;
    *pulled = std::move(result.pulled);
    if (resume_seq != nullptr) *resume_seq = result.resume_seq;
    return absl::OkStatus();
  }

  void HandleReply(Message&& msg) {
    const wire::Header& h = msg.header;
    Message done;  // the request's copy; destroyed unlocked: may unpin an op
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(h.request_id());
    if (!h.is_response()) {
      TESSERA_LOG(WARNING) << "dropped unexpected message " << DebugString(msg);
      return;
    }
    if (it == requests_.end()) {
      // A second answer to a resent request.
      TESSERA_VLOG(1) << "dropped answer to a finished request "
                      << DebugString(msg);
      return;
    }
    if (h.ack_only()) {
      // The server has it and is holding it: keep asking, at the current
      // (doubled) interval, in case the final reply is lost.
      it->second.unanswered = 0;
      it->second.next_send = absl::Now() + it->second.wait;
      return;
    }
    Request request = std::move(it->second);
    requests_.erase(it);
    KeepForReplay(request, h);
    done = std::move(request.msg);
    if (request.op == 0) return;  // a replayed request: nobody waits
    if (h.sender() != request.server) {
      TESSERA_LOG(WARNING) << "reply to request " << h.request_id()
                           << " came from node " << h.sender() << ", not "
                           << request.server;
    }
    Op& op = ops_[request.op];
    absl::Status status = FromWire(h.status());
    if (status.ok() && request.rejoin)
      op.resume_seq = std::min(op.resume_seq, h.push_seq());
    if (status.ok() && request.out != nullptr) {
      if (msg.data.size() != 1 ||
          h.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
          h.frames(0).num_values() != request.length) {
        status = absl::DataLossError(
            absl::StrCat("reply from node ", h.sender(), " does not carry ",
                         request.length, " float values"));
      } else {
        stats_.bytes_pulled += msg.data[0].size();
        op.pulled.push_back(PulledFrame{request.out, std::move(msg.data[0])});
      }
    }
    if (!status.ok() && op.status.ok()) op.status = status;
    --op.pending;
  }

  // After a reply from a server that checkpoints: keep the init (rank 0) and
  // the push until a checkpoint of that server holds them.
  void KeepForReplay(const Request& request, const wire::Header& reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!reply.checkpointing() || !request.part.valid) return;
    auto k = keys_.find(request.part.key);
    if (k == keys_.end() || request.part.index >= k->second.log.size()) return;
    KeyInfo& info = k->second;
    const wire::Command cmd = request.msg.header.command();
    if (cmd == wire::KV_INIT) {
      if (reply.status().code() == 0)
        info.init[request.part.index] = request.msg;  // owns its bytes
      return;
    }
    if (cmd != wire::KV_PUSH && cmd != wire::KV_PUSHPULL) return;
    std::deque<LoggedPush>& log = info.log[request.part.index];
    while (!log.empty() && log.front().seq < reply.durable_seq())
      log.pop_front();
    const uint64_t seq = request.msg.header.push_seq();
    if (request.replayed || seq < reply.durable_seq() ||
        (!log.empty() && log.back().seq >= seq)) {
      return;
    }
    LoggedPush kept;
    kept.seq = seq;
    kept.msg.header = request.msg.header;
    // The frames may borrow the caller's memory, which is theirs again once
    // this operation completes: copy.
    for (const Buffer& b : request.msg.data)
      kept.msg.data.push_back(Buffer::CopyOf(b.data(), b.size()));
    log.push_back(std::move(kept));
  }

  void FailAll(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    failure_ = status;
    for (auto& [id, op] : ops_) {
      if (op.status.ok()) op.status = status;
    }
  }

  const Options options_;
  const bool sync_;
  const KeyPartitioner partitioner_;
  std::unique_ptr<Node> node_;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> next_request_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, KeyInfo> keys_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Request> requests_ ABSL_GUARDED_BY(mu_);
  std::map<int, Message> settings_msgs_ ABSL_GUARDED_BY(mu_);  // by command
  uint64_t next_op_ ABSL_GUARDED_BY(mu_) = 1;
  bool two_bit_ ABSL_GUARDED_BY(mu_) = false;
  float threshold_ ABSL_GUARDED_BY(mu_) = 0;
  // A restarted worker's push numbering: kPending once an Init learned a
  // count from the servers, kSettled after SettleResumeLocked.
  enum class Resume { kNone, kPending, kSettled };
  Resume resume_ ABSL_GUARDED_BY(mu_) = Resume::kNone;
  uint64_t resume_round_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  KVWorkerStats stats_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_resender_{false};
  std::thread resender_;
  absl::Mutex device_mu_;  // one device push at a time per worker (shared
                           // staging buffers)
};

}  // namespace

absl::StatusOr<std::unique_ptr<KVWorker>> KVWorker::Create(
    const std::string& type) {
  if (type != "dist_sync" && type != "dist_async") {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV store type '", type, "': expected dist_sync or dist_async"));
  }
  TESSERA_ASSIGN_OR_RETURN(Options options, Options::FromEnvironment());
  if (options.role != Role::kWorker) {
    return absl::InvalidArgumentError(
        absl::StrCat("DMLC_ROLE='", RoleName(options.role),
                     "': a KV store client must be a worker"));
  }
  SetLogVerbosity(options.verbose);
  auto worker = std::make_unique<KVWorkerImpl>(options, type == "dist_sync");
  TESSERA_RETURN_IF_ERROR(worker->Start());
  return std::unique_ptr<KVWorker>(std::move(worker));
}

absl::Status KVWorker::Push(uint64_t key, absl::Span<const float> grad) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PushAsync(key, grad));
  return Wait(h);
}

absl::Status KVWorker::Pull(uint64_t key, absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PullAsync(key, out));
  return Wait(h);
}

absl::Status KVWorker::PushPull(uint64_t key, absl::Span<const float> grad,
                                absl::Span<float> out) {
  TESSERA_ASSIGN_OR_RETURN(OpHandle h, PushPullAsync(key, grad, out));
  return Wait(h);
}

}  // namespace tessera

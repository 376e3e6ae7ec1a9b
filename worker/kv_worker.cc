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
#include "tessera/kv_worker.h"

#include <cstring>
#include <map>
#include <set>
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
#include "worker/device_copy.h"

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
        partitioner_(options.num_servers, options.bigarray_bound) {}

  ~KVWorkerImpl() override {
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
    TESSERA_ASSIGN_OR_RETURN(node_,
                             Node::Start(options_, std::move(callbacks)));
    node_->StartDelivery();
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
    return Broadcast(std::move(msg), "set_optimizer");
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
    TESSERA_RETURN_IF_ERROR(
        Broadcast(std::move(msg), "set_gradient_compression"));
    absl::MutexLock lock(&mu_);
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
      if (two_bit_) info.residual.assign(value.size(), 0.0f);
    }
    absl::Status stored = absl::OkStatus();
    if (rank() == 0) {
      const uint64_t op = NewOp();
      for (const KeyPart& part : Parts(key)) {
        Message msg = SliceMessage(wire::KV_INIT, key, part, value.size());
        msg.header.mutable_kv_options()->set_sync_mode(sync_);
        AddFloatFrame(
            &msg, Buffer::CopyOf(value.data() + part.offset, part.length * 4));
        SendPart(op, part, std::move(msg), nullptr);
      }
      stored = WaitOp(op, absl::StrCat("init of key ", key));
    }
    absl::Status barrier = node_->Barrier(kGroupWorkers);
    if (!stored.ok()) {
      absl::MutexLock lock(&mu_);
      keys_.erase(key);
      return stored;
    }
    return barrier;
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
    for (size_t i = 0; i < info->parts.size(); ++i) {
      const KeyPart& part = info->parts[i];
      Message msg = SliceMessage(wire::KV_PUSH, key, part, len);
      Buffer payload =
          Buffer::CopyOf(static_cast<uint8_t*>(info->pinned) + spans[i].first,
                         spans[i].second);
      if (two_bit) {
        AddTwoBitFrame(&msg, std::move(payload), part.length);
      } else {
        AddFloatFrame(&msg, std::move(payload));
      }
      CountPushed(spans[i].second);
      SendPart(op, part, std::move(msg), nullptr);
    }
    return op;
  }

  absl::StatusOr<OpHandle> PullAsync(uint64_t key,
                                     absl::Span<float> out) override {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    TESSERA_RETURN_IF_ERROR(CheckKey(key, out.size(), "pull"));
    const uint64_t op = NewOp();
    for (const KeyPart& part : Parts(key)) {
      SendPart(op, part, SliceMessage(wire::KV_PULL, key, part, out.size()),
               out.data() + part.offset);
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
    absl::Status done = barrier.ok() ? node_->FinishWorker() : barrier;
    node_->Stop();
    return done;
  }

  KVWorkerStats stats() const override {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  struct KeyInfo {
    uint64_t length = 0;
    std::vector<KeyPart> parts;
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
    std::vector<PulledFrame> pulled;  // replies not yet copied to the caller
  };
  struct Request {
    uint64_t op = 0;
    float* out = nullptr;  // where pulled values go
    uint64_t length = 0;
    int server = 0;
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

  absl::StatusOr<OpHandle> StartPush(wire::Command cmd, uint64_t key,
                                     absl::Span<const float> grad,
                                     absl::Span<float> out) {
    TESSERA_RETURN_IF_ERROR(CheckOpen());
    TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "push"));
    bool two_bit;
    float threshold;
    std::vector<KeyPart> parts;
    float* residual = nullptr;
    {
      absl::MutexLock lock(&mu_);
      two_bit = two_bit_;
      threshold = threshold_;
      parts = keys_[key].parts;
      residual = keys_[key].residual.data();
      ++stats_.pushes;
    }
    const uint64_t op = NewOp();
    for (const KeyPart& part : parts) {
      Message msg = SliceMessage(cmd, key, part, grad.size());
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
               cmd == wire::KV_PUSHPULL ? out.data() + part.offset : nullptr);
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

  // Sends one request of operation `op`; a failed send fails the operation.
  void SendPart(uint64_t op, const KeyPart& part, Message msg, float* out) {
    const uint64_t request = next_request_.fetch_add(1);
    msg.header.set_request_id(request);
    const int server = ServerId(part.server_rank);
    {
      absl::MutexLock lock(&mu_);
      requests_[request] = Request{op, out, part.length, server};
      ++ops_[op].pending;
    }
    absl::Status sent = node_->Send(server, std::move(msg));
    if (!sent.ok()) {
      absl::MutexLock lock(&mu_);
      requests_.erase(request);
      Op& o = ops_[op];
      --o.pending;
      if (o.status.ok()) o.status = sent;
    }
  }

  absl::Status Broadcast(Message msg, const std::string& what) {
    const uint64_t op = NewOp();
    for (int s = 0; s < options_.num_servers; ++s) {
      KeyPart part{s, 0, 0};
      SendPart(op, part, msg, nullptr);
    }
    return WaitOp(op, what);
  }

  absl::Status WaitOp(uint64_t op, const std::string& what) {
    std::vector<PulledFrame> pulled;
    absl::Status status = WaitOpLocked(op, what, &pulled);
    if (status.ok()) {
      for (const PulledFrame& f : pulled)
        std::memcpy(f.out, f.values.data(), f.values.size());
    }
    return status;
  }

  // Waits for `op` and hands its pulled frames to the caller, who copies them
  // unlocked.
  absl::Status WaitOpLocked(uint64_t op, const std::string& what,
                            std::vector<PulledFrame>* pulled) {
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
    return absl::OkStatus();
  }

  void HandleReply(Message&& msg) {
    const wire::Header& h = msg.header;
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(h.request_id());
    if (!h.is_response() || it == requests_.end()) {
      TESSERA_LOG(WARNING) << "dropped unexpected message " << DebugString(msg);
      return;
    }
    const Request request = it->second;
    requests_.erase(it);
    if (h.sender() != request.server) {
      TESSERA_LOG(WARNING) << "reply to request " << h.request_id()
                           << " came from node " << h.sender() << ", not "
                           << request.server;
    }
    Op& op = ops_[request.op];
    absl::Status status = FromWire(h.status());
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
  std::atomic<uint64_t> next_request_{1};

  mutable absl::Mutex mu_;
  std::map<uint64_t, KeyInfo> keys_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Request> requests_ ABSL_GUARDED_BY(mu_);
  uint64_t next_op_ ABSL_GUARDED_BY(mu_) = 1;
  bool two_bit_ ABSL_GUARDED_BY(mu_) = false;
  float threshold_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  KVWorkerStats stats_ ABSL_GUARDED_BY(mu_);
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

#include "worker/client/kv_client.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

// The tag of the workers' barrier that ends the init of `key`.
std::string InitBarrier(uint64_t key) { return absl::StrCat("init ", key); }

}  // namespace

absl::StatusOr<std::unique_ptr<KVClient>> KVClient::Create(
    const Options& options, bool sync, std::unique_ptr<Transport> transport) {
  if (options.role != Role::kWorker) {
    return absl::InvalidArgumentError(
        absl::StrCat("DMLC_ROLE='", RoleName(options.role),
                     "': a KV store client must be a worker"));
  }
  std::unique_ptr<KVClient> client(new KVClient(options, sync));
  TESSERA_RETURN_IF_ERROR(client->Start(std::move(transport)));
  return client;
}

KVClient::KVClient(const Options& options, bool sync)
    : options_(options),
      sync_(sync),
      partitioner_(options.num_servers, options.bigarray_bound) {}

KVClient::~KVClient() {
  // The node's threads call into the tracker: stop them first. The tracker's
  // resend thread then finds the node stopped (its sends fail).
  if (node_ != nullptr) node_->Stop();
  tracker_.reset();
}

absl::Status KVClient::Start(std::unique_ptr<Transport> transport) {
  RequestTracker::Options tracking;
  tracking.resend = options_.resend;
  tracking.resend_timeout = options_.resend_timeout;
  tracking.resend_retries = options_.resend_retries;
  tracking.request_timeout = options_.request_timeout;
  tracking.first_request_id = FirstRequestId(options_.restart_count);
  tracker_ = std::make_unique<RequestTracker>(
      tracking,
      [this](int server, Message msg) {
        return node_->Send(server, std::move(msg));
      },
      [this](int node) { return node_->Describe(node); },
      [this](const RequestTracker::Answered& answered,
             const wire::Header& reply) {
        replay_log_.Keep(answered.request.part, answered.msg,
                         answered.request.replayed, reply);
      },
      // A thread in Wait takes replies off the transport itself (no hand-off
      // from the node's receiver thread).
      [this](absl::Duration timeout) {
        return node_->ReceiveOnCaller(timeout);
      });
  Node::Callbacks callbacks;
  callbacks.on_data = [this](Message&& msg) {
    tracker_->HandleReply(std::move(msg));
  };
  callbacks.on_failure = [this](const absl::Status& status) {
    tracker_->FailAll(status);
  };
  callbacks.on_peer_restart = [this](int peer) { ReplayTo(peer); };
  callbacks.on_receiver_free = [this] { tracker_->ReceiverFree(); };
  TESSERA_ASSIGN_OR_RETURN(
      node_, Node::Start(options_, std::move(callbacks), std::move(transport)));
  node_->StartDelivery();
  return absl::OkStatus();
}

absl::Status KVClient::CheckOpen() const {
  if (closed_) return absl::FailedPreconditionError("the KV store is closed");
  return node_->failure();
}

bool KVClient::HaveKeys() const {
  absl::MutexLock lock(&mu_);
  return !keys_.empty();
}

std::vector<KeyPart> KVClient::Parts(uint64_t key) const {
  absl::MutexLock lock(&mu_);
  return keys_.at(key).parts;
}

absl::Status KVClient::CheckKey(uint64_t key, size_t len,
                                const char* what) const {
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

Message KVClient::SliceMessage(wire::Command cmd, uint64_t key,
                               const KeyPart& part, uint64_t total) {
  Message msg;
  msg.header.set_command(cmd);
  wire::KeySlice* slice = msg.header.mutable_slice();
  slice->set_key(key);
  slice->set_offset(part.offset);
  slice->set_length(part.length);
  slice->set_total_length(total);
  return msg;
}

void KVClient::SendPart(uint64_t op, const KeyPart& part, Message msg,
                        float* out, RequestTracker::PartRef ref,
                        bool replayed) {
  RequestTracker::Request request;
  request.op = op;
  request.server = ServerId(part.server_rank);
  request.out = out;
  request.length = part.length;
  request.part = ref;
  request.replayed = replayed;
  request.rejoin = msg.header.rejoin();
  tracker_->Send(request, std::move(msg));
}

absl::Status KVClient::Broadcast(const Message& msg, const std::string& what) {
  const uint64_t op = tracker_->NewOp();
  for (int s = 0; s < options_.num_servers; ++s)
    SendPart(op, KeyPart{s, 0, 0}, msg, nullptr);
  return tracker_->Wait(op, what);
}

absl::Status KVClient::SetOptimizer(const std::string& spec) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "set_optimizer must be called before the first init");
  }
  Message msg;
  msg.header.set_command(wire::KV_SET_OPTIMIZER);
  msg.header.mutable_kv_options()->set_optimizer_spec(spec);
  TESSERA_RETURN_IF_ERROR(Broadcast(msg, "set_optimizer"));
  replay_log_.KeepSetting(msg);
  return absl::OkStatus();
}

absl::Status KVClient::SetGradientCompression(const std::string& type,
                                              float threshold) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (type != "2bit" && type != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient compression type '", type, "': expected 2bit or none"));
  }
  if (type == "2bit" && !(threshold > 0 && std::isfinite(threshold))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "2-bit compression threshold ", threshold, ": expected a number > 0"));
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
  replay_log_.KeepSetting(msg);
  absl::MutexLock lock(&mu_);
  two_bit_ = type == "2bit";
  threshold_ = threshold;
  return absl::OkStatus();
}

absl::Status KVClient::Init(uint64_t key, absl::Span<const float> value) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", key, ": empty value"));
  }
  const std::vector<KeyPart> parts = partitioner_.Partition(key, value.size());
  for (const KeyPart& part : parts) {
    if (options_.max_frame_bytes > 0 &&
        part.length * sizeof(float) >
            static_cast<uint64_t>(options_.max_frame_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init of key ", key, ": its part on server ", part.server_rank,
          " is ", part.length * sizeof(float),
          " bytes, more than TESSERA_MAX_MESSAGE_BYTES=",
          options_.max_frame_bytes,
          " (raise it, or use more servers: arrays of at least "
          "TESSERA_BIGARRAY_BOUND elements are split over all of them)"));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (keys_.count(key) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("key ", key, " is already initialised"));
    }
    KeyInfo& info = keys_[key];
    info.length = value.size();
    info.parts = parts;
    if (two_bit_) info.residual.assign(value.size(), 0.0f);
  }
  replay_log_.DeclareKey(key, parts);
  auto forget = [&] {
    replay_log_.ForgetKey(key);
    absl::MutexLock lock(&mu_);
    keys_.erase(key);
  };
  if (options_.restart_count > 0) {
    uint64_t resume = 0;
    absl::Status found = RejoinKey(key, value.size(), &resume);
    if (found.ok()) {
      {
        absl::MutexLock lock(&mu_);
        keys_[key].next_seq = resume;
        // Before the first push all keys resume together (SettleResumeLocked);
        // a key declared after that keeps its own count.
        if (resume_ != Resume::kSettled) resume_ = Resume::kPending;
      }
      TESSERA_VLOG(1) << "key " << key << ": the servers took " << resume
                      << " push(es) of this rank before the restart";
      // The others may wait for this rank in this key's init barrier (it died
      // before reaching it); the scheduler joins it only then.
      return node_->JoinBarrierIfOpen(kGroupWorkers, InitBarrier(key));
    }
    if (!absl::IsNotFound(found)) {
      forget();
      return found;
    }
    // Not (wholly) on the servers: this worker died while the job was still
    // initialising; do what a first life does.
  }
  absl::Status stored = absl::OkStatus();
  if (rank() == 0) {
    const uint64_t op = tracker_->NewOp();
    for (size_t i = 0; i < parts.size(); ++i) {
      const KeyPart& part = parts[i];
      Message msg = SliceMessage(wire::KV_INIT, key, part, value.size());
      msg.header.mutable_kv_options()->set_sync_mode(sync_);
      AddFloatFrame(&msg, Buffer::CopyOf(value.data() + part.offset,
                                         part.length * sizeof(float)));
      SendPart(op, part, std::move(msg), nullptr, {key, i, true});
    }
    stored = tracker_->Wait(op, absl::StrCat("init of key ", key));
  }
  absl::Status barrier = node_->Barrier(kGroupWorkers, InitBarrier(key));
  if (!stored.ok()) {
    forget();
    return stored;
  }
  return barrier;
}

uint64_t KVClient::ResumeRound() {
  absl::MutexLock lock(&mu_);
  SettleResumeLocked();
  return resume_round_;
}

void KVClient::SettleResumeLocked() {
  if (resume_ != Resume::kPending) return;
  resume_ = Resume::kSettled;
  uint64_t resume = UINT64_MAX;
  for (const auto& [key, info] : keys_) resume = std::min(resume, info.next_seq);
  if (keys_.empty()) resume = 0;
  for (auto& [key, info] : keys_) info.next_seq = resume;
  resume_round_ = resume;
  TESSERA_LOG(INFO) << "restarted (TESSERA_RESTART_COUNT="
                    << options_.restart_count << "): resuming at round "
                    << resume;
}

absl::Status KVClient::RejoinKey(uint64_t key, uint64_t total,
                                 uint64_t* resume) {
  const uint64_t op = tracker_->NewOp();
  for (const KeyPart& part : Parts(key)) {
    Message msg = SliceMessage(wire::KV_INIT, key, part, total);
    msg.header.set_rejoin(true);
    SendPart(op, part, std::move(msg), nullptr);
  }
  return tracker_->Wait(op, absl::StrCat("rejoin of key ", key), resume);
}

absl::StatusOr<OpHandle> KVClient::SendPush(wire::Command cmd, uint64_t key,
                                            size_t len, float* out,
                                            const PayloadFn& payload) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, len, "push"));
  const std::vector<KeyPart> parts = Parts(key);
  const uint64_t op = tracker_->NewOp();
  std::vector<Buffer> payloads;
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<Buffer> made = payload(op, i, parts[i]);
    if (!made.ok()) {
      payloads.clear();  // unpins what was borrowed
      tracker_->FailOp(op, made.status());
      (void)tracker_->Wait(op, "push");
      return made.status();
    }
    payloads.push_back(*std::move(made));
  }
  bool two_bit;
  uint64_t seq;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    SettleResumeLocked();
    seq = keys_[key].next_seq++;
    ++stats_.pushes;
    for (const Buffer& b : payloads) stats_.bytes_pushed += b.size();
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    Message msg = SliceMessage(cmd, key, part, len);
    msg.header.set_push_seq(seq);
    if (two_bit) {
      AddTwoBitFrame(&msg, std::move(payloads[i]), part.length);
    } else {
      AddFloatFrame(&msg, std::move(payloads[i]));
    }
    SendPart(op, part, std::move(msg), out == nullptr ? nullptr : out + part.offset,
             {key, i, true});
  }
  return op;
}

KVClient::PayloadFn KVClient::HostPayload(uint64_t key,
                                          absl::Span<const float> grad) {
  return [this, key, grad](uint64_t op, size_t,
                           const KeyPart& part) -> absl::StatusOr<Buffer> {
    bool two_bit;
    float threshold;
    float* residual;
    {
      absl::MutexLock lock(&mu_);
      two_bit = two_bit_;
      threshold = threshold_;
      residual = keys_[key].residual.data();
    }
    if (!two_bit) {
      // Zero-copy: the frame borrows the caller's memory and pins the op.
      return Buffer::Wrap(grad.data() + part.offset,
                          part.length * sizeof(float), tracker_->Pin(op));
    }
    Buffer packed =
        Buffer::Allocate(compression::TwoBitCompressedBytes(part.length));
    TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
        grad.data() + part.offset, residual + part.offset, part.length,
        threshold, packed.mutable_data()));
    return packed;
  };
}

absl::StatusOr<OpHandle> KVClient::PushAsync(uint64_t key,
                                             absl::Span<const float> grad) {
  return SendPush(wire::KV_PUSH, key, grad.size(), nullptr,
                  HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushPullAsync(uint64_t key,
                                                 absl::Span<const float> grad,
                                                 absl::Span<float> out) {
  if (out.size() != grad.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pushpull of key ", key, ": gradient has ", grad.size(),
                     " values but output has ", out.size()));
  }
  return SendPush(wire::KV_PUSHPULL, key, grad.size(), out.data(),
                  HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushDeviceAsync(uint64_t key,
                                                   const float* device_grad,
                                                   size_t len,
                                                   void* cuda_stream) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, len, "push"));
  bool two_bit;
  float threshold;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    threshold = threshold_;
  }
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<Buffer> staged,
      device_.Stage(key, device_grad, len, Parts(key), two_bit, threshold,
                    cuda_stream));
  return SendPush(wire::KV_PUSH, key, len, nullptr,
                  [&staged](uint64_t, size_t i, const KeyPart&) {
                    return absl::StatusOr<Buffer>(std::move(staged[i]));
                  });
}

absl::StatusOr<OpHandle> KVClient::PullAsync(uint64_t key,
                                             absl::Span<float> out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, out.size(), "pull"));
  const uint64_t op = tracker_->NewOp();
  const std::vector<KeyPart> parts = Parts(key);
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    SendPart(op, part, SliceMessage(wire::KV_PULL, key, part, out.size()),
             out.data() + part.offset, {key, i, true});
  }
  absl::MutexLock lock(&mu_);
  ++stats_.pulls;
  return op;
}

absl::Status KVClient::Wait(OpHandle handle) {
  return tracker_->Wait(handle, "operation");
}

absl::Status KVClient::Barrier() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  return node_->Barrier(kGroupWorkers);
}

absl::Status KVClient::Close() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  closed_ = true;
  absl::Status barrier = node_->Barrier(kGroupWorkers, "close");
  if (barrier.ok()) {
    // Tells each server this worker is done with it; one that heard it from
    // every worker ends without failure should the scheduler then vanish.
    Message bye;
    bye.header.set_command(wire::KV_FINISH);
    absl::Status said = Broadcast(bye, "goodbye to the servers");
    if (!said.ok()) TESSERA_LOG(WARNING) << said.message();
  }
  absl::Status done = barrier.ok() ? node_->Finish() : barrier;
  node_->Stop();
  return done;
}

KVWorkerStats KVClient::stats() const {
  KVWorkerStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
  }
  s.bytes_pulled = tracker_->bytes_pulled();
  s.resends = tracker_->resends();
  return s;
}

void KVClient::ReplayTo(int server) {
  if (!IsServerId(server)) return;
  std::vector<ReplayLog::Entry> replay = replay_log_.For(RankOfId(server));
  tracker_->ResendNowTo(server);
  TESSERA_LOG(INFO) << node_->Describe(server) << " restarted; replaying "
                    << replay.size() << " message(s) to it";
  for (ReplayLog::Entry& e : replay)
    SendPart(0, e.part, std::move(e.msg), nullptr, e.ref, /*replayed=*/true);
}

}  // namespace tessera

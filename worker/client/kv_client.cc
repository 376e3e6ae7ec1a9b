#include "worker/client/kv_client.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/trace.h"
#include "worker/client/kv_client_internal.h"
#include "worker/client/pulled_value_rep.h"

namespace tessera {
using client_internal::PushWindow;

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
      partitioner_(options.num_servers, options.bigarray_bound),
      routes_(options.num_servers, options.chain_length(),
              options.single_copy) {}

KVClient::~KVClient() {
  metric_handles_.clear();
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
      [this](int to, Message msg) {
        Prioritise(&msg);
        return node_->Send(to, std::move(msg));
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
      },
      // Where each request goes: replies come only from there.
      [this](int server, Message* msg) { return routes_.Route(server, msg); });
  Node::Callbacks callbacks;
  callbacks.on_data = [this](Message&& msg) {
    tracker_->HandleReply(std::move(msg));
  };
  callbacks.on_failure = [this](const absl::Status& status) {
    tracker_->FailAll(status);
  };
  callbacks.on_peer_restart = [this](int peer) { ReplayTo(peer); };
  callbacks.on_peer_dead = [this](int peer) { FailOver(peer); };
  callbacks.on_server_change = [this](int peer) {
    if (IsServerId(peer)) ServersChanged();
  };
  callbacks.on_receiver_free = [this] { tracker_->ReceiverFree(); };
  TESSERA_ASSIGN_OR_RETURN(
      node_, Node::Start(options_, std::move(callbacks), std::move(transport)));
  live_node_.store(node_.get(), std::memory_order_release);
  TESSERA_RETURN_IF_ERROR(JoinLocalGroup());
  // Server states that changed while Start ran (its callbacks saw no node).
  ServersChanged();
  node_->StartDelivery();
  MetricsRegistry& r = MetricsRegistry::Global();
  auto counter = [&](const char* name, const char* help,
                     uint64_t KVWorkerStats::*field) {
    metric_handles_.push_back(r.AddCollector(
        name, help, MetricType::kCounter, [this, field](MetricSamples* out) {
          absl::MutexLock lock(&mu_);
          out->push_back({{}, static_cast<double>(stats_.*field)});
        }));
  };
  counter("tessera_worker_pushes_total",
          "Pushes issued (push, pushpull, push_rows; one per key and call).",
          &KVWorkerStats::pushes);
  counter("tessera_worker_pulls_total",
          "Pulls issued (pull, pull_rows; one per key and call).",
          &KVWorkerStats::pulls);
  counter("tessera_worker_pushed_bytes_total",
          "Payload bytes of pushes (after 2-bit compression).",
          &KVWorkerStats::bytes_pushed);
  counter("tessera_worker_group_saved_bytes_total",
          "Payload bytes this worker did not push or pull itself because its "
          "local group carried them (TESSERA_LOCAL_GROUP=1): what it would "
          "have sent and received without the group, less what it did.",
          &KVWorkerStats::group_bytes_saved);
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_pulled_bytes_total",
      "Payload bytes of pull replies as received (compressed pulls: the "
      "2-bit frames).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(tracker_->bytes_pulled())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_pulled_float32_bytes_total",
      "What the pulls stand for as float32 values (pulled bytes without "
      "compression).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back(
            {{}, static_cast<double>(tracker_->bytes_pulled_float32())});
      }));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<wire::KVStats>> KVClient::ServerStats() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  std::vector<wire::KVStats> stats(options_.num_servers);
  const uint64_t op = tracker_->NewOp();
  const std::vector<bool> dead = node_->dead_servers();
  for (int s = 0; s < options_.num_servers; ++s) {
    if (dead[s]) continue;  // failed over: its stats went with it
    Message msg;
    msg.header.set_command(wire::KV_STATS);
    RequestTracker::Request request;
    request.op = op;
    request.server = ServerId(s);
    wire::KVStats* out = &stats[s];
    request.on_reply = [out](const Message& reply) {
      *out = reply.header.kv_stats();
      return absl::OkStatus();
    };
    tracker_->Send(request, std::move(msg));
  }
  TESSERA_RETURN_IF_ERROR(tracker_->Wait(op, "KV_STATS"));
  return stats;
}

absl::Status KVClient::CheckOpen() const {
  if (closed_) return absl::FailedPreconditionError("the KV store is closed");
  return node_->failure();
}

bool KVClient::HaveKeys() const {
  absl::MutexLock lock(&mu_);
  return !keys_.empty();
}

absl::StatusOr<KVClient::KeyInfo*> KVClient::KeyInfoLocked(uint64_t key,
                                                           const char* what) {
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    return absl::NotFoundError(
        absl::StrCat(what, " of key ", key,
                     ": the key is gone (its init failed on another thread)"));
  }
  return &it->second;
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
  if (it->second.row_length != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " of key ", key,
        ": the key is row-sparse (init_rows): use push_rows / pull_rows"));
  }
  if (it->second.length != len) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of key ", key, " with ", len,
                     " values; the key has ", it->second.length));
  }
  return absl::OkStatus();
}

Message KVClient::SliceMessage(wire::Command cmd, uint64_t key,
                               const KeyPart& part, uint64_t total,
                               uint64_t row_length) {
  Message msg;
  msg.header.set_command(cmd);
  wire::KeySlice* slice = msg.header.mutable_slice();
  slice->set_key(key);
  slice->set_offset(part.offset);
  slice->set_length(part.length);
  slice->set_total_length(total);
  slice->set_row_length(row_length);
  return msg;
}

void KVClient::SendPart(uint64_t op, const KeyPart& part, Message msg,
                        float* out, RequestTracker::PartRef ref, bool replayed,
                        int window) {
  RequestTracker::Request request;
  request.op = op;
  request.server = ServerId(part.server_rank);
  request.out = out;
  request.length = part.length;
  request.part = ref;
  request.replayed = replayed;
  request.rejoin = msg.header.rejoin();
  request.window = window;
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

absl::Status KVClient::SetPullCompression(const std::string& type) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (type != "2bit" && type != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "pull compression type '", type, "': expected 2bit or none"));
  }
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "pull compression must be set before the first init");
  }
  absl::MutexLock lock(&mu_);
  pull_two_bit_ = type == "2bit";
  return absl::OkStatus();
}

absl::StatusOr<OpHandle> KVClient::SendPush(wire::Command cmd, uint64_t key,
                                            float* out,
                                            const PayloadFn& payload,
                                            const std::vector<bool>& owned,
                                            const std::vector<int>& mates) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  // A worker joining an elastic job enters the rounds before its first push.
  TESSERA_RETURN_IF_ERROR(EnterRounds());
  std::vector<KeyPart> parts;
  uint64_t total = 0, row_length = 0;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(const KeyInfo* found, KeyInfoLocked(key, "push"));
    const KeyInfo& info = *found;
    TESSERA_RETURN_IF_ERROR(info.out_of_step);
    parts = info.parts;
    row_length = info.row_length;
    total = row_length == 0 ? info.length : info.length / row_length;
  }
  const uint64_t op = tracker_->NewOp();
  std::vector<Message> bodies;
  auto mine = [&owned](size_t i) { return owned.empty() || owned[i]; };
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!mine(i)) {
      bodies.emplace_back();
      continue;
    }
    absl::StatusOr<Message> made = payload(op, i, parts[i]);
    if (!made.ok()) {
      bodies.clear();  // unpins what was borrowed
      tracker_->FailOp(op, made.status());
      (void)tracker_->Wait(op, "push");
      return made.status();
    }
    bodies.push_back(*std::move(made));
  }
  bool windowed;
  uint64_t seq;
  {
    absl::MutexLock lock(&mu_);
    windowed = keys_[key].windowed;
    SettleResumeLocked();
    seq = keys_[key].next_seq++;
    push_ops_[op] = {key, seq};
    ++stats_.pushes;
    for (const Message& b : bodies)
      for (const Buffer& d : b.data) stats_.bytes_pushed += d.size();
  }
  std::map<int, int> windows;  // by server rank; none: not windowed
  if (row_length != 0) {
    windows = RowPushWindows(parts, bodies);
  } else if (windowed) {
    for (const KeyPart& part : parts)
      windows[part.server_rank] = PushWindow(options_);
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!mine(i)) continue;
    const KeyPart& part = parts[i];
    Message msg = std::move(bodies[i]);
    *msg.header.mutable_slice() =
        SliceMessage(cmd, key, part, total, row_length).header.slice();
    msg.header.set_command(cmd);
    msg.header.set_push_seq(seq);
    for (int mate : mates) msg.header.add_group_ranks(mate);
    auto window = windows.find(part.server_rank);
    SendPart(op, part, std::move(msg),
             out == nullptr ? nullptr : out + part.offset, {key, i, true},
             /*replayed=*/false, window == windows.end() ? 0 : window->second);
  }
  return op;
}

KVClient::PayloadFn KVClient::HostPayload(uint64_t key,
                                          absl::Span<const float> grad) {
  return [this, key, grad](uint64_t op, size_t,
                           const KeyPart& part) -> absl::StatusOr<Message> {
    bool two_bit;
    float threshold;
    float* residual;
    {
      absl::MutexLock lock(&mu_);
      two_bit = two_bit_;
      threshold = threshold_;
      residual = keys_[key].residual.data();
    }
    Message body;
    if (!two_bit) {
      // Zero-copy: the frame borrows the caller's memory and pins the op.
      AddFloatFrame(
          &body, Buffer::Wrap(grad.data() + part.offset,
                              part.length * sizeof(float), tracker_->Pin(op)));
      return body;
    }
    trace::Span span("kv", "compress");
    span.Arg("key", static_cast<int64_t>(key));
    span.Arg("values", static_cast<int64_t>(part.length));
    Buffer packed =
        Buffer::Allocate(compression::TwoBitCompressedBytes(part.length));
    TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
        grad.data() + part.offset, residual + part.offset, part.length,
        threshold, packed.mutable_data()));
    AddTwoBitFrame(&body, std::move(packed), part.length);
    return body;
  };
}

absl::StatusOr<OpHandle> KVClient::PushAsync(uint64_t key,
                                             absl::Span<const float> grad) {
  TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "push"));
  if (grouped()) return GroupPush(wire::KV_PUSH, key, grad, nullptr);
  return SendPush(wire::KV_PUSH, key, nullptr, HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushPullAsync(uint64_t key,
                                                 absl::Span<const float> grad,
                                                 absl::Span<float> out) {
  if (out.size() != grad.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pushpull of key ", key, ": gradient has ", grad.size(),
                     " values but output has ", out.size()));
  }
  TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "pushpull"));
  if (grouped()) return GroupPush(wire::KV_PUSHPULL, key, grad, out.data());
  return SendPush(wire::KV_PUSHPULL, key, out.data(), HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushDeviceAsync(uint64_t key,
                                                   const float* device_grad,
                                                   size_t len,
                                                   void* cuda_stream) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, len, "push"));
  if (grouped()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push of key ", key,
        " from GPU memory: a worker in a local group (TESSERA_LOCAL_GROUP=1) "
        "pushes from host memory only so far; set TESSERA_LOCAL_GROUP=0"));
  }
  bool two_bit;
  float threshold;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    threshold = threshold_;
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Buffer> staged,
                           device_.Stage(key, device_grad, len, Parts(key),
                                         two_bit, threshold, cuda_stream));
  return SendPush(wire::KV_PUSH, key, nullptr,
                  [&staged, two_bit](uint64_t, size_t i, const KeyPart& part) {
                    Message body;
                    if (two_bit) {
                      AddTwoBitFrame(&body, std::move(staged[i]), part.length);
                    } else {
                      AddFloatFrame(&body, std::move(staged[i]));
                    }
                    return absl::StatusOr<Message>(std::move(body));
                  });
}

absl::StatusOr<OpHandle> KVClient::StartPull(uint64_t key, uint64_t length,
                                             const PlainReplyFn& plain,
                                             const CopiedFn& copied,
                                             const PrepareFn& prepare,
                                             const std::vector<bool>& owned) {
  std::vector<KeyPart> parts;
  std::vector<std::shared_ptr<PulledCopy>> copies;
  uint64_t pushed;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(const KeyInfo* info, KeyInfoLocked(key, "pull"));
    TESSERA_RETURN_IF_ERROR(info->out_of_step);
    parts = info->parts;
    copies = info->pulled;
    pushed = info->next_seq;
    ++stats_.pulls;
  }
  const uint64_t op = tracker_->NewOp();
  if (prepare) prepare(parts);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!owned.empty() && !owned[i]) continue;
    const KeyPart& part = parts[i];
    Message msg = SliceMessage(wire::KV_PULL, key, part, length);
    msg.header.set_push_seq(pushed);  // sees this worker's pushes
    RequestTracker::Request request;
    request.op = op;
    request.server = ServerId(part.server_rank);
    request.length = part.length;
    request.part = {key, i, true};
    if (copies.empty()) {
      plain(i, part, &request);
    } else {
      // Compressed: the reply brings this worker's copy forward, which then
      // goes where the caller wants it.
      std::shared_ptr<PulledCopy> copy = copies[i];
      msg.header.set_pull_compressed(true);
      msg.header.set_pull_chain(copy->chain());
      msg.header.set_pull_version(copy->version());
      request.on_reply = [copy, copied, i, part](const Message& reply) {
        absl::Status applied = copy->Apply(reply);
        if (applied.ok()) copied(i, part, *copy);
        return applied;
      };
    }
    tracker_->Send(request, std::move(msg));
  }
  return op;
}

absl::StatusOr<OpHandle> KVClient::PullAsync(uint64_t key,
                                             absl::Span<float> out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, out.size(), "pull"));
  float* base = out.data();
  PlainReplyFn plain = [base](size_t, const KeyPart& part,
                              RequestTracker::Request* request) {
    request->out = base + part.offset;  // copied there in Wait
  };
  CopiedFn copied = [base](size_t, const KeyPart& part,
                           const PulledCopy& copy) {
    copy.CopyTo(base + part.offset);
  };
  if (grouped()) return GroupPull(key, base, out.size(), plain, copied);
  return StartPull(key, out.size(), plain, copied);
}

absl::StatusOr<OpHandle> KVClient::PullViewAsync(uint64_t key,
                                                 PulledValue* out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull_view of key ", key, ": no PulledValue to fill"));
  }
  uint64_t length = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = keys_.find(key);
    if (it != keys_.end()) length = it->second.length;
  }
  TESSERA_RETURN_IF_ERROR(CheckKey(key, length, "pull_view"));
  auto rep = std::make_shared<PulledValue::Rep>();
  rep->length = length;
  if (grouped()) {
    // One part, the group's: this member's parts arrive in it, the others'
    // come from the group in Wait.
    Buffer values = Buffer::Allocate(length * sizeof(float));
    float* base = values.mutable_floats();
    rep->offsets = {0};
    rep->lengths = {length};
    rep->frames = {std::move(values)};
    absl::StatusOr<OpHandle> op = GroupPull(
        key, base, length,
        [base](size_t, const KeyPart& part, RequestTracker::Request* request) {
          request->out = base + part.offset;
        },
        [base](size_t, const KeyPart& part, const PulledCopy& copy) {
          copy.CopyTo(base + part.offset);
        });
    if (op.ok()) out->rep_ = std::move(rep);
    return op;
  }
  absl::StatusOr<OpHandle> op = StartPull(
      key, length,
      [rep](size_t i, const KeyPart& part, RequestTracker::Request* request) {
        // The reply's frame itself becomes the part: no copy.
        request->on_reply = [rep, i, n = part.length](const Message& reply) {
          if (reply.data.size() != 1 || reply.header.frames_size() != 1 ||
              reply.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
              reply.header.frames(0).num_values() != n ||
              reply.data[0].size() != n * sizeof(float)) {
            return absl::DataLossError(
                absl::StrCat("reply from node ", reply.header.sender(),
                             " does not carry ", n, " float values"));
          }
          rep->frames[i] = reply.data[0];
          return absl::OkStatus();
        };
      },
      [rep](size_t i, const KeyPart& part, const PulledCopy& copy) {
        Buffer values = Buffer::Allocate(part.length * sizeof(float));
        copy.CopyTo(values.mutable_floats());
        rep->frames[i] = std::move(values);
      },
      [&rep](const std::vector<KeyPart>& parts) {
        // Before any request goes: the replies fill frames[i].
        for (const KeyPart& part : parts) {
          rep->offsets.push_back(part.offset);
          rep->lengths.push_back(part.length);
        }
        rep->frames.resize(parts.size());
      });
  if (!op.ok()) return op.status();
  out->rep_ = std::move(rep);
  return op;
}

absl::Status KVClient::Wait(OpHandle handle) {
  absl::Status status = tracker_->Wait(handle, "operation");
  if (grouped()) status = FinishGroupPull(handle, std::move(status));
  absl::MutexLock lock(&mu_);
  auto push = push_ops_.find(handle);
  if (push == push_ops_.end()) return status;
  const auto [key, seq] = push->second;
  push_ops_.erase(push);
  // A server refused a push before taking its number (Header.push_untaken:
  // a malformed payload, too much of this worker waiting on the key, ...):
  // the servers' count of this worker's pushes stays behind. A refusal after
  // the number was taken leaves the key as it is.
  if (!PushUntaken(status)) return status;
  status.ErasePayload(kPushUntakenPayload);
  if (keys_[key].out_of_step.ok()) {
    keys_[key].out_of_step = absl::FailedPreconditionError(absl::StrCat(
        "key ", key, ": push ", seq, " of this worker was refused (",
        status.message(),
        "); its later pushes and pulls of the key would wait for it for ever"));
  }
  return status;
}

absl::Status KVClient::Barrier() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  return node_->Barrier(kGroupWorkers);
}

absl::Status KVClient::Close() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  closed_ = true;
  if (options_.elastic()) {
    // An elastic job's workers need not push the same number of rounds (one
    // that joined later trains later): the goodbye goes first, so that the
    // servers' rounds go on without this worker while it waits in the
    // barrier for the others.
    Message bye;
    bye.header.set_command(wire::KV_FINISH);
    absl::Status said = Broadcast(bye, "goodbye to the servers");
    if (!said.ok()) TESSERA_LOG(WARNING) << said.message();
  }
  absl::Status barrier = node_->Barrier(kGroupWorkers, "close");
  if (barrier.ok() && !options_.elastic()) {
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

absl::Status KVClient::Leave() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (!options_.elastic()) {
    return absl::FailedPreconditionError(
        "Leave: the job is not elastic (TESSERA_ELASTIC is unset); a worker "
        "that stops early ends the job");
  }
  closed_ = true;
  absl::Status left = node_->Leave();
  node_->Stop();
  if (left.ok()) {
    TESSERA_LOG(INFO) << "left the job (TESSERA_ELASTIC): the rounds go on "
                         "without this worker";
  }
  return left;
}

KVWorkerStats KVClient::stats() const {
  KVWorkerStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
  }
  s.bytes_pulled = tracker_->bytes_pulled();
  s.bytes_pulled_float32 = tracker_->bytes_pulled_float32();
  s.resends = tracker_->resends();
  return s;
}

}  // namespace tessera

#include "server/kv_server.h"

#include <cstring>
#include <deque>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/logging.h"

namespace tessera {

struct KVServer::KeyState {
  uint64_t key = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t total_length = 0;
  bool sync = true;
  Buffer weights;
  std::vector<std::vector<float>> optimizer_state;
  uint64_t steps = 0;
  // The current dist_sync round: one decoded gradient per worker rank.
  std::vector<Buffer> round;
  std::vector<wire::Header> round_requests;
  int round_count = 0;
  // Messages that must wait for the current round (a worker's next push, or its
  // pull after a push of this round), in arrival order.
  std::deque<Message> backlog;
  bool round_completed = false;  // the backlog may have work to replay
};

struct KVServer::Shard {
  explicit Shard(size_t capacity) : queue(capacity) {}
  BoundedQueue<Message> queue;
  // Messages queued for the shard's thread and not yet processed. Only Handle's
  // thread adds to it, so when it reads 0 the update thread is idle in Pop and
  // the keys may be handled on Handle's thread (release/acquire hands them
  // over).
  std::atomic<int64_t> pending{0};
  std::map<uint64_t, KeyState> keys;  // owned by the shard's thread, or by
                                      // Handle's thread while pending == 0
};

namespace {

// Messages up to this many data bytes are processed on Handle's thread when
// their shard is idle.
constexpr size_t kInlineBytes = 64 << 10;

void ToWire(const absl::Status& s, wire::WireStatus* out) {
  out->set_code(static_cast<int>(s.code()));
  out->set_message(std::string(s.message()));
}

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

}  // namespace

KVServer::KVServer(int num_workers, int num_threads, SendFn send)
    : num_workers_(num_workers), send_(std::move(send)) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i)
    shards_.push_back(std::make_unique<Shard>(4096));
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, shard = shards_[i].get()] { Run(shard); });
  }
}

KVServer::~KVServer() { Stop(); }

void KVServer::Stop() {
  if (stopped_.exchange(true)) return;
  for (auto& shard : shards_) shard->queue.Close();
  for (std::thread& t : threads_) t.join();
}

wire::KVStats KVServer::stats() const {
  wire::KVStats s;
  s.set_pushes_applied(pushes_applied_.load());
  s.set_rounds_applied(rounds_applied_.load());
  s.set_malformed_messages(malformed_.load());
  s.set_errors_returned(errors_.load());
  return s;
}

KVServer::Settings KVServer::settings() const {
  absl::MutexLock lock(&settings_mu_);
  return settings_;
}

void KVServer::Reply(const Message& request, const absl::Status& status,
                     Buffer values) {
  Message reply;
  reply.header.set_command(request.header.command());
  reply.header.set_request_id(request.header.request_id());
  reply.header.set_is_response(true);
  if (request.header.has_slice())
    *reply.header.mutable_slice() = request.header.slice();
  if (!status.ok()) {
    ToWire(status, reply.header.mutable_status());
    ++errors_;
    TESSERA_VLOG(1) << "error reply to node " << request.header.sender() << ": "
                    << status.message();
  }
  if (request.header.command() == wire::KV_STATS)
    *reply.header.mutable_kv_stats() = stats();
  if (!values.empty()) AddFloatFrame(&reply, std::move(values));
  absl::Status sent = send_(request.header.sender(), std::move(reply));
  if (!sent.ok()) {
    TESSERA_LOG(WARNING) << "reply to node " << request.header.sender() << ": "
                         << sent.message();
  }
}

void KVServer::Handle(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.is_response()) {
    ++malformed_;
    TESSERA_LOG(WARNING) << "dropped unexpected reply " << DebugString(msg);
    return;
  }
  if (!IsWorkerId(h.sender()) || RankOfId(h.sender()) >= num_workers_) {
    ++malformed_;
    TESSERA_LOG(WARNING) << "dropped message from non-worker node "
                         << h.sender() << ": " << DebugString(msg);
    return;
  }
  switch (h.command()) {
    case wire::KV_SET_OPTIMIZER:
    case wire::KV_SET_COMPRESSION:
    case wire::KV_STATS:
      HandleSettings(std::move(msg));
      return;
    case wire::KV_INIT:
    case wire::KV_PUSH:
    case wire::KV_PULL:
    case wire::KV_PUSHPULL:
      break;
    default:
      ++malformed_;
      TESSERA_LOG(WARNING) << "dropped unexpected message " << DebugString(msg);
      return;
  }
  if (!h.has_slice()) {
    ++malformed_;
    Reply(msg, absl::DataLossError("key-value message without a key slice"));
    return;
  }
  if (h.command() == wire::KV_INIT) num_keys_.fetch_add(1);
  Shard* shard = shards_[Mix(h.slice().key()) % shards_.size()].get();
  // An idle shard's cheap message is processed here: the hand-off to the update
  // thread (a wake-up, tens of microseconds on a loaded machine) would cost
  // more than the work. The key's messages stay in arrival order: nothing of
  // this shard is queued or being processed.
  if (shard->pending.load(std::memory_order_acquire) == 0 && !stopped_.load() &&
      ProcessInline(msg)) {
    Process(shard, std::move(msg));
    return;
  }
  shard->pending.fetch_add(1, std::memory_order_relaxed);
  if (!shard->queue.Push(std::move(msg)))
    shard->pending.fetch_sub(1, std::memory_order_relaxed);
}

bool KVServer::ProcessInline(const Message& msg) const {
  // Cheap: a pull (its reply shares the weights), a small message, or a float32
  // push that needs no arithmetic (one worker, no optimizer: the pushed frame
  // becomes the weights). Anything else runs on the update threads, in
  // parallel.
  const wire::Command cmd = msg.header.command();
  if (cmd == wire::KV_PULL) return true;
  size_t bytes = 0;
  for (const Buffer& b : msg.data) bytes += b.size();
  if (bytes <= kInlineBytes) return true;
  if (cmd != wire::KV_PUSH && cmd != wire::KV_PUSHPULL) return false;
  if (num_workers_ != 1 || msg.header.frames_size() != 1 ||
      msg.header.frames(0).encoding() != wire::DataFrame::FLOAT32) {
    return false;
  }
  absl::MutexLock lock(&settings_mu_);
  return settings_.optimizer == nullptr;
}

void KVServer::HandleSettings(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.command() == wire::KV_STATS) {
    Reply(msg, absl::OkStatus());
    return;
  }
  absl::Status status;
  {
    absl::MutexLock lock(&settings_mu_);
    const bool keys_exist = num_keys_.load() > 0;
    if (h.command() == wire::KV_SET_OPTIMIZER) {
      absl::StatusOr<std::unique_ptr<Optimizer>> opt =
          Optimizer::Create(h.kv_options().optimizer_spec());
      if (!opt.ok()) {
        status = opt.status();
      } else {
        const std::string spec = *opt ? (*opt)->spec() : "none";
        if (spec != settings_.optimizer_spec) {
          if (keys_exist) {
            status = absl::FailedPreconditionError(absl::StrCat(
                "the optimizer must be set before keys are initialised (server "
                "has '",
                settings_.optimizer_spec, "', asked for '", spec, "')"));
          } else {
            settings_.optimizer =
                std::shared_ptr<const Optimizer>(std::move(*opt));
            settings_.optimizer_spec = spec;
            TESSERA_VLOG(1) << "optimizer: " << spec;
          }
        }
      }
    } else {
      const std::string& type = h.kv_options().compression_type();
      const float t = h.kv_options().compression_threshold();
      if (type != "2bit" && type != "none") {
        status = absl::InvalidArgumentError(
            absl::StrCat("unknown gradient compression '", type,
                         "': expected 2bit or none"));
      } else if (type == "2bit" && !(t > 0 && std::isfinite(t))) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "2-bit compression threshold ", t, ": expected a number > 0"));
      } else if (type != settings_.compression ||
                 (type == "2bit" && t != settings_.threshold)) {
        if (keys_exist) {
          status = absl::FailedPreconditionError(
              "gradient compression must be set before keys are initialised");
        } else {
          settings_.compression = type;
          settings_.threshold = type == "2bit" ? t : 0;
          TESSERA_VLOG(1) << "gradient compression: " << type << " threshold "
                          << t;
        }
      }
    }
  }
  Reply(msg, status);
}

void KVServer::Run(Shard* shard) {
  while (std::optional<Message> msg = shard->queue.Pop()) {
    Process(shard, *std::move(msg));
    shard->pending.fetch_sub(1, std::memory_order_release);
  }
}

absl::StatusOr<Buffer> KVServer::DecodeGradient(const Message& msg,
                                                const KeyState& key,
                                                const Settings& settings) {
  if (msg.data.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("push of key ", key.key,
                                                   " carries ", msg.data.size(),
                                                   " data frames; expected 1"));
  }
  const wire::DataFrame& desc = msg.header.frames(0);
  if (desc.num_values() != key.length) {
    return absl::InvalidArgumentError(
        absl::StrCat("push of key ", key.key, " has ", desc.num_values(),
                     " values; the key has ", key.length, " here"));
  }
  if (desc.encoding() == wire::DataFrame::FLOAT32) return msg.data[0];
  if (desc.encoding() != wire::DataFrame::TWO_BIT) {
    return absl::InvalidArgumentError("push payload must be float32 or 2-bit");
  }
  if (settings.compression != "2bit") {
    return absl::InvalidArgumentError(
        "2-bit payload but gradient compression is not set on this server");
  }
  Buffer decoded = Buffer::Allocate(key.length * sizeof(float));
  absl::Status s = compression::TwoBitDequantize(
      msg.data[0].data(), msg.data[0].size(), key.length, settings.threshold,
      decoded.mutable_floats());
  if (!s.ok()) {
    ++malformed_;
    return s;
  }
  return decoded;
}

void KVServer::Process(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (msg.header.command() == wire::KV_INIT) {
    if (shard->keys.count(slice.key()) != 0) {
      Reply(msg, absl::AlreadyExistsError(absl::StrCat(
                     "key ", slice.key(), " is already initialised")));
      return;
    }
    if (msg.data.size() != 1 ||
        msg.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
        slice.length() == 0 ||
        msg.header.frames(0).num_values() != slice.length() ||
        slice.offset() + slice.length() > slice.total_length() ||
        slice.offset() + slice.length() < slice.offset()) {
      Reply(msg,
            absl::InvalidArgumentError(absl::StrCat(
                "init of key ", slice.key(), ": malformed slice or value")));
      return;
    }
    KeyState& key = shard->keys[slice.key()];
    key.key = slice.key();
    key.offset = slice.offset();
    key.length = slice.length();
    key.total_length = slice.total_length();
    key.sync = msg.header.kv_options().sync_mode();
    key.weights = Buffer::CopyOf(msg.data[0].data(), msg.data[0].size());
    key.round.resize(num_workers_);
    Reply(msg, absl::OkStatus());
    return;
  }
  auto it = shard->keys.find(slice.key());
  if (it == shard->keys.end()) {
    Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                " was never initialised")));
    return;
  }
  KeyState& key = it->second;
  if (slice.offset() != key.offset || slice.length() != key.length ||
      slice.total_length() != key.total_length) {
    Reply(msg, absl::InvalidArgumentError(absl::StrCat(
                   "key ", slice.key(), ": request for elements [",
                   slice.offset(), ", +", slice.length(), ") of ",
                   slice.total_length(), " but this server holds [", key.offset,
                   ", +", key.length, ") of ", key.total_length)));
    return;
  }
  // Keep each worker's messages in order behind its waiting ones.
  bool sender_waiting = false;
  for (const Message& m : key.backlog)
    sender_waiting |= m.header.sender() == msg.header.sender();
  if (sender_waiting || !TryProcess(shard, &key, msg))
    key.backlog.push_back(std::move(msg));
  ReplayBacklog(shard, &key);
}

bool KVServer::TryProcess(Shard* shard, KeyState* key, Message& msg) {
  const int rank = RankOfId(msg.header.sender());
  const wire::Command cmd = msg.header.command();
  if (cmd == wire::KV_PULL) {
    if (key->sync && !key->round[rank].empty())
      return false;  // sees this round's result
    Reply(msg, absl::OkStatus(), key->weights);
    return true;
  }
  const Settings s = settings();
  if (key->sync && !key->round[rank].empty())
    return false;  // belongs to the next round
  absl::StatusOr<Buffer> grad = DecodeGradient(msg, *key, s);
  if (!grad.ok()) {
    Reply(msg, grad.status());
    return true;
  }
  if (!key->sync) {
    if (s.optimizer == nullptr) {
      Reply(msg,
            absl::FailedPreconditionError("dist_async needs an optimizer on "
                                          "the servers: call set_optimizer "
                                          "before pushing"));
      return true;
    }
    ApplyUpdate(*s.optimizer, key, grad->floats());
    ++pushes_applied_;
    Reply(msg, absl::OkStatus(),
          cmd == wire::KV_PUSHPULL ? key->weights : Buffer());
    return true;
  }
  key->round[rank] = *std::move(grad);
  key->round_requests.push_back(msg.header);
  ++key->round_count;
  ++pushes_applied_;
  if (key->round_count == num_workers_) CompleteRound(shard, key);
  return true;
}

void KVServer::ApplyUpdate(const Optimizer& optimizer, KeyState* key,
                           const float* grad) {
  // Copy on write: a pull reply may still be sending the current weights.
  if (!key->weights.unique())
    key->weights = Buffer::CopyOf(key->weights.data(), key->weights.size());
  const int slots = optimizer.state_slots();
  if (static_cast<int>(key->optimizer_state.size()) != slots) {
    key->optimizer_state.assign(slots, std::vector<float>(key->length, 0.0f));
  }
  std::vector<float*> state;
  for (auto& v : key->optimizer_state) state.push_back(v.data());
  optimizer.Update(key->weights.mutable_floats(), grad, key->length,
                   state.data(), ++key->steps);
}

void KVServer::CompleteRound(Shard* shard, KeyState* key) {
  const Settings s = settings();
  const size_t n = key->length;
  Buffer sum;
  if (num_workers_ == 1) {
    sum = std::move(key->round[0]);
  } else {
    sum = Buffer::Allocate(n * sizeof(float));
    float* out = sum.mutable_floats();
    std::memcpy(out, key->round[0].data(), n * sizeof(float));
    for (int r = 1; r < num_workers_; ++r) {
      const float* g = key->round[r].floats();
      for (size_t i = 0; i < n; ++i) out[i] += g[i];
    }
  }
  if (s.optimizer == nullptr) {
    key->weights =
        std::move(sum);  // the store becomes the round's sum (all-reduce)
  } else {
    ApplyUpdate(*s.optimizer, key, sum.floats());
  }
  ++rounds_applied_;
  for (Buffer& b : key->round) b = Buffer();
  key->round_count = 0;
  std::vector<wire::Header> requests;
  requests.swap(key->round_requests);
  for (const wire::Header& h : requests) {
    Message request;
    request.header = h;
    Reply(request, absl::OkStatus(),
          h.command() == wire::KV_PUSHPULL ? key->weights : Buffer());
  }
  key->round_completed = true;
}

void KVServer::ReplayBacklog(Shard* shard, KeyState* key) {
  // Replay what waited for a finished round, in order; a worker's later
  // messages stay behind the first of its messages that must wait again.
  // Replaying can finish another round, which calls for another pass.
  while (key->round_completed) {
    key->round_completed = false;
    std::deque<Message> waiting;
    waiting.swap(key->backlog);
    std::set<int> blocked;
    while (!waiting.empty()) {
      Message m = std::move(waiting.front());
      waiting.pop_front();
      const int sender = m.header.sender();
      if (blocked.count(sender) != 0 || !TryProcess(shard, key, m)) {
        blocked.insert(sender);
        key->backlog.push_back(std::move(m));
      }
    }
  }
}

}  // namespace tessera

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
  // Per worker rank: pushes accepted (the next expected push_seq), and how
  // many of them the last written checkpoint holds.
  std::vector<uint64_t> received;
  std::vector<uint64_t> durable;
  // Messages that must wait: a worker's next push or its pull after a push of
  // the current round, or a push that came before an earlier one of the same
  // worker (resent after a loss). In arrival order.
  std::deque<Message> backlog;
  bool progress = false;  // the backlog may have work to replay
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
  // A recovering server's messages for keys not created yet (by the replayed
  // init), by key, in arrival order.
  std::map<uint64_t, std::deque<Message>> orphans;
};

namespace {

// OK when `slice` names exactly the part of its key this server holds
// ([offset, +length) of total); otherwise the error to answer with.
absl::Status CheckSlice(const wire::KeySlice& slice, uint64_t offset,
                        uint64_t length, uint64_t total) {
  if (slice.offset() == offset && slice.length() == length &&
      slice.total_length() == total) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "key ", slice.key(), ": request for elements [", slice.offset(), ", +",
      slice.length(), ") of ", slice.total_length(), " but this server holds [",
      offset, ", +", length, ") of ", total));
}

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
  s.set_duplicates(duplicates_.load());
  s.set_checkpoints_written(checkpoints_.load());
  absl::MutexLock lock(&key_counts_mu_);
  for (const auto& [key, n] : key_pushes_)
    (*s.mutable_key_pushes_applied())[key] = n;
  return s;
}

KVServer::Settings KVServer::settings() const {
  absl::MutexLock lock(&settings_mu_);
  return settings_;
}

void KVServer::Acknowledge(const Message& request) {
  Message ack;
  ack.header.set_command(request.header.command());
  ack.header.set_request_id(request.header.request_id());
  ack.header.set_is_response(true);
  ack.header.set_ack_only(true);
  (void)send_(request.header.sender(), std::move(ack));
}

void KVServer::Reply(const Message& request, const absl::Status& status,
                     Buffer values, const KeyState* key) {
  Message reply;
  reply.header.set_command(request.header.command());
  reply.header.set_request_id(request.header.request_id());
  reply.header.set_is_response(true);
  reply.header.set_push_seq(request.header.push_seq());
  if (request.header.has_slice())
    *reply.header.mutable_slice() = request.header.slice();
  if (key != nullptr && checkpointing_.load()) {
    reply.header.set_checkpointing(true);
    reply.header.set_durable_seq(
        key->durable[RankOfId(request.header.sender())]);
  }
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
    case wire::KV_FINISH: {
      const bool first = finished_workers_.insert(RankOfId(h.sender())).second;
      Reply(msg, absl::OkStatus());
      if (first &&
          static_cast<int>(finished_workers_.size()) == num_workers_) {
        TESSERA_VLOG(1) << "every worker finished with this server";
        if (on_workers_finished_) on_workers_finished_();
      }
      return;
    }
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
  if (h.command() == wire::KV_INIT && !h.rejoin()) num_keys_.fetch_add(1);
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
  if (msg.header.command() == wire::KV_INIT && msg.header.rejoin()) {
    // A restarted worker asks where its pushes to this key resume.
    auto existing = shard->keys.find(slice.key());
    if (existing == shard->keys.end()) {
      Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                  " is not on this server")));
      return;
    }
    KeyState& key = existing->second;
    if (absl::Status same =
            CheckSlice(slice, key.offset, key.length, key.total_length);
        !same.ok()) {
      Reply(msg, same);
      return;
    }
    // What the earlier life left waiting here (a pull, a push behind a
    // missing one) is dropped: nobody waits for its reply, and the new life
    // pushes again from the count reported now.
    const size_t before = key.backlog.size();
    std::erase_if(key.backlog, [&](const Message& m) {
      return m.header.sender() == msg.header.sender() &&
             m.header.generation() < msg.header.generation();
    });
    msg.header.set_push_seq(key.received[RankOfId(msg.header.sender())]);
    Reply(msg, absl::OkStatus());
    if (key.backlog.size() != before) {
      TESSERA_VLOG(1) << "key " << slice.key() << ": dropped "
                      << before - key.backlog.size()
                      << " waiting message(s) of node " << msg.header.sender()
                      << "'s earlier life";
      key.progress = true;  // what waited behind them may go now
      ReplayBacklog(shard, &key);
    }
    return;
  }
  if (msg.header.command() == wire::KV_INIT) {
    auto existing = shard->keys.find(slice.key());
    if (existing != shard->keys.end()) {
      const KeyState& key = existing->second;
      if (CheckSlice(slice, key.offset, key.length, key.total_length).ok()) {
        // A resent init, or one replayed to a server restored from a
        // checkpoint: the key is there; its value is not touched.
        ++duplicates_;
        Reply(msg, absl::OkStatus(), Buffer(), &key);
      } else {
        Reply(msg,
              absl::AlreadyExistsError(absl::StrCat(
                  "key ", slice.key(), " is already initialised with [",
                  key.offset, ", +", key.length, ") of ", key.total_length)));
      }
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
    KeyState* key =
        CreateKey(shard, slice, msg.header.kv_options().sync_mode());
    key->weights = Buffer::CopyOf(msg.data[0].data(), msg.data[0].size());
    // With the key: a checkpointing server's reply tells the worker to keep
    // the init for a replay.
    Reply(msg, absl::OkStatus(), Buffer(), key);
    // Messages a recovering server held for this key go next, in order.
    auto orphans = shard->orphans.find(slice.key());
    if (orphans != shard->orphans.end()) {
      for (Message& m : orphans->second) key->backlog.push_back(std::move(m));
      shard->orphans.erase(orphans);
      key->progress = true;
      ReplayBacklog(shard, key);
    }
    return;
  }
  auto it = shard->keys.find(slice.key());
  if (it == shard->keys.end()) {
    if (recovering_.load()) {
      // Restarted: the worker replaying this may be ahead of the init that
      // recreates the key. Hold it (once per request) and say so.
      std::deque<Message>& held = shard->orphans[slice.key()];
      bool duplicate = false;
      for (const Message& m : held) {
        duplicate |= m.header.sender() == msg.header.sender() &&
                     m.header.request_id() == msg.header.request_id();
      }
      Acknowledge(msg);
      if (!duplicate) held.push_back(std::move(msg));
      return;
    }
    Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                " was never initialised")));
    return;
  }
  KeyState& key = it->second;
  if (absl::Status same =
          CheckSlice(slice, key.offset, key.length, key.total_length);
      !same.ok()) {
    Reply(msg, same);
    return;
  }
  // Keep each worker's messages in order behind its waiting ones; a resent
  // copy of a waiting message is acknowledged, not queued twice.
  bool sender_waiting = false;
  for (const Message& m : key.backlog) {
    if (m.header.sender() != msg.header.sender()) continue;
    sender_waiting = true;
    if (m.header.request_id() == msg.header.request_id() &&
        m.header.generation() == msg.header.generation()) {
      ++duplicates_;
      Acknowledge(msg);
      return;
    }
  }
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
  // Exactly once: the worker numbers its pushes to this key.
  const uint64_t seq = msg.header.push_seq();
  const uint64_t next = key->received[rank];
  if (seq < next) {
    ++duplicates_;
    if (key->sync && seq + 1 == next && !key->round[rank].empty()) {
      // In the current round; answered when it completes. The newest copy is
      // the one answered: a restarted worker's repeat of its earlier life's
      // push carries a request id the old one did not.
      for (wire::Header& h : key->round_requests) {
        if (h.sender() == msg.header.sender()) h = msg.header;
      }
      Acknowledge(msg);
    } else {
      Reply(msg, absl::OkStatus(),
            cmd == wire::KV_PUSHPULL ? key->weights : Buffer(), key);
    }
    return true;
  }
  if (seq > next) return false;  // an earlier push of this worker is missing
  if (key->sync && !key->round[rank].empty())
    return false;  // belongs to the next round
  // From here the push is taken: even a rejected one uses up its number, so
  // the worker's next push is not held waiting for it.
  key->received[rank] = next + 1;
  key->progress = true;
  const Settings s = settings();
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
    ++async_applied_;
    CountKeyPush(key->key);
    Reply(msg, absl::OkStatus(),
          cmd == wire::KV_PUSHPULL ? key->weights : Buffer(), key);
    return true;
  }
  key->round[rank] = *std::move(grad);
  key->round_requests.push_back(msg.header);
  ++key->round_count;
  ++pushes_applied_;
  CountKeyPush(key->key);
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
          h.command() == wire::KV_PUSHPULL ? key->weights : Buffer(), key);
  }
  key->progress = true;
}

void KVServer::CountKeyPush(uint64_t key) {
  absl::MutexLock lock(&key_counts_mu_);
  ++key_pushes_[key];
}

KVServer::KeyState* KVServer::CreateKey(Shard* shard,
                                        const wire::KeySlice& slice,
                                        bool sync) {
  KeyState& key = shard->keys[slice.key()];
  key.key = slice.key();
  key.offset = slice.offset();
  key.length = slice.length();
  key.total_length = slice.total_length();
  key.sync = sync;
  key.round.resize(num_workers_);
  key.received.assign(num_workers_, 0);
  key.durable.assign(num_workers_, 0);
  return &key;
}

void KVServer::ReplayBacklog(Shard* shard, KeyState* key) {
  // Replay what waited for a finished round, in order; a worker's later
  // messages stay behind the first of its messages that must wait again.
  // Replaying can finish another round, which calls for another pass.
  while (key->progress) {
    key->progress = false;
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

namespace tessera {

void KVServer::WaitIdle() {
  for (auto& shard : shards_) {
    while (shard->pending.load(std::memory_order_acquire) != 0)
      absl::SleepFor(absl::Microseconds(50));
  }
}

wire::ServerCheckpoint KVServer::Snapshot() {
  WaitIdle();
  wire::ServerCheckpoint saved;
  const Settings s = settings();
  saved.set_optimizer_spec(s.optimizer_spec);
  saved.set_compression_type(s.compression);
  saved.set_compression_threshold(s.threshold);
  saved.set_rounds_applied(updates_applied());
  for (auto& shard : shards_) {
    for (const auto& [id, key] : shard->keys) {
      wire::CheckpointKey* out = saved.add_keys();
      out->set_key(key.key);
      out->set_offset(key.offset);
      out->set_length(key.length);
      out->set_total_length(key.total_length);
      out->set_sync_mode(key.sync);
      out->set_weights(key.weights.data(), key.weights.size());
      for (const std::vector<float>& slot : key.optimizer_state)
        out->add_optimizer_state(slot.data(), slot.size() * sizeof(float));
      out->set_steps(key.steps);
      // A push in the unfinished round is not in the weights: the worker
      // sends it again after a restore.
      for (int r = 0; r < num_workers_; ++r) {
        out->add_received(key.received[r] -
                          (key.sync && !key.round[r].empty() ? 1 : 0));
      }
    }
  }
  return saved;
}

void KVServer::MarkDurable(const wire::ServerCheckpoint& saved) {
  WaitIdle();
  for (const wire::CheckpointKey& k : saved.keys()) {
    Shard* shard = shards_[Mix(k.key()) % shards_.size()].get();
    auto it = shard->keys.find(k.key());
    if (it == shard->keys.end()) continue;
    for (int r = 0; r < num_workers_ && r < k.received_size(); ++r)
      it->second.durable[r] = k.received(r);
  }
  ++checkpoints_;
}

absl::Status KVServer::Restore(const wire::ServerCheckpoint& saved) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(saved.optimizer_spec());
  if (!opt.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint names optimizer '",
                                            saved.optimizer_spec(),
                                            "': ", opt.status().message()));
  }
  {
    absl::MutexLock lock(&settings_mu_);
    settings_.optimizer = std::shared_ptr<const Optimizer>(std::move(*opt));
    settings_.optimizer_spec =
        settings_.optimizer ? settings_.optimizer->spec() : "none";
    settings_.compression =
        saved.compression_type().empty() ? "none" : saved.compression_type();
    settings_.threshold = saved.compression_threshold();
  }
  for (const wire::CheckpointKey& k : saved.keys()) {
    if (k.weights().size() != k.length() * sizeof(float) ||
        k.received_size() != num_workers_) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint of key ", k.key(),
          " does not match: ", k.weights().size(), " weight bytes for ",
          k.length(), " values, ", k.received_size(), " worker counts for ",
          num_workers_, " workers (was the job's DMLC_NUM_WORKER changed?)"));
    }
    wire::KeySlice slice;
    slice.set_key(k.key());
    slice.set_offset(k.offset());
    slice.set_length(k.length());
    slice.set_total_length(k.total_length());
    Shard* shard = shards_[Mix(k.key()) % shards_.size()].get();
    KeyState* key = CreateKey(shard, slice, k.sync_mode());
    key->weights = Buffer::CopyOf(k.weights().data(), k.weights().size());
    for (const std::string& slot : k.optimizer_state()) {
      std::vector<float> v(k.length());
      if (slot.size() != v.size() * sizeof(float)) {
        return absl::DataLossError(
            absl::StrCat("checkpoint of key ", k.key(), ": optimizer state of ",
                         slot.size(), " bytes for ", k.length(), " values"));
      }
      std::memcpy(v.data(), slot.data(), slot.size());
      key->optimizer_state.push_back(std::move(v));
    }
    key->steps = k.steps();
    for (int r = 0; r < num_workers_; ++r)
      key->received[r] = key->durable[r] = k.received(r);
    num_keys_.fetch_add(1);
    absl::MutexLock lock(&key_counts_mu_);
    uint64_t total = 0;
    for (uint64_t n : k.received()) total += n;
    key_pushes_[k.key()] = total;
  }
  recovering_.store(true);
  return absl::OkStatus();
}

void KVServer::set_recovering() { recovering_.store(true); }

}  // namespace tessera

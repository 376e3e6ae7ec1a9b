#include "server/kv_server.h"

#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/bounded_queue.h"
#include "common/hashed_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/trace.h"
#include "common/wire_status.h"
#include "server/key_store.h"
#include "server/pull_shadow.h"

namespace tessera {
namespace {

// Messages up to this many data bytes are processed on Handle's thread when
// their shard is idle.
constexpr size_t kInlineBytes = 64 << 10;

// Updates from a slice's primary up to this many data bytes are applied on
// Handle's thread when their shard is idle.
constexpr size_t kInlineReplicaBytes = 4 << 20;

// What an update thread's queue holds at most: messages and their bytes.
constexpr size_t kShardQueueMessages = 4096;
constexpr uint64_t kShardQueueBytes = uint64_t{128} << 20;

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

uint64_t DataBytes(const Message& msg) {
  uint64_t bytes = 0;
  for (const Buffer& b : msg.data) bytes += b.size();
  return bytes;
}

}  // namespace

// One update thread's work: messages of its keys, and tasks (checkpoint
// snapshots, durable marks) that must run between them.
struct KVServer::Shard {
  Shard(int num_workers, WaitingLimits limits, SyncRound::Mode sum_mode)
      : queue(kShardQueueMessages, kShardQueueBytes),
        phase_since_ns(absl::GetCurrentTimeNanos()),
        store(num_workers, limits, sum_mode) {}
  struct Work {
    Message msg;
    std::function<void(Shard*)> task;  // set: run it instead
  };
  BoundedQueue<Work> queue;
  // Work queued for the shard's thread and not yet done. Only Handle's thread
  // adds to it, so when it reads 0 the update thread is idle in Pop and the
  // keys may be handled on Handle's thread (release/acquire hands them over).
  std::atomic<int64_t> pending{0};
  // What the update thread does (for /debug/pending): the command of the
  // message it handles (0 idle, -1 a task), its key, and since when.
  std::atomic<int> phase{0};
  std::atomic<uint64_t> phase_key{0};
  std::atomic<int64_t> phase_since_ns;
  KeyStore store;  // owned by the shard's thread, or by Handle's thread while
                   // pending == 0
  // Replication, owned as `store` is: the node table's server states.
  std::vector<ServerState> states;
  // A hand-back in progress (HandBack): the slices that stop, and the job
  // (null once this shard's part is done, or none runs).
  std::vector<StoredKey*> yielding;
  std::shared_ptr<HandbackJob> handback;
  int handback_rank = -1;       // the rank taking its place back; -1: none
  bool handback_leave = false;  // one copy: the rank leaves instead
  // One copy: slices this shard gave to a server that joined and dropped;
  // a request for one that still comes here is dropped (the worker sends
  // it again to the new server once its table says so).
  std::set<std::pair<uint64_t, uint64_t>> moved_away;
};

struct KVServer::HandbackJob {
  uint64_t epoch = 0;
  std::function<void(uint64_t)> ready;
  absl::Mutex mu;
  size_t remaining ABSL_GUARDED_BY(mu) = 0;  // shards not done yet
};

namespace {

// Elastic jobs: what a worker out of the job is told.
absl::Status NotInJob(int rank) {
  return absl::FailedPreconditionError(
      absl::StrCat("worker ", rank,
                   " is not in the job (TESSERA_ELASTIC: it left, or has not "
                   "joined); the rounds go on without it"));
}

}  // namespace

KVServer::KVServer(int num_workers, int num_threads, SendFn send,
                   WaitingLimits limits, SyncRound::Mode sum_mode,
                   RoundWatch::Options watch)
    : num_workers_(num_workers),
      send_(std::move(send)),
      limits_(limits),
      chain_rng_(std::random_device()() ^
                 static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))),
      round_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_round_duration_seconds",
          "dist_sync: from a round's first push to its completion (every "
          "worker's push summed and the update applied), per key.",
          DurationBuckets())),
      update_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_update_duration_seconds",
          "Time to apply one update to a key slice (the optimizer, or the "
          "round's sum becoming the value).",
          LatencyBuckets())),
      watch_(num_workers, watch) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i)
    shards_.push_back(std::make_unique<Shard>(num_workers, limits, sum_mode));
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, i, shard = shards_[i].get()] {
      trace::SetThreadName(absl::StrCat("update ", i));
      Run(shard);
    });
  }
  MetricsRegistry& r = MetricsRegistry::Global();
  auto counter = [&](const char* name, const char* help,
                     const std::atomic<uint64_t>* value) {
    metric_handles_.push_back(r.AddCollector(
        name, help, MetricType::kCounter, [value](MetricSamples* out) {
          out->push_back({{}, static_cast<double>(value->load())});
        }));
  };
  // The counts of KV_STATS (stats()), read from the same counters.
  counter("tessera_server_pushes_applied_total",
          "Pushes applied (once per key and push, however many slices; "
          "KV_STATS pushes_applied).",
          &pushes_applied_);
  counter("tessera_server_rounds_applied_total",
          "dist_sync rounds completed and applied, one per key and round "
          "(KV_STATS rounds_applied).",
          &rounds_applied_);
  counter("tessera_server_async_updates_total",
          "dist_async pushes applied as updates, one per key and push.",
          &async_applied_);
  counter("tessera_server_duplicates_total",
          "Repeated requests (resent, replayed) answered without being "
          "applied again (KV_STATS duplicates).",
          &duplicates_);
  counter("tessera_server_errors_returned_total",
          "Requests answered with an error (KV_STATS errors_returned).",
          &errors_);
  counter("tessera_server_refused_requests_total",
          "Requests refused with RESOURCE_EXHAUSTED: too much waiting on a "
          "key (KV_STATS refused).",
          &refused_);
  counter("tessera_server_malformed_messages_total",
          "Malformed key-value messages dropped or answered with an error "
          "(KV_STATS malformed_messages; the transport's are "
          "tessera_transport_malformed_messages_total).",
          &malformed_);
  counter("tessera_server_failed_replies_total",
          "Replies the transport would not take (a worker gone, its queue "
          "full past the send time-out).",
          &failed_replies_);
  counter("tessera_server_replica_updates_total",
          "Updates applied as a backup of a slice (KV_REPLICATE; "
          "TESSERA_REPLICAS > 1; KV_STATS replica_updates).",
          &replica_updates_);
  counter("tessera_server_promoted_slices_total",
          "Slices this server took over from a dead primary (KV_STATS "
          "promoted_slices; a hand-back's slices taken back count too).",
          &promoted_);
  counter("tessera_server_handed_back_slices_total",
          "Slices this server stopped answering for at a hand-back: a "
          "replacement that caught up took back its place in their chains.",
          &slices_handed_back_);
  counter("tessera_server_moved_away_slices_total",
          "One copy (TESSERA_MAX_SERVERS without replicas): slices this "
          "server gave to a server that joined and then dropped (KV_STATS "
          "moved_away_slices).",
          &moved_away_);
  counter("tessera_server_replica_resends_total",
          "Updates sent again to a backup that had not answered them.",
          &replica_resends_);
  counter("tessera_server_checkpoints_written_total",
          "Checkpoints written and made durable (KV_STATS "
          "checkpoints_written).",
          &checkpoints_);
  metric_handles_.push_back(r.AddCollector(
      "tessera_server_keys", "Keys initialised on this server.",
      MetricType::kGauge, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(num_keys_.load())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_server_update_queue_messages",
      "Messages and tasks queued for the update threads, not yet taken.",
      MetricType::kGauge, [this](MetricSamples* out) {
        size_t queued = 0;
        for (const auto& shard : shards_) queued += shard->queue.size();
        out->push_back({{}, static_cast<double>(queued)});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_server_update_threads", "Update threads of this server.",
      MetricType::kGauge, [n = shards_.size()](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(n)});
      }));
  pending_section_ = DebugPendingRegistry::Global().Add(
      [this](wire::DebugPending* out) { FillPending(out); });
}

const KeyMetrics* KVServer::SeriesFor(uint64_t key) {
  absl::MutexLock lock(&key_counts_mu_);
  auto it = key_series_.find(key);
  if (it != key_series_.end()) return it->second.get();
  auto make = [](const std::string& label) {
    MetricsRegistry& r = MetricsRegistry::Global();
    const MetricLabels labels = {{"key", label}};
    auto m = std::make_unique<KeyMetrics>();
    m->pushes = r.GetCounter(
        "tessera_server_key_pushes_applied_total",
        "Pushes applied, by key (the first 32 keys of this server; the "
        "others under key=\"other\"; KV_STATS key_pushes_applied).",
        labels);
    m->pulls = r.GetCounter(
        "tessera_server_key_pulls_total",
        "Pulls answered, by key (the first 32 keys of this server; the others "
        "under key=\"other\").",
        labels);
    m->rounds = r.GetCounter(
        "tessera_server_key_rounds_applied_total",
        "dist_sync rounds applied, by key (the first 32 keys of this server; "
        "the others under key=\"other\").",
        labels);
    return m;
  };
  if (key_series_.size() >= kMaxKeySeries) {
    if (other_keys_ == nullptr) {
      static KeyMetrics* other = make("other").release();
      other_keys_ = other;
    }
    return other_keys_;
  }
  return (key_series_[key] = make(absl::StrCat(key))).get();
}

const KeyMetrics& KVServer::MetricsOf(StoredKey* key) {
  if (key->metrics == nullptr) key->metrics = SeriesFor(key->key);
  return *key->metrics;
}

void KVServer::TimedUpdate(const StoredKey& key,
                           const std::function<void()>& update) {
  const absl::Time start = absl::Now();
  update();
  const absl::Time end = absl::Now();
  update_duration_->ObserveDuration(end - start);
  trace::Complete("server", "update", absl::ToUnixNanos(start),
                  absl::ToUnixNanos(end),
                  {{"key", static_cast<int64_t>(key.key)},
                   {"values", static_cast<int64_t>(key.length)}});
}

void KVServer::TraceRound(const StoredKey& key, absl::Time update_start,
                          absl::Time update_end, int last_rank) {
  if (!trace::Enabled()) return;
  const int64_t end = absl::ToUnixNanos(update_end);
  trace::Complete("server", "update", absl::ToUnixNanos(update_start), end,
                  {{"key", static_cast<int64_t>(key.key)},
                   {"values", static_cast<int64_t>(key.length)}});
  trace::AsyncSpan("server", "round", trace::NewId(),
                   absl::ToUnixNanos(key.round_started), end,
                   {{"key", static_cast<int64_t>(key.key)},
                    {"offset", static_cast<int64_t>(key.offset)},
                    {"workers", num_workers_},
                    {"waited_for", last_rank}});
}

KVServer::~KVServer() { Stop(); }

void KVServer::Stop() {
  if (stopped_.exchange(true)) return;
  {
    absl::MutexLock lock(&catch_up_mu_);
    catch_up_cv_.SignalAll();
  }
  if (catch_up_thread_.joinable()) catch_up_thread_.join();
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
  s.set_refused(refused_.load());
  s.set_replica_updates(replica_updates_.load());
  s.set_promoted_slices(promoted_.load());
  s.set_moved_away_slices(moved_away_.load());
  absl::MutexLock lock(&key_counts_mu_);
  for (const auto& [key, n] : key_pushes_)
    (*s.mutable_key_pushes_applied())[key] = n;
  return s;
}

KVServer::Settings KVServer::settings() const {
  absl::MutexLock lock(&settings_mu_);
  return settings_;
}

KVServer::Shard* KVServer::ShardOf(uint64_t key) const {
  return shards_[Mix(key) % shards_.size()].get();
}

void KVServer::Acknowledge(const Message& request) {
  Message ack;
  ack.header.set_command(request.header.command());
  ack.header.set_request_id(request.header.request_id());
  ack.header.set_is_response(true);
  ack.header.set_ack_only(true);
  (void)send_(request.header.sender(), std::move(ack));
}

Message KVServer::NewReply(const Message& request, const absl::Status& status,
                           const StoredKey* key) {
  Message reply;
  reply.header.set_command(request.header.command());
  reply.header.set_request_id(request.header.request_id());
  reply.header.set_is_response(true);
  reply.header.set_push_seq(request.header.push_seq());
  if (request.header.has_slice())
    *reply.header.mutable_slice() = request.header.slice();
  if (request.header.rejoin()) {
    // Elastic joins: the entry asked, and where the slice's rounds are.
    reply.header.set_enter(request.header.enter());
    reply.header.set_enter_round(request.header.enter_round());
    reply.header.set_open_round(request.header.open_round());
    reply.header.set_joining(request.header.joining());
  }
  if (key != nullptr && checkpointing_.load()) {
    reply.header.set_checkpointing(true);
    reply.header.set_durable_seq(
        key->ledger.durable(RankOfId(request.header.sender())));
  }
  if (!status.ok()) {
    ToWire(status, reply.header.mutable_status());
    ++errors_;
    if (absl::IsResourceExhausted(status)) ++refused_;
    TESSERA_VLOG(1) << "error reply to node " << request.header.sender() << ": "
                    << status.message();
  }
  if (request.header.command() == wire::KV_STATS)
    *reply.header.mutable_kv_stats() = stats();
  return reply;
}

void KVServer::SendReply(const Message& request, Message reply) {
  absl::Status sent = send_(request.header.sender(), std::move(reply));
  if (!sent.ok()) {
    const uint64_t n = ++failed_replies_;
    if (LogOccurrence(n)) {
      TESSERA_LOG(WARNING) << "reply to node " << request.header.sender()
                           << " not sent (#" << n << "): " << sent.message();
    }
  }
}

void KVServer::DropMalformed(const std::string& what, const Message& msg) {
  const uint64_t n = ++malformed_;
  // Throttled on its own count: the drops counted without a warning (a
  // request without a slice, say) must not use up the logged ones.
  if (const uint64_t w = ++malformed_warnings_; LogOccurrence(w)) {
    TESSERA_LOG(WARNING) << "dropped " << what << " (malformed message #" << n
                         << ", warning #" << w
                         << "; logged: the first 20, then at powers of two): "
                         << DebugString(msg);
  }
}

void KVServer::Reply(const Message& request, const absl::Status& status,
                     Buffer values, const StoredKey* key) {
  Message reply = NewReply(request, status, key);
  if (!values.empty()) AddFloatFrame(&reply, std::move(values));
  SendReply(request, std::move(reply));
}

uint64_t KVServer::NewChain() {
  absl::MutexLock lock(&chain_mu_);
  uint64_t chain;
  do {
    chain = chain_rng_();
  } while (chain == 0);
  return chain;
}

void KVServer::Handle(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.command() == wire::KV_TRANSFER && replicas_ > 1 &&
      IsServerId(h.sender()) && RankOfId(h.sender()) < num_servers_ &&
      RankOfId(h.sender()) != rank_) {
    if (h.has_slice()) {
      Enqueue(ShardOf(h.slice().key()),
              std::move(msg));  // a slice, or its answer
    } else if (h.is_response()) {
      TransferCounted(RankOfId(h.sender()), h.transfer_total());
    } else {
      TransferRequested(RankOfId(h.sender()), h);
    }
    return;
  }
  if (h.command() == wire::KV_REPLICATE && replicas_ > 1 &&
      IsServerId(h.sender()) && RankOfId(h.sender()) < num_servers_ &&
      h.has_slice()) {
    // Between the servers of a chain: an update, or a backup's answer. An
    // update is applied on this thread when its shard is idle, up to
    // kInlineReplicaBytes: its primary's answers wait for it, so the hand-off
    // to the update thread would be on every round's path.
    Shard* shard = ShardOf(h.slice().key());
    if (shard->pending.load(std::memory_order_acquire) == 0 &&
        !stopped_.load() && DataBytes(msg) <= kInlineReplicaBytes) {
      ProcessMessage(shard, std::move(msg));
      return;
    }
    Enqueue(shard, std::move(msg));
    return;
  }
  if (h.is_response()) {
    DropMalformed("unexpected reply", msg);
    return;
  }
  if (!IsWorkerId(h.sender()) || RankOfId(h.sender()) >= num_workers_) {
    DropMalformed(absl::StrCat("message from non-worker node ", h.sender()),
                  msg);
    return;
  }
  if (!left_workers_.empty() &&
      left_workers_.count(RankOfId(h.sender())) != 0) {
    Reply(msg, NotInJob(RankOfId(h.sender())));
    return;
  }
  switch (h.command()) {
    case wire::KV_SET_OPTIMIZER:
    case wire::KV_SET_COMPRESSION:
    case wire::KV_STATS:
      HandleSettings(std::move(msg));
      return;
    case wire::KV_FINISH: {
      const int rank = RankOfId(h.sender());
      const bool first = finished_workers_.insert(rank).second;
      Reply(msg, absl::OkStatus());
      if (first && elastic_) LeaveRounds(rank);
      if (first) CheckWorkersFinished();
      return;
    }
    case wire::KV_INIT:
    case wire::KV_PUSH:
    case wire::KV_PULL:
    case wire::KV_PUSHPULL:
      break;
    default:
      DropMalformed("unexpected message", msg);
      return;
  }
  if (!h.has_slice()) {
    ++malformed_;
    Reply(msg, absl::DataLossError("key-value message without a key slice"));
    return;
  }
  if (h.command() == wire::KV_INIT && !h.rejoin()) num_keys_.fetch_add(1);
  Shard* shard = ShardOf(h.slice().key());
  // An idle shard's cheap message is processed here: the hand-off to the update
  // thread (a wake-up, tens of microseconds on a loaded machine) would cost
  // more than the work. The key's messages stay in arrival order: nothing of
  // this shard is queued or being processed.
  if (shard->pending.load(std::memory_order_acquire) == 0 && !stopped_.load() &&
      ProcessInline(msg)) {
    ProcessMessage(shard, std::move(msg));
    return;
  }
  Enqueue(shard, std::move(msg));
}

void KVServer::Enqueue(Shard* shard, Message&& msg) {
  const uint64_t bytes = DataBytes(msg);
  shard->pending.fetch_add(1, std::memory_order_relaxed);
  if (!shard->queue.Push(Shard::Work{std::move(msg), nullptr}, bytes))
    shard->pending.fetch_sub(1, std::memory_order_relaxed);
}

void KVServer::Post(Shard* shard, std::function<void(Shard*)> task) {
  shard->pending.fetch_add(1, std::memory_order_relaxed);
  if (!shard->queue.Push(Shard::Work{Message(), std::move(task)}))
    shard->pending.fetch_sub(1, std::memory_order_relaxed);
}

bool KVServer::ProcessInline(const Message& msg) const {
  // Cheap: a pull (its reply shares the weights), a small message, or a float32
  // push that needs no arithmetic (one worker, no optimizer: the pushed frame
  // becomes the weights). Anything else runs on the update threads, in
  // parallel.
  const wire::Command cmd = msg.header.command();
  if (cmd == wire::KV_PULL) return true;
  if (DataBytes(msg) <= kInlineBytes) return true;
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
  while (std::optional<Shard::Work> work = shard->queue.Pop()) {
    shard->phase_since_ns.store(absl::GetCurrentTimeNanos(),
                                std::memory_order_relaxed);
    if (work->task) {
      shard->phase.store(-1, std::memory_order_relaxed);
      work->task(shard);
    } else {
      shard->phase_key.store(work->msg.header.slice().key(),
                             std::memory_order_relaxed);
      shard->phase.store(work->msg.header.command(), std::memory_order_relaxed);
      ProcessMessage(shard, std::move(work->msg));
    }
    shard->phase.store(0, std::memory_order_relaxed);
    shard->phase_since_ns.store(absl::GetCurrentTimeNanos(),
                                std::memory_order_relaxed);
    shard->pending.fetch_sub(1, std::memory_order_release);
  }
}

void KVServer::FillPending(wire::DebugPending* out) const {
  const absl::Time now = absl::Now();
  watch_.Fill(out, now);
  for (size_t i = 0; i < shards_.size(); ++i) {
    const Shard& shard = *shards_[i];
    wire::ThreadPhase* t = out->add_threads();
    t->set_thread(absl::StrCat("update ", i));
    const int phase = shard.phase.load(std::memory_order_relaxed);
    if (phase == 0) {
      t->set_phase("idle");
    } else if (phase < 0) {
      t->set_phase("checkpoint");
    } else {
      t->set_phase(wire::Command_Name(static_cast<wire::Command>(phase)));
      t->set_key(shard.phase_key.load(std::memory_order_relaxed));
    }
    t->set_for_s(absl::ToDoubleSeconds(
        now - absl::FromUnixNanos(
                  shard.phase_since_ns.load(std::memory_order_relaxed))));
  }
}

void KVServer::ReportWaiting(StoredKey* key) {
  const size_t n = key->waiting.size();
  if (n == key->reported_waiting) return;
  key->reported_waiting = n;
  watch_.Waiting(key->key, key->offset, n);
}

void KVServer::Process(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (msg.header.command() == wire::KV_REPLICATE) {
    if (msg.header.is_response()) {
      ReplicaAnswered(shard, msg);
    } else {
      TakeReplica(shard, std::move(msg));
    }
    return;
  }
  if (msg.header.command() == wire::KV_TRANSFER) {
    if (msg.header.is_response()) {
      TransferAnswered(shard, msg);
    } else {
      TakeTransfer(shard, std::move(msg));
    }
    return;
  }
  if (msg.header.command() == wire::KV_INIT) {
    if (msg.header.rejoin()) {
      Rejoin(shard, std::move(msg));
    } else {
      Init(shard, std::move(msg));
    }
    return;
  }
  StoredKey* key = shard->store.Find(slice);
  if (key == nullptr) {
    if (shard->moved_away.count({slice.key(), slice.offset()}) != 0) {
      TESSERA_VLOG(1) << "dropped " << wire::Command_Name(msg.header.command())
                      << " of key " << slice.key() << " offset "
                      << slice.offset()
                      << ": the slice moved to another server";
      return;
    }
    if (recovering_.load()) {
      // Restarted: the worker replaying this may be ahead of the init that
      // recreates the key. Hold it (once per request) and say so.
      bool duplicate = false;
      absl::Status held = shard->store.HoldOrphan(slice, msg, &duplicate);
      if (held.ok()) {
        Acknowledge(msg);
      } else {
        Reply(msg, held);
      }
      return;
    }
    Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                " was never initialised")));
    return;
  }
  if (absl::Status same = key->CheckSlice(slice); !same.ok()) {
    Reply(msg, same);
    return;
  }
  // Keep each worker's messages in order behind its waiting ones; a resent
  // copy of a waiting message is acknowledged, not queued twice. A push
  // numbered at or below what the server expects from its worker goes first:
  // whatever of that worker waits came after it (a push that overtook it, and
  // what followed that).
  const int sender = msg.header.sender();
  if (key->waiting.Holds(sender, msg.header.request_id(),
                         msg.header.generation())) {
    ++duplicates_;
    Acknowledge(msg);
    if (!key->unacked.empty()) ResendUpdates(shard, key);
    return;
  }
  const bool is_push = msg.header.command() == wire::KV_PUSH ||
                       msg.header.command() == wire::KV_PUSHPULL;
  const bool in_order =
      is_push &&
      key->ledger.Classify(RankOfId(sender), msg.header.push_seq()) !=
          PushLedger::kAhead;
  if ((key->waiting.HasWaiting(sender) && !in_order) || !TryProcess(key, msg)) {
    Hold(key, std::move(msg));
  }
  Replay(key);
  // A worker asking again may be waiting for an update a backup has not
  // answered (lost with a connection): send it again, at most once per
  // PS_RESEND_TIMEOUT, doubling.
  if (!key->unacked.empty()) ResendUpdates(shard, key);
}

void KVServer::Init(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (StoredKey* key = shard->store.Find(slice); key != nullptr) {
    if (key->hashed() && !msg.header.rejoin() &&
        slice.hashed_spec() != key->hashed_spec) {
      // A hashed key made again with other options (rank 0's are the key's;
      // a restarted rank 0 must bring the same).
      Reply(msg, absl::AlreadyExistsError(absl::StrCat(
                     "hashed key ", slice.key(), " exists with options '",
                     key->hashed_spec, "', not '", slice.hashed_spec(), "'")));
      return;
    }
    if (key->CheckSlice(slice).ok()) {
      // A resent init, or one replayed to a server restored from a
      // checkpoint: the key is there; its value is not touched.
      ++duplicates_;
      Reply(msg, absl::OkStatus(), Buffer(), key);
    } else {
      Reply(msg,
            absl::AlreadyExistsError(absl::StrCat(
                "key ", slice.key(), " is already initialised with [",
                key->offset, ", +", key->length, ") of ", key->total_length)));
    }
    return;
  }
  if (absl::Status placed = CheckReplicaPlace(msg.header); !placed.ok()) {
    Reply(msg, placed);
    return;
  }
  if (single_copy_ && !TakesInit(*shard, msg.header)) {
    // One copy, and the slice is moving to another server: not made here
    // (this server may have reported its part, and the new one would never
    // get it). The worker sends the init again, and after the move it goes
    // there.
    TESSERA_VLOG(1) << "init of key " << slice.key() << " offset "
                    << slice.offset()
                    << " not taken: another server answers for the slice, or "
                       "will";
    return;
  }
  shard->moved_away.erase({slice.key(), slice.offset()});
  if (slice.row_length() != 0 && slice.length() == 0 &&
      slice.total_length() == 0) {
    // A hashed row key: no value; its rows come with its ids.
    absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(slice.hashed_spec());
    if (!spec.ok() || !msg.data.empty() ||
        slice.row_length() > (uint64_t{1} << 24)) {
      Reply(msg, absl::InvalidArgumentError(
                     absl::StrCat("init of hashed key ", slice.key(), ": ",
                                  spec.ok() ? "malformed slice or value"
                                            : spec.status().message())));
      return;
    }
    StoredKey* key =
        shard->store.Create(slice, msg.header.kv_options().sync_mode());
    key->weights = Buffer::Allocate(0);
    MakeReplicated(key, msg.header.replica());
    Reply(msg, absl::OkStatus(), Buffer(), key);
    OfferSlice(shard, key);
    shard->store.AdoptOrphans(key);
    Replay(key);
    return;
  }
  // A row-sparse key's init without a value means zeros.
  const uint64_t values =
      slice.length() * (slice.row_length() == 0 ? 1 : slice.row_length());
  const bool zeros = slice.row_length() != 0 && msg.data.empty();
  if ((!zeros && (msg.data.size() != 1 ||
                  msg.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
                  msg.header.frames(0).num_values() != values)) ||
      slice.length() == 0 ||
      (slice.row_length() != 0 &&
       (values / slice.row_length() != slice.length() ||
        values > (uint64_t{1} << 40) / sizeof(float))) ||
      slice.offset() + slice.length() > slice.total_length() ||
      slice.offset() + slice.length() < slice.offset()) {
    Reply(msg, absl::InvalidArgumentError(absl::StrCat(
                   "init of key ", slice.key(), ": malformed slice or value")));
    return;
  }
  Buffer zeroed;
  if (zeros) {
    // Nothing crossed the wire for it: the size is only the header's word.
    try {
      zeroed = Buffer::Allocate(values * sizeof(float));
    } catch (const std::bad_alloc&) {
      Reply(msg, absl::ResourceExhaustedError(absl::StrCat(
                     "init of key ", slice.key(), ": cannot allocate ",
                     values * sizeof(float), " bytes for its rows")));
      return;
    }
    std::memset(zeroed.mutable_data(), 0, zeroed.size());
  }
  StoredKey* key =
      shard->store.Create(slice, msg.header.kv_options().sync_mode());
  MakeReplicated(key, msg.header.replica());
  if (zeros) {
    key->weights = std::move(zeroed);
  } else {
    key->weights = Buffer::CopyOf(msg.data[0].data(), msg.data[0].size());
  }
  // With the key: a checkpointing server's reply tells the worker to keep the
  // init for a replay.
  Reply(msg, absl::OkStatus(), Buffer(), key);
  OfferSlice(shard, key);
  // Messages a recovering server held for this key go next, in order.
  shard->store.AdoptOrphans(key);
  Replay(key);
}

void KVServer::Rejoin(Shard* shard, Message&& msg) {
  // A restarted worker asks where its pushes to this key resume.
  const wire::KeySlice& slice = msg.header.slice();
  StoredKey* key = shard->store.Find(slice);
  if (key == nullptr) {
    Reply(msg, absl::NotFoundError(absl::StrCat("key ", slice.key(),
                                                " is not on this server")));
    return;
  }
  if (absl::Status same = key->CheckSlice(slice); !same.ok()) {
    Reply(msg, same);
    return;
  }
  const int rank = RankOfId(msg.header.sender());
  if (msg.header.enter()) {
    EnterRounds(key, std::move(msg));
    return;
  }
  // What the earlier life left waiting here (a pull, a push behind a missing
  // one) is dropped: nobody waits for its reply, and the new life pushes again
  // from the count reported now.
  const size_t dropped = key->waiting.DropEarlierLives(msg.header.sender(),
                                                       msg.header.generation());
  msg.header.set_push_seq(key->ledger.received(rank));
  // A worker joining an elastic job learns where the rounds are, to choose
  // the round it enters every slice at.
  msg.header.set_open_round(key->engine->RoundNumber());
  // dist_async slices too: a joiner reusing the rank of a worker that left
  // mid-push numbers its pushes from the largest count (its entry), or its
  // first push to a slice that counted more would be taken as a duplicate.
  msg.header.set_joining(key->engine->Joining(rank));
  Reply(msg, absl::OkStatus());
  if (dropped != 0) {
    TESSERA_VLOG(1) << "key " << slice.key() << ": dropped " << dropped
                    << " waiting message(s) of node " << msg.header.sender()
                    << "'s earlier life";
    key->progress = true;  // what waited behind them may go now
    Replay(key);
  }
}

void KVServer::EnterRounds(StoredKey* key, Message&& msg) {
  // A worker joining an elastic job enters the slice's rounds at the round it
  // names, the same in every slice (RoundMembers::EnterAt).
  const int rank = RankOfId(msg.header.sender());
  if (key->engine->Left(rank)) {
    Reply(msg, NotInJob(rank));
    return;
  }
  const bool joining = key->engine->Joining(rank);
  const bool taken =
      !key->sync || key->engine->EnterAt(rank, msg.header.enter_round());
  // Its pushes are numbered from push_seq here (the largest count of its rank
  // among the key's slices: a worker that left may have pushed to some
  // slices of a key and not others before it went).
  if (taken && joining && msg.header.push_seq() > key->ledger.received(rank))
    key->ledger.SetReceived(rank, msg.header.push_seq());
  // Refused: the reply's open round is past the round asked (the open round
  // itself when a push of the rank's earlier holder is in it).
  msg.header.set_open_round(taken ? key->engine->RoundNumber()
                                  : std::max(key->engine->RoundNumber(),
                                             msg.header.enter_round() + 1));
  msg.header.set_joining(key->engine->Joining(rank));
  TESSERA_VLOG(1) << "key " << key->key << " offset " << key->offset
                  << ": worker " << rank << " enters at round "
                  << msg.header.enter_round() << " (open round "
                  << key->engine->RoundNumber()
                  << "): " << (taken ? "taken" : "too late");
  Reply(msg, absl::OkStatus());
  // An earlier entry at the open round, moved later: the round may be
  // complete without it.
  if (key->sync && key->engine->RoundComplete()) CompleteRound(key, -1);
  key->progress = true;
  Replay(key);
}

void KVServer::Hold(StoredKey* key, Message&& msg) {
  absl::Status held = key->waiting.Hold(key->key, msg);
  if (!held.ok()) Reply(msg, held);
  ReportWaiting(key);
}

bool KVServer::TryProcess(StoredKey* key, Message& msg) {
  // A backup holds a worker's request until it answers for the slice (the
  // worker heard of the primary's death before this server did).
  if (key->replicated && !Active(*ShardOf(key->key), *key)) return false;
  // A hand-back: past its round boundary the slice takes no new push (the
  // server taking it back will); pulls are still answered, and so is a push
  // taken before the boundary that comes again (its answer was lost with a
  // connection). Held, that copy would keep its worker from its pushes to
  // the slices still waiting for their boundary, and the hand-back would
  // wait for them for ever (a one-copy leave under killed connections).
  if (key->yield == StoredKey::kYielded &&
      msg.header.command() != wire::KV_PULL) {
    const bool taken_before =
        (msg.header.command() == wire::KV_PUSH ||
         msg.header.command() == wire::KV_PUSHPULL) &&
        key->ledger.Classify(RankOfId(msg.header.sender()),
                             msg.header.push_seq()) == PushLedger::kDuplicate;
    if (!taken_before) return false;
  }
  if (key->engine->Left(RankOfId(msg.header.sender()))) {
    // Held before its worker left the job (elastic): not taken now.
    Reply(msg, NotInJob(RankOfId(msg.header.sender())));
    return true;
  }
  if (msg.header.command() == wire::KV_PULL) {
    const int rank = RankOfId(msg.header.sender());
    // Read your own pushes: a pull waits for the pushes its worker made before
    // it, however it overtook them (a resend reaching a restarted server
    // before the replay does).
    if (msg.header.push_seq() > key->ledger.received(rank)) return false;
    if (key->sync && key->engine->Contributed(rank))
      return false;  // sees this round's result
    if (CountsFor(*key)) MetricsOf(key).pulls->Increment();
    Message reply = NewReply(msg, absl::OkStatus(), key);
    if (absl::Status pulled = key->engine->Pull(msg, &reply, *this);
        !pulled.ok()) {
      Reply(msg, pulled);
    } else {
      SendReply(msg, std::move(reply));
    }
    return true;
  }
  return TryPush(key, msg);
}

bool KVServer::TryPush(StoredKey* key, Message& msg) {
  const int rank = RankOfId(msg.header.sender());
  const wire::Command cmd = msg.header.command();
  // Exactly once: the worker numbers its pushes to this key.
  const uint64_t seq = msg.header.push_seq();
  switch (key->ledger.Classify(rank, seq)) {
    case PushLedger::kDuplicate:
      ++duplicates_;
      if (JoinPendingUpdate(key, msg)) return true;
      if (key->sync && seq + 1 == key->ledger.received(rank) &&
          key->engine->Contributed(rank)) {
        // In the open round; answered when it completes. The newest copy is
        // the one answered: a restarted worker's repeat of its earlier life's
        // push carries a request id the old one did not.
        key->engine->ReplaceRequest(msg.header.sender(), msg.header);
        Acknowledge(msg);
      } else {
        Reply(msg, absl::OkStatus(),
              cmd == wire::KV_PUSHPULL ? key->weights : Buffer(), key);
      }
      return true;
    case PushLedger::kAhead:
      return false;  // an earlier push of this worker is missing
    case PushLedger::kNext:
      break;
  }
  if (key->sync && key->engine->Contributed(rank))
    return false;  // belongs to the next round
  // A joiner's push before the round it entered at waits for it; its first
  // push in the rounds makes it a member (one that announced no round enters
  // the round under way).
  if (key->sync && key->engine->Early(rank)) return false;
  if (key->sync) key->engine->Enter(rank);
  key->ledger.Take(rank);
  key->progress = true;
  if (key->sync && key->engine->RoundEmpty()) key->round_started = absl::Now();
  absl::StatusOr<SliceEngine::Pushed> pushed =
      key->engine->Push(msg, settings(), *this);
  if (!pushed.ok()) {
    Reply(msg, pushed.status());
    return true;
  }
  CountPush(*key);
  if (key->sync)
    watch_.PushTaken(key->key, key->offset, rank, key->round_started,
                     absl::Now(), CountsFor(*key));
  switch (*pushed) {
    case SliceEngine::Pushed::kApplied:
      if (CountsFor(*key)) ++async_applied_;
      if (key->replicated) {
        Replicate(key, {msg.header});
        break;
      }
      Reply(msg, absl::OkStatus(),
            key->engine->AnswersWithWeights(cmd) ? key->weights : Buffer(),
            key);
      break;
    case SliceEngine::Pushed::kAdded:
      // Held until the round completes, whose answer lets the worker's next
      // slice go: a worker is then at most its window of slices ahead of the
      // slowest, so a server holds accumulators only for that many slices of
      // a key, not for all of them (ExactSum::Release). An acknowledgement
      // on receipt let the fastest worker open every slice of a big key.
      break;
    case SliceEngine::Pushed::kRoundComplete:
      CompleteRound(key, rank);
      break;
  }
  return true;
}

void KVServer::CompleteRound(StoredKey* key, int last_rank) {
  SliceEngine::Round round = key->engine->FinishRound(settings());
  update_duration_->ObserveDuration(round.update_end - round.update_start);
  watch_.RoundDone(key->key, key->offset, key->round_started, round.update_end);
  TraceRound(*key, round.update_start, round.update_end, last_rank);
  // Like pushes, a round of a key counts once, on its first slice here.
  if (CountsFor(*key)) {
    ++rounds_applied_;
    MetricsOf(key).rounds->Increment();
    round_duration_->ObserveDuration(round.update_end - key->round_started);
  }
  if (key->replicated) {
    Replicate(key, std::move(round.requests));
  } else {
    for (const wire::Header& h : round.requests) {
      Message request;
      request.header = h;
      Reply(request, absl::OkStatus(),
            key->engine->AnswersWithWeights(h.command()) ? key->weights
                                                         : Buffer(),
            key);
    }
  }
  key->engine->AfterRound();
  key->progress = true;
  // A hand-back waited for this boundary: no later push is taken here.
  if (key->yield == StoredKey::kYielding) key->yield = StoredKey::kYielded;
}

void KVServer::Replay(StoredKey* key) {
  // Replay what waited for a finished round, in order; a worker's later
  // messages stay behind the first of its messages that must wait again.
  // Replaying can finish another round, which calls for another pass.
  while (key->progress) {
    key->progress = false;
    key->waiting.Replay([&](Message& m) { return TryProcess(key, m); });
  }
  ReportWaiting(key);
}

void KVServer::CountPush(StoredKey& key) {
  // A push comes in one slice per TESSERA_CHUNK_BYTES: it counts once.
  if (!CountsFor(key)) return;
  ++pushes_applied_;
  MetricsOf(&key).pushes->Increment();
  absl::MutexLock lock(&key_counts_mu_);
  ++key_pushes_[key.key];
}

void KVServer::Snapshot(std::function<void(wire::ServerCheckpoint)> done) {
  struct Job {
    absl::Mutex mu;
    wire::ServerCheckpoint saved ABSL_GUARDED_BY(mu);
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    std::function<void(wire::ServerCheckpoint)> done;
  };
  auto job = std::make_shared<Job>();
  job->done = std::move(done);
  {
    absl::MutexLock lock(&job->mu);
    const Settings s = settings();
    job->saved.set_optimizer_spec(s.optimizer_spec);
    job->saved.set_compression_type(s.compression);
    job->saved.set_compression_threshold(s.threshold);
    job->saved.set_rounds_applied(updates_applied());
    job->remaining = shards_.size();
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [job](Shard* shard) {
      absl::MutexLock lock(&job->mu);
      for (const auto& [id, key] : shard->store.keys())
        key->Snapshot(job->saved.add_keys());
      if (--job->remaining == 0) job->done(std::move(job->saved));
    });
  }
}

void KVServer::MarkDurable(
    std::shared_ptr<const wire::ServerCheckpoint> saved) {
  ++checkpoints_;
  for (auto& shard : shards_) {
    Post(shard.get(), [saved](Shard* shard) {
      for (const wire::CheckpointKey& k : saved->keys()) {
        StoredKey* key = shard->store.Find(k.key(), k.offset());
        if (key == nullptr) continue;
        for (int r = 0; r < key->ledger.num_workers() && r < k.received_size();
             ++r) {
          key->ledger.set_durable(r, k.received(r));
        }
      }
    });
  }
}

std::pair<std::vector<float>, uint64_t> KVServer::ShadowForTesting(
    uint64_t key, uint64_t offset) {
  absl::Notification done;
  std::pair<std::vector<float>, uint64_t> out;
  Post(ShardOf(key), [&](Shard* shard) {
    StoredKey* k = shard->store.Find(key, offset);
    const PullShadow* shadow =
        k == nullptr ? nullptr : k->engine->pull_shadow();
    if (shadow != nullptr) {
      const Buffer& s = shadow->shadow();
      out.first.assign(s.floats(), s.floats() + s.num_floats());
      out.second = shadow->version();
    }
    done.Notify();
  });
  done.WaitForNotification();
  return out;
}

absl::Status KVServer::InstallSettings(const wire::ServerCheckpoint& saved,
                                       const char* what) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(saved.optimizer_spec());
  if (!opt.ok()) {
    return absl::DataLossError(absl::StrCat(what, " names optimizer '",
                                            saved.optimizer_spec(),
                                            "': ", opt.status().message()));
  }
  absl::MutexLock lock(&settings_mu_);
  settings_.optimizer = std::shared_ptr<const Optimizer>(std::move(*opt));
  settings_.optimizer_spec =
      settings_.optimizer ? settings_.optimizer->spec() : "none";
  settings_.compression =
      saved.compression_type().empty() ? "none" : saved.compression_type();
  settings_.threshold = saved.compression_threshold();
  return absl::OkStatus();
}

absl::Status KVServer::Restore(const wire::ServerCheckpoint& saved) {
  TESSERA_RETURN_IF_ERROR(InstallSettings(saved, "checkpoint"));
  std::map<uint64_t, std::pair<uint64_t, uint64_t>>
      first;  // key: offset, pushes
  for (const wire::CheckpointKey& k : saved.keys()) {
    if (absl::Status s = ShardOf(k.key())->store.Restore(k); !s.ok()) return s;
    num_keys_.fetch_add(1);
    uint64_t total = 0;
    for (uint64_t n : k.received()) total += n;
    auto [it, added] = first.try_emplace(k.key(), k.offset(), total);
    if (!added && k.offset() < it->second.first)
      it->second = {k.offset(), total};
  }
  if (replicas_ > 1) {
    for (auto& shard : shards_) {
      for (const auto& [id, key] : shard->store.keys()) {
        const uint64_t seq = key->replica_seq;
        MakeReplicated(key.get(), key->replica);
        key->replica_seq = seq;
      }
    }
  }
  for (const auto& [key, at] : first)
    SeriesFor(key)->pushes->Increment(at.second);
  {
    absl::MutexLock lock(&key_counts_mu_);
    for (const auto& [key, at] : first) key_pushes_[key] = at.second;
  }
  recovering_.store(true);
  return absl::OkStatus();
}

void KVServer::set_replication(int rank, int num_servers, int replicas,
                               absl::Duration resend_timeout,
                               bool single_copy) {
  rank_ = rank;
  num_servers_ = std::max(num_servers, 1);
  replicas_ = std::clamp(replicas, 1, num_servers_);
  single_copy_ = single_copy && replicas_ > 1;
  replica_resend_ = resend_timeout;
  for (auto& shard : shards_) shard->states.assign(num_servers_, ServerState());
}

void KVServer::MakeReplicated(StoredKey* key, uint32_t replica) {
  if (replicas_ <= 1) return;
  key->replicated = true;
  key->replica = replica;
  key->acked.assign(replicas_, 0);
  key->transfer.assign(replicas_, StoredKey::kNoTransfer);
  key->transfer_sent.assign(replicas_, absl::InfinitePast());
  // A slice made while a hand-back runs (its shard's part may be done
  // already): one that moves takes no push from the start (its round is
  // empty), as the others past their boundary.
  Shard* shard = ShardOf(key->key);
  if (Moves(*shard, *key)) {
    key->yield = StoredKey::kYielded;
    shard->yielding.push_back(key);
  }
}

absl::Status KVServer::CheckReplicaPlace(const wire::Header& init) const {
  if (init.replica() == 0) return absl::OkStatus();
  if (replicas_ <= 1 || init.replica() >= static_cast<uint32_t>(replicas_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", init.slice().key(), " as replica ",
                     init.replica(), ", but this server holds ", replicas_,
                     " replica(s) of a slice (TESSERA_REPLICAS)"));
  }
  if (!init.kv_options().sync_mode() && replicas_ > 2 && !single_copy_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dist_async key ", init.slice().key(),
        " with TESSERA_REPLICAS=", replicas_,
        ": an async key has at most 2 replicas (two backups could "
        "each hold a different last update when the primary dies)"));
  }
  return absl::OkStatus();
}

bool KVServer::CountsFor(const StoredKey& key) const {
  const Shard& shard = *ShardOf(key.key);
  if (replicas_ <= 1) return shard.store.IsFirstSlice(key);
  // Of the slices this server answers for.
  return Active(shard, key) &&
         shard.store.IsFirstSlice(
             key, [&](const StoredKey& k) { return Active(shard, k); });
}

SliceChain KVServer::ChainOf(const StoredKey& key) const {
  return SliceChain::Around(rank_, static_cast<int>(key.replica), num_servers_,
                            replicas_);
}

bool KVServer::Active(const Shard& shard, const StoredKey& key) const {
  if (!key.replicated) return true;
  return ChainOf(key).Primary(shard.states) == rank_;
}

std::vector<int> KVServer::LiveBackups(const Shard& shard,
                                       const StoredKey& key) const {
  // Every other member that holds the slice, or receives it (a replacement
  // this server sent it to): the order of the chain does not matter here.
  std::vector<int> backups;
  for (int place = 0; place < replicas_; ++place) {
    if (place == static_cast<int>(key.replica)) continue;
    const int rank = ChainOf(key).RankAt(place);
    const ServerState& state = shard.states[rank];
    if (state.dead) continue;
    // With one copy only a server the slice is moving to receives it.
    if ((state.catching_up || single_copy_) &&
        key.transfer[place] == StoredKey::kNoTransfer) {
      continue;
    }
    backups.push_back(rank);
  }
  return backups;
}

bool KVServer::AnswerWaitsFor(const Shard& shard, const StoredKey& key,
                              int place) const {
  // A replacement counts once it holds the slice (its transfer answered); a
  // member that holds its slices always counts, also while a slice is being
  // sent to it whole (a gap): answers wait for it.
  // With one copy a member receives only slices moving to it: the same.
  return (!shard.states[ChainOf(key).RankAt(place)].catching_up &&
          !single_copy_) ||
         key.transfer[place] == StoredKey::kTransferHeld;
}

void KVServer::SendUpdate(int rank, const Message& update) {
  Message copy = update;  // shares the frames
  absl::Status sent = send_(ServerId(rank), std::move(copy));
  if (!sent.ok()) {
    TESSERA_VLOG(1) << "update of key " << update.header.slice().key()
                    << " to server " << rank << ": " << sent.message();
  }
}

void KVServer::Replicate(StoredKey* key, std::vector<wire::Header> requests) {
  Shard* shard = ShardOf(key->key);
  PendingUpdate p;
  p.seq = key->replica_seq++;
  p.update.header.set_command(wire::KV_REPLICATE);
  p.update.header.mutable_slice()->set_key(key->key);
  p.update.header.mutable_slice()->set_offset(key->offset);
  p.update.header.set_replica_seq(p.seq);
  for (int r = 0; r < key->ledger.num_workers(); ++r)
    p.update.header.add_replica_counts(key->ledger.received(r));
  if (elastic_ && key->sync)
    key->engine->MemberStates(p.update.header.mutable_replica_members());
  key->engine->TakeUpdate(&p.update);
  for (const wire::Header& h : requests) {
    if (key->engine->AnswersWithWeights(h.command())) p.weights = key->weights;
  }
  p.requests = std::move(requests);
  p.sent = absl::Now();
  p.wait = replica_resend_;
  const std::vector<int> backups = LiveBackups(*shard, *key);
  for (int rank : backups) SendUpdate(rank, p.update);
  key->unacked.push_back(std::move(p));
  // With no live backup left the update is answered at once.
  AnswerReplicated(shard, key);
}

bool KVServer::JoinPendingUpdate(StoredKey* key, const Message& msg) {
  if (key->unacked.empty()) return false;
  const int rank = RankOfId(msg.header.sender());
  for (PendingUpdate& p : key->unacked) {
    if (p.answered) continue;
    if (msg.header.push_seq() >= p.update.header.replica_counts(rank)) continue;
    // The push's update: answered with it, once the backups hold it.
    for (const wire::Header& h : p.requests) {
      if (h.sender() == msg.header.sender() &&
          h.request_id() == msg.header.request_id()) {
        Acknowledge(msg);
        return true;
      }
    }
    p.requests.push_back(msg.header);
    if (key->engine->AnswersWithWeights(msg.header.command()) &&
        p.weights.empty()) {
      p.weights = key->weights;  // newer than the update's at worst
    }
    Acknowledge(msg);
    return true;
  }
  return false;
}

void KVServer::AnswerReplicated(Shard* shard, StoredKey* key) {
  const std::vector<int> backups = LiveBackups(*shard, *key);
  // Answered in order once every backup holding the slice holds the update;
  // kept until every backup it was sent to holds it (a replacement
  // receiving the slice may miss one and wait for its resend).
  bool answering = true;
  for (PendingUpdate& p : key->unacked) {
    if (p.answered) continue;
    for (int rank : backups) {
      const int place = ChainOf(*key).PlaceOf(rank);
      if (AnswerWaitsFor(*shard, *key, place) && key->acked[place] <= p.seq) {
        answering = false;
        break;
      }
    }
    if (!answering) break;
    for (const wire::Header& h : p.requests) {
      Message request;
      request.header = h;
      Reply(request, absl::OkStatus(),
            key->engine->AnswersWithWeights(h.command()) ? p.weights : Buffer(),
            key);
    }
    p.requests.clear();
    p.weights = Buffer();
    p.answered = true;
  }
  while (!key->unacked.empty() && key->unacked.front().answered) {
    const uint64_t seq = key->unacked.front().seq;
    bool held = true;
    for (int rank : backups) {
      if (key->acked[ChainOf(*key).PlaceOf(rank)] <= seq) {
        held = false;
        break;
      }
    }
    if (!held) break;
    key->unacked.pop_front();
  }
}

void KVServer::TakeReplica(Shard* shard, Message&& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) {
    // Its init (sent by the workers to every replica) has not come: the
    // primary sends the update again.
    TESSERA_VLOG(1) << "update of key " << h.slice().key() << " offset "
                    << h.slice().offset() << " for a slice not held here";
    return;
  }
  // Only from the slice's primary as this server sees the chain: a server
  // declared dead must not change what its successor now answers for.
  const int from = RankOfId(h.sender());
  const int primary = ChainOf(*key).Primary(shard->states);
  if (from != primary || primary == rank_) {
    TESSERA_VLOG(1) << "ignored update of key " << h.slice().key()
                    << " from server " << from << " (primary " << primary
                    << ")";
    return;
  }
  auto answer = [&](const absl::Status& status) {
    Message reply = NewReply(msg, status, nullptr);
    reply.header.set_replica_seq(h.replica_seq());
    SendReply(msg, std::move(reply));
  };
  if (h.replica_seq() < key->replica_seq) {
    answer(absl::OkStatus());  // held already; the answer was lost
    return;
  }
  if (h.replica_seq() > key->replica_seq) {
    // A gap: an earlier update was lost, or this backup missed updates its
    // primary no longer keeps (a promotion with R >= 3). Saying how many it
    // holds makes the primary resend the next one, or send the slice whole.
    Message reply = NewReply(
        msg,
        absl::FailedPreconditionError(absl::StrCat(
            "update ", h.replica_seq(), " of key ", key->key,
            " is ahead of this server, which holds ", key->replica_seq)),
        nullptr);
    reply.header.set_replica_seq(key->replica_seq);
    SendReply(msg, std::move(reply));
    return;
  }
  if (h.replica_counts_size() != key->ledger.num_workers()) {
    ++malformed_;
    answer(absl::DataLossError(absl::StrCat(
        "update of key ", key->key, " carries ", h.replica_counts_size(),
        " push counts for ", key->ledger.num_workers(), " workers")));
    return;
  }
  if (absl::Status applied = key->engine->ApplyReplica(msg, settings(), *this);
      !applied.ok()) {
    ++malformed_;
    answer(applied);
    return;
  }
  for (int r = 0; r < key->ledger.num_workers(); ++r)
    key->ledger.SetReceived(r, h.replica_counts(r));
  // A dist_sync slice's update is one of its primary's rounds: a backup
  // promoted later numbers its rounds as the primary did.
  if (key->sync) key->engine->SetRoundNumber(key->engine->RoundNumber() + 1);
  TakeMembers(key, h.replica_members(), "update");
  ++key->replica_seq;
  ++replica_updates_;
  answer(absl::OkStatus());
}

void KVServer::TakeMembers(
    StoredKey* key, const google::protobuf::RepeatedField<uint64_t>& states,
    const char* what) {
  if (states.empty() || !key->sync) return;
  if (states.size() != key->ledger.num_workers()) {
    const uint64_t n = ++malformed_;
    if (LogOccurrence(++malformed_warnings_)) {
      TESSERA_LOG(WARNING) << what << " of key " << key->key << " offset "
                           << key->offset << " carries " << states.size()
                           << " worker states for " << key->ledger.num_workers()
                           << " workers: ignored (malformed message #" << n
                           << ")";
    }
    return;
  }
  const KeyStore& store = ShardOf(key->key)->store;
  for (int r = 0; r < states.size(); ++r) {
    // The scheduler's word on a worker may reach the primary after this
    // server: a rank this server heard leave stays out, and one it heard
    // join is not put out (a joiner not waited for yet is safe either way).
    if (store.Left(r) && states[r] != RoundMembers::kStateOut) continue;
    if (store.Joined(r) && states[r] == RoundMembers::kStateOut) continue;
    key->engine->SetMemberState(r, states[r]);
  }
}

void KVServer::ReplicaAnswered(Shard* shard, const Message& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) return;
  const int rank = RankOfId(h.sender());
  const int place = ChainOf(*key).PlaceOf(rank);
  if (place < 0 || place == static_cast<int>(key->replica)) return;
  const absl::Status status = FromWire(h.status());
  if (absl::IsFailedPrecondition(status)) {
    // The backup holds h.replica_seq() updates and got a later one.
    const uint64_t held = h.replica_seq();
    if (held >= key->replica_seq) return;
    key->acked[place] = std::max(key->acked[place], held);
    if (!key->unacked.empty() && key->unacked.front().seq <= held) {
      // Kept updates are consecutive: the next one it needs is at this index.
      PendingUpdate& p = key->unacked[held - key->unacked.front().seq];
      const absl::Time now = absl::Now();
      if (now - p.sent >= absl::Milliseconds(10)) {  // not just sent
        SendUpdate(rank, p.update);
        ++replica_resends_;
        p.sent = now;
      }
    } else if (key->transfer[place] != StoredKey::kTransferSent) {
      TESSERA_LOG(WARNING) << "server " << rank << " holds " << held
                           << " updates of key " << key->key << " offset "
                           << key->offset << ", fewer than this server keeps "
                           << "for resending: sending it the slice whole";
      SendTransfer(key, place);
    }
    return;
  }
  if (!status.ok()) {
    TESSERA_LOG(WARNING) << "server " << rank << " refused update "
                         << h.replica_seq() << " of key " << key->key << ": "
                         << status.message();
    return;
  }
  // It cannot hold an update not made yet.
  if (h.replica_seq() >= key->replica_seq) return;
  key->acked[place] = std::max(key->acked[place], h.replica_seq() + 1);
  AnswerReplicated(shard, key);
}

void KVServer::ResendUpdates(Shard* shard, StoredKey* key) {
  if (key->unacked.empty()) return;
  const absl::Time now = absl::Now();
  const std::vector<int> backups = LiveBackups(*shard, *key);
  for (PendingUpdate& p : key->unacked) {
    if (now - p.sent < p.wait) continue;
    for (int rank : backups) {
      if (key->acked[ChainOf(*key).PlaceOf(rank)] > p.seq) continue;
      SendUpdate(rank, p.update);
      ++replica_resends_;
    }
    p.sent = now;
    p.wait = std::min(p.wait * 2, replica_resend_ * 8);
  }
}

void KVServer::CheckWorkersFinished() {
  int done = static_cast<int>(finished_workers_.size());
  for (int r : left_workers_) done += finished_workers_.count(r) == 0 ? 1 : 0;
  if (done != num_workers_ || workers_finished_reported_) return;
  workers_finished_reported_ = true;
  TESSERA_VLOG(1) << "every worker finished with this server (or left)";
  if (on_workers_finished_) on_workers_finished_();
}

void KVServer::set_elastic(int nominal) {
  elastic_ = true;
  for (int r = nominal; r < num_workers_; ++r) {
    left_workers_.insert(r);
    watch_.SetInJob(r, false);
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [nominal](Shard* s) { s->store.SetElastic(nominal); });
  }
}

void KVServer::WorkerJoined(int rank) {
  if (rank < 0 || rank >= num_workers_) return;
  left_workers_.erase(rank);
  finished_workers_.erase(rank);
  watch_.SetInJob(rank, true);
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      s->store.WorkerJoined(rank);
      for (auto& [id, key] : s->store.keys()) Replay(key.get());
    });
  }
}

void KVServer::WorkerLeft(int rank) {
  if (rank < 0 || rank >= num_workers_ || !left_workers_.insert(rank).second)
    return;
  LeaveRounds(rank);
  CheckWorkersFinished();
}

void KVServer::LeaveRounds(int rank) {
  watch_.SetInJob(rank, false);
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      s->store.WorkerLeft(rank);
      for (auto& [id, key] : s->store.keys()) {
        StoredKey* k = key.get();
        if (k->sync && k->engine->RoundComplete()) CompleteRound(k, -1);
        Replay(k);
      }
    });
  }
}

void KVServer::ServerDied(int rank) {
  if (replicas_ <= 1 || rank < 0 || rank >= num_servers_) return;
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank](Shard* s) {
      std::vector<ServerState> states = s->states;
      if (rank >= static_cast<int>(states.size())) return;
      states[rank].dead = true;
      ApplyStates(s, std::move(states));
    });
  }
}

void KVServer::UpdateServers(std::vector<ServerState> states) {
  if (replicas_ <= 1 || static_cast<int>(states.size()) != num_servers_) return;
  for (auto& shard : shards_) {
    Post(shard.get(), [this, states](Shard* s) { ApplyStates(s, states); });
  }
  {
    // A catch-up in progress: a death moves slices to other servers, so the
    // counts given so far are stale; the live servers are asked again.
    absl::MutexLock lock(&catch_up_mu_);
    if (catch_up_ != nullptr && !catch_up_->done) {
      catch_up_->counted.clear();
      catch_up_cv_.SignalAll();
    }
  }
}

void KVServer::ApplyStates(Shard* s, std::vector<ServerState> states) {
  std::vector<ServerState> before = std::move(s->states);
  if (before.size() != states.size())
    before.assign(states.size(), ServerState());
  s->states = std::move(states);
  std::vector<int> died, replaced;
  for (int r = 0; r < num_servers_; ++r) {
    if (s->states[r].dead && !before[r].dead) died.push_back(r);
    if (s->states[r].joined != before[r].joined) replaced.push_back(r);
  }
  uint64_t promoted = 0, handed_back = 0;
  std::vector<std::pair<uint64_t, uint64_t>> gone;  // one copy: given away
  for (const auto& [id, owned] : s->store.keys()) {
    StoredKey* key = owned.get();
    if (!key->replicated) continue;
    for (int r : replaced) {
      // A new process at that place: it holds nothing of what was sent.
      const int place = ChainOf(*key).PlaceOf(r);
      if (place < 0 || place == static_cast<int>(key->replica)) continue;
      key->transfer[place] = StoredKey::kNoTransfer;
      key->acked[place] = 0;
    }
    const bool was_active = [&] {
      std::swap(s->states, before);
      const bool a = Active(*s, *key);
      std::swap(s->states, before);
      return a;
    }();
    if (was_active && !Active(*s, *key)) {
      ++handed_back;
      if (single_copy_) gone.push_back({key->key, key->offset});
    }
    if (Active(*s, *key)) {
      if (!was_active) {
        ++promoted;
        key->progress = true;  // what it held for the dead primary
      }
      AnswerReplicated(s, key);  // no longer waits for the dead one
      Replay(key);
    }
  }
  if (handed_back != 0) {
    slices_handed_back_ += handed_back;
    TESSERA_LOG(INFO)
        << "hand-back: " << handed_back
        << (single_copy_
                ? " key slice(s) of this server's moved to the server that "
                  "joined (this server drops its copy)"
                : " key slice(s) of this server's are answered by the "
                  "replacement that took back its place");
  }
  if (promoted != 0) {
    promoted_ += promoted;
    if (died.empty()) {
      TESSERA_LOG(INFO) << "hand-back: this server answers for " << promoted
                        << (single_copy_ ? " key slice(s) moved to it"
                                         : " key slice(s) of its chains again");
    } else if (single_copy_) {
      // One copy: a server that held slices leaves only once they moved
      // (a death ends the job).
      TESSERA_LOG(INFO) << "server(s) " << absl::StrJoin(died, ", ")
                        << " left: this server now answers for " << promoted
                        << " key slice(s) that moved here";
    } else {
      TESSERA_LOG(WARNING) << "server(s) " << absl::StrJoin(died, ", ")
                           << " died: this server now answers for " << promoted
                           << " of their key slices";
    }
  }
  HandbackAfterChange(s);  // before the erase: it releases yielding slices
  // One copy: the new server holds every update (the hand-back waited for
  // it) and no update comes here any more: the copy is dropped, and with it
  // the requests it held (their workers send them to the new server).
  for (const auto& [key, offset] : gone) {
    s->store.Erase(key, offset);
    s->moved_away.insert({key, offset});
    ++moved_away_;
  }
}

void KVServer::HandBack(int rank, uint64_t epoch,
                        std::function<void(uint64_t epoch)> ready, bool leave) {
  if (replicas_ <= 1 || rank < 0 || rank >= num_servers_ ||
      (rank == rank_ && !leave) || (leave && !single_copy_) ||
      epoch <= handback_seen_) {
    return;
  }
  if (leave && rank == rank_) {
    TESSERA_LOG(INFO) << "leaving: moving this server's key slices to the "
                         "servers that answer for them without it";
  }
  handback_seen_ = epoch;
  auto job = std::make_shared<HandbackJob>();
  job->epoch = epoch;
  job->ready = std::move(ready);
  {
    absl::MutexLock lock(&job->mu);
    job->remaining = shards_.size();
  }
  for (auto& shard : shards_) {
    Post(shard.get(), [this, rank, job, leave](Shard* s) {
      StartYield(s, rank, leave, job);
    });
  }
}

void KVServer::StartYield(Shard* s, int rank, bool leave,
                          const std::shared_ptr<HandbackJob>& job) {
  // A later attempt replaces an earlier one (its slices that still move stay
  // stopped).
  if (rank >= static_cast<int>(s->states.size())) return;
  s->handback_rank = rank;
  s->handback_leave = leave;
  s->handback = job;
  Reyield(s);
}

bool KVServer::Waiting(const Shard& s) const {
  // The table as this shard knows it says the rank holds its slices and has
  // not its place back (a notice can come before the change it follows).
  const ServerState& r = s.states[s.handback_rank];
  if (s.handback_leave) return r.holds();  // not left yet
  return r.holds() && !r.restored;
}

std::vector<ServerState> KVServer::StatesAfter(const Shard& s) const {
  std::vector<ServerState> after = s.states;
  if (s.handback_leave) {
    after[s.handback_rank].dead = true;
  } else {
    after[s.handback_rank].restored = true;
  }
  return after;
}

void KVServer::Reyield(Shard* s) {
  std::vector<StoredKey*> before = std::move(s->yielding);
  s->yielding.clear();
  if (Waiting(*s)) {
    for (const auto& [id, owned] : s->store.keys()) {
      StoredKey* key = owned.get();
      if (!Moves(*s, *key)) continue;
      if (key->yield == StoredKey::kNotYielding) {
        key->yield = !key->sync || key->engine->RoundEmpty()
                         ? StoredKey::kYielded
                         : StoredKey::kYielding;
      }
      s->yielding.push_back(key);
    }
  }
  // Slices that no longer move take their held pushes.
  for (StoredKey* key : before) {
    if (std::find(s->yielding.begin(), s->yielding.end(), key) !=
        s->yielding.end()) {
      continue;
    }
    ReleaseYield(s, key);
  }
  CheckYield(s);
}

void KVServer::ReleaseYield(Shard* s, StoredKey* key) {
  const bool held = key->yield == StoredKey::kYielded;
  key->yield = StoredKey::kNotYielding;
  if (held && Active(*s, *key)) {
    key->progress = true;
    Replay(key);
  }
}

bool KVServer::Moves(const Shard& s, const StoredKey& key) const {
  if (s.handback_rank < 0 || !key.replicated || !Active(s, key)) return false;
  return ChainOf(key).Primary(StatesAfter(s)) != rank_;
}

bool KVServer::TakesInit(const Shard& s, const wire::Header& init) const {
  const SliceChain chain = SliceChain::Around(
      rank_, static_cast<int>(init.replica()), num_servers_, replicas_);
  if (chain.Primary(s.states) != rank_) return false;
  // And it stays here through the hand-back running on the shard.
  return s.handback_rank < 0 || !Waiting(s) ||
         chain.Primary(StatesAfter(s)) == rank_;
}

bool KVServer::MovesTo(const Shard& s, const StoredKey& key, int rank) const {
  // Replacement `rank` once it has its place back.
  std::vector<ServerState> after = s.states;
  after[rank].catching_up = false;
  after[rank].restored = true;
  return ChainOf(key).Primary(after) == rank;
}

void KVServer::OfferSlice(Shard* s, StoredKey* key) {
  // One copy: a slice made while a replacement is on its way to answering
  // for it goes to it at once (the workers send its init to one server).
  if (!single_copy_ || !key->replicated || !Active(*s, *key)) return;
  for (int rank = 0; rank < num_servers_; ++rank) {
    const ServerState& r = s->states[rank];
    if (rank == rank_ || r.dead || r.joined == 0 || r.restored) continue;
    if (MovesTo(*s, *key, rank)) SendTransfer(key, ChainOf(*key).PlaceOf(rank));
  }
}

void KVServer::CheckYield(Shard* s) {
  if (s->handback == nullptr || s->handback_rank < 0 || !Waiting(*s)) return;
  bool done = true;
  const std::vector<ServerState> after =
      single_copy_ ? StatesAfter(*s) : std::vector<ServerState>();
  for (StoredKey* key : s->yielding) {
    if (key->yield != StoredKey::kYielded) done = false;
    if (single_copy_) {
      // The one copy must be where it moves before it moves (the leaver
      // sends it; an old primary sends a slice made after the catch-up).
      const int to = ChainOf(*key).Primary(after);
      const int place = to < 0 ? -1 : ChainOf(*key).PlaceOf(to);
      if (place < 0) {
        done = false;  // no server to take it: never reported as moved
      } else if (key->transfer[place] != StoredKey::kTransferHeld) {
        done = false;
        if (key->transfer[place] == StoredKey::kNoTransfer ||
            absl::Now() - key->transfer_sent[place] > 8 * replica_resend_) {
          SendTransfer(key, place);
        }
      }
    }
    if (!key->unacked.empty()) {
      done = false;
      ResendUpdates(s, key);  // due ones only: the hand-back waits for them
    }
  }
  if (!done) return;
  std::shared_ptr<HandbackJob> job = std::move(s->handback);
  s->handback = nullptr;  // reported; the slices stay stopped until the end
  bool last = false;
  {
    absl::MutexLock lock(&job->mu);
    last = --job->remaining == 0;
  }
  if (last) job->ready(job->epoch);
}

void KVServer::EndYield(Shard* s) {
  std::vector<StoredKey*> yielding = std::move(s->yielding);
  s->yielding.clear();
  s->handback = nullptr;
  s->handback_rank = -1;
  s->handback_leave = false;
  for (StoredKey* key : yielding) ReleaseYield(s, key);
}

void KVServer::HandbackAfterChange(Shard* s) {
  if (s->handback_rank < 0) return;
  const ServerState& r = s->states[s->handback_rank];
  // A leave ends when its rank left (a leaver may have been given its place
  // back long before); a hand-back when the rank has its place, or died.
  if (r.dead || (r.restored && !s->handback_leave)) {
    // Done (the rank answers now), or given up (it died): the scheduler
    // starts another, if any, with a new notice.
    EndYield(s);
    return;
  }
  // Otherwise the hand-back goes on over the new table: a death may change
  // which slices move; a notice that came before the change it follows
  // starts now. A change the scheduler made after starting it gives it up
  // there, and a new notice replaces it here.
  Reyield(s);
}

void KVServer::ProcessMessage(Shard* shard, Message&& msg) {
  Process(shard, std::move(msg));
  if (shard->handback != nullptr) CheckYield(shard);
}

// --- State transfer to a replacement (server/replication.h) ---------------

void KVServer::TransferRequested(int rank, const wire::Header& request) {
  struct Job {
    absl::Mutex mu;
    uint64_t total ABSL_GUARDED_BY(mu) = 0;
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
  };
  auto job = std::make_shared<Job>();
  {
    absl::MutexLock lock(&job->mu);
    job->remaining = shards_.size();
  }
  const uint64_t request_id = request.request_id();
  for (auto& shard : shards_) {
    Post(shard.get(), [this, job, rank, request_id](Shard* s) {
      // Only a rank this server knows as a replacement: one asking before
      // the table change reached here asks again.
      uint64_t mine = 0;
      if (s->states[rank].catching_up && !s->states[rank].dead) {
        for (const auto& [id, owned] : s->store.keys()) {
          StoredKey* key = owned.get();
          if (!key->replicated || !Active(*s, *key)) continue;
          const int place = ChainOf(*key).PlaceOf(rank);
          if (place < 0 || place == static_cast<int>(key->replica)) continue;
          // One copy: only the slices it will answer for.
          if (single_copy_ && !MovesTo(*s, *key, rank)) continue;
          ++mine;
          // Not answered yet: sent again only when it may have been lost
          // (a re-ask every PS_RESEND_TIMEOUT must not resend a slice in
          // flight, gigabytes for a big shard).
          if (key->transfer[place] == StoredKey::kNoTransfer ||
              (key->transfer[place] == StoredKey::kTransferSent &&
               absl::Now() - key->transfer_sent[place] > 8 * replica_resend_)) {
            SendTransfer(key, place);
          }
        }
      }
      absl::MutexLock lock(&job->mu);
      job->total += mine;
      if (--job->remaining != 0) return;
      if (!s->states[rank].catching_up) return;  // not (yet) known as one
      Message count;
      count.header.set_command(wire::KV_TRANSFER);
      count.header.set_is_response(true);
      count.header.set_request_id(request_id);
      count.header.set_transfer_total(job->total);
      absl::Status sent = send_(ServerId(rank), std::move(count));
      if (!sent.ok()) {
        TESSERA_VLOG(1) << "transfer count to server " << rank << ": "
                        << sent.message();
      }
    });
  }
}

void KVServer::SendTransfer(StoredKey* key, int place) {
  wire::ServerCheckpoint saved;
  {
    const Settings set = settings();
    saved.set_optimizer_spec(set.optimizer_spec);
    saved.set_compression_type(set.compression);
    saved.set_compression_threshold(set.threshold);
  }
  wire::CheckpointKey* k = saved.add_keys();
  key->Snapshot(k);
  k->set_replica(static_cast<uint32_t>(place));
  // Which workers its rounds wait for: a replacement may have come after a
  // worker joined, and the joiner's entry round is known here only.
  if (elastic_ && key->sync) key->engine->MemberStates(k->mutable_members());
  // Serialized straight into the frame (no intermediate string).
  const size_t size = saved.ByteSizeLong();
  Buffer bytes = Buffer::Allocate(size);
  saved.SerializeWithCachedSizesToArray(bytes.mutable_data());
  Message msg;
  msg.header.set_command(wire::KV_TRANSFER);
  msg.header.mutable_slice()->set_key(key->key);
  msg.header.mutable_slice()->set_offset(key->offset);
  msg.header.set_replica_seq(key->replica_seq);
  msg.header.set_replica(static_cast<uint32_t>(place));
  AddRawFrame(&msg, std::move(bytes));
  key->transfer[place] = StoredKey::kTransferSent;
  key->transfer_sent[place] = absl::Now();
  const int rank = ChainOf(*key).RankAt(place);
  absl::Status sent = send_(ServerId(rank), std::move(msg));
  TESSERA_VLOG(1) << "sent key " << key->key << " offset " << key->offset
                  << " (" << size << " bytes, update " << key->replica_seq
                  << ") to replacement server " << rank
                  << (sent.ok() ? "" : ": " + std::string(sent.message()));
}

void KVServer::TransferAnswered(Shard* shard, const Message& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) return;
  const int place = ChainOf(*key).PlaceOf(RankOfId(h.sender()));
  if (place < 0 || place == static_cast<int>(key->replica)) return;
  if (!FromWire(h.status()).ok()) {
    TESSERA_LOG(WARNING) << "server " << RankOfId(h.sender())
                         << " refused the transfer of key " << key->key << ": "
                         << h.status().message();
    key->transfer[place] = StoredKey::kNoTransfer;  // sent again when asked
    return;
  }
  if (key->transfer[place] != StoredKey::kTransferSent) return;
  key->transfer[place] = StoredKey::kTransferHeld;
  key->acked[place] = std::max(key->acked[place], h.replica_seq());
  AnswerReplicated(shard, key);
}

void KVServer::TakeTransfer(Shard* shard, Message&& msg) {
  const wire::Header& h = msg.header;
  const int from = RankOfId(h.sender());
  auto answer = [&](const absl::Status& status) {
    Message reply = NewReply(msg, status, nullptr);
    reply.header.set_replica_seq(h.replica_seq());
    SendReply(msg, std::move(reply));
  };
  wire::ServerCheckpoint saved;
  if (msg.data.size() != 1 ||
      !saved.ParseFromArray(msg.data[0].data(),
                            static_cast<int>(msg.data[0].size())) ||
      saved.keys_size() != 1 || saved.keys(0).key() != h.slice().key() ||
      saved.keys(0).offset() != h.slice().offset() ||
      saved.keys(0).replica_seq() != h.replica_seq() ||
      saved.keys(0).replica() >= static_cast<uint32_t>(replicas_)) {
    ++malformed_;
    answer(absl::DataLossError(absl::StrCat("malformed transfer of key ",
                                            h.slice().key(), " offset ",
                                            h.slice().offset())));
    return;
  }
  const wire::CheckpointKey& k = saved.keys(0);
  // Only from the slice's acting primary as this server sees the chain.
  const int primary = SliceChain::Around(rank_, static_cast<int>(k.replica()),
                                         num_servers_, replicas_)
                          .Primary(shard->states);
  if (from != primary) {
    TESSERA_VLOG(1) << "ignored transfer of key " << k.key() << " from server "
                    << from << " (primary " << primary << ")";
    return;
  }
  StoredKey* key = shard->store.Find(k.key(), k.offset());
  bool catching_up = false;
  {
    absl::MutexLock lock(&catch_up_mu_);
    catching_up = catch_up_ != nullptr && !catch_up_->done;
  }
  // A slice new here only while catching up; one held here only at the
  // place it holds it (the sender names the place, and with it the chain).
  if ((key == nullptr && !catching_up && !single_copy_) ||
      (key != nullptr && (!key->replicated || key->replica != k.replica()))) {
    ++malformed_;
    answer(absl::FailedPreconditionError(absl::StrCat(
        "transfer of key ", k.key(), " offset ", k.offset(), " as place ",
        k.replica(), ": not a slice this server receives there")));
    return;
  }
  if (key == nullptr || key->replica_seq < k.replica_seq()) {
    // The job's optimizer and compression: a replacement has none yet (with
    // one copy a slice can come after the catch-up, or be its first).
    if (catching_up || (single_copy_ && key == nullptr)) {
      if (absl::Status set = InstallSettings(saved, "transfer"); !set.ok()) {
        ++malformed_;
        answer(set);
        return;
      }
    }
    const bool added = key == nullptr;
    if (!added) shard->store.Erase(k.key(), k.offset());
    if (absl::Status restored = shard->store.Restore(k); !restored.ok()) {
      ++malformed_;
      answer(restored);
      return;
    }
    key = shard->store.Find(k.key(), k.offset());
    shard->moved_away.erase({k.key(), k.offset()});
    MakeReplicated(key, k.replica());
    key->replica_seq = k.replica_seq();
    TakeMembers(key, k.members(), "transfer");
    if (added) num_keys_.fetch_add(1);
  }
  {
    absl::MutexLock lock(&catch_up_mu_);
    if (catch_up_ != nullptr) {
      if (catch_up_->taken[from].insert({k.key(), k.offset()}).second)
        catch_up_->bytes += msg.data[0].size();
    }
  }
  answer(absl::OkStatus());
  CheckCaughtUp();
}

void KVServer::TransferCounted(int rank, uint64_t total) {
  {
    absl::MutexLock lock(&catch_up_mu_);
    if (catch_up_ == nullptr) return;
    catch_up_->counted[rank] = total;
  }
  CheckCaughtUp();
}

void KVServer::StartCatchUp(std::function<std::vector<ServerState>()> states,
                            std::function<void()> caught_up) {
  {
    absl::MutexLock lock(&catch_up_mu_);
    if (catch_up_ != nullptr || replicas_ <= 1) return;
    catch_up_ = std::make_unique<CatchUp>();
    catch_up_->states = std::move(states);
    catch_up_->caught_up = std::move(caught_up);
    catch_up_->started = absl::Now();
  }
  if (single_copy_) {
    TESSERA_LOG(INFO) << "this server takes rank " << rank_
                      << ": asking the live servers for the key slices it "
                         "will answer for";
  } else {
    TESSERA_LOG(INFO) << "this server replaces a dead one (rank " << rank_
                      << "): asking the live servers for its key slices";
  }
  catch_up_thread_ = std::thread([this] { CatchUpLoop(); });
}

void KVServer::CatchUpLoop() {
  uint64_t asked = 0;
  absl::MutexLock lock(&catch_up_mu_);
  while (!stopped_.load() && !catch_up_->done) {
    const std::vector<ServerState> states = catch_up_->states();
    std::vector<int> ask;
    for (int r = 0; r < num_servers_ && r < static_cast<int>(states.size());
         ++r) {
      if (r != rank_ && !states[r].dead && !catch_up_->SentAll(r))
        ask.push_back(r);
    }
    catch_up_mu_.Unlock();
    for (int r : ask) {
      Message request;
      request.header.set_command(wire::KV_TRANSFER);
      request.header.set_request_id(++asked);
      (void)send_(ServerId(r), std::move(request));
    }
    catch_up_mu_.Lock();
    if (catch_up_->done || stopped_.load()) break;
    catch_up_cv_.WaitWithTimeout(&catch_up_mu_, replica_resend_);
  }
}

void KVServer::CheckCaughtUp() {
  std::function<void()> report;
  {
    absl::MutexLock lock(&catch_up_mu_);
    if (catch_up_ == nullptr || catch_up_->done) return;
    const std::vector<ServerState> states = catch_up_->states();
    uint64_t slices = 0;
    for (int r = 0; r < num_servers_ && r < static_cast<int>(states.size());
         ++r) {
      if (r == rank_ || states[r].dead) continue;
      if (!catch_up_->SentAll(r)) return;
      slices += catch_up_->counted[r];
    }
    catch_up_->done = true;
    catch_up_cv_.SignalAll();
    TESSERA_LOG(INFO) << "caught up: " << slices << " key slice(s), "
                      << catch_up_->bytes << " bytes, in "
                      << absl::FormatDuration(absl::Now() - catch_up_->started);
    report = catch_up_->caught_up;
  }
  if (report) report();
}

}  // namespace tessera

#include "server/kv_server.h"

#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/bounded_queue.h"
#include "common/logging.h"
#include "common/trace.h"
#include "common/wire_status.h"
#include "server/key_store.h"
#include "server/kv_server_shard.h"
#include "server/pull_shadow.h"

namespace tessera {
namespace {

// Messages up to this many data bytes are processed on Handle's thread when
// their shard is idle.
constexpr size_t kInlineBytes = 64 << 10;

// Updates from a slice's primary up to this many data bytes are applied on
// Handle's thread when their shard is idle.
constexpr size_t kInlineReplicaBytes = 4 << 20;

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
  catch_up_.Stop();
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
      TransferCounted(RankOfId(h.sender()), msg);
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

void KVServer::ProcessMessage(Shard* shard, Message&& msg) {
  Process(shard, std::move(msg));
  if (shard->handback != nullptr) CheckYield(shard);
}

// --- State transfer to a replacement (server/replication.h) ---------------

}  // namespace tessera

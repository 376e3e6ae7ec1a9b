// KVServer's account of itself (docs/metrics.md): the KV_STATS counts and
// the metrics collected from the same counters, each key's series (the first
// kMaxKeySeries keys, the rest under key="other"), update timing and round
// traces (TESSERA_TRACE), and the server's part of /debug/pending.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "common/trace.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"

namespace tessera {

void KVServer::AddCounter(const char* name, const char* help,
                          const std::atomic<uint64_t>* value) {
  metric_handles_.push_back(MetricsRegistry::Global().AddCollector(
      name, help, MetricType::kCounter, [value](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(value->load())});
      }));
}

void KVServer::RegisterCounters() {
  auto counter = [this](const char* name, const char* help,
                        const std::atomic<uint64_t>* value) {
    AddCounter(name, help, value);
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
          "dist_async and dist_ssp pushes applied as updates, one per key and "
          "push.",
          &async_applied_);
  counter("tessera_server_duplicates_total",
          "Repeated requests (resent, replayed) answered without being "
          "applied again (KV_STATS duplicates).",
          &duplicates_);
  counter("tessera_server_probes_sent_whole_total",
          "Probes (the header of a push resent after its acknowledgement) "
          "for a push this server did not hold, answered: send it whole.",
          &probes_sent_whole_);
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
          "Replies and acknowledgements the transport would not take (a "
          "worker gone, its queue full past the send time-out).",
          &failed_replies_);
  counter("tessera_server_failed_server_sends_total",
          "Messages to other servers (chain updates, transfers, their counts "
          "and asks) the transport would not take.",
          &failed_server_sends_);
  RegisterChainCounters();
}

// The counters of chains, hand-backs, transfers and checkpoints.
void KVServer::RegisterChainCounters() {
  auto counter = [this](const char* name, const char* help,
                        const std::atomic<uint64_t>* value) {
    AddCounter(name, help, value);
  };
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
  counter("tessera_server_misplaced_inits_total",
          "KV_INITs refused because the place in the slice's chain they "
          "named cannot be this server's (KV_STATS misplaced_inits).",
          &misplaced_inits_);
  counter("tessera_server_misplaced_server_messages_total",
          "Replica updates and transfers dropped because their sender's "
          "place in the slice's chain may not send them (KV_STATS "
          "misplaced_server_messages).",
          &misplaced_server_messages_);
  counter("tessera_server_replica_resends_total",
          "Updates sent again to a backup that had not answered them.",
          &replica_resends_);
  counter("tessera_server_checkpoints_written_total",
          "Checkpoints written and made durable (KV_STATS "
          "checkpoints_written).",
          &checkpoints_);
}

void KVServer::RegisterGauges() {
  MetricsRegistry& r = MetricsRegistry::Global();
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
  s.set_misplaced_inits(misplaced_inits_.load());
  s.set_misplaced_server_messages(misplaced_server_messages_.load());
  absl::MutexLock lock(&key_counts_mu_);
  for (const auto& [key, n] : key_pushes_)
    (*s.mutable_key_pushes_applied())[key] = n;
  return s;
}

void KVServer::FillPending(wire::DebugPending* out) const {
  const absl::Time now = absl::Now();
  watch_.Fill(out, now);
  ssp_stats_.Fill(out, now);
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

}  // namespace tessera

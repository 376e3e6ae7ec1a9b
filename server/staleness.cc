#include "server/staleness.h"

#include <algorithm>
#include <string>
#include <vector>

namespace tessera {

bool StalenessGate::Open(uint64_t clock, const PushLedger& ledger,
                         const std::function<bool(int)>& counts) const {
  // received + s >= clock, without the underflow of clock - s.
  for (int r = 0; r < ledger.num_workers(); ++r) {
    if (counts(r) && ledger.received(r) + staleness_ < clock) return false;
  }
  return true;
}

StalenessGate::Span StalenessGate::Measure(
    const PushLedger& ledger, const std::function<bool(int)>& counts) {
  Span span;
  uint64_t fastest = 0;
  for (int r = 0; r < ledger.num_workers(); ++r) {
    if (!counts(r)) continue;
    const uint64_t n = ledger.received(r);
    if (span.slowest_rank < 0 || n < span.slowest) {
      span.slowest_rank = r;
      span.slowest = n;
    }
    fastest = std::max(fastest, n);
  }
  if (span.slowest_rank >= 0) span.spread = fastest - span.slowest;
  return span;
}

bool StalenessGate::Hold(int sender, uint64_t request_id, absl::Time now) {
  return held_.try_emplace({sender, request_id}, now).second;
}

std::optional<absl::Duration> StalenessGate::Release(int sender,
                                                     uint64_t request_id,
                                                     absl::Time now) {
  auto it = held_.find({sender, request_id});
  if (it == held_.end()) return std::nullopt;
  const absl::Duration held = now - it->second;
  held_.erase(it);
  return held;
}

size_t StalenessGate::Forget(int sender) {
  return std::erase_if(
      held_, [sender](const auto& h) { return h.first.first == sender; });
}

StalenessStats::StalenessStats(int num_workers)
    : num_workers_(num_workers),
      clock_(new std::atomic<uint64_t>[num_workers]),
      pushed_(new std::atomic<bool>[num_workers]),
      in_job_(new std::atomic<bool>[num_workers]),
      held_total_(MetricsRegistry::Global().GetCounter(
          "tessera_server_ssp_pulls_held_total",
          "dist_ssp: pulls the staleness bound held (once per pull) until "
          "every worker in the job was at most s pushes behind the puller.")),
      held_seconds_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_ssp_pull_held_seconds",
          "dist_ssp: how long the staleness bound held a pull, per pull held.",
          LatencyBuckets())) {
  for (int r = 0; r < num_workers; ++r) {
    clock_[r].store(0);
    pushed_[r].store(false);
    in_job_[r].store(true);
  }
  MetricsRegistry& m = MetricsRegistry::Global();
  handles_.push_back(m.AddCollector(
      "tessera_server_ssp_clock",
      "dist_ssp: per worker rank, the most pushes of it any dist_ssp slice "
      "on this server has taken (its step, as this server sees it); ranks "
      "that pushed to one only.",
      MetricType::kGauge, [this](MetricSamples* out) {
        for (int r = 0; r < num_workers_; ++r) {
          if (!pushed_[r].load()) continue;
          out->push_back(
              {{{"rank", std::to_string(r)}}, static_cast<double>(clock(r))});
        }
      }));
  handles_.push_back(m.AddCollector(
      "tessera_server_ssp_clock_spread",
      "dist_ssp: the fastest worker's clock minus the slowest's, over the "
      "workers in the job (at most s + 1: a worker pushes, then its pull "
      "waits).",
      MetricType::kGauge, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(spread())});
      }));
  handles_.push_back(
      m.AddCollector("tessera_server_ssp_pulls_waiting",
                     "dist_ssp: pulls the staleness bound holds now.",
                     MetricType::kGauge, [this](MetricSamples* out) {
                       out->push_back({{}, static_cast<double>(waiting())});
                     }));
}

void StalenessStats::Pushed(int rank, uint64_t count) {
  if (rank < 0 || rank >= num_workers_) return;
  pushed_[rank].store(true, std::memory_order_relaxed);
  uint64_t seen = clock_[rank].load(std::memory_order_relaxed);
  while (seen < count && !clock_[rank].compare_exchange_weak(
                             seen, count, std::memory_order_relaxed)) {
  }
}

void StalenessStats::SetInJob(int rank, bool in_job) {
  if (rank >= 0 && rank < num_workers_) in_job_[rank].store(in_job);
}

void StalenessStats::Held() {
  held_total_->Increment();
  waiting_.fetch_add(1, std::memory_order_relaxed);
}

void StalenessStats::Released(absl::Duration held) {
  held_seconds_->ObserveDuration(held);
  waiting_.fetch_sub(1, std::memory_order_relaxed);
}

void StalenessStats::Dropped(size_t n) {
  waiting_.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
}

void StalenessStats::Holding(int sender, uint64_t request_id,
                             const HeldPull& pull, absl::Time now) {
  absl::MutexLock lock(&held_mu_);
  auto [it, added] = held_.try_emplace(
      HeldId{pull.key, pull.offset, sender, request_id}, HeldEntry{pull, now});
  if (!added) it->second.pull = pull;  // since: when it was first held
}

void StalenessStats::NotHolding(uint64_t key, uint64_t offset, int sender,
                                uint64_t request_id) {
  absl::MutexLock lock(&held_mu_);
  held_.erase(HeldId{key, offset, sender, request_id});
}

void StalenessStats::NotHoldingAny(uint64_t key, uint64_t offset, int sender) {
  absl::MutexLock lock(&held_mu_);
  auto it = held_.lower_bound(HeldId{key, offset, sender, 0});
  while (it != held_.end() && std::get<0>(it->first) == key &&
         std::get<1>(it->first) == offset && std::get<2>(it->first) == sender) {
    it = held_.erase(it);
  }
}

void StalenessStats::Fill(wire::DebugPending* out, absl::Time now) const {
  absl::MutexLock lock(&held_mu_);
  // Oldest first; held at the same time, in the map's order.
  std::vector<std::pair<absl::Time, const HeldEntry*>> by_age;
  for (const auto& [id, held] : held_) by_age.push_back({held.since, &held});
  std::stable_sort(
      by_age.begin(), by_age.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  const size_t listed = std::min(by_age.size(), kMaxListed);
  out->set_held_pulls_total(out->held_pulls_total() +
                            static_cast<int32_t>(held_.size()));
  for (size_t i = 0; i < listed; ++i) {
    const HeldPull& p = by_age[i].second->pull;
    wire::HeldPull* h = out->add_held_pulls();
    h->set_key(p.key);
    h->set_offset(p.offset);
    h->set_rank(p.rank);
    h->set_command(wire::Command_Name(p.command));
    h->set_clock(p.clock);
    h->set_staleness(p.staleness);
    h->set_held_by(p.held_by);
    h->set_held_by_pushes(p.held_by_pushes);
    // Held: held_by_pushes + s < clock, so this is at least 1.
    const uint64_t needs = p.held_by_pushes + p.staleness;
    h->set_steps(p.clock > needs ? p.clock - needs : 0);
    h->set_age_s(absl::ToDoubleSeconds(now - by_age[i].first));
  }
}

uint64_t StalenessStats::clock(int rank) const {
  return clock_[rank].load(std::memory_order_relaxed);
}

uint64_t StalenessStats::spread() const {
  bool any = false;
  uint64_t lo = 0, hi = 0;
  for (int r = 0; r < num_workers_; ++r) {
    if (!pushed_[r].load() || !in_job_[r].load()) continue;
    const uint64_t c = clock(r);
    lo = any ? std::min(lo, c) : c;
    hi = any ? std::max(hi, c) : c;
    any = true;
  }
  return hi - lo;
}

}  // namespace tessera

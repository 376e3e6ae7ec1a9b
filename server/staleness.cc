#include "server/staleness.h"

#include <algorithm>
#include <string>

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

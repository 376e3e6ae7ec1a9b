// Metrics: counters, gauges and histograms of a process, and their
// Prometheus text exposition (format 0.0.4), which MetricsHttpServer serves.
//
//   MetricsRegistry& r = MetricsRegistry::Global();
//   Counter* sent = r.GetCounter("tessera_sent_bytes_total",
//                                "Bytes sent", {{"command", "KV_PUSH"}});
//   sent->Increment(n);                           // hot path: one relaxed add
//   Histogram* t = r.GetHistogram("tessera_worker_push_duration_seconds",
//                                 "Push latency", LatencyBuckets());
//   t->Observe(0.0012);
//   // Counts kept elsewhere are read when scraped:
//   CollectorHandle h = r.AddCollector(
//       "tessera_server_pushes_applied_total", "Pushes applied",
//       MetricType::kCounter, [this](MetricSamples* out) {
//         out->push_back({{}, static_cast<double>(pushes_.load())});
//       });                                    // removed when h is destroyed
//   std::string text = r.TextExposition();
//
// A series (a name and its label values) is made once and lives as long as
// the registry: callers keep the pointer and increment it without a lock.
// Label cardinality is bounded: at most kMaxSeriesPerFamily label sets of a
// family get a series of their own; past that, new label sets share one more
// series whose label values are all "other" (a warning is logged once). Callers with unbounded label values
// (keys) bound them themselves (see docs/metrics.md).
//
// Names follow Prometheus: [a-zA-Z_:][a-zA-Z0-9_:]*, counters end in
// _total, units are base units (_seconds, _bytes). A name used with two
// types, or a histogram with two bucket layouts, is a programming error
// (CHECK).
//
// Thread-safety: everything is thread-safe. Collectors run on the scraping
// thread without the registry's lock held (they may take their owner's
// locks; an owner must not destroy a CollectorHandle while holding a lock its
// collector takes).
#ifndef TESSERA_COMMON_METRICS_H_
#define TESSERA_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {

// Label names and values of one series, in the order given.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

enum class MetricType { kCounter, kGauge, kHistogram };

class Counter {
 public:
  void Increment(uint64_t n = 1) {
    value_.fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d) { value_.fetch_add(d, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Fixed buckets: an observation v goes into the first bucket whose upper
// bound b has v <= b (Prometheus' "le"), or the +Inf bucket.
class Histogram {
 public:
  // REQUIRES: `bounds` strictly increasing and finite.
  explicit Histogram(std::vector<double> bounds);

  void Observe(double v);
  void ObserveDuration(absl::Duration d) { Observe(absl::ToDoubleSeconds(d)); }

  struct Snapshot {
    std::vector<uint64_t> buckets;  // per bucket (not cumulative), +Inf last
    double sum = 0;
    uint64_t count = 0;  // the sum of `buckets`
  };
  Snapshot snapshot() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<double> sum_{0};
};

// Buckets for request latencies: 50 us .. 10 s.
const std::vector<double>& LatencyBuckets();
// Buckets for longer work (rounds, checkpoints, steps): 1 ms .. 300 s.
const std::vector<double>& DurationBuckets();

// What a collector reports: one value per label set.
struct MetricSample {
  MetricLabels labels;
  double value = 0;
};
using MetricSamples = std::vector<MetricSample>;
using CollectFn = std::function<void(MetricSamples* out)>;

class MetricsRegistry;

// Keeps a collector registered; destroying (or Reset) removes it and waits
// for a scrape running it to finish with it. Move-only.
class CollectorHandle {
 public:
  CollectorHandle() = default;
  CollectorHandle(CollectorHandle&& other) noexcept;
  CollectorHandle& operator=(CollectorHandle&& other) noexcept;
  CollectorHandle(const CollectorHandle&) = delete;
  CollectorHandle& operator=(const CollectorHandle&) = delete;
  ~CollectorHandle() { Reset(); }
  void Reset();

 private:
  friend class MetricsRegistry;
  struct Entry;
  explicit CollectorHandle(std::shared_ptr<Entry> entry)
      : entry_(std::move(entry)) {}
  std::shared_ptr<Entry> entry_;
};

class MetricsRegistry {
 public:
  static constexpr size_t kMaxSeriesPerFamily = 256;

  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The process's registry (what the daemons and the client library use and
  // MetricsHttpServer serves). Holds the process_* collectors (RSS, CPU time,
  // start time) from its creation.
  static MetricsRegistry& Global();

  // The series of `name` with `labels`, made on first use. The pointer lives
  // as long as the registry. `help` of the first call is kept.
  Counter* GetCounter(std::string_view name, std::string_view help,
                      const MetricLabels& labels = {});
  Gauge* GetGauge(std::string_view name, std::string_view help,
                  const MetricLabels& labels = {});
  // REQUIRES: every call for `name` passes the same bounds.
  Histogram* GetHistogram(std::string_view name, std::string_view help,
                          const std::vector<double>& bounds,
                          const MetricLabels& labels = {});

  // Adds samples computed at scrape time to family `name` (a counter or a
  // gauge). Several collectors, or a collector and GetCounter/GetGauge
  // series, may report the same label set: their values are added (two
  // clients in one process report their sum).
  [[nodiscard]] CollectorHandle AddCollector(std::string_view name,
                                             std::string_view help,
                                             MetricType type, CollectFn fn);

  // Every family, sorted by name, in Prometheus' text format 0.0.4.
  std::string TextExposition() const;

 private:
  struct Series {
    MetricLabels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
  };
  struct Family {
    MetricType type = MetricType::kCounter;
    std::string help;
    std::vector<double> bounds;                // histograms
    std::map<std::string, Series> series;      // by serialized labels
    std::vector<std::weak_ptr<CollectorHandle::Entry>> collectors;
    bool overflow_warned = false;
  };

  Family& FamilyLocked(std::string_view name, std::string_view help,
                       MetricType type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Series& SeriesLocked(std::string_view name, Family& family,
                       const MetricLabels& labels)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family, std::less<>> families_ ABSL_GUARDED_BY(mu_);
};

// Keeps several collectors registered together.
using CollectorHandles = std::vector<CollectorHandle>;

// Text-format helpers (exposed for tests): a label value or HELP text with
// the escapes Prometheus requires, and a sample value.
std::string EscapeLabelValue(std::string_view value);
std::string EscapeHelp(std::string_view help);
std::string FormatMetricValue(double value);

}  // namespace tessera

#endif  // TESSERA_COMMON_METRICS_H_

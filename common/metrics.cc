#include "common/metrics.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/process_info.h"

namespace tessera {

struct CollectorHandle::Entry {
  absl::Mutex mu;
  CollectFn fn ABSL_GUARDED_BY(mu);
};

namespace {

// A programming error (a bad name, a type clash): logged, then abort.
class FatalLine {
 public:
  ~FatalLine() {
    TESSERA_LOG(ERROR) << stream_.str();
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

#define METRICS_CHECK(cond) \
  if (cond) {               \
  } else                    \
    FatalLine().stream() << "metrics: check failed: " #cond ": "

bool ValidName(std::string_view name, bool label) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                       c == '_' || (!label && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  return true;
}

std::string SerializeLabels(const MetricLabels& labels) {
  std::string out;
  for (const auto& [name, value] : labels) {
    absl::StrAppend(&out, out.empty() ? "" : ",", name, "=\"",
                    EscapeLabelValue(value), "\"");
  }
  return out;
}

// `name{labels}` or `name`, with an extra label appended (histogram "le").
std::string SampleName(const std::string& name, const std::string& labels,
                       const std::string& extra = "") {
  std::string all = labels;
  if (!extra.empty()) absl::StrAppend(&all, all.empty() ? "" : ",", extra);
  if (all.empty()) return std::string(name);
  return absl::StrCat(name, "{", all, "}");
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AddProcessCollectors(MetricsRegistry* r) {
  // Registered for the life of the process.
  static CollectorHandles* handles = new CollectorHandles;
  handles->push_back(r->AddCollector(
      "process_resident_memory_bytes", "Resident memory size in bytes.",
      MetricType::kGauge, [](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(ResidentBytes())});
      }));
  handles->push_back(r->AddCollector(
      "tessera_process_peak_resident_memory_bytes",
      "Peak resident memory size in bytes (VmHWM).", MetricType::kGauge,
      [](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(PeakResidentBytes())});
      }));
  handles->push_back(r->AddCollector(
      "process_cpu_seconds_total",
      "Total user and system CPU time spent in seconds.",
      MetricType::kCounter, [](MetricSamples* out) {
        struct rusage u;
        if (getrusage(RUSAGE_SELF, &u) != 0) return;
        const double s = u.ru_utime.tv_sec + u.ru_stime.tv_sec +
                         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
        out->push_back({{}, s});
      }));
  const double start = ProcessStartTimeSeconds();
  if (start > 0) {
    handles->push_back(r->AddCollector(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        MetricType::kGauge,
        [start](MetricSamples* out) { out->push_back({{}, start}); }));
  }
}

}  // namespace

// --- Histogram ----------------------------------------------------------------

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    METRICS_CHECK(std::isfinite(bounds_[i])) << "histogram bound " << bounds_[i];
    METRICS_CHECK(i == 0 || bounds_[i] > bounds_[i - 1])
        << "histogram bounds must increase";
  }
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double v) {
  const size_t i = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.buckets.resize(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    s.buckets[i] = buckets_[i].load(std::memory_order_relaxed);
    s.count += s.buckets[i];
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double>* b = new std::vector<double>{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
      0.01,    0.025,  0.05,    0.1,    0.25,  0.5,    1,
      2.5,     5,      10};
  return *b;
}

const std::vector<double>& DurationBuckets() {
  static const std::vector<double>* b = new std::vector<double>{
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
      2.5,   5,      10,    30,   60,    120,  300};
  return *b;
}

// --- CollectorHandle ----------------------------------------------------------

CollectorHandle::CollectorHandle(CollectorHandle&& other) noexcept
    : entry_(std::move(other.entry_)) {}

CollectorHandle& CollectorHandle::operator=(CollectorHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    entry_ = std::move(other.entry_);
  }
  return *this;
}

void CollectorHandle::Reset() {
  if (entry_ == nullptr) return;
  {
    // Waits for a scrape that is running the collector.
    absl::MutexLock lock(&entry_->mu);
    entry_->fn = nullptr;
  }
  entry_.reset();
}

// --- MetricsRegistry ----------------------------------------------------------

MetricsRegistry& MetricsRegistry::Global() {
  static MetricsRegistry* global = [] {
    auto* r = new MetricsRegistry;
    AddProcessCollectors(r);
    return r;
  }();
  return *global;
}

MetricsRegistry::Family& MetricsRegistry::FamilyLocked(std::string_view name,
                                                       std::string_view help,
                                                       MetricType type) {
  METRICS_CHECK(ValidName(name, /*label=*/false)) << "bad metric name '" << name << "'";
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family()).first;
    it->second.type = type;
    it->second.help = std::string(help);
  }
  METRICS_CHECK(it->second.type == type)
      << "metric " << name << " used as a " << TypeName(type) << " and a "
      << TypeName(it->second.type);
  return it->second;
}

MetricsRegistry::Series& MetricsRegistry::SeriesLocked(
    std::string_view name, Family& family, const MetricLabels& labels) {
  for (const auto& [label, value] : labels) {
    METRICS_CHECK(ValidName(label, /*label=*/true) && label != "le")
        << "bad label name '" << label << "' of metric " << name;
  }
  std::string key = SerializeLabels(labels);
  auto it = family.series.find(key);
  if (it != family.series.end()) return it->second;
  MetricLabels use = labels;
  if (family.series.size() >= kMaxSeriesPerFamily) {
    if (!family.overflow_warned) {
      family.overflow_warned = true;
      TESSERA_LOG(WARNING) << "metric " << name << " has "
                           << kMaxSeriesPerFamily
                           << " series; further label sets are counted under "
                              "label values \"other\"";
    }
    for (auto& [label, value] : use) value = "other";
    key = SerializeLabels(use);
    it = family.series.find(key);
    if (it != family.series.end()) return it->second;
  }
  Series& s = family.series[key];
  s.labels = std::move(use);
  return s;
}

Counter* MetricsRegistry::GetCounter(std::string_view name,
                                     std::string_view help,
                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family& f = FamilyLocked(name, help, MetricType::kCounter);
  Series& s = SeriesLocked(name, f, labels);
  if (s.counter == nullptr) s.counter = std::make_unique<Counter>();
  return s.counter.get();
}

Gauge* MetricsRegistry::GetGauge(std::string_view name, std::string_view help,
                                 const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family& f = FamilyLocked(name, help, MetricType::kGauge);
  Series& s = SeriesLocked(name, f, labels);
  if (s.gauge == nullptr) s.gauge = std::make_unique<Gauge>();
  return s.gauge.get();
}

Histogram* MetricsRegistry::GetHistogram(std::string_view name,
                                         std::string_view help,
                                         const std::vector<double>& bounds,
                                         const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family& f = FamilyLocked(name, help, MetricType::kHistogram);
  if (f.series.empty()) f.bounds = bounds;
  METRICS_CHECK(f.bounds == bounds) << "histogram " << name
                            << " used with two bucket layouts";
  Series& s = SeriesLocked(name, f, labels);
  if (s.histogram == nullptr) s.histogram = std::make_unique<Histogram>(bounds);
  return s.histogram.get();
}

CollectorHandle MetricsRegistry::AddCollector(std::string_view name,
                                              std::string_view help,
                                              MetricType type, CollectFn fn) {
  METRICS_CHECK(type != MetricType::kHistogram) << "histograms are not collected";
  auto entry = std::make_shared<CollectorHandle::Entry>();
  {
    absl::MutexLock lock(&entry->mu);
    entry->fn = std::move(fn);
  }
  absl::MutexLock lock(&mu_);
  Family& f = FamilyLocked(name, help, type);
  std::erase_if(f.collectors, [](const auto& w) { return w.expired(); });
  f.collectors.push_back(entry);
  return CollectorHandle(std::move(entry));
}

std::string MetricsRegistry::TextExposition() const {
  struct Out {
    std::string name;
    MetricType type;
    std::string help;
    // Counters and gauges: serialized labels -> value (summed).
    std::map<std::string, double> values;
    std::string histogram_text;
    std::vector<std::shared_ptr<CollectorHandle::Entry>> collectors;
  };
  std::vector<Out> outs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, f] : families_) {
      Out o;
      o.name = name;
      o.type = f.type;
      o.help = f.help;
      for (const auto& [key, s] : f.series) {
        if (s.counter != nullptr) {
          o.values[key] += static_cast<double>(s.counter->value());
        } else if (s.gauge != nullptr) {
          o.values[key] += s.gauge->value();
        } else if (s.histogram != nullptr) {
          const Histogram::Snapshot snap = s.histogram->snapshot();
          uint64_t cumulative = 0;
          for (size_t i = 0; i < snap.buckets.size(); ++i) {
            cumulative += snap.buckets[i];
            const std::string le =
                i < f.bounds.size() ? FormatMetricValue(f.bounds[i]) : "+Inf";
            absl::StrAppend(&o.histogram_text,
                            SampleName(absl::StrCat(name, "_bucket"), key,
                                       absl::StrCat("le=\"", le, "\"")),
                            " ", cumulative, "\n");
          }
          absl::StrAppend(&o.histogram_text,
                          SampleName(absl::StrCat(name, "_sum"), key), " ",
                          FormatMetricValue(snap.sum), "\n",
                          SampleName(absl::StrCat(name, "_count"), key), " ",
                          snap.count, "\n");
        }
      }
      for (const auto& w : f.collectors) {
        if (std::shared_ptr<CollectorHandle::Entry> e = w.lock())
          o.collectors.push_back(std::move(e));
      }
      outs.push_back(std::move(o));
    }
  }
  // Collectors run without the registry's lock: they take their owners'
  // locks, and an owner may make series while holding those.
  std::string text;
  for (Out& o : outs) {
    MetricSamples samples;
    for (const auto& e : o.collectors) {
      absl::MutexLock lock(&e->mu);
      if (e->fn) e->fn(&samples);
    }
    for (const MetricSample& s : samples)
      o.values[SerializeLabels(s.labels)] += s.value;
    if (o.values.empty() && o.histogram_text.empty()) continue;
    absl::StrAppend(&text, "# HELP ", o.name, " ", EscapeHelp(o.help), "\n",
                    "# TYPE ", o.name, " ", TypeName(o.type), "\n");
    for (const auto& [key, value] : o.values) {
      absl::StrAppend(&text, SampleName(o.name, key), " ",
                      FormatMetricValue(value), "\n");
    }
    text += o.histogram_text;
  }
  return text;
}

// --- Text format --------------------------------------------------------------

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 9.007199254740992e15)
    return absl::StrCat(static_cast<int64_t>(value));
  // The shortest form that reads back as the same double.
  for (int digits = 15; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, value);
    if (std::strtod(s.c_str(), nullptr) == value) return s;
  }
  return absl::StrFormat("%.17g", value);
}

}  // namespace tessera

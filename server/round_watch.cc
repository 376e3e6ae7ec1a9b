#include "server/round_watch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace tessera {
namespace {

// Lines of one CheckLate; the rest are counted in a last line.
constexpr size_t kMaxLateLines = 20;
// Ranks named in a line; a longer list ends with how many there are.
constexpr size_t kMaxRanksNamed = 16;
// Weight of the newest round in a rank's mean lag.
constexpr double kLagWeight = 0.2;

std::vector<double> LagBuckets() {
  return {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
          0.2,   0.5,   1,     2,    5,    10,   30};
}

std::string Short(absl::Duration d) {
  if (d >= absl::Seconds(1))
    return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(100)));
  if (d >= absl::Milliseconds(1))
    return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(1)));
  return absl::FormatDuration(absl::Trunc(d, absl::Microseconds(1)));
}

std::string RankList(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  if (ranks.size() <= kMaxRanksNamed) return absl::StrJoin(ranks, ", ");
  return absl::StrCat(
      absl::StrJoin(ranks.begin(), ranks.begin() + kMaxRanksNamed, ", "),
      ", ... (", ranks.size(), " in all)");
}

}  // namespace

void RoundWatch::SetInJob(int rank, bool in_job) {
  if (rank < 0 || rank >= num_workers_) return;
  absl::MutexLock lock(&mu_);
  in_job_[rank] = in_job;
}

RoundWatch::RoundWatch(int num_workers, Options options)
    : num_workers_(num_workers), options_(options) {
  {
    absl::MutexLock lock(&mu_);
    lag_.resize(num_workers);
    in_job_.assign(num_workers, true);
  }
  MetricsRegistry& r = MetricsRegistry::Global();
  auto slowest = [this](bool lag) {
    return [this, lag](MetricSamples* out) {
      absl::MutexLock lock(&mu_);
      int rank = -1;
      double worst = -1;
      for (int i = 0; i < static_cast<int>(lag_.size()); ++i) {
        if (lag_[i].rounds > 0 && lag_[i].mean_s > worst) {
          worst = lag_[i].mean_s;
          rank = i;
        }
      }
      if (rank < 0) return;
      out->push_back({{}, lag ? worst : static_cast<double>(rank)});
    };
  };
  metric_handles_.push_back(r.AddCollector(
      "tessera_server_slowest_rank",
      "dist_sync: the worker rank whose pushes arrive last in its rounds "
      "(largest mean arrival lag over recent rounds).",
      MetricType::kGauge, slowest(false)));
  metric_handles_.push_back(r.AddCollector(
      "tessera_server_slowest_rank_lag_seconds",
      "dist_sync: the slowest rank's mean arrival lag (from a round's first "
      "push to its push) over recent rounds.",
      MetricType::kGauge, slowest(true)));
  if (options_.check_every > absl::ZeroDuration())
    thread_ = std::thread([this] { Loop(); });
}

RoundWatch::~RoundWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void RoundWatch::PushTaken(uint64_t key, uint64_t offset, int rank,
                           absl::Time round_started, absl::Time now,
                           bool count_lag) {
  if (rank < 0 || rank >= num_workers_) return;
  const double lag_s = absl::ToDoubleSeconds(now - round_started);
  Histogram* histogram;
  {
    absl::MutexLock lock(&mu_);
    Open& o = open_[{key, offset}];
    if (o.in.empty() || o.started != round_started) {
      o.in.assign(num_workers_, false);
      o.started = round_started;
      o.next_report = absl::ZeroDuration();
    }
    o.in[rank] = true;
    if (!count_lag) return;
    Lag& l = lag_[rank];
    l.mean_s = l.rounds == 0 ? lag_s
                             : (1 - kLagWeight) * l.mean_s + kLagWeight * lag_s;
    ++l.rounds;
    histogram = l.histogram;
  }
  if (histogram == nullptr) {
    histogram = MetricsRegistry::Global().GetHistogram(
        "tessera_server_arrival_lag_seconds",
        "dist_sync: from a round's first push to each worker's push, by rank "
        "(the first 255 ranks; the others under rank=\"other\").",
        LagBuckets(), {{"rank", absl::StrCat(rank)}});
    absl::MutexLock lock(&mu_);
    lag_[rank].histogram = histogram;
  }
  histogram->Observe(lag_s);
}

void RoundWatch::RoundDone(uint64_t key, uint64_t offset,
                           absl::Time round_started, absl::Time now) {
  absl::MutexLock lock(&mu_);
  open_.erase({key, offset});
  std::deque<absl::Duration>& recent = recent_[{key, offset}];
  recent.push_back(now - round_started);
  if (recent.size() > kRecentRounds) recent.pop_front();
}

void RoundWatch::Waiting(uint64_t key, uint64_t offset, size_t count) {
  absl::MutexLock lock(&mu_);
  if (count == 0) {
    waiting_.erase({key, offset});
  } else {
    waiting_[{key, offset}] = count;
  }
}

absl::Duration RoundWatch::MedianLocked(const Slice& slice) const {
  auto it = recent_.find(slice);
  if (it == recent_.end() || it->second.empty()) return absl::ZeroDuration();
  std::vector<absl::Duration> d(it->second.begin(), it->second.end());
  std::nth_element(d.begin(), d.begin() + d.size() / 2, d.end());
  return d[d.size() / 2];
}

absl::Duration RoundWatch::ThresholdLocked(const Slice& slice) const {
  const absl::Duration median = MedianLocked(slice);
  if (median == absl::ZeroDuration()) return 10 * options_.late_min;
  return std::max(options_.late_min, options_.late_factor * median);
}

void RoundWatch::Fill(wire::DebugPending* out, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<absl::Time, Slice>> by_age;
  for (const auto& [slice, o] : open_) by_age.push_back({o.started, slice});
  const size_t listed = std::min(by_age.size(), kMaxListed);
  std::partial_sort(by_age.begin(), by_age.begin() + listed, by_age.end());
  by_age.resize(listed);
  out->set_open_rounds_total(out->open_rounds_total() +
                             static_cast<int32_t>(open_.size()));
  for (const auto& [started, slice] : by_age) {
    const Open& o = open_.at(slice);
    wire::OpenRound* r = out->add_open_rounds();
    r->set_key(slice.first);
    r->set_offset(slice.second);
    for (int rank = 0; rank < num_workers_; ++rank) {
      if (o.in[rank]) {
        r->add_ranks_in(rank);
      } else if (in_job_[rank]) {
        r->add_ranks_missing(rank);
      }
    }
    r->set_age_s(absl::ToDoubleSeconds(now - o.started));
    r->set_median_round_s(absl::ToDoubleSeconds(MedianLocked(slice)));
  }
  std::vector<std::pair<size_t, Slice>> by_count;
  for (const auto& [slice, count] : waiting_)
    by_count.push_back({count, slice});
  const size_t held = std::min(by_count.size(), kMaxListed);
  std::partial_sort(by_count.begin(), by_count.begin() + held, by_count.end(),
                    [](const auto& a, const auto& b) {
                      return a.first != b.first ? a.first > b.first
                                                : a.second < b.second;
                    });
  by_count.resize(held);
  out->set_waiting_total(out->waiting_total() +
                         static_cast<int32_t>(waiting_.size()));
  for (const auto& [count, slice] : by_count) {
    wire::WaitingCount* w = out->add_waiting();
    w->set_key(slice.first);
    w->set_offset(slice.second);
    w->set_count(static_cast<int32_t>(count));
  }
  std::vector<std::pair<double, int>> ranks;  // mean lag, rank
  for (int rank = 0; rank < num_workers_; ++rank)
    if (lag_[rank].rounds > 0) ranks.push_back({lag_[rank].mean_s, rank});
  std::stable_sort(
      ranks.begin(), ranks.end(),
      [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [mean, rank] : ranks) {
    wire::RankLag* l = out->add_rank_lag();
    l->set_rank(rank);
    l->set_mean_lag_s(mean);
    l->set_rounds(lag_[rank].rounds);
  }
}

std::vector<std::string> RoundWatch::CheckLate(absl::Time now) {
  absl::MutexLock lock(&mu_);
  // The oldest late round of each key, and all its late slices (each is
  // reported with its key, and again only once its wait has doubled).
  struct Late {
    Slice oldest;
    absl::Duration age;
    std::vector<Open*> slices;
  };
  std::map<uint64_t, Late> late;
  for (auto& [slice, o] : open_) {
    const absl::Duration age = now - o.started;
    const absl::Duration threshold = ThresholdLocked(slice);
    if (age < threshold || age < o.next_report) continue;
    auto [it, added] = late.try_emplace(slice.first, Late{slice, age, {}});
    if (!added && age > it->second.age) {
      it->second.oldest = slice;
      it->second.age = age;
    }
    it->second.slices.push_back(&o);
  }
  std::vector<std::string> lines;
  for (const auto& [key, found] : late) {
    if (lines.size() == kMaxLateLines) {
      // Not reported: named at the next look.
      lines.push_back(absl::StrCat("... and ", late.size() - kMaxLateLines,
                                   " more key(s) with late rounds"));
      break;
    }
    for (Open* o : found.slices) o->next_report = 2 * (now - o->started);
    const Slice& slice = found.oldest;
    const absl::Duration age = found.age;
    const Open& o = open_.at(slice);
    std::vector<int> in, missing;
    for (int rank = 0; rank < num_workers_; ++rank) {
      if (o.in[rank]) {
        in.push_back(rank);
      } else if (in_job_[rank]) {
        missing.push_back(rank);
      }
    }
    const absl::Duration median = MedianLocked(slice);
    const std::string why =
        median == absl::ZeroDuration()
            ? std::string("no round of the key has completed here yet")
            : absl::StrCat(static_cast<int64_t>(age / median),
                           "x the key's recent median round of ",
                           Short(median));
    lines.push_back(absl::StrCat(
        "dist_sync round of key ", key, " has waited ", Short(age), " for ",
        missing.size() == 1 ? "rank " : "ranks ", RankList(missing), " (", why,
        "; ranks in: ", RankList(in), ")"));
  }
  return lines;
}

void RoundWatch::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.check_every);
      if (stop_) return;
    }
    for (const std::string& line : CheckLate(absl::Now()))
      TESSERA_LOG(WARNING) << line;
  }
}

}  // namespace tessera

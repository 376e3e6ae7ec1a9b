#include "tools/bench/bench_worker.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "tessera/kv_worker.h"
#include "tools/bench/bench_util.h"

namespace tessera::bench {

std::string FormatSample(const WorkerSample& s) {
  return absl::StrCat("BENCH rank=", s.rank, " op=", s.op, " size=", s.size,
                      " inflight=", s.inflight, " iters=", s.iterations,
                      " seconds=", s.seconds, " p50_us=", s.p50_us,
                      " p99_us=", s.p99_us);
}

bool ParseSample(const std::string& line, WorkerSample* s) {
  std::vector<std::string> fields =
      absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (fields.empty() || fields[0] != "BENCH") return false;
  for (size_t i = 1; i < fields.size(); ++i) {
    std::pair<std::string, std::string> kv =
        absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
    const std::string& k = kv.first;
    const std::string& v = kv.second;
    bool ok = true;
    if (k == "rank")
      ok = absl::SimpleAtoi(v, &s->rank);
    else if (k == "op")
      s->op = v;
    else if (k == "size")
      ok = absl::SimpleAtoi(v, &s->size);
    else if (k == "inflight")
      ok = absl::SimpleAtoi(v, &s->inflight);
    else if (k == "iters")
      ok = absl::SimpleAtoi(v, &s->iterations);
    else if (k == "seconds")
      ok = absl::SimpleAtod(v, &s->seconds);
    else if (k == "p50_us")
      ok = absl::SimpleAtod(v, &s->p50_us);
    else if (k == "p99_us")
      ok = absl::SimpleAtod(v, &s->p99_us);
    if (!ok) return false;
  }
  return true;
}

namespace {

// Keys: size index * 16 + slot; one slot per outstanding request.
constexpr uint64_t kSlotsPerSize = 16;

class BenchWorker {
 public:
  BenchWorker(const WorkerPlan& plan, std::unique_ptr<KVWorker> kv)
      : plan_(plan), kv_(std::move(kv)) {
    for (int n : plan_.inflight) slots_ = std::max(slots_, n);
  }

  absl::Status Run() {
    if (absl::Status s = kv_->SetOptimizer(plan_.optimizer); !s.ok()) return s;
    for (size_t i = 0; i < plan_.sizes.size(); ++i) {
      const size_t n = plan_.sizes[i] / sizeof(float);
      std::vector<float> init(n, 0.5f);
      for (int slot = 0; slot < slots_; ++slot) {
        if (absl::Status s = kv_->Init(i * kSlotsPerSize + slot, init); !s.ok())
          return s;
      }
    }
    for (size_t i = 0; i < plan_.sizes.size(); ++i) {
      const size_t n = plan_.sizes[i] / sizeof(float);
      grads_.assign(slots_, std::vector<float>(n, 1e-3f));
      outs_.assign(slots_, std::vector<float>(n, 0.0f));
      views_.assign(slots_, PulledValue());
      for (const std::string& op : plan_.ops) {
        for (int inflight : plan_.inflight) {
          absl::Status s = Measure(i, op, inflight);
          if (!s.ok()) return s;
        }
      }
    }
    return kv_->Close();
  }

 private:
  absl::StatusOr<OpHandle> Issue(const std::string& op, uint64_t key,
                                 int slot) {
    if (op == "push") return kv_->PushAsync(key, grads_[slot]);
    if (op == "pull") return kv_->PullAsync(key, absl::MakeSpan(outs_[slot]));
    // The view of the previous pull in this slot is dropped here, as a
    // program done with it would.
    if (op == "pullview") return kv_->PullViewAsync(key, &views_[slot]);
    return kv_->PushPullAsync(key, grads_[slot], absl::MakeSpan(outs_[slot]));
  }

  // Runs `count` operations with up to `inflight` outstanding; per-operation
  // latencies go to `latencies_us` when given.
  absl::Status Loop(size_t size_index, const std::string& op, int inflight,
                    int count, std::vector<double>* latencies_us) {
    std::vector<OpHandle> handles(inflight);
    std::vector<double> started(inflight);
    int issued = 0, done = 0;
    while (done < count) {
      while (issued < count && issued - done < inflight) {
        const int slot = issued % inflight;
        started[slot] = NowSeconds();
        absl::StatusOr<OpHandle> h =
            Issue(op, size_index * kSlotsPerSize + slot, slot);
        if (!h.ok()) return h.status();
        handles[slot] = *h;
        ++issued;
      }
      const int slot = done % inflight;
      if (absl::Status s = kv_->Wait(handles[slot]); !s.ok()) return s;
      if (latencies_us != nullptr)
        latencies_us->push_back((NowSeconds() - started[slot]) * 1e6);
      ++done;
    }
    return absl::OkStatus();
  }

  absl::Status Measure(size_t size_index, const std::string& op, int inflight) {
    const int iterations = plan_.iterations[size_index];
    const int warmup = std::max(2, iterations / 10);
    if (absl::Status s = kv_->Barrier(); !s.ok()) return s;
    if (absl::Status s = Loop(size_index, op, inflight, warmup, nullptr);
        !s.ok())
      return s;
    if (absl::Status s = kv_->Barrier(); !s.ok()) return s;
    std::vector<double> latencies;
    latencies.reserve(iterations);
    const double t0 = NowSeconds();
    absl::Status s = Loop(size_index, op, inflight, iterations,
                          inflight == 1 ? &latencies : nullptr);
    const double t1 = NowSeconds();
    if (!s.ok()) return s;
    WorkerSample sample;
    sample.rank = kv_->rank();
    sample.op = op;
    sample.size = plan_.sizes[size_index];
    sample.inflight = inflight;
    sample.iterations = iterations;
    sample.seconds = t1 - t0;
    const LatencyStats l = Percentiles(latencies);
    sample.p50_us = l.p50_us;
    sample.p99_us = l.p99_us;
    std::cout << FormatSample(sample) << std::endl;
    return absl::OkStatus();
  }

  const WorkerPlan plan_;
  std::unique_ptr<KVWorker> kv_;
  int slots_ = 1;
  std::vector<std::vector<float>> grads_;
  std::vector<std::vector<float>> outs_;
  std::vector<PulledValue> views_;
};

}  // namespace

int RunBenchWorker(const WorkerPlan& plan) {
  absl::StatusOr<std::unique_ptr<KVWorker>> kv = KVWorker::Create("dist_sync");
  if (!kv.ok()) {
    std::cerr << "tessera-bench worker: " << kv.status() << "\n";
    return 1;
  }
  BenchWorker worker(plan, *std::move(kv));
  absl::Status s = worker.Run();
  if (!s.ok()) {
    std::cerr << "tessera-bench worker: " << s << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tessera::bench

// model_replay: replays a real model's communication and compute on a real
// Tessera job (issue #48's measuring instrument): one key per parameter
// tensor of ResNet-50, VGG-16 or BERT-base (tools/bench/model_zoo.h has the
// shapes and where they come from), and each layer's forward and backward
// compute as a wait of its FLOPs at a stated device rate, so the replay needs
// no GPU and leaves the CPU to communication.
//
//   tools/launch.py -n 2 -s 2 build/tools/bench/model_replay --model=resnet50
//       --batch=32 --tflops=15 --steps=10 --link-gbps=10 --metrics-out=r{rank}.json
//   build/tools/bench/model_replay --model=vgg16 --describe   # no job: shapes
//
// A step, as a training loop with a pre-forward hook and gradient hooks runs it:
//   forward   layer by layer in forward order; before each layer's forward,
//             Wait for the previous step's push and pull of each of its keys
//             (nothing to wait for in the first step), then its forward time
//   backward  layer by layer in reverse order: its backward time (2 x its
//             forward), then for each of its tensors PushAsync(gradient) and
//             at once PullAsync(weights) (the server answers the pull when
//             the round with this push is applied)
// The device is a clock of its own: a layer starts when the previous layer
// ended or, when its forward had to wait for weights, when they arrived, so
// the sleeps' own lateness does not add up over a hundred layers. Keys are
// Init in forward order (key i: the i-th tensor); rank 0's weights are
// stored. --order=fifo: every queue keeps issue order (backward order;
// TESSERA_SEND_ORDER=fifo); --order=priority: each key's default priority
// (the first layer most urgent) orders the worker's sealed sending queues and
// the servers' (docs/priority.md). --gc=2bit sets 2-bit gradient compression
// (pulls stay float32).
//
// Printed per worker, one JSON object on stdout (and to --metrics-out, {rank}
// replaced by the rank):
//   step_ms, median_step_ms   each timed step: from the start of one step's
//                       forward to the next one's (the last: to the end of
//                       its backward, where the next forward would start);
//                       median over the steps after --warmup. A step's own
//                       communication is waited for in the next step's
//                       forward, so each interval holds one step's waiting
//   median_wait_ms, median_first_wait_ms   how long a timed step's forward
//                       waited for weights: all its layers, and the first
//                       layer alone (what sending the first layer first saves)
//   compute_ms          forward + backward of every layer at --tflops for
//                       --batch samples: the compute-only bound
//   measured_compute_ms the same schedule replayed with no job (sleeps only,
//                       median of 3 steps): a same-run check of the waits
//   bytes_pushed_per_step, bytes_pulled_per_step   what one worker sends
//                       and receives a step, from the shapes and the key
//                       layout (common/key_layout.h, TESSERA_BIGARRAY_BOUND,
//                       TESSERA_CHUNK_BYTES, 2-bit codes per slice);
//                       measured_bytes_*: KVWorker::stats() over all steps /
//                       steps, which must be equal
//   server_bytes_in_per_step, server_bytes_out_per_step   per server rank:
//                       every worker's pushes to it / pulls from it
//   link_ms             with --link-gbps: the busiest direction of the
//                       busiest node's link (each node has its own full-duplex
//                       link of that rate, as tools/bench/shaped_link.py
//                       builds them): max over the workers' up (pushed) and
//                       down (pulled) and the servers' in and out bytes, at
//                       the rate; busiest_link names it. Not push + pull:
//                       the two travel in opposite directions at once.
//   overlap_bound_ms    max(compute_ms, link_ms): the step with communication
//                       perfectly overlapped (compute_ms without --link-gbps)
//
// Exit code 0 on success, 1 when an operation failed, 2 on bad flags.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/compression/two_bit.h"
#include "common/key_layout.h"
#include "common/options.h"
#include "tessera/kv_worker.h"
#include "tools/bench/bench_util.h"
#include "tools/bench/model_zoo.h"

namespace tessera::bench {
namespace {

constexpr char kUsage[] =
    R"(usage: model_replay [flags]   (as a worker of a job, or with --describe)
  --model=resnet50|vgg16|bert-base|mlp   the model replayed (default resnet50)
  --batch=32            samples per worker a step
  --seq-len=128         tokens a sample (bert-base)
  --tflops=15           the device's rate, 10^12 FLOP/s (15: V100-class fp32)
  --steps=10 --warmup=2 timed steps (median reported), untimed first steps
  --order=fifo|priority the order pushes and pulls are sent in (fifo: issue
                        order; priority: the first layer's first)
  --gc=none|2bit        gradient compression of the pushes
  --threshold=0.5       2-bit threshold
  --optimizer="sgd lr=0.01"   the servers' optimizer
  --link-gbps=G         each node's link, Gbit/s, for the perfect-overlap bound
  --metrics-out=PATH    also write the JSON there ({rank}: the rank)
  --describe            no job: print the model's layers, tensors and bounds
)";

struct Flags {
  std::string model = "resnet50";
  int batch = 32;
  int seq_len = 128;
  double tflops = 15;
  int steps = 10;
  int warmup = 2;
  std::string order = "fifo";
  std::string gc = "none";
  float threshold = 0.5f;
  std::string optimizer = "sgd lr=0.01";
  double link_gbps = 0;
  std::string metrics_out;
  bool describe = false;
};

// One flag of the form --name=value into `f`; false with *expected set when
// the value is bad, InvalidArgument for an unknown flag.
absl::StatusOr<bool> ParseOne(const std::string& a, Flags* f,
                              std::string* expected) {
  std::string v;
  if (TakeFlag(a, "model", &v)) {
    f->model = v;
    return true;  // checked by MakeModel
  } else if (TakeFlag(a, "batch", &v)) {
    *expected = "1..65536";
    return absl::SimpleAtoi(v, &f->batch) && f->batch >= 1 && f->batch <= 65536;
  } else if (TakeFlag(a, "seq-len", &v)) {
    *expected = "1..512";
    return absl::SimpleAtoi(v, &f->seq_len);
  } else if (TakeFlag(a, "tflops", &v)) {
    *expected = "a number > 0";
    return absl::SimpleAtod(v, &f->tflops) && f->tflops > 0;
  } else if (TakeFlag(a, "steps", &v)) {
    *expected = "1..10000";
    return absl::SimpleAtoi(v, &f->steps) && f->steps >= 1 && f->steps <= 10000;
  } else if (TakeFlag(a, "warmup", &v)) {
    *expected = "0..100";
    return absl::SimpleAtoi(v, &f->warmup) && f->warmup >= 0 &&
           f->warmup <= 100;
  } else if (TakeFlag(a, "order", &v)) {
    f->order = v;
    *expected = "fifo or priority";
    return v == "fifo" || v == "priority";
  } else if (TakeFlag(a, "gc", &v)) {
    f->gc = v;
    *expected = "none or 2bit";
    return v == "none" || v == "2bit";
  } else if (TakeFlag(a, "threshold", &v)) {
    *expected = "a number > 0";
    return absl::SimpleAtof(v, &f->threshold) && f->threshold > 0;
  } else if (TakeFlag(a, "optimizer", &v)) {
    f->optimizer = v;
    return true;
  } else if (TakeFlag(a, "link-gbps", &v)) {
    *expected = "a number >= 0 (0: no link bound)";
    return absl::SimpleAtod(v, &f->link_gbps) && f->link_gbps >= 0;
  } else if (TakeFlag(a, "metrics-out", &v)) {
    f->metrics_out = v;
    return true;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown argument '", a, "'"));
}

absl::StatusOr<Flags> ParseFlags(const std::vector<std::string>& args) {
  Flags f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--describe") {
      f.describe = true;
      continue;
    }
    if (a == "--metrics-out" && i + 1 < args.size()) {
      f.metrics_out = args[++i];  // as tools/bench/shaped_link.py passes it
      continue;
    }
    std::string expected;
    absl::StatusOr<bool> ok = ParseOne(a, &f, &expected);
    if (!ok.ok()) return ok.status();
    if (!*ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", a, "': expected ", expected));
    }
  }
  return f;
}

// Per layer, seconds of forward and of backward on the stated device.
struct Compute {
  std::vector<double> forward_s;
  std::vector<double> backward_s;
  double total_s = 0;
};

Compute ComputeOf(const ModelSpec& m, const Flags& f) {
  Compute c;
  for (const LayerSpec& l : m.layers) {
    const double fwd = l.forward_flops * f.batch / (f.tflops * 1e12);
    c.forward_s.push_back(fwd);
    c.backward_s.push_back(2 * fwd);
    c.total_s += 3 * fwd;
  }
  return c;
}

// What a step moves, from the shapes and the key layout a worker uses.
struct Traffic {
  uint64_t pushed = 0;  // by one worker
  uint64_t pulled = 0;
  std::vector<uint64_t> server_in;   // every worker's pushes, per server
  std::vector<uint64_t> server_out;  // every worker's pulls, per server
};

// The parts of a key of n values, as (server, values): KeyPartitioner's
// placement, whose arithmetic common/key_layout.h holds: whole on the key's
// home server below the bound, else split evenly over the servers.
std::vector<std::pair<int, uint64_t>> PartsOf(uint64_t key, uint64_t n,
                                              int servers, uint64_t bound) {
  if (n < bound || servers == 1) return {{KeyHome(key, servers), n}};
  std::vector<std::pair<int, uint64_t>> parts;
  for (int s = 0; s < servers; ++s) {
    const uint64_t len =
        SplitPartBegin(n, s + 1, servers) - SplitPartBegin(n, s, servers);
    if (len > 0) parts.push_back({s, len});
  }
  return parts;
}

// Each part travels in slices of chunk_elements values; a 2-bit push codes
// each slice on its own (padded to 16 values).
Traffic TrafficOf(const ModelSpec& m, int workers, int servers, uint64_t bound,
                  uint64_t chunk_elements, bool two_bit) {
  Traffic t;
  t.server_in.assign(servers, 0);
  t.server_out.assign(servers, 0);
  uint64_t key = 0;
  for (const LayerSpec& l : m.layers) {
    for (const ParamSpec& p : l.params) {
      for (const auto& [server, len] :
           PartsOf(key++, p.size(), servers, bound)) {
        for (uint64_t at = 0; at < len; at += chunk_elements) {
          const uint64_t slice = std::min(chunk_elements, len - at);
          const uint64_t up = two_bit
                                  ? compression::TwoBitCompressedBytes(slice)
                                  : slice * sizeof(float);
          const uint64_t down = slice * sizeof(float);
          t.pushed += up;
          t.pulled += down;
          t.server_in[server] += up * workers;
          t.server_out[server] += down * workers;
        }
      }
    }
  }
  return t;
}

struct LinkBound {
  double ms = 0;
  std::string busiest;  // e.g. "worker down", "server 1 in"
};

LinkBound LinkOf(const Traffic& t, double gbps) {
  LinkBound b;
  if (gbps <= 0) return b;
  std::vector<std::pair<uint64_t, std::string>> links = {
      {t.pushed, "worker up"}, {t.pulled, "worker down"}};
  for (size_t s = 0; s < t.server_in.size(); ++s) {
    links.push_back({t.server_in[s], absl::StrCat("server ", s, " in")});
    links.push_back({t.server_out[s], absl::StrCat("server ", s, " out")});
  }
  const auto& top = *std::max_element(
      links.begin(), links.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  b.ms = top.first * 8.0 / (gbps * 1e9) * 1e3;
  b.busiest = top.second;
  return b;
}

std::string JsonList(const std::vector<double>& v) {
  std::vector<std::string> s;
  for (double x : v) s.push_back(absl::StrFormat("%.3f", x));
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

std::string JsonList(const std::vector<uint64_t>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ","), "]");
}

void Emit(const Flags& flags, int rank, const std::string& json) {
  std::fputs(json.c_str(), stdout);
  std::fflush(stdout);
  if (flags.metrics_out.empty()) return;
  const std::string path = absl::StrReplaceAll(
      flags.metrics_out, {{"{rank}", std::to_string(rank)}});
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::cerr << "model_replay: cannot write --metrics-out " << path << "\n";
    return;
  }
  std::fputs(json.c_str(), f);
  std::fclose(f);
}

// The device: a clock that runs layers back to back, each starting when the
// previous one ended or when its weights arrived, whichever is later.
class DeviceClock {
 public:
  // A layer of `seconds` whose inputs were ready at `ready_at` (0: before
  // the previous layer ended); sleeps until it ends.
  void Run(double seconds, double ready_at) {
    if (free_at_ == 0) free_at_ = NowSeconds();
    free_at_ = std::max(free_at_, ready_at) + seconds;
    const double left = free_at_ - NowSeconds();
    if (left > 0) absl::SleepFor(absl::Seconds(left));
  }

 private:
  double free_at_ = 0;
};

// Wait of an op that was already done takes less than this; a longer one
// means the layer waited for its weights.
constexpr double kBlockedSeconds = 50e-6;

// One worker's replay: the keys, their buffers and the ops of the last step.
class Replay {
 public:
  Replay(const ModelSpec& model, const Compute& compute, KVWorker* kv)
      : model_(model), compute_(compute), kv_(kv) {}

  // Inits every key in forward order (rank 0's weights are stored).
  absl::Status Init() {
    uint64_t largest = 0;
    for (const LayerSpec& l : model_.layers) {
      for (const ParamSpec& p : l.params) {
        weights_.emplace_back(p.size(), 0.01f);
        largest = std::max(largest, p.size());
      }
    }
    // One gradient buffer for every key (pushes only read it): uniform in
    // [-1, 1), so 2-bit codes have something to code.
    gradient_.resize(largest);
    std::mt19937 rng(1 + (kv_ == nullptr ? 0 : kv_->rank()));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : gradient_) x = u(rng);
    push_.assign(weights_.size(), 0);
    pull_.assign(weights_.size(), 0);
    pending_.assign(weights_.size(), false);
    if (kv_ == nullptr) return absl::OkStatus();
    for (size_t key = 0; key < weights_.size(); ++key) {
      if (absl::Status s = kv_->Init(key, weights_[key]); !s.ok()) return s;
    }
    return kv_->Barrier();
  }

  // Runs `steps` steps; (*starts)[i] is when step i began, and one more
  // entry when the step after the last would begin: a step's own pushes and
  // pulls are waited for in the next step's forward, so the last step's are
  // waited for after that entry (counting them too would count two steps'
  // communication in the last step).
  absl::Status Run(int steps, std::vector<double>* starts) {
    for (int step = 0; step < steps; ++step) {
      starts->push_back(NowSeconds());
      wait_s_.push_back(0);
      first_wait_s_.push_back(0);
      if (absl::Status s = Forward(); !s.ok())
        return Annotate(s, step, "forward");
      if (absl::Status s = Backward(); !s.ok())
        return Annotate(s, step, "backward");
    }
    starts->push_back(NowSeconds());
    for (size_t key = 0; key < pending_.size(); ++key) {
      if (absl::Status s = WaitKey(key); !s.ok())
        return Annotate(s, steps - 1, "the last pulls");
    }
    return absl::OkStatus();
  }

  // Per step, seconds its forward waited for weights: all layers, the first.
  const std::vector<double>& wait_s() const { return wait_s_; }
  const std::vector<double>& first_wait_s() const { return first_wait_s_; }

 private:
  static absl::Status Annotate(const absl::Status& s, int step,
                               const char* where) {
    return absl::Status(
        s.code(), absl::StrCat("step ", step, ", ", where, ": ", s.message()));
  }

  absl::Status WaitKey(size_t key) {
    if (!pending_[key]) return absl::OkStatus();
    pending_[key] = false;
    absl::Status push = kv_->Wait(push_[key]);
    absl::Status pull = kv_->Wait(pull_[key]);
    return push.ok() ? pull : push;
  }

  absl::Status Forward() {
    size_t key = 0;
    for (size_t l = 0; l < model_.layers.size(); ++l) {
      const double t0 = NowSeconds();
      for (size_t i = 0; i < model_.layers[l].params.size(); ++i) {
        if (absl::Status s = WaitKey(key + i); !s.ok()) return s;
      }
      const double t1 = NowSeconds();
      wait_s_.back() += t1 - t0;
      if (l == 0) first_wait_s_.back() = t1 - t0;
      device_.Run(compute_.forward_s[l], t1 - t0 > kBlockedSeconds ? t1 : 0);
      key += model_.layers[l].params.size();
    }
    return absl::OkStatus();
  }

  absl::Status Backward() {
    size_t end = weights_.size();
    for (size_t l = model_.layers.size(); l-- > 0;) {
      device_.Run(compute_.backward_s[l], 0);
      const size_t first = end - model_.layers[l].params.size();
      for (size_t key = first; kv_ != nullptr && key < end; ++key) {
        absl::Span<const float> g(gradient_.data(), weights_[key].size());
        absl::StatusOr<OpHandle> push = kv_->PushAsync(key, g);
        if (!push.ok()) return push.status();
        absl::StatusOr<OpHandle> pull =
            kv_->PullAsync(key, absl::MakeSpan(weights_[key]));
        if (!pull.ok()) {
          (void)kv_->Wait(*push);
          return pull.status();
        }
        push_[key] = *push;
        pull_[key] = *pull;
        pending_[key] = true;
      }
      end = first;
    }
    return absl::OkStatus();
  }

  const ModelSpec& model_;
  const Compute& compute_;
  KVWorker* kv_;  // nullptr: compute only
  DeviceClock device_;
  std::vector<std::vector<float>> weights_;  // per key, the pulls' buffers
  std::vector<float> gradient_;
  std::vector<OpHandle> push_, pull_;
  std::vector<bool> pending_;
  std::vector<double> wait_s_, first_wait_s_;
};

// Step times in ms: starts[i + 1] - starts[i] for the steps from `from` on.
std::vector<double> StepMs(const std::vector<double>& starts, int from) {
  std::vector<double> ms;
  for (size_t i = from; i + 1 < starts.size(); ++i)
    ms.push_back((starts[i + 1] - starts[i]) * 1e3);
  return ms;
}

// The sleeps-only replay of the same schedule, median ms of 3 steps.
double MeasuredComputeMs(const ModelSpec& m, const Compute& c) {
  Replay alone(m, c, nullptr);
  std::vector<double> starts;
  if (!alone.Init().ok() || !alone.Run(3, &starts).ok()) return 0;
  return Median(StepMs(starts, 0));
}

#define REPLAY_RETURN_IF_ERROR(expr, what)                         \
  do {                                                             \
    absl::Status _s = (expr);                                      \
    if (!_s.ok()) {                                                \
      std::cerr << "model_replay: " << what << ": " << _s << "\n"; \
      return 1;                                                    \
    }                                                              \
  } while (0)

struct Result {
  std::vector<double> step_ms;
  std::vector<double> wait_ms, first_wait_ms;  // per timed step
  double measured_compute_ms = 0;
  double pushed = 0, pulled = 0;  // KVWorker::stats() / step
};

std::string ResultJson(const Flags& f, const ModelSpec& m, const Compute& c,
                       const Traffic& t, KVWorker* kv, const Result& r) {
  const LinkBound link = LinkOf(t, f.link_gbps);
  const double compute_ms = c.total_s * 1e3;
  const double bound_ms = std::max(compute_ms, link.ms);
  const double median = Median(r.step_ms);
  return absl::StrFormat(
      "{\"rank\":%d,\"workers\":%d,\"servers\":%d,\"model\":\"%s\","
      "\"sample\":\"%s\",\"batch\":%d,\"seq_len\":%d,\"tflops\":%.6g,"
      "\"order\":\"%s\",\"gc\":\"%s\",\"threshold\":%.6g,"
      "\"optimizer\":\"%s\",\"layers\":%d,\"keys\":%d,\"params\":%d,"
      "\"steps\":%d,\"warmup\":%d,\"step_ms\":%s,\"median_step_ms\":%.3f,"
      "\"median_wait_ms\":%.3f,\"median_first_wait_ms\":%.3f,"
      "\"forward_ms\":%.3f,\"compute_ms\":%.3f,"
      "\"measured_compute_ms\":%.3f,\"bytes_pushed_per_step\":%d,"
      "\"bytes_pulled_per_step\":%d,\"measured_bytes_pushed_per_step\":%.1f,"
      "\"measured_bytes_pulled_per_step\":%.1f,"
      "\"server_bytes_in_per_step\":%s,\"server_bytes_out_per_step\":%s,"
      "\"link_gbps\":%.6g,\"link_ms\":%.3f,\"busiest_link\":\"%s\","
      "\"overlap_bound_ms\":%.3f,\"x_overlap_bound\":%.4f,"
      "\"x_compute_bound\":%.4f}\n",
      kv->rank(), kv->num_workers(), kv->num_servers(), m.name, m.sample,
      f.batch, f.seq_len, f.tflops, f.order, f.gc, f.threshold, f.optimizer,
      m.layers.size(), m.num_tensors(), m.num_params(), f.steps, f.warmup,
      JsonList(r.step_ms), median, Median(r.wait_ms), Median(r.first_wait_ms),
      c.total_s * 1e3 / 3, compute_ms, r.measured_compute_ms, t.pushed,
      t.pulled, r.pushed, r.pulled, JsonList(t.server_in),
      JsonList(t.server_out), f.link_gbps, link.ms, link.busiest, bound_ms,
      median / bound_ms, median / compute_ms);
}

int RunReplay(const Flags& flags, const ModelSpec& model) {
  // The worker's queues: priorities on the wire, or none (FIFO).
  setenv("TESSERA_SEND_ORDER", flags.order.c_str(), 1);
  absl::StatusOr<Options> options = Options::FromEnvironment();
  REPLAY_RETURN_IF_ERROR(options.status(), "the environment");
  const Compute compute = ComputeOf(model, flags);
  Result r;
  r.measured_compute_ms = MeasuredComputeMs(model, compute);
  absl::StatusOr<std::unique_ptr<KVWorker>> made =
      KVWorker::Create("dist_sync");
  REPLAY_RETURN_IF_ERROR(made.status(), "joining the job");
  KVWorker* kv = made->get();
  REPLAY_RETURN_IF_ERROR(kv->SetOptimizer(flags.optimizer), "SetOptimizer");
  if (flags.gc == "2bit") {
    REPLAY_RETURN_IF_ERROR(kv->SetGradientCompression("2bit", flags.threshold),
                           "SetGradientCompression");
  }
  Replay replay(model, compute, kv);
  REPLAY_RETURN_IF_ERROR(replay.Init(), "Init");
  const KVWorkerStats before = kv->stats();
  std::vector<double> starts;
  const int total = flags.warmup + flags.steps;
  REPLAY_RETURN_IF_ERROR(replay.Run(total, &starts), "replay");
  const KVWorkerStats after = kv->stats();
  r.step_ms = StepMs(starts, flags.warmup);
  for (int i = flags.warmup; i < total; ++i) {
    r.wait_ms.push_back(replay.wait_s()[i] * 1e3);
    r.first_wait_ms.push_back(replay.first_wait_s()[i] * 1e3);
  }
  r.pushed =
      static_cast<double>(after.bytes_pushed - before.bytes_pushed) / total;
  r.pulled =
      static_cast<double>(after.bytes_pulled - before.bytes_pulled) / total;
  const Traffic traffic = TrafficOf(
      model, kv->num_workers(), options->num_servers, options->bigarray_bound,
      std::max<uint64_t>(1, options->chunk_bytes / sizeof(float)),
      flags.gc == "2bit");
  const std::string json = ResultJson(flags, model, compute, traffic, kv, r);
  REPLAY_RETURN_IF_ERROR(kv->Close(), "Close");
  Emit(flags, kv->rank(), json);
  std::fprintf(stderr,
               "model_replay: rank %d %s: step %.1f ms (median of %d), "
               "compute %.1f ms\n",
               kv->rank(), model.name.c_str(), Median(r.step_ms), flags.steps,
               compute.total_s * 1e3);
  return 0;
}

// --describe: the model's layers and tensors, its counts and compute, JSON.
int Describe(const Flags& flags, const ModelSpec& model) {
  const Compute compute = ComputeOf(model, flags);
  std::vector<std::string> layers;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    std::vector<std::string> params;
    for (const ParamSpec& p : model.layers[l].params) {
      params.push_back(absl::StrCat("{\"name\":\"", p.name, "\",\"shape\":[",
                                    absl::StrJoin(p.shape, ","), "]}"));
    }
    layers.push_back(absl::StrFormat(
        "{\"name\":\"%s\",\"forward_flops\":%.0f,\"forward_ms\":%.6f,"
        "\"params\":[%s]}",
        model.layers[l].name, model.layers[l].forward_flops,
        compute.forward_s[l] * 1e3, absl::StrJoin(params, ",")));
  }
  absl::PrintF(
      "{\"model\":\"%s\",\"sample\":\"%s\",\"batch\":%d,\"tflops\":%.6g,"
      "\"layers\":%d,\"keys\":%d,\"params\":%d,"
      "\"forward_flops_per_sample\":%.0f,\"compute_ms\":%.3f,"
      "\"layer_list\":[%s]}\n",
      model.name, model.sample, flags.batch, flags.tflops, model.layers.size(),
      model.num_tensors(), model.num_params(), model.forward_flops(),
      compute.total_s * 1e3, absl::StrJoin(layers, ",\n"));
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(tessera::bench::kUsage, stdout);
      return 0;
    }
  }
  absl::StatusOr<tessera::bench::Flags> flags =
      tessera::bench::ParseFlags(args);
  absl::StatusOr<tessera::bench::ModelSpec> model =
      flags.ok() ? tessera::bench::MakeModel(flags->model, flags->seq_len)
                 : flags.status();
  if (!model.ok()) {
    std::cerr << "model_replay: " << model.status().message() << "\n"
              << tessera::bench::kUsage;
    return 2;
  }
  if (flags->describe) return tessera::bench::Describe(*flags, *model);
  return tessera::bench::RunReplay(*flags, *model);
}

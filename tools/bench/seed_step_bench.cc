// seed_step_bench: the communication of one training step of the first seed's
// model (issue #15) on a real Tessera job, and the server's cost of a row push
// and pull against the number of rows (O(k), not O(num_rows)).
//
// The model is E rows x D embedding (sparse inputs) -> D x H -> H x O: keys 0
// (the embedding), 1 (D x H) and 2 (H x O), float32. Each worker, every step,
// pushes the gradients of every key and then pulls the weights the next batch
// needs, in one of three modes:
//
//   dense     every key dense float32: the embedding pushed and pulled whole
//   rows      the embedding a row-sparse key: push the gradient rows of this
//             step's batch, pull the rows of the next batch; dense layers
//             float32
//   rows2bit  as rows, with 2-bit gradient compression of every push
//             (SetGradientCompression("2bit", threshold)) and compressed
//             pulls (SetPullCompression("2bit")): the dense keys' pulls
//             bring 2-bit changes, the embedding's row pulls bfloat16 rows
//             (docs/compression.md says why not 2-bit)
//
// A batch touches exactly round(fraction * E) distinct rows, drawn by rank
// from a Zipf law P(rank r) ~ 1 / r^s (--zipf=s) until that many distinct
// ranks came up; ranks map to row ids through a fixed random permutation (the
// same on every worker, so the frequent rows spread over the servers' row
// ranges), and each batch's ids are sorted. Every worker draws its own
// batches (seeded by rank), all before the first step: the timed steps only
// communicate.
//
//   seed_step_bench --mode=rows --fraction=0.05 --metrics-out=out-{rank}.json
//   seed_step_bench --okrows=2500,25000,250000 --ok-keys=25000,250000
//   seed_step_bench --raw-baseline      # raw ZeroMQ and memcpy, no job
//
// As a worker (DMLC_ROLE=worker and the rest of the DMLC_* environment, as
// tools/launch.py or tools/bench/seed_step.py set it) it prints one JSON
// object per worker on stdout, and writes it to --metrics-out when given
// ({rank} is replaced by the worker's rank):
//   step_ms            every timed step's time, push start to pull end
//   median_step_ms     their median
//   push_ms, median_push_ms   the push half of each step (push start until
//                      every push completed: the round applied); the rest
//                      of a step is the pulls
//   bytes_pushed_per_step, bytes_pulled_per_step, bytes_pulled_float32_per_step
//                      KVWorker::stats() over the timed steps / steps: the
//                      payload bytes of pushes (row ids included) and of pull
//                      replies; the row ids a row pull sends are not in them
//   memcpy_ms_per_step one thread copying the step's pushed + pulled bytes
//                      (same process, after the steps): a same-run baseline
// With --okrows (one worker, one server) it reports per row-sparse key of
// --ok-keys rows and per k of --okrows (k <= rows) the median time of a
// blocking PushRows then PullRows of k distinct uniformly random rows, and
// the median CPU time the worker process (all its threads) spent on one.
// --overlap issues each pull right after the pushes instead of after they
// completed (the server holds a pull until its worker's push of that slice is
// in the round's result, so a step's pulls start slice by slice as rounds
// complete): what a training loop that calls push then pull without waiting
// (MXNet's kv.push; kv.pull) gets. The JSON's `pulled_fnv` hashes every
// pulled value of the timed steps, so a run with and without --overlap can be
// checked for the same values.
// --raw-baseline measures raw ZeroMQ (1 MB messages, one-way stream between two
// processes on loopback, tessera-bench's baseline), plain and with CURVE on the
// sockets (jobs are CURVE-encrypted unless TESSERA_INSECURE=1 or
// TESSERA_AUTH_ONLY=1), and memcpy, and prints JSON.
//
// Exit code 0 on success, 1 when an operation failed, 2 on bad flags.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "tessera/kv_worker.h"
#include "tools/bench/bench_util.h"
#include "tools/bench/raw_zmq.h"

namespace tessera::bench {
namespace {

constexpr char kUsage[] =
    R"(usage: seed_step_bench [flags]   (as a worker of a job)
  --mode=dense|rows|rows2bit  what the step sends (default rows)
  --fraction=0.05             share of the embedding's rows a batch touches
  --zipf=1.0                  exponent s of the rows' Zipf law, P(rank r) ~ 1/r^s
  --emb-rows=250000 --emb-dim=1024 --hidden=512 --outputs=200000
  --steps=5 --warmup=1        timed steps (median reported), untimed first steps
  --optimizer="sgd lr=0.01"   the servers' optimizer
  --threshold=0.5             2-bit gradient threshold (rows2bit)
  --seed=1
  --metrics-out=PATH          also write the JSON there ({rank}: the rank; also
                              --metrics-out PATH)
  --okrows=K1,K2,...          instead: time PushRows+PullRows of K random rows
  --ok-keys=N1,N2,...         ... on row-sparse keys of N rows (of --emb-dim)
  --ok-reps=7                 ... timed repetitions per (key, K), after 2 untimed
  --overlap                   issue the pulls right after the pushes, without
                              waiting for them (the server orders them)
  --raw-baseline              no job: raw ZeroMQ 1 MB stream (plain, CURVE) and
                              memcpy, JSON
)";

struct Flags {
  std::string mode = "rows";
  double fraction = 0.05;
  double zipf = 1.0;
  uint64_t emb_rows = 250000;
  uint64_t emb_dim = 1024;
  uint64_t hidden = 512;
  uint64_t outputs = 200000;
  int steps = 5;
  int warmup = 1;
  std::string optimizer = "sgd lr=0.01";
  float threshold = 0.5f;
  uint64_t seed = 1;
  std::string metrics_out;
  std::vector<uint64_t> okrows;
  std::vector<uint64_t> ok_keys;
  int ok_reps = 7;
  bool raw_baseline = false;
  bool overlap = false;
};

// FNV-1a over 8-byte words (then the last bytes), continuing from `h`
// (kFnvOffset to start): a check that two runs pulled the same bits, not a
// cryptographic hash. Taken outside the timed part of a step.
constexpr uint64_t kFnvOffset = 1469598103934665603ull;
// This process's CPU time, all its threads (ZeroMQ's I/O thread too).
double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

uint64_t Fnv1a(const void* data, size_t n, uint64_t h) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, sizeof(word));
    h ^= word;
    h *= 1099511628211ull;
  }
  for (; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

absl::Status ParseU64List(const std::string& name, const std::string& text,
                          std::vector<uint64_t>* out) {
  out->clear();
  for (const std::string& s : SplitList(text)) {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, "='", text, "': expected positive whole numbers"));
    }
    out->push_back(v);
  }
  if (out->empty())
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": empty list"));
  return absl::OkStatus();
}

absl::StatusOr<Flags> ParseFlags(const std::vector<std::string>& args) {
  Flags f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    std::string v;
    bool ok = true;
    const char* expected = "";
    if (a == "--raw-baseline") {
      f.raw_baseline = true;
    } else if (a == "--overlap") {
      f.overlap = true;
    } else if (a == "--metrics-out" && i + 1 < args.size()) {
      f.metrics_out = args[++i];  // as tools/bench/shaped_link.py passes it
    } else if (TakeFlag(a, "mode", &v)) {
      f.mode = v;
      ok = v == "dense" || v == "rows" || v == "rows2bit";
      expected = "dense, rows or rows2bit";
    } else if (TakeFlag(a, "fraction", &v)) {
      ok =
          absl::SimpleAtod(v, &f.fraction) && f.fraction > 0 && f.fraction <= 1;
      expected = "a number in (0, 1]";
    } else if (TakeFlag(a, "zipf", &v)) {
      ok = absl::SimpleAtod(v, &f.zipf) && f.zipf >= 0 && f.zipf <= 4;
      expected = "a number in [0, 4]";
    } else if (TakeFlag(a, "emb-rows", &v)) {
      ok = absl::SimpleAtoi(v, &f.emb_rows) && f.emb_rows > 0;
      expected = "a positive whole number";
    } else if (TakeFlag(a, "emb-dim", &v)) {
      ok = absl::SimpleAtoi(v, &f.emb_dim) && f.emb_dim > 0;
      expected = "a positive whole number";
    } else if (TakeFlag(a, "hidden", &v)) {
      ok = absl::SimpleAtoi(v, &f.hidden) && f.hidden > 0;
      expected = "a positive whole number";
    } else if (TakeFlag(a, "outputs", &v)) {
      ok = absl::SimpleAtoi(v, &f.outputs) && f.outputs > 0;
      expected = "a positive whole number";
    } else if (TakeFlag(a, "steps", &v)) {
      ok = absl::SimpleAtoi(v, &f.steps) && f.steps > 0 && f.steps <= 10000;
      expected = "1..10000";
    } else if (TakeFlag(a, "warmup", &v)) {
      ok = absl::SimpleAtoi(v, &f.warmup) && f.warmup >= 0 && f.warmup <= 100;
      expected = "0..100";
    } else if (TakeFlag(a, "optimizer", &v)) {
      f.optimizer = v;
    } else if (TakeFlag(a, "threshold", &v)) {
      ok = absl::SimpleAtof(v, &f.threshold) && f.threshold > 0;
      expected = "a number > 0";
    } else if (TakeFlag(a, "seed", &v)) {
      ok = absl::SimpleAtoi(v, &f.seed);
      expected = "a whole number";
    } else if (TakeFlag(a, "metrics-out", &v)) {
      f.metrics_out = v;
    } else if (TakeFlag(a, "okrows", &v)) {
      absl::Status s = ParseU64List("okrows", v, &f.okrows);
      if (!s.ok()) return s;
    } else if (TakeFlag(a, "ok-keys", &v)) {
      absl::Status s = ParseU64List("ok-keys", v, &f.ok_keys);
      if (!s.ok()) return s;
    } else if (TakeFlag(a, "ok-reps", &v)) {
      ok = absl::SimpleAtoi(v, &f.ok_reps) && f.ok_reps > 0;
      expected = "a positive whole number";
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown argument '", a, "'"));
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", a, "': expected ", expected));
    }
  }
  if (!f.okrows.empty() && f.ok_keys.empty()) f.ok_keys = {f.emb_rows};
  return f;
}


std::string JsonList(const std::vector<double>& v) {
  std::vector<std::string> s;
  for (double x : v) s.push_back(absl::StrFormat("%.3f", x));
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

// Uniform in [-1, 1): the gradients (their values only matter to 2-bit codes).
void FillGradient(std::vector<float>* v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : *v) x = u(rng);
}

// The batches of one worker: batches[i] holds `k` distinct sorted row ids.
class ZipfRows {
 public:
  ZipfRows(uint64_t num_rows, double s, uint64_t permutation_seed)
      : cdf_(num_rows), row_of_rank_(num_rows) {
    double sum = 0;
    for (uint64_t r = 0; r < num_rows; ++r) {
      sum += 1.0 / std::pow(static_cast<double>(r + 1), s);
      cdf_[r] = sum;
    }
    for (double& c : cdf_) c /= sum;
    std::iota(row_of_rank_.begin(), row_of_rank_.end(), 0);
    std::mt19937_64 rng(permutation_seed);
    std::shuffle(row_of_rank_.begin(), row_of_rank_.end(), rng);
  }

  // Draws until `k` distinct rows came up (REQUIRES: k <= num_rows); also
  // returns how many draws that took.
  std::vector<uint64_t> Batch(uint64_t k, std::mt19937_64* rng,
                              uint64_t* draws) {
    std::vector<char> seen(cdf_.size(), 0);
    std::vector<uint64_t> ids;
    ids.reserve(k);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    *draws = 0;
    while (ids.size() < k) {
      ++*draws;
      const uint64_t rank = std::min<uint64_t>(
          std::upper_bound(cdf_.begin(), cdf_.end(), u(*rng)) - cdf_.begin(),
          cdf_.size() - 1);
      if (!seen[rank]) {
        seen[rank] = 1;
        ids.push_back(row_of_rank_[rank]);
      }
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  }

 private:
  std::vector<double> cdf_;
  std::vector<uint64_t> row_of_rank_;
};

void Emit(const Flags& flags, int rank, const std::string& json) {
  std::fputs(json.c_str(), stdout);
  std::fflush(stdout);
  if (flags.metrics_out.empty()) return;
  const std::string path = absl::StrReplaceAll(
      flags.metrics_out, {{"{rank}", std::to_string(rank)}});
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::cerr << "seed_step_bench: cannot write --metrics-out " << path << "\n";
    return;
  }
  std::fputs(json.c_str(), f);
  std::fclose(f);
}

// Milliseconds one thread takes to copy `bytes` (median of 3).
double MemcpyMs(uint64_t bytes) {
  if (bytes == 0) return 0;
  const uint64_t chunk = std::min<uint64_t>(bytes, 64ull << 20);
  std::vector<char> a(chunk, 1), b(chunk, 0);
  std::vector<double> ms;
  for (int i = 0; i < 3; ++i) {
    const double t0 = NowSeconds();
    for (uint64_t done = 0; done < bytes; done += chunk)
      std::memcpy(b.data(), a.data(), std::min(chunk, bytes - done));
    ms.push_back((NowSeconds() - t0) * 1e3);
  }
  return Median(ms);
}

#define SEED_RETURN_IF_ERROR(expr, what)                              \
  do {                                                                \
    absl::Status _s = (expr);                                         \
    if (!_s.ok()) {                                                   \
      std::cerr << "seed_step_bench: " << what << ": " << _s << "\n"; \
      return 1;                                                       \
    }                                                                 \
  } while (0)

// Waits for every handle; the first failure wins.
absl::Status WaitAll(KVWorker* kv, std::vector<absl::StatusOr<OpHandle>>* ops) {
  absl::Status first;
  for (absl::StatusOr<OpHandle>& op : *ops) {
    absl::Status s = op.ok() ? kv->Wait(*op) : op.status();
    if (!s.ok() && first.ok()) first = s;
  }
  ops->clear();
  return first;
}

int RunStep(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<KVWorker>> made =
      KVWorker::Create("dist_sync");
  SEED_RETURN_IF_ERROR(made.status(), "joining the job");
  KVWorker* kv = made->get();
  const int rank = kv->rank();
  const bool rows = flags.mode != "dense";
  const bool two_bit = flags.mode == "rows2bit";
  SEED_RETURN_IF_ERROR(kv->SetOptimizer(flags.optimizer), "SetOptimizer");
  if (two_bit) {
    SEED_RETURN_IF_ERROR(kv->SetGradientCompression("2bit", flags.threshold),
                         "SetGradientCompression");
    SEED_RETURN_IF_ERROR(kv->SetPullCompression("2bit"), "SetPullCompression");
  }
  const uint64_t E = flags.emb_rows, D = flags.emb_dim;
  const uint64_t n1 = D * flags.hidden, n2 = flags.hidden * flags.outputs;
  const uint64_t k = std::max<uint64_t>(
      1, std::min<uint64_t>(E, std::llround(flags.fraction * E)));
  const int total_steps = flags.warmup + flags.steps;

  // Batches (rows modes): one per step plus the one the last step pulls for.
  std::vector<std::vector<uint64_t>> batches;
  uint64_t draws = 0;
  double draw_seconds = 0;
  if (rows) {
    const double t0 = NowSeconds();
    ZipfRows zipf(E, flags.zipf, flags.seed);
    std::mt19937_64 rng(flags.seed * 1000003 + rank);
    for (int i = 0; i <= total_steps; ++i) {
      uint64_t d = 0;
      batches.push_back(zipf.Batch(k, &rng, &d));
      draws += d;
    }
    draw_seconds = NowSeconds() - t0;
  }

  // Gradients and weights: the row modes hold k rows of each; the
  // all-dense mode pulls the embedding into its gradient's buffer (the push
  // has completed by then): one 1 GB buffer per worker instead of two, and
  // float32 transfers do not depend on the values.
  const uint64_t emb_values = rows ? k * D : E * D;
  std::vector<float> emb_grad(emb_values), emb_rows_w(rows ? emb_values : 0);
  std::vector<float>& emb_w = rows ? emb_rows_w : emb_grad;
  std::vector<float> g1(n1), w1(n1), g2(n2), w2(n2);
  FillGradient(&emb_grad, flags.seed * 31 + rank);
  FillGradient(&g1, flags.seed * 37 + rank);
  FillGradient(&g2, flags.seed * 41 + rank);

  if (rows) {
    SEED_RETURN_IF_ERROR(kv->InitRows(0, nullptr, E, D), "InitRows(0)");
  } else {
    SEED_RETURN_IF_ERROR(kv->Init(0, emb_w), "Init(0)");
  }
  SEED_RETURN_IF_ERROR(kv->Init(1, w1), "Init(1)");
  SEED_RETURN_IF_ERROR(kv->Init(2, w2), "Init(2)");
  SEED_RETURN_IF_ERROR(kv->Barrier(), "Barrier");

  std::vector<double> step_ms, push_ms;
  uint64_t pulled_fnv = kFnvOffset;
  KVWorkerStats before;
  std::vector<absl::StatusOr<OpHandle>> ops;
  for (int step = 0; step < total_steps; ++step) {
    if (step == flags.warmup) before = kv->stats();
    const double t0 = NowSeconds();
    if (rows) {
      ops.push_back(kv->PushRowsAsync(0, batches[step], emb_grad));
    } else {
      ops.push_back(kv->PushAsync(0, emb_grad));
    }
    ops.push_back(kv->PushAsync(1, g1));
    ops.push_back(kv->PushAsync(2, g2));
    std::vector<absl::StatusOr<OpHandle>> pushes;
    if (flags.overlap) {
      pushes.swap(ops);  // waited for after the pulls are issued
    } else {
      SEED_RETURN_IF_ERROR(WaitAll(kv, &ops),
                           absl::StrCat("step ", step, ": push"));
    }
    double pushed_at = NowSeconds();
    if (rows) {
      ops.push_back(
          kv->PullRowsAsync(0, batches[step + 1], absl::MakeSpan(emb_w)));
    } else {
      ops.push_back(kv->PullAsync(0, absl::MakeSpan(emb_w)));
    }
    ops.push_back(kv->PullAsync(1, absl::MakeSpan(w1)));
    ops.push_back(kv->PullAsync(2, absl::MakeSpan(w2)));
    if (flags.overlap) {
      SEED_RETURN_IF_ERROR(WaitAll(kv, &pushes),
                           absl::StrCat("step ", step, ": push"));
      pushed_at = NowSeconds();
    }
    SEED_RETURN_IF_ERROR(WaitAll(kv, &ops),
                         absl::StrCat("step ", step, ": pull"));
    const double done_at = NowSeconds();
    if (step >= flags.warmup) {
      // After the step's time is taken.
      pulled_fnv =
          Fnv1a(emb_w.data(), emb_w.size() * sizeof(float), pulled_fnv);
      pulled_fnv = Fnv1a(w1.data(), w1.size() * sizeof(float), pulled_fnv);
      pulled_fnv = Fnv1a(w2.data(), w2.size() * sizeof(float), pulled_fnv);
      step_ms.push_back((done_at - t0) * 1e3);
      push_ms.push_back((pushed_at - t0) * 1e3);
    }
  }
  const KVWorkerStats after = kv->stats();
  SEED_RETURN_IF_ERROR(kv->Close(), "Close");

  const double steps = flags.steps;
  const double pushed = (after.bytes_pushed - before.bytes_pushed) / steps;
  const double pulled = (after.bytes_pulled - before.bytes_pulled) / steps;
  const double pulled_f32 =
      (after.bytes_pulled_float32 - before.bytes_pulled_float32) / steps;
  const double memcpy_ms =
      MemcpyMs(static_cast<uint64_t>(pushed) + static_cast<uint64_t>(pulled));
  Emit(flags, rank,
       absl::StrFormat(
           "{\"rank\":%d,\"workers\":%d,\"servers\":%d,\"mode\":\"%s\","
           "\"fraction\":%.6g,\"zipf\":%.6g,\"emb_rows\":%d,\"emb_dim\":%d,"
           "\"hidden\":%d,\"outputs\":%d,\"rows_per_batch\":%d,"
           "\"zipf_draws_per_batch\":%.1f,\"draw_seconds\":%.3f,"
           "\"optimizer\":\"%s\",\"threshold\":%.6g,\"steps\":%d,"
           "\"warmup\":%d,\"step_ms\":%s,\"median_step_ms\":%.3f,"
           "\"push_ms\":%s,\"median_push_ms\":%.3f,"
           "\"bytes_pushed_per_step\":%.1f,\"bytes_pulled_per_step\":%.1f,"
           "\"bytes_pulled_float32_per_step\":%.1f,"
           "\"memcpy_ms_per_step\":%.3f,\"overlap\":%s,"
           "\"pulled_fnv\":\"%016x\"}\n",
           rank, kv->num_workers(), kv->num_servers(), flags.mode,
           flags.fraction, flags.zipf, E, D, flags.hidden, flags.outputs,
           rows ? k : 0,
           rows ? static_cast<double>(draws) / batches.size() : 0.0,
           draw_seconds, flags.optimizer, flags.threshold, flags.steps,
           flags.warmup, JsonList(step_ms), Median(step_ms), JsonList(push_ms),
           Median(push_ms), pushed, pulled, pulled_f32, memcpy_ms,
           flags.overlap ? "true" : "false", pulled_fnv));
  return 0;
}

// k distinct uniformly random ids below n, sorted (partial Fisher-Yates).
std::vector<uint64_t> RandomRows(uint64_t n, uint64_t k, std::mt19937_64* rng,
                                 std::vector<uint64_t>* scratch) {
  if (scratch->size() != n) {
    scratch->resize(n);
    std::iota(scratch->begin(), scratch->end(), 0);
  }
  for (uint64_t i = 0; i < k; ++i) {
    std::uniform_int_distribution<uint64_t> u(i, n - 1);
    std::swap((*scratch)[i], (*scratch)[u(*rng)]);
  }
  std::vector<uint64_t> ids(scratch->begin(), scratch->begin() + k);
  std::sort(ids.begin(), ids.end());
  return ids;
}

int RunOkRows(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<KVWorker>> made =
      KVWorker::Create("dist_sync");
  SEED_RETURN_IF_ERROR(made.status(), "joining the job");
  KVWorker* kv = made->get();
  if (kv->num_workers() != 1 || kv->num_servers() != 1) {
    std::cerr << "seed_step_bench --okrows: run it with 1 worker and 1 server "
                 "(DMLC_NUM_WORKER="
              << kv->num_workers() << ", DMLC_NUM_SERVER=" << kv->num_servers()
              << ")\n";
    return 2;
  }
  SEED_RETURN_IF_ERROR(kv->SetOptimizer(flags.optimizer), "SetOptimizer");
  const uint64_t D = flags.emb_dim;
  for (size_t i = 0; i < flags.ok_keys.size(); ++i) {
    SEED_RETURN_IF_ERROR(kv->InitRows(10 + i, nullptr, flags.ok_keys[i], D),
                         "InitRows");
  }
  const uint64_t kmax =
      *std::max_element(flags.okrows.begin(), flags.okrows.end());
  std::vector<float> grad(kmax * D), out(kmax * D);
  FillGradient(&grad, flags.seed);
  std::mt19937_64 rng(flags.seed);
  std::vector<std::string> results;
  std::vector<uint64_t> scratch;
  uint64_t pulled_fnv = kFnvOffset;
  for (size_t i = 0; i < flags.ok_keys.size(); ++i) {
    const uint64_t n = flags.ok_keys[i];
    for (uint64_t k : flags.okrows) {
      if (k > n) continue;
      std::vector<double> ms, push_ms, cpu_ms;
      for (int rep = 0; rep < flags.ok_reps + 2; ++rep) {
        const std::vector<uint64_t> ids = RandomRows(n, k, &rng, &scratch);
        const absl::Span<const float> g(grad.data(), k * D);
        const absl::Span<float> o(out.data(), k * D);
        const double c0 = ProcessCpuSeconds(), t0 = NowSeconds();
        double t1;
        if (flags.overlap) {
          absl::StatusOr<OpHandle> push = kv->PushRowsAsync(10 + i, ids, g);
          absl::StatusOr<OpHandle> pull = kv->PullRowsAsync(10 + i, ids, o);
          SEED_RETURN_IF_ERROR(push.ok() ? kv->Wait(*push) : push.status(),
                               "PushRowsAsync");
          t1 = NowSeconds();
          SEED_RETURN_IF_ERROR(pull.ok() ? kv->Wait(*pull) : pull.status(),
                               "PullRowsAsync");
        } else {
          SEED_RETURN_IF_ERROR(kv->PushRows(10 + i, ids, g), "PushRows");
          t1 = NowSeconds();
          SEED_RETURN_IF_ERROR(kv->PullRows(10 + i, ids, o), "PullRows");
        }
        const double t2 = NowSeconds(), c2 = ProcessCpuSeconds();
        if (rep >= 2)
          pulled_fnv = Fnv1a(o.data(), o.size() * sizeof(float), pulled_fnv);
        if (rep >= 2) {
          ms.push_back((t2 - t0) * 1e3);
          push_ms.push_back((t1 - t0) * 1e3);
          cpu_ms.push_back((c2 - c0) * 1e3);
        }
      }
      // Bytes that cross: ids and rows in the push, ids out and rows back in
      // the pull.
      const uint64_t bytes = 2 * k * (sizeof(uint64_t) + D * sizeof(float));
      results.push_back(absl::StrFormat(
          "{\"key_rows\":%d,\"k\":%d,\"row_length\":%d,\"reps\":%d,"
          "\"median_ms\":%.3f,\"median_push_ms\":%.3f,\"ms\":%s,"
          "\"median_cpu_ms\":%.3f,"
          "\"us_per_row\":%.3f,\"bytes\":%d,\"memcpy_ms\":%.3f}",
          n, k, D, flags.ok_reps, Median(ms), Median(push_ms), JsonList(ms),
          Median(cpu_ms), Median(ms) * 1e3 / k, bytes, MemcpyMs(bytes)));
      std::fprintf(stderr, "okrows: key %lu rows, k=%lu: median %.2f ms\n",
                   static_cast<unsigned long>(n), static_cast<unsigned long>(k),
                   Median(ms));
    }
  }
  SEED_RETURN_IF_ERROR(kv->Close(), "Close");
  Emit(flags, 0,
       absl::StrCat("{\"rank\":0,\"okrows\":[", absl::StrJoin(results, ","),
                    "],\"optimizer\":\"", flags.optimizer, "\",\"overlap\":",
                    flags.overlap ? "true" : "false", ",\"pulled_fnv\":\"",
                    absl::StrFormat("%016x", pulled_fnv), "\"}\n"));
  return 0;
}

// Raw ZeroMQ with plain sockets and with CURVE on them (the jobs' default
// security), and memcpy.
int RunRawBaseline() {
  double gbps[2] = {0, 0};
  for (int curve = 0; curve < 2; ++curve) {
    RawZmqPlan plan;
    plan.self_exe = SelfExecutable();
    plan.sizes = {1 << 20};
    plan.seconds = 0.5;
    plan.two_way = false;
    plan.curve = curve == 1;
    plan.log_path = "/dev/null";
    absl::StatusOr<std::vector<RawZmqFigures>> raw = MeasureRawZmq(plan);
    if (!raw.ok()) {
      std::cerr << "seed_step_bench: raw ZeroMQ baseline: " << raw.status()
                << "\n";
      return 1;
    }
    gbps[curve] = (*raw)[0].gbps;
  }
  const double memcpy_gbps = MeasureMemcpy(64 << 20, 0.3);
  std::printf(
      "{\"zmq_1mb_gbps\":%.4f,\"zmq_curve_1mb_gbps\":%.4f,"
      "\"memcpy_64mb_gbps\":%.4f}\n",
      gbps[0], gbps[1], memcpy_gbps);
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& a : args) {
    std::string v;
    if (a == "--help" || a == "-h") {
      std::fputs(tessera::bench::kUsage, stdout);
      return 0;
    }
    if (tessera::bench::TakeFlag(a, "raw-peer", &v)) {
      std::vector<std::string> ports = absl::StrSplit(v, ',');
      if (ports.size() != 2) return 2;
      return tessera::bench::RunRawZmqPeer(std::atoi(ports[0].c_str()),
                                           std::atoi(ports[1].c_str()));
    }
  }
  absl::StatusOr<tessera::bench::Flags> flags =
      tessera::bench::ParseFlags(args);
  if (!flags.ok()) {
    std::cerr << "seed_step_bench: " << flags.status().message() << "\n"
              << tessera::bench::kUsage;
    return 2;
  }
  if (flags->raw_baseline) return tessera::bench::RunRawBaseline();
  if (!flags->okrows.empty()) return tessera::bench::RunOkRows(*flags);
  return tessera::bench::RunStep(*flags);
}

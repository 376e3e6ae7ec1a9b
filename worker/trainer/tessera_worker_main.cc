// tessera-worker: trains an MLP classifier on Fashion-MNIST as one worker of a
// Tessera job. The servers hold the weights and run the optimizer; every step
// this worker computes the gradient of its local batch, pushes it layer by
// layer from the last layer down (while backward still runs on the layers
// below) and pulls the new weights.
//
//   tessera-worker --kv-store dist_sync --batch-size 128 --epochs 10 --device
//   cpu
//
// Exit codes: 0 done; 2 a bad flag, missing data or unusable device (one line
// on stderr naming the flag); 1 a failure of the cluster (the KV client's
// error).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "common/gpu/device.h"
#include "common/trace.h"
#include "tessera/kv_worker.h"
#include "worker/trainer/batch_loader.h"
#include "worker/trainer/blas_core.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/mlp.h"
#include "worker/trainer/straggler.h"
#include "worker/trainer/train_flags.h"

namespace tessera {
namespace {

// Elastic jobs: SIGTERM asks this worker to leave after its step in progress.
std::atomic<bool> leave_requested{false};
extern "C" void RequestLeave(int) { leave_requested.store(true); }

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int Fail(int code, const std::string& message) {
  std::cerr << "tessera-worker: " << message << std::endl;
  return code;
}

// The test images as floats in [0, 1], converted once.
struct FloatImages {
  std::vector<float> x;
  std::vector<int32_t> y;
};

FloatImages ToFloat(const LabeledImages& data) {
  FloatImages out;
  out.x.resize(data.pixels.size());
  for (size_t i = 0; i < data.pixels.size(); ++i)
    out.x[i] = data.pixels[i] / 255.0f;
  out.y.assign(data.labels.begin(), data.labels.end());
  return out;
}

// One epoch, for --metrics-out's "epoch_log" (tools/plot.py draws it).
struct EpochRecord {
  int epoch = 0;
  double seconds = 0;  // training time, evaluation excluded
  int64_t samples = 0;
  double train_accuracy = 0;
  double validation_accuracy = -1;  // rank 0 (and the last epoch's, others)
  double time_compute_s = 0;
  double time_comm_s = 0;
  double time_issue_s = 0;
  double time_data_s = 0;
};

// Counts what a run did, for the progress lines and --metrics-out.
struct RunTotals {
  double time_compute_s =
      0;  // forward/backward, including issuing the async KV ops
  double time_comm_s = 0;  // waiting for pushes and pulls after backward
  // Issuing pushes and pulls during backward: 2-bit compression (on the GPU,
  // also the device-to-host copy) and handing the requests to the transport.
  // Not part of time_compute_s.
  double time_issue_s = 0;
  double time_data_s = 0;  // waiting for the batch loader
  double time_eval_s = 0;
  double wall_seconds = 0;
  int64_t samples = 0;
  int64_t steps = 0;
  double first_loss = -1;  // mean loss of the first batch
  double final_loss = -1;  // mean training loss of the last epoch
  // FNV-1a of the servers' final weights (WeightsChecksum: as float32
  // bytes): two dist_sync runs that end with the same bits agree.
  uint64_t weights_fnv1a = 0;
  double train_accuracy = 0;
  double test_accuracy = -1;
  std::vector<EpochRecord> epochs;
};

std::string MetricsJson(const TrainFlags& flags, MlpDevice device,
                        const KVWorker& kv, const RunTotals& t) {
  const KVWorkerStats stats = kv.stats();
  const double train_time = t.wall_seconds - t.time_eval_s;
  std::string json = "{";
  absl::StrAppendFormat(&json, "\"test_accuracy\": %.6f", t.test_accuracy);
  absl::StrAppendFormat(&json, ", \"train_accuracy\": %.6f", t.train_accuracy);
  absl::StrAppendFormat(&json, ", \"epochs\": %d", flags.epochs);
  absl::StrAppendFormat(&json, ", \"wall_seconds\": %.3f", t.wall_seconds);
  absl::StrAppendFormat(&json, ", \"samples_per_second\": %.1f",
                        train_time > 0 ? t.samples / train_time : 0.0);
  absl::StrAppendFormat(&json, ", \"bytes_pushed\": %d", stats.bytes_pushed);
  absl::StrAppendFormat(&json, ", \"bytes_pulled\": %d", stats.bytes_pulled);
  absl::StrAppendFormat(&json, ", \"bytes_pulled_float32\": %d",
                        stats.bytes_pulled_float32);
  absl::StrAppendFormat(&json, ", \"device\": \"%s\"", MlpDeviceName(device));
  absl::StrAppendFormat(&json, ", \"kv_store\": \"%s\"", flags.kv_store);
  if (flags.kv_store == "dist_ssp" && flags.staleness >= 0)
    absl::StrAppendFormat(&json, ", \"staleness\": %d", flags.staleness);
  if (flags.slow_every > 0) {
    absl::StrAppendFormat(&json,
                          ", \"slow_every\": %d, \"slow_factor\": %g, "
                          "\"slow_rank\": %d",
                          flags.slow_every, flags.slow_factor, flags.slow_rank);
  }
  absl::StrAppendFormat(&json, ", \"gc_type\": \"%s\"", flags.gc_type);
  absl::StrAppendFormat(&json, ", \"gc_pull\": \"%s\"", flags.gc_pull);
  absl::StrAppendFormat(&json, ", \"optimizer\": \"%s\"", flags.optimizer);
  absl::StrAppendFormat(&json, ", \"batch_size\": %d", flags.batch_size);
  absl::StrAppendFormat(&json, ", \"steps\": %d", t.steps);
  absl::StrAppendFormat(&json, ", \"first_loss\": %.6f", t.first_loss);
  absl::StrAppendFormat(&json, ", \"final_loss\": %.6f", t.final_loss);
  absl::StrAppendFormat(&json, ", \"weights_fnv1a\": \"%016x\"",
                        t.weights_fnv1a);
  absl::StrAppendFormat(&json, ", \"num_workers\": %d", kv.num_workers());
  absl::StrAppendFormat(&json, ", \"rank\": %d", kv.rank());
  absl::StrAppendFormat(&json, ", \"time_compute_s\": %.3f", t.time_compute_s);
  absl::StrAppendFormat(&json, ", \"time_comm_s\": %.3f", t.time_comm_s);
  absl::StrAppendFormat(&json, ", \"time_issue_s\": %.3f", t.time_issue_s);
  absl::StrAppendFormat(&json, ", \"time_data_s\": %.3f", t.time_data_s);
  absl::StrAppendFormat(&json, ", \"time_eval_s\": %.3f", t.time_eval_s);
  json += ", \"epoch_log\": [";
  for (size_t i = 0; i < t.epochs.size(); ++i) {
    const EpochRecord& e = t.epochs[i];
    absl::StrAppendFormat(
        &json,
        "%s{\"epoch\": %d, \"seconds\": %.3f, \"samples\": %d, "
        "\"samples_per_second\": %.1f, \"train_accuracy\": %.6f, "
        "\"validation_accuracy\": %.6f, \"time_compute_s\": %.3f, "
        "\"time_comm_s\": %.3f, \"time_issue_s\": %.3f, "
        "\"time_data_s\": %.3f}",
        i == 0 ? "" : ", ", e.epoch, e.seconds, e.samples,
        e.seconds > 0 ? e.samples / e.seconds : 0.0, e.train_accuracy,
        e.validation_accuracy, e.time_compute_s, e.time_comm_s, e.time_issue_s,
        e.time_data_s);
  }
  json += "]}\n";
  return json;
}

// Writes next to the target and renames, so a reader never sees half a file.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Issues the push of layer l's gradients and the pull of its new weights; the
// first error is kept in `error` and stops further issuing.
void PushPullLayer(KVWorker& kv, Mlp& mlp, int l, std::vector<OpHandle>* ops,
                   absl::Status* error) {
  if (!error->ok()) return;
  const size_t w_len = static_cast<size_t>(mlp.out_size(l)) * mlp.in_size(l);
  const size_t b_len = static_cast<size_t>(mlp.out_size(l));
  const uint64_t keys[2] = {MlpWeightKey(l), MlpBiasKey(l)};
  const float* grads[2] = {mlp.WeightGrad(l), mlp.BiasGrad(l)};
  const size_t lens[2] = {w_len, b_len};
  const absl::Span<float> staging[2] = {mlp.WeightStaging(l),
                                        mlp.BiasStaging(l)};
  for (int t = 0; t < 2; ++t) {
    absl::StatusOr<OpHandle> push =
        mlp.device() == MlpDevice::kCuda
            ? kv.PushDeviceAsync(keys[t], grads[t], lens[t], mlp.stream())
            : kv.PushAsync(keys[t], absl::MakeConstSpan(grads[t], lens[t]));
    if (!push.ok()) {
      *error = absl::Status(
          push.status().code(),
          absl::StrCat("push of key ", keys[t], ": ", push.status().message()));
      return;
    }
    ops->push_back(*push);
    absl::StatusOr<OpHandle> pull = kv.PullAsync(keys[t], staging[t]);
    if (!pull.ok()) {
      *error = absl::Status(
          pull.status().code(),
          absl::StrCat("pull of key ", keys[t], ": ", pull.status().message()));
      return;
    }
    ops->push_back(*pull);
  }
}

// Why a run stops early: the exit code and the line for stderr.
struct Failure {
  int code;
  std::string message;
};
using MaybeFailure = std::optional<Failure>;  // nullopt: go on

MaybeFailure KvFailure(const std::string& what, const absl::Status& s) {
  return Failure{1, absl::StrCat(what, ": ", s.ToString())};
}

// One worker's training run: prepare (device, data, output), join the job,
// configure the servers and start from their weights, then the epochs, each a
// loop of steps, and the summary.
class Trainer {
 public:
  explicit Trainer(const TrainFlags& flags) : flags_(flags) {}

  // The process's exit code.
  int Run() {
    MaybeFailure failed = RunPhases();
    return failed.has_value() ? Fail(failed->code, failed->message) : 0;
  }

 private:
  MaybeFailure RunPhases() {
    if (MaybeFailure f = Prepare()) return f;
    if (MaybeFailure f = JoinJob()) return f;
    if (MaybeFailure f = ConfigureServers()) return f;
    if (MaybeFailure f = StartFromServerWeights()) return f;
    // An elastic job's worker leaves on SIGTERM after its step in progress;
    // in other jobs SIGTERM ends the process as it always did.
    const char* elastic = std::getenv("TESSERA_ELASTIC");
    if (elastic != nullptr && *elastic != '\0')
      std::signal(SIGTERM, RequestLeave);
    if (MaybeFailure f = TrainEpochs()) return f;
    if (left_) return LeaveJob();
    return Finish();
  }

  // SIGTERM in an elastic job: the steps so far count, the rest of the job
  // goes on without this worker.
  MaybeFailure LeaveJob() {
    if (absl::Status s = kv_->Leave(); !s.ok()) return KvFailure("Leave", s);
    std::printf("Left the job after %lld step(s) (SIGTERM, TESSERA_ELASTIC)\n",
                static_cast<long long>(totals_.steps));
    std::fflush(stdout);
    return std::nullopt;
  }

  // The device, the data and --metrics-out (and dist_ssp's bound), before
  // joining the cluster: a worker without them fails alone and at once.
  MaybeFailure Prepare() {
    const char* staleness_env = std::getenv("TESSERA_STALENESS");
    if (flags_.kv_store == "dist_ssp" && flags_.staleness < 0 &&
        (staleness_env == nullptr || *staleness_env == 0)) {
      return Failure{2,
                     "--kv-store dist_ssp: expected --staleness S (or "
                     "TESSERA_STALENESS=S), a bound in steps 0..1000000"};
    }
    if (flags_.device == "cuda" ||
        (flags_.device == "auto" && gpu::DeviceAvailable())) {
      if (!gpu::DeviceAvailable()) {
        return Failure{
            2, absl::StrCat("--device: expected a usable GPU for 'cuda', but ",
                            gpu::DeviceDescription())};
      }
      device_ = MlpDevice::kCuda;
    }
    // Several workers and servers share the machine's cores; one OpenBLAS
    // thread per worker unless the user says otherwise with
    // OPENBLAS_NUM_THREADS.
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) SetCpuMathThreads(1);

    absl::StatusOr<FashionMnist> data = LoadFashionMnist(
        flags_.data_dir, flags_.train_subset, flags_.test_subset);
    if (!data.ok()) {
      return Failure{
          2,
          absl::StrCat("--data: expected the Fashion-MNIST IDX files in '",
                       flags_.data_dir, "' (set --data or FASHION_MNIST_DIR): ",
                       data.status().message())};
    }
    data_ = std::move(*data);

    if (!flags_.metrics_out.empty()) {
      // Checked now rather than after an hour of training.
      const std::string probe = absl::StrCat(
          absl::StrReplaceAll(flags_.metrics_out, {{"{rank}", "probe"}}),
          ".tmp");
      std::ofstream out(probe, std::ios::app);
      if (!out) {
        return Failure{
            2, absl::StrCat("--metrics-out: expected a writable file path, "
                            "got '",
                            flags_.metrics_out, "'")};
      }
      out.close();
      std::remove(probe.c_str());
    }
    return std::nullopt;
  }

  // Joins the job (rank and size), then checks the data's sharding and makes
  // the model.
  MaybeFailure JoinJob() {
    absl::StatusOr<std::unique_ptr<KVWorker>> kv =
        KVWorker::Create(flags_.kv_store);
    if (!kv.ok()) {
      // A bad variable or key file is configuration (2); a missing cluster, 1.
      return Failure{
          absl::IsInvalidArgument(kv.status()) ? 2 : 1,
          absl::StrCat("cannot join the cluster: ", kv.status().ToString())};
    }
    kv_ = std::move(*kv);
    trace::SetThreadName("main");

    loader_options_.batch_size = flags_.batch_size;
    // A worker that joined an elastic job under a rank past DMLC_NUM_WORKER
    // has no shard of its own: it trains on rank mod DMLC_NUM_WORKER's, in an
    // order of its own.
    const int ranks = kv_->num_workers();
    loader_options_.rank = kv_->rank() % ranks;
    loader_options_.num_workers = ranks;
    loader_options_.seed =
        flags_.seed + static_cast<uint64_t>(kv_->rank() / ranks) * 0x9e3779b9u;
    loader_options_.epochs = flags_.epochs;
    if (absl::Status s =
            BatchLoader::Validate(loader_options_, data_.train.count);
        !s.ok()) {
      return Failure{2, absl::StrCat("--train-subset: ", s.message())};
    }

    MlpConfig config;
    config.sizes.push_back(data_.train.dim());
    config.sizes.insert(config.sizes.end(), flags_.hidden.begin(),
                        flags_.hidden.end());
    config.sizes.push_back(10);
    config.seed = flags_.seed;
    absl::StatusOr<std::unique_ptr<Mlp>> mlp =
        CreateMlp(device_, config, flags_.batch_size);
    if (!mlp.ok()) {
      return Failure{2, absl::StrCat("--device ", MlpDeviceName(device_), ": ",
                                     mlp.status().message())};
    }
    mlp_ = std::move(*mlp);
    // Every worker runs floor(smallest shard / batch) steps an epoch.
    steps_per_epoch_ =
        (static_cast<int64_t>(data_.train.count) / kv_->num_workers()) /
        flags_.batch_size;
    return std::nullopt;
  }

  // Compression and the servers' optimizer.
  MaybeFailure ConfigureServers() {
    // dist_ssp applies each push on its own, as dist_async.
    const bool sync = flags_.kv_store == "dist_sync";
    if (flags_.staleness >= 0) {
      if (absl::Status s = kv_->SetStaleness(flags_.staleness); !s.ok())
        return KvFailure("SetStaleness", s);
    }
    // The pushed gradient is the SUM over a batch: dist_sync averages over
    // every worker's samples of a round, dist_async over the one batch of a
    // push.
    const double rescale_grad = 1.0 / (static_cast<double>(flags_.batch_size) *
                                       (sync ? kv_->num_workers() : 1));
    if (flags_.gc_pull == "2bit") {
      if (absl::Status s = kv_->SetPullCompression("2bit"); !s.ok())
        return KvFailure("SetPullCompression", s);
    }
    if (flags_.gc_type == "2bit") {
      if (absl::Status s =
              kv_->SetGradientCompression("2bit", flags_.gc_threshold);
          !s.ok()) {
        return KvFailure("SetGradientCompression", s);
      }
    }
    // A key is updated once a round in dist_sync and once a push in
    // dist_async.
    const int64_t updates_per_epoch =
        steps_per_epoch_ * (sync ? 1 : kv_->num_workers());
    if (absl::Status s = kv_->SetOptimizer(
            OptimizerSpec(flags_, rescale_grad, updates_per_epoch));
        !s.ok()) {
      return KvFailure("SetOptimizer", s);
    }
    return std::nullopt;
  }

  // Initializes the keys (rank 0's values are kept) and pulls them, so every
  // worker starts from the stored weights; a worker restarted into a running
  // job (launch.py --restarts) pulls the servers' current weights and skips
  // the steps its earlier life completed.
  MaybeFailure StartFromServerWeights() {
    const std::vector<LayerParams> init = mlp_->GetParams();
    if (flags_.fuse_keys) {
      // One key: every layer's W then b, in layer order.
      fused_at_.clear();
      std::vector<float> all;
      for (int l = 0; l < mlp_->num_layers(); ++l) {
        fused_at_.push_back(all.size());
        all.insert(all.end(), init[l].w.begin(), init[l].w.end());
        fused_at_.push_back(all.size());
        all.insert(all.end(), init[l].b.begin(), init[l].b.end());
      }
      fused_at_.push_back(all.size());
      fused_grad_.assign(all.size(), 0.0f);
      fused_pull_.assign(all.size(), 0.0f);
      if (absl::Status s = kv_->Init(kFusedKey, all); !s.ok())
        return KvFailure(absl::StrCat("Init of key ", kFusedKey), s);
      if (absl::Status s = kv_->Pull(kFusedKey, absl::MakeSpan(fused_pull_));
          !s.ok()) {
        return KvFailure(absl::StrCat("Pull of key ", kFusedKey), s);
      }
      ScatterFusedPull();
    }
    for (int l = 0; !flags_.fuse_keys && l < mlp_->num_layers(); ++l) {
      if (absl::Status s = kv_->Init(MlpWeightKey(l), init[l].w); !s.ok())
        return KvFailure(absl::StrCat("Init of key ", MlpWeightKey(l)), s);
      if (absl::Status s = kv_->Init(MlpBiasKey(l), init[l].b); !s.ok())
        return KvFailure(absl::StrCat("Init of key ", MlpBiasKey(l)), s);
    }
    for (int l = 0; !flags_.fuse_keys && l < mlp_->num_layers(); ++l) {
      if (absl::Status s = kv_->Pull(MlpWeightKey(l), mlp_->WeightStaging(l));
          !s.ok()) {
        return KvFailure(absl::StrCat("Pull of key ", MlpWeightKey(l)), s);
      }
      if (absl::Status s = kv_->Pull(MlpBiasKey(l), mlp_->BiasStaging(l));
          !s.ok()) {
        return KvFailure(absl::StrCat("Pull of key ", MlpBiasKey(l)), s);
      }
    }
    if (absl::Status s = mlp_->CommitStagedParams(); !s.ok())
      return Failure{1, s.ToString()};

    skip_ = static_cast<int64_t>(kv_->ResumeRound());
    resumed_ = skip_ > 0;
    if (resumed_) {
      const int64_t per_epoch = std::max<int64_t>(1, steps_per_epoch_);
      std::printf("restarted: resuming at step %lld (epoch %lld, batch %lld)\n",
                  static_cast<long long>(skip_),
                  static_cast<long long>(skip_ / per_epoch),
                  static_cast<long long>(skip_ % per_epoch));
      std::fflush(stdout);
    }
    return std::nullopt;
  }

  MaybeFailure TrainEpochs() {
    loader_ = std::make_unique<BatchLoader>(&data_.train, loader_options_);
    run_start_ = Clock::now();
    for (int epoch = 0; epoch < flags_.epochs && !left_; ++epoch) {
      if (MaybeFailure f = TrainEpoch(epoch)) return f;
    }
    return std::nullopt;
  }

  // What one epoch counted so far.
  struct EpochCounts {
    Clock::time_point window_start;
    int64_t window_samples = 0, window_correct = 0;
    int64_t samples = 0, correct = 0;
    double loss = 0;
  };

  MaybeFailure TrainEpoch(int epoch) {
    const Clock::time_point epoch_start = Clock::now();
    const double eval_before = totals_.time_eval_s;
    const RunTotals before = totals_;
    EpochCounts counts;
    counts.window_start = epoch_start;
    for (int b = 0;; ++b) {
      if (leave_requested.load()) {
        left_ = true;  // between steps: every push of this one was answered
        return std::nullopt;
      }
      bool done = false;
      if (MaybeFailure f = Step(epoch, b, &counts, &done)) return f;
      if (done) break;
    }
    if (resumed_ && totals_.steps == 0) return std::nullopt;  // skipped whole
    const double epoch_seconds = SecondsSince(epoch_start);
    totals_.train_accuracy =
        counts.samples > 0
            ? static_cast<double>(counts.correct) / counts.samples
            : 0.0;
    totals_.final_loss =
        counts.samples > 0 ? counts.loss / counts.samples : 0.0;
    std::printf("Epoch[%d] Train-accuracy=%.6f\n", epoch,
                totals_.train_accuracy);
    if (kv_->rank() == 0) {
      absl::StatusOr<double> acc = Evaluate();
      if (!acc.ok()) {
        return Failure{1,
                       absl::StrCat("evaluation: ", acc.status().ToString())};
      }
      totals_.test_accuracy = *acc;
      std::printf("Epoch[%d] Validation-accuracy=%.6f\n", epoch, *acc);
    }
    // Training time of the epoch; the evaluation is not part of it.
    const double train_seconds =
        epoch_seconds - (totals_.time_eval_s - eval_before);
    std::printf("Epoch[%d] Time cost=%.3f\n", epoch, train_seconds);
    std::fflush(stdout);
    EpochRecord record;
    record.epoch = epoch;
    record.seconds = train_seconds;
    record.samples = counts.samples;
    record.train_accuracy = totals_.train_accuracy;
    record.validation_accuracy = kv_->rank() == 0 ? totals_.test_accuracy : -1;
    record.time_compute_s = totals_.time_compute_s - before.time_compute_s;
    record.time_comm_s = totals_.time_comm_s - before.time_comm_s;
    record.time_issue_s = totals_.time_issue_s - before.time_issue_s;
    record.time_data_s = totals_.time_data_s - before.time_data_s;
    totals_.epochs.push_back(record);
    return std::nullopt;
  }

  // Batch `b` of `epoch`: forward and backward, each layer's push and pull
  // issued as backward reaches it, the wait for them, and the new weights.
  // `*done` when the epoch has no batch left.
  //
  // TESSERA_TRACE: a "step" span holding data-wait, forward, backward (with
  // an "issue" span per layer: compression and the requests) and comm-wait
  // (waiting for the pushes and pulls), then commit.
  MaybeFailure Step(int epoch, int b, EpochCounts* counts, bool* done) {
    const int64_t step_start = trace::Enabled() ? trace::NowNanos() : 0;
    Clock::time_point t = Clock::now();
    std::optional<Batch> batch = loader_->Next();
    totals_.time_data_s += SecondsSince(t);
    if (!batch.has_value()) {
      *done = true;
      return std::nullopt;
    }
    if (skip_ > 0) {
      --skip_;
      return std::nullopt;
    }
    int64_t phase_start = 0;
    // Ends the trace's phase `name` now and starts the next.
    auto phase = [&](const char* name) {
      if (step_start == 0) return;
      const int64_t now = trace::NowNanos();
      trace::Complete("train", name, phase_start, now);
      phase_start = now;
    };
    phase_start = step_start;
    phase("data-wait");

    t = Clock::now();
    // --slow-every: a straggler's slow step (its pushes come late).
    const absl::Duration slow =
        flags_.slow_rank < 0 || flags_.slow_rank == kv_->rank()
            ? straggler_.Delay(totals_.steps)
            : absl::ZeroDuration();
    if (slow > absl::ZeroDuration()) absl::SleepFor(slow);
    ops_.clear();
    absl::Status issue_error;
    double step_issue_s = 0;
    absl::StatusOr<MlpBatchStats> step = mlp_->ForwardBackward(
        batch->images.data(), batch->labels.data(), batch->size,
        [&](int l) {
          trace::Span span("train", "issue");
          span.Arg("layer", l);
          const Clock::time_point issue = Clock::now();
          if (flags_.fuse_keys) {
            FuseLayerGrads(l, &issue_error);
          } else {
            PushPullLayer(*kv_, *mlp_, l, &ops_, &issue_error);
          }
          step_issue_s += SecondsSince(issue);
        },
        step_start == 0 ? std::function<void()>() : [&] { phase("forward"); });
    totals_.time_compute_s += SecondsSince(t) - step_issue_s;
    straggler_.Observe(absl::Seconds(SecondsSince(t) - step_issue_s) - slow);
    totals_.time_issue_s += step_issue_s;
    phase("backward");
    if (!step.ok()) {
      return Failure{1,
                     absl::StrCat("training step: ", step.status().ToString())};
    }

    t = Clock::now();
    absl::Status wait_error;
    for (OpHandle op : ops_) {
      if (absl::Status s = kv_->Wait(op); !s.ok() && wait_error.ok())
        wait_error = s;
    }
    totals_.time_comm_s += SecondsSince(t);
    phase("comm-wait");
    if (!issue_error.ok()) return KvFailure("KV request", issue_error);
    if (!wait_error.ok()) return KvFailure("KV request", wait_error);
    if (flags_.fuse_keys) ScatterFusedPull();
    if (absl::Status s = mlp_->CommitStagedParams(); !s.ok())
      return Failure{1, s.ToString()};
    if (step_start != 0) {
      const int64_t now = trace::NowNanos();
      trace::Complete("train", "commit", phase_start, now);
      trace::Complete("train", "step", step_start, now,
                      {{"epoch", epoch},
                       {"batch", b},
                       {"step", totals_.steps},
                       {"samples", step->rows}});
    }

    Account(epoch, b, *step, counts);
    return std::nullopt;
  }

  // A finished step's counts, and the progress line every --log-every batches.
  void Account(int epoch, int b, const MlpBatchStats& step,
               EpochCounts* counts) {
    if (totals_.steps == 0) totals_.first_loss = step.loss_sum / step.rows;
    ++totals_.steps;
    totals_.samples += step.rows;
    counts->window_samples += step.rows;
    counts->window_correct += step.correct;
    counts->samples += step.rows;
    counts->correct += step.correct;
    counts->loss += step.loss_sum;
    if ((b + 1) % flags_.log_every == 0) {
      const double secs = SecondsSince(counts->window_start);
      std::printf(
          "Epoch[%d] Batch[%d] Speed: %.2f samples/sec accuracy=%.6f\n", epoch,
          b + 1, secs > 0 ? counts->window_samples / secs : 0.0,
          static_cast<double>(counts->window_correct) / counts->window_samples);
      std::fflush(stdout);
      counts->window_start = Clock::now();
      counts->window_samples = counts->window_correct = 0;
    }
  }

  // Accuracy on the test set (converted to floats once).
  absl::StatusOr<double> Evaluate() {
    const Clock::time_point t0 = Clock::now();
    if (!test_.has_value()) test_ = ToFloat(data_.test);
    absl::StatusOr<MlpBatchStats> s =
        mlp_->Evaluate(test_->x.data(), test_->y.data(), data_.test.count);
    totals_.time_eval_s += SecondsSince(t0);
    if (!s.ok()) return s.status();
    return s->rows > 0 ? static_cast<double>(s->correct) / s->rows : 0.0;
  }

  // The other ranks' final accuracy (for --metrics-out), the job's end and
  // the metrics file.
  MaybeFailure Finish() {
    if (kv_->rank() != 0 && !flags_.metrics_out.empty()) {
      // In dist_sync every worker holds the same final weights; in dist_async
      // this is the model as this worker last pulled it.
      absl::StatusOr<double> acc = Evaluate();
      if (!acc.ok()) {
        return Failure{1,
                       absl::StrCat("evaluation: ", acc.status().ToString())};
      }
      totals_.test_accuracy = *acc;
    }
    totals_.wall_seconds = SecondsSince(run_start_);
    absl::StatusOr<uint64_t> checksum = WeightsChecksum();
    if (!checksum.ok())
      return KvFailure("Pull of the final weights", checksum.status());
    totals_.weights_fnv1a = *checksum;
    std::printf("Final weights checksum=%016llx\n",
                static_cast<unsigned long long>(*checksum));
    std::fflush(stdout);

    if (absl::Status s = kv_->Close(); !s.ok()) return KvFailure("Close", s);
    if (!flags_.metrics_out.empty()) {
      const std::string path = absl::StrReplaceAll(
          flags_.metrics_out, {{"{rank}", absl::StrCat(kv_->rank())}});
      if (absl::Status s = WriteFileAtomically(
              path, MetricsJson(flags_, device_, *kv_, totals_));
          !s.ok()) {
        return Failure{1, absl::StrCat("--metrics-out: ", s.message())};
      }
    }
    return std::nullopt;
  }

  // The servers' final weights, pulled key by key (layer by layer, W then
  // b; or the fused key), hashed.
  absl::StatusOr<uint64_t> WeightsChecksum() {
    uint64_t h = 14695981039346656037ULL;
    auto add = [&h](const std::vector<float>& v) {
      const auto* p = reinterpret_cast<const unsigned char*>(v.data());
      for (size_t i = 0; i < v.size() * sizeof(float); ++i) {
        h ^= p[i];
        h *= 1099511628211ULL;
      }
    };
    auto pull = [&](uint64_t key, size_t n) -> absl::Status {
      std::vector<float> v(n);
      absl::Status pulled = kv_->Pull(key, absl::MakeSpan(v));
      if (pulled.ok()) add(v);
      return pulled;
    };
    if (flags_.fuse_keys) {
      absl::Status s = pull(kFusedKey, fused_pull_.size());
      if (!s.ok()) return s;
      return h;
    }
    for (int l = 0; l < mlp_->num_layers(); ++l) {
      absl::Status s = pull(MlpWeightKey(l), mlp_->WeightStaging(l).size());
      if (s.ok()) s = pull(MlpBiasKey(l), mlp_->BiasStaging(l).size());
      if (!s.ok()) return s;
    }
    return h;
  }

  const TrainFlags& flags_;
  MlpDevice device_ = MlpDevice::kCpu;
  FashionMnist data_;
  std::optional<FloatImages> test_;
  std::unique_ptr<KVWorker> kv_;
  BatchLoader::Options loader_options_;
  std::unique_ptr<BatchLoader> loader_;
  std::unique_ptr<Mlp> mlp_;
  int64_t steps_per_epoch_ = 0;
  int64_t skip_ = 0;  // steps of an earlier life still to skip
  Straggler straggler_{flags_.slow_every, flags_.slow_factor};
  bool resumed_ = false;
  std::vector<OpHandle> ops_;  // the step's pushes and pulls

  // --fuse-keys on: every parameter in one key, each layer's W then b, in
  // layer order; tensor t (2l: W of layer l, 2l + 1: its b) at fused_at_[t].
  static constexpr uint64_t kFusedKey = 1000;
  std::vector<size_t> fused_at_;
  std::vector<float> fused_grad_, fused_pull_;

  // Layer l's gradients into the fused gradient; after the last layer
  // backward reaches (layer 0), the fused push and pull are issued.
  void FuseLayerGrads(int l, absl::Status* error) {
    if (!error->ok()) return;
    float* w = fused_grad_.data() + fused_at_[2 * l];
    float* b = fused_grad_.data() + fused_at_[2 * l + 1];
    const size_t w_len = fused_at_[2 * l + 1] - fused_at_[2 * l];
    const size_t b_len = fused_at_[2 * l + 2] - fused_at_[2 * l + 1];
    if (mlp_->device() == MlpDevice::kCuda) {
      const LayerParams g = mlp_->GetGrads(l);  // copied to the host
      std::copy(g.w.begin(), g.w.end(), w);
      std::copy(g.b.begin(), g.b.end(), b);
    } else {
      std::memcpy(w, mlp_->WeightGrad(l), w_len * sizeof(float));
      std::memcpy(b, mlp_->BiasGrad(l), b_len * sizeof(float));
    }
    if (l != 0) return;
    absl::StatusOr<OpHandle> push =
        kv_->PushAsync(kFusedKey, absl::MakeConstSpan(fused_grad_));
    if (!push.ok()) {
      *error = absl::Status(push.status().code(),
                            absl::StrCat("push of key ", kFusedKey, ": ",
                                         push.status().message()));
      return;
    }
    ops_.push_back(*push);
    absl::StatusOr<OpHandle> pull =
        kv_->PullAsync(kFusedKey, absl::MakeSpan(fused_pull_));
    if (!pull.ok()) {
      *error = absl::Status(pull.status().code(),
                            absl::StrCat("pull of key ", kFusedKey, ": ",
                                         pull.status().message()));
      return;
    }
    ops_.push_back(*pull);
  }

  // The fused pull into every layer's staging.
  void ScatterFusedPull() {
    for (int l = 0; l < mlp_->num_layers(); ++l) {
      const absl::Span<float> w = mlp_->WeightStaging(l);
      const absl::Span<float> b = mlp_->BiasStaging(l);
      std::memcpy(w.data(), fused_pull_.data() + fused_at_[2 * l],
                  w.size() * sizeof(float));
      std::memcpy(b.data(), fused_pull_.data() + fused_at_[2 * l + 1],
                  b.size() * sizeof(float));
    }
  }
  RunTotals totals_;
  Clock::time_point run_start_;
  bool left_ = false;  // SIGTERM in an elastic job: leaving after this step
};

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<tessera::TrainFlags> flags =
      tessera::ParseTrainFlags(args, std::getenv("FASHION_MNIST_DIR"));
  if (!flags.ok())
    return tessera::Fail(2, std::string(flags.status().message()));
  if (flags->help) {
    std::cout << tessera::TrainFlagsUsage();
    return 0;
  }
  // The CPU path's OpenBLAS kernels (may start this program again).
  if (flags->device != "cuda")
    tessera::ChooseBlasKernels("tessera-worker", argv);
  return tessera::Trainer(*flags).Run();
}

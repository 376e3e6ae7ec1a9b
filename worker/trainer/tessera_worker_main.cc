// tessera-worker: trains an MLP classifier on Fashion-MNIST as one worker of a
// Tessera job. The servers hold the weights and run the optimizer; every step
// this worker computes the gradient of its local batch, pushes it layer by
// layer from the last layer down (while backward still runs on the layers
// below) and pulls the new weights; the next step's forward waits for each
// layer's new weights just before that layer (--wait-pulls layer, the
// default).
//
//   tessera-worker --kv-store dist_sync --batch-size 128 --epochs 10 --device
//   cpu
//
// Exit codes: 0 done; 2 a bad flag, missing data or unusable device (one line
// on stderr naming the flag); 1 a failure of the cluster (the KV client's
// error).
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
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
#include "common/gpu/device.h"
#include "common/trace.h"
#include "tessera/kv_worker.h"
#include "worker/trainer/batch_loader.h"
#include "worker/trainer/blas_core.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/mlp.h"
#include "worker/trainer/train_flags.h"
#include "worker/trainer/training_loop.h"

namespace tessera {
namespace {

// Elastic jobs: SIGTERM asks this worker to leave after its step in progress.
std::atomic<bool> leave_requested{false};
extern "C" void RequestLeave(int) { leave_requested.store(true); }

int Fail(int code, const std::string& message) {
  std::cerr << "tessera-worker: " << message << std::endl;
  return code;
}

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
  // What the run did: --fuse-keys on waits by step whatever --wait-pulls says.
  absl::StrAppendFormat(&json, ", \"wait_pulls\": \"%s\"",
                        flags.fuse_keys ? "step" : flags.wait_pulls);
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

// One worker's training run: prepare (device, data, output), join the job,
// configure the servers, then the TrainingLoop (start from the servers'
// weights, the epochs, each a loop of steps), and the summary.
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
    loop_ = std::make_unique<TrainingLoop>(flags_, data_, loader_options_, *kv_,
                                           *mlp_, steps_per_epoch_,
                                           &leave_requested, &totals_);
    if (MaybeFailure f = loop_->StartFromServerWeights()) return f;
    // An elastic job's worker leaves on SIGTERM after its step in progress;
    // in other jobs SIGTERM ends the process as it always did.
    const char* elastic = std::getenv("TESSERA_ELASTIC");
    if (elastic != nullptr && *elastic != '\0')
      std::signal(SIGTERM, RequestLeave);
    if (MaybeFailure f = loop_->Run()) return f;
    if (loop_->left()) return LeaveJob();
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
    const bool sync =
        flags_.kv_store == "dist_sync" || flags_.kv_store == "dist_device_sync";
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

  // The other ranks' final accuracy (for --metrics-out), the job's end and
  // the metrics file.
  MaybeFailure Finish() {
    if (kv_->rank() != 0 && !flags_.metrics_out.empty()) {
      // In dist_sync every worker holds the same final weights; in dist_async
      // this is the model as this worker last pulled it.
      absl::StatusOr<double> acc = loop_->Evaluate();
      if (!acc.ok()) {
        return Failure{1,
                       absl::StrCat("evaluation: ", acc.status().ToString())};
      }
      totals_.test_accuracy = *acc;
    }
    totals_.wall_seconds = loop_->SecondsSinceStart();
    absl::StatusOr<uint64_t> checksum = loop_->WeightsChecksum();
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

  const TrainFlags& flags_;
  MlpDevice device_ = MlpDevice::kCpu;
  FashionMnist data_;
  std::unique_ptr<KVWorker> kv_;
  BatchLoader::Options loader_options_;
  std::unique_ptr<Mlp> mlp_;
  int64_t steps_per_epoch_ = 0;
  RunTotals totals_;
  std::unique_ptr<TrainingLoop> loop_;
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

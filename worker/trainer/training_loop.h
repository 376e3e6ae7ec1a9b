// TrainingLoop: the steps of one tessera-worker's training run, once the
// worker has joined the job and configured the servers. It starts the model
// from the servers' weights (every key initialized, rank 0's values kept, and
// pulled; a worker restarted into a running job skips the steps its earlier
// life completed), then runs the epochs, each a loop of steps: forward and
// backward, each layer's push and pull issued as backward reaches it (with
// --fuse-keys, one push and pull of every parameter at once), the wait for
// them and the new weights. With --wait-pulls layer (the default, a key per
// tensor) a step's pushes and pulls are not waited for at its end: the next
// step's forward waits for each layer's just before that layer runs and
// commits that layer's weights, so the first layers compute while the last
// ones' pulls still travel. Whatever is still pending is waited for before
// anything else reads the weights or the job ends: at an epoch's end (before
// rank 0's evaluation), before leaving, at the end of Run, in Evaluate and in
// WeightsChecksum. It prints the progress lines, evaluates rank 0's model
// after each epoch and counts what it did in a RunTotals.
//
//   RunTotals totals;
//   TrainingLoop loop(flags, data, loader_options, *kv, *mlp, steps_per_epoch,
//                     &leave_requested, &totals);
//   if (MaybeFailure f = loop.StartFromServerWeights()) return f;
//   if (MaybeFailure f = loop.Run()) return f;
//   absl::StatusOr<uint64_t> checksum = loop.WeightsChecksum();
//
// Thread-safety: none (the worker's main thread).
#ifndef TESSERA_WORKER_TRAINER_TRAINING_LOOP_H_
#define TESSERA_WORKER_TRAINER_TRAINING_LOOP_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tessera/kv_worker.h"
#include "worker/trainer/batch_loader.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/mlp.h"
#include "worker/trainer/straggler.h"
#include "worker/trainer/train_flags.h"

namespace tessera {

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
  // Waiting for pushes and pulls: after backward (--wait-pulls step), or
  // before each layer's forward and at an epoch's end (layer).
  double time_comm_s = 0;
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

// The test images as floats in [0, 1], converted once.
struct FloatImages {
  std::vector<float> x;
  std::vector<int32_t> y;
};

// Why a run stops early: the exit code and the line for stderr.
struct Failure {
  int code;
  std::string message;
};
using MaybeFailure = std::optional<Failure>;  // nullopt: go on

// A failed KV call `what`: exit code 1.
MaybeFailure KvFailure(const std::string& what, const absl::Status& s);

class TrainingLoop {
 public:
  // Every reference and pointer must outlive the loop. `steps_per_epoch`:
  // the steps every worker runs an epoch (for the resume line). When
  // `*leave_requested` turns true, the loop stops after the step in progress
  // (left()). The loop adds to `*totals`.
  TrainingLoop(const TrainFlags& flags, const FashionMnist& data,
               const BatchLoader::Options& loader_options, KVWorker& kv,
               Mlp& mlp, int64_t steps_per_epoch,
               const std::atomic<bool>* leave_requested, RunTotals* totals);
  TrainingLoop(const TrainingLoop&) = delete;
  TrainingLoop& operator=(const TrainingLoop&) = delete;

  // Initializes the keys (rank 0's values are kept) and pulls them, so every
  // worker starts from the stored weights; a worker restarted into a running
  // job (launch.py --restarts) pulls the servers' current weights and skips
  // the steps its earlier life completed. REQUIRES: called once, before Run.
  MaybeFailure StartFromServerWeights();

  // The epochs, until the last or until a leave was requested. Errors (here
  // and in StartFromServerWeights): exit code 1 and the line for stderr, for
  // a failed KV call, training step or evaluation.
  MaybeFailure Run();

  // True when Run stopped early because a leave was requested: every push of
  // the steps it ran was answered (waited for before leaving).
  bool left() const { return left_; }

  // Seconds since Run began.
  double SecondsSinceStart() const;

  // Accuracy on the test set (converted to floats once); the time it took is
  // added to time_eval_s. Pending pulls are waited for first (Run leaves none).
  absl::StatusOr<double> Evaluate();

  // The servers' final weights, pulled key by key (layer by layer, W then
  // b; or the fused key), hashed. Pending pushes and pulls are waited for
  // first (Run leaves none).
  absl::StatusOr<uint64_t> WeightsChecksum();

 private:
  using Clock = std::chrono::steady_clock;
  // What one epoch counted so far.
  struct EpochCounts {
    Clock::time_point window_start;
    int64_t window_samples = 0, window_correct = 0;
    int64_t samples = 0, correct = 0;
    double loss = 0;
  };

  MaybeFailure TrainEpoch(int epoch);
  MaybeFailure Step(int epoch, int b, EpochCounts* counts, bool* done);
  absl::StatusOr<MlpBatchStats> ComputeAndIssue(
      const Batch& batch, const std::function<void()>& on_forward_done,
      absl::Status* issue_error, MaybeFailure* wait_failure);
  // --wait-pulls layer: the hook before layer l's forward.
  absl::Status BeforeLayerForward(int l, double* wait_s,
                                  MaybeFailure* wait_failure);
  // --wait-pulls step (or --fuse-keys): every op of the step; the first
  // error. --wait-pulls layer: nothing (OK).
  absl::Status WaitStep();
  // Waits for layer l's pending ops (all, even after an error; the first
  // error kept in *wait_error when it holds none) and, when they succeeded,
  // commits the layer's staged weights: that commit's status.
  absl::Status WaitLayer(int l, absl::Status* wait_error);
  // WaitLayer for every layer: the first commit error.
  absl::Status WaitPending(absl::Status* wait_error);
  // WaitPending, its time added to time_comm_s; a wait error ends the job as
  // a step's does ("KV request: ...").
  MaybeFailure DrainPending();
  void Account(int epoch, int b, const MlpBatchStats& step,
               EpochCounts* counts);
  void FuseLayerGrads(int l, absl::Status* error);
  void ScatterFusedPull();

  const TrainFlags& flags_;
  const FashionMnist& data_;
  const BatchLoader::Options loader_options_;
  KVWorker& kv_;
  Mlp& mlp_;
  const int64_t steps_per_epoch_;
  const std::atomic<bool>* const leave_requested_;
  RunTotals* const totals_;

  std::optional<FloatImages> test_;
  std::unique_ptr<BatchLoader> loader_;
  int64_t skip_ = 0;  // steps of an earlier life still to skip
  Straggler straggler_{flags_.slow_every, flags_.slow_factor};
  bool resumed_ = false;
  // --wait-pulls layer with a key per tensor: each layer's pushes and pulls
  // are waited for before its next forward.
  const bool wait_by_layer_ = flags_.wait_pulls == "layer" && !flags_.fuse_keys;
  std::vector<OpHandle> ops_;  // --fuse-keys: the step's push and pull
  // A key per tensor: each layer's pushes and pulls not yet waited for.
  std::vector<std::vector<OpHandle>> layer_ops_;

  // --fuse-keys on: every parameter in one key, each layer's W then b, in
  // layer order; tensor t (2l: W of layer l, 2l + 1: its b) at fused_at_[t].
  static constexpr uint64_t kFusedKey = 1000;
  std::vector<size_t> fused_at_;
  std::vector<float> fused_grad_, fused_pull_;

  Clock::time_point run_start_;
  bool left_ = false;  // a leave was requested: leaving after this step
};

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_TRAINING_LOOP_H_

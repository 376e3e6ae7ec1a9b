#include "worker/trainer/training_loop.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "common/trace.h"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

FloatImages ToFloat(const LabeledImages& data) {
  FloatImages out;
  out.x.resize(data.pixels.size());
  for (size_t i = 0; i < data.pixels.size(); ++i)
    out.x[i] = data.pixels[i] / 255.0f;
  out.y.assign(data.labels.begin(), data.labels.end());
  return out;
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

}  // namespace

MaybeFailure KvFailure(const std::string& what, const absl::Status& s) {
  return Failure{1, absl::StrCat(what, ": ", s.ToString())};
}

TrainingLoop::TrainingLoop(const TrainFlags& flags, const FashionMnist& data,
                           const BatchLoader::Options& loader_options,
                           KVWorker& kv, Mlp& mlp, int64_t steps_per_epoch,
                           const std::atomic<bool>* leave_requested,
                           RunTotals* totals)
    : flags_(flags),
      data_(data),
      loader_options_(loader_options),
      kv_(kv),
      mlp_(mlp),
      steps_per_epoch_(steps_per_epoch),
      leave_requested_(leave_requested),
      totals_(totals),
      layer_ops_(mlp.num_layers()) {}

double TrainingLoop::SecondsSinceStart() const {
  return SecondsSince(run_start_);
}

MaybeFailure TrainingLoop::StartFromServerWeights() {
  const std::vector<LayerParams> init = mlp_.GetParams();
  if (flags_.fuse_keys) {
    // One key: every layer's W then b, in layer order.
    fused_at_.clear();
    std::vector<float> all;
    for (int l = 0; l < mlp_.num_layers(); ++l) {
      fused_at_.push_back(all.size());
      all.insert(all.end(), init[l].w.begin(), init[l].w.end());
      fused_at_.push_back(all.size());
      all.insert(all.end(), init[l].b.begin(), init[l].b.end());
    }
    fused_at_.push_back(all.size());
    fused_grad_.assign(all.size(), 0.0f);
    fused_pull_.assign(all.size(), 0.0f);
    if (absl::Status s = kv_.Init(kFusedKey, all); !s.ok())
      return KvFailure(absl::StrCat("Init of key ", kFusedKey), s);
    if (absl::Status s = kv_.Pull(kFusedKey, absl::MakeSpan(fused_pull_));
        !s.ok()) {
      return KvFailure(absl::StrCat("Pull of key ", kFusedKey), s);
    }
    ScatterFusedPull();
  }
  for (int l = 0; !flags_.fuse_keys && l < mlp_.num_layers(); ++l) {
    if (absl::Status s = kv_.Init(MlpWeightKey(l), init[l].w); !s.ok())
      return KvFailure(absl::StrCat("Init of key ", MlpWeightKey(l)), s);
    if (absl::Status s = kv_.Init(MlpBiasKey(l), init[l].b); !s.ok())
      return KvFailure(absl::StrCat("Init of key ", MlpBiasKey(l)), s);
  }
  for (int l = 0; !flags_.fuse_keys && l < mlp_.num_layers(); ++l) {
    if (absl::Status s = kv_.Pull(MlpWeightKey(l), mlp_.WeightStaging(l));
        !s.ok()) {
      return KvFailure(absl::StrCat("Pull of key ", MlpWeightKey(l)), s);
    }
    if (absl::Status s = kv_.Pull(MlpBiasKey(l), mlp_.BiasStaging(l));
        !s.ok()) {
      return KvFailure(absl::StrCat("Pull of key ", MlpBiasKey(l)), s);
    }
  }
  if (absl::Status s = mlp_.CommitStagedParams(); !s.ok())
    return Failure{1, s.ToString()};

  skip_ = static_cast<int64_t>(kv_.ResumeRound());
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

MaybeFailure TrainingLoop::Run() {
  loader_ = std::make_unique<BatchLoader>(&data_.train, loader_options_);
  run_start_ = Clock::now();
  for (int epoch = 0; epoch < flags_.epochs && !left_; ++epoch) {
    if (MaybeFailure f = TrainEpoch(epoch)) return f;
  }
  return DrainPending();  // none left: each epoch's end drained them
}

MaybeFailure TrainingLoop::TrainEpoch(int epoch) {
  const Clock::time_point epoch_start = Clock::now();
  const double eval_before = totals_->time_eval_s;
  const RunTotals before = *totals_;
  EpochCounts counts;
  counts.window_start = epoch_start;
  for (int b = 0;; ++b) {
    if (leave_requested_->load()) {
      // Between steps: every push of this one answered, once waited for.
      if (MaybeFailure f = DrainPending()) return f;
      left_ = true;
      return std::nullopt;
    }
    bool done = false;
    if (MaybeFailure f = Step(epoch, b, &counts, &done)) return f;
    if (done) break;
  }
  // The last step's pulls, before the evaluation reads the weights (and so
  // that an epoch's time holds all of its communication).
  if (MaybeFailure f = DrainPending()) return f;
  if (resumed_ && totals_->steps == 0) return std::nullopt;  // skipped whole
  const double epoch_seconds = SecondsSince(epoch_start);
  totals_->train_accuracy =
      counts.samples > 0 ? static_cast<double>(counts.correct) / counts.samples
                         : 0.0;
  totals_->final_loss = counts.samples > 0 ? counts.loss / counts.samples : 0.0;
  std::printf("Epoch[%d] Train-accuracy=%.6f\n", epoch,
              totals_->train_accuracy);
  if (kv_.rank() == 0) {
    absl::StatusOr<double> acc = Evaluate();
    if (!acc.ok()) {
      return Failure{1, absl::StrCat("evaluation: ", acc.status().ToString())};
    }
    totals_->test_accuracy = *acc;
    std::printf("Epoch[%d] Validation-accuracy=%.6f\n", epoch, *acc);
  }
  // Training time of the epoch; the evaluation is not part of it.
  const double train_seconds =
      epoch_seconds - (totals_->time_eval_s - eval_before);
  std::printf("Epoch[%d] Time cost=%.3f\n", epoch, train_seconds);
  std::fflush(stdout);
  EpochRecord record;
  record.epoch = epoch;
  record.seconds = train_seconds;
  record.samples = counts.samples;
  record.train_accuracy = totals_->train_accuracy;
  record.validation_accuracy = kv_.rank() == 0 ? totals_->test_accuracy : -1;
  record.time_compute_s = totals_->time_compute_s - before.time_compute_s;
  record.time_comm_s = totals_->time_comm_s - before.time_comm_s;
  record.time_issue_s = totals_->time_issue_s - before.time_issue_s;
  record.time_data_s = totals_->time_data_s - before.time_data_s;
  totals_->epochs.push_back(record);
  return std::nullopt;
}

// Batch `b` of `epoch`: forward and backward, each layer's push and pull
// issued as backward reaches it, the wait for them, and the new weights
// (--wait-pulls layer: the previous step's, layer by layer in this forward).
// `*done` when the epoch has no batch left.
//
// TESSERA_TRACE: a "step" span holding data-wait, forward (--wait-pulls
// layer: with a "layer-wait" span per layer), backward (with an "issue" span
// per layer: compression and the requests) and comm-wait (waiting for the
// pushes and pulls; empty with --wait-pulls layer), then commit.
MaybeFailure TrainingLoop::Step(int epoch, int b, EpochCounts* counts,
                                bool* done) {
  const int64_t step_start = trace::Enabled() ? trace::NowNanos() : 0;
  Clock::time_point t = Clock::now();
  std::optional<Batch> batch = loader_->Next();
  totals_->time_data_s += SecondsSince(t);
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

  absl::Status issue_error;
  MaybeFailure wait_failure;  // a layer's wait before its forward
  absl::StatusOr<MlpBatchStats> step = ComputeAndIssue(
      *batch,
      step_start == 0 ? std::function<void()>() : [&] { phase("forward"); },
      &issue_error, &wait_failure);
  phase("backward");
  if (wait_failure.has_value()) {
    (void)DrainPending();  // the rest; the first failure is the one told
    return wait_failure;
  }
  if (!step.ok()) {
    return Failure{1,
                   absl::StrCat("training step: ", step.status().ToString())};
  }

  t = Clock::now();
  const absl::Status wait_error = WaitStep();
  totals_->time_comm_s += SecondsSince(t);
  phase("comm-wait");
  if (!issue_error.ok()) {
    (void)DrainPending();  // --wait-pulls layer: the ops issued before it
    return KvFailure("KV request", issue_error);
  }
  if (!wait_error.ok()) return KvFailure("KV request", wait_error);
  if (flags_.fuse_keys) ScatterFusedPull();
  if (!wait_by_layer_) {
    if (absl::Status s = mlp_.CommitStagedParams(); !s.ok())
      return Failure{1, s.ToString()};
  }
  if (step_start != 0) {
    const int64_t now = trace::NowNanos();
    trace::Complete("train", "commit", phase_start, now);
    trace::Complete("train", "step", step_start, now,
                    {{"epoch", epoch},
                     {"batch", b},
                     {"step", totals_->steps},
                     {"samples", step->rows}});
  }

  Account(epoch, b, *step, counts);
  return std::nullopt;
}

// The compute of a step (after --slow-every's sleep, when this is a slow
// step): forward and backward, with each layer's push and pull issued as
// backward reaches it (the first error kept in `*issue_error`); with
// --wait-pulls layer, each layer's previous ops waited for before its forward
// (a failure there kept in `*wait_failure`; it stops the step). The waits
// count as time_comm_s, not compute.
absl::StatusOr<MlpBatchStats> TrainingLoop::ComputeAndIssue(
    const Batch& batch, const std::function<void()>& on_forward_done,
    absl::Status* issue_error, MaybeFailure* wait_failure) {
  const Clock::time_point t = Clock::now();
  // --slow-every: a straggler's slow step (its pushes come late).
  const absl::Duration slow =
      flags_.slow_rank < 0 || flags_.slow_rank == kv_.rank()
          ? straggler_.Delay(totals_->steps)
          : absl::ZeroDuration();
  if (slow > absl::ZeroDuration()) absl::SleepFor(slow);
  ops_.clear();
  double step_issue_s = 0, step_wait_s = 0;
  std::function<absl::Status(int)> before_layer;
  if (wait_by_layer_) {
    before_layer = [&](int l) {
      return BeforeLayerForward(l, &step_wait_s, wait_failure);
    };
  }
  absl::StatusOr<MlpBatchStats> step = mlp_.ForwardBackward(
      batch.images.data(), batch.labels.data(), batch.size,
      [&](int l) {
        trace::Span span("train", "issue");
        span.Arg("layer", l);
        const Clock::time_point issue = Clock::now();
        if (flags_.fuse_keys) {
          FuseLayerGrads(l, issue_error);
        } else {
          PushPullLayer(kv_, mlp_, l, &layer_ops_[l], issue_error);
        }
        step_issue_s += SecondsSince(issue);
      },
      on_forward_done, before_layer);
  const double compute_s = SecondsSince(t) - step_issue_s - step_wait_s;
  totals_->time_compute_s += compute_s;
  straggler_.Observe(absl::Seconds(compute_s) - slow);
  totals_->time_issue_s += step_issue_s;
  totals_->time_comm_s += step_wait_s;
  return step;
}

absl::Status TrainingLoop::BeforeLayerForward(int l, double* wait_s,
                                              MaybeFailure* wait_failure) {
  trace::Span span("train", "layer-wait");
  span.Arg("layer", l);
  const Clock::time_point t = Clock::now();
  absl::Status wait_error;
  const absl::Status commit = WaitLayer(l, &wait_error);
  *wait_s += SecondsSince(t);
  if (!wait_error.ok()) {
    *wait_failure = KvFailure("KV request", wait_error);
    return wait_error;
  }
  if (!commit.ok()) *wait_failure = Failure{1, commit.ToString()};
  return commit;
}

absl::Status TrainingLoop::WaitStep() {
  if (wait_by_layer_) return absl::OkStatus();
  absl::Status wait_error;
  auto wait = [&](std::vector<OpHandle>* ops) {
    for (OpHandle op : *ops) {
      if (absl::Status s = kv_.Wait(op); !s.ok() && wait_error.ok())
        wait_error = s;
    }
    ops->clear();
  };
  wait(&ops_);
  // In the order they were issued: from the last layer down.
  for (int l = mlp_.num_layers() - 1; l >= 0; --l) wait(&layer_ops_[l]);
  return wait_error;
}

absl::Status TrainingLoop::WaitLayer(int l, absl::Status* wait_error) {
  std::vector<OpHandle>& ops = layer_ops_[l];
  if (ops.empty()) return absl::OkStatus();
  absl::Status first;
  for (OpHandle op : ops) {
    if (absl::Status s = kv_.Wait(op); !s.ok() && first.ok()) first = s;
  }
  ops.clear();
  if (!first.ok()) {
    if (wait_error->ok()) *wait_error = first;
    return absl::OkStatus();
  }
  return mlp_.CommitStagedLayer(l);
}

absl::Status TrainingLoop::WaitPending(absl::Status* wait_error) {
  absl::Status commit;
  for (int l = 0; l < mlp_.num_layers(); ++l) {
    if (absl::Status s = WaitLayer(l, wait_error); !s.ok() && commit.ok())
      commit = s;
  }
  return commit;
}

MaybeFailure TrainingLoop::DrainPending() {
  trace::Span span("train", "drain");
  const Clock::time_point t = Clock::now();
  absl::Status wait_error;
  const absl::Status commit = WaitPending(&wait_error);
  totals_->time_comm_s += SecondsSince(t);
  if (!wait_error.ok()) return KvFailure("KV request", wait_error);
  if (!commit.ok()) return Failure{1, commit.ToString()};
  return std::nullopt;
}

// A finished step's counts, and the progress line every --log-every batches.
void TrainingLoop::Account(int epoch, int b, const MlpBatchStats& step,
                           EpochCounts* counts) {
  if (totals_->steps == 0) totals_->first_loss = step.loss_sum / step.rows;
  ++totals_->steps;
  totals_->samples += step.rows;
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

absl::StatusOr<double> TrainingLoop::Evaluate() {
  absl::Status wait_error;
  if (absl::Status s = WaitPending(&wait_error); !wait_error.ok() || !s.ok())
    return wait_error.ok() ? s : wait_error;
  const Clock::time_point t0 = Clock::now();
  if (!test_.has_value()) test_ = ToFloat(data_.test);
  absl::StatusOr<MlpBatchStats> s =
      mlp_.Evaluate(test_->x.data(), test_->y.data(), data_.test.count);
  totals_->time_eval_s += SecondsSince(t0);
  if (!s.ok()) return s.status();
  return s->rows > 0 ? static_cast<double>(s->correct) / s->rows : 0.0;
}

absl::StatusOr<uint64_t> TrainingLoop::WeightsChecksum() {
  // This worker's last pushes, so the servers' weights hold them.
  absl::Status wait_error;
  if (absl::Status s = WaitPending(&wait_error); !wait_error.ok() || !s.ok())
    return wait_error.ok() ? s : wait_error;
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
    absl::Status pulled = kv_.Pull(key, absl::MakeSpan(v));
    if (pulled.ok()) add(v);
    return pulled;
  };
  if (flags_.fuse_keys) {
    absl::Status s = pull(kFusedKey, fused_pull_.size());
    if (!s.ok()) return s;
    return h;
  }
  for (int l = 0; l < mlp_.num_layers(); ++l) {
    absl::Status s = pull(MlpWeightKey(l), mlp_.WeightStaging(l).size());
    if (s.ok()) s = pull(MlpBiasKey(l), mlp_.BiasStaging(l).size());
    if (!s.ok()) return s;
  }
  return h;
}

// Layer l's gradients into the fused gradient; after the last layer
// backward reaches (layer 0), the fused push and pull are issued.
void TrainingLoop::FuseLayerGrads(int l, absl::Status* error) {
  if (!error->ok()) return;
  float* w = fused_grad_.data() + fused_at_[2 * l];
  float* b = fused_grad_.data() + fused_at_[2 * l + 1];
  const size_t w_len = fused_at_[2 * l + 1] - fused_at_[2 * l];
  const size_t b_len = fused_at_[2 * l + 2] - fused_at_[2 * l + 1];
  if (mlp_.device() == MlpDevice::kCuda) {
    const LayerParams g = mlp_.GetGrads(l);  // copied to the host
    std::copy(g.w.begin(), g.w.end(), w);
    std::copy(g.b.begin(), g.b.end(), b);
  } else {
    std::memcpy(w, mlp_.WeightGrad(l), w_len * sizeof(float));
    std::memcpy(b, mlp_.BiasGrad(l), b_len * sizeof(float));
  }
  if (l != 0) return;
  absl::StatusOr<OpHandle> push =
      kv_.PushAsync(kFusedKey, absl::MakeConstSpan(fused_grad_));
  if (!push.ok()) {
    *error = absl::Status(
        push.status().code(),
        absl::StrCat("push of key ", kFusedKey, ": ", push.status().message()));
    return;
  }
  ops_.push_back(*push);
  absl::StatusOr<OpHandle> pull =
      kv_.PullAsync(kFusedKey, absl::MakeSpan(fused_pull_));
  if (!pull.ok()) {
    *error = absl::Status(
        pull.status().code(),
        absl::StrCat("pull of key ", kFusedKey, ": ", pull.status().message()));
    return;
  }
  ops_.push_back(*pull);
}

// The fused pull into every layer's staging.
void TrainingLoop::ScatterFusedPull() {
  for (int l = 0; l < mlp_.num_layers(); ++l) {
    const absl::Span<float> w = mlp_.WeightStaging(l);
    const absl::Span<float> b = mlp_.BiasStaging(l);
    std::memcpy(w.data(), fused_pull_.data() + fused_at_[2 * l],
                w.size() * sizeof(float));
    std::memcpy(b.data(), fused_pull_.data() + fused_at_[2 * l + 1],
                b.size() * sizeof(float));
  }
}

}  // namespace tessera

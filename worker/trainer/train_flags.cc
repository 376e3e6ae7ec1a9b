#include "worker/trainer/train_flags.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/options.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

absl::Status Expected(absl::string_view flag, absl::string_view what,
                      absl::string_view value) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": expected ", what, ", got '", value, "'"));
}

absl::Status ParseInt(absl::string_view flag, absl::string_view value, int min,
                      absl::string_view what, int* out) {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < min)
    return Expected(flag, what, value);
  *out = v;
  return absl::OkStatus();
}

// A finite float in [min, max) (or [min, max] when max is infinite), or > min
// when `exclusive_min`.
absl::Status ParseFloat(absl::string_view flag, absl::string_view value,
                        float min, bool exclusive_min, float max,
                        absl::string_view what, float* out) {
  float v = 0;
  if (!absl::SimpleAtof(value, &v) || !std::isfinite(v) || v < min ||
      (exclusive_min && v == min) || v >= max) {
    return Expected(flag, what, value);
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseChoice(absl::string_view flag, absl::string_view value,
                         const std::vector<absl::string_view>& choices,
                         absl::string_view what, std::string* out) {
  for (absl::string_view c : choices) {
    if (value == c) {
      *out = std::string(value);
      return absl::OkStatus();
    }
  }
  return Expected(flag, what, value);
}

absl::Status ParseHidden(absl::string_view value, std::vector<int>* out) {
  constexpr absl::string_view kWhat =
      "comma-separated positive layer widths such as 256,128";
  std::vector<int> widths;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    int w = 0;
    if (!absl::SimpleAtoi(part, &w) || w <= 0 || w > (1 << 20)) {
      return Expected("hidden", kWhat, value);
    }
    widths.push_back(w);
  }
  *out = std::move(widths);
  return absl::OkStatus();
}

bool IsKnownFlag(absl::string_view name) {
  static constexpr absl::string_view kFlags[] = {
      "kv-store",       "batch-size",   "epochs",
      "gc-type",        "gc-threshold", "lr",
      "seed",           "hidden",       "optimizer",
      "momentum",       "wd",           "device",
      "data",           "train-subset", "test-subset",
      "log-every",      "metrics-out",  "lr-factor",
      "lr-step-epochs", "gc-pull",      "fuse-keys",
      "staleness",      "slow-every",   "slow-factor",
      "slow-rank",      "wait-pulls"};
  for (absl::string_view f : kFlags) {
    if (name == f) return true;
  }
  return false;
}

float DefaultLearningRate(absl::string_view optimizer) {
  if (optimizer == "adam") return 0.001f;
  if (optimizer == "adamax") return 0.002f;
  if (optimizer == "adagrad") return 0.01f;
  return 0.1f;
}

// Which flags the command line gave: their defaults depend on other flags.
struct GivenFlags {
  bool lr = false, momentum = false, data = false, slow_factor = false,
       slow_rank = false, wait_pulls = false;
};

// The flags of dist_ssp and of a straggler (--staleness, --slow-every,
// --slow-factor, --slow-rank); false when `name` is none of them.
bool SetStalenessFlag(const std::string& name, const std::string& value,
                      TrainFlags* f, GivenFlags* given, absl::Status* s) {
  if (name == "staleness") {
    int64_t v = 0;
    if (!absl::SimpleAtoi(value, &v) || v < 0 || v > kMaxStaleness) {
      *s = Expected(
          name, absl::StrCat("a whole number of steps in 0..", kMaxStaleness),
          value);
    }
    f->staleness = v;
    return true;
  }
  if (name == "slow-every") {
    *s = ParseInt(name, value, 0, "a non-negative integer (0: off)",
                  &f->slow_every);
    return true;
  }
  if (name == "slow-factor") {
    float v = 0;
    *s = ParseFloat(name, value, 1, false, 1000, "a number in [1, 1000)", &v);
    f->slow_factor = v;
    given->slow_factor = true;
    return true;
  }
  if (name == "slow-rank") {
    *s = ParseInt(name, value, 0, "a worker rank (0 or more)", &f->slow_rank);
    given->slow_rank = true;
    return true;
  }
  return false;
}

// Sets flag --`name` (a known one) of `f` to `value`.
absl::Status SetTrainFlag(const std::string& name, const std::string& value,
                          TrainFlags* f, GivenFlags* given) {
  absl::Status s;
  if (SetStalenessFlag(name, value, f, given, &s)) return s;
  if (name == "kv-store") {
    s = ParseChoice(name, value,
                    {"dist_sync", "dist_async", "dist_ssp", "dist_device_sync"},
                    "dist_sync, dist_async, dist_ssp or dist_device_sync",
                    &f->kv_store);
  } else if (name == "batch-size") {
    s = ParseInt(name, value, 1, "a positive integer", &f->batch_size);
  } else if (name == "epochs") {
    s = ParseInt(name, value, 1, "a positive integer", &f->epochs);
  } else if (name == "gc-type") {
    s = ParseChoice(name, value, {"none", "2bit"}, "none or 2bit", &f->gc_type);
  } else if (name == "fuse-keys") {
    std::string choice;
    s = ParseChoice(name, value, {"on", "off"}, "on or off", &choice);
    f->fuse_keys = choice == "on";
  } else if (name == "wait-pulls") {
    s = ParseChoice(name, value, {"layer", "step"}, "layer or step",
                    &f->wait_pulls);
    given->wait_pulls = true;
  } else if (name == "gc-pull") {
    s = ParseChoice(name, value, {"none", "2bit"}, "none or 2bit", &f->gc_pull);
  } else if (name == "gc-threshold") {
    s = ParseFloat(name, value, 0, true, std::numeric_limits<float>::infinity(),
                   "a positive number", &f->gc_threshold);
  } else if (name == "lr") {
    s = ParseFloat(name, value, 0, true, std::numeric_limits<float>::infinity(),
                   "a positive number", &f->lr);
    given->lr = true;
  } else if (name == "seed") {
    if (!absl::SimpleAtoi(value, &f->seed)) {
      s = Expected(name, "a non-negative integer", value);
    }
  } else if (name == "hidden") {
    s = ParseHidden(value, &f->hidden);
  } else if (name == "optimizer") {
    s = ParseChoice(name, value, {"sgd", "adam", "adamax", "adagrad"},
                    "sgd, adam, adamax or adagrad", &f->optimizer);
  } else if (name == "momentum") {
    s = ParseFloat(name, value, 0, false, 1, "a number in [0, 1)",
                   &f->momentum);
    given->momentum = true;
  } else if (name == "wd") {
    s = ParseFloat(name, value, 0, false,
                   std::numeric_limits<float>::infinity(),
                   "a non-negative number", &f->wd);
  } else if (name == "lr-factor") {
    s = ParseFloat(name, value, 0, true, 1, "a number in (0, 1]",
                   &f->lr_factor);
  } else if (name == "lr-step-epochs") {
    s = ParseInt(name, value, 0, "a non-negative integer (0: off)",
                 &f->lr_step_epochs);
  } else if (name == "device") {
    s = ParseChoice(name, value, {"auto", "cuda", "cpu"}, "auto, cuda or cpu",
                    &f->device);
  } else if (name == "data") {
    if (value.empty()) s = Expected(name, "a directory", value);
    f->data_dir = value;
    given->data = true;
  } else if (name == "train-subset") {
    s = ParseInt(name, value, 0, "a non-negative integer (0: all)",
                 &f->train_subset);
  } else if (name == "test-subset") {
    s = ParseInt(name, value, 0, "a non-negative integer (0: all)",
                 &f->test_subset);
  } else if (name == "log-every") {
    s = ParseInt(name, value, 1, "a positive integer", &f->log_every);
  } else if (name == "metrics-out") {
    if (value.empty()) s = Expected(name, "a file path", value);
    f->metrics_out = value;
  }
  return s;
}

}  // namespace

absl::StatusOr<TrainFlags> ParseTrainFlags(const std::vector<std::string>& args,
                                           const char* fashion_mnist_dir_env) {
  TrainFlags f;
  GivenFlags given;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      f.help = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg,
                       "'; flags take the form --name=value or --name value"));
    }
    std::string name, value;
    const size_t eq = arg.find('=');
    name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (!IsKnownFlag(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag '--", name,
                       "'; run tessera-worker --help for the flags"));
    }
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size() && !absl::StartsWith(args[i + 1], "--")) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": expected a value"));
    }

    TESSERA_RETURN_IF_ERROR(SetTrainFlag(name, value, &f, &given));
  }
  if (given.momentum && f.optimizer != "sgd") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--momentum: only used by --optimizer sgd, not --optimizer ",
        f.optimizer));
  }
  if (f.staleness >= 0 && f.kv_store != "dist_ssp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--staleness: only used by --kv-store dist_ssp, not --kv-store ",
        f.kv_store));
  }
  if (given.wait_pulls && f.wait_pulls == "layer" && f.fuse_keys) {
    return absl::InvalidArgumentError(
        "--wait-pulls: layer needs a key per tensor, not --fuse-keys on (one "
        "key: its pull is waited for by step)");
  }
  if (given.slow_factor && f.slow_every == 0) {
    return absl::InvalidArgumentError(
        "--slow-factor: only used with --slow-every N (N > 0)");
  }
  if (given.slow_rank && f.slow_every == 0) {
    return absl::InvalidArgumentError(
        "--slow-rank: only used with --slow-every N (N > 0)");
  }
  if (!given.lr) f.lr = DefaultLearningRate(f.optimizer);
  // Measured with 2 workers: server-side momentum 0.9 diverges under dist_async
  // (stale pushes already act as momentum) and under 2-bit compression (the
  // residual already accumulates past gradients), while momentum 0 trains in
  // both. dist_ssp's pushes are stale as dist_async's (by up to s steps).
  const bool sync =
      f.kv_store == "dist_sync" || f.kv_store == "dist_device_sync";
  if (!given.momentum && (!sync || f.gc_type == "2bit")) {
    f.momentum = 0.0f;
  }
  if (!given.data && fashion_mnist_dir_env != nullptr &&
      *fashion_mnist_dir_env != 0) {
    f.data_dir = fashion_mnist_dir_env;
  }
  return f;
}

std::string TrainFlagsUsage() {
  return absl::StrCat(
      "Usage: tessera-worker [--name=value ...]\n"
      "Trains an MLP on Fashion-MNIST as one worker of a Tessera job (the "
      "launcher\n"
      "sets the DMLC_* environment).\n"
      "  --kv-store dist_sync|dist_async|dist_ssp|dist_device_sync  "
      "(dist_sync)\n"
      "  --staleness S                     dist_ssp's bound: a pull after c\n"
      "                                    pushes waits for every worker's\n"
      "                                    c - S (0..1000000; else\n"
      "                                    $TESSERA_STALENESS)\n"
      "  --slow-every N                    a straggler: every Nth step's\n"
      "                                    compute takes --slow-factor times\n"
      "                                    as long, by sleeping (0: off)\n"
      "  --slow-factor F                   (5; with --slow-every)\n"
      "  --slow-rank R                     only worker rank R is slow (with\n"
      "                                    --slow-every; default: every one)\n"
      "  --batch-size N                    per worker (128)\n"
      "  --epochs N                        (10)\n"
      "  --hidden W1,W2,...                hidden layer widths (256,128)\n"
      "  --optimizer sgd|adam|adamax|adagrad  runs on the servers (sgd)\n"
      "  --lr X                            (sgd 0.1, adam 0.001, adamax 0.002, "
      "adagrad 0.01)\n"
      "  --momentum X                      sgd only (0.9; 0 with dist_async, "
      "dist_ssp or 2bit)\n"
      "  --wd X                            weight decay (0.0001)\n"
      "  --gc-type none|2bit               gradient compression (none)\n"
      "  --gc-threshold X                  2-bit threshold (0.5)\n"
      "  --gc-pull none|2bit               pull compression: the change of "
      "the\n"
      "                                    weights, 2-bit coded (none)\n"
      "  --fuse-keys on|off                one key for every parameter: one\n"
      "                                    push and pull a step (off)\n"
      "  --wait-pulls layer|step           wait for each layer's pulled\n"
      "                                    weights just before its forward,\n"
      "                                    or for all at the end of the step\n"
      "                                    (layer; step with --fuse-keys on)\n"
      "  --seed N                          weights and shuffling (42)\n"
      "  --device auto|cuda|cpu            (auto: cuda when a GPU is present)\n"
      "  --data DIR                        (else $FASHION_MNIST_DIR, else ",
      kDefaultFashionMnistDir,
      ")\n"
      "  --train-subset N                  first N training images only (0: "
      "all)\n"
      "  --test-subset N                   first N test images only (0: all)\n"
      "  --lr-factor F                     multiply the learning rate by F "
      "every\n"
      "  --lr-step-epochs N                N epochs (0: constant rate; default "
      "0, F 0.1)\n"
      "  --log-every N                     progress line every N batches (50)\n"
      "  --metrics-out FILE                JSON metrics at the end; {rank} is "
      "replaced\n");
}

std::string OptimizerSpec(const TrainFlags& flags, double rescale_grad,
                          int64_t updates_per_epoch) {
  std::string spec = absl::StrFormat("%s lr=%.9g", flags.optimizer, flags.lr);
  if (flags.optimizer == "sgd") {
    absl::StrAppendFormat(&spec, " momentum=%.9g", flags.momentum);
  }
  absl::StrAppendFormat(&spec, " wd=%.9g rescale_grad=%.9g", flags.wd,
                        rescale_grad);
  if (flags.lr_step_epochs > 0 && updates_per_epoch > 0) {
    absl::StrAppendFormat(&spec, " lr_factor=%.9g lr_step=%d", flags.lr_factor,
                          flags.lr_step_epochs * updates_per_epoch);
  }
  return spec;
}

}  // namespace tessera

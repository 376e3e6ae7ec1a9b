// TrainFlags: the command line of tessera-worker, parsed and checked in one
// place so that every mistake is reported as one line naming the flag and what
// it expects.
//
//   absl::StatusOr<tessera::TrainFlags> flags =
//       tessera::ParseTrainFlags(args, std::getenv("FASHION_MNIST_DIR"));
//   if (!flags.ok()) {
//     std::cerr << "tessera-worker: " << flags.status().message() << "\n";
//     return 2;
//   }
//
// Flags take the form --name=value or --name value.
#ifndef TESSERA_WORKER_TRAINER_TRAIN_FLAGS_H_
#define TESSERA_WORKER_TRAINER_TRAIN_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera {

inline constexpr char kDefaultFashionMnistDir[] =
    "/usr/share/datasets/fashion-mnist";

struct TrainFlags {
  std::string kv_store = "dist_sync";  // dist_sync | dist_async | dist_ssp
  // dist_ssp's staleness bound (--staleness, 0..kMaxStaleness); -1: not
  // given (TESSERA_STALENESS's, which must then be set).
  int64_t staleness = -1;
  // A straggler, for experiments (worker/trainer/straggler.h): every
  // slow_every-th step's compute takes slow_factor times as long (the rest
  // slept). 0: off.
  int slow_every = 0;
  double slow_factor = 5;
  // The worker rank that is slow (--slow-rank); -1: every worker given
  // --slow-every (launch.py gives every worker the same flags).
  int slow_rank = -1;
  int batch_size = 128;  // per worker
  int epochs = 10;
  std::string gc_type = "none";  // none | 2bit
  std::string gc_pull = "none";  // none | 2bit: pull compression
  // on: every parameter travels in one key (one push and one pull a step,
  // after backward) instead of a key per tensor pushed as backward reaches it.
  bool fuse_keys = false;
  // When a step's pulled weights are waited for: "layer", each layer's just
  // before its forward in the next step (its pushes and pulls; the forward of
  // the layers before it overlaps the rest), or "step", every one at the end
  // of the step, before the next forward starts. --fuse-keys on waits by
  // step (one key).
  std::string wait_pulls = "layer";
  float gc_threshold = 0.5f;
  std::string optimizer = "sgd";  // sgd | adam | adamax | adagrad
  // Unless given, the optimizer's usual rate: sgd 0.1, adam 0.001, adamax
  // 0.002, adagrad 0.01.
  float lr = 0.1f;
  // sgd only. Unless given: 0.9, but 0 with dist_async or 2bit compression,
  // where server-side momentum was measured to diverge.
  float momentum = 0.9f;
  float wd = 1e-4f;
  // Step schedule (MXNet's --lr-factor / --lr-step-epochs): the learning rate
  // is multiplied by lr_factor every lr_step_epochs epochs; 0 turns it off.
  float lr_factor = 0.1f;
  int lr_step_epochs = 0;
  uint64_t seed = 42;
  std::vector<int> hidden = {256, 128};
  std::string device = "auto";  // auto | cuda | cpu
  // --data, else $FASHION_MNIST_DIR, else kDefaultFashionMnistDir.
  std::string data_dir = kDefaultFashionMnistDir;
  int train_subset = 0;  // 0: all
  int test_subset = 0;   // 0: all
  int log_every = 50;    // batches
  // Empty: no metrics file. "{rank}" in the path is replaced by the worker's
  // rank.
  std::string metrics_out;
  bool help = false;  // --help / -h: print TrainFlagsUsage() and exit 0
};

// Parses `args` (argv without the program name). `fashion_mnist_dir_env` is the
// value of $FASHION_MNIST_DIR or null. InvalidArgument whose message names the
// flag, what it holds and what was expected.
absl::StatusOr<TrainFlags> ParseTrainFlags(const std::vector<std::string>& args,
                                           const char* fashion_mnist_dir_env);

// The --help text.
std::string TrainFlagsUsage();

// The server optimizer spec for KVWorker::SetOptimizer, e.g.
// "sgd lr=0.1 momentum=0.9 wd=0.0001 rescale_grad=0.00390625".
// `updates_per_epoch` is how many updates a key sees in an epoch (the
// schedule's unit).
std::string OptimizerSpec(const TrainFlags& flags, double rescale_grad,
                          int64_t updates_per_epoch);

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_TRAIN_FLAGS_H_

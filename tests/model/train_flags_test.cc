// Tests of tessera-worker's flag parsing: defaults, both flag forms, the data
// directory's precedence and the one-line message of every bad flag; and
// the straggler the flags make (worker/trainer/straggler.h).
#include "worker/trainer/train_flags.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/trainer/straggler.h"

namespace tessera {
namespace {

absl::StatusOr<TrainFlags> Parse(std::vector<std::string> args,
                                 const char* env = nullptr) {
  return ParseTrainFlags(args, env);
}

std::string Error(std::vector<std::string> args) {
  absl::StatusOr<TrainFlags> f = Parse(std::move(args));
  EXPECT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(f.status().message());
}

TEST(TrainFlagsTest, Defaults) {
  absl::StatusOr<TrainFlags> f = Parse({});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kv_store, "dist_sync");
  EXPECT_EQ(f->batch_size, 128);
  EXPECT_EQ(f->epochs, 10);
  EXPECT_EQ(f->gc_type, "none");
  EXPECT_FLOAT_EQ(f->gc_threshold, 0.5f);
  EXPECT_EQ(f->optimizer, "sgd");
  EXPECT_FLOAT_EQ(f->lr, 0.1f);
  EXPECT_FLOAT_EQ(f->momentum, 0.9f);
  EXPECT_FLOAT_EQ(f->wd, 1e-4f);
  EXPECT_EQ(f->seed, 42u);
  EXPECT_EQ(f->hidden, (std::vector<int>{256, 128}));
  EXPECT_EQ(f->device, "auto");
  EXPECT_EQ(f->data_dir, "/usr/share/datasets/fashion-mnist");
  EXPECT_EQ(f->train_subset, 0);
  EXPECT_EQ(f->test_subset, 0);
  EXPECT_EQ(f->log_every, 50);
  EXPECT_EQ(f->metrics_out, "");
  EXPECT_FALSE(f->fuse_keys);
  EXPECT_FALSE(f->help);
}

TEST(TrainFlagsTest, FuseKeysIsOnOrOff) {
  EXPECT_TRUE(Parse({"--fuse-keys", "on"})->fuse_keys);
  EXPECT_TRUE(Parse({"--fuse-keys=on"})->fuse_keys);
  EXPECT_FALSE(Parse({"--fuse-keys=off"})->fuse_keys);
  EXPECT_EQ(Error({"--fuse-keys=yes"}),
            "--fuse-keys: expected on or off, got 'yes'");
}

TEST(TrainFlagsTest, WaitPullsIsLayerOrStep) {
  EXPECT_EQ(Parse({})->wait_pulls, "layer");
  EXPECT_EQ(Parse({"--wait-pulls", "step"})->wait_pulls, "step");
  EXPECT_EQ(Parse({"--wait-pulls=layer"})->wait_pulls, "layer");
  EXPECT_EQ(Error({"--wait-pulls=tensor"}),
            "--wait-pulls: expected layer or step, got 'tensor'");
  EXPECT_EQ(Error({"--wait-pulls="}),
            "--wait-pulls: expected layer or step, got ''");
  // One fused key has no layers to wait for one by one; by step is fine.
  EXPECT_EQ(Error({"--fuse-keys=on", "--wait-pulls=layer"}),
            "--wait-pulls: layer needs a key per tensor, not --fuse-keys on "
            "(one key: its pull is waited for by step)");
  EXPECT_TRUE(Parse({"--fuse-keys=on"})->fuse_keys);
  EXPECT_EQ(Parse({"--fuse-keys=on", "--wait-pulls=step"})->wait_pulls, "step");
  EXPECT_NE(TrainFlagsUsage().find("--wait-pulls layer|step"),
            std::string::npos);
}

TEST(TrainFlagsTest, ParsesEveryFlagInBothForms) {
  absl::StatusOr<TrainFlags> f = Parse({"--kv-store=dist_async",
                                        "--batch-size",
                                        "64",
                                        "--epochs=3",
                                        "--gc-type",
                                        "2bit",
                                        "--gc-threshold=0.25",
                                        "--lr",
                                        "0.05",
                                        "--seed=7",
                                        "--hidden",
                                        "512,256,64",
                                        "--optimizer=sgd",
                                        "--momentum",
                                        "0",
                                        "--wd=0",
                                        "--device",
                                        "cpu",
                                        "--data=/d",
                                        "--train-subset",
                                        "2000",
                                        "--test-subset=500",
                                        "--log-every",
                                        "10",
                                        "--metrics-out=/tmp/m-{rank}.json"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kv_store, "dist_async");
  EXPECT_EQ(f->batch_size, 64);
  EXPECT_EQ(f->epochs, 3);
  EXPECT_EQ(f->gc_type, "2bit");
  EXPECT_FLOAT_EQ(f->gc_threshold, 0.25f);
  EXPECT_FLOAT_EQ(f->lr, 0.05f);
  EXPECT_EQ(f->seed, 7u);
  EXPECT_EQ(f->hidden, (std::vector<int>{512, 256, 64}));
  EXPECT_FLOAT_EQ(f->momentum, 0.0f);
  EXPECT_FLOAT_EQ(f->wd, 0.0f);
  EXPECT_EQ(f->device, "cpu");
  EXPECT_EQ(f->data_dir, "/d");
  EXPECT_EQ(f->train_subset, 2000);
  EXPECT_EQ(f->test_subset, 500);
  EXPECT_EQ(f->log_every, 10);
  EXPECT_EQ(f->metrics_out, "/tmp/m-{rank}.json");
}

TEST(TrainFlagsTest, DataDirectoryPrecedence) {
  EXPECT_EQ(Parse({}, "/env")->data_dir, "/env");
  EXPECT_EQ(Parse({}, "")->data_dir, "/usr/share/datasets/fashion-mnist");
  EXPECT_EQ(Parse({"--data", "/flag"}, "/env")->data_dir, "/flag");
}

TEST(TrainFlagsTest, LearningRateDefaultsFollowTheOptimizer) {
  EXPECT_FLOAT_EQ(Parse({"--optimizer=adam"})->lr, 0.001f);
  EXPECT_FLOAT_EQ(Parse({"--optimizer=adamax"})->lr, 0.002f);
  EXPECT_FLOAT_EQ(Parse({"--optimizer=adagrad"})->lr, 0.01f);
  EXPECT_FLOAT_EQ(Parse({"--optimizer=adam", "--lr=0.3"})->lr, 0.3f);
  EXPECT_FLOAT_EQ(Parse({"--lr=0.3", "--optimizer=adam"})->lr, 0.3f);
}

TEST(TrainFlagsTest, MomentumDefaultsToZeroWhereItDiverges) {
  EXPECT_FLOAT_EQ(Parse({"--kv-store=dist_sync"})->momentum, 0.9f);
  EXPECT_FLOAT_EQ(Parse({"--kv-store=dist_async"})->momentum, 0.0f);
  EXPECT_FLOAT_EQ(Parse({"--gc-type=2bit"})->momentum, 0.0f);
  EXPECT_FLOAT_EQ(Parse({"--gc-type=2bit", "--momentum=0.5"})->momentum, 0.5f);
  EXPECT_FLOAT_EQ(Parse({"--momentum=0.5", "--kv-store=dist_async"})->momentum,
                  0.5f);
}

// dist_ssp and a straggler (issue #49).
TEST(TrainFlagsTest, StalenessAndStragglerFlags) {
  absl::StatusOr<TrainFlags> f =
      Parse({"--kv-store", "dist_ssp", "--staleness", "3", "--slow-every", "5",
             "--slow-factor", "5"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kv_store, "dist_ssp");
  EXPECT_EQ(f->staleness, 3);
  EXPECT_EQ(f->slow_every, 5);
  EXPECT_DOUBLE_EQ(f->slow_factor, 5);
  EXPECT_EQ(f->slow_rank, -1) << "every worker given --slow-every";
  EXPECT_EQ(Parse({"--slow-every=5", "--slow-rank=3"})->slow_rank, 3);
  EXPECT_FLOAT_EQ(f->momentum, 0.0f) << "stale pushes, as dist_async's";
  EXPECT_EQ(Parse({"--kv-store=dist_ssp"})->staleness, -1)
      << "not given: TESSERA_STALENESS's";
  EXPECT_EQ(Parse({"--kv-store=dist_ssp", "--staleness=0"})->staleness, 0);
  for (const char* bad : {"-1", "1000001", "two", "1.5"}) {
    EXPECT_EQ(Error({"--kv-store=dist_ssp", absl::StrCat("--staleness=", bad)}),
              absl::StrCat("--staleness: expected a whole number of steps in "
                           "0..1000000, got '",
                           bad, "'"));
  }
  EXPECT_EQ(Error({"--staleness=2"}),
            "--staleness: only used by --kv-store dist_ssp, not --kv-store "
            "dist_sync");
  EXPECT_EQ(Error({"--slow-every=-1"}),
            "--slow-every: expected a non-negative integer (0: off), got '-1'");
  EXPECT_EQ(Error({"--slow-every=5", "--slow-factor=0.5"}),
            "--slow-factor: expected a number in [1, 1000), got '0.5'");
  EXPECT_EQ(Error({"--slow-factor=3"}),
            "--slow-factor: only used with --slow-every N (N > 0)");
  EXPECT_EQ(Error({"--slow-rank=1"}),
            "--slow-rank: only used with --slow-every N (N > 0)");
  EXPECT_EQ(Error({"--slow-every=5", "--slow-rank=-2"}),
            "--slow-rank: expected a worker rank (0 or more), got '-2'");
  const std::string usage = TrainFlagsUsage();
  for (const char* flag : {"--staleness S", "--slow-every N", "--slow-factor F",
                           "--slow-rank R", "dist_ssp"}) {
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
  }
}

// Every --slow-every-th step sleeps (factor - 1) x the mean compute time.
TEST(StragglerTest, EveryNthStepTakesFactorTimesAsLong) {
  Straggler off(0, 5);
  off.Observe(absl::Milliseconds(10));
  EXPECT_EQ(off.Delay(4), absl::ZeroDuration());
  Straggler s(5, 5);
  EXPECT_EQ(s.Delay(4), absl::ZeroDuration()) << "nothing observed yet";
  s.Observe(absl::Milliseconds(10));
  s.Observe(absl::Milliseconds(30));
  for (int64_t step : {0, 1, 2, 3, 5, 8, 10})
    EXPECT_EQ(s.Delay(step), absl::ZeroDuration()) << step;
  EXPECT_EQ(s.Delay(4), absl::Milliseconds(80)) << "the 5th step: 4 x 20 ms";
  EXPECT_EQ(s.Delay(9), absl::Milliseconds(80)) << "the 10th";
}

TEST(TrainFlagsTest, Help) {
  EXPECT_TRUE(Parse({"--help"})->help);
  EXPECT_TRUE(Parse({"-h"})->help);
  EXPECT_NE(TrainFlagsUsage().find("--gc-threshold"), std::string::npos);
}

TEST(TrainFlagsTest, BadFlagsSayWhichAndWhatWasExpected) {
  EXPECT_EQ(Error({"--kv-store=local"}),
            "--kv-store: expected dist_sync, dist_async, dist_ssp or "
            "dist_device_sync, got "
            "'local'");
  EXPECT_EQ(Error({"--batch-size=0"}),
            "--batch-size: expected a positive integer, got '0'");
  EXPECT_EQ(Error({"--batch-size", "12x"}),
            "--batch-size: expected a positive integer, got '12x'");
  EXPECT_EQ(Error({"--epochs=-1"}),
            "--epochs: expected a positive integer, got '-1'");
  EXPECT_EQ(Error({"--gc-type=1bit"}),
            "--gc-type: expected none or 2bit, got '1bit'");
  EXPECT_EQ(Error({"--gc-threshold=0"}),
            "--gc-threshold: expected a positive number, got '0'");
  EXPECT_EQ(Error({"--lr", "-0.1"}),
            "--lr: expected a positive number, got '-0.1'");
  EXPECT_EQ(Error({"--lr=nan"}), "--lr: expected a positive number, got 'nan'");
  EXPECT_EQ(Error({"--lr=fast"}),
            "--lr: expected a positive number, got 'fast'");
  EXPECT_EQ(Error({"--seed=-3"}),
            "--seed: expected a non-negative integer, got '-3'");
  EXPECT_EQ(Error({"--hidden=256,,128"}),
            "--hidden: expected comma-separated positive layer widths such as "
            "256,128, "
            "got '256,,128'");
  EXPECT_EQ(Error({"--hidden="}),
            "--hidden: expected comma-separated positive layer widths such as "
            "256,128, "
            "got ''");
  EXPECT_EQ(Error({"--hidden=0"}),
            "--hidden: expected comma-separated positive layer widths such as "
            "256,128, "
            "got '0'");
  EXPECT_EQ(
      Error({"--optimizer=rmsprop"}),
      "--optimizer: expected sgd, adam, adamax or adagrad, got 'rmsprop'");
  EXPECT_EQ(Error({"--momentum=1"}),
            "--momentum: expected a number in [0, 1), got '1'");
  EXPECT_EQ(Error({"--optimizer=adam", "--momentum=0.5"}),
            "--momentum: only used by --optimizer sgd, not --optimizer adam");
  EXPECT_EQ(Error({"--wd=-1"}),
            "--wd: expected a non-negative number, got '-1'");
  EXPECT_EQ(Error({"--device=tpu"}),
            "--device: expected auto, cuda or cpu, got 'tpu'");
  EXPECT_EQ(Error({"--data="}), "--data: expected a directory, got ''");
  EXPECT_EQ(
      Error({"--train-subset=-5"}),
      "--train-subset: expected a non-negative integer (0: all), got '-5'");
  EXPECT_EQ(Error({"--test-subset=x"}),
            "--test-subset: expected a non-negative integer (0: all), got 'x'");
  EXPECT_EQ(Error({"--log-every=0"}),
            "--log-every: expected a positive integer, got '0'");
  EXPECT_EQ(Error({"--metrics-out="}),
            "--metrics-out: expected a file path, got ''");
}

TEST(TrainFlagsTest, MalformedCommandLines) {
  EXPECT_EQ(Error({"--learning-rate=0.1"}),
            "unknown flag '--learning-rate'; run tessera-worker --help for the "
            "flags");
  EXPECT_EQ(
      Error({"--verbose"}),
      "unknown flag '--verbose'; run tessera-worker --help for the flags");
  EXPECT_EQ(Error({"--lr"}), "--lr: expected a value");
  EXPECT_EQ(Error({"--data", "--epochs=2"}), "--data: expected a value");
  EXPECT_EQ(Error({"train.py"}),
            "unexpected argument 'train.py'; flags take the form --name=value "
            "or --name "
            "value");
  EXPECT_EQ(Error({"-lr=0.1"}),
            "unexpected argument '-lr=0.1'; flags take the form --name=value "
            "or --name "
            "value");
}

TEST(TrainFlagsTest, OptimizerSpec) {
  TrainFlags f;
  EXPECT_EQ(OptimizerSpec(f, 1.0 / 256, 234),
            "sgd lr=0.100000001 momentum=0.899999976 wd=9.99999975e-05 "
            "rescale_grad=0.00390625");
  f.optimizer = "adam";
  f.lr = 0.5f;
  f.wd = 0;
  EXPECT_EQ(OptimizerSpec(f, 0.125, 234),
            "adam lr=0.5 wd=0 rescale_grad=0.125");
  f.lr_step_epochs = 5;
  f.lr_factor = 0.5f;
  EXPECT_EQ(OptimizerSpec(f, 0.125, 234),
            "adam lr=0.5 wd=0 rescale_grad=0.125 lr_factor=0.5 lr_step=1170");
}

TEST(TrainFlagsTest, LearningRateSchedule) {
  absl::StatusOr<TrainFlags> f =
      ParseTrainFlags({"--lr-factor", "0.2", "--lr-step-epochs=4"}, nullptr);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->lr_factor, 0.2f);
  EXPECT_EQ(f->lr_step_epochs, 4);
  EXPECT_FALSE(ParseTrainFlags({"--lr-factor", "1.5"}, nullptr).ok());
  EXPECT_FALSE(ParseTrainFlags({"--lr-step-epochs", "-1"}, nullptr).ok());
}

}  // namespace
}  // namespace tessera

// Tests of the CPU Mlp: the loss on a hand-computed case, gradients against
// central finite differences of an independent double-precision reference, and
// the API's contracts.
#include "worker/trainer/mlp.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Mlp> MakeCpu(std::vector<int> sizes, int max_batch,
                             uint64_t seed = 1) {
  MlpConfig config;
  config.sizes = std::move(sizes);
  config.seed = seed;
  absl::StatusOr<std::unique_ptr<Mlp>> mlp =
      CreateMlp(MlpDevice::kCpu, config, max_batch);
  EXPECT_TRUE(mlp.ok()) << mlp.status();
  return mlp.ok() ? *std::move(mlp) : nullptr;
}

// Sum over rows of the softmax cross-entropy of the MLP, in double, written
// independently of worker/mlp.cc.
double ReferenceLoss(const std::vector<int>& sizes,
                     const std::vector<std::vector<double>>& w,
                     const std::vector<std::vector<double>>& b,
                     const std::vector<float>& x, const std::vector<int32_t>& y,
                     int rows) {
  const int layers = static_cast<int>(sizes.size()) - 1;
  double total = 0;
  for (int r = 0; r < rows; ++r) {
    std::vector<double> a(x.begin() + r * sizes[0],
                          x.begin() + (r + 1) * sizes[0]);
    for (int l = 0; l < layers; ++l) {
      std::vector<double> z(sizes[l + 1]);
      for (int o = 0; o < sizes[l + 1]; ++o) {
        double s = b[l][o];
        for (int i = 0; i < sizes[l]; ++i) s += w[l][o * sizes[l] + i] * a[i];
        z[o] = l + 1 < layers ? std::max(s, 0.0) : s;
      }
      a = std::move(z);
    }
    double m = a[0];
    for (double v : a) m = std::max(m, v);
    double sum = 0;
    for (double v : a) sum += std::exp(v - m);
    total += std::log(sum) - (a[y[r]] - m);
  }
  return total;
}

TEST(MlpTest, SoftmaxCrossEntropyMatchesHandComputedValues) {
  // One layer, W = 0 and b = (1, 2, 3): every row's logits are (1, 2, 3).
  std::unique_ptr<Mlp> mlp = MakeCpu({2, 3}, 2);
  ASSERT_NE(mlp, nullptr);
  std::vector<LayerParams> params(1);
  params[0].w.assign(6, 0.0f);
  params[0].b = {1.0f, 2.0f, 3.0f};
  ASSERT_TRUE(mlp->SetParams(params).ok());
  const std::vector<float> x = {1.0f, 0.0f, 0.0f, 2.0f};
  const std::vector<int32_t> y = {2, 0};
  absl::StatusOr<MlpBatchStats> stats =
      mlp->ForwardBackward(x.data(), y.data(), 2, nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status();
  // -log softmax: label 2 gives log(1 + e^-1 + e^-2) = 0.4076059644, label 0
  // adds 2.
  EXPECT_NEAR(stats->loss_sum, 0.4076059644 + 2.4076059644, 1e-6);
  EXPECT_EQ(stats->correct, 1);
  EXPECT_EQ(stats->rows, 2);

  const double p[3] = {0.0900305732, 0.2447284711, 0.6652409558};
  const LayerParams g = mlp->GetGrads(0);
  // db sums softmax - onehot over the rows; dW[c] = row0 delta * (1, 0) + row1
  // delta
  // * (0, 2).
  const double d0[3] = {p[0], p[1], p[2] - 1};
  const double d1[3] = {p[0] - 1, p[1], p[2]};
  for (int c = 0; c < 3; ++c) {
    EXPECT_NEAR(g.b[c], d0[c] + d1[c], 1e-6) << c;
    EXPECT_NEAR(g.w[c * 2 + 0], d0[c], 1e-6) << c;
    EXPECT_NEAR(g.w[c * 2 + 1], 2 * d1[c], 1e-6) << c;
  }
}

TEST(MlpTest, GradientsMatchCentralFiniteDifferences) {
  const std::vector<int> sizes = {6, 5, 4, 3};
  const int rows = 7;
  std::unique_ptr<Mlp> mlp = MakeCpu(sizes, rows, /*seed=*/7);
  ASSERT_NE(mlp, nullptr);
  // Non-zero biases so that no ReLU sits exactly at its kink.
  std::vector<LayerParams> params = mlp->GetParams();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  for (LayerParams& p : params) {
    for (float& v : p.b) v = u(rng);
  }
  ASSERT_TRUE(mlp->SetParams(params).ok());
  std::vector<float> x(rows * sizes[0]);
  for (float& v : x) v = u(rng) * 2;
  const std::vector<int32_t> y = {0, 1, 2, 2, 1, 0, 1};

  std::vector<int> order;
  absl::StatusOr<MlpBatchStats> stats = mlp->ForwardBackward(
      x.data(), y.data(), rows, [&](int l) { order.push_back(l); });
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(order, (std::vector<int>{2, 1, 0}));

  std::vector<std::vector<double>> w, b;
  for (const LayerParams& p : params) {
    w.emplace_back(p.w.begin(), p.w.end());
    b.emplace_back(p.b.begin(), p.b.end());
  }
  EXPECT_NEAR(stats->loss_sum, ReferenceLoss(sizes, w, b, x, y, rows),
              1e-5 * std::abs(stats->loss_sum));

  constexpr double kEps = 1e-6;
  auto check = [&](std::vector<double>& v, double analytic, const char* what,
                   int l, size_t i) {
    const double saved = v[i];
    v[i] = saved + kEps;
    const double plus = ReferenceLoss(sizes, w, b, x, y, rows);
    v[i] = saved - kEps;
    const double minus = ReferenceLoss(sizes, w, b, x, y, rows);
    v[i] = saved;
    const double numeric = (plus - minus) / (2 * kEps);
    EXPECT_NEAR(analytic, numeric, 1e-4 + 1e-4 * std::abs(numeric))
        << what << " layer " << l << " element " << i;
  };
  for (int l = 0; l < mlp->num_layers(); ++l) {
    const LayerParams g = mlp->GetGrads(l);
    ASSERT_EQ(g.w.size(), w[l].size());
    ASSERT_EQ(g.b.size(), b[l].size());
    for (size_t i = 0; i < w[l].size(); ++i) check(w[l], g.w[i], "W", l, i);
    for (size_t i = 0; i < b[l].size(); ++i) check(b[l], g.b[i], "b", l, i);
  }
}

TEST(MlpTest, EvaluateInChunksMatchesOneForwardPass) {
  const std::vector<int> sizes = {4, 8, 3};
  std::unique_ptr<Mlp> big = MakeCpu(sizes, 10, 5);
  std::unique_ptr<Mlp> small = MakeCpu(sizes, 3, 5);  // 4 chunks for 10 rows
  ASSERT_NE(big, nullptr);
  ASSERT_NE(small, nullptr);
  std::vector<float> x(10 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  const std::vector<int32_t> y = {0, 1, 2, 0, 1, 2, 0, 1, 2, 0};
  absl::StatusOr<MlpBatchStats> a =
      big->ForwardBackward(x.data(), y.data(), 10, nullptr);
  absl::StatusOr<MlpBatchStats> e = small->Evaluate(x.data(), y.data(), 10);
  ASSERT_TRUE(a.ok() && e.ok());
  EXPECT_NEAR(a->loss_sum, e->loss_sum, 1e-5);
  EXPECT_EQ(a->correct, e->correct);
  EXPECT_EQ(e->rows, 10);
}

TEST(MlpTest, InitialParamsAreDeterministicAndScaled) {
  MlpConfig config;
  config.sizes = {100, 50, 10};
  config.seed = 9;
  const std::vector<LayerParams> a = InitialMlpParams(config);
  const std::vector<LayerParams> b = InitialMlpParams(config);
  config.seed = 10;
  const std::vector<LayerParams> c = InitialMlpParams(config);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].w, b[0].w);
  EXPECT_NE(a[0].w, c[0].w);
  const double he = std::sqrt(6.0 / 100), xavier = std::sqrt(6.0 / 60);
  double max0 = 0, max1 = 0;
  for (float v : a[0].w)
    max0 = std::max(max0, std::abs(static_cast<double>(v)));
  for (float v : a[1].w)
    max1 = std::max(max1, std::abs(static_cast<double>(v)));
  EXPECT_LE(max0, he);
  EXPECT_GT(max0, 0.9 * he);
  EXPECT_LE(max1, xavier);
  EXPECT_GT(max1, 0.9 * xavier);
  for (const LayerParams& p : a) {
    for (float v : p.b) EXPECT_EQ(v, 0.0f);
  }
}

TEST(MlpTest, LocalSgdStepLowersTheLoss) {
  std::unique_ptr<Mlp> mlp = MakeCpu({4, 16, 3}, 6, 2);
  ASSERT_NE(mlp, nullptr);
  std::vector<float> x(6 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.7f * i);
  const std::vector<int32_t> y = {0, 1, 2, 2, 1, 0};
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    absl::StatusOr<MlpBatchStats> s =
        mlp->ForwardBackward(x.data(), y.data(), 6, nullptr);
    ASSERT_TRUE(s.ok());
    if (step == 0) first = s->loss_sum;
    last = s->loss_sum;
    ASSERT_TRUE(mlp->LocalSgdStep(0.5f, 1.0f / 6).ok());
  }
  EXPECT_LT(last, 0.5 * first);
}

TEST(MlpTest, StagedParamsAreTheParamsOnCpu) {
  std::unique_ptr<Mlp> mlp = MakeCpu({3, 2}, 1);
  ASSERT_NE(mlp, nullptr);
  absl::Span<float> w = mlp->WeightStaging(0);
  absl::Span<float> b = mlp->BiasStaging(0);
  ASSERT_EQ(w.size(), 6u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  b[1] = 4.0f;
  ASSERT_TRUE(mlp->CommitStagedParams().ok());
  const std::vector<LayerParams> p = mlp->GetParams();
  EXPECT_EQ(p[0].w, (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(p[0].b, (std::vector<float>{0, 4}));
  EXPECT_EQ(mlp->stream(), nullptr);
  EXPECT_EQ(mlp->device(), MlpDevice::kCpu);
}

// The hook before each layer's forward: called for layers 0, 1, 2 in order,
// before the loss and backward; weights staged and committed there are the
// ones that layer's forward uses (here another model's, layer by layer, so
// the result must be that model's exactly).
TEST(MlpTest, BeforeLayerForwardRunsBeforeEachLayerReadsItsWeights) {
  const std::vector<int> sizes = {5, 7, 6, 3};
  std::unique_ptr<Mlp> mlp = MakeCpu(sizes, 4, 1);
  std::unique_ptr<Mlp> other = MakeCpu(sizes, 4, 2);
  ASSERT_NE(mlp, nullptr);
  ASSERT_NE(other, nullptr);
  std::vector<float> x(4 * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.7f * i);
  const std::vector<int32_t> y = {0, 2, 1, 2};
  const std::vector<LayerParams> want = other->GetParams();
  std::vector<std::string> events;
  absl::StatusOr<MlpBatchStats> got = mlp->ForwardBackward(
      x.data(), y.data(), 4,
      [&](int l) { events.push_back(absl::StrCat("ready ", l)); },
      [&] { events.push_back("forward done"); },
      [&](int l) {
        events.push_back(absl::StrCat("before ", l));
        absl::Span<float> w = mlp->WeightStaging(l);
        absl::Span<float> b = mlp->BiasStaging(l);
        std::copy(want[l].w.begin(), want[l].w.end(), w.begin());
        std::copy(want[l].b.begin(), want[l].b.end(), b.begin());
        return mlp->CommitStagedLayer(l);
      });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(events, (std::vector<std::string>{
                        "before 0", "before 1", "before 2", "forward done",
                        "ready 2", "ready 1", "ready 0"}));
  absl::StatusOr<MlpBatchStats> ref =
      other->ForwardBackward(x.data(), y.data(), 4, nullptr);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(got->loss_sum, ref->loss_sum);
  EXPECT_EQ(got->correct, ref->correct);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(mlp->GetGrads(l).w, other->GetGrads(l).w) << "layer " << l;
    EXPECT_EQ(mlp->GetGrads(l).b, other->GetGrads(l).b) << "layer " << l;
  }
}

// An error from the hook ends the pass with it: no later layer, no backward.
TEST(MlpTest, BeforeLayerForwardErrorStopsThePass) {
  std::unique_ptr<Mlp> mlp = MakeCpu({5, 7, 6, 3}, 4);
  ASSERT_NE(mlp, nullptr);
  const std::vector<float> x(4 * 5, 0.5f);
  const std::vector<int32_t> y = {0, 1, 2, 0};
  std::vector<int> before, ready;
  absl::StatusOr<MlpBatchStats> got = mlp->ForwardBackward(
      x.data(), y.data(), 4, [&](int l) { ready.push_back(l); }, nullptr,
      [&](int l) {
        before.push_back(l);
        return l == 1 ? absl::UnavailableError("pull of key 2: gone")
                      : absl::OkStatus();
      });
  EXPECT_EQ(got.status(), absl::UnavailableError("pull of key 2: gone"));
  EXPECT_EQ(before, (std::vector<int>{0, 1}));
  EXPECT_TRUE(ready.empty());
  // Evaluate has no hook; CommitStagedLayer is nothing to do on the CPU.
  EXPECT_TRUE(mlp->CommitStagedLayer(2).ok());
  EXPECT_TRUE(mlp->Evaluate(x.data(), y.data(), 4).ok());
}

TEST(MlpTest, RejectsBadConfigRowsAndLabels) {
  MlpConfig config;
  config.sizes = {5};
  EXPECT_THAT(CreateMlp(MlpDevice::kCpu, config, 4).status().message(),
              HasSubstr("at least an input and an output width"));
  config.sizes = {5, 0, 3};
  EXPECT_EQ(CreateMlp(MlpDevice::kCpu, config, 4).status().message(),
            "layer width 1 must be in 1..1048576, got 0");
  config.sizes = {5, 3};
  EXPECT_EQ(CreateMlp(MlpDevice::kCpu, config, 0).status().message(),
            "max_batch must be positive, got 0");

  std::unique_ptr<Mlp> mlp = MakeCpu({2, 3}, 2);
  ASSERT_NE(mlp, nullptr);
  const std::vector<float> x(6, 0.5f);
  const std::vector<int32_t> bad = {0, 3, 0};
  EXPECT_EQ(
      mlp->ForwardBackward(x.data(), bad.data(), 3, nullptr).status().message(),
      "ForwardBackward: rows must be in 1..2, got 3");
  EXPECT_EQ(
      mlp->ForwardBackward(x.data(), bad.data(), 2, nullptr).status().message(),
      "label 3 of row 1 is outside 0..2");
  EXPECT_EQ(mlp->Evaluate(x.data(), bad.data(), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<LayerParams> wrong(1);
  wrong[0].w.resize(5);
  wrong[0].b.resize(3);
  EXPECT_EQ(mlp->SetParams(wrong).message(),
            "SetParams: layer 0 has 5 weights and 3 biases, expected 6 and 3");
}

TEST(MlpTest, CpuMathThreadsCanBeSet) {
  SetCpuMathThreads(1);
  EXPECT_EQ(CpuMathThreads(), 1);
}

}  // namespace
}  // namespace tessera

// Each server-side optimizer against a reference written out here in double
// precision.
#include "server/optimizer.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kN = 7;
constexpr int kSteps = 5;

double Grad(int i, int t) {
  return 0.3 * std::sin(1.7 * i + 0.9 * t) * (t + 1);
}

std::vector<float> RunSteps(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(spec);
  EXPECT_TRUE(opt.ok()) << opt.status();
  std::vector<float> w(kN);
  for (int i = 0; i < kN; ++i) w[i] = 0.25f * static_cast<float>(i) - 0.5f;
  std::vector<std::vector<float>> state((*opt)->state_slots(),
                                        std::vector<float>(kN, 0));
  std::vector<float*> slots;
  for (auto& s : state) slots.push_back(s.data());
  for (int t = 0; t < kSteps; ++t) {
    std::vector<float> g(kN);
    for (int i = 0; i < kN; ++i) g[i] = static_cast<float>(Grad(i, t));
    (*opt)->Update(w.data(), g.data(), kN, slots.data(), t + 1);
  }
  return w;
}

double Clip(double x, double c) {
  return c > 0 ? std::fmin(std::fmax(x, -c), c) : x;
}

TEST(OptimizerTest, SgdLrMinusTwoAddsTwiceTheGradientExactly) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create("sgd lr=-2");
  ASSERT_TRUE(opt.ok());
  float w[3] = {1, 1, 1};
  const float g[3] = {1, 2, 3};
  (*opt)->Update(w, g, 3, nullptr, 1);
  EXPECT_EQ(w[0], 3);
  EXPECT_EQ(w[1], 5);
  EXPECT_EQ(w[2], 7);
}

TEST(OptimizerTest, SgdWithMomentumWeightDecayRescaleAndClip) {
  const double lr = 0.1, mom = 0.9, wd = 0.01, rescale = 0.5, clip = 0.2;
  std::vector<float> got = RunSteps(
      "sgd lr=0.1 momentum=0.9 wd=0.01 rescale_grad=0.5 clip_gradient=0.2");
  for (int i = 0; i < kN; ++i) {
    double w = 0.25 * i - 0.5, m = 0;
    for (int t = 0; t < kSteps; ++t) {
      m = mom * m - lr * (Clip(rescale * Grad(i, t), clip) + wd * w);
      w += m;
    }
    EXPECT_NEAR(got[i], w, 1e-5) << i;
  }
}

TEST(OptimizerTest, PlainSgd) {
  std::vector<float> got = RunSteps("sgd lr=0.05 wd=0.1");
  for (int i = 0; i < kN; ++i) {
    double w = 0.25 * i - 0.5;
    for (int t = 0; t < kSteps; ++t) w -= 0.05 * (Grad(i, t) + 0.1 * w);
    EXPECT_NEAR(got[i], w, 1e-5) << i;
  }
}

TEST(OptimizerTest, Adam) {
  std::vector<float> got =
      RunSteps("adam lr=0.01 beta1=0.8 beta2=0.99 epsilon=1e-6 wd=0.001");
  for (int i = 0; i < kN; ++i) {
    double w = 0.25 * i - 0.5, m = 0, v = 0;
    for (int t = 0; t < kSteps; ++t) {
      const double g = Grad(i, t) + 0.001 * w;
      m = 0.8 * m + 0.2 * g;
      v = 0.99 * v + 0.01 * g * g;
      const double lr_t = 0.01 * std::sqrt(1 - std::pow(0.99, t + 1)) /
                          (1 - std::pow(0.8, t + 1));
      w -= lr_t * m / (std::sqrt(v) + 1e-6);
    }
    EXPECT_NEAR(got[i], w, 1e-5) << i;
  }
}

TEST(OptimizerTest, AdaMax) {
  std::vector<float> got = RunSteps("adamax lr=0.02 clip_gradient=0.5");
  for (int i = 0; i < kN; ++i) {
    double w = 0.25 * i - 0.5, m = 0, u = 0;
    for (int t = 0; t < kSteps; ++t) {
      const double g = Clip(Grad(i, t), 0.5);
      m = 0.9 * m + 0.1 * g;
      u = std::fmax(0.999 * u, std::fabs(g));
      if (u > 0) w -= 0.02 / (1 - std::pow(0.9, t + 1)) * m / u;
    }
    EXPECT_NEAR(got[i], w, 1e-5) << i;
  }
}

TEST(OptimizerTest, AdaGrad) {
  std::vector<float> got = RunSteps("adagrad lr=0.1 wd=0.01 rescale_grad=2");
  for (int i = 0; i < kN; ++i) {
    double w = 0.25 * i - 0.5, h = 0;
    for (int t = 0; t < kSteps; ++t) {
      const double g = 2 * Grad(i, t);
      h += g * g;
      w -= 0.1 * (g / std::sqrt(h + 1e-7) + 0.01 * w);
    }
    EXPECT_NEAR(got[i], w, 1e-5) << i;
  }
}

TEST(OptimizerTest, NoneMeansNoUpdater) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create("none");
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ(*opt, nullptr);
  EXPECT_FALSE(Optimizer::Create("none lr=1").ok());
}

TEST(OptimizerTest, SpecIsCanonical) {
  EXPECT_EQ((*Optimizer::Create("sgd   momentum=0.5 lr=0.1"))->spec(),
            (*Optimizer::Create("sgd lr=0.1 momentum=0.5"))->spec());
}

TEST(OptimizerTest, BadSpecsNameTheProblem) {
  EXPECT_THAT(Optimizer::Create("rmsprop").status().message(),
              HasSubstr("unknown optimizer 'rmsprop': expected sgd, adam, "
                        "adamax, adagrad or none"));
  EXPECT_THAT(Optimizer::Create("adam momentum=0.9").status().message(),
              HasSubstr("unknown parameter 'momentum' for optimizer adam"));
  EXPECT_THAT(Optimizer::Create("sgd lr").status().message(),
              HasSubstr("expected name=value"));
  EXPECT_THAT(
      Optimizer::Create("sgd lr=inf").status().message(),
      HasSubstr(
          "parameter lr='inf' of optimizer sgd: expected a finite number"));
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

TEST(OptimizerScheduleTest, FactorScheduleDropsTheRateEveryStepUpdates) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create("sgd lr=-2 lr_factor=0.5 lr_step=2");
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_EQ((*opt)->ScheduledLr(1), -2.0f);
  EXPECT_EQ((*opt)->ScheduledLr(2), -2.0f);
  EXPECT_EQ((*opt)->ScheduledLr(3), -1.0f);
  EXPECT_EQ((*opt)->ScheduledLr(5), -0.5f);
  float w = 0;
  const float g = 1;
  for (uint64_t t = 1; t <= 4; ++t) (*opt)->Update(&w, &g, 1, nullptr, t);
  EXPECT_EQ(w, 2 + 2 + 1 + 1);  // w += 2g, 2g, g, g
  EXPECT_EQ((*Optimizer::Create("adam lr=0.01"))->ScheduledLr(1000), 0.01f);
}

}  // namespace
}  // namespace tessera

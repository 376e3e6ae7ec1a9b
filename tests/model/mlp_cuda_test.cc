// The CUDA backend against the CPU backend: same parameters and batch, so the
// same loss and gradients to float tolerance. Labelled `gpu`; skips without a
// device.
#include "worker/trainer/mlp_cuda.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common/gpu/device.h"
#include "gtest/gtest.h"
#include "worker/trainer/mlp.h"

namespace tessera {
namespace {

MlpConfig Config() {
  MlpConfig config;
  config.sizes = {784, 64, 32, 10};
  config.seed = 11;
  return config;
}

TEST(MlpCudaTest, CreateFailsCleanlyWithoutDevice) {
  if (gpu::DeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::unique_ptr<Mlp>> mlp = CreateCudaMlp(Config(), 8);
  EXPECT_EQ(mlp.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(gpu::DeviceDescription().empty());
}

void ExpectClose(const std::vector<float>& cpu, const std::vector<float>& gpu,
                 const char* what, int layer) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what << " layer " << layer;
  double max_abs = 0;
  for (float v : cpu)
    max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_NEAR(cpu[i], gpu[i], 1e-4 * (1 + max_abs))
        << what << " layer " << layer << " element " << i;
  }
}

TEST(MlpCudaTest, ForwardBackwardMatchesCpu) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  const int rows = 37;
  absl::StatusOr<std::unique_ptr<Mlp>> cpu =
      CreateMlp(MlpDevice::kCpu, Config(), 64);
  absl::StatusOr<std::unique_ptr<Mlp>> gpu =
      CreateMlp(MlpDevice::kCuda, Config(), 64);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->device(), MlpDevice::kCuda);
  EXPECT_NE((*gpu)->stream(), nullptr);

  std::vector<float> x(rows * 784);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = 0.5f + 0.5f * std::sin(0.37f * i);
  std::vector<int32_t> y(rows);
  for (int r = 0; r < rows; ++r) y[r] = (r * 7) % 10;

  for (int step = 0; step < 3; ++step) {
    std::vector<int> gpu_order;
    absl::StatusOr<MlpBatchStats> a =
        (*cpu)->ForwardBackward(x.data(), y.data(), rows, nullptr);
    absl::StatusOr<MlpBatchStats> b = (*gpu)->ForwardBackward(
        x.data(), y.data(), rows, [&](int l) { gpu_order.push_back(l); });
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(gpu_order, (std::vector<int>{2, 1, 0}));
    EXPECT_NEAR(a->loss_sum, b->loss_sum, 1e-4 * a->loss_sum);
    EXPECT_EQ(a->correct, b->correct);
    for (int l = 0; l < 3; ++l) {
      const LayerParams gc = (*cpu)->GetGrads(l);
      const LayerParams gg = (*gpu)->GetGrads(l);
      ExpectClose(gc.w, gg.w, "dW", l);
      ExpectClose(gc.b, gg.b, "db", l);
    }
    ASSERT_TRUE((*cpu)->LocalSgdStep(0.1f, 1.0f / rows).ok());
    ASSERT_TRUE((*gpu)->LocalSgdStep(0.1f, 1.0f / rows).ok());
  }
  absl::StatusOr<MlpBatchStats> ea = (*cpu)->Evaluate(x.data(), y.data(), rows);
  absl::StatusOr<MlpBatchStats> eb = (*gpu)->Evaluate(x.data(), y.data(), rows);
  ASSERT_TRUE(ea.ok() && eb.ok());
  EXPECT_NEAR(ea->loss_sum, eb->loss_sum, 1e-4 * ea->loss_sum);
}

TEST(MlpCudaTest, StagedParamsTakeEffectAtCommit) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  absl::StatusOr<std::unique_ptr<Mlp>> gpu =
      CreateMlp(MlpDevice::kCuda, Config(), 8);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<LayerParams> before = (*gpu)->GetParams();
  absl::Span<float> b = (*gpu)->BiasStaging(2);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i);
  EXPECT_EQ((*gpu)->GetParams()[2].b, before[2].b);
  ASSERT_TRUE((*gpu)->CommitStagedParams().ok());
  EXPECT_EQ((*gpu)->GetParams()[2].b,
            (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ((*gpu)->GetParams()[0].w, before[0].w);
}

// CommitStagedLayer copies that layer's staging only.
TEST(MlpCudaTest, CommitStagedLayerCopiesThatLayerOnly) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  absl::StatusOr<std::unique_ptr<Mlp>> gpu =
      CreateMlp(MlpDevice::kCuda, Config(), 8);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<LayerParams> before = (*gpu)->GetParams();
  for (int l = 0; l < 3; ++l) {
    for (float& v : (*gpu)->BiasStaging(l)) v = 100.0f + l;
  }
  ASSERT_TRUE((*gpu)->CommitStagedLayer(1).ok());
  const std::vector<LayerParams> after = (*gpu)->GetParams();
  EXPECT_EQ(after[0].b, before[0].b);
  EXPECT_EQ(after[1].b, std::vector<float>(32, 101.0f));
  EXPECT_EQ(after[2].b, before[2].b);
  EXPECT_EQ(after[1].w, before[1].w);
  EXPECT_FALSE((*gpu)->CommitStagedLayer(3).ok());
}

// Layer-by-layer commits from the hook before each layer's forward give the
// CPU backend's results for the same weights (each layer's staged before it
// runs, as tessera-worker's --wait-pulls layer does).
TEST(MlpCudaTest, LayerByLayerCommitsMatchCpu) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  const int rows = 16;
  MlpConfig other = Config();
  other.seed = 12;
  absl::StatusOr<std::unique_ptr<Mlp>> cpu =
      CreateMlp(MlpDevice::kCpu, other, rows);
  absl::StatusOr<std::unique_ptr<Mlp>> gpu =
      CreateMlp(MlpDevice::kCuda, Config(), rows);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<LayerParams> want = (*cpu)->GetParams();
  std::vector<float> x(rows * 784);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = 0.5f + 0.5f * std::sin(0.11f * i);
  std::vector<int32_t> y(rows);
  for (int r = 0; r < rows; ++r) y[r] = (r * 3) % 10;
  std::vector<int> before;
  absl::StatusOr<MlpBatchStats> b = (*gpu)->ForwardBackward(
      x.data(), y.data(), rows, nullptr, nullptr, [&](int l) {
        before.push_back(l);
        absl::Span<float> w = (*gpu)->WeightStaging(l);
        absl::Span<float> bias = (*gpu)->BiasStaging(l);
        std::copy(want[l].w.begin(), want[l].w.end(), w.begin());
        std::copy(want[l].b.begin(), want[l].b.end(), bias.begin());
        return (*gpu)->CommitStagedLayer(l);
      });
  absl::StatusOr<MlpBatchStats> a =
      (*cpu)->ForwardBackward(x.data(), y.data(), rows, nullptr);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(before, (std::vector<int>{0, 1, 2}));
  EXPECT_NEAR(a->loss_sum, b->loss_sum, 1e-4 * a->loss_sum);
  for (int l = 0; l < 3; ++l) {
    ExpectClose((*cpu)->GetGrads(l).w, (*gpu)->GetGrads(l).w, "dW", l);
    ExpectClose((*cpu)->GetGrads(l).b, (*gpu)->GetGrads(l).b, "db", l);
  }
}

}  // namespace
}  // namespace tessera

// The CUDA MLP's kernel arithmetic (worker/trainer/mlp_kernels.h), run on the
// host against the CPU backend: each piece against the CPU loop it replaces,
// then the kernels' bodies composed as CudaMlp::ForwardBackward composes them
// (matrix products as plain loops standing in for cuBLAS) against CpuMlp.
//
// Bit-equal where the kernel claims it (bias and ReLU, the ReLU gradient, the
// column sums, and loss, correctness and softmax gradient from equal logits),
// except that NaN matches any NaN (a GPU need not keep a NaN's payload).
// Where matrix products enter, the comparison has a tolerance: OpenBLAS (FMA,
// blocked), cuBLAS and the plain loops here add the products in different
// orders. On inputs whose every product and partial sum is exact (small dyadic
// values) the order cannot matter, and the loss is bit-equal end to end.
#include "worker/trainer/mlp_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/trainer/mlp.h"

namespace tessera {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b);
}

const std::vector<float>& EdgeValues() {
  static const std::vector<float> edges = {
      0.0f,
      -0.0f,
      1.0f,
      -1.0f,
      0.5f,
      -2.5f,
      1e-40f,
      -1e-40f,
      std::numeric_limits<float>::denorm_min(),
      std::numeric_limits<float>::min(),
      std::numeric_limits<float>::max(),
      std::numeric_limits<float>::lowest(),
      kInf,
      -kInf,
      kNaN};
  return edges;
}

// The loop CpuMlp::Forward ran before it called BiasActivation.
TEST(MlpKernelsTest, BiasActivationMatchesTheCpuLoop) {
  for (float z : EdgeValues()) {
    for (float b : EdgeValues()) {
      EXPECT_TRUE(SameFloat(mlp_kernels::BiasActivation(z, b, true),
                            std::max(z + b, 0.0f)))
          << z << " + " << b;
      EXPECT_TRUE(SameFloat(mlp_kernels::BiasActivation(z, b, false), z + b))
          << z << " + " << b;
    }
  }
  // NaN and -0 pass ReLU unchanged, as std::max passes them.
  EXPECT_TRUE(std::isnan(mlp_kernels::BiasActivation(kNaN, 0.0f, true)));
  EXPECT_EQ(Bits(mlp_kernels::BiasActivation(-0.0f, -0.0f, true)), Bits(-0.0f));
  EXPECT_EQ(mlp_kernels::BiasActivation(-3.0f, 1.0f, true), 0.0f);
}

// BiasActivationKernel's thread i against the CPU's row-by-row loop.
TEST(MlpKernelsTest, BiasActivationAtIndexesLikeTheCpuRows) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int cols : {1, 7, 10, 33}) {
    for (bool relu : {true, false}) {
      const int rows = 5;
      std::vector<float> z(rows * cols), b(cols);
      for (float& v : z) v = normal(rng);
      for (float& v : b) v = normal(rng);
      std::vector<float> cpu = z;
      for (int r = 0; r < rows; ++r) {
        float* zr = cpu.data() + r * cols;
        for (int c = 0; c < cols; ++c) {
          zr[c] = relu ? std::max(zr[c] + b[c], 0.0f) : zr[c] + b[c];
        }
      }
      for (size_t i = 0; i < z.size(); ++i) {
        mlp_kernels::BiasActivationAt(z.data(), b.data(), i, cols, relu);
      }
      for (size_t i = 0; i < z.size(); ++i) {
        ASSERT_EQ(Bits(z[i]), Bits(cpu[i])) << "cols " << cols << " " << i;
      }
    }
  }
}

// The expression CpuMlp's backward pass used before it called ReluBackward.
TEST(MlpKernelsTest, ReluBackwardMatchesTheCpuExpression) {
  for (float delta : EdgeValues()) {
    for (float act : EdgeValues()) {
      EXPECT_TRUE(SameFloat(mlp_kernels::ReluBackward(delta, act),
                            act > 0.0f ? delta : 0.0f))
          << delta << " at " << act;
    }
  }
  // A NaN output lets no gradient through; -0 is not positive.
  EXPECT_EQ(mlp_kernels::ReluBackward(1.0f, kNaN), 0.0f);
  EXPECT_EQ(mlp_kernels::ReluBackward(1.0f, -0.0f), 0.0f);
}

// ColumnSumsKernel's thread c against CpuMlp's bias-gradient loop (zeroed,
// then row by row): the same additions in the same order.
TEST(MlpKernelsTest, ColumnSumMatchesTheCpuRowMajorLoop) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int rows : {1, 2, 37, 128}) {
    for (int cols : {1, 10, 33, 256}) {
      std::vector<float> m(static_cast<size_t>(rows) * cols);
      for (float& v : m) v = normal(rng);
      m[0] = 1e-40f;  // A denormal.
      std::vector<float> db(cols);
      std::fill(db.begin(), db.end(), 0.0f);
      for (int r = 0; r < rows; ++r) {
        const float* d = m.data() + static_cast<size_t>(r) * cols;
        for (int c = 0; c < cols; ++c) db[c] += d[c];
      }
      for (int c = 0; c < cols; ++c) {
        ASSERT_EQ(Bits(mlp_kernels::ColumnSum(m.data(), rows, cols, c)),
                  Bits(db[c]))
            << rows << " x " << cols << " column " << c;
      }
    }
  }
}

TEST(MlpKernelsTest, SoftmaxCrossEntropyRowHandComputedValues) {
  // Logits (1, 2, 3): loss log(e^-2 + e^-1 + 1) - (z_y - 3).
  const std::vector<float> logits = {1, 2, 3, 1, 2, 3};
  const std::vector<int32_t> labels = {2, 0};
  std::vector<float> delta(6);
  int correct = -1;
  EXPECT_NEAR(mlp_kernels::SoftmaxCrossEntropyRow(logits.data(), labels.data(),
                                                  0, 3, delta.data(), &correct),
              0.4076059644, 1e-9);
  EXPECT_EQ(correct, 1);
  EXPECT_NEAR(mlp_kernels::SoftmaxCrossEntropyRow(logits.data(), labels.data(),
                                                  1, 3, delta.data(), &correct),
              2.4076059644, 1e-9);
  EXPECT_EQ(correct, 0);
  // Row 1's softmax minus its one-hot (label 0); row 0's delta is untouched
  // by row 1.
  const double p[3] = {0.0900305732, 0.2447284711, 0.6652409558};
  EXPECT_NEAR(delta[3], p[0] - 1, 1e-6);
  EXPECT_NEAR(delta[4], p[1], 1e-6);
  EXPECT_NEAR(delta[5], p[2], 1e-6);
  EXPECT_NEAR(delta[2], p[2] - 1, 1e-6);
}

TEST(MlpKernelsTest, SoftmaxCrossEntropyRowTiesGoToTheFirstMaximum) {
  const std::vector<float> logits = {5, 5, 1};
  int correct = -1;
  const std::vector<int32_t> first = {0}, second = {1};
  mlp_kernels::SoftmaxCrossEntropyRow(logits.data(), first.data(), 0, 3,
                                      nullptr, &correct);
  EXPECT_EQ(correct, 1);
  mlp_kernels::SoftmaxCrossEntropyRow(logits.data(), second.data(), 0, 3,
                                      nullptr, &correct);
  EXPECT_EQ(correct, 0);
}

// Against an independent long-double softmax: the loss is summed in double
// from the same float differences z - max, so it agrees to double rounding;
// the gradient is float (expf times a float reciprocal), within a few ulp.
TEST(MlpKernelsTest, SoftmaxCrossEntropyRowMatchesLongDoubleReference) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int classes : {1, 2, 10, 100}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> z(classes);
      for (float& v : z) v = normal(rng);
      const std::vector<int32_t> label = {trial % classes};
      std::vector<float> delta(classes), aliased = z;
      int correct = 0, aliased_correct = 0;
      const double loss = mlp_kernels::SoftmaxCrossEntropyRow(
          z.data(), label.data(), 0, classes, delta.data(), &correct);
      // delta may be the logits themselves.
      EXPECT_EQ(loss, mlp_kernels::SoftmaxCrossEntropyRow(
                          aliased.data(), label.data(), 0, classes,
                          aliased.data(), &aliased_correct));
      EXPECT_EQ(correct, aliased_correct);
      for (int c = 0; c < classes; ++c) {
        ASSERT_EQ(Bits(aliased[c]), Bits(delta[c]));
      }

      const float m = *std::max_element(z.begin(), z.end());
      long double sum = 0;
      for (float v : z) sum += std::exp(static_cast<long double>(v - m));
      const long double ref_loss =
          std::log(sum) - static_cast<long double>(z[label[0]] - m);
      EXPECT_NEAR(loss, static_cast<double>(ref_loss),
                  1e-12 * (1 + std::fabs(static_cast<double>(ref_loss))));
      const int argmax =
          static_cast<int>(std::max_element(z.begin(), z.end()) - z.begin());
      EXPECT_EQ(correct, argmax == label[0] ? 1 : 0);
      for (int c = 0; c < classes; ++c) {
        const long double want =
            std::exp(static_cast<long double>(z[c] - m)) / sum -
            (c == label[0] ? 1 : 0);
        EXPECT_NEAR(delta[c], static_cast<double>(want), 1e-6) << "class " << c;
      }
    }
  }
}

// What one CudaMlp::ForwardBackward computes, with the kernels' bodies run on
// the host in the kernels' order and plain loops for the cuBLAS products.
struct HostRun {
  MlpBatchStats stats;
  std::vector<LayerParams> grads;
};

HostRun RunKernelBodiesOnHost(const std::vector<int>& sizes,
                              const std::vector<LayerParams>& params,
                              const std::vector<float>& x,
                              const std::vector<int32_t>& labels, int rows) {
  const int layers = static_cast<int>(sizes.size()) - 1;
  std::vector<std::vector<float>> act(layers), delta(layers);
  // Forward: z = input W^T, then BiasActivationKernel.
  for (int l = 0; l < layers; ++l) {
    const int in = sizes[l], out = sizes[l + 1];
    const std::vector<float>& input = l == 0 ? x : act[l - 1];
    act[l].assign(static_cast<size_t>(rows) * out, 0.0f);
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < out; ++o) {
        float s = 0.0f;
        for (int i = 0; i < in; ++i) {
          s += input[r * in + i] * params[l].w[o * in + i];
        }
        act[l][r * out + o] = s;
      }
    }
    for (size_t i = 0; i < act[l].size(); ++i) {
      mlp_kernels::BiasActivationAt(act[l].data(), params[l].b.data(), i, out,
                                    l + 1 < layers);
    }
  }
  // SoftmaxCrossEntropyKernel, then SumRowStats on the host.
  const int last = layers - 1, classes = sizes[layers];
  delta[last].assign(static_cast<size_t>(rows) * classes, 0.0f);
  std::vector<double> row_loss(rows);
  std::vector<int> row_correct(rows);
  for (int r = 0; r < rows; ++r) {
    row_loss[r] = mlp_kernels::SoftmaxCrossEntropyRow(
        act[last].data(), labels.data(), r, classes, delta[last].data(),
        &row_correct[r]);
  }
  HostRun run;
  for (int r = 0; r < rows; ++r) {
    run.stats.loss_sum += row_loss[r];
    run.stats.correct += row_correct[r];
  }
  run.stats.rows = rows;
  // Backward: dW = delta^T input, ColumnSumsKernel, delta W, then
  // ReluBackwardKernel.
  run.grads.resize(layers);
  for (int l = last; l >= 0; --l) {
    const int in = sizes[l], out = sizes[l + 1];
    const std::vector<float>& input = l == 0 ? x : act[l - 1];
    LayerParams& g = run.grads[l];
    g.w.assign(static_cast<size_t>(out) * in, 0.0f);
    g.b.assign(out, 0.0f);
    for (int o = 0; o < out; ++o) {
      for (int i = 0; i < in; ++i) {
        float s = 0.0f;
        for (int r = 0; r < rows; ++r) {
          s += delta[l][r * out + o] * input[r * in + i];
        }
        g.w[o * in + i] = s;
      }
    }
    for (int c = 0; c < out; ++c) {
      g.b[c] = mlp_kernels::ColumnSum(delta[l].data(), rows, out, c);
    }
    if (l > 0) {
      delta[l - 1].assign(static_cast<size_t>(rows) * in, 0.0f);
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < in; ++i) {
          float s = 0.0f;
          for (int o = 0; o < out; ++o) {
            s += delta[l][r * out + o] * params[l].w[o * in + i];
          }
          delta[l - 1][r * in + i] = s;
        }
      }
      for (size_t i = 0; i < delta[l - 1].size(); ++i) {
        delta[l - 1][i] =
            mlp_kernels::ReluBackward(delta[l - 1][i], act[l - 1][i]);
      }
    }
  }
  return run;
}

void ExpectClose(const std::vector<float>& cpu, const std::vector<float>& host,
                 const std::string& what) {
  ASSERT_EQ(cpu.size(), host.size()) << what;
  double max_abs = 0;
  for (float v : cpu) max_abs = std::max(max_abs, std::fabs(double{v}));
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_NEAR(cpu[i], host[i], 1e-5 * (1 + max_abs))
        << what << " element " << i;
  }
}

std::unique_ptr<Mlp> CpuMlpWith(const std::vector<int>& sizes,
                                const std::vector<LayerParams>& params,
                                int max_batch) {
  MlpConfig config;
  config.sizes = sizes;
  absl::StatusOr<std::unique_ptr<Mlp>> mlp =
      CreateMlp(MlpDevice::kCpu, config, max_batch);
  EXPECT_TRUE(mlp.ok()) << mlp.status();
  if (!mlp.ok()) return nullptr;
  EXPECT_TRUE((*mlp)->SetParams(params).ok());
  return *std::move(mlp);
}

// Small dyadic weights, biases and inputs: every product and partial sum of
// the forward pass is exact, so the logits are the same bits whatever order
// OpenBLAS adds in, and so are the loss, the correct count and the last
// layer's bias gradient (the kernels' functions on equal inputs). The other
// gradients pass through products of the non-dyadic softmax: tolerance.
TEST(MlpKernelsTest, KernelBodiesOnHostMatchCpuMlpBitForBitOnExactInputs) {
  const std::vector<int> sizes = {8, 6, 5, 4};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> eighths(-4, 4), quarters(-2, 2),
      halves(0, 2), label(0, 3);
  std::vector<LayerParams> params(3);
  for (int l = 0; l < 3; ++l) {
    params[l].w.resize(sizes[l] * sizes[l + 1]);
    for (float& w : params[l].w) w = eighths(rng) / 8.0f;
    params[l].b.resize(sizes[l + 1]);
    for (float& b : params[l].b) b = quarters(rng) / 4.0f;
  }
  const int rows = 9;
  std::vector<float> x(rows * sizes[0]);
  for (float& v : x) v = halves(rng) / 2.0f;
  std::vector<int32_t> y(rows);
  for (int32_t& v : y) v = label(rng);

  std::unique_ptr<Mlp> cpu = CpuMlpWith(sizes, params, rows);
  ASSERT_NE(cpu, nullptr);
  absl::StatusOr<MlpBatchStats> want =
      cpu->ForwardBackward(x.data(), y.data(), rows, nullptr);
  ASSERT_TRUE(want.ok()) << want.status();
  const HostRun got = RunKernelBodiesOnHost(sizes, params, x, y, rows);

  EXPECT_EQ(got.stats.loss_sum, want->loss_sum);  // Bit-equal.
  EXPECT_EQ(got.stats.correct, want->correct);
  EXPECT_EQ(got.stats.rows, want->rows);
  const LayerParams last = cpu->GetGrads(2);
  ASSERT_EQ(last.b.size(), got.grads[2].b.size());
  for (size_t c = 0; c < last.b.size(); ++c) {
    EXPECT_EQ(Bits(got.grads[2].b[c]), Bits(last.b[c])) << "db class " << c;
  }
  for (int l = 0; l < 3; ++l) {
    const LayerParams g = cpu->GetGrads(l);
    ExpectClose(g.w, got.grads[l].w, "dW layer " + std::to_string(l));
    ExpectClose(g.b, got.grads[l].b, "db layer " + std::to_string(l));
  }
}

// The shape and data of mlp_cuda_test's comparison, on the host: random
// weights and inputs, so the products round, in different orders; loss to
// 1e-5 relative, gradients to 1e-5 of their largest magnitude.
TEST(MlpKernelsTest, KernelBodiesOnHostMatchCpuMlpOnRandomInputs) {
  MlpConfig config;
  config.sizes = {784, 64, 32, 10};
  config.seed = 11;
  const std::vector<LayerParams> params = InitialMlpParams(config);
  const int rows = 37;
  std::vector<float> x(rows * 784);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = 0.5f + 0.5f * std::sin(0.37f * i);
  }
  std::vector<int32_t> y(rows);
  for (int r = 0; r < rows; ++r) y[r] = (r * 7) % 10;

  std::unique_ptr<Mlp> cpu = CpuMlpWith(config.sizes, params, 64);
  ASSERT_NE(cpu, nullptr);
  absl::StatusOr<MlpBatchStats> want =
      cpu->ForwardBackward(x.data(), y.data(), rows, nullptr);
  ASSERT_TRUE(want.ok()) << want.status();
  const HostRun got = RunKernelBodiesOnHost(config.sizes, params, x, y, rows);
  EXPECT_NEAR(got.stats.loss_sum, want->loss_sum, 1e-5 * want->loss_sum);
  EXPECT_EQ(got.stats.correct, want->correct);
  for (int l = 0; l < 3; ++l) {
    const LayerParams g = cpu->GetGrads(l);
    ExpectClose(g.w, got.grads[l].w, "dW layer " + std::to_string(l));
    ExpectClose(g.b, got.grads[l].b, "db layer " + std::to_string(l));
  }
}

}  // namespace
}  // namespace tessera

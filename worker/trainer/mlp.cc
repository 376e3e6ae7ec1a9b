#include "worker/trainer/mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/trainer/mlp_cuda.h"
#include "worker/trainer/mlp_kernels.h"

namespace tessera {
namespace {

constexpr int kMaxLayerWidth = 1 << 20;

// Softmax cross-entropy on `rows` x `classes` logits: adds each row's loss and
// correctness to `stats` and, when `delta` is not null, writes
// d(loss)/d(logits) = softmax - onehot there (it may alias `logits`). Row by
// row with the CUDA kernel's function.
void SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int rows,
                         int classes, float* delta, MlpBatchStats* stats) {
  for (int r = 0; r < rows; ++r) {
    int correct = 0;
    stats->loss_sum += mlp_kernels::SoftmaxCrossEntropyRow(
        logits, labels, r, classes, delta, &correct);
    stats->correct += correct;
  }
  stats->rows += rows;
}

absl::Status CheckLabels(const int32_t* labels, int rows, int classes) {
  for (int r = 0; r < rows; ++r) {
    if (labels[r] < 0 || labels[r] >= classes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "label ", labels[r], " of row ", r, " is outside 0..", classes - 1));
    }
  }
  return absl::OkStatus();
}

// The CPU backend: cblas_sgemm for the matrix products, plain loops for the
// rest.
class CpuMlp final : public Mlp {
 public:
  CpuMlp(const MlpConfig& config, int max_batch)
      : Mlp(config, max_batch),
        params_(InitialMlpParams(config)),
        grads_(num_layers()),
        acts_(num_layers()),
        deltas_(num_layers()) {
    for (int l = 0; l < num_layers(); ++l) {
      grads_[l].w.assign(params_[l].w.size(), 0.0f);
      grads_[l].b.assign(params_[l].b.size(), 0.0f);
      acts_[l].assign(static_cast<size_t>(max_batch) * out_size(l), 0.0f);
      deltas_[l].assign(static_cast<size_t>(max_batch) * out_size(l), 0.0f);
    }
  }

  MlpDevice device() const override { return MlpDevice::kCpu; }

  absl::Status SetParams(const std::vector<LayerParams>& params) override {
    if (params.size() != params_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SetParams: got ", params.size(),
                       " layers, the model has ", params_.size()));
    }
    for (int l = 0; l < num_layers(); ++l) {
      if (params[l].w.size() != params_[l].w.size() ||
          params[l].b.size() != params_[l].b.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SetParams: layer ", l, " has ", params[l].w.size(),
            " weights and ", params[l].b.size(), " biases, expected ",
            params_[l].w.size(), " and ", params_[l].b.size()));
      }
    }
    params_ = params;
    return absl::OkStatus();
  }

  std::vector<LayerParams> GetParams() override { return params_; }

  absl::StatusOr<MlpBatchStats> ForwardBackward(
      const float* x, const int32_t* labels, int rows,
      const std::function<void(int layer)>& on_layer_ready,
      const std::function<void()>& on_forward_done = nullptr,
      const std::function<absl::Status(int layer)>& before_layer_forward =
          nullptr) override {
    if (rows <= 0 || rows > max_batch()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ForwardBackward: rows must be in 1..", max_batch(), ", got ", rows));
    }
    if (absl::Status s = CheckLabels(labels, rows, out_size(num_layers() - 1));
        !s.ok()) {
      return s;
    }
    MlpBatchStats stats;
    if (absl::Status s = Forward(x, rows, before_layer_forward); !s.ok())
      return s;
    const int last = num_layers() - 1;
    SoftmaxCrossEntropy(acts_[last].data(), labels, rows, out_size(last),
                        deltas_[last].data(), &stats);
    if (on_forward_done) on_forward_done();
    for (int l = last; l >= 0; --l) {
      const int in = in_size(l), out = out_size(l);
      const float* input = l == 0 ? x : acts_[l - 1].data();
      const float* delta = deltas_[l].data();
      // dW = delta^T input: (out x rows) (rows x in).
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, rows, 1.0f,
                  delta, out, input, in, 0.0f, grads_[l].w.data(), in);
      // Column sums of delta; the CUDA kernel's mlp_kernels::ColumnSum adds in
      // the same order, row-major here for the cache.
      float* db = grads_[l].b.data();
      std::fill(db, db + out, 0.0f);
      for (int r = 0; r < rows; ++r) {
        const float* d = delta + static_cast<size_t>(r) * out;
        for (int c = 0; c < out; ++c) db[c] += d[c];
      }
      if (l > 0) {
        // delta_{l-1} = (delta W) masked by ReLU'(z_{l-1}): (rows x out) (out x
        // in).
        float* prev = deltas_[l - 1].data();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, in, out,
                    1.0f, delta, out, params_[l].w.data(), in, 0.0f, prev, in);
        const float* a = acts_[l - 1].data();
        const size_t n = static_cast<size_t>(rows) * in;
        for (size_t i = 0; i < n; ++i) {
          prev[i] = mlp_kernels::ReluBackward(prev[i], a[i]);
        }
      }
      if (on_layer_ready) on_layer_ready(l);
    }
    return stats;
  }

  absl::StatusOr<MlpBatchStats> Evaluate(const float* x, const int32_t* labels,
                                         int rows) override {
    const int classes = out_size(num_layers() - 1);
    if (absl::Status s = CheckLabels(labels, rows, classes); !s.ok()) return s;
    MlpBatchStats stats;
    for (int begin = 0; begin < rows; begin += max_batch()) {
      const int n = std::min(max_batch(), rows - begin);
      if (absl::Status s =
              Forward(x + static_cast<size_t>(begin) * in_size(0), n, nullptr);
          !s.ok()) {
        return s;
      }
      SoftmaxCrossEntropy(acts_[num_layers() - 1].data(), labels + begin, n,
                          classes, nullptr, &stats);
    }
    return stats;
  }

  const float* WeightGrad(int layer) const override {
    return grads_[layer].w.data();
  }
  const float* BiasGrad(int layer) const override {
    return grads_[layer].b.data();
  }
  LayerParams GetGrads(int layer) override { return grads_[layer]; }

  absl::Span<float> WeightStaging(int layer) override {
    return absl::MakeSpan(params_[layer].w);
  }
  absl::Span<float> BiasStaging(int layer) override {
    return absl::MakeSpan(params_[layer].b);
  }
  absl::Status CommitStagedParams() override { return absl::OkStatus(); }
  absl::Status CommitStagedLayer(int layer) override {
    return absl::OkStatus();
  }

  absl::Status LocalSgdStep(float lr, float scale) override {
    for (int l = 0; l < num_layers(); ++l) {
      cblas_saxpy(static_cast<int>(params_[l].w.size()), -lr * scale,
                  grads_[l].w.data(), 1, params_[l].w.data(), 1);
      cblas_saxpy(static_cast<int>(params_[l].b.size()), -lr * scale,
                  grads_[l].b.data(), 1, params_[l].b.data(), 1);
    }
    return absl::OkStatus();
  }

 private:
  // acts_[l] = layer l's output for `rows` rows: ReLU(x W^T + b), or the logits
  // for the last layer. `before_layer`, when given, runs before each layer;
  // its error stops the pass.
  absl::Status Forward(
      const float* x, int rows,
      const std::function<absl::Status(int layer)>& before_layer) {
    for (int l = 0; l < num_layers(); ++l) {
      if (before_layer) {
        if (absl::Status s = before_layer(l); !s.ok()) return s;
      }
      const int in = in_size(l), out = out_size(l);
      const float* input = l == 0 ? x : acts_[l - 1].data();
      float* z = acts_[l].data();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f,
                  input, in, params_[l].w.data(), in, 0.0f, z, out);
      const float* b = params_[l].b.data();
      const bool relu = l + 1 < num_layers();
      for (int r = 0; r < rows; ++r) {
        float* zr = z + static_cast<size_t>(r) * out;
        // Constant `relu` per loop, so each loop stays as simple as before.
        if (relu) {
          for (int c = 0; c < out; ++c) {
            zr[c] = mlp_kernels::BiasActivation(zr[c], b[c], true);
          }
        } else {
          for (int c = 0; c < out; ++c) {
            zr[c] = mlp_kernels::BiasActivation(zr[c], b[c], false);
          }
        }
      }
    }
    return absl::OkStatus();
  }

  std::vector<LayerParams> params_;  // also the pull targets
  std::vector<LayerParams> grads_;
  std::vector<std::vector<float>> acts_;  // per layer: max_batch x out
  std::vector<std::vector<float>>
      deltas_;  // per layer: d(loss)/d(z), max_batch x out
};

}  // namespace

const char* MlpDeviceName(MlpDevice device) {
  return device == MlpDevice::kCuda ? "cuda" : "cpu";
}

absl::Status ValidateMlpConfig(const MlpConfig& config) {
  if (config.sizes.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("an MLP needs at least an input and an output width, got ",
                     config.sizes.size(), " width(s)"));
  }
  for (size_t i = 0; i < config.sizes.size(); ++i) {
    if (config.sizes[i] <= 0 || config.sizes[i] > kMaxLayerWidth) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer width ", i, " must be in 1..", kMaxLayerWidth,
                       ", got ", config.sizes[i]));
    }
  }
  return absl::OkStatus();
}

std::vector<LayerParams> InitialMlpParams(const MlpConfig& config) {
  std::mt19937_64 rng(config.seed);
  const int layers = static_cast<int>(config.sizes.size()) - 1;
  std::vector<LayerParams> params(std::max(layers, 0));
  for (int l = 0; l < layers; ++l) {
    const int in = config.sizes[l], out = config.sizes[l + 1];
    const double limit =
        l + 1 < layers ? std::sqrt(6.0 / in) : std::sqrt(6.0 / (in + out));
    params[l].w.resize(static_cast<size_t>(out) * in);
    for (float& w : params[l].w) {
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
      w = static_cast<float>((2.0 * u - 1.0) * limit);
    }
    params[l].b.assign(out, 0.0f);
  }
  return params;
}

absl::StatusOr<std::unique_ptr<Mlp>> CreateMlp(MlpDevice device,
                                               const MlpConfig& config,
                                               int max_batch) {
  if (absl::Status s = ValidateMlpConfig(config); !s.ok()) return s;
  if (max_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch must be positive, got ", max_batch));
  }
  if (device == MlpDevice::kCuda) return CreateCudaMlp(config, max_batch);
  return std::unique_ptr<Mlp>(new CpuMlp(config, max_batch));
}

void SetCpuMathThreads(int threads) {
  openblas_set_num_threads(std::max(threads, 1));
}

int CpuMathThreads() { return openblas_get_num_threads(); }

}  // namespace tessera

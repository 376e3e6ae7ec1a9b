// The CUDA backend of Mlp: cuBLAS SGEMMs for the matrix products, the kernels
// below for the rest, all on one stream. Row-major matrices are handed to
// column-major cuBLAS as their transposes, so no data is ever transposed. The
// kernels' arithmetic is in mlp_kernels.h, shared with the CPU backend.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/gpu/cuda/cuda_check.h"
#include "common/gpu/device.h"
#include "common/status_macros.h"
#include "worker/trainer/mlp_cuda.h"
#include "worker/trainer/mlp_kernels.h"

// cuBLAS reports its own status type; CUDA runtime errors go through
// TESSERA_CUDA_RETURN_IF_ERROR.
#define TESSERA_CUBLAS_RETURN_IF_ERROR(expr)                       \
  do {                                                             \
    const cublasStatus_t tessera_cublas_st = (expr);               \
    if (tessera_cublas_st != CUBLAS_STATUS_SUCCESS) {              \
      return absl::InternalError(absl::StrCat(                     \
          #expr, ": ", cublasGetStatusString(tessera_cublas_st))); \
    }                                                              \
  } while (0)

namespace tessera {
namespace {

constexpr int kThreads = 256;

int Blocks(size_t n) {
  return static_cast<int>(
      std::min<size_t>((n + kThreads - 1) / kThreads, 4096));
}

// z[r][c] += b[c], then ReLU when `relu` (mlp_kernels::BiasActivationAt).
__global__ void BiasActivationKernel(float* z, const float* b, int rows,
                                     int cols, bool relu) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    mlp_kernels::BiasActivationAt(z, b, i, cols, relu);
  }
}

// One thread per row (mlp_kernels::SoftmaxCrossEntropyRow): loss and
// correctness of the row, and when `delta` is not null d(loss)/d(logits) =
// softmax - onehot.
__global__ void SoftmaxCrossEntropyKernel(const float* logits,
                                          const int32_t* labels, int rows,
                                          int classes, float* delta,
                                          double* row_loss, int* row_correct) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  row_loss[r] = mlp_kernels::SoftmaxCrossEntropyRow(logits, labels, r, classes,
                                                    delta, &row_correct[r]);
}

// delta[i] = 0 where the ReLU output act[i] was not positive
// (mlp_kernels::ReluBackward).
__global__ void ReluBackwardKernel(float* delta, const float* act, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    delta[i] = mlp_kernels::ReluBackward(delta[i], act[i]);
  }
}

// out[c] = sum over rows of m[r][c] (mlp_kernels::ColumnSum); neighbouring
// threads read neighbouring columns.
__global__ void ColumnSumsKernel(const float* m, int rows, int cols,
                                 float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  out[c] = mlp_kernels::ColumnSum(m, rows, cols, c);
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t n) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)));
    size_ = n;
    return absl::OkStatus();
  }
  T* get() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  absl::Status Allocate(size_t n) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(&ptr_, std::max<size_t>(n, 1) * sizeof(T)));
    size_ = n;
    return absl::OkStatus();
  }
  T* get() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

absl::Status CheckLabels(const int32_t* labels, int rows, int classes) {
  for (int r = 0; r < rows; ++r) {
    if (labels[r] < 0 || labels[r] >= classes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "label ", labels[r], " of row ", r, " is outside 0..", classes - 1));
    }
  }
  return absl::OkStatus();
}

class CudaMlp final : public Mlp {
 public:
  CudaMlp(const MlpConfig& config, int max_batch)
      : Mlp(config, max_batch), layers_(num_layers()) {}

  ~CudaMlp() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (commit_done_ != nullptr) cudaEventDestroy(commit_done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&commit_done_, cudaEventDisableTiming));
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
    TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
    // Plain FP32 products, so the results match the CPU backend to float
    // tolerance.
    TESSERA_CUBLAS_RETURN_IF_ERROR(
        cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    const size_t batch = static_cast<size_t>(max_batch());
    for (int l = 0; l < num_layers(); ++l) {
      Layer& L = layers_[l];
      const size_t weights = static_cast<size_t>(out_size(l)) * in_size(l);
      const size_t out = static_cast<size_t>(out_size(l));
      TESSERA_RETURN_IF_ERROR(L.w.Allocate(weights));
      TESSERA_RETURN_IF_ERROR(L.b.Allocate(out));
      TESSERA_RETURN_IF_ERROR(L.gw.Allocate(weights));
      TESSERA_RETURN_IF_ERROR(L.gb.Allocate(out));
      TESSERA_RETURN_IF_ERROR(L.act.Allocate(batch * out));
      TESSERA_RETURN_IF_ERROR(L.delta.Allocate(batch * out));
      TESSERA_RETURN_IF_ERROR(L.staged_w.Allocate(weights));
      TESSERA_RETURN_IF_ERROR(L.staged_b.Allocate(out));
    }
    TESSERA_RETURN_IF_ERROR(x_.Allocate(batch * in_size(0)));
    TESSERA_RETURN_IF_ERROR(host_x_.Allocate(batch * in_size(0)));
    TESSERA_RETURN_IF_ERROR(labels_.Allocate(batch));
    TESSERA_RETURN_IF_ERROR(host_labels_.Allocate(batch));
    TESSERA_RETURN_IF_ERROR(row_loss_.Allocate(batch));
    TESSERA_RETURN_IF_ERROR(row_correct_.Allocate(batch));
    TESSERA_RETURN_IF_ERROR(host_row_loss_.Allocate(batch));
    TESSERA_RETURN_IF_ERROR(host_row_correct_.Allocate(batch));
    return SetParams(InitialMlpParams(config()));
  }

  MlpDevice device() const override { return MlpDevice::kCuda; }
  void* stream() const override { return stream_; }

  absl::Status SetParams(const std::vector<LayerParams>& params) override {
    if (static_cast<int>(params.size()) != num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SetParams: got ", params.size(),
                       " layers, the model has ", num_layers()));
    }
    for (int l = 0; l < num_layers(); ++l) {
      if (params[l].w.size() != layers_[l].w.size() ||
          params[l].b.size() != layers_[l].b.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SetParams: layer ", l, " has ", params[l].w.size(),
            " weights and ", params[l].b.size(), " biases, expected ",
            layers_[l].w.size(), " and ", layers_[l].b.size()));
      }
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(commit_done_));
    for (int l = 0; l < num_layers(); ++l) {
      std::memcpy(layers_[l].staged_w.get(), params[l].w.data(),
                  params[l].w.size() * sizeof(float));
      std::memcpy(layers_[l].staged_b.get(), params[l].b.data(),
                  params[l].b.size() * sizeof(float));
    }
    TESSERA_RETURN_IF_ERROR(CommitStagedParams());
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  std::vector<LayerParams> GetParams() override {
    std::vector<LayerParams> params(num_layers());
    for (int l = 0; l < num_layers(); ++l) {
      params[l].w = ToHost(layers_[l].w);
      params[l].b = ToHost(layers_[l].b);
    }
    return params;
  }

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
    const int last = num_layers() - 1;
    TESSERA_RETURN_IF_ERROR(CheckLabels(labels, rows, out_size(last)));
    TESSERA_RETURN_IF_ERROR(UploadBatch(x, labels, rows));
    TESSERA_RETURN_IF_ERROR(Forward(rows, before_layer_forward));
    SoftmaxCrossEntropyKernel<<<(rows + kThreads - 1) / kThreads, kThreads, 0,
                                stream_>>>(
        layers_[last].act.get(), labels_.get(), rows, out_size(last),
        layers_[last].delta.get(), row_loss_.get(), row_correct_.get());
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    TESSERA_RETURN_IF_ERROR(DownloadRowStats(rows));
    if (on_forward_done) on_forward_done();
    // Pulls from the callbacks overwrite the staging buffers: the copies of the
    // last commit must have left them (with CommitStagedLayer, the last
    // layer's event follows every earlier copy on the stream).
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(commit_done_));
    const float one = 1.0f, zero = 0.0f;
    for (int l = last; l >= 0; --l) {
      Layer& L = layers_[l];
      const int in = in_size(l), out = out_size(l);
      const float* input = l == 0 ? x_.get() : layers_[l - 1].act.get();
      // dW (out x in) = delta^T input; as column-major: dW^T = input^T delta.
      TESSERA_CUBLAS_RETURN_IF_ERROR(
          cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, &one,
                      input, in, L.delta.get(), out, &zero, L.gw.get(), in));
      ColumnSumsKernel<<<(out + kThreads - 1) / kThreads, kThreads, 0,
                         stream_>>>(L.delta.get(), rows, out, L.gb.get());
      TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      if (l > 0) {
        // delta_{l-1} (rows x in) = delta W; as column-major: W^T delta^T.
        Layer& P = layers_[l - 1];
        TESSERA_CUBLAS_RETURN_IF_ERROR(cublasSgemm(
            cublas_, CUBLAS_OP_N, CUBLAS_OP_N, in, rows, out, &one, L.w.get(),
            in, L.delta.get(), out, &zero, P.delta.get(), in));
        const size_t n = static_cast<size_t>(rows) * in;
        ReluBackwardKernel<<<Blocks(n), kThreads, 0, stream_>>>(P.delta.get(),
                                                                P.act.get(), n);
        TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      }
      if (on_layer_ready) on_layer_ready(l);
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return SumRowStats(rows);
  }

  absl::StatusOr<MlpBatchStats> Evaluate(const float* x, const int32_t* labels,
                                         int rows) override {
    const int last = num_layers() - 1;
    TESSERA_RETURN_IF_ERROR(CheckLabels(labels, rows, out_size(last)));
    MlpBatchStats total;
    for (int begin = 0; begin < rows; begin += max_batch()) {
      const int n = std::min(max_batch(), rows - begin);
      TESSERA_RETURN_IF_ERROR(UploadBatch(
          x + static_cast<size_t>(begin) * in_size(0), labels + begin, n));
      TESSERA_RETURN_IF_ERROR(Forward(n, nullptr));
      SoftmaxCrossEntropyKernel<<<(n + kThreads - 1) / kThreads, kThreads, 0,
                                  stream_>>>(
          layers_[last].act.get(), labels_.get(), n, out_size(last), nullptr,
          row_loss_.get(), row_correct_.get());
      TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      TESSERA_RETURN_IF_ERROR(DownloadRowStats(n));
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      const MlpBatchStats part = SumRowStats(n);
      total.loss_sum += part.loss_sum;
      total.correct += part.correct;
      total.rows += part.rows;
    }
    return total;
  }

  const float* WeightGrad(int layer) const override {
    return layers_[layer].gw.get();
  }
  const float* BiasGrad(int layer) const override {
    return layers_[layer].gb.get();
  }

  LayerParams GetGrads(int layer) override {
    LayerParams grads;
    grads.w = ToHost(layers_[layer].gw);
    grads.b = ToHost(layers_[layer].gb);
    return grads;
  }

  absl::Span<float> WeightStaging(int layer) override {
    return absl::MakeSpan(layers_[layer].staged_w.get(),
                          layers_[layer].staged_w.size());
  }
  absl::Span<float> BiasStaging(int layer) override {
    return absl::MakeSpan(layers_[layer].staged_b.get(),
                          layers_[layer].staged_b.size());
  }

  absl::Status CommitStagedParams() override {
    for (Layer& L : layers_) TESSERA_RETURN_IF_ERROR(CopyStaged(L));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(commit_done_, stream_));
    return absl::OkStatus();
  }

  absl::Status CommitStagedLayer(int layer) override {
    if (layer < 0 || layer >= num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CommitStagedLayer: layer must be in 0..",
                       num_layers() - 1, ", got ", layer));
    }
    TESSERA_RETURN_IF_ERROR(CopyStaged(layers_[layer]));
    // Recorded after this copy, so it also follows every earlier commit's.
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(commit_done_, stream_));
    return absl::OkStatus();
  }

  absl::Status LocalSgdStep(float lr, float scale) override {
    const float alpha = -lr * scale;
    for (Layer& L : layers_) {
      TESSERA_CUBLAS_RETURN_IF_ERROR(
          cublasSaxpy(cublas_, static_cast<int>(L.w.size()), &alpha, L.gw.get(),
                      1, L.w.get(), 1));
      TESSERA_CUBLAS_RETURN_IF_ERROR(
          cublasSaxpy(cublas_, static_cast<int>(L.b.size()), &alpha, L.gb.get(),
                      1, L.b.get(), 1));
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  struct Layer {
    DeviceBuffer<float> w, b;    // parameters
    DeviceBuffer<float> gw, gb;  // gradients of the last step
    DeviceBuffer<float> act;     // output, max_batch x out
    DeviceBuffer<float> delta;   // d(loss)/d(pre-activation), max_batch x out
    PinnedBuffer<float> staged_w, staged_b;  // pull targets
  };

  absl::Status UploadBatch(const float* x, const int32_t* labels, int rows) {
    // The previous upload has completed: every step ends with a stream sync.
    const size_t x_floats = static_cast<size_t>(rows) * in_size(0);
    std::memcpy(host_x_.get(), x, x_floats * sizeof(float));
    std::memcpy(host_labels_.get(), labels, rows * sizeof(int32_t));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(x_.get(), host_x_.get(), x_floats * sizeof(float),
                        cudaMemcpyHostToDevice, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        labels_.get(), host_labels_.get(), rows * sizeof(int32_t),
        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  // Layer L's staging onto the device, on the stream.
  absl::Status CopyStaged(Layer& L) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(L.w.get(), L.staged_w.get(), L.w.size() * sizeof(float),
                        cudaMemcpyHostToDevice, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(L.b.get(), L.staged_b.get(), L.b.size() * sizeof(float),
                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  // Queues the forward pass of `rows` rows; `before_layer`, when given, runs
  // on the host before each layer is queued, and its error stops the pass.
  absl::Status Forward(
      int rows, const std::function<absl::Status(int layer)>& before_layer) {
    const float one = 1.0f, zero = 0.0f;
    for (int l = 0; l < num_layers(); ++l) {
      if (before_layer) TESSERA_RETURN_IF_ERROR(before_layer(l));
      Layer& L = layers_[l];
      const int in = in_size(l), out = out_size(l);
      const float* input = l == 0 ? x_.get() : layers_[l - 1].act.get();
      // z (rows x out) = input W^T; as column-major: z^T = W input^T.
      TESSERA_CUBLAS_RETURN_IF_ERROR(
          cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &one,
                      L.w.get(), in, input, in, &zero, L.act.get(), out));
      const size_t n = static_cast<size_t>(rows) * out;
      BiasActivationKernel<<<Blocks(n), kThreads, 0, stream_>>>(
          L.act.get(), L.b.get(), rows, out, l + 1 < num_layers());
      TESSERA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    return absl::OkStatus();
  }

  absl::Status DownloadRowStats(int rows) {
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        host_row_loss_.get(), row_loss_.get(), rows * sizeof(double),
        cudaMemcpyDeviceToHost, stream_));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host_row_correct_.get(), row_correct_.get(),
                        rows * sizeof(int), cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  }

  // REQUIRES: the stream has been synchronized after DownloadRowStats(rows).
  MlpBatchStats SumRowStats(int rows) const {
    MlpBatchStats stats;
    for (int r = 0; r < rows; ++r) {
      stats.loss_sum += host_row_loss_.get()[r];
      stats.correct += host_row_correct_.get()[r];
    }
    stats.rows = rows;
    return stats;
  }

  // Copies a device buffer to the host after the stream's work; empty on
  // failure.
  std::vector<float> ToHost(const DeviceBuffer<float>& buf) {
    std::vector<float> out(buf.size());
    if (cudaStreamSynchronize(stream_) != cudaSuccess ||
        cudaMemcpy(out.data(), buf.get(), buf.size() * sizeof(float),
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
      return {};
    }
    return out;
  }

  std::vector<Layer> layers_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t commit_done_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer<float> x_;
  DeviceBuffer<int32_t> labels_;
  PinnedBuffer<float> host_x_;
  PinnedBuffer<int32_t> host_labels_;
  DeviceBuffer<double> row_loss_;  // Double, as the CPU backend sums it.
  DeviceBuffer<int> row_correct_;
  PinnedBuffer<double> host_row_loss_;
  PinnedBuffer<int> host_row_correct_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Mlp>> CreateCudaMlp(const MlpConfig& config,
                                                   int max_batch) {
  TESSERA_RETURN_IF_ERROR(ValidateMlpConfig(config));
  if (max_batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch must be positive, got ", max_batch));
  }
  if (!gpu::DeviceAvailable()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA backend needs a GPU: ", gpu::DeviceDescription()));
  }
  auto mlp = std::make_unique<CudaMlp>(config, max_batch);
  TESSERA_RETURN_IF_ERROR(mlp->Init());
  return std::unique_ptr<Mlp>(std::move(mlp));
}

}  // namespace tessera

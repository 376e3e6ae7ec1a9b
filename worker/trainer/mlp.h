// Mlp: the multi-layer perceptron classifier that tessera-worker trains, with a
// CPU backend (OpenBLAS) and a CUDA backend (cuBLAS plus kernels,
// worker/cuda/).
//
// Layer l maps in_l inputs to out_l outputs: z = x W^T + b, with W row-major
// (out x in) and b (out); hidden layers apply ReLU, the last layer feeds a
// softmax cross-entropy loss. Each parameter tensor is one KV key (MlpWeightKey
// / MlpBiasKey), so a layer's gradients can be pushed while backward still
// works on the layers below it.
//
//   tessera::MlpConfig config{.sizes = {784, 256, 128, 10}, .seed = 42};
//   absl::StatusOr<std::unique_ptr<tessera::Mlp>> mlp =
//       tessera::CreateMlp(tessera::MlpDevice::kCpu, config,
//       /*max_batch=*/128);
//   auto step = (*mlp)->ForwardBackward(batch.images.data(),
//   batch.labels.data(),
//                                        batch.size, [&](int layer) {
//                                        Push(layer); });
//   // ...wait for the pulls into WeightStaging(l) / BiasStaging(l), then:
//   (*mlp)->CommitStagedParams();
//
// Gradients are SUMS over the batch (not means): the server's rescale_grad
// divides.
//
// Thread-safety: an Mlp is used by one thread at a time, except that the
// staging buffers and gradient buffers handed to the KV client may be read or
// written by it between the layer callback and the following
// CommitStagedParams (or, layer by layer, that layer's CommitStagedLayer).
#ifndef TESSERA_WORKER_TRAINER_MLP_H_
#define TESSERA_WORKER_TRAINER_MLP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tessera {

enum class MlpDevice { kCpu, kCuda };
const char* MlpDeviceName(MlpDevice device);

struct MlpConfig {
  // Layer widths from input to output, e.g. {784, 256, 128, 10}; at least two.
  std::vector<int> sizes;
  // Seeds the initial weights: every worker with the same seed builds the same
  // model.
  uint64_t seed = 0;
};

// InvalidArgument naming the bad width.
absl::Status ValidateMlpConfig(const MlpConfig& config);

inline uint64_t MlpWeightKey(int layer) {
  return 2 * static_cast<uint64_t>(layer);
}
inline uint64_t MlpBiasKey(int layer) {
  return 2 * static_cast<uint64_t>(layer) + 1;
}

// Host copy of one layer's parameters (or gradients).
struct LayerParams {
  std::vector<float> w;  // out x in, row-major
  std::vector<float> b;  // out
};

// The initial parameters: W uniform in +-sqrt(6 / in) (He) for ReLU layers and
// +-sqrt(6 / (in + out)) (Xavier) for the output layer, b = 0, drawn from
// mt19937_64 so the values are the same on every platform.
std::vector<LayerParams> InitialMlpParams(const MlpConfig& config);

// What one forward pass measured over its batch.
struct MlpBatchStats {
  double loss_sum = 0;  // sum over the batch of -log softmax(z)[label]
  int correct = 0;      // rows whose argmax is the label
  int rows = 0;
};

class Mlp {
 public:
  virtual ~Mlp() = default;

  virtual MlpDevice device() const = 0;
  const MlpConfig& config() const { return config_; }
  int num_layers() const { return static_cast<int>(config_.sizes.size()) - 1; }
  int in_size(int layer) const { return config_.sizes[layer]; }
  int out_size(int layer) const { return config_.sizes[layer + 1]; }
  int max_batch() const { return max_batch_; }

  // Replaces the parameters (host copies, as InitialMlpParams gives them).
  // InvalidArgument on a shape mismatch.
  virtual absl::Status SetParams(const std::vector<LayerParams>& params) = 0;
  virtual std::vector<LayerParams> GetParams() = 0;

  // Forward, loss and backward on `rows` examples: `x` is rows x in_size(0)
  // row-major on the host, `labels` in 0..classes-1. Backward runs from the
  // last layer down; once layer l's gradients are final and its weights are no
  // longer read in this step, calls on_layer_ready(l) (so l goes num_layers()-1
  // ... 0), from this thread. The callback may start pushes of the gradient
  // buffers and pulls into the staging buffers of that layer. REQUIRES: 0 <
  // rows <= max_batch(); labels in range (InvalidArgument otherwise).
  // on_forward_done, when given, is called once forward and the loss are
  // done, before backward starts: the boundary of a step's forward and
  // backward phases (traces). On kCuda it is the host's view: forward is
  // queued on the stream, not necessarily finished on the device (waiting for
  // it would cost the overlap being measured).
  // before_layer_forward, when given, is called with l = 0 ... num_layers()-1
  // just before layer l's forward reads its parameters, from this thread: the
  // caller may wait there for that layer's pulls and CommitStagedLayer(l)
  // (layer-by-layer forward). An error from it ends the call with that
  // status, before any layer after it runs and before backward.
  virtual absl::StatusOr<MlpBatchStats> ForwardBackward(
      const float* x, const int32_t* labels, int rows,
      const std::function<void(int layer)>& on_layer_ready,
      const std::function<void()>& on_forward_done = nullptr,
      const std::function<absl::Status(int layer)>& before_layer_forward =
          nullptr) = 0;

  // Forward and loss only, over any number of rows (in chunks of max_batch()).
  virtual absl::StatusOr<MlpBatchStats> Evaluate(const float* x,
                                                 const int32_t* labels,
                                                 int rows) = 0;

  // The last ForwardBackward's gradients of layer l. On kCpu these point to
  // host memory, on kCuda to device memory (valid for PushDeviceAsync on
  // stream()). The buffers live as long as the Mlp and change at the next
  // ForwardBackward.
  virtual const float* WeightGrad(int layer) const = 0;
  virtual const float* BiasGrad(int layer) const = 0;
  // Copies the last gradients of layer l to the host (waits for the device).
  virtual LayerParams GetGrads(int layer) = 0;

  // Host buffers that receive pulled parameters (pinned memory on kCuda). They
  // take effect at CommitStagedParams, so a pull may land while other layers
  // still compute.
  virtual absl::Span<float> WeightStaging(int layer) = 0;
  virtual absl::Span<float> BiasStaging(int layer) = 0;
  // Makes the staged parameters of every layer the model's parameters (on kCpu
  // the staging buffers are the parameters; on kCuda an asynchronous copy on
  // stream()).
  virtual absl::Status CommitStagedParams() = 0;
  // The same for layer `layer` only (0 <= layer < num_layers()): on kCpu
  // nothing to do, on kCuda an asynchronous copy of that layer's staging on
  // stream(), ordered before any forward queued after it.
  virtual absl::Status CommitStagedLayer(int layer) = 0;

  // params -= lr * scale * grads, locally: single-process training and tests.
  virtual absl::Status LocalSgdStep(float lr, float scale) = 0;

  // The cudaStream_t the CUDA backend computes on; nullptr on kCpu.
  virtual void* stream() const { return nullptr; }

 protected:
  Mlp(const MlpConfig& config, int max_batch)
      : config_(config), max_batch_(max_batch) {}

 private:
  const MlpConfig config_;
  const int max_batch_;
};

// Builds a model with InitialMlpParams(config) for batches of up to max_batch
// rows. InvalidArgument for a bad config; FailedPrecondition for kCuda without
// a device.
absl::StatusOr<std::unique_ptr<Mlp>> CreateMlp(MlpDevice device,
                                               const MlpConfig& config,
                                               int max_batch);

// Threads OpenBLAS may use in this process. tessera-worker uses 1 by default:
// the workers and servers of a job share the machine's cores, and OpenBLAS
// threads that spin for work take cores from the server threads and the batch
// loader.
void SetCpuMathThreads(int threads);
int CpuMathThreads();

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_MLP_H_

// The arithmetic of the CUDA MLP's kernels (cuda/mlp_cuda.cu), one element,
// column or row at a time, as TESSERA_HOST_DEVICE functions. The CPU backend
// (mlp.cc) calls the same functions, and host tests run the kernels' bodies
// against it on machines without a GPU. Names no CUDA type. The matrix
// products are not here: cuBLAS and OpenBLAS compute them, each in its own
// order, so the two backends agree on those only to float tolerance.
//
//   // Thread i of the bias-and-activation kernel, and the same on the host:
//   BiasActivationAt(z, b, i, cols, /*relu=*/true);
//   // Thread r of the loss kernel; the CPU backend runs it for every row:
//   row_loss[r] = SoftmaxCrossEntropyRow(logits, labels, r, classes, delta,
//                                        &row_correct[r]);
#ifndef TESSERA_WORKER_TRAINER_MLP_KERNELS_H_
#define TESSERA_WORKER_TRAINER_MLP_KERNELS_H_

// The C functions by name (::exp, ::expf, ::log): nvcc provides each of them on
// the device, and on the host they are what std::exp / std::log call.
#include <math.h>

#include <cstddef>
#include <cstdint>

#include "common/gpu/host_device.h"

namespace tessera::mlp_kernels {

// z + b, then ReLU when `relu`: max(v, 0) as std::max computes it, so NaN and
// -0 pass through unchanged.
TESSERA_HOST_DEVICE inline float BiasActivation(float z, float b, bool relu) {
  const float v = z + b;
  return relu && v < 0.0f ? 0.0f : v;
}

// Element i of a row-major rows x cols matrix z: z[i] = BiasActivation(z[i],
// b[column of i]).
TESSERA_HOST_DEVICE inline void BiasActivationAt(float* z, const float* b,
                                                 size_t i, int cols,
                                                 bool relu) {
  z[i] = BiasActivation(z[i], b[i % static_cast<size_t>(cols)], relu);
}

// The gradient through ReLU: `delta` where the layer's output `act` was
// positive, else 0 (also for a NaN output).
TESSERA_HOST_DEVICE inline float ReluBackward(float delta, float act) {
  return act > 0.0f ? delta : 0.0f;
}

// Sum of column c of a row-major rows x cols matrix, adding rows 0, 1, ... in
// order from 0.0f (the order of the CPU's row-major loop, so the same bits).
TESSERA_HOST_DEVICE inline float ColumnSum(const float* m, int rows, int cols,
                                           int c) {
  float sum = 0.0f;
  for (int r = 0; r < rows; ++r) {
    sum += m[static_cast<size_t>(r) * static_cast<size_t>(cols) + c];
  }
  return sum;
}

// Softmax cross-entropy of row r of `logits` (rows x classes) against
// labels[r]: returns -log softmax(z)[label] (summed in double), sets *correct
// to 1 when the row's first argmax is the label (else 0), and when `delta` is
// not null writes d(loss)/d(logits) = softmax - onehot to row r of `delta`
// (which may be `logits`). REQUIRES: 0 <= labels[r] < classes.
TESSERA_HOST_DEVICE inline double SoftmaxCrossEntropyRow(const float* logits,
                                                         const int32_t* labels,
                                                         int r, int classes,
                                                         float* delta,
                                                         int* correct) {
  const size_t row = static_cast<size_t>(r) * static_cast<size_t>(classes);
  const float* z = logits + row;
  int argmax = 0;
  for (int c = 1; c < classes; ++c) {
    if (z[c] > z[argmax]) argmax = c;
  }
  const float m = z[argmax];
  double sum = 0;
  for (int c = 0; c < classes; ++c) sum += ::exp(static_cast<double>(z[c] - m));
  const int y = labels[r];
  const double loss = ::log(sum) - static_cast<double>(z[y] - m);
  *correct = argmax == y ? 1 : 0;
  if (delta != nullptr) {
    float* d = delta + row;
    const float inv = static_cast<float>(1.0 / sum);
    for (int c = 0; c < classes; ++c) d[c] = ::expf(z[c] - m) * inv;
    d[y] -= 1.0f;
  }
  return loss;
}

}  // namespace tessera::mlp_kernels

#endif  // TESSERA_WORKER_TRAINER_MLP_KERNELS_H_

// TESSERA_HOST_DEVICE marks a function that runs on the host and, compiled by
// nvcc, on the GPU as well. A CUDA kernel keeps its arithmetic in such
// functions, in headers that name no CUDA type, so that host tests run the
// code the kernel runs on machines without a GPU (and the CPU path may share
// it).
//
//   TESSERA_HOST_DEVICE inline float Relu(float v) { return v < 0 ? 0 : v; }
//
//   // In a .cu file:    v[i] = Relu(v[i]);          inside a __global__ kernel
//   // In a host test:   EXPECT_EQ(Relu(-1.0f), 0.0f);
#ifndef TESSERA_COMMON_GPU_HOST_DEVICE_H_
#define TESSERA_COMMON_GPU_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif

namespace tessera::gpu {

// a + b and a - b, each rounded once to nearest even. On the device these are
// __fadd_rn / __fsub_rn, which nvcc never contracts into a multiply-add nor
// reassociates, so a kernel that uses them produces the host's bits.
TESSERA_HOST_DEVICE inline float AddRoundedToNearest(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

TESSERA_HOST_DEVICE inline float SubRoundedToNearest(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

}  // namespace tessera::gpu

#endif  // TESSERA_COMMON_GPU_HOST_DEVICE_H_

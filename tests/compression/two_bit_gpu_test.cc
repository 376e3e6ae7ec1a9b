// GPU 2-bit codec against the CPU codec, bit for bit, residual included. Skips
// when no CUDA device is present (and without CUDA, checks that the stub says
// so).
#include "common/compression/two_bit_gpu.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/compression/two_bit.h"
#include "common/gpu/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::compression {
namespace {

using ::testing::HasSubstr;

#define ASSERT_CUDA_OK(expr)                              \
  do {                                                    \
    const cudaError_t cuda_err = (expr);                  \
    ASSERT_EQ(cuda_err, cudaSuccess)                      \
        << #expr << ": " << cudaGetErrorString(cuda_err); \
  } while (0)

// A device array freed on scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n_ > 0 && cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)) !=
                      cudaSuccess) {
      p_ = nullptr;
    }
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  bool ok() const { return n_ == 0 || p_ != nullptr; }
  cudaError_t Upload(const std::vector<T>& v) {
    return cudaMemcpy(p_, v.data(), v.size() * sizeof(T),
                      cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>& v) const {
    return cudaMemcpy(v.data(), p_, v.size() * sizeof(T),
                      cudaMemcpyDeviceToHost);
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

bool SameBits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

class TwoBitGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

// Several consecutive pushes per length: packed bytes and the evolving residual
// must equal the CPU codec's bit for bit. Offsets exercise the unaligned
// (scalar) path.
TEST_F(TwoBitGpuTest, QuantizeMatchesCpuBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.7f);
  for (size_t len : {1u, 2u, 3u, 4u, 5u, 15u, 16u, 17u, 31u, 33u, 255u, 1000u,
                     4097u, 65536u, 1000003u}) {
    for (size_t offset : {0u, 1u}) {
      for (float t : {0.5f, 0.013f}) {
        std::vector<float> cpu_residual(len, 0.0f);
        DeviceArray<float> d_grad(len + offset), d_residual(len + offset);
        DeviceArray<uint8_t> d_out(TwoBitCompressedBytes(len));
        ASSERT_TRUE(d_grad.ok() && d_residual.ok() && d_out.ok());
        ASSERT_CUDA_OK(
            cudaMemset(d_residual.get(), 0, (len + offset) * sizeof(float)));
        ASSERT_CUDA_OK(
            cudaMemset(d_out.get(), 0xAB, TwoBitCompressedBytes(len)));
        for (int push = 0; push < 4; ++push) {
          std::vector<float> grad(len + offset);
          for (float& g : grad) g = normal(rng);
          if (push == 3 && len > 2) grad[1] = 1e-40f;  // A denormal.
          ASSERT_CUDA_OK(d_grad.Upload(grad));

          std::vector<uint8_t> cpu_out(TwoBitCompressedBytes(len));
          ASSERT_TRUE(TwoBitQuantize(grad.data() + offset, cpu_residual.data(),
                                     len, t, cpu_out.data())
                          .ok());
          ASSERT_TRUE(TwoBitQuantizeDevice(d_grad.get() + offset,
                                           d_residual.get() + offset, len, t,
                                           d_out.get(), nullptr)
                          .ok());
          ASSERT_CUDA_OK(cudaDeviceSynchronize());
          std::vector<uint8_t> gpu_out(cpu_out.size());
          ASSERT_CUDA_OK(d_out.Download(gpu_out));
          ASSERT_EQ(gpu_out, cpu_out)
              << "len " << len << " offset " << offset << " push " << push;
          std::vector<float> gpu_residual(len + offset);
          ASSERT_CUDA_OK(d_residual.Download(gpu_residual));
          for (size_t i = 0; i < len; ++i) {
            ASSERT_TRUE(SameBits(gpu_residual[offset + i], cpu_residual[i]))
                << "len " << len << " push " << push << " element " << i << ": "
                << gpu_residual[offset + i] << " vs " << cpu_residual[i];
          }
        }
      }
    }
  }
}

TEST_F(TwoBitGpuTest, ReferenceVector) {
  const std::vector<float> grad = {0.6f,  -0.7f, 0.2f, 0.5f,
                                   -0.5f, 0.49f, 1.0f, -2.0f};
  DeviceArray<float> d_grad(8), d_residual(8), d_decoded(8);
  DeviceArray<uint8_t> d_out(4);
  ASSERT_CUDA_OK(d_grad.Upload(grad));
  ASSERT_CUDA_OK(cudaMemset(d_residual.get(), 0, 8 * sizeof(float)));
  ASSERT_TRUE(TwoBitQuantizeDevice(d_grad.get(), d_residual.get(), 8, 0.5f,
                                   d_out.get(), nullptr)
                  .ok());
  std::vector<uint8_t> out(4);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(d_out.Download(out));
  EXPECT_THAT(out, ::testing::ElementsAre(0xE3, 0x8E, 0x00, 0x00));
  ASSERT_TRUE(
      TwoBitDequantizeDevice(d_out.get(), 8, 0.5f, d_decoded.get(), nullptr)
          .ok());
  std::vector<float> decoded(8);
  ASSERT_CUDA_OK(d_decoded.Download(decoded));
  EXPECT_THAT(decoded, ::testing::ElementsAre(0.5f, -0.5f, 0.0f, 0.5f, -0.5f,
                                              0.0f, 0.5f, -0.5f));
}

TEST_F(TwoBitGpuTest, DequantizeMatchesCpu) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t len : {1u, 3u, 16u, 17u, 1001u, 65537u}) {
    std::vector<float> grad(len), residual(len, 0.0f);
    for (float& g : grad) g = normal(rng);
    std::vector<uint8_t> wire(TwoBitCompressedBytes(len));
    ASSERT_TRUE(
        TwoBitQuantize(grad.data(), residual.data(), len, 0.5f, wire.data())
            .ok());
    std::vector<float> cpu(len);
    ASSERT_TRUE(
        TwoBitDequantize(wire.data(), wire.size(), len, 0.5f, cpu.data()).ok());
    DeviceArray<uint8_t> d_in(wire.size());
    DeviceArray<float> d_out(len + 1);
    ASSERT_CUDA_OK(d_in.Upload(wire));
    for (size_t offset : {0u, 1u}) {
      ASSERT_TRUE(TwoBitDequantizeDevice(d_in.get(), len, 0.5f,
                                         d_out.get() + offset, nullptr)
                      .ok());
      std::vector<float> gpu(len + 1);
      ASSERT_CUDA_OK(d_out.Download(gpu));
      for (size_t i = 0; i < len; ++i) {
        ASSERT_TRUE(SameBits(gpu[offset + i], cpu[i])) << "len " << len;
      }
    }
  }
}

TEST_F(TwoBitGpuTest, DequantizeRejectsMalformedPayloads) {
  DeviceArray<uint8_t> d_in(8);
  DeviceArray<float> d_out(17);
  const std::vector<uint8_t> bad_code = {0x40, 0, 0, 0, 0, 0, 0, 0};
  ASSERT_CUDA_OK(d_in.Upload(bad_code));
  absl::Status s =
      TwoBitDequantizeDevice(d_in.get(), 17, 0.5f, d_out.get(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("0b01"));

  const std::vector<uint8_t> bad_padding = {0, 0, 0, 0, 0xC0, 0, 0, 0x01};
  ASSERT_CUDA_OK(d_in.Upload(bad_padding));
  s = TwoBitDequantizeDevice(d_in.get(), 17, 0.5f, d_out.get(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("wrong place"));

  EXPECT_EQ(TwoBitDequantizeDevice(d_in.get(), 17, -1.0f, d_out.get(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      TwoBitQuantizeDevice(nullptr, nullptr, 17, 0.5f, nullptr, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::compression

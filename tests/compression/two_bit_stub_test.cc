// Built without CUDA: the GPU entry points exist and say why they cannot work.
#include <cstdint>

#include "common/compression/two_bit_gpu.h"
#include "common/gpu/device.h"
#include "gtest/gtest.h"

namespace tessera::compression {
namespace {

TEST(TwoBitGpuStubTest, EverythingSaysBuiltWithoutCuda) {
  EXPECT_FALSE(gpu::DeviceAvailable());
  float f = 0;
  uint8_t b[4] = {};
  absl::Status s = TwoBitQuantizeDevice(&f, &f, 1, 0.5f, b, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "built without CUDA");
  EXPECT_EQ(TwoBitDequantizeDevice(b, 1, 0.5f, &f, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tessera::compression

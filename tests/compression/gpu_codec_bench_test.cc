// The GPU half of tessera-codec-bench: without a device (or without CUDA) it
// says so with FailedPrecondition; with one, it returns figures.
#include "tests/compression/gpu_codec_bench.h"

#include "common/gpu/device.h"
#include "gtest/gtest.h"

namespace tessera::compression {
namespace {

TEST(GpuCodecBenchTest, WithoutDeviceIsFailedPrecondition) {
  if (gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  EXPECT_EQ(RunGpuCodecBench(1 << 20).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(GpuCodecBenchTest, OnDeviceReportsFigures) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << gpu::DeviceDescription();
  absl::StatusOr<GpuCodecBenchResult> r = RunGpuCodecBench(1 << 20);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes, 1u << 20);
  EXPECT_GT(r->quantize_gbps, 0);
  EXPECT_GT(r->dequantize_gbps, 0);
  EXPECT_GT(r->d2d_memcpy_gbps, 0);
  EXPECT_GT(r->d2h_float_ms, 0);
  EXPECT_GT(r->d2h_compressed_ms, 0);
  EXPECT_FALSE(r->device_name.empty());
  EXPECT_EQ(RunGpuCodecBench(3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::compression

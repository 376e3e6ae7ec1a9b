// tessera-codec-bench: throughput of the 2-bit codec against a same-run
// baseline.
//
// CPU, one thread: quantize, dequantize and dequantize-add of 1, 4, 16, 64 and
// 256 MiB of float input, beside a single-thread memcpy of the same buffer; the
// ratio is what to compare between runs (these machines are noisy). GPU, when a
// device is present: the kernels beside a device-to-device cudaMemcpy, and the
// time to bring a 100 MiB gradient to the host with and without compression.
//
// Usage: tessera-codec-bench [--json] [--max-mb=N]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/compression/two_bit.h"
#include "common/gpu/device.h"
#include "tests/compression/gpu_codec_bench.h"

namespace tessera::compression {
namespace {

constexpr float kThreshold = 0.5f;
constexpr size_t kMiB = size_t{1} << 20;

// Keeps the compiler from dropping work whose result is never read.
inline void Touch(void* p) { asm volatile("" : : "r"(p) : "memory"); }

// Best seconds per call of `op` over at least 3 runs and about 0.4 s, after a
// warm-up.
template <typename Op>
double BestSeconds(Op op) {
  op();
  double best = 1e300;
  double total = 0;
  for (int i = 0; i < 3 || (total < 0.4 && i < 200); ++i) {
    const auto begin = std::chrono::steady_clock::now();
    op();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin)
            .count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

struct CpuRow {
  size_t bytes;
  double memcpy_gbps, quantize_gbps, dequantize_gbps, dequantize_add_gbps;
};

bool Check(const absl::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "%s failed: %s\n", what, s.ToString().c_str());
  return false;
}

bool RunCpu(size_t bytes, CpuRow* row) {
  const size_t len = bytes / sizeof(float);
  std::vector<float> grad(len), residual(len, 0.0f), copy(len), decoded(len);
  std::vector<uint8_t> packed(TwoBitCompressedBytes(len));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (float& g : grad) g = normal(rng);
  const double gb = static_cast<double>(bytes) / 1e9;
  bool ok = true;

  row->bytes = bytes;
  row->memcpy_gbps = gb / BestSeconds([&] {
                       std::memcpy(copy.data(), grad.data(), bytes);
                       Touch(copy.data());
                     });
  row->quantize_gbps =
      gb / BestSeconds([&] {
        ok &= Check(TwoBitQuantize(grad.data(), residual.data(), len,
                                   kThreshold, packed.data()),
                    "TwoBitQuantize");
        Touch(packed.data());
      });
  row->dequantize_gbps =
      gb / BestSeconds([&] {
        ok &= Check(TwoBitDequantize(packed.data(), packed.size(), len,
                                     kThreshold, decoded.data()),
                    "TwoBitDequantize");
        Touch(decoded.data());
      });
  row->dequantize_add_gbps =
      gb / BestSeconds([&] {
        ok &= Check(TwoBitDequantizeAdd(packed.data(), packed.size(), len,
                                        kThreshold, decoded.data()),
                    "TwoBitDequantizeAdd");
        Touch(decoded.data());
      });
  return ok;
}

// Memory traffic per float of input: the quantizer reads grad and residual and
// writes residual plus 1/16 of the bytes; a copy reads and writes once.
constexpr double kQuantizeTraffic = 3.0 + 1.0 / 16;
constexpr double kCopyTraffic = 2.0;

int Main(int argc, char** argv) {
  bool json = false;
  size_t max_mb = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      json = true;
    } else if (arg.rfind("--max-mb=", 0) == 0) {
      max_mb = std::strtoull(arg.c_str() + 9, nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json] [--max-mb=N]\n  unknown argument '%s'\n",
                   argv[0], arg.c_str());
      return 2;
    }
  }

  std::vector<CpuRow> cpu;
  for (size_t mb : {1, 4, 16, 64, 256}) {
    if (mb > max_mb) break;
    CpuRow row{};
    if (!RunCpu(mb * kMiB, &row)) return 1;
    cpu.push_back(row);
  }

  std::vector<GpuCodecBenchResult> gpu;
  GpuCodecBenchResult transfer;
  std::string gpu_note = "no CUDA device";
  if (gpu::DeviceAvailable()) {
    gpu_note.clear();
    for (size_t mb : {1, 4, 16, 64, 256}) {
      if (mb > max_mb) break;
      absl::StatusOr<GpuCodecBenchResult> r = RunGpuCodecBench(mb * kMiB);
      if (!r.ok()) {
        std::fprintf(stderr, "GPU bench: %s\n", r.status().ToString().c_str());
        return 1;
      }
      gpu.push_back(*r);
    }
    absl::StatusOr<GpuCodecBenchResult> r = RunGpuCodecBench(100 * kMiB);
    if (!r.ok()) {
      std::fprintf(stderr, "GPU bench: %s\n", r.status().ToString().c_str());
      return 1;
    }
    transfer = *r;
  }

  if (json) {
    std::printf("{\n  \"threshold\": %g,\n  \"cpu\": [\n", kThreshold);
    for (size_t i = 0; i < cpu.size(); ++i) {
      const CpuRow& c = cpu[i];
      std::printf(
          "    {\"mib\": %zu, \"memcpy_gbps\": %.3f, \"quantize_gbps\": %.3f, "
          "\"quantize_vs_memcpy\": %.3f, \"dequantize_gbps\": %.3f, "
          "\"dequantize_vs_memcpy\": %.3f, \"dequantize_add_gbps\": %.3f, "
          "\"dequantize_add_vs_memcpy\": %.3f}%s\n",
          c.bytes / kMiB, c.memcpy_gbps, c.quantize_gbps,
          c.quantize_gbps / c.memcpy_gbps, c.dequantize_gbps,
          c.dequantize_gbps / c.memcpy_gbps, c.dequantize_add_gbps,
          c.dequantize_add_gbps / c.memcpy_gbps, i + 1 < cpu.size() ? "," : "");
    }
    std::printf("  ],\n  \"gpu\": [\n");
    for (size_t i = 0; i < gpu.size(); ++i) {
      const GpuCodecBenchResult& g = gpu[i];
      std::printf(
          "    {\"mib\": %zu, \"d2d_memcpy_gbps\": %.1f, \"quantize_gbps\": "
          "%.1f, "
          "\"quantize_vs_memcpy\": %.3f, \"quantize_bandwidth_fraction\": "
          "%.3f, "
          "\"dequantize_gbps\": %.1f, \"dequantize_vs_memcpy\": %.3f}%s\n",
          g.bytes / kMiB, g.d2d_memcpy_gbps, g.quantize_gbps,
          g.quantize_gbps / g.d2d_memcpy_gbps,
          g.quantize_gbps * kQuantizeTraffic /
              (g.d2d_memcpy_gbps * kCopyTraffic),
          g.dequantize_gbps, g.dequantize_gbps / g.d2d_memcpy_gbps,
          i + 1 < gpu.size() ? "," : "");
    }
    std::printf("  ]");
    if (!gpu.empty()) {
      std::printf(
          ",\n  \"gpu_device\": \"%s\",\n  \"gpu_to_host_100mib\": "
          "{\"float_d2h_ms\": %.3f, \"quantize_then_d2h_ms\": %.3f, "
          "\"speedup\": %.2f}",
          transfer.device_name.c_str(), transfer.d2h_float_ms,
          transfer.d2h_compressed_ms,
          transfer.d2h_float_ms / transfer.d2h_compressed_ms);
    } else {
      std::printf(",\n  \"gpu_note\": \"%s\"", gpu_note.c_str());
    }
    std::printf("\n}\n");
    return 0;
  }

  std::printf(
      "2-bit codec, CPU, one thread, threshold %g (GB/s of float data)\n",
      kThreshold);
  std::printf("%8s %9s %9s %6s %9s %6s %9s %6s\n", "MiB", "memcpy", "quantize",
              "ratio", "dequant", "ratio", "deq-add", "ratio");
  for (const CpuRow& c : cpu) {
    std::printf("%8zu %9.2f %9.2f %6.2f %9.2f %6.2f %9.2f %6.2f\n",
                c.bytes / kMiB, c.memcpy_gbps, c.quantize_gbps,
                c.quantize_gbps / c.memcpy_gbps, c.dequantize_gbps,
                c.dequantize_gbps / c.memcpy_gbps, c.dequantize_add_gbps,
                c.dequantize_add_gbps / c.memcpy_gbps);
  }
  if (gpu.empty()) {
    std::printf("GPU: skipped (%s)\n", gpu_note.c_str());
    return 0;
  }
  std::printf(
      "\n2-bit codec, GPU %s (GB/s of float data; 'bw' = share of the copy's "
      "memory bandwidth,\ncounting %.4g bytes moved per input byte for "
      "quantize "
      "and %.4g for the copy)\n",
      transfer.device_name.c_str(), kQuantizeTraffic, kCopyTraffic);
  std::printf("%8s %9s %9s %6s %6s %9s %6s\n", "MiB", "d2d-copy", "quantize",
              "ratio", "bw", "dequant", "ratio");
  for (const GpuCodecBenchResult& g : gpu) {
    std::printf(
        "%8zu %9.1f %9.1f %6.2f %6.2f %9.1f %6.2f\n", g.bytes / kMiB,
        g.d2d_memcpy_gbps, g.quantize_gbps, g.quantize_gbps / g.d2d_memcpy_gbps,
        g.quantize_gbps * kQuantizeTraffic / (g.d2d_memcpy_gbps * kCopyTraffic),
        g.dequantize_gbps, g.dequantize_gbps / g.d2d_memcpy_gbps);
  }
  std::printf(
      "\n100 MiB gradient, GPU to pinned host memory: D2H of floats %.3f ms, "
      "quantize on GPU + D2H of packed bytes %.3f ms (%.2fx)\n",
      transfer.d2h_float_ms, transfer.d2h_compressed_ms,
      transfer.d2h_float_ms / transfer.d2h_compressed_ms);
  return 0;
}

}  // namespace
}  // namespace tessera::compression

int main(int argc, char** argv) {
  return tessera::compression::Main(argc, argv);
}

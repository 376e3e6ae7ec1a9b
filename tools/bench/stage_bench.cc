// stage_bench: what each stage of a round costs one core per byte, beside
// memcpy in the same run (issue #27's per-stage table, docs/benchmarks.md).
//
//   stage_bench [--mb=64] [--row-length=1024] [--reps=5] [--workers=2]
//
// Every stage runs on --mb MiB of float32 values (rows of --row-length for the
// row stages, drawn at random from a matrix 20 times that size, as the seed
// model's 5% of rows are) and prints GB/s of float32 values handled (the
// values a payload stands for, for 2-bit stages), the median of --reps, and
// its ratio to memcpy's GB/s:
//
//   memcpy       one copy of the values into memory already touched
//   gather       the rows copied out of the matrix into one buffer (a pull's
//                reply on the server, a row push's frame on a worker)
//   scatter      the rows copied from one buffer into the matrix (a row pull's
//                reply into the caller's array)
//   encode       TwoBitQuantize with error feedback (a worker's 2-bit push)
//   decode-add   TwoBitDequantizeAdd (a worker applying a compressed pull)
//   sum floats   ExactSum: --workers float32 pushes added, then Finish
//   sum 2-bit    ExactSum: --workers 2-bit pushes added, then Finish
//   sum rows     RowRound: --workers pushes of the same rows, then Finish
//   update sgd   the optimizer (sgd lr=0.01) on the values
//   shadow       PullShadow::CatchUp: one compressed pull version (change,
//                threshold, code, shadow update)
//
// Sealing and opening (the record layer) are measured by seal_bench.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/buffer.h"
#include "common/compression/two_bit.h"
#include "proto/tessera.pb.h"
#include "server/exact_sum.h"
#include "server/optimizer.h"
#include "server/pull_shadow.h"
#include "server/round_engine.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double MedianSeconds(int reps, F&& f) {
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    f();
    s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

bool Flag(const std::string& arg, const char* name, int64_t* out) {
  const std::string prefix = std::string("--") + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  return absl::SimpleAtoi(arg.substr(prefix.size()), out) && *out > 0;
}

int Main(int argc, char** argv) {
  int64_t mb = 64, row_length = 1024, reps = 5, workers = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!Flag(a, "mb", &mb) && !Flag(a, "row-length", &row_length) &&
        !Flag(a, "reps", &reps) && !Flag(a, "workers", &workers)) {
      std::fprintf(stderr,
                   "usage: %s [--mb=64] [--row-length=1024] [--reps=5] "
                   "[--workers=2]\n  bad argument '%s'\n",
                   argv[0], a.c_str());
      return 2;
    }
  }
  const size_t n = static_cast<size_t>(mb) << 18;  // floats
  const size_t l = static_cast<size_t>(row_length);
  const size_t rows = std::max<size_t>(1, n / l);
  const size_t values = rows * l;
  const double bytes = static_cast<double>(values) * sizeof(float);

  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> grad(values), out(values), residual(values, 0.0f);
  for (float& g : grad) g = u(rng);
  std::memcpy(out.data(), grad.data(), values * sizeof(float));
  // The matrix the rows come from: 20x the rows, ids sorted as a batch's.
  const size_t matrix_rows = rows * 20;
  std::vector<float> matrix(matrix_rows * l, 0.5f);
  std::vector<uint64_t> ids(rows);
  {
    std::vector<uint64_t> all(matrix_rows);
    for (size_t i = 0; i < matrix_rows; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + rows, ids.begin());
    std::sort(ids.begin(), ids.end());
  }
  std::vector<uint8_t> packed(compression::TwoBitCompressedBytes(values));
  std::vector<std::vector<uint8_t>> pushes(workers, packed);
  for (auto& p : pushes) {
    std::vector<float> r(values, 0.0f);
    (void)compression::TwoBitQuantize(grad.data(), r.data(), values, 0.5f,
                                      p.data());
  }

  struct Row {
    const char* stage;
    double gbps;
  };
  std::vector<Row> table;
  auto run = [&](const char* stage, double stage_bytes, auto&& f) {
    f();  // warm: first touches and allocations out of the timing
    table.push_back({stage, stage_bytes / MedianSeconds(reps, f) / 1e9});
  };

  run("memcpy", bytes,
      [&] { std::memcpy(out.data(), grad.data(), values * sizeof(float)); });
  run("gather", bytes, [&] {
    for (size_t k = 0; k < rows; ++k)
      std::memcpy(out.data() + k * l, matrix.data() + ids[k] * l,
                  l * sizeof(float));
  });
  run("scatter", bytes, [&] {
    for (size_t k = 0; k < rows; ++k)
      std::memcpy(matrix.data() + ids[k] * l, out.data() + k * l,
                  l * sizeof(float));
  });
  run("encode", bytes, [&] {
    (void)compression::TwoBitQuantize(grad.data(), residual.data(), values,
                                      0.5f, packed.data());
  });
  run("decode-add", bytes, [&] {
    (void)compression::TwoBitDequantizeAdd(packed.data(), packed.size(), values,
                                           0.5f, out.data());
  });
  ExactSum sum(values);
  run("sum floats", bytes * workers, [&] {
    for (int64_t w = 0; w < workers; ++w) sum.AddFloats(grad.data());
    (void)sum.Finish();
  });
  run("sum 2-bit", bytes * workers, [&] {
    for (int64_t w = 0; w < workers; ++w)
      (void)sum.AddTwoBit(pushes[w].data(), pushes[w].size(), 0.5f);
    (void)sum.Finish();
  });
  RowRound round(static_cast<int>(workers), l);
  const wire::Header request;
  run("sum rows", bytes * workers, [&] {
    for (int64_t w = 0; w < workers; ++w)
      round.Add(static_cast<int>(w), ids.data(), rows, grad.data(), request);
    (void)round.Finish();
    (void)round.TakeRequests();
  });
  std::unique_ptr<Optimizer> sgd = *Optimizer::Create("sgd lr=0.01");
  run("update sgd", bytes,
      [&] { sgd->Update(out.data(), grad.data(), values, nullptr, 1); });
  Buffer weights = Buffer::CopyOf(grad.data(), values * sizeof(float));
  PullShadow shadow(weights, 1);
  run("shadow", bytes, [&] {
    float* w = weights.mutable_floats();
    for (size_t i = 0; i < values; i += 64) w[i] += 0.25f;
    shadow.MarkChanged();
    shadow.CatchUp(weights);
  });

  std::printf(
      "stages, one thread, %zu MiB of float32 values (%zu rows of %zu "
      "for the row stages), median of %d\n",
      static_cast<size_t>(mb), rows, l, static_cast<int>(reps));
  std::printf("%-12s %9s %7s\n", "stage", "GB/s", "x memcpy");
  const double base = table[0].gbps;
  for (const Row& r : table)
    std::printf("%-12s %9.2f %7.2f\n", r.stage, r.gbps, r.gbps / base);
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) { return tessera::bench::Main(argc, argv); }

// hashed_bench: what a hashed row key's table (server/hashed_table.h) costs a
// server against its population, beside memcpy of the same rows in the same
// run (issue #29).
//
//   hashed_bench [--populations=100000,1000000,10000000] [--dim=16]
//                [--batch=10000] [--rounds=20]
//
// For each population P it fills a table (capacity P, SGD) with P rows, then
// times, median of --rounds:
//   push    one round of --batch distinct ids, 90% of them rows it holds (drawn
//           uniformly) and 10% new (each evicting the least recently pushed
//           row): rows per second through ApplyRound (admission, LRU, update)
//   pull    Read of --batch ids it holds: rows per second
//   memcpy  the same rows copied from a P-row array at random (the baseline)
// and reports the table's bytes per row beside the row's float bytes, then
// the time of an eviction sweep: with expire_after set so that a tenth of the
// rows expire at once, the round that evicts them (ns per evicted row).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/hashed_spec.h"
#include "server/hashed_table.h"
#include "server/optimizer.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

uint64_t IdOf(uint64_t i) { return (i * 0x9e3779b97f4a7c15ULL) ^ 0x5bd1e995u; }

int Main(int argc, char** argv) {
  std::vector<uint64_t> populations = {100000, 1000000, 10000000};
  uint64_t dim = 16, batch = 10000, rounds = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool ok = true;
    if (a.rfind("--populations=", 0) == 0) {
      populations.clear();
      for (absl::string_view p : absl::StrSplit(a.substr(14), ',')) {
        uint64_t v = 0;
        ok &= absl::SimpleAtoi(p, &v) && v > 0;
        populations.push_back(v);
      }
    } else if (a.rfind("--dim=", 0) == 0) {
      ok = absl::SimpleAtoi(a.substr(6), &dim) && dim > 0;
    } else if (a.rfind("--batch=", 0) == 0) {
      ok = absl::SimpleAtoi(a.substr(8), &batch) && batch > 0;
    } else if (a.rfind("--rounds=", 0) == 0) {
      ok = absl::SimpleAtoi(a.substr(9), &rounds) && rounds > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: %s [--populations=N,...] [--dim=16] [--batch=10000] "
                   "[--rounds=20]\n  bad argument '%s'\n",
                   argv[0], a.c_str());
      return 2;
    }
  }
  std::unique_ptr<Optimizer> sgd = *Optimizer::Create("sgd lr=0.01");
  std::printf(
      "hashed key table, dim %lu (%lu B of floats a row), batch %lu, "
      "median of %lu rounds\n",
      static_cast<unsigned long>(dim), static_cast<unsigned long>(dim * 4),
      static_cast<unsigned long>(batch), static_cast<unsigned long>(rounds));
  std::printf("%12s %10s %12s %12s %12s %10s %10s %12s\n", "population",
              "fill s", "push rows/s", "pull rows/s", "memcpy rows/s", "B/row",
              "x floats", "sweep ns/row");
  std::mt19937_64 rng(7);
  for (const uint64_t P : populations) {
    HashedSpec spec;
    spec.capacity = P;
    HashedTable t(dim, spec);
    std::vector<float> grad(batch * dim, 0.01f);
    auto grads = [&](size_t i) { return grad.data() + i * dim; };
    // Fill: P new ids in rounds of up to 1M.
    const auto fill_start = Clock::now();
    std::vector<uint64_t> ids;
    for (uint64_t done = 0; done < P;) {
      const uint64_t n = std::min<uint64_t>(P - done, 1000000);
      ids.resize(n);
      for (uint64_t k = 0; k < n; ++k) ids[k] = IdOf(done + k);
      std::vector<float> fill_grad(n * dim, 0.01f);
      t.ApplyRound(
          ids, std::vector<uint32_t>(n, 1),
          [&](size_t i) { return fill_grad.data() + i * dim; }, sgd.get(),
          t.round() + 1);
      done += n;
    }
    const double fill_s = Seconds(fill_start);
    uint64_t next_new = P;
    std::vector<double> push_rate, pull_rate, copy_rate;
    std::vector<float> out(batch * dim);
    std::vector<float> flat(std::min<uint64_t>(P, 20000000) * dim, 1.0f);
    for (uint64_t r = 0; r < rounds; ++r) {
      // 90% held ids (uniform among the first P: some were evicted by the
      // new ids of earlier rounds, which then count as new), 10% new.
      ids.resize(batch);
      for (uint64_t k = 0; k < batch; ++k)
        ids[k] = k % 10 == 9 ? IdOf(next_new++) : IdOf(rng() % P);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      auto start = Clock::now();
      t.ApplyRound(ids, std::vector<uint32_t>(ids.size(), 1), grads, sgd.get(),
                   t.round() + 1);
      push_rate.push_back(ids.size() / Seconds(start));
      start = Clock::now();
      for (uint64_t k = 0; k < ids.size(); ++k)
        t.Read(ids[k], out.data() + k * dim);
      pull_rate.push_back(ids.size() / Seconds(start));
      start = Clock::now();
      for (uint64_t k = 0; k < ids.size(); ++k) {
        const uint64_t at = (ids[k] % (flat.size() / dim)) * dim;
        std::memcpy(out.data() + k * dim, flat.data() + at,
                    dim * sizeof(float));
      }
      copy_rate.push_back(ids.size() / Seconds(start));
    }
    const double bytes_per_row = static_cast<double>(t.bytes()) / t.rows();
    // The sweep: a table whose rows all date from round 1, then expire.
    double sweep_ns = 0;
    {
      HashedSpec s2;
      s2.expire_after = 2;
      HashedTable e(dim, s2);
      const uint64_t n = std::max<uint64_t>(1, P / 10);
      std::vector<uint64_t> old(n);
      for (uint64_t k = 0; k < n; ++k) old[k] = IdOf(k);
      std::vector<float> g(n * dim, 0.01f);
      e.ApplyRound(
          old, std::vector<uint32_t>(n, 1),
          [&](size_t i) { return g.data() + i * dim; }, nullptr, 1);
      const std::vector<uint64_t> none;
      e.ApplyRound(none, {}, grads, nullptr, 2);  // round 2: nothing expires
      const auto start = Clock::now();
      e.ApplyRound(none, {}, grads, nullptr, 3);  // round 3: all n expire
      sweep_ns = Seconds(start) * 1e9 / n;
      if (e.rows() != 0)
        std::fprintf(stderr, "sweep left %lu rows\n",
                     static_cast<unsigned long>(e.rows()));
    }
    std::printf("%12lu %10.2f %12.0f %12.0f %12.0f %10.1f %10.2f %12.1f\n",
                static_cast<unsigned long>(P), fill_s, Median(push_rate),
                Median(pull_rate), Median(copy_rate), bytes_per_row,
                bytes_per_row / (dim * 4.0), sweep_ns);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) { return tessera::bench::Main(argc, argv); }

// A worker for the metrics and trace tests (metrics_test.py): a fixed,
// countable amount of work, then the servers' KV_STATS written down, then it
// waits (with the job alive) until the test has scraped every process.
//
//   metrics_worker DIR ROUNDS
//
// Keys: 0 (100 values), 1 (1000), 2 (300), 3 (4000; split over the servers
// when TESSERA_BIGARRAY_BOUND <= 4000). After init every worker pulls every
// key once; then each round pushes keys 0, 1, 3, pushpulls key 2 and pulls
// keys 0, 1, 3. dist_sync, "sgd lr=0.01".
//
// Then: a barrier; rank 0 writes DIR/kv_stats.json (each server's KV_STATS,
// by server rank); every worker writes DIR/worker-RANK.json (its stats and
// metrics port) and DIR/ready-RANK, waits (at most 120 s) for DIR/go, and
// closes. Exit 0, or 1 with a message on stderr.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/options.h"
#include "worker/client/kv_client.h"

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::cerr << "metrics_worker: " << what << ": " << s << std::endl;
  return 1;
}

bool WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  out << text;
  out.close();
  return out && std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 0;
  if (argc != 3 || !absl::SimpleAtoi(argv[2], &rounds) || rounds < 1) {
    std::cerr << "usage: metrics_worker DIR ROUNDS\n";
    return 2;
  }
  const std::string dir = argv[1];
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::StatusOr<tessera::Options> options =
      tessera::Options::FromEnvironment();
  if (!options.ok()) return Fail("options", options.status());
  absl::StatusOr<std::unique_ptr<tessera::KVClient>> made =
      tessera::KVClient::Create(*options, /*sync=*/true);
  if (!made.ok()) return Fail("create", made.status());
  tessera::KVClient& kv = **made;
  const int rank = kv.rank();

  const std::map<uint64_t, size_t> lengths = {
      {0, 100}, {1, 1000}, {2, 300}, {3, 4000}};
  std::map<uint64_t, std::vector<float>> values, grads;
  for (const auto& [key, n] : lengths) {
    values[key].assign(n, 1.0f);
    grads[key].assign(n, 0.5f + rank);
  }
  if (absl::Status s = kv.SetOptimizer("sgd lr=0.01"); !s.ok())
    return Fail("set_optimizer", s);
  for (auto& [key, v] : values) {
    if (absl::Status s = kv.Init(key, v); !s.ok()) return Fail("init", s);
  }
  for (auto& [key, v] : values) {
    if (absl::Status s = kv.Pull(key, absl::MakeSpan(v)); !s.ok())
      return Fail("pull", s);
  }
  for (int r = 0; r < rounds; ++r) {
    std::vector<tessera::OpHandle> ops;
    for (uint64_t key : {0, 1, 3}) {
      absl::StatusOr<tessera::OpHandle> op = kv.PushAsync(key, grads[key]);
      if (!op.ok()) return Fail("push", op.status());
      ops.push_back(*op);
    }
    absl::StatusOr<tessera::OpHandle> pp =
        kv.PushPullAsync(2, grads[2], absl::MakeSpan(values[2]));
    if (!pp.ok()) return Fail("pushpull", pp.status());
    ops.push_back(*pp);
    for (tessera::OpHandle op : ops) {
      if (absl::Status s = kv.Wait(op); !s.ok()) return Fail("wait", s);
    }
    for (uint64_t key : {0, 1, 3}) {
      if (absl::Status s = kv.Pull(key, absl::MakeSpan(values[key])); !s.ok())
        return Fail("pull", s);
    }
  }
  if (absl::Status s = kv.Barrier(); !s.ok()) return Fail("barrier", s);
  if (rank == 0) {
    absl::StatusOr<std::vector<tessera::wire::KVStats>> stats =
        kv.ServerStats();
    if (!stats.ok()) return Fail("KV_STATS", stats.status());
    std::string json = "[";
    for (size_t s = 0; s < stats->size(); ++s) {
      const tessera::wire::KVStats& k = (*stats)[s];
      std::string per_key;
      const std::map<uint64_t, uint64_t> ordered(
          k.key_pushes_applied().begin(), k.key_pushes_applied().end());
      for (const auto& [key, n] : ordered) {
        absl::StrAppend(&per_key, per_key.empty() ? "" : ", ", "\"", key,
                        "\": ", n);
      }
      absl::StrAppend(
          &json, s == 0 ? "" : ",\n ", "{\"server\": ", s,
          ", \"pushes_applied\": ", k.pushes_applied(),
          ", \"rounds_applied\": ", k.rounds_applied(),
          ", \"duplicates\": ", k.duplicates(),
          ", \"errors_returned\": ", k.errors_returned(),
          ", \"malformed_messages\": ", k.malformed_messages(),
          ", \"checkpoints_written\": ", k.checkpoints_written(),
          ", \"refused\": ", k.refused(), ", \"key_pushes_applied\": {",
          per_key, "}}");
    }
    json += "]\n";
    if (!WriteFile(dir + "/kv_stats.json", json)) {
      std::cerr << "metrics_worker: cannot write " << dir << "/kv_stats.json\n";
      return 1;
    }
  }
  const tessera::KVWorkerStats st = kv.stats();
  const std::string mine = absl::StrCat(
      "{\"rank\": ", rank, ", \"pushes\": ", st.pushes,
      ", \"pulls\": ", st.pulls, ", \"bytes_pushed\": ", st.bytes_pushed,
      ", \"bytes_pulled\": ", st.bytes_pulled, ", \"resends\": ", st.resends,
      ", \"metrics_port\": ", kv.metrics_port(), "}\n");
  const std::string ready = absl::StrCat(dir, "/ready-", rank);
  if (!WriteFile(absl::StrCat(dir, "/worker-", rank, ".json"), mine) ||
      !WriteFile(ready, "")) {
    std::cerr << "metrics_worker: cannot write to " << dir << "\n";
    return 1;
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  const std::string go = dir + "/go";
  while (access(go.c_str(), F_OK) != 0) {
    if (absl::Now() > deadline) {
      std::cerr << "metrics_worker: no " << go << " within 120 s\n";
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (absl::Status s = kv.Close(); !s.ok()) return Fail("close", s);
  std::printf("metrics_worker %d: done\n", rank);
  return 0;
}

// tessera-bench: throughput and latency of push, pull and pushpull on a real
// Tessera job on this machine, next to a raw ZeroMQ transfer and memcpy
// measured in the same run.
//
//   tessera-bench                       # full run: 4K..64M, 1x1 and 2x2, table
//   tessera-bench --quick --json        # a short run, JSON on stdout
//   tessera-bench --sizes=1M --jobs=1x1:none --seconds=1
//
// The parent process starts tessera-scheduler and tessera-server (found next to
// this binary in the build tree, through --scheduler-binary / --server-binary,
// or on PATH) and re-executes itself as each worker (--worker); workers print
// BENCH lines on stdout. Throughput counts float-value bytes per direction
// (GB/s = 1e9 B/s); a 2x2 job's figure is the sum over its workers. Latency is
// that of a blocking operation on worker 0. Exit code 0 on success, 1 when a
// process of a job failed, 2 on bad flags. Jobs run with fresh job keys
// (sealed, as tools/launch.py starts them); --security=none,sealed,auth runs
// each job once per setting, in that order, to measure what security costs.
#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/curve_keys.h"
#include "tools/bench/bench_util.h"
#include "tools/bench/bench_worker.h"
#include "tools/bench/raw_zmq.h"

namespace tessera::bench {
namespace {

constexpr char kUsage[] = R"(usage: tessera-bench [flags]
  --sizes=4K,64K,1M,16M,64M   value sizes (bytes of float32 per key)
  --jobs=1x1:none,2x2:none,1x1:sgd
                              jobs as SERVERSxWORKERS:OPTIMIZER; optimizer none or sgd
                              (sgd means "sgd lr=0.1")
  --ops=push,pull,pullview,pushpull
                              operations to time (pullview: PullView, the pull
                              that lends the received frame instead of copying it)
  --inflight=1,4,8            outstanding requests per worker (latency from 1)
  --seconds=0.5               target time per measurement
  --quick                     --sizes=4K,1M --jobs=1x1:none --seconds=0.2
  --security=sealed           how the job's connections are secured, one job run per
                              setting listed: sealed (the default: authenticated,
                              sealed links, docs/security.md; "curve" is its old
                              name), auth (TESSERA_AUTH_ONLY=1: authenticated, not
                              encrypted), none (TESSERA_INSECURE=1)
  --raw-curve                 the raw ZeroMQ baseline with CURVE encryption on its
                              sockets (what ZeroMQ's encryption costs by itself)
  --json                      print JSON on stdout instead of the table
  --ack-cost                  also time raw ZeroMQ transfers answered by a 16-byte ack
                              each (what a push's acknowledgement costs at the transport)
  --scheduler-binary=PATH, --server-binary=PATH
  --log-dir=DIR               where child logs go (default: a fresh /tmp directory)
)";

struct Flags {
  std::vector<size_t> sizes;
  std::vector<std::string> jobs = {"1x1:none", "2x2:none", "1x1:sgd"};
  std::vector<std::string> ops = {"push", "pull", "pullview", "pushpull"};
  std::vector<int> inflight = {1, 4, 8};
  std::vector<std::string> security = {"sealed"};
  std::string key_dir;  // the jobs' keys (made in log_dir)
  double seconds = 0.5;
  bool json = false;
  bool ack_cost = false;
  bool raw_curve = false;
  std::string scheduler_binary;
  std::string server_binary;
  std::string log_dir;
};

struct JobSpec {
  int servers = 1;
  int workers = 1;
  std::string optimizer_name = "none";
  std::string optimizer_spec = "none";
  std::string security = "sealed";  // sealed, auth or none
};

struct Row {
  std::string op;
  size_t size = 0;
  int inflight = 1;
  double gbps = 0;  // summed over workers
  double p50_us = 0;
  double p99_us = 0;
};

struct JobResult {
  JobSpec spec;
  std::vector<Row> rows;
};

absl::StatusOr<JobSpec> ParseJob(const std::string& text) {
  JobSpec j;
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  std::vector<std::string> sw = absl::StrSplit(parts[0], 'x');
  if (parts.size() > 2 || sw.size() != 2 ||
      !absl::SimpleAtoi(sw[0], &j.servers) ||
      !absl::SimpleAtoi(sw[1], &j.workers) || j.servers < 1 || j.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--jobs item '", text,
                     "': expected SERVERSxWORKERS[:none|sgd], e.g. 2x2:none"));
  }
  if (parts.size() == 2) j.optimizer_name = parts[1];
  if (j.optimizer_name == "none") {
    j.optimizer_spec = "none";
  } else if (j.optimizer_name == "sgd") {
    j.optimizer_spec = "sgd lr=0.1";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--jobs item '", text, "': optimizer must be none or sgd"));
  }
  return j;
}

std::string JobName(const JobSpec& j) {
  return absl::StrCat(j.servers, " server", j.servers > 1 ? "s" : "", " / ",
                      j.workers, " worker", j.workers > 1 ? "s" : "",
                      ", dist_sync, optimizer ", j.optimizer_spec,
                      ", security ", j.security);
}

absl::StatusOr<std::vector<size_t>> ParseSizes(const std::string& text) {
  std::vector<size_t> sizes;
  for (const std::string& s : SplitList(text)) {
    absl::StatusOr<size_t> n = ParseSize(s);
    if (!n.ok()) return n.status();
    sizes.push_back(*n);
  }
  if (sizes.empty()) return absl::InvalidArgumentError("--sizes: empty list");
  return sizes;
}

absl::StatusOr<std::vector<int>> ParseInts(const std::string& name,
                                           const std::string& text) {
  std::vector<int> out;
  for (const std::string& s : SplitList(text)) {
    int v = 0;
    if (!absl::SimpleAtoi(s, &v) || v < 1 || v > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "='", text, "': expected numbers 1..16"));
    }
    out.push_back(v);
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": empty list"));
  return out;
}

// ---- Worker mode
// -------------------------------------------------------------------

int WorkerMain(const std::vector<std::string>& args) {
  WorkerPlan plan;
  for (const std::string& a : args) {
    std::string v;
    if (TakeFlag(a, "sizes", &v)) {
      absl::StatusOr<std::vector<size_t>> s = ParseSizes(v);
      if (!s.ok()) return 2;
      plan.sizes = *s;
    } else if (TakeFlag(a, "iters", &v)) {
      for (const std::string& n : SplitList(v))
        plan.iterations.push_back(std::atoi(n.c_str()));
    } else if (TakeFlag(a, "ops", &v)) {
      plan.ops = SplitList(v);
    } else if (TakeFlag(a, "inflight", &v)) {
      absl::StatusOr<std::vector<int>> n = ParseInts("inflight", v);
      if (!n.ok()) return 2;
      plan.inflight = *n;
    } else if (TakeFlag(a, "optimizer", &v)) {
      plan.optimizer = v;
    }
  }
  if (plan.sizes.empty() || plan.iterations.size() != plan.sizes.size()) {
    std::cerr << "tessera-bench --worker: --sizes and --iters must name the "
                 "same sizes\n";
    return 2;
  }
  return RunBenchWorker(plan);
}

// ---- Parent: jobs
// --------------------------------------------------------------------

struct Binaries {
  std::string self, scheduler, server;
};

std::string Tail(const std::string& path, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  std::string all;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) all.append(buf, n);
  std::fclose(f);
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

absl::StatusOr<JobResult> RunJob(const Flags& flags, const Binaries& bin,
                                 const JobSpec& spec,
                                 const std::vector<RawZmqFigures>& raw,
                                 int job_index) {
  // Iterations per size: enough for about --seconds at raw ZeroMQ speed, shared
  // by the workers; every worker runs the same counts (dist_sync rounds need
  // it).
  std::vector<int> iterations;
  for (size_t i = 0; i < flags.sizes.size(); ++i) {
    const double per_op = static_cast<double>(flags.sizes[i]) * spec.workers /
                              (raw[i].gbps * 1e9) +
                          raw[0].rtt.p50_us * 1e-6;
    iterations.push_back(
        static_cast<int>(std::clamp(flags.seconds / per_op, 5.0, 100000.0)));
  }
  const int port = FreeLoopbackPort();
  std::map<std::string, std::string> env = {
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", std::to_string(port)},
      {"DMLC_NUM_SERVER", std::to_string(spec.servers)},
      {"DMLC_NUM_WORKER", std::to_string(spec.workers)},
      {"TESSERA_INSECURE", spec.security == "none" ? "1" : "0"},
      {"TESSERA_AUTH_ONLY", spec.security == "auth" ? "1" : "0"},
      {"TESSERA_KEY_DIR", spec.security == "none" ? "" : flags.key_dir},
  };
  const std::string prefix =
      absl::StrCat(flags.log_dir, "/job", job_index, "-");
  std::vector<ChildProcess> daemons;
  std::vector<ChildProcess> workers;
  auto kill_all = [&]() {
    for (const ChildProcess& c : workers) KillProcess(c);
    for (const ChildProcess& c : daemons) KillProcess(c);
  };
  auto spawn = [&](const std::vector<std::string>& argv,
                   const std::string& role, const std::string& log,
                   bool capture) -> absl::Status {
    std::map<std::string, std::string> e = env;
    e["DMLC_ROLE"] = role;
    absl::StatusOr<ChildProcess> c =
        SpawnProcess(argv, e, capture, prefix + log);
    if (!c.ok()) return c.status();
    c->name = log;
    (capture ? workers : daemons).push_back(*c);
    return absl::OkStatus();
  };
  absl::Status s = spawn({bin.scheduler}, "scheduler", "scheduler.log", false);
  for (int i = 0; s.ok() && i < spec.servers; ++i) {
    s = spawn({bin.server}, "server", absl::StrCat("server", i, ".log"), false);
  }
  std::vector<std::string> size_list, iter_list;
  for (size_t i = 0; i < flags.sizes.size(); ++i) {
    size_list.push_back(std::to_string(flags.sizes[i]));
    iter_list.push_back(std::to_string(iterations[i]));
  }
  std::vector<std::string> inflight_list;
  for (int n : flags.inflight) inflight_list.push_back(std::to_string(n));
  const std::vector<std::string> worker_argv = {
      bin.self,
      "--worker",
      absl::StrCat("--sizes=", absl::StrJoin(size_list, ",")),
      absl::StrCat("--iters=", absl::StrJoin(iter_list, ",")),
      absl::StrCat("--ops=", absl::StrJoin(flags.ops, ",")),
      absl::StrCat("--inflight=", absl::StrJoin(inflight_list, ",")),
      absl::StrCat("--optimizer=", spec.optimizer_spec)};
  for (int i = 0; s.ok() && i < spec.workers; ++i) {
    s = spawn(worker_argv, "worker", absl::StrCat("worker", i, ".log"), true);
  }
  if (!s.ok()) {
    kill_all();
    return s;
  }

  // Collect BENCH lines until every worker closed its stdout.
  const size_t expected = flags.sizes.size() * flags.ops.size() *
                          flags.inflight.size() * spec.workers;
  const double budget =
      120 + 10 * static_cast<double>(expected) * flags.seconds;
  const double deadline = NowSeconds() + budget;
  std::vector<std::string> pending(workers.size());
  std::vector<bool> open(workers.size(), true);
  std::vector<WorkerSample> samples;
  while (std::count(open.begin(), open.end(), true) > 0 &&
         NowSeconds() < deadline) {
    std::vector<pollfd> fds;
    std::vector<size_t> index;
    for (size_t i = 0; i < workers.size(); ++i) {
      if (open[i]) {
        fds.push_back({workers[i].stdout_fd, POLLIN, 0});
        index.push_back(i);
      }
    }
    if (poll(fds.data(), fds.size(), 200) <= 0) continue;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const size_t i = index[k];
      char buf[4096];
      const ssize_t n = read(workers[i].stdout_fd, buf, sizeof(buf));
      if (n <= 0) {
        open[i] = false;
        close(workers[i].stdout_fd);
        continue;
      }
      pending[i].append(buf, n);
      size_t nl;
      while ((nl = pending[i].find('\n')) != std::string::npos) {
        WorkerSample sample;
        if (ParseSample(pending[i].substr(0, nl), &sample))
          samples.push_back(sample);
        pending[i].erase(0, nl + 1);
      }
    }
  }
  std::string failure;
  for (const ChildProcess& w : workers) {
    const int code =
        WaitProcess(w, absl::Seconds(NowSeconds() < deadline ? 30 : 0));
    if (code != 0) {
      absl::StrAppend(&failure, w.name, " exited with ", code, ":\n",
                      Tail(prefix + w.name, 2000), "\n");
    }
  }
  for (const ChildProcess& d : daemons) {
    const int code = WaitProcess(d, absl::Seconds(failure.empty() ? 20 : 1));
    if (code != 0 && failure.empty()) {
      absl::StrAppend(&failure, d.name, " exited with ", code, ":\n",
                      Tail(prefix + d.name, 2000), "\n");
    }
  }
  kill_all();
  if (!failure.empty()) {
    return absl::InternalError(
        absl::StrCat("job ", JobName(spec), " failed\n", failure));
  }

  JobResult result;
  result.spec = spec;
  for (size_t i = 0; i < flags.sizes.size(); ++i) {
    for (const std::string& op : flags.ops) {
      for (int inflight : flags.inflight) {
        Row row;
        row.op = op;
        row.size = flags.sizes[i];
        row.inflight = inflight;
        double bytes = 0, seconds = 0;
        int found = 0;
        for (const WorkerSample& w : samples) {
          if (w.op != op || w.size != row.size || w.inflight != inflight)
            continue;
          ++found;
          bytes += static_cast<double>(w.size) * w.iterations;
          seconds = std::max(seconds, w.seconds);
          if (w.rank == 0) {
            row.p50_us = w.p50_us;
            row.p99_us = w.p99_us;
          }
        }
        if (found != spec.workers) {
          return absl::InternalError(absl::StrCat(
              "job ", JobName(spec), ": ", found, " reports for ", op, " ",
              SizeName(row.size), " in-flight ", inflight));
        }
        row.gbps = bytes / seconds / 1e9;
        result.rows.push_back(row);
      }
    }
  }
  return result;
}

// ---- Report
// ------------------------------------------------------------------------

struct Target {
  std::string what;
  std::string rule;  // ">= 0.95x raw", "<= 1.20x raw rtt": "OP GOALx ..."
  double goal = 0;
  bool at_most = false;
  double value = 0;  // the ratio achieved
  bool have = false;
  std::string detail;
  bool met() const { return have && (at_most ? value <= goal : value >= goal); }
};

const RawZmqFigures* RawFor(const std::vector<RawZmqFigures>& raw,
                            size_t size) {
  for (const RawZmqFigures& r : raw) {
    if (r.size == size) return &r;
  }
  return nullptr;
}

const Row* FindRow(const JobResult& job, const std::string& op, size_t size,
                   int inflight) {
  for (const Row& r : job.rows) {
    if (r.op == op && r.size == size && r.inflight == inflight) return &r;
  }
  return nullptr;
}

const Row* BestRow(const JobResult& job, const std::string& op, size_t size) {
  const Row* best = nullptr;
  for (const Row& r : job.rows) {
    if (r.op == op && r.size == size &&
        (best == nullptr || r.gbps > best->gbps))
      best = &r;
  }
  return best;
}

std::vector<Target> Targets(const std::vector<JobResult>& jobs,
                            const std::vector<RawZmqFigures>& raw) {
  auto target = [](const char* what, const char* rule, double goal,
                   bool at_most) {
    Target t;
    t.what = what;
    t.rule = rule;
    t.goal = goal;
    t.at_most = at_most;
    return t;
  };
  // Issue #12: push and pull against the one-way raw stream; pushpull, which
  // moves every value both ways, against raw ZeroMQ streaming both ways at once
  // (on 2 cores the one-way figure is out of reach for it); the round trip of
  // a blocking 4 KB pushpull against the raw 4 KB round trip. The pull into
  // the caller's buffer copies each value once more than the raw receiver
  // does; PullView (the frame lent, as the raw receiver holds it) does not.
  std::vector<Target> t = {
      target("1 MB push", ">= 0.95x raw", 0.95, false),
      target("1 MB pull (into a buffer)", ">= 0.95x raw", 0.95, false),
      target("1 MB pushpull, per direction", ">= 0.90x raw two-way", 0.90,
             false),
      target("4 KB round trip p50 (pushpull)", "<= 1.20x raw rtt", 1.20, true),
      target("1 MB pull, lent (PullView)", ">= 0.95x raw", 0.95, false),
  };
  const JobResult* job = nullptr;
  for (const JobResult& j : jobs) {
    if (j.spec.servers == 1 && j.spec.workers == 1 &&
        j.spec.optimizer_name == "none") {
      job = &j;
      break;
    }
  }
  if (job == nullptr) return t;
  const size_t mb = 1 << 20;
  // Target index -> operation.
  const std::pair<int, const char*> ops[] = {
      {0, "push"}, {1, "pull"}, {2, "pushpull"}, {4, "pullview"}};
  for (const auto& [i, op] : ops) {
    const Row* r = BestRow(*job, op, mb);
    const RawZmqFigures* z = RawFor(raw, mb);
    if (r == nullptr || z == nullptr) continue;
    if (i != 2) {
      t[i].have = true;
      t[i].value = r->gbps / z->gbps;
      t[i].detail = absl::StrFormat("%.2f vs %.2f GB/s (in-flight %d)",
                                    r->gbps, z->gbps, r->inflight);
    } else if (z->two_way_gbps > 0) {
      t[i].have = true;
      t[i].value = r->gbps / z->two_way_gbps;
      t[i].detail = absl::StrFormat(
          "%.2f vs %.2f GB/s two-way (in-flight %d); one-way raw %.2f GB/s: "
          "%.2fx of it",
          r->gbps, z->two_way_gbps, r->inflight, z->gbps, r->gbps / z->gbps);
    }
  }
  const Row* r = FindRow(*job, "pushpull", 4096, 1);
  const RawZmqFigures* z = RawFor(raw, 4096);
  if (r != nullptr && z != nullptr) {
    t[3].have = true;
    t[3].value = r->p50_us / z->rtt.p50_us;
    t[3].detail = absl::StrFormat("%.0f vs %.0f us", r->p50_us, z->rtt.p50_us);
  }
  return t;
}

void PrintTable(const Flags& flags, const std::vector<RawZmqFigures>& raw,
                const std::vector<double>& memcpy_gbps,
                const std::vector<JobResult>& jobs,
                const std::vector<Target>& targets,
                const std::string& command) {
  std::printf(
      "tessera-bench: %ld cores, loopback; GB/s = 1e9 bytes of float values "
      "per second "
      "per direction\ncommand: %s\n\n",
      sysconf(_SC_NPROCESSORS_ONLN), command.c_str());
  std::printf(
      "Same-run baselines: raw ZeroMQ PUSH/PULL between two processes (header "
      "frame + "
      "zero-copy data frame%s), mean of a run before and one after the jobs; "
      "two-way: both directions at once, GB/s per direction; memcpy "
      "(one thread)\n",
      flags.raw_curve ? ", CURVE-encrypted" : "");
  std::printf("%-8s %12s %15s %14s %14s %14s %12s", "size", "zmq GB/s",
              "(before/after)", "2-way GB/s/dir", "zmq rtt p50us",
              "zmq rtt p99us", "memcpy GB/s");
  if (flags.ack_cost) std::printf(" %14s %14s", "acked GB/s", "acked p50us");
  std::printf("\n");
  for (size_t i = 0; i < raw.size(); ++i) {
    std::printf(
        "%-8s %12.2f %15s %14.2f %14.0f %14.0f %12.2f",
        SizeName(raw[i].size).c_str(), raw[i].gbps,
        absl::StrFormat("(%.2f/%.2f)", raw[i].gbps_before, raw[i].gbps_after)
            .c_str(),
        raw[i].two_way_gbps, raw[i].rtt.p50_us, raw[i].rtt.p99_us,
        memcpy_gbps[i]);
    if (flags.ack_cost)
      std::printf(" %14.2f %14.0f", raw[i].acked_gbps, raw[i].acked.p50_us);
    std::printf("\n");
  }
  for (const JobResult& job : jobs) {
    std::printf("\n%s\n", JobName(job.spec).c_str());
    std::printf("%-8s %-9s %9s %9s %9s %9s %9s %11s\n", "size", "op",
                "in-flight", "GB/s", "x zmq", "p50 us", "p99 us", "p50 x rtt");
    for (const Row& r : job.rows) {
      const RawZmqFigures* z = RawFor(raw, r.size);
      std::printf("%-8s %-9s %9d %9.2f %9.2f", SizeName(r.size).c_str(),
                  r.op.c_str(), r.inflight, r.gbps, z ? r.gbps / z->gbps : 0.0);
      if (r.inflight == 1) {
        std::printf(" %9.0f %9.0f %11.2f\n", r.p50_us, r.p99_us,
                    z ? r.p50_us / z->rtt.p50_us : 0.0);
      } else {
        std::printf(" %9s %9s %11s\n", "-", "-", "-");
      }
    }
  }
  std::printf(
      "\nTargets (1 server / 1 worker, optimizer none; throughput: best "
      "in-flight setting, against the one-way raw stream, pushpull against "
      "the two-way one; round trip: 1 in flight)\n");
  for (const Target& t : targets) {
    if (!t.have) {
      std::printf("  %-32s %-21s not measured in this run\n", t.what.c_str(),
                  t.rule.c_str());
      continue;
    }
    std::printf("  %-32s %-21s %5.2fx  %-8s %s\n", t.what.c_str(),
                t.rule.c_str(), t.value, t.met() ? "met" : "NOT MET",
                t.detail.c_str());
  }
}

void PrintJson(const Flags& flags, const std::vector<RawZmqFigures>& raw,
               const std::vector<double>& memcpy_gbps,
               const std::vector<JobResult>& jobs,
               const std::vector<Target>& targets, const std::string& command) {
  std::string j = absl::StrCat("{\"cores\":", sysconf(_SC_NPROCESSORS_ONLN),
                               ",\"command\":\"", command, "\",\"raw_curve\":",
                               flags.raw_curve ? "true" : "false",
                               ",\"baseline\":[");
  for (size_t i = 0; i < raw.size(); ++i) {
    absl::StrAppend(
        &j, i ? "," : "",
        absl::StrFormat(
            "{\"size\":%d,\"zmq_gbps\":%.4f,\"zmq_gbps_before\":%.4f,"
            "\"zmq_gbps_after\":%.4f,\"zmq_two_way_gbps\":%.4f,"
            "\"zmq_rtt_p50_us\":%.1f,\"zmq_rtt_p50_before_us\":%.1f,"
            "\"zmq_rtt_p50_after_us\":%.1f,"
            "\"zmq_rtt_p99_us\":%.1f,\"memcpy_gbps\":%.4f",
            raw[i].size, raw[i].gbps, raw[i].gbps_before, raw[i].gbps_after,
            raw[i].two_way_gbps, raw[i].rtt.p50_us, raw[i].rtt_p50_before_us,
            raw[i].rtt_p50_after_us, raw[i].rtt.p99_us, memcpy_gbps[i]));
    if (flags.ack_cost) {
      absl::StrAppend(
          &j,
          absl::StrFormat(",\"zmq_acked_gbps\":%.4f,\"zmq_acked_p50_us\":%.1f",
                          raw[i].acked_gbps, raw[i].acked.p50_us));
    }
    absl::StrAppend(&j, "}");
  }
  absl::StrAppend(&j, "],\"jobs\":[");
  for (size_t k = 0; k < jobs.size(); ++k) {
    const JobResult& job = jobs[k];
    absl::StrAppend(
        &j, k ? "," : "",
        absl::StrFormat("{\"servers\":%d,\"workers\":%d,\"optimizer\":\"%s\","
                        "\"security\":\"%s\",\"results\":[",
                        job.spec.servers, job.spec.workers,
                        job.spec.optimizer_spec, job.spec.security));
    for (size_t i = 0; i < job.rows.size(); ++i) {
      const Row& r = job.rows[i];
      const RawZmqFigures* z = RawFor(raw, r.size);
      absl::StrAppend(
          &j, i ? "," : "",
          absl::StrFormat(
              "{\"op\":\"%s\",\"size\":%d,\"inflight\":%d,\"gbps\":%.4f,"
              "\"ratio_to_zmq\":%.4f",
              r.op, r.size, r.inflight, r.gbps, z ? r.gbps / z->gbps : 0));
      if (r.inflight == 1) {
        absl::StrAppend(&j, absl::StrFormat(",\"p50_us\":%.1f,\"p99_us\":%.1f",
                                            r.p50_us, r.p99_us));
      }
      absl::StrAppend(&j, "}");
    }
    absl::StrAppend(&j, "]}");
  }
  absl::StrAppend(&j, "],\"targets\":[");
  for (size_t i = 0; i < targets.size(); ++i) {
    const Target& t = targets[i];
    absl::StrAppend(
        &j, i ? "," : "",
        absl::StrFormat("{\"what\":\"%s\",\"rule\":\"%s\",\"measured\":%s,"
                        "\"ratio\":%.4f,\"met\":%s}",
                        t.what, t.rule, t.have ? "true" : "false", t.value,
                        t.met() ? "true" : "false"));
  }
  absl::StrAppend(&j, "]}\n");
  std::fputs(j.c_str(), stdout);
}

int ParentMain(const std::vector<std::string>& args,
               const std::string& command) {
  Flags flags;
  std::string sizes = "4K,64K,1M,16M,64M";
  bool quick = false;
  bool jobs_set = false, sizes_set = false, seconds_set = false;
  for (const std::string& a : args) {
    std::string v;
    absl::Status bad;
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--json") {
      flags.json = true;
    } else if (a == "--raw-curve") {
      flags.raw_curve = true;
    } else if (a == "--ack-cost") {
      flags.ack_cost = true;
    } else if (TakeFlag(a, "sizes", &v)) {
      sizes = v;
      sizes_set = true;
    } else if (TakeFlag(a, "jobs", &v)) {
      flags.jobs = SplitList(v);
      jobs_set = true;
    } else if (TakeFlag(a, "ops", &v)) {
      flags.ops = SplitList(v);
      for (const std::string& op : flags.ops) {
        if (op != "push" && op != "pull" && op != "pullview" &&
            op != "pushpull") {
          bad = absl::InvalidArgumentError(absl::StrCat(
              "--ops='", v, "': expected push, pull, pullview and/or pushpull"));
        }
      }
    } else if (TakeFlag(a, "security", &v)) {
      flags.security = SplitList(v);
      for (std::string& m : flags.security) {
        if (m == "curve") m = "sealed";  // the default's old name
        if (m != "sealed" && m != "auth" && m != "none") {
          bad = absl::InvalidArgumentError(absl::StrCat(
              "--security='", v, "': expected sealed, auth and/or none"));
        }
      }
    } else if (TakeFlag(a, "inflight", &v)) {
      absl::StatusOr<std::vector<int>> n = ParseInts("inflight", v);
      if (n.ok())
        flags.inflight = *n;
      else
        bad = n.status();
    } else if (TakeFlag(a, "seconds", &v)) {
      if (!absl::SimpleAtod(v, &flags.seconds) ||
          !(flags.seconds > 0 && flags.seconds <= 60)) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("--seconds='", v, "': expected (0, 60]"));
      }
      seconds_set = true;
    } else if (TakeFlag(a, "scheduler-binary", &v)) {
      flags.scheduler_binary = v;
    } else if (TakeFlag(a, "server-binary", &v)) {
      flags.server_binary = v;
    } else if (TakeFlag(a, "log-dir", &v)) {
      flags.log_dir = v;
    } else {
      bad = absl::InvalidArgumentError(
          absl::StrCat("unknown argument '", a, "'"));
    }
    if (!bad.ok()) {
      std::cerr << "tessera-bench: " << bad.message() << "\n" << kUsage;
      return 2;
    }
  }
  if (quick) {
    if (!sizes_set) sizes = "4K,1M";
    if (!jobs_set) flags.jobs = {"1x1:none"};
    if (!seconds_set) flags.seconds = 0.2;
  }
  absl::StatusOr<std::vector<size_t>> parsed = ParseSizes(sizes);
  if (!parsed.ok()) {
    std::cerr << "tessera-bench: --sizes: " << parsed.status().message()
              << "\n";
    return 2;
  }
  flags.sizes = *parsed;
  std::vector<JobSpec> specs;
  for (const std::string& j : flags.jobs) {
    absl::StatusOr<JobSpec> spec = ParseJob(j);
    if (!spec.ok()) {
      std::cerr << "tessera-bench: " << spec.status().message() << "\n";
      return 2;
    }
    for (const std::string& mode : flags.security) {
      spec->security = mode;
      specs.push_back(*spec);
    }
  }

  Binaries bin;
  bin.self = SelfExecutable();
  const std::string dir = bin.self.substr(0, bin.self.rfind('/'));
  bin.scheduler = FindExecutable(
      {flags.scheduler_binary, dir + "/../../scheduler/tessera-scheduler",
       dir + "/tessera-scheduler"},
      "tessera-scheduler");
  bin.server =
      FindExecutable({flags.server_binary, dir + "/../../server/tessera-server",
                      dir + "/tessera-server"},
                     "tessera-server");
  if (!flags.scheduler_binary.empty() &&
      bin.scheduler != flags.scheduler_binary) {
    std::cerr << "tessera-bench: --scheduler-binary=" << flags.scheduler_binary
              << " is not an executable file\n";
    return 2;
  }
  if (!flags.server_binary.empty() && bin.server != flags.server_binary) {
    std::cerr << "tessera-bench: --server-binary=" << flags.server_binary
              << " is not an executable file\n";
    return 2;
  }
  if (bin.scheduler.empty() || bin.server.empty()) {
    std::cerr << "tessera-bench: cannot find tessera-scheduler / "
                 "tessera-server next to "
              << bin.self
              << " or on PATH; pass --scheduler-binary and --server-binary\n";
    return 2;
  }
  if (flags.log_dir.empty()) {
    char tmpl[] = "/tmp/tessera-bench-XXXXXX";
    const char* made = mkdtemp(tmpl);
    flags.log_dir = made ? made : "/tmp";
  }
  std::string key_dir = flags.log_dir + "/keys-XXXXXX";
  flags.key_dir = mkdtemp(key_dir.data()) != nullptr ? key_dir : "";
  absl::StatusOr<JobKeySet> keys = GenerateJobKeys();
  absl::Status keys_written =
      !keys.ok() ? keys.status()
      : flags.key_dir.empty()
          ? absl::UnavailableError(absl::StrCat("cannot create a folder in ",
                                                flags.log_dir))
          : WriteKeyFiles(*keys, flags.key_dir);
  if (!keys_written.ok()) {
    std::cerr << "tessera-bench: job keys: " << keys_written.message() << "\n";
    return 1;
  }

  RawZmqPlan plan;
  plan.self_exe = bin.self;
  plan.sizes = flags.sizes;
  plan.seconds = flags.seconds;
  plan.ack_cost = flags.ack_cost;
  plan.curve = flags.raw_curve;
  plan.log_path = flags.log_dir + "/raw-peer.log";
  std::vector<double> memcpy_gbps;
  for (size_t size : flags.sizes)
    memcpy_gbps.push_back(MeasureMemcpy(size, flags.seconds / 4));
  absl::StatusOr<std::vector<RawZmqFigures>> raw = MeasureRawZmq(plan);
  if (!raw.ok()) {
    std::cerr << "tessera-bench: raw ZeroMQ baseline: "
              << raw.status().message() << "\n";
    return 1;
  }
  std::vector<JobResult> jobs;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (!flags.json)
      std::fprintf(stderr, "running %s ...\n", JobName(specs[k]).c_str());
    absl::StatusOr<JobResult> job =
        RunJob(flags, bin, specs[k], *raw, static_cast<int>(k));
    if (!job.ok()) {
      std::cerr << "tessera-bench: " << job.status().message() << "\nlogs in "
                << flags.log_dir << "\n";
      return 1;
    }
    jobs.push_back(*job);
  }
  // The baseline is the mean of a run before and one after the jobs.
  absl::StatusOr<std::vector<RawZmqFigures>> raw_after = MeasureRawZmq(plan);
  if (!raw_after.ok()) {
    std::cerr << "tessera-bench: raw ZeroMQ baseline: "
              << raw_after.status().message() << "\n";
    return 1;
  }
  raw = CombineRuns(*raw, *raw_after);
  const std::vector<Target> targets = Targets(jobs, *raw);
  if (flags.json) {
    PrintJson(flags, *raw, memcpy_gbps, jobs, targets, command);
  } else {
    PrintTable(flags, *raw, memcpy_gbps, jobs, targets, command);
  }
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string command = "tessera-bench";
  for (const std::string& a : args) absl::StrAppend(&command, " ", a);
  for (const std::string& a : args) {
    std::string v;
    if (a == "--worker") return tessera::bench::WorkerMain(args);
    if (tessera::bench::TakeFlag(a, "raw-peer", &v)) {
      std::vector<std::string> ports = absl::StrSplit(v, ',');
      if (ports.size() != 2) return 2;
      return tessera::bench::RunRawZmqPeer(std::atoi(ports[0].c_str()),
                                           std::atoi(ports[1].c_str()));
    }
  }
  return tessera::bench::ParentMain(args, command);
}

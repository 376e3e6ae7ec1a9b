// tessera-sim: a simulated cluster in one process (issue #19). The real
// Scheduler, Node, KVServer and KVClient run on threads over the in-memory
// network (tests/support/memory_network.h), so a job of a thousand nodes or
// more forms, barriers, heart-beats, runs sync rounds and loses a node on one
// machine. Every message is encoded and decoded as on the wire; a counting
// layer under each transport tallies what is sent, by command, and what the
// scheduler receives.
//
//   tessera-sim --nodes=1000 [--server_percent=10] [--barriers=5]
//               [--idle_s=3] [--rounds=3] [--values=100] [--kv=true]
//               [--kill=true] [--heartbeat_timeout_s=3] [--scheduler_rt]
//
// --kv=false runs the control plane only (Node per process, no KVServer or
// KVClient): two threads per node instead of four, for 10,000 nodes. Prints
// one block of figures per phase and a one-line summary
//   SIM nodes=N servers=S workers=W form_s=... barrier_ms=... ...
// that the ctest (sim_test) checks. Exit 0 when every check passed (formed,
// rounds' exact sums, the killed node named by every survivor), 1 otherwise.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/node.h"
#include "common/options.h"
#include "scheduler/scheduler.h"
#include "server/kv_server.h"
#include "tests/support/memory_network.h"
#include "worker/client/kv_client.h"

ABSL_FLAG(int, nodes, 1000, "servers + workers (the scheduler is one more)");
ABSL_FLAG(int, server_percent, 10, "percent of the nodes that are servers");
ABSL_FLAG(int, barriers, 5, "worker barriers to time");
ABSL_FLAG(double, idle_s, 3, "seconds of idling to count heartbeats");
ABSL_FLAG(int, rounds, 3, "dist_sync rounds of push and pull (with --kv)");
ABSL_FLAG(int, values, 100, "floats in the round's key");
ABSL_FLAG(bool, kv, true, "run KVServer/KVClient (false: control plane only)");
ABSL_FLAG(bool, kill, true, "end with a worker's death and its detection");
ABSL_FLAG(double, heartbeat_interval_s, 1, "PS_HEARTBEAT_INTERVAL");
ABSL_FLAG(double, heartbeat_timeout_s, 3, "PS_HEARTBEAT_TIMEOUT");
ABSL_FLAG(bool, scheduler_rt, false,
          "run the scheduler's thread at real-time priority (SCHED_RR) where "
          "permitted: it then stands for a scheduler on a machine of its own, "
          "which the simulated nodes' threads cannot starve of CPU");

namespace tessera {
namespace {

constexpr int kCommands = 64;  // wire::Command values are below this

struct Counters {
  std::atomic<uint64_t> sent[kCommands] = {};
  std::atomic<uint64_t> sent_bytes{0};
  std::atomic<uint64_t> scheduler_received[kCommands] = {};

  uint64_t Sent(wire::Command c) const { return sent[c].load(); }
  uint64_t SentTotal() const {
    uint64_t n = 0;
    for (const auto& c : sent) n += c.load();
    return n;
  }
  uint64_t SchedulerReceived() const {
    uint64_t n = 0;
    for (const auto& c : scheduler_received) n += c.load();
    return n;
  }
};

// Counts every message sent through it (and, for the scheduler's, received).
class CountingTransport : public Transport {
 public:
  CountingTransport(std::unique_ptr<Transport> inner, Counters* counters,
                    bool scheduler)
      : inner_(std::move(inner)), counters_(counters), scheduler_(scheduler) {}
  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    return inner_->Bind(ip, port);
  }
  absl::Status Connect(int peer, const std::string& ip, int port) override {
    return inner_->Connect(peer, ip, port);
  }
  void Disconnect(int peer) override { inner_->Disconnect(peer); }
  absl::Status Send(int peer, const Message& msg) override {
    const int c = msg.header.command();
    if (c >= 0 && c < kCommands) ++counters_->sent[c];
    size_t bytes = msg.header.ByteSizeLong();
    for (const Buffer& b : msg.data) bytes += b.size();
    counters_->sent_bytes += bytes;
    return inner_->Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    absl::StatusOr<Message> msg = inner_->Receive(timeout);
    if (scheduler_ && msg.ok()) {
      const int c = msg->header.command();
      if (c >= 0 && c < kCommands) ++counters_->scheduler_received[c];
    }
    return msg;
  }
  uint64_t malformed_count() const override {
    return inner_->malformed_count();
  }
  void Close() override { inner_->Close(); }

 private:
  std::unique_ptr<Transport> inner_;
  Counters* counters_;
  const bool scheduler_;
};

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

struct Result {
  bool ok = true;
  std::vector<std::string> problems;
  void Fail(std::string why) {
    ok = false;
    if (problems.size() < 10) problems.push_back(std::move(why));
  }
};

int Run() {
  const int nodes = absl::GetFlag(FLAGS_nodes);
  const int servers =
      std::max(1, nodes * absl::GetFlag(FLAGS_server_percent) / 100);
  const int workers = nodes - servers;
  const bool kv = absl::GetFlag(FLAGS_kv);
  const bool kill = absl::GetFlag(FLAGS_kill);
  const int barriers = absl::GetFlag(FLAGS_barriers);
  const int rounds = kv ? absl::GetFlag(FLAGS_rounds) : 0;
  const int values = absl::GetFlag(FLAGS_values);
  const absl::Duration idle = absl::Seconds(absl::GetFlag(FLAGS_idle_s));
  if (workers < 2 || servers < 1) {
    std::fprintf(stderr, "tessera-sim: --nodes=%d: need 2 workers and a server\n",
                 nodes);
    return 2;
  }
  Options options;
  options.root_uri = "10.0.0.1";
  options.root_port = 9000;
  options.num_servers = servers;
  options.num_workers = workers;
  options.heartbeat_interval =
      absl::Seconds(absl::GetFlag(FLAGS_heartbeat_interval_s));
  options.heartbeat_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_heartbeat_timeout_s));
  options.start_timeout = absl::Seconds(600);
  options.request_timeout = absl::Seconds(600);
  options.resend_timeout = absl::Seconds(2);

  MemoryNetwork net;
  Counters counters;
  Result result;
  absl::Mutex result_mu;
  auto fail = [&](std::string why) {
    absl::MutexLock lock(&result_mu);
    result.Fail(std::move(why));
  };

  std::printf("tessera-sim: %d nodes (%d servers, %d workers) + scheduler, %s, "
              "heartbeat %gs / time-out %gs, %u hardware threads\n",
              nodes, servers, workers, kv ? "KVServer + KVClient" : "control plane only",
              absl::GetFlag(FLAGS_heartbeat_interval_s),
              absl::GetFlag(FLAGS_heartbeat_timeout_s),
              std::thread::hardware_concurrency());
  const absl::Time start = absl::Now();
  Options sched_options = options;
  sched_options.role = Role::kScheduler;
  Scheduler scheduler(sched_options,
                      std::make_unique<CountingTransport>(net.NewTransport(),
                                                          &counters, true));
  if (!scheduler.Bind().ok()) {
    std::fprintf(stderr, "tessera-sim: the scheduler cannot bind\n");
    return 1;
  }
  absl::Status scheduler_result;
  std::atomic<int> rt_error{-1};  // -1: not asked; 0: done; else errno
  std::thread scheduler_thread([&] {
    if (absl::GetFlag(FLAGS_scheduler_rt)) {
      sched_param param{};
      param.sched_priority = 1;
      rt_error = pthread_setschedparam(pthread_self(), SCHED_RR, &param);
    }
    scheduler_result = scheduler.Run();
  });
  while (absl::GetFlag(FLAGS_scheduler_rt) && rt_error.load() == -1)
    std::this_thread::yield();
  if (rt_error.load() > 0) {
    std::printf("tessera-sim: --scheduler_rt: no real-time priority (%s); the "
                "scheduler's thread shares the CPU with the nodes' threads\n",
                std::strerror(rt_error.load()));
  } else if (rt_error.load() == 0) {
    std::printf("tessera-sim: the scheduler's thread runs at real-time "
                "priority (SCHED_RR 1)\n");
  }

  // Phases, delimited by a barrier of the worker threads (the last to arrive
  // runs the completion: it reads the counters and the clock).
  struct Mark {
    absl::Time at;
    uint64_t sent = 0, scheduler_received = 0, barrier_msgs = 0, heartbeats = 0;
  };
  std::vector<Mark> marks;
  auto mark = [&] {
    Mark m;
    m.at = absl::Now();
    m.sent = counters.SentTotal();
    m.scheduler_received = counters.SchedulerReceived();
    m.barrier_msgs = counters.Sent(wire::BARRIER);
    m.heartbeats = counters.scheduler_received[wire::HEARTBEAT].load();
    marks.push_back(m);
  };
  std::barrier phase(workers, [&]() noexcept { mark(); });

  std::vector<std::thread> threads;
  threads.reserve(nodes);
  std::atomic<int> servers_failed_as_expected{0};
  for (int i = 0; i < servers; ++i) {
    threads.emplace_back([&] {
      Options mine = options;
      mine.role = Role::kServer;
      auto transport = std::make_unique<CountingTransport>(net.NewTransport(),
                                                           &counters, false);
      std::unique_ptr<Node> node;
      std::optional<KVServer> server;
      Node::Callbacks callbacks;
      if (kv) {
        server.emplace(workers, 1, [&node](int peer, Message m) {
          return node->Send(peer, std::move(m));
        });
        server->set_on_workers_finished([&node] { node->MarkPartDone(); });
        callbacks.on_data = [&server](Message&& m) {
          server->Handle(std::move(m));
        };
      }
      absl::StatusOr<std::unique_ptr<Node>> started =
          Node::Start(mine, std::move(callbacks), std::move(transport));
      if (!started.ok()) {
        fail(absl::StrCat("server: ", started.status().ToString()));
        return;
      }
      node = *std::move(started);
      node->StartDelivery();
      absl::Status end = node->WaitForTerminate();
      if (kill && !end.ok() &&
          end.message().find("died") != std::string::npos) {
        ++servers_failed_as_expected;
      } else if (!kill && !end.ok()) {
        fail(absl::StrCat("server: ", end.ToString()));
      }
      node->Stop();
      if (server) server->Stop();
    });
  }

  std::atomic<int> survivors_told{0};
  absl::Time killed_at;
  std::atomic<int64_t> last_told_ns{0};
  std::vector<absl::Time> joined(workers);
  const int victim = workers - 1;  // by thread, not rank
  for (int i = 0; i < workers; ++i) {
    threads.emplace_back([&, i] {
      Options mine = options;
      mine.role = Role::kWorker;
      auto transport = std::make_unique<CountingTransport>(net.NewTransport(),
                                                           &counters, false);
      std::unique_ptr<KVClient> client;
      std::unique_ptr<Node> node;
      if (kv) {
        absl::StatusOr<std::unique_ptr<KVClient>> c =
            KVClient::Create(mine, /*sync=*/true, std::move(transport));
        if (!c.ok()) {
          fail(absl::StrCat("worker: ", c.status().ToString()));
          phase.arrive_and_drop();
          return;
        }
        client = *std::move(c);
      } else {
        absl::StatusOr<std::unique_ptr<Node>> n =
            Node::Start(mine, Node::Callbacks(), std::move(transport));
        if (!n.ok()) {
          fail(absl::StrCat("worker: ", n.status().ToString()));
          phase.arrive_and_drop();
          return;
        }
        node = *std::move(n);
      }
      joined[i] = absl::Now();
      auto do_barrier = [&]() -> absl::Status {
        return kv ? client->Barrier() : node->Barrier(kGroupWorkers);
      };
      phase.arrive_and_wait();  // 1: formed
      for (int b = 0; b < barriers; ++b) {
        if (absl::Status s = do_barrier(); !s.ok())
          fail(absl::StrCat("barrier: ", s.ToString()));
      }
      phase.arrive_and_wait();  // 2: barriers done
      absl::SleepFor(idle);
      phase.arrive_and_wait();  // 3: idle done
      if (kv) {
        std::vector<float> w(values, 0.0f), g(values, client->rank() + 1.0f);
        if (absl::Status s = client->Init(1, w); !s.ok())
          fail(absl::StrCat("init: ", s.ToString()));
        const float want = workers * (workers + 1) / 2.0f;
        for (int r = 0; r < rounds; ++r) {
          if (absl::Status s = client->Push(1, g); !s.ok())
            fail(absl::StrCat("push: ", s.ToString()));
          if (absl::Status s = client->Pull(1, absl::MakeSpan(w)); !s.ok())
            fail(absl::StrCat("pull: ", s.ToString()));
          if (w[0] != want || w[values - 1] != want) {
            fail(absl::StrCat("round ", r, ": pulled ", w[0], ", want ", want));
          }
        }
      }
      phase.arrive_and_wait();  // 4: rounds done
      if (!kill) {
        absl::Status end = kv ? client->Close() : node->Finish();
        if (!end.ok()) fail(absl::StrCat("close: ", end.ToString()));
        if (node) node->Stop();
        return;
      }
      if (i == victim) {
        // Dies without a word: its threads stop, nothing is sent.
        killed_at = absl::Now();
        phase.arrive_and_drop();
        if (node) node->Stop();
        client.reset();
        node.reset();
        return;
      }
      phase.arrive_and_wait();  // 5: the victim is gone
      // Wait in a barrier the victim never joins: the scheduler must end it.
      absl::Status s = do_barrier();
      if (!s.ok() && s.message().find("died") != std::string::npos) {
        ++survivors_told;
        const int64_t ns = absl::ToUnixNanos(absl::Now());
        int64_t seen = last_told_ns.load();
        while (ns > seen && !last_told_ns.compare_exchange_weak(seen, ns)) {
        }
      } else {
        fail(absl::StrCat("a survivor's barrier ended with ", s.ToString()));
      }
      if (node) node->Stop();
    });
  }
  for (std::thread& t : threads) t.join();
  scheduler_thread.join();
  const absl::Time end = absl::Now();

  // --- Figures ---------------------------------------------------------------
  absl::Time formed = start;
  for (absl::Time t : joined) formed = std::max(formed, t);
  if (marks.size() < 4) {
    fail(absl::StrCat("only ", marks.size(), " phases completed"));
  }
  std::printf("\nphase                          time        messages sent   at the scheduler\n");
  double form_s = Seconds(formed - start), barrier_ms = 0, hb_per_s = 0,
         round_ms = 0;
  uint64_t form_sched = 0, barrier_msgs = 0;
  if (marks.size() >= 4) {
    form_sched = marks[0].scheduler_received;
    std::printf("formation                 %9.3f s  %14llu  %14llu\n", form_s,
                (unsigned long long)marks[0].sent,
                (unsigned long long)marks[0].scheduler_received);
    barrier_ms = barriers > 0 ? Seconds(marks[1].at - marks[0].at) * 1e3 / barriers : 0;
    barrier_msgs = barriers > 0
        ? (marks[1].barrier_msgs - marks[0].barrier_msgs) / barriers : 0;
    std::printf("barrier (mean of %d)       %9.3f ms %14llu  %14llu  (BARRIER messages per barrier: %llu)\n",
                barriers, barrier_ms,
                (unsigned long long)((marks[1].sent - marks[0].sent) / std::max(1, barriers)),
                (unsigned long long)((marks[1].scheduler_received - marks[0].scheduler_received) / std::max(1, barriers)),
                (unsigned long long)barrier_msgs);
    const double idle_s = Seconds(marks[2].at - marks[1].at);
    hb_per_s = (marks[2].heartbeats - marks[1].heartbeats) / idle_s;
    std::printf("idle                      %9.3f s  %14llu  %14llu  (heartbeats at the scheduler: %.0f/s)\n",
                idle_s, (unsigned long long)(marks[2].sent - marks[1].sent),
                (unsigned long long)(marks[2].scheduler_received - marks[1].scheduler_received),
                hb_per_s);
    round_ms = rounds > 0 ? Seconds(marks[3].at - marks[2].at) * 1e3 / rounds : 0;
    std::printf("round (mean of %d, + init) %9.3f ms %14llu  %14llu\n", rounds,
                round_ms,
                (unsigned long long)((marks[3].sent - marks[2].sent) / std::max(1, rounds)),
                (unsigned long long)((marks[3].scheduler_received - marks[2].scheduler_received) / std::max(1, rounds)));
  }
  double detect_s = 0;
  if (kill) {
    const int expected = workers - 1;
    detect_s = last_told_ns.load() > 0
                   ? Seconds(absl::FromUnixNanos(last_told_ns.load()) - killed_at)
                   : -1;
    std::printf("failure: %d of %d surviving workers and %d of %d servers told "
                "the worker died, the last %.3f s after its death "
                "(PS_HEARTBEAT_TIMEOUT %gs)\n",
                survivors_told.load(), expected,
                servers_failed_as_expected.load(), servers, detect_s,
                absl::GetFlag(FLAGS_heartbeat_timeout_s));
    if (survivors_told.load() != expected)
      fail("not every surviving worker was told of the death");
    if (kv && servers_failed_as_expected.load() != servers)
      fail("not every server was told of the death");
    if (scheduler_result.ok()) fail("the scheduler ended a failed job with OK");
  } else if (!scheduler_result.ok()) {
    fail(absl::StrCat("scheduler: ", scheduler_result.ToString()));
  }
  std::printf("total %.3f s, %llu messages, %.1f MB sent\n", Seconds(end - start),
              (unsigned long long)counters.SentTotal(),
              counters.sent_bytes.load() / 1e6);
  std::printf("SIM nodes=%d servers=%d workers=%d form_s=%.3f "
              "form_scheduler_msgs=%llu barrier_ms=%.3f barrier_msgs=%llu "
              "heartbeats_per_s=%.1f round_ms=%.3f detect_s=%.3f ok=%d\n",
              nodes, servers, workers, form_s, (unsigned long long)form_sched,
              barrier_ms, (unsigned long long)barrier_msgs, hb_per_s, round_ms,
              detect_s, result.ok ? 1 : 0);
  for (const std::string& p : result.problems)
    std::printf("problem: %s\n", p.c_str());
  return result.ok ? 0 : 1;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // As tessera-server and KVWorker::Create do: Debian's Abseil checks every
  // lock order against one global graph, which thousands of threads contend.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  tessera::SetLogTag("sim");
  return tessera::Run();
}

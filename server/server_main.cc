// tessera-server: holds a shard of the weights of a Tessera job and updates
// them. Configured by the DMLC_* environment, plus flags:
//
//   --checkpoint-dir DIR     write this server's shard to DIR (atomically) and,
//                            when restarted (TESSERA_RESTART_COUNT > 0), resume
//                            from the newest readable one
//   --checkpoint-every N     every N updates (a dist_sync round of one key or a
//                            dist_async push each count 1), or Ns for every N
//                            seconds; default 30s
//   --checkpoint-keep K      keep the newest K files (default 3)
//
// Exit codes: 0 job done, 1 job failed (a peer died, the scheduler gave up or
// vanished, a restart found no checkpoint to resume from), 2 bad configuration.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/daemon.h"
#include "common/logging.h"
#include "common/node.h"
#include "common/options.h"
#include "common/process_info.h"
#include "server/checkpoint.h"
#include "server/kv_server.h"

namespace {

// Replicated jobs: SIGTERM asks this server to leave (see Serve).
std::atomic<bool> leave_requested{false};
// The first SIGTERM asks; the default comes back, so a second one ends the
// process (launch.py's teardown, or a user whose leave was refused).
extern "C" void RequestLeave(int) {
  leave_requested.store(true);
  std::signal(SIGTERM, SIG_DFL);
}

struct Flags {
  std::string checkpoint_dir;
  tessera::CheckpointPolicy policy;
  int keep = 3;
  // TESSERA_TEST_CHECKPOINT_DELAY (seconds; testing only): every checkpoint
  // write is held this long, as on a slow disk.
  absl::Duration test_write_delay = absl::ZeroDuration();
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags flags;
  std::string every = "30s";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    const size_t eq = arg.find('=');
    const bool has_inline = arg.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_inline) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const bool known = arg == "--checkpoint-dir" ||
                       arg == "--checkpoint-every" ||
                       arg == "--checkpoint-keep";
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag '", argv[i],
                       "': expected --checkpoint-dir, --checkpoint-every or "
                       "--checkpoint-keep"));
    }
    if (!has_inline) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
      }
      value = argv[++i];
    }
    if (arg == "--checkpoint-dir") {
      if (value.empty()) {
        return absl::InvalidArgumentError(
            "--checkpoint-dir='': expected a folder");
      }
      flags.checkpoint_dir = value;
    } else if (arg == "--checkpoint-every") {
      every = value;
    } else if (!absl::SimpleAtoi(value, &flags.keep) || flags.keep < 1 ||
               flags.keep > 1000) {
      return absl::InvalidArgumentError(
          absl::StrCat("--checkpoint-keep='", value,
                       "': expected a whole number in 1..1000"));
    }
  }
  absl::StatusOr<tessera::CheckpointPolicy> policy =
      tessera::CheckpointPolicy::Parse(every);
  if (!policy.ok()) return policy.status();
  flags.policy = *policy;
  if (const char* delay = std::getenv("TESSERA_TEST_CHECKPOINT_DELAY")) {
    double seconds = 0;
    if (!absl::SimpleAtod(delay, &seconds) || !(seconds >= 0) ||
        seconds > 3600) {
      return absl::InvalidArgumentError(
          absl::StrCat("TESSERA_TEST_CHECKPOINT_DELAY='", delay,
                       "': expected seconds in 0..3600"));
    }
    flags.test_write_delay = absl::Seconds(seconds);
  }
  return flags;
}

// The update threads: TESSERA_SERVER_THREADS, or one per core (at most 8).
int UpdateThreads(const tessera::Options& options) {
  if (options.server_threads != 0) return options.server_threads;
  return static_cast<int>(
      std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
}

// With --checkpoint-dir: a restarted server resumes from its newest readable
// checkpoint (or, with none yet, waits for the workers' replay), and the
// server checkpoints from now on. A restart without one cannot go on.
// Called before the node delivers anything, so no request sees the shard
// before it is restored.
absl::Status PrepareCheckpoints(
    const Flags& flags, const tessera::Options& options,
    const tessera::Node& node, tessera::KVServer& server,
    std::unique_ptr<tessera::CheckpointStore>* store,
    std::unique_ptr<tessera::Checkpointer>* checkpointer) {
  const std::string restarted = absl::StrCat(
      "restarted (TESSERA_RESTART_COUNT=", options.restart_count, ")");
  // A replacement in a replicated job (a spare, or this rank restarted) gets
  // its slices from their replicas (KV_TRANSFER), newer than any checkpoint.
  const bool replacement = node.catching_up();
  if (flags.checkpoint_dir.empty()) {
    if (options.restart_count == 0 || replacement) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        restarted,
        " without --checkpoint-dir: this server's weights are lost and the "
        "job cannot continue"));
  }
  *store = std::make_unique<tessera::CheckpointStore>(flags.checkpoint_dir,
                                                      node.rank(), flags.keep);
  if (options.restart_count > 0 && !replacement) {
    auto latest = (*store)->LoadLatest();
    absl::Status restored = latest.status();
    if (restored.ok() && latest->has_value()) {
      restored = server.Restore(**latest);
      if (restored.ok()) {
        TESSERA_LOG(INFO) << restarted << ": resumed from checkpoint "
                          << (*latest)->sequence() << " ("
                          << (*latest)->keys_size() << " key(s), "
                          << (*latest)->rounds_applied() << " update(s))";
      }
    } else if (restored.ok()) {
      TESSERA_LOG(INFO) << restarted << ": no checkpoint in "
                        << flags.checkpoint_dir
                        << " yet; the workers replay everything";
      server.set_recovering();
    }
    if (!restored.ok()) {
      return absl::Status(
          restored.code(),
          absl::StrCat(restarted, ": cannot resume: ", restored.message()));
    }
  }
  server.set_checkpointing(true);
  *checkpointer = std::make_unique<tessera::Checkpointer>(
      store->get(), flags.policy, &server, flags.test_write_delay);
  return absl::OkStatus();
}

// One summary line: tests read the exactly-once counts from it.
void LogSummary(const tessera::KVServer& server, const tessera::Node& node) {
  const tessera::wire::KVStats stats = server.stats();
  std::string per_key;
  std::map<uint64_t, uint64_t> ordered(stats.key_pushes_applied().begin(),
                                       stats.key_pushes_applied().end());
  for (const auto& [key, n] : ordered)
    absl::StrAppend(&per_key, per_key.empty() ? "" : ", ", "key ", key, ": ",
                    n);
  TESSERA_LOG(INFO) << "pushes applied " << stats.pushes_applied() << " ("
                    << per_key << "), rounds " << stats.rounds_applied()
                    << ", duplicates " << stats.duplicates() << ", checkpoints "
                    << stats.checkpoints_written() << ", refused "
                    << stats.refused() << ", replica updates "
                    << stats.replica_updates() << ", promoted slices "
                    << stats.promoted_slices() << ", malformed "
                    << stats.malformed_messages() + node.malformed_count()
                    << ", wrong sender " << node.wrong_sender_count()
                    << ", refused connections "
                    << node.refused_connection_count() << ", sealed drops "
                    << tessera::DescribeSealedDrops(node.sealed_drops())
                    << ", peak RSS " << tessera::PeakResidentBytes() / 1000000
                    << " MB";
}

// Joins the job, serves it until its end and says how it went.
int Serve(const Flags& flags, const tessera::Options& options) {
  constexpr char kProgram[] = "tessera-server";
  const int threads = UpdateThreads(options);
  // Elastic jobs: the worker notices (receiving thread) and the first
  // table's workers (this thread, once: see below) one at a time. A notice
  // before that read is in the table it reads. Made before `node`, whose
  // threads call back until it is destroyed.
  absl::Mutex workers_mu;
  bool workers_read = !options.elastic();  // guarded by workers_mu
  std::unique_ptr<tessera::Node> node;
  std::unique_ptr<tessera::CheckpointStore> store;
  std::unique_ptr<tessera::Checkpointer> checkpointer;
  tessera::RoundWatch::Options watch;
  watch.late_factor = options.late_factor;
  watch.late_min = options.late_min;
  // An elastic job's server is made for its most workers (TESSERA_ELASTIC's
  // MAX); the ranks past DMLC_NUM_WORKER join later.
  tessera::KVServer server(
      options.elastic() ? options.elastic_max : options.num_workers, threads,
      [&node](int peer, tessera::Message msg) {
        return node->Send(peer, std::move(msg));
      },
      tessera::WaitingLimits(),
      options.exact_sync_sum ? tessera::SyncRound::Mode::kExact
                             : tessera::SyncRound::Mode::kArrival,
      watch);
  if (options.elastic()) server.set_elastic(options.num_workers);
  tessera::Node::Callbacks callbacks;
  callbacks.on_data = [&server, &checkpointer](tessera::Message&& msg) {
    if (checkpointer != nullptr) checkpointer->MaybeWrite();
    server.Handle(std::move(msg));
  };
  // Table changes can come before `node` is set (they are read on the
  // receiving thread from Start on); UpdateServers below covers those.
  std::atomic<tessera::Node*> live_node{nullptr};
  callbacks.on_peer_dead = [&server, &live_node, &workers_mu,
                            &workers_read](int peer) {
    if (tessera::IsWorkerId(peer)) {
      absl::MutexLock lock(&workers_mu);
      if (workers_read) server.WorkerLeft(tessera::RankOfId(peer));
      return;
    }
    if (!tessera::IsServerId(peer)) return;
    if (tessera::Node* n = live_node.load()) {
      server.UpdateServers(n->server_states());
    } else {
      server.ServerDied(tessera::RankOfId(peer));
    }
  };
  callbacks.on_peer_join = [&server, &workers_mu, &workers_read](int peer) {
    if (!tessera::IsWorkerId(peer)) return;
    absl::MutexLock lock(&workers_mu);
    if (workers_read) server.WorkerJoined(tessera::RankOfId(peer));
  };
  callbacks.on_server_change = [&server, &live_node](int peer) {
    if (!tessera::IsServerId(peer)) return;
    if (tessera::Node* n = live_node.load())
      server.UpdateServers(n->server_states());
  };
  callbacks.on_handback = [&server, &live_node](int rank, uint64_t epoch,
                                                bool leave) {
    tessera::Node* n = live_node.load();
    if (n == nullptr) return;  // not sent before this server holds slices
    server.HandBack(
        rank, epoch, [n](uint64_t done) { n->ReportHandback(done); }, leave);
  };
  absl::StatusOr<std::unique_ptr<tessera::Node>> started =
      tessera::Node::Start(options, std::move(callbacks));
  if (!started.ok() && options.spare && absl::IsCancelled(started.status())) {
    TESSERA_LOG(INFO) << started.status().message();
    return 0;
  }
  if (!started.ok()) {
    return tessera::ExitWith(kProgram, started.status(),
                             absl::IsInvalidArgument(started.status()) ? 2 : 1);
  }
  node = *std::move(started);
  server.set_on_workers_finished([&node] { node->MarkPartDone(); });
  server.set_replication(node->rank(), options.num_servers,
                         options.chain_length(), options.resend_timeout,
                         options.single_copy);
  live_node.store(node.get());
  server.UpdateServers(node->server_states());
  if (absl::Status prepared = PrepareCheckpoints(flags, options, *node, server,
                                                 &store, &checkpointer);
      !prepared.ok()) {
    return tessera::ExitWith(kProgram, prepared, 1);
  }
  if (options.elastic()) {
    // Workers that left or joined before this server started (it is a
    // replacement, or restarted): the notices went to the others only. After
    // the checkpoint's restore (which fills the stores on this thread), and
    // before any request is delivered; the notices of later tables wait for
    // this, or are in the table read here.
    absl::MutexLock lock(&workers_mu);
    const tessera::Node::WorkerChanges workers = node->worker_changes();
    for (int rank : workers.out) server.WorkerLeft(rank);
    for (int rank : workers.joined) server.WorkerJoined(rank);
    workers_read = true;
  }
  node->StartDelivery();
  if (node->catching_up()) {
    // A replacement (a spare, or this rank's dead server restarted): the
    // live servers send it the slices of its chains.
    tessera::Node* n = node.get();
    server.StartCatchUp([n] { return n->server_states(); },
                        [n] { n->ReportCaughtUp(); });
  }
  TESSERA_VLOG(1) << "serving with " << threads << " update thread(s)";
  // A replicated job's server leaves it on SIGTERM when every key slice it
  // holds keeps a live replica (the scheduler decides; its slices fail over
  // to them); refused, it goes on serving, and a second SIGTERM ends it. In
  // other jobs SIGTERM ends the process as it always did.
  std::atomic<bool> serving{true};
  std::thread leaver;
  if (options.chain_length() > 1) {
    std::signal(SIGTERM, RequestLeave);
    const bool single_copy = options.single_copy;
    leaver = std::thread([&node, &serving, single_copy] {
      while (serving.load()) {
        if (!leave_requested.exchange(false)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          continue;
        }
        TESSERA_LOG(INFO) << "SIGTERM: asking the scheduler to leave the job "
                          << (single_copy ? "(TESSERA_MAX_SERVERS)"
                                          : "(TESSERA_REPLICAS)");
        if (absl::Status left = node->Leave(); !left.ok()) {
          TESSERA_LOG(WARNING)
              << "not leaving: " << left.message()
              << "; serving on (a second SIGTERM ends this server)";
          continue;
        }
        TESSERA_LOG(INFO) << (single_copy
                                  ? "left the job (SIGTERM): its key slices "
                                    "moved to the other servers"
                                  : "left the job (SIGTERM): its key slices "
                                    "fail over to their replicas");
        return;
      }
    });
  }
  const absl::Status result = node->WaitForTerminate();
  serving.store(false);
  if (leaver.joinable()) leaver.join();
  LogSummary(server, *node);
  node->Stop();
  server.Stop();
  checkpointer.reset();  // before the store it writes to
  return result.ok() ? 0 : tessera::ExitWith(kProgram, result, 1);
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok())
    return tessera::ExitWith("tessera-server", flags.status(), 2);
  absl::StatusOr<tessera::Options> options =
      tessera::StartDaemon(tessera::Role::kServer);
  if (!options.ok())
    return tessera::ExitWith("tessera-server", options.status(), 2);
  return Serve(*flags, *options);
}

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
#include <optional>
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

// Replicated jobs: SIGTERM asks this server to leave (see StartLeaver).
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
                    << stats.promoted_slices() << ", misplaced inits "
                    << stats.misplaced_inits() << ", misplaced server messages "
                    << stats.misplaced_server_messages() << ", malformed "
                    << stats.malformed_messages() + node.malformed_count()
                    << ", wrong sender " << node.wrong_sender_count()
                    << ", refused connections "
                    << node.refused_connection_count() << ", sealed drops "
                    << tessera::DescribeSealedDrops(node.sealed_drops())
                    << ", peak RSS " << tessera::PeakResidentBytes() / 1000000
                    << " MB";
}

// One server process in the job: its KVServer, its membership (the Node), its
// checkpoints and, in a replicated job, the thread that asks to leave on
// SIGTERM.
class ServerDaemon {
 public:
  ServerDaemon(const Flags& flags, const tessera::Options& options);

  // Joins the job, serves it until its end and says how it went (the
  // process's exit code).
  int Serve();

 private:
  static constexpr char kProgram[] = "tessera-server";

  static tessera::RoundWatch::Options WatchOptions(
      const tessera::Options& options);
  // What the node's threads tell this server: data messages, deaths, joins,
  // table changes and hand-backs.
  tessera::Node::Callbacks MakeCallbacks();
  // Starts the node. An exit code when the process ends here (a spare the
  // job did not need, or a failed start).
  std::optional<int> JoinJob();
  // Between the node's start and its first delivery: the server learns its
  // place, restores its checkpoint and the workers that changed before it
  // started; then delivery begins (and a replacement's catch-up).
  absl::Status StartServing();
  // Workers that left or joined before this server started.
  void ReadWorkerChanges();
  // A replicated job: a thread that asks the scheduler to leave on SIGTERM.
  void StartLeaver();
  // After the job's end: the summary, then the node, the server and the
  // checkpointer stop.
  int Shutdown(const absl::Status& result);

  const Flags& flags_;
  const tessera::Options& options_;
  const int threads_;
  // Elastic jobs: the worker notices (receiving thread) and the first
  // table's workers (the main thread, once: see ReadWorkerChanges) one at a
  // time. A notice before that read is in the table it reads. Made before
  // `node_`, whose threads call back until it is destroyed.
  absl::Mutex workers_mu_;
  bool workers_read_ ABSL_GUARDED_BY(workers_mu_);
  std::unique_ptr<tessera::Node> node_;
  std::unique_ptr<tessera::CheckpointStore> store_;
  std::unique_ptr<tessera::Checkpointer> checkpointer_;
  tessera::KVServer server_;
  // Table changes can come before `node_` is set (they are read on the
  // receiving thread from Start on); StartServing's UpdateServers covers
  // those.
  std::atomic<tessera::Node*> live_node_{nullptr};
  std::atomic<bool> serving_{true};
  std::thread leaver_;
};

tessera::RoundWatch::Options ServerDaemon::WatchOptions(
    const tessera::Options& options) {
  tessera::RoundWatch::Options watch;
  watch.late_factor = options.late_factor;
  watch.late_min = options.late_min;
  return watch;
}

// An elastic job's server is made for its most workers (TESSERA_ELASTIC's
// MAX); the ranks past DMLC_NUM_WORKER join later.
ServerDaemon::ServerDaemon(const Flags& flags, const tessera::Options& options)
    : flags_(flags),
      options_(options),
      threads_(UpdateThreads(options)),
      workers_read_(!options.elastic()),
      server_(
          options.elastic() ? options.elastic_max : options.num_workers,
          threads_,
          [this](int peer, tessera::Message msg) {
            return node_->Send(peer, std::move(msg));
          },
          tessera::WaitingLimits(),
          options.exact_sync_sum ? tessera::SyncRound::Mode::kExact
                                 : tessera::SyncRound::Mode::kArrival,
          WatchOptions(options)) {
  if (options.elastic()) server_.set_elastic(options.num_workers);
}

tessera::Node::Callbacks ServerDaemon::MakeCallbacks() {
  tessera::Node::Callbacks callbacks;
  callbacks.on_data = [this](tessera::Message&& msg) {
    if (checkpointer_ != nullptr) checkpointer_->MaybeWrite();
    server_.Handle(std::move(msg));
  };
  callbacks.on_peer_dead = [this](int peer) {
    if (tessera::IsWorkerId(peer)) {
      absl::MutexLock lock(&workers_mu_);
      if (workers_read_) server_.WorkerLeft(tessera::RankOfId(peer));
      return;
    }
    if (!tessera::IsServerId(peer)) return;
    if (tessera::Node* n = live_node_.load()) {
      server_.UpdateServers(n->server_states());
    } else {
      server_.ServerDied(tessera::RankOfId(peer));
    }
  };
  callbacks.on_peer_join = [this](int peer) {
    if (!tessera::IsWorkerId(peer)) return;
    absl::MutexLock lock(&workers_mu_);
    if (workers_read_) server_.WorkerJoined(tessera::RankOfId(peer));
  };
  callbacks.on_server_change = [this](int peer) {
    if (!tessera::IsServerId(peer)) return;
    if (tessera::Node* n = live_node_.load())
      server_.UpdateServers(n->server_states());
  };
  callbacks.on_handback = [this](int rank, uint64_t epoch, bool leave) {
    tessera::Node* n = live_node_.load();
    if (n == nullptr) return;  // not sent before this server holds slices
    server_.HandBack(
        rank, epoch, [n](uint64_t done) { n->ReportHandback(done); }, leave);
  };
  return callbacks;
}

std::optional<int> ServerDaemon::JoinJob() {
  absl::StatusOr<std::unique_ptr<tessera::Node>> started =
      tessera::Node::Start(options_, MakeCallbacks());
  if (!started.ok() && options_.spare && absl::IsCancelled(started.status())) {
    TESSERA_LOG(INFO) << started.status().message();
    return 0;
  }
  if (!started.ok()) {
    return tessera::ExitWith(kProgram, started.status(),
                             absl::IsInvalidArgument(started.status()) ? 2 : 1);
  }
  node_ = *std::move(started);
  return std::nullopt;
}

absl::Status ServerDaemon::StartServing() {
  server_.set_on_workers_finished([this] { node_->MarkPartDone(); });
  server_.set_replication(node_->rank(), options_.num_servers,
                          options_.chain_length(), options_.resend_timeout,
                          options_.single_copy);
  live_node_.store(node_.get());
  server_.set_local_groups(node_->local_groups());
  server_.UpdateServers(node_->server_states());
  if (absl::Status prepared = PrepareCheckpoints(
          flags_, options_, *node_, server_, &store_, &checkpointer_);
      !prepared.ok()) {
    return prepared;
  }
  if (options_.elastic()) ReadWorkerChanges();
  if (node_->catching_up()) {
    // A replacement (a spare, or this rank's dead server restarted): the
    // live servers send it the slices of its chains. Started before any
    // message is delivered: a live server sends slices as soon as it sees
    // the replacement in the table, and one taken before the catch-up began
    // would be neither credited to its sender nor, in a replicated job,
    // accepted at all.
    tessera::Node* n = node_.get();
    server_.StartCatchUp([n] { return n->server_states(); },
                         [n] { n->ReportCaughtUp(); });
  }
  node_->StartDelivery();
  return absl::OkStatus();
}

void ServerDaemon::ReadWorkerChanges() {
  // Workers that left or joined before this server started (it is a
  // replacement, or restarted): the notices went to the others only. After
  // the checkpoint's restore (which fills the stores on this thread), and
  // before any request is delivered; the notices of later tables wait for
  // this, or are in the table read here.
  absl::MutexLock lock(&workers_mu_);
  const tessera::Node::WorkerChanges workers = node_->worker_changes();
  for (int rank : workers.out) server_.WorkerLeft(rank);
  for (int rank : workers.joined) server_.WorkerJoined(rank);
  workers_read_ = true;
}

void ServerDaemon::StartLeaver() {
  // A replicated job's server leaves it on SIGTERM when every key slice it
  // holds keeps a live replica (the scheduler decides; its slices fail over
  // to them); refused, it goes on serving, and a second SIGTERM ends it. In
  // other jobs SIGTERM ends the process as it always did.
  if (options_.chain_length() <= 1) return;
  std::signal(SIGTERM, RequestLeave);
  const bool single_copy = options_.single_copy;
  leaver_ =
      std::thread([this, single_copy] {
        while (serving_.load()) {
          if (!leave_requested.exchange(false)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            continue;
          }
          TESSERA_LOG(INFO)
              << "SIGTERM: asking the scheduler to leave the job "
              << (single_copy ? "(TESSERA_MAX_SERVERS)" : "(TESSERA_REPLICAS)");
          if (absl::Status left = node_->Leave(); !left.ok()) {
            TESSERA_LOG(WARNING)
                << "not leaving: " << left.message()
                << "; serving on (a second SIGTERM ends this server)";
            continue;
          }
          TESSERA_LOG(INFO)
              << (single_copy ? "left the job (SIGTERM): its key slices "
                                "moved to the other servers"
                              : "left the job (SIGTERM): its key slices "
                                "fail over to their replicas");
          return;
        }
      });
}

int ServerDaemon::Shutdown(const absl::Status& result) {
  serving_.store(false);
  if (leaver_.joinable()) leaver_.join();
  LogSummary(server_, *node_);
  node_->Stop();
  server_.Stop();
  checkpointer_.reset();  // before the store it writes to
  return result.ok() ? 0 : tessera::ExitWith(kProgram, result, 1);
}

int ServerDaemon::Serve() {
  if (std::optional<int> ended = JoinJob(); ended.has_value()) return *ended;
  if (absl::Status started = StartServing(); !started.ok()) {
    // The node first: its threads call into the server until it stops (the
    // members go in the other order).
    node_->Stop();
    server_.Stop();
    return tessera::ExitWith(kProgram, started, 1);
  }
  TESSERA_VLOG(1) << "serving with " << threads_ << " update thread(s)";
  StartLeaver();
  return Shutdown(node_->WaitForTerminate());
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
  ServerDaemon daemon(*flags, *options);
  return daemon.Serve();
}

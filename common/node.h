// Node: a server's or worker's membership in a job. It registers with the
// scheduler, receives the node table (ids and ranks), connects to its peers,
// serves barriers, heart-beats, and reports the job's end or failure.
// Messages of the data plane (header.plane DATA) are handed to the owner's
// callback; Node knows nothing of what they mean.
//
//   Node::Callbacks cb;
//   cb.on_data = [&](Message&& m) { server.Handle(std::move(m)); };
//   cb.on_failure = [&](const absl::Status& s) { ... };   // a peer died, the job aborted
//   absl::StatusOr<std::unique_ptr<Node>> node = Node::Start(options, cb);
//   (*node)->Barrier(kGroupWorkers);
//
// Receiving: the node's receiver thread takes messages off the transport and
// dispatches them. A thread that waits for a reply can instead receive itself
// (ReceiveOnCaller), so the reply wakes the thread that wants it and not the
// receiver thread, which would then have to wake the waiter: one thread
// hand-off less per round trip. One thread receives at a time; the receiver
// thread steps aside after its current receive when a caller asks, and takes
// over again when no caller has received for kCallerGrace (or at once when
// the node itself waits for the scheduler).
//
//   while (!reply_arrived) {
//     if (node->ReceiveOnCaller(absl::Milliseconds(20)) ==
//         Node::ReceiveResult::kBusy) { /* wait for on_receiver_free */ }
//   }
//
// Thread-safety: all methods are thread-safe. Callbacks run on the thread that
// received the message (the receiver thread, or a caller in ReceiveOnCaller:
// on_data, on_peer_restart, on_failure after a control message), or on
// whichever internal thread noticed a failure (on_failure, called exactly
// once); they must not block for long. Messages are dispatched one at a time,
// in arrival order, whichever thread receives them.
#ifndef TESSERA_COMMON_NODE_H_
#define TESSERA_COMMON_NODE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/debug_pending.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/options.h"
#include "common/replica_chain.h"
#include "common/transport.h"

namespace tessera {

// The first request id of a process in its `restart_count`-th life: each life
// numbers from its own range, so a reply meant for an earlier life never
// matches a request of this one.
inline uint64_t FirstRequestId(uint64_t restart_count) {
  return (restart_count << 48) + 1;
}

class Node {
 public:
  struct Callbacks {
    std::function<void(Message&&)> on_data;
    std::function<void(const absl::Status&)> on_failure;
    // A peer this node talks to restarted (same identity, new generation);
    // called on the receiving thread after the link to it is renewed.
    std::function<void(int peer)> on_peer_restart;
    // Replicated jobs: the scheduler declared server `peer` dead and its key
    // slices failed over to their replicas (the job goes on). Called once per
    // peer, on the receiving thread, after dead_servers() includes it.
    std::function<void(int peer)> on_peer_dead;
    // Replicated jobs: a server's state changed without it dying: a
    // replacement took a dead server's rank (catching up), caught up, or
    // took back its place (restored); also for this node's own entry.
    // Called on the receiving thread, after server_states() says so.
    std::function<void(int peer)> on_server_change;
    // Replicated jobs, servers: the scheduler's HANDBACK notice: server rank
    // `rank` takes back its slices; the owner calls ReportHandback(epoch)
    // once its part is done. Called on the receiving thread.
    // `leave`: the rank leaves a job with one copy of each slice instead
    // (its slices move to the servers answering for them without it).
    std::function<void(int rank, uint64_t epoch, bool leave)> on_handback;
    // Elastic jobs (TESSERA_ELASTIC): a worker joined the job (a new process
    // under a rank that left, or one never used). Called on the receiving
    // thread, after the link to it is made.
    std::function<void(int peer)> on_peer_join;
    // The receiver thread stepped aside after a ReceiveOnCaller answered
    // kBusy: a caller may receive now. Called on the receiver thread, with no
    // lock of the node held.
    std::function<void()> on_receiver_free;
  };

  // How long the receiver thread leaves the transport to callers after a
  // caller last received: long enough that a caller issuing one request after
  // another finds it free, short enough that messages nobody waits for
  // (replies to operations not being waited for, control messages) are read
  // soon after they arrive.
  static constexpr absl::Duration kCallerGrace = absl::Milliseconds(5);
  // The receiver thread's receive time-out: how soon it notices a caller that
  // asked for the transport while nothing arrives (an arrival ends the receive
  // at once), and an idle node's wake-ups per second.
  static constexpr absl::Duration kReceiverPoll = absl::Milliseconds(100);

  enum class ReceiveResult {
    kReceived,  // one message received and dispatched on the calling thread
    kTimedOut,  // nothing arrived within the time-out
    kBusy,      // another thread is receiving; it dispatches what arrives
    kClosed,    // the node stopped (or its transport failed): do not retry
  };

  // Joins the job: resolves and binds the node's address, starts serving
  // metrics when TESSERA_METRICS_PORT is set (on the advertised address),
  // registers, and waits up to options.start_timeout for the node table.
  // Errors: InvalidArgument (naming the variable) for a bad address or port
  // (a metrics port in use included), DeadlineExceeded when the table never
  // came, Aborted when the scheduler gave up on the job.
  static absl::StatusOr<std::unique_ptr<Node>> Start(
      const Options& options, Callbacks callbacks,
      std::unique_ptr<Transport> transport = nullptr);

  ~Node();

  int id() const { return id_; }
  int rank() const { return rank_; }
  // The generation this process's messages carry: TESSERA_RESTART_COUNT, or
  // the one the scheduler gave a worker joining an elastic job (> 0: this
  // process continues a rank whose pushes the servers may hold, and must not
  // wait in barriers the others passed).
  uint64_t generation() const { return generation_.load(); }
  Role role() const { return options_.role; }
  int num_servers() const { return options_.num_servers; }
  int num_workers() const { return options_.num_workers; }
  const Options& options() const { return options_; }
  // "server 1 (id 10 at 127.0.0.1:40123)"
  std::string Describe(int node_id) const;
  // Replicated jobs: the ranks of the servers declared dead so far.
  std::vector<bool> dead_servers() const;
  // Elastic jobs: the workers of the node table that are out of the job
  // (left, or declared dead) and those that joined it after it formed and
  // are in it. A server that starts later (a replacement, a restart) learns
  // from these what the notices told the others.
  struct WorkerChanges {
    std::vector<int> out;     // ranks
    std::vector<int> joined;  // ranks
  };
  WorkerChanges worker_changes() const;
  // Replicated jobs: per server rank, its state in the node table
  // (common/replica_chain.h).
  std::vector<ServerState> server_states() const;
  // Host-local aggregation (docs/local_groups.md): this worker's place in its
  // host's group as the node table gives it (size 0: in no group), and, for
  // a server, every worker rank's group mates (by rank, itself included;
  // empty for a worker in no group).
  struct LocalPlace {
    uint32_t group = 0;
    uint32_t rank = 0;
    uint32_t size = 0;
    uint64_t nonce = 0;  // the job's (NodeTable.local_group_nonce)
    // The job's largest group (NodeTable.local_group_split), for every
    // worker, in a group or not: dense keys are cut into this many parts.
    uint32_t split = 0;
  };
  LocalPlace local_place() const;
  std::vector<std::vector<int>> local_groups() const;
  // A replacement server: whether it is still catching up (its own entry).
  bool catching_up() const;
  // A replacement server holds every slice of its chains: tells the
  // scheduler, again with each heartbeat until the table says so.
  void ReportCaughtUp();
  // A server done with its part of hand-back `epoch` (HANDBACK): tells the
  // scheduler, again with each heartbeat until the next table change (the
  // hand-back's end, or a change that gave it up).
  void ReportHandback(uint64_t epoch);

  // Starts handing data-plane messages to on_data. Until then (from the moment
  // the node is reachable, before Start returns) they are held in arrival
  // order, so the owner never sees a message before it holds the Node it
  // replies through.
  void StartDelivery();

  // Sends a data-plane message; fills in sender, generation and plane.
  absl::Status Send(int peer, Message msg);

  // Receives at most one message, waiting at most `timeout`, and dispatches
  // it on the calling thread as the receiver thread would (callbacks
  // included). kBusy at once when another thread is receiving: when that is
  // the receiver thread, it steps aside after its current receive and calls
  // on_receiver_free. REQUIRES: the caller holds no lock that a callback
  // takes.
  ReceiveResult ReceiveOnCaller(absl::Duration timeout);

  // Waits (at most TESSERA_TIMEOUT) until every node of `group` has entered
  // the barrier. `tag` says what the barrier is for (the owner's words, e.g.
  // "init 3"); the scheduler only compares tags.
  absl::Status Barrier(int group, const std::string& tag = "");
  // For a node restarted into a running job: returns at once when the
  // group's barrier of this tag was released already (the earlier life, or
  // the others without it, passed it); otherwise joins it as Barrier does
  // (the others wait there for this node, or will).
  absl::Status JoinBarrierIfOpen(int group, const std::string& tag);

  // Tells the scheduler this node has finished its work (a worker, after its
  // last barrier), then waits (at most TESSERA_TIMEOUT) until the scheduler
  // announces the job's end, which it acknowledges. OK once the scheduler
  // counted this node done, unless the job failed meanwhile (a node died).
  absl::Status Finish();

  // Elastic jobs (TESSERA_ELASTIC), a worker: leaves the job before its end
  // (after its last step; every reply to its pushes came). The scheduler
  // takes it out of the membership and tells the servers, which complete
  // later rounds without it; returns once the scheduler took the goodbye.
  // The node may stop then. FailedPrecondition in a job that is not elastic.
  // A server of a replicated job (TESSERA_REPLICAS >= 2) leaves the same way
  // (SERVER_LEAVE): the scheduler takes it when every key slice it holds
  // keeps a live replica (FailedPrecondition naming the slices otherwise),
  // and its slices fail over to them; WaitForTerminate then returns OK.
  absl::Status Leave();

  // This node's part of the job is complete (Finish does it; a server calls it
  // once every worker has said goodbye). From then
  // on, a scheduler that goes silent ends the node without failure: the job's
  // end was decided, or this node is no longer needed for it.
  void MarkPartDone();

  // Blocks until the scheduler ends the job (OK) or the job fails (the
  // failure). No deadline of its own: it lasts as long as the job, whose length
  // nobody knows in advance; a dead scheduler ends it through the heartbeat
  // time-out. With heartbeats off (PS_HEARTBEAT_INTERVAL=0, the user's choice,
  // warned about at start) nothing can tell a long job from a dead scheduler.
  absl::Status WaitForTerminate();

  // OK while the job is healthy, else the first failure.
  absl::Status failure() const;

  // Stops the threads (the metrics server's too) and closes the transport.
  // Idempotent.
  void Stop();

  // The metrics server's port; 0 when TESSERA_METRICS_PORT is unset.
  int metrics_port() const;

  uint64_t malformed_count() const { return transport_->malformed_count(); }
  // Messages whose claimed sender did not match their connection's key
  // (secured transports), and control messages from a node other than the
  // scheduler; connections refused for want of the job's keys.
  uint64_t wrong_sender_count() const {
    return transport_->wrong_sender_count() + foreign_control_.load();
  }
  uint64_t refused_connection_count() const {
    return transport_->refused_connection_count();
  }
  // Sealed records and messages dropped, by reason (secured jobs).
  SealedDrops sealed_drops() const { return transport_->sealed_drops(); }

 private:
  // Node's code lives in one file per concern: node.cc (joining, failing,
  // stopping), node_table.cc (the node table and its updates),
  // node_control.cc (control messages, heartbeats), node_receiver.cc (who
  // receives, and dispatch), node_scheduler_calls.cc (barriers, finishing,
  // leaving).
  Node(const Options& options, Callbacks callbacks,
       std::unique_ptr<Transport> transport);

  absl::Status Join();
  // Join's steps: binds the node's address (and the metrics endpoint) and
  // links to the scheduler; the registration; sends it and waits for the
  // node table (asking again while it does not come), then links to the
  // peers.
  absl::Status BindAndConnect();
  Message RegisterMessage() const;
  absl::Status RegisterAndAwaitTable();
  void ReceiveLoop();
  // Waits until the receiver thread may take the transport (it is free and no
  // caller received within kCallerGrace, or the node waits for the scheduler)
  // and takes it. False when the node stops.
  bool AwaitReceiverTurn();
  // Hands the transport back after a receive turn; calls on_receiver_free
  // when a caller asked for it meanwhile.
  void EndReceiverTurn();
  // Asks the receiver thread to take the transport now, without the grace
  // (the node waits for a control message that no caller will receive).
  void WakeReceiver();
  // Receives at most one message and dispatches it. REQUIRES: the calling
  // thread holds the transport (receiving_ names it).
  ReceiveResult ReceiveAndDispatch(absl::Duration timeout);
  void HeartbeatLoop();
  // A heartbeat, with the reports the scheduler has not taken yet (caught
  // up, a hand-back's part done).
  void SendHeartbeat();
  void HandleControl(Message&& msg);
  // HandleControl's steps, one per kind of control message.
  // Acknowledges a control message the scheduler keeps until acknowledged.
  void Acknowledge(const wire::Header& h);
  void HandleNodeTable(const wire::Header& h);
  // The answer to a request of CallScheduler: wakes its waiter.
  void AnswerWaiter(const wire::Header& h);
  void HandleNodeDead(const wire::Header& h);
  void HandleAbort(const wire::Header& h);
  // The first node table: finds this node's id and rank in it and installs
  // the peers' identities. False when it is no use (a table came already,
  // it does not list this node, or it counts other server ranks: failure_).
  bool AdoptFirstTable(const wire::NodeTable& table);
  // A node table after the first: renews links to restarted peers.
  void UpdateTable(const wire::NodeTable& table);
  // What a table after the first changed: gathered under mu_, then told
  // (logs, callbacks) with mu_ released.
  struct TableChanges {
    std::vector<int> restarted;
    std::vector<int> died;
    std::vector<int> changed;  // replacements taking a rank, or caught up
    std::vector<int> joined;   // elastic jobs: workers joining
    bool self_dead = false;
    bool self_changed = false;
  };
  // UpdateTable's steps. ApplyTableEntry takes one entry of the table: this
  // node's own, a death, a worker joining under a rank never used, the same
  // process in a new state, or a later life of a known node (a restart, a
  // replacement, a worker joining under a rank that left: ApplyNewLife).
  void ApplyTableEntry(const wire::NodeInfo& n, TableChanges* changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyOwnEntry(const wire::NodeInfo& n, TableChanges* changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyDeath(const wire::NodeInfo& n, TableChanges* changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddJoinedWorker(const wire::NodeInfo& n, TableChanges* changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyNewLife(const wire::NodeInfo& n, wire::NodeInfo* known,
                    TableChanges* changes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndHandbackOnServerChange(const TableChanges& changes);
  void AnnounceTableChanges(const TableChanges& changes);
  void AnnounceDeath(int peer);
  void AnnounceServerChange(int peer);
  bool WantsLink(int peer_id) const;
  // Tells the transport a peer's node key and sealed lane (secured jobs).
  void InstallIdentity(const wire::NodeInfo& n);
  void InstallSchedulerIdentity(const wire::NodeTable& table);
  void Fail(const absl::Status& status);
  // Sends a control request to the scheduler and waits for its reply.
  // Waits until `ready` holds or `deadline` passes. With PS_RESEND, calls
  // `ask_again` (with mu_ released) after PS_RESEND_TIMEOUT without `ready`,
  // then after twice that, up to 8x.
  void AwaitAskingAgain(const absl::Condition& ready, absl::Time deadline,
                        const std::function<void()>& ask_again)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CallScheduler(wire::Command command, wire::Header extra,
                             absl::Duration timeout, const std::string& what);
  // Sends a control message to the scheduler.
  absl::Status SendControl(Message msg);

  const Options options_;
  Callbacks callbacks_;
  std::unique_ptr<Transport> transport_;
  std::string address_;  // advertised ip
  int port_ = 0;
  std::string scheduler_address_;
  int id_ = 0;
  // Register.nonce: random, this process's; an ABORT before the table (id_
  // still 0) counts only when it names it.
  const uint64_t nonce_;
  std::atomic<uint64_t> foreign_aborts_{0};  // aborts for other nodes
  int rank_ = -1;
  std::atomic<uint64_t> next_request_;
  std::atomic<uint64_t> generation_;

  mutable absl::Mutex mu_;
  bool have_table_ ABSL_GUARDED_BY(mu_) = false;
  std::map<int, wire::NodeInfo> nodes_ ABSL_GUARDED_BY(mu_);
  uint64_t local_group_nonce_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t local_group_split_ ABSL_GUARDED_BY(mu_) = 0;
  struct Waiter {
    bool done = false;
    absl::Status status;
  };
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool terminated_ ABSL_GUARDED_BY(mu_) = false;
  bool left_ ABSL_GUARDED_BY(mu_) = false;  // a server's Leave was taken
  bool part_done_ ABSL_GUARDED_BY(mu_) = false;
  bool report_caught_up_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t report_handback_ ABSL_GUARDED_BY(mu_) = 0;  // epoch; 0: none
  absl::Time last_scheduler_contact_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool deliver_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Message> held_
      ABSL_GUARDED_BY(mu_);  // data messages before StartDelivery

  // Who takes messages off the transport: at most one thread at a time.
  enum class Receiver { kNone, kThread, kCaller };
  absl::Mutex receive_mu_;
  absl::CondVar heartbeat_cv_;  // the heartbeat thread sleeps on it (mu_)
  absl::CondVar receiver_cv_;   // the receiver thread waits for its turn
  Receiver receiving_ ABSL_GUARDED_BY(receive_mu_) = Receiver::kNone;
  // When a caller last handed the transport back.
  absl::Time caller_received_ ABSL_GUARDED_BY(receive_mu_) =
      absl::InfinitePast();
  bool receiver_wanted_ ABSL_GUARDED_BY(receive_mu_) = false;  // WakeReceiver
  bool receive_stopped_ ABSL_GUARDED_BY(receive_mu_) = false;
  // A caller found the receiver thread receiving (it steps aside after its
  // current receive).
  std::atomic<bool> caller_waiting_{false};

  std::atomic<bool> stop_{false};
  // PS_DROP_MSG's random numbers; used by the thread that holds the
  // transport (one at a time, ordered by receive_mu_).
  uint32_t drop_state_ = 0;
  std::thread receiver_;
  std::thread heartbeat_;

  // Metrics (MetricsRegistry::Global()): after transport_, so the collectors
  // reading it go first.
  Counter* const heartbeats_sent_;
  Counter* const control_resends_;
  Counter* const foreign_control_metric_;
  std::atomic<uint64_t> foreign_control_{0};  // control messages not from
                                              // the scheduler, dropped
  CollectorHandles metric_handles_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  // This node's part of /debug/pending (role, rank, id, host); first gone.
  DebugPendingRegistry::Section pending_section_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_NODE_H_

// Scheduler: forms a job and watches it. It waits for the configured numbers of
// servers and workers to register, assigns ids and ranks (sorted by advertised
// address, so they do not depend on start order), sends everyone the node
// table, serves barriers, watches heartbeats, and ends the job when every
// worker has finished.
//
// The messages that end a job (TERMINATE, ABORT, NODE_DEAD) and the node
// tables sent after a restart are notices: each is kept until its node
// acknowledges it and sent again meanwhile (PS_RESEND_TIMEOUT, doubling up to
// 8x). Once the end is decided the scheduler keeps serving (heartbeats,
// repeated requests) until every node has acknowledged it, or for at most
// PS_HEARTBEAT_TIMEOUT: the time after which a node that hears nothing gives up
// on the scheduler by itself.
//
//   Scheduler scheduler(options);
//   absl::StatusOr<int> port = scheduler.Bind();   // InvalidArgument: exit 2
//   absl::Status result = scheduler.Run();          // OK: job done; else why it failed
//
// Not thread-safe: one thread calls Bind, then Run.
#ifndef TESSERA_SCHEDULER_SCHEDULER_H_
#define TESSERA_SCHEDULER_SCHEDULER_H_

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/debug_pending.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/options.h"
#include "common/transport.h"
#include "scheduler/barriers.h"
#include "scheduler/local_groups.h"
#include "scheduler/notices.h"

namespace tessera {

// Gives ids and ranks to registered nodes: servers get ids 8, 10, ... and
// workers 9, 11, ..., each role ranked 0..n-1 in the order of the rank each
// registered with (its launcher's start order, DMLC_TASK_ID: launch.py's
// "worker 1" is rank 1), then of (host, port). Nodes registered with a
// negative rank (none: started without a launcher) come after those with
// one, in order of (host, port).
std::vector<wire::NodeInfo> AssignIds(std::vector<wire::NodeInfo> nodes);

class Scheduler {
 public:
  explicit Scheduler(const Options& options,
                     std::unique_ptr<Transport> transport = nullptr);
  ~Scheduler();

  // Binds DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT (with the job's keys unless a
  // transport was given), and serves metrics on that address when
  // TESSERA_METRICS_PORT is set. InvalidArgument naming the variable when the
  // host does not resolve, a port is taken, or the keys are missing or
  // unusable (TESSERA_KEY_FILE / TESSERA_KEY_DIR). REQUIRES: before Run.
  absl::StatusOr<int> Bind();

  // The metrics server's port; 0 when TESSERA_METRICS_PORT is unset.
  int metrics_port() const {
    return metrics_http_ == nullptr ? 0 : metrics_http_->port();
  }

  // Runs until the job ends. OK when every worker finished; DeadlineExceeded
  // when nodes never registered; Unavailable when a node stopped heart-beating.
  absl::Status Run();

 private:
  struct Registration;
  void Handle(Message&& msg);
  // An acknowledgement of a notice (scheduler/notices.h); false when `h`
  // acknowledges none.
  bool Acknowledged(const wire::Header& h);
  // Decides the end of the job: `result` is what Run returns. Tells every
  // reachable node (`end` is the TERMINATE, ABORT or NODE_DEAD to send) and
  // keeps serving until all acknowledged it or PS_HEARTBEAT_TIMEOUT passed.
  void EndJob(const absl::Status& result, const Message& end,
              const std::vector<int>& peers);
  // True while ending and some node has not acknowledged the end.
  bool Ending(absl::Time now);
  // Run's last step once the end is acknowledged: drops what is still queued,
  // logs what the loop handled and returns the job's result.
  absl::Status Finished(absl::Time start, absl::Time now);
  // Before the job formed: ends it past TESSERA_START_TIMEOUT, naming who
  // never registered, and says every kFormationReportInterval what it waits
  // for.
  void WatchFormation(absl::Time start, absl::Time now);
  // Ends a formed job whose nodes registered but never confirmed the table
  // by the start-up deadline: the scheduler cannot reach their addresses.
  void EndForUnreachableNodes();
  // A node entering a barrier: released with the others of its group once
  // all are in.
  void HandleBarrier(int sender, const wire::Header& h);
  // A worker saying it has finished: the job ends when every worker has.
  void HandleWorkerDone(int sender, const wire::Header& h);
  void HandleWorkerLeave(int sender, const wire::Header& h);
  // Ends the job (TERMINATE) once every worker still in it finished; `why`
  // is logged at PS_VERBOSE=1.
  void EndJobIfWorkersDone(const char* why);
  void AnswerDeadNode(int sender, const wire::Header& h, bool acknowledgement);
  void HandleRegister(const Message& msg);
  // HandleRegister's steps (scheduler/registration.cc).
  bool RegistrationAdmissible(const Message& msg);
  // A first registration while the job forms: counted against the role's
  // number (an elastic job's extra workers held for after formation, others
  // past it turned away); the last one forms the job.
  void RegisterBeforeFormation(const Registration& r);
  bool RestartOfKnownNode(const wire::NodeInfo& info, const std::string& key,
                          uint64_t nonce);
  bool NewToTheJob(const wire::NodeInfo& info, const std::string& key,
                   uint64_t nonce);
  void TurnAway(const Registration& r, const std::string& why);
  // Tells the node that registered at `info`'s address, for a moment as
  // `provisional`, that it takes no part: an ABORT naming its registration
  // (`nonce`), which no other node there would take.
  void AbortRegistration(int provisional, const wire::NodeInfo& info,
                         absl::Span<const uint64_t> nonces,
                         const std::string& why);
  // A registration again at the address of one registered or held, with its
  // connection key: its nonce joins that registration's (a restarted process
  // at the address presents a new one; an abort names them all).
  void NoteNonce(const wire::NodeInfo& info, const std::string& key,
                 uint64_t nonce);
  void HoldSpare(const Registration& r);
  void FormJob();
  // A server or worker restarted with the same address: new generation, same
  // id and rank; everyone gets the new table. (A worker that had already
  // finished is told to abort.)
  void Rejoin(int id, const wire::NodeInfo& info, uint64_t nonce);
  // Rejoin of a replicated server: its new process holds none of its slices,
  // so it fails its old life over and takes the rank back as a replacement
  // (unless a spare took it first).
  void RejoinReplicatedServer(int id, const wire::NodeInfo& info,
                              uint64_t nonce);
  // The node table node `for_id` needs (NODE_TABLE): the other role's nodes
  // and its own entry.
  // Links to the node `n` (registered or formed) as `id`: in a secured job
  // to its sealed lane, sealed for its node key, whose records are then
  // taken as `id`'s.
  absl::Status LinkTo(int id, const wire::NodeInfo& n);
  Message TableMessage(int for_id) const;
  // A NODE_TABLE of one changed node (a restart), for nodes holding theirs.
  Message ChangeMessage(const wire::NodeInfo& changed) const;
  static int64_t ThreadCpuMillis();
  void Reply(int peer, const wire::Header& request, const absl::Status& status);
  void Broadcast(const Message& msg, int except);
  // Ends the job (NODE_DEAD to the others) when a node stopped heart-beating.
  void CheckLiveness(absl::Time now);
  // Nodes whose process is gone (their port refuses the connection that
  // closed, Transport::TakeLostLinks) are declared dead at once where the
  // job survives them; issue #46's "noticed in a second".
  void CheckLostLinks(absl::Time now);
  // Whether the job goes on without `n` rather than ending: a server with
  // replicas whose chains all keep a server, an elastic job's worker above
  // the minimum.
  bool SurvivesDeathOf(const wire::NodeInfo& n) const;
  // `id` is dead for `reason` ("stopped heart-beating: ..."): fail-over,
  // an elastic worker's leave, or the job's end.
  void DeclareDead(int id, const std::string& reason);
  // Ends the job because `node` died (or left) and the job cannot go on
  // without it: every live node is told NODE_DEAD with `why`.
  void EndJobForDeathOf(const wire::NodeInfo& node, const std::string& why);
  // Replicated jobs (TESSERA_REPLICAS > 1): server `id` is dead. When every
  // chain of servers still has a live member, every live node is told (a
  // table change marking it dead) and the job goes on; otherwise the job
  // ends naming the slices that lost every replica.
  // `goodbye`: it left (SERVER_LEAVE), marked `left`.
  // `moved`: one copy, and the leaver's slices moved before (a leave).
  void FailOver(int id, const std::string& reason, bool goodbye = false,
                bool moved = false);
  // A server's SERVER_LEAVE: taken (FailOver) when every chain keeps a live
  // member without it, refused naming the chain otherwise.
  void HandleServerLeave(int sender, const wire::Header& h);
  // The first chain of servers (its first rank, and its ranks as text) with
  // no live member once server `without` is gone too; nullopt when every
  // chain keeps one.
  std::optional<std::pair<int, std::string>> LostChain(int without) const;
  // Replicated jobs: a spare (or the dead server restarted) takes dead
  // server `id`'s rank: new generation, catching_up, the next `joined`;
  // every live node is told, the replacement gets its table.
  void Replace(int id, const Registration& with);
  // Elastic jobs (TESSERA_ELASTIC): worker `id` leaves the job, by goodbye
  // (WORKER_LEAVE) or declared dead. Every live node is told (a table change
  // marking it dead, and left for a goodbye), so the servers complete its
  // rounds without it; fewer than the minimum left ends the job naming it.
  void WorkerLeaves(int id, bool goodbye, const std::string& reason);
  // Elastic jobs: a worker registering after the job formed (or a dead one's
  // new process, id its old id) joins under the lowest rank not in the job
  // (`id`, or picked when -1), while fewer than MAX are in it: a new
  // generation and `joined`; every live server is told (a notice), and the
  // joiner gets its table once all of them acknowledged.
  void JoinWorker(const Registration& r, int id);
  void SendJoinerTable(int joiner);
  // Workers in the job: formed and not dead (nor left).
  int WorkersInJob() const;
  // Every worker in the job has finished (the job is done).
  bool AllWorkersDone() const;
  // A held spare, if any, replaces a dead server whose rank is free.
  void PlaceSpares();
  // CAUGHT_UP from replacement `id`: it holds its slices; everyone is told,
  // and its hand-back starts.
  void CaughtUp(int id);
  // Hand-backs (server/replication.h): when none runs, starts one for the
  // first live server that caught up and is not restored yet: a HANDBACK
  // notice to every other live server. A server change (death, leave,
  // replacement, catch-up) gives up the one running first (`GiveUpHandback`).
  void MaybeHandBack();
  // Sends the notices of a hand-back of server `id` (or with `leave`, its
  // leave) and waits for the servers' reports.
  void StartHandback(int id, bool leave);
  // One copy: an error naming server `id` when no other live server that
  // holds key slices (or will, once in its place) stays to take its slices.
  absl::Status LastHolder(int id) const;
  void GiveUpHandback();
  // A hand-back running for options.handback_retry: logged, naming the
  // servers it waits for, and started again (GiveUpHandback, MaybeHandBack).
  void RetryHandback(absl::Time now);
  // HANDBACK from server `sender`: done with hand-back `epoch`. The last one
  // completes it (the rank restored, everyone told).
  void HandbackDone(int sender, uint64_t epoch);
  // The nodes not declared dead, but `except`.
  std::vector<int> LivePeers(int except) const;
  // How many nodes a barrier of `group` waits for (dead servers not).
  int ExpectedInBarrier(int group) const;
  std::string Describe(const wire::NodeInfo& node) const;
  // "1 of 2 worker(s) and 1 of 1 server(s)": who has not registered yet.
  std::string MissingNodes() const;
  // Describe for a node of the table or a registered one (provisional id).
  std::string DescribePeer(int id) const;
  // Who registers with `info`: "the node at host:port", and the node of the
  // job at that address of that role if there is one (a restart, or a node
  // of the job claiming what is not its own).
  std::string DescribeRegistering(const wire::NodeInfo& info) const;
  // Who holds (or held) the sealed node key `key`: the scheduler, a node of
  // the table, a registration, or an earlier life of a restarted node (""
  // when nobody does or the key is empty, as in an insecure job). A
  // registration or restart claiming such a key is ignored: receivers would
  // take the holder's records as the claimer's and drop them, or give an
  // old life's captured records a fresh link state.
  std::string SealedKeyHolder(const std::string& key) const;

  const Options options_;
  std::unique_ptr<Transport> transport_;
  std::string bound_address_;

  struct Registration {
    wire::NodeInfo info;
    int provisional_id = 0;
    std::string hostname;
    int pid = 0;
    std::string key;  // the node's own key it registered with (empty: none)
    // Register.nonce of each process that registered at the address (the
    // first, then restarts of it; at most kMaxNonces): what an abort names.
    std::vector<uint64_t> nonces;
  };
  std::vector<Registration> registered_;
  // Spares (TESSERA_SPARE=1) waiting for a server to die, oldest first, and
  // the replacements made so far (NodeInfo.joined of the next is one more).
  std::deque<Registration> spares_;
  uint32_t replacements_ = 0;
  // The nodes of the job as it formed that have not confirmed its table yet
  // (the start-up deadline's check).
  std::set<int> unconfirmed_at_formation_;
  // TESSERA_MAX_SERVERS: server ranks without a server are in nodes_ as dead,
  // with no address until a server takes one.
  static bool Absent(const wire::NodeInfo& n) {
    return n.role() == wire::SERVER && n.dead() && n.port() == 0;
  }
  // The hand-back running: the server taking back its place, the attempt's
  // number, and the servers whose part is not done yet.
  struct Handback {
    int id = 0;
    bool leave = false;  // one copy: the server leaves (SERVER_LEAVE)
    uint64_t epoch = 0;
    std::set<int> waiting;
    absl::Time started;
  };
  std::optional<Handback> handback_;
  // One copy of each slice (TESSERA_MAX_SERVERS, TESSERA_REPLICAS=1): servers
  // that asked to leave, with the request to answer once their slices moved
  // (a hand-back with `leave`, after any replacement's).
  std::map<int, wire::Header> leaving_;
  uint64_t handback_epochs_ = 0;
  // Names the local groups' shared memory (NodeTable.local_group_nonce).
  const uint64_t local_group_nonce_ = LocalGroupNonce();
  int local_group_split_ = 0;  // NodeTable.local_group_split
  // Elastic jobs: workers joined so far (NodeInfo.joined of the next is one
  // more), and the servers each joiner's table still waits for.
  uint32_t worker_joins_ = 0;
  std::map<int, std::set<int>> join_waits_;
  // Workers of an elastic job that registered before it formed, past
  // DMLC_NUM_WORKER: they join once it has.
  std::vector<Registration> early_joiners_;
  // Index of registered_ (a registration is checked against all before it).
  std::set<std::pair<std::string, int>> registered_at_;  // host, port
  std::map<int, int> registered_by_role_;                // wire::Role -> count
  bool formed_ = false;
  std::map<int, wire::NodeInfo> nodes_;  // by id, once formed
  // The node's own key each node registered with, by id (launch.py's keys;
  // absent for nodes that registered with their role's key): a restart must
  // come with the same.
  std::map<int, std::string> node_key_of_;
  std::set<std::string> registered_keys_;
  // Sealed node key -> the id holding it (provisional before the job forms),
  // or kRetiredKey for a restarted node's earlier key.
  static constexpr int kRetiredKey = -1;
  std::map<std::string, int> sealed_key_holder_;
  std::map<int, absl::Time> last_seen_;  // by id
  std::set<int> done_workers_;
  std::set<int> confirmed_;  // nodes that acknowledged the node table
  absl::Time formed_at_;
  // Until the job forms, what it waits for is logged every
  // kFormationReportInterval.
  static constexpr absl::Duration kFormationReportInterval = absl::Seconds(5);
  absl::Time last_formation_report_;
  // CheckLiveness passes over every node; it runs every kLivenessEvery, not
  // after every message (at 10,000 nodes that pass cost more than the
  // message).
  static constexpr absl::Duration kLivenessEvery = absl::Milliseconds(100);
  absl::Time last_liveness_check_ = absl::InfinitePast();
  bool ended_ = false;       // the end is decided
  absl::Status result_;      // what Run returns once ended
  std::string end_reason_;   // told to nodes that register after the end
  absl::Time end_deadline_;  // stop waiting for acknowledgements
  // Registrations taken off the transport while other messages waited
  // behind them, with when each was taken: they are handled once nothing
  // else waits, or after kRegistrationWait (a registration costs a key
  // check and a link; a heartbeat's answer should not wait for hundreds).
  std::deque<std::pair<absl::Time, Message>> waiting_registrations_;
  static constexpr absl::Duration kRegistrationWait = absl::Milliseconds(20);
  // The next message to handle: one received (a registration set aside
  // while it is not the only thing waiting), or a set-aside registration;
  // a Receive's error when neither.
  absl::StatusOr<Message> NextMessage();
  uint64_t received_ = 0;    // control messages handled, for the summary
  uint64_t heartbeats_ = 0;  // of which heartbeats
  uint64_t malformed_ = 0;   // messages dropped as not for the control plane

  // Metrics (MetricsRegistry::Global()); scraped from the HTTP thread, so
  // counts the Run thread keeps in plain fields are mirrored here.
  struct Metrics {
    Metrics();
    Counter* heartbeats;
    Counter* dead_nodes;
    Counter* failovers;
    Counter* servers_left;
    Counter* replacements;
    Counter* handbacks;
    Counter* handback_retries;
    Gauge* spares;
    Counter* barriers_released;
    Counter* notice_resends;
    Counter* ignored_messages;
    Counter* registrations;
    Gauge* registered_servers;
    Gauge* registered_workers;
    Gauge* finished_workers;
    Gauge* workers_in_job;
    Counter* workers_left;
    Counter* workers_joined;
    Gauge* formed;
    Gauge* oldest_heartbeat_age;
  };
  Metrics metrics_;
  // Node tables, changes, hand-back orders and the job's end, sent until
  // acknowledged (after metrics_: it counts resends there).
  Notices notices_;
  // The open barriers (late ones logged from Run, as a server logs late
  // rounds; docs/debugging.md).
  Barriers barriers_;
  CollectorHandles metric_handles_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;

  absl::Time last_late_check_ = absl::InfinitePast();
  // The nodes of `group` not in its open barrier (nor finished), described.
  std::vector<std::string> MissingFromBarrier(int group) const;

  // /debug/pending: the HTTP thread asks, Run makes it between messages
  // (the scheduler's state is Run's alone) and the asker waits up to 1 s.
  void MakePending(absl::Time now);
  void FillPending(wire::DebugPending* out);
  std::atomic<bool> pending_wanted_{false};
  absl::Mutex pending_mu_;
  absl::CondVar pending_cv_;
  uint64_t pending_asked_ ABSL_GUARDED_BY(pending_mu_) = 0;
  uint64_t pending_made_ ABSL_GUARDED_BY(pending_mu_) = 0;
  absl::Time pending_made_at_ ABSL_GUARDED_BY(pending_mu_);
  wire::DebugPending pending_ ABSL_GUARDED_BY(pending_mu_);
  DebugPendingRegistry::Section pending_section_;  // last: removed first
};

}  // namespace tessera

#endif  // TESSERA_SCHEDULER_SCHEDULER_H_

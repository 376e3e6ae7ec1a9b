// Options: the cluster configuration of one node, read once from the DMLC_* /
// PS_* / TESSERA_* environment (the conventions of MXNet's launcher and
// ps-lite).
//
//   absl::StatusOr<Options> options = Options::FromEnvironment();
//   if (!options.ok()) { std::cerr << options.status().message() << "\n"; return 2; }
//
// Parsing is pure: ParseOptions takes a lookup function, so tests pass a map.
// Parsing only checks syntax and ranges; resolving hosts and interfaces happens
// when a node starts (see net_util.h). Every error message names the variable,
// its value and what was expected.
#ifndef TESSERA_COMMON_OPTIONS_H_
#define TESSERA_COMMON_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

enum class Role { kScheduler, kServer, kWorker };

// dist_ssp's largest staleness bound, in steps (TESSERA_STALENESS,
// KVWorker::SetStaleness); past it the bound would hold nothing back that
// dist_async does not.
inline constexpr int64_t kMaxStaleness = 1000000;

const char* RoleName(Role role);

struct Options {
  Role role = Role::kWorker;
  std::string root_uri;  // DMLC_PS_ROOT_URI: IP (v4 or v6) or hostname
  int root_port = 0;     // DMLC_PS_ROOT_PORT: 1..65535
  // Server ranks: the key partition's servers, DMLC_NUM_SERVER, or
  // TESSERA_MAX_SERVERS when that is set (a replicated job that servers may
  // join: it forms with DMLC_NUM_SERVER of them, `initial_servers`, and the
  // other ranks wait for servers while their slices' replicas answer for
  // them; docs/faults.md, "Servers join").
  int num_servers = 0;
  int initial_servers = 0;  // 0: num_servers
  int servers_at_start() const {
    return initial_servers > 0 ? initial_servers : num_servers;
  }
  int num_workers = 0;  // DMLC_NUM_WORKER: >= 1
  std::string
      interface;  // DMLC_INTERFACE: network interface to take the address of
  std::string
      node_host;  // DMLC_NODE_HOST: advertised address; wins over interface
  int port = 0;   // PORT: port to bind (0: any free one)
  // DMLC_TASK_ID (set by launch.py: servers 0..S-1, workers S..S+W-1): this
  // process's place in its launcher's start order; -1 when unset. The
  // scheduler ranks each role in this order (nodes without one after those
  // with one, by address), so that launch.py's "worker 1" is rank 1.
  int task_id = -1;
  int verbose = 0;  // PS_VERBOSE: 0, 1 or 2
  // PS_HEARTBEAT_INTERVAL / PS_HEARTBEAT_TIMEOUT, seconds (fractions allowed);
  // an interval of 0 turns heartbeats off. On by default, unlike ps-lite.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // TESSERA_START_TIMEOUT: how long the scheduler waits for every node to
  // register and a node waits for the node table.
  absl::Duration start_timeout = absl::Seconds(60);
  // TESSERA_TIMEOUT: deadline of any single request (push, pull, barrier).
  absl::Duration request_timeout = absl::Seconds(600);
  // TESSERA_SERVER_THREADS: update threads of a server (0: one per core, at
  // most 8).
  int server_threads = 0;
  // TESSERA_BIGARRAY_BOUND: arrays with at least this many elements are split
  // over all servers (MXNET_KVSTORE_BIGARRAY_BOUND is honoured too).
  uint64_t bigarray_bound = 1000000;
  // TESSERA_RESTART_COUNT: set by the launcher when it restarts a node.
  uint64_t restart_count = 0;
  // TESSERA_REPLICAS: servers holding each key slice (1..DMLC_NUM_SERVER; 1,
  // no copies, by default): the slice's primary (the server its partition
  // names) and the next replicas - 1 servers after it, which hold every
  // update the primary applied before a worker is answered and take over
  // when it dies (server/replication.h, docs/faults.md).
  int replicas = 1;
  // TESSERA_MAX_SERVERS with TESSERA_REPLICAS=1: servers join and leave a
  // job whose slices have one copy each. A slice's placement follows the
  // chain rules over every server rank (common/replica_chain.h): it is
  // answered by the first rank from its own on that holds its slices, and
  // moves by state transfer and a hand-back, but no server copies another's
  // updates (server/replication.h, "One copy").
  bool single_copy = false;
  // The chain the replication machinery places a slice on: `replicas`
  // ranks, or with one copy every rank (1: no machinery at all).
  int chain_length() const { return single_copy ? num_servers : replicas; }
  // TESSERA_SPARE=1 (servers of a replicated job): a spare, held by the
  // scheduler until a server dies and then given its rank; it waits for that
  // without TESSERA_START_TIMEOUT's deadline (the scheduler ends it with the
  // job).
  bool spare = false;
  // Replicated jobs, the scheduler: a hand-back still waiting for a server's
  // report this long after it started is started again (a new attempt; each
  // server reports once more when its part is done). Not an environment
  // variable: a bound on a lost report, not a tuning knob.
  absl::Duration handback_retry = absl::Seconds(10);
  // TESSERA_ELASTIC=MIN:MAX (launch.py --elastic): workers may leave while the
  // job runs (docs/faults.md, "Elastic jobs"). A worker that says goodbye
  // (SIGTERM) or is declared dead leaves the membership of every dist_sync
  // round that it has not pushed to yet, and the job goes on while at least
  // MIN workers have not left. A worker may join while fewer than MAX are in
  // the job: it takes the lowest rank not in it (one that left, or one of
  // DMLC_NUM_WORKER..MAX-1) and is a member of the rounds from the next one.
  // 0:0 (unset): not elastic, a worker's death ends the job.
  int elastic_min = 0;
  int elastic_max = 0;
  bool elastic() const { return elastic_min > 0; }
  // TESSERA_LOCAL_GROUP=1 (workers): sum the gradients of the workers on this
  // host in shared memory and push each key once per host (docs/
  // local_groups.md). 0 (the default): every worker pushes for itself. The
  // scheduler does not group elastic jobs, nor jobs of one copy whose servers
  // come and go (TESSERA_MAX_SERVERS with TESSERA_REPLICAS=1).
  bool local_group = false;

  // Acknowledged delivery (worker requests). PS_RESEND: 1 (default) keeps each
  // request until its reply and sends it again when no reply came within
  // PS_RESEND_TIMEOUT milliseconds (default 1000), doubling the wait each time
  // up to 8x; TESSERA_RESEND_RETRIES unanswered sends in a row (default 8)
  // fail the request with an error naming the server. 0 turns it off.
  bool resend = true;
  absl::Duration resend_timeout = absl::Milliseconds(1000);
  int resend_retries = 8;
  // PS_DROP_MSG: percent of received data-plane messages dropped on purpose
  // (testing the resend path, as in ps-lite). 0 by default.
  int drop_percent = 0;
  // TESSERA_MAX_MESSAGE_BYTES: the largest single frame a node accepts
  // (ZMQ_MAXMSGSIZE); a peer sending a bigger one is disconnected, and a
  // worker refuses to init a key whose part on one server would be bigger.
  // 1 GiB by default: a 250k x 1024 float32 embedding whole on one server
  // fits; bigger arrays are split over the servers (TESSERA_BIGARRAY_BOUND).
  int64_t max_frame_bytes = int64_t{1} << 30;
  // TESSERA_CHUNK_BYTES: a key's part on one server travels in slices of at
  // most this many bytes (1 MiB by default), each stored, summed and updated
  // on its own; of one push, a worker keeps at most 64 MiB / (workers x this)
  // slices (at least one) in flight per server, so what a server holds for
  // pushes in flight grows neither with its keys nor with the workers.
  int64_t chunk_bytes = int64_t{1} << 20;
  // TESSERA_SYNC_SUM: how a server adds up a dist_sync round. "exact" (the
  // default): each value's exact sum, rounded once, so the same bits in any
  // arrival order (8 bytes per value while the round is open). "arrival":
  // float32 additions in arrival order (4 bytes per value, about 2x faster
  // to add, but the last bits of a sum depend on which push came first).
  bool exact_sync_sum = true;
  // TESSERA_SEND_ORDER (a worker's): "priority" (the default) puts each
  // request's priority in its header, so sending and server queues let the
  // more urgent slices pass (docs/priority.md); "fifo" sends none: every
  // queue keeps issue order (the baseline priority is measured against).
  bool send_priority = true;
  // TESSERA_SEND_CREDIT_BYTES: the credit, what each link's kernel buffers
  // may hold on either end (SO_SNDBUF on the sender's socket, SO_RCVBUF on
  // the receiver's, and the sealed lane's receive queue in records), so that
  // an urgent slice waits behind at most this much of less urgent ones that
  // already left the sending queue (docs/priority.md). 0 (the default): the
  // kernel's own sizes, autotuned up to megabytes on either end (a credit of
  // 1 MiB cost sealed pulls on loopback about a fifth of their throughput).
  int64_t send_credit_bytes = 0;
  // When a dist_sync round (on a server) or a barrier (on the scheduler) is
  // late enough to log whom it waits for: TESSERA_LATE_FACTOR times its
  // recent median, and at least TESSERA_LATE_MIN seconds (docs/debugging.md).
  double late_factor = 10;
  absl::Duration late_min = absl::Seconds(1);
  // TESSERA_STALENESS: dist_ssp's bound s, 0..kMaxStaleness steps
  // (docs/consistency.md); -1 when unset. Read by every role, used by a
  // dist_ssp worker's key inits.
  int64_t staleness = -1;

  // Security of the node's connections (common/curve_keys.h). TESSERA_KEY_FILE:
  // this role's key file; TESSERA_KEY_DIR: a folder holding <role>.key (used
  // when TESSERA_KEY_FILE is unset). TESSERA_INSECURE=1: neither
  // authentication nor encryption (a warning says so; without it a node with
  // no keys refuses to start). TESSERA_AUTH_ONLY=1: authenticated with the
  // keys, bytes not encrypted (trusted links).
  std::string key_file;
  std::string key_dir;
  bool insecure = false;
  bool auth_only = false;
  // TESSERA_JOB_ID: a name of this job, bound into every sealed link's key
  // (common/sealed_link.h), so that two jobs sharing a key folder cannot
  // open each other's records. 1 to 64 letters, digits, '.', '_' or '-';
  // unset: empty, the id of every job that sets none. tools/launch.py gives
  // each job a fresh one.
  std::string job_id;
  // TESSERA_CORE_DUMPS=1: a daemon may leave a core dump (and be traced by
  // its user), key material included. 0 (the default): StartDaemon makes it
  // non-dumpable (PR_SET_DUMPABLE 0).
  bool core_dumps = false;
  // TESSERA_SEALED_PORT: the port of a worker's or server's sealed lane, where
  // its peers' sealed records arrive in a secured job (docs/security.md); 0
  // (the default): any free port, told to the peers in the node table.
  int sealed_port = 0;

  // TESSERA_METRICS_PORT: serve Prometheus metrics over HTTP on this port of
  // the node's advertised address (0: a free port, logged). -1 (unset): off.
  int metrics_port = -1;

  // Reads the process environment.
  static absl::StatusOr<Options> FromEnvironment();
};

// Looks up a variable; std::nullopt when unset.
using EnvLookup =
    std::function<std::optional<std::string>(const std::string& name)>;

absl::StatusOr<Options> ParseOptions(const EnvLookup& lookup);

}  // namespace tessera

#endif  // TESSERA_COMMON_OPTIONS_H_

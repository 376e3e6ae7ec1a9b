// tessera::KVWorker: the C++ client of a Tessera cluster.
//
// A worker process creates one KVWorker, which joins the cluster described by
// the DMLC_* environment (see README.md), then initialises keys, pushes
// gradients and pulls weights. Keys name dense float32 arrays whose length is
// fixed at Init.
//
//   auto kv = tessera::KVWorker::Create("dist_sync");
//   if (!kv.ok()) { std::cerr << kv.status() << "\n"; return 1; }
//   (*kv)->SetOptimizer("sgd lr=0.1");
//   (*kv)->Init(/*key=*/0, weights);
//   auto push = (*kv)->PushAsync(0, grad);     // overlaps with the caller's work
//   ...
//   (*kv)->Wait(push);
//   (*kv)->Pull(0, absl::MakeSpan(weights));
//   (*kv)->Close();
//
// Thread-safety: all methods may be called from several threads at once.
// Buffers given to the *Async methods are owned by the caller and must stay
// alive (and, for pulls, untouched) until Wait on the returned handle has
// returned.
//
// Errors: every method returns absl::Status; InvalidArgument for caller
// mistakes (wrong length, unknown key, bad optimizer spec), FailedPrecondition
// for calls in the wrong order, Unavailable when a node of the job died,
// DeadlineExceeded when a reply did not come within TESSERA_TIMEOUT seconds.
#ifndef TESSERA_KV_WORKER_H_
#define TESSERA_KV_WORKER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessera/export.h"

namespace tessera {

// Identifies an asynchronous operation; pass it to KVWorker::Wait exactly once.
using OpHandle = uint64_t;

// Byte counters of one worker, for metrics.
struct KVWorkerStats {
  uint64_t bytes_pushed =
      0;  // payload bytes sent in pushes (after compression)
  uint64_t bytes_pulled = 0;  // payload bytes received in pulls (on the wire)
  // What the pulls stand for as float32 (bytes_pulled without compression).
  uint64_t bytes_pulled_float32 = 0;
  uint64_t pushes = 0;
  uint64_t pulls = 0;
  uint64_t resends = 0;  // requests sent again after no answer in time
  // Host-local aggregation (TESSERA_LOCAL_GROUP=1): payload bytes this worker
  // would have pushed and pulled without its local group, less those it did.
  uint64_t group_bytes_saved = 0;
};

// A pulled value lent without a copy (KVWorker::PullViewAsync): the frames
// the servers' replies arrived in, one per part of the key (a key bigger than
// TESSERA_CHUNK_BYTES, or at least TESSERA_BIGARRAY_BOUND values on several
// servers, arrives in several parts). It keeps those frames alive for as long
// as it or a copy of it lives; copies share them. Read-only. Read it only
// after Wait on the pull has returned OK.
//
//   tessera::PulledValue w;
//   auto h = (*kv)->PullViewAsync(0, &w);
//   (*kv)->Wait(*h);
//   absl::Span<const float> weights = w.span();  // one part: no copy at all
class TESSERA_EXPORT PulledValue {
 public:
  PulledValue() = default;

  // The key's length in values (0 before PullViewAsync).
  size_t size() const;
  // The parts, in order: part(i) holds the values from offset(i) on.
  size_t num_parts() const;
  size_t offset(size_t i) const;
  absl::Span<const float> part(size_t i) const;
  // All the values in one span when they arrived in one part; empty when
  // num_parts() != 1 (use part() or CopyTo then).
  absl::Span<const float> span() const;
  // Copies the values into `out` (size() floats); InvalidArgument otherwise.
  absl::Status CopyTo(absl::Span<float> out) const;

  struct Rep;  // worker/client/pulled_value_rep.h

 private:
  friend class KVClient;
  std::shared_ptr<const Rep> rep_;
};

class TESSERA_EXPORT KVWorker {
 public:
  // Joins the cluster given by the DMLC_* environment as a worker. `type` is
  // "dist_sync", "dist_async", "dist_device_sync" (MXNet's name: dist_sync
  // with the workers of each host summing their pushes there first, as
  // TESSERA_LOCAL_GROUP=1 does; docs/local_groups.md) or "dist_ssp"
  // (bounded staleness: pushes are
  // applied on arrival, as in dist_async, and a pull made after c pushes to
  // a key waits until every worker in the job has had at least c - s of its
  // pushes to the key applied; docs/consistency.md). dist_ssp takes its
  // bound s from TESSERA_STALENESS or SetStaleness. Blocks until the node
  // table has arrived. InvalidArgument for another type, or a
  // TESSERA_STALENESS that is not a whole number in 0..1000000.
  // Turns off Abseil's mutex deadlock detection for the process (a debugging
  // aid, on by default in Debian's Abseil, that costs more than the rest of
  // a lock).
  static absl::StatusOr<std::unique_ptr<KVWorker>> Create(
      const std::string& type);

  // Out of line (kv_worker.cc): the class's vtable and type_info live in
  // libtessera, exported once, not in every program that includes this.
  virtual ~KVWorker();

  virtual int rank() const = 0;
  virtual int num_workers() const = 0;
  virtual int num_servers() const = 0;
  virtual bool is_sync() const = 0;

  // Sets the server-side optimizer, e.g. "sgd lr=0.1 momentum=0.9 wd=1e-4",
  // "adam lr=0.001", "none". Every worker may call it with the same spec;
  // servers apply it once. REQUIRES: before the first Init.
  virtual absl::Status SetOptimizer(const std::string& spec) = 0;

  // Sets gradient compression: type "2bit" (threshold > 0) or "none".
  // REQUIRES: before the first Init.
  virtual absl::Status SetGradientCompression(const std::string& type,
                                              float threshold) = 0;

  // Sets pull compression: "2bit" or "none" (the default). With "2bit" a pull
  // brings only the change of the weights since this worker's last pull,
  // 2-bit coded against a threshold the server chooses per change; the server
  // keeps what it has not sent yet for later pulls (error feedback), and this
  // worker keeps its own copy of each key (its memory: one copy of the
  // weights), which is exactly what the server believes it holds. The first
  // pull of a key, and any pull after a server or this worker restarted,
  // brings the server's copy whole. A pull therefore returns the weights as
  // the compression has brought them so far, not the server's exact weights.
  // Pushpull replies stay float32. Row pulls (PullRows) bring bfloat16 rows
  // instead (each value rounded to nearest, ties to even; no state on either
  // side; docs/compression.md). REQUIRES: before the first Init.
  virtual absl::Status SetPullCompression(const std::string& type) = 0;

  // dist_ssp: sets the staleness bound s of the keys initialised after it
  // (every worker sets the same; rank 0's inits carry it), overriding
  // TESSERA_STALENESS. A pull made after c pushes to a key never misses a
  // push numbered below c - s (the first push is 0) of any worker in the
  // job; s = 0 makes every step wait for the slowest worker, with each push
  // applied on its own (no round sum). InvalidArgument for s outside
  // 0..1000000; FailedPrecondition in a dist_sync or dist_async store, or
  // after the first Init. A dist_ssp store's first Init fails
  // (FailedPrecondition) while neither gave a bound.
  virtual absl::Status SetStaleness(int64_t staleness) = 0;

  // Declares `key` with the length of `value`. Every worker calls Init for the
  // same keys in the same order; rank 0's value is stored. Returns after a
  // barrier of the workers.
  //
  // In a worker restarted into a running job (TESSERA_RESTART_COUNT > 0, as
  // tools/launch.py --restarts sets it) whose keys the servers hold, Init
  // stores nothing: it learns from the servers how many of this worker's pushes
  // to the key they took (see ResumeRound), and joins the init barrier only if
  // the other workers are waiting in one (its earlier life died before it).
  virtual absl::Status Init(uint64_t key, absl::Span<const float> value) = 0;

  // The step a restarted worker resumes at: after its Inits, the number of
  // pushes of every key the servers took from its earlier life (the smallest
  // over the keys; a push whose dist_sync round was still open counts). The
  // next push of each key is numbered from there, so a program that pushes
  // each key once per step skips ResumeRound() steps and pushes on; a push the
  // servers already took is answered (once its round is applied) and not
  // applied twice. 0 in a worker's first life.
  virtual uint64_t ResumeRound() = 0;

  // How urgent `key`'s pushes and pulls are (MXNet's `priority`; higher goes
  // first): each sending queue and each server's queue lets a slice pass the
  // queued slices of less urgent keys (docs/priority.md). By default the
  // reverse of the order the keys were initialised in (the first key 0, the
  // next -1, ...), so the first layer's weights come back first. Takes effect
  // for the requests sent from then on (resends too). NotFound for a key not
  // initialised here; InvalidArgument for a priority outside
  // [-1000000000, 1000000000]. With TESSERA_SEND_ORDER=fifo priorities are
  // kept but not sent: every queue keeps issue order.
  virtual absl::Status SetPriority(uint64_t key, int64_t priority) = 0;
  virtual absl::StatusOr<int64_t> Priority(uint64_t key) const = 0;

  // Pushes a gradient for `key` (compressed when compression is set). In
  // dist_sync the operation completes once the round it belongs to is applied
  // on the servers; in dist_async and dist_ssp once the servers have applied
  // this push.
  virtual absl::StatusOr<OpHandle> PushAsync(uint64_t key,
                                             absl::Span<const float> grad) = 0;

  // Pushes a gradient that lives in GPU memory (a CUDA device pointer). With
  // 2-bit compression the gradient is compressed on the GPU (residual kept
  // there) and only the packed bytes cross PCIe. `cuda_stream` is a
  // cudaStream_t or nullptr. Fails with FailedPrecondition when this build or
  // machine has no CUDA.
  virtual absl::StatusOr<OpHandle> PushDeviceAsync(uint64_t key,
                                                   const float* device_grad,
                                                   size_t len,
                                                   void* cuda_stream) = 0;

  // Pulls the current value of `key` into `out` (whose length must be the
  // key's). A pull issued after this worker's push of a round sees that round's
  // result. In dist_ssp a pull issued after this worker's c-th push to the
  // key completes once every worker in the job has had c - s pushes to it
  // applied, and sees them (and this worker's c).
  virtual absl::StatusOr<OpHandle> PullAsync(uint64_t key,
                                             absl::Span<float> out) = 0;

  // Pulls the current value of `key` as PullAsync does, but lends the
  // received frames to the caller (`*out`, set at once, readable after Wait)
  // instead of copying them into a buffer: the one copy a pull makes on the
  // worker is gone, so a large pull moves at the transport's speed. With pull
  // compression the worker's copy is copied out (that copy is needed anyway).
  virtual absl::StatusOr<OpHandle> PullViewAsync(uint64_t key,
                                                 PulledValue* out) = 0;

  // Push then pull in one request per server part.
  virtual absl::StatusOr<OpHandle> PushPullAsync(uint64_t key,
                                                 absl::Span<const float> grad,
                                                 absl::Span<float> out) = 0;

  // Row-sparse keys: a num_rows x row_length float32 matrix of which pushes
  // and pulls name only some rows (MXNet's row_sparse arrays, for embeddings
  // and sparse inputs). Init as Init does (every worker, same order, rank 0's
  // value stored); `value` (num_rows * row_length floats) may be nullptr for
  // zeros, so a big embedding need not cross the wire. A key at least
  // TESSERA_BIGARRAY_BOUND values big is split over every server by rows.
  virtual absl::Status InitRows(uint64_t key, const float* value,
                                uint64_t num_rows, uint64_t row_length) = 0;
  // Hashed row keys (embeddings for any feature id): rows of row_length
  // float32 named by arbitrary uint64 ids, spread over the servers by a hash
  // of the id. A server creates a row for an id when a push names it (pulls
  // of an id without a row read the row it would be created with), keeps at
  // most `capacity` rows, admits an id only after `admit_after` pushes named
  // it and evicts rows not pushed for `expire_after` rounds. `options`: the
  // text common/hashed_spec.h describes, e.g. "init=normal std=0.01 seed=7
  // admit_after=2 expire_after=1000 capacity=1000000" ("" for zeros, no
  // admission filter, no expiry, no bound); InvalidArgument naming a bad
  // option. Then PushRows / PullRows with any ids. Init as Init does (every
  // worker, same order).
  virtual absl::Status InitHashed(uint64_t key, uint64_t row_length,
                                  const std::string& options) = 0;
  // Pushes the gradients of some rows: `rows` holds row_ids.size() rows of
  // row_length values, one after another; ids may repeat (summed). In
  // dist_sync every worker pushes once per round (an empty set of rows
  // too); the optimizer then updates only the rows present in the round (a
  // lazy update: the others keep their weights and optimizer state); with no
  // optimizer the rows present become the round's sum. With 2-bit
  // compression the rows are compressed with error feedback kept per row.
  // InvalidArgument naming the key and id for an id >= num_rows, the wrong
  // number of values, or a dense key.
  virtual absl::StatusOr<OpHandle> PushRowsAsync(
      uint64_t key, absl::Span<const uint64_t> row_ids,
      absl::Span<const float> rows) = 0;
  // Pulls the named rows, in that order (ids may repeat; none is allowed),
  // into `out` (row_ids.size() * row_length floats). Rows travel float32
  // (bfloat16 under pull compression).
  virtual absl::StatusOr<OpHandle> PullRowsAsync(
      uint64_t key, absl::Span<const uint64_t> row_ids,
      absl::Span<float> out) = 0;
  // The row length of a row-sparse key; NotFound / InvalidArgument (dense).
  virtual absl::StatusOr<uint64_t> RowLength(uint64_t key) const = 0;
  absl::Status PushRows(uint64_t key, absl::Span<const uint64_t> row_ids,
                        absl::Span<const float> rows);
  absl::Status PullRows(uint64_t key, absl::Span<const uint64_t> row_ids,
                        absl::Span<float> out);

  // Waits for an operation and returns its result.
  virtual absl::Status Wait(OpHandle handle) = 0;

  // Blocking forms.
  absl::Status Push(uint64_t key, absl::Span<const float> grad);
  absl::Status Pull(uint64_t key, absl::Span<float> out);
  absl::StatusOr<PulledValue> PullView(uint64_t key);
  absl::Status PushPull(uint64_t key, absl::Span<const float> grad,
                        absl::Span<float> out);

  // Barrier of all workers.
  virtual absl::Status Barrier() = 0;

  // Barrier of the workers, then tells the scheduler this worker is done and
  // leaves. Further calls fail with FailedPrecondition.
  virtual absl::Status Close() = 0;

  // Elastic jobs (TESSERA_ELASTIC, launch.py --elastic): leaves the job
  // before its end, without the workers' barrier, e.g. on SIGTERM after the
  // step in progress. REQUIRES: every operation of this worker was waited
  // for (its pushes then count in their rounds). The scheduler takes it out
  // of the membership and the servers complete every later round without
  // it; the others go on while at least the minimum remain. Further calls
  // fail with FailedPrecondition; FailedPrecondition too in a job that is
  // not elastic.
  virtual absl::Status Leave() = 0;

  virtual KVWorkerStats stats() const = 0;
};

}  // namespace tessera

#endif  // TESSERA_KV_WORKER_H_

/* Tessera's C API: a worker's view of a Tessera key-value store, for any
 * language.
 *
 * Every function that returns int returns 0 (TESSERA_OK) on success and, on
 * failure, the status code of the failure: one of the TesseraStatusCode
 * values below, which are absl::StatusCode's (e.g. TESSERA_INVALID_ARGUMENT
 * for a caller's mistake, TESSERA_FAILED_PRECONDITION for a call in the wrong
 * order, TESSERA_UNAVAILABLE when a node of the job died,
 * TESSERA_DEADLINE_EXCEEDED when a reply did not come in time; see
 * kv_worker.h). tessera_last_error() then describes the last failure on the
 * calling thread as "CODE: message". A caller that only needs success or
 * failure tests for non-zero. The cluster is given by the DMLC_* environment
 * (see README.md); tools/launch.py sets it.
 *
 *   TesseraKV* kv;
 *   if (tessera_kv_create("dist_sync", &kv) != 0) { puts(tessera_last_error()); return 1; }
 *   tessera_kv_set_optimizer(kv, "sgd lr=0.1");
 *   tessera_kv_init(kv, 0, weights, n);
 *   tessera_kv_push(kv, 0, grad, n);
 *   tessera_kv_pull(kv, 0, weights, n);
 *   tessera_kv_close(kv);
 *
 * Build: cc prog.c $(pkg-config --cflags --libs tessera)
 */
#ifndef TESSERA_C_API_H_
#define TESSERA_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "tessera/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a failed call returns: absl::StatusCode's values, so that C callers can
 * tell failures apart without parsing tessera_last_error(). The functions
 * return int; a value not listed here (from a newer Abseil) is a failure too.
 */
typedef enum TesseraStatusCode {
  TESSERA_OK = 0,
  TESSERA_CANCELLED = 1,
  TESSERA_UNKNOWN = 2,
  TESSERA_INVALID_ARGUMENT = 3,
  TESSERA_DEADLINE_EXCEEDED = 4,
  TESSERA_NOT_FOUND = 5,
  TESSERA_ALREADY_EXISTS = 6,
  TESSERA_PERMISSION_DENIED = 7,
  TESSERA_RESOURCE_EXHAUSTED = 8,
  TESSERA_FAILED_PRECONDITION = 9,
  TESSERA_ABORTED = 10,
  TESSERA_OUT_OF_RANGE = 11,
  TESSERA_UNIMPLEMENTED = 12,
  TESSERA_INTERNAL = 13,
  TESSERA_UNAVAILABLE = 14,
  TESSERA_DATA_LOSS = 15,
  TESSERA_UNAUTHENTICATED = 16
} TesseraStatusCode;

/* The library's version, "MAJOR.MINOR.PATCH" (the VERSION file at the top of
 * the source tree); a static string. */
TESSERA_EXPORT const char* tessera_version(void);

typedef struct TesseraKV TesseraKV;

/* Joins the cluster as a worker. type: "dist_sync", "dist_async",
 * "dist_device_sync" (dist_sync with each host's workers summed there first,
 * docs/local_groups.md) or "dist_ssp" (bounded staleness, its bound from
 * TESSERA_STALENESS or tessera_kv_set_staleness; see KVWorker::Create and
 * docs/consistency.md). */
TESSERA_EXPORT int tessera_kv_create(const char* type, TesseraKV** out);
TESSERA_EXPORT int tessera_kv_rank(const TesseraKV* kv, int* rank);
TESSERA_EXPORT int tessera_kv_num_workers(const TesseraKV* kv,
                                          int* num_workers);
TESSERA_EXPORT int tessera_kv_num_servers(const TesseraKV* kv,
                                          int* num_servers);
/* Called by every worker, in the same order; rank 0's value is stored. Returns
 * when stored (includes a barrier of the workers). */
TESSERA_EXPORT int tessera_kv_init(TesseraKV* kv, uint64_t key,
                                   const float* value, size_t len);
/* dist_sync: returns once the round it belongs to is applied; dist_async: once
 * the servers applied this push. */
TESSERA_EXPORT int tessera_kv_push(TesseraKV* kv, uint64_t key,
                                   const float* grad, size_t len);
TESSERA_EXPORT int tessera_kv_pull(TesseraKV* kv, uint64_t key, float* out,
                                   size_t len);
TESSERA_EXPORT int tessera_kv_pushpull(TesseraKV* kv, uint64_t key,
                                       const float* grad, float* out,
                                       size_t len);

/* Asynchronous forms: each issues the operation and returns at once with a
 * handle in *handle; tessera_kv_wait(kv, handle) waits for it and returns its
 * result (pulled values are written into `out` inside tessera_kv_wait). Several
 * operations may be in flight at once, e.g. a push per layer while backward
 * still runs. The caller's buffers are borrowed, not copied: `grad` must stay
 * valid and unchanged, and `out` valid and unread, until tessera_kv_wait on the
 * handle has returned. REQUIRES: every handle is waited for exactly once, and
 * before tessera_kv_close. An unknown handle fails (InvalidArgument). */
TESSERA_EXPORT int tessera_kv_push_async(TesseraKV* kv, uint64_t key,
                                         const float* grad, size_t len,
                                         uint64_t* handle);
TESSERA_EXPORT int tessera_kv_pull_async(TesseraKV* kv, uint64_t key,
                                         float* out, size_t len,
                                         uint64_t* handle);
TESSERA_EXPORT int tessera_kv_pushpull_async(TesseraKV* kv, uint64_t key,
                                             const float* grad, float* out,
                                             size_t len, uint64_t* handle);
TESSERA_EXPORT int tessera_kv_wait(TesseraKV* kv, uint64_t handle);

TESSERA_EXPORT int tessera_kv_barrier(TesseraKV* kv);
/* e.g. "sgd lr=0.1 momentum=0.9 wd=0.0001", "adam lr=0.001", "none". Before any
 * init. */
TESSERA_EXPORT int tessera_kv_set_optimizer(TesseraKV* kv, const char* spec);
/* dist_ssp: the staleness bound s, 0..1000000 steps: a pull made after c
 * pushes to a key waits until every worker in the job has had c - s of its
 * pushes to the key applied. Before any init; overrides TESSERA_STALENESS
 * (see KVWorker::SetStaleness). */
TESSERA_EXPORT int tessera_kv_set_staleness(TesseraKV* kv, int64_t staleness);
/* How urgent `key`'s pushes and pulls are, higher first (MXNet's `priority`;
 * see KVWorker::SetPriority): -1000000000..1000000000; by default minus the
 * number of keys initialised before it. After the key's init. */
TESSERA_EXPORT int tessera_kv_set_priority(TesseraKV* kv, uint64_t key,
                                           int64_t priority);
TESSERA_EXPORT int tessera_kv_priority(TesseraKV* kv, uint64_t key,
                                       int64_t* priority);
/* "2bit" (threshold > 0) or "none". Before any init. */
TESSERA_EXPORT int tessera_kv_set_gradient_compression(TesseraKV* kv,
                                                       const char* type,
                                                       float threshold);
/* "2bit" or "none" (the default): pulls bring the change of the weights since
 * this worker's last pull, 2-bit coded, into a copy this worker keeps, and row
 * pulls bring bfloat16 rows (see KVWorker::SetPullCompression). Before any
 * init. */
TESSERA_EXPORT int tessera_kv_set_pull_compression(TesseraKV* kv,
                                                   const char* type);

/* A pull without a copy (KVWorker::PullView): the received frames are lent to
 * the caller in *out, one part per server slice of the key, until
 * tessera_pulled_free(*out). Read-only.
 *
 *   TesseraPulled* w;
 *   if (tessera_kv_pull_view(kv, 0, &w) != 0) { puts(tessera_last_error()); }
 *   size_t offset, len;
 *   const float* part = tessera_pulled_part(w, 0, &offset, &len);
 *   ...
 *   tessera_pulled_free(w);
 */
typedef struct TesseraPulled TesseraPulled;
TESSERA_EXPORT int tessera_kv_pull_view(TesseraKV* kv, uint64_t key,
                                        TesseraPulled** out);
/* The pulled values. */
TESSERA_EXPORT size_t tessera_pulled_size(const TesseraPulled* pulled);
TESSERA_EXPORT size_t tessera_pulled_num_parts(const TesseraPulled* pulled);
/* Part i's first value, and its offset and length in values where those are
 * not NULL; NULL when i >= tessera_pulled_num_parts. */
TESSERA_EXPORT const float* tessera_pulled_part(const TesseraPulled* pulled,
                                                size_t i, size_t* offset,
                                                size_t* len);
/* NULL is allowed. */
TESSERA_EXPORT void tessera_pulled_free(TesseraPulled* pulled);

/* Row-sparse keys (see KVWorker::InitRows): a num_rows x row_length float32
 * matrix whose pushes and pulls name some rows. value may be NULL (zeros).
 * A push carries num_ids * row_length values; a pull fills as many. In
 * dist_sync every worker pushes once per round, an empty set of rows too. */
TESSERA_EXPORT int tessera_kv_init_rows(TesseraKV* kv, uint64_t key,
                                        const float* value, size_t num_rows,
                                        size_t row_length);
/* Hashed row keys (see KVWorker::InitHashed): rows of row_length float32 named
 * by any uint64 id; push and pull them with tessera_kv_push_rows /
 * tessera_kv_pull_rows. options: "" or text such as "init=normal std=0.01
 * seed=7 admit_after=2 expire_after=1000 capacity=1000000"
 * (docs/embeddings.md). */
TESSERA_EXPORT int tessera_kv_init_hashed(TesseraKV* kv, uint64_t key,
                                          size_t row_length,
                                          const char* options);
TESSERA_EXPORT int tessera_kv_push_rows(TesseraKV* kv, uint64_t key,
                                        const uint64_t* row_ids, size_t num_ids,
                                        const float* rows);
TESSERA_EXPORT int tessera_kv_pull_rows(TesseraKV* kv, uint64_t key,
                                        const uint64_t* row_ids, size_t num_ids,
                                        float* out);
/* Barrier of the workers, then leaves the job and frees kv (also on failure).
 */
TESSERA_EXPORT int tessera_kv_close(TesseraKV* kv);
/* Elastic jobs (TESSERA_ELASTIC): leaves the job before its end, without the
 * workers' barrier, once every operation was waited for; the rounds go on
 * without this worker (KVWorker::Leave). Frees kv (also on failure). */
TESSERA_EXPORT int tessera_kv_leave(TesseraKV* kv);
TESSERA_EXPORT const char* tessera_last_error(void);

/* Tessera's addition for restarted workers (tools/launch.py --restarts). In a
 * worker restarted into a running job, after its inits: the round its pushes
 * resume at, i.e. the number of pushes of every key the servers took from its
 * earlier life (the smallest over the keys). A program that pushes each key
 * once per step skips that many steps; a push the servers already took is
 * answered and not applied again. 0 in a worker's first life. */
TESSERA_EXPORT int tessera_kv_resume_round(TesseraKV* kv, uint64_t* round);

/* MXNet's 2-bit gradient format, for checking it from other code. */
TESSERA_EXPORT size_t tessera_2bit_compressed_bytes(size_t len);
/* residual (len floats) is updated in place; out receives
 * tessera_2bit_compressed_bytes(len). */
TESSERA_EXPORT int tessera_2bit_quantize(const float* grad, float* residual,
                                         size_t len, float threshold,
                                         uint8_t* out);
/* in holds tessera_2bit_compressed_bytes(len) bytes. */
TESSERA_EXPORT int tessera_2bit_dequantize(const uint8_t* in, size_t len,
                                           float threshold, float* out);

#ifdef __cplusplus
}
#endif

#endif /* TESSERA_C_API_H_ */

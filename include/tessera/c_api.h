/* Tessera's C API: a worker's view of a Tessera key-value store, for any
 * language.
 *
 * Every function returns 0 on success and non-zero on failure;
 * tessera_last_error() then describes the last failure on the calling thread.
 * The cluster is given by the DMLC_* environment (see README.md);
 * tools/launch.py sets it.
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

#ifdef __cplusplus
extern "C" {
#endif

typedef struct TesseraKV TesseraKV;

/* Joins the cluster as a worker. type: "dist_sync" or "dist_async". */
int tessera_kv_create(const char* type, TesseraKV** out);
int tessera_kv_rank(const TesseraKV* kv, int* rank);
int tessera_kv_num_workers(const TesseraKV* kv, int* num_workers);
int tessera_kv_num_servers(const TesseraKV* kv, int* num_servers);
/* Called by every worker, in the same order; rank 0's value is stored. Returns
 * when stored (includes a barrier of the workers). */
int tessera_kv_init(TesseraKV* kv, uint64_t key, const float* value,
                    size_t len);
/* dist_sync: returns once the round it belongs to is applied; dist_async: once
 * the servers applied this push. */
int tessera_kv_push(TesseraKV* kv, uint64_t key, const float* grad, size_t len);
int tessera_kv_pull(TesseraKV* kv, uint64_t key, float* out, size_t len);
int tessera_kv_pushpull(TesseraKV* kv, uint64_t key, const float* grad,
                        float* out, size_t len);

/* Asynchronous forms: each issues the operation and returns at once with a
 * handle in *handle; tessera_kv_wait(kv, handle) waits for it and returns its
 * result (pulled values are written into `out` inside tessera_kv_wait). Several
 * operations may be in flight at once, e.g. a push per layer while backward
 * still runs. The caller's buffers are borrowed, not copied: `grad` must stay
 * valid and unchanged, and `out` valid and unread, until tessera_kv_wait on the
 * handle has returned. REQUIRES: every handle is waited for exactly once, and
 * before tessera_kv_close. An unknown handle fails (InvalidArgument). */
int tessera_kv_push_async(TesseraKV* kv, uint64_t key, const float* grad,
                          size_t len, uint64_t* handle);
int tessera_kv_pull_async(TesseraKV* kv, uint64_t key, float* out, size_t len,
                          uint64_t* handle);
int tessera_kv_pushpull_async(TesseraKV* kv, uint64_t key, const float* grad,
                              float* out, size_t len, uint64_t* handle);
int tessera_kv_wait(TesseraKV* kv, uint64_t handle);

int tessera_kv_barrier(TesseraKV* kv);
/* e.g. "sgd lr=0.1 momentum=0.9 wd=0.0001", "adam lr=0.001", "none". Before any
 * init. */
int tessera_kv_set_optimizer(TesseraKV* kv, const char* spec);
/* "2bit" (threshold > 0) or "none". Before any init. */
int tessera_kv_set_gradient_compression(TesseraKV* kv, const char* type,
                                        float threshold);
/* "2bit" or "none" (the default): pulls bring the change of the weights since
 * this worker's last pull, 2-bit coded, into a copy this worker keeps (see
 * KVWorker::SetPullCompression). Before any init. */
int tessera_kv_set_pull_compression(TesseraKV* kv, const char* type);

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
int tessera_kv_pull_view(TesseraKV* kv, uint64_t key, TesseraPulled** out);
size_t tessera_pulled_size(const TesseraPulled* pulled);  /* values */
size_t tessera_pulled_num_parts(const TesseraPulled* pulled);
/* Part i's first value, and its offset and length in values where those are
 * not NULL; NULL when i >= tessera_pulled_num_parts. */
const float* tessera_pulled_part(const TesseraPulled* pulled, size_t i,
                                 size_t* offset, size_t* len);
void tessera_pulled_free(TesseraPulled* pulled);  /* NULL is allowed */

/* Row-sparse keys (see KVWorker::InitRows): a num_rows x row_length float32
 * matrix whose pushes and pulls name some rows. value may be NULL (zeros).
 * A push carries num_ids * row_length values; a pull fills as many. In
 * dist_sync every worker pushes once per round, an empty set of rows too. */
int tessera_kv_init_rows(TesseraKV* kv, uint64_t key, const float* value,
                         size_t num_rows, size_t row_length);
int tessera_kv_push_rows(TesseraKV* kv, uint64_t key, const uint64_t* row_ids,
                         size_t num_ids, const float* rows);
int tessera_kv_pull_rows(TesseraKV* kv, uint64_t key, const uint64_t* row_ids,
                         size_t num_ids, float* out);
/* Barrier of the workers, then leaves the job and frees kv (also on failure).
 */
int tessera_kv_close(TesseraKV* kv);
const char* tessera_last_error(void);

/* Tessera's addition for restarted workers (tools/launch.py --restarts). In a
 * worker restarted into a running job, after its inits: the round its pushes
 * resume at, i.e. the number of pushes of every key the servers took from its
 * earlier life (the smallest over the keys). A program that pushes each key
 * once per step skips that many steps; a push the servers already took is
 * answered and not applied again. 0 in a worker's first life. */
int tessera_kv_resume_round(TesseraKV* kv, uint64_t* round);

/* MXNet's 2-bit gradient format, for checking it from other code. */
size_t tessera_2bit_compressed_bytes(size_t len);
/* residual (len floats) is updated in place; out receives
 * tessera_2bit_compressed_bytes(len). */
int tessera_2bit_quantize(const float* grad, float* residual, size_t len,
                          float threshold, uint8_t* out);
/* in holds tessera_2bit_compressed_bytes(len) bytes. */
int tessera_2bit_dequantize(const uint8_t* in, size_t len, float threshold,
                            float* out);

#ifdef __cplusplus
}
#endif

#endif /* TESSERA_C_API_H_ */

/* A worker for tools/bench/many_processes.py (issue #19), C API only.
 *
 *   scale_worker VALUES ROUNDS BARRIERS
 *
 * Joins the job (tessera_kv_create), runs BARRIERS worker barriers, initialises
 * key 1 with VALUES floats (dist_sync, no optimizer: the store becomes each
 * round's sum), then ROUNDS times pushes rank+1 everywhere and pulls, checking
 * n(n+1)/2. Prints one line:
 *   SCALE rank=R joined_unix_ms=T barrier_ms=B rounds_ms=X close_ms=C
 * (joined_unix_ms: wall clock when tessera_kv_create returned, for the
 * driver's formation time; barrier_ms: the mean of the barriers; rounds_ms:
 * all rounds; close_ms: tessera_kv_close). Exit 0 when every check passed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tessera/c_api.h"

static double Now(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: scale_worker VALUES ROUNDS BARRIERS\n");
    return 2;
  }
  const size_t n = strtoull(argv[1], NULL, 10);
  const int rounds = atoi(argv[2]);
  const int barriers = atoi(argv[3]);
  if (n == 0 || rounds < 0 || barriers < 0) {
    fprintf(stderr, "scale_worker: VALUES must be > 0, ROUNDS and BARRIERS >= 0\n");
    return 2;
  }
  TesseraKV* kv;
  if (tessera_kv_create("dist_sync", &kv) != 0) {
    fprintf(stderr, "scale_worker: %s\n", tessera_last_error());
    return 1;
  }
  const double joined = Now(CLOCK_REALTIME);
  int rank = 0, workers = 0;
  tessera_kv_rank(kv, &rank);
  tessera_kv_num_workers(kv, &workers);
  float* w = calloc(n, sizeof(float));
  float* g = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) g[i] = (float)(rank + 1);
  double t0 = Now(CLOCK_MONOTONIC);
  for (int b = 0; b < barriers; ++b) {
    if (tessera_kv_barrier(kv) != 0) goto fail;
  }
  const double barrier_ms =
      barriers > 0 ? (Now(CLOCK_MONOTONIC) - t0) / barriers : 0.0;
  if (tessera_kv_init(kv, 1, w, n) != 0) goto fail;
  const float want = workers * (workers + 1) / 2.0f;
  t0 = Now(CLOCK_MONOTONIC);
  for (int r = 0; r < rounds; ++r) {
    if (tessera_kv_push(kv, 1, g, n) != 0) goto fail;
    if (tessera_kv_pull(kv, 1, w, n) != 0) goto fail;
    if (w[0] != want || w[n / 2] != want || w[n - 1] != want) {
      fprintf(stderr, "scale_worker rank %d: round %d pulled %g, want %g\n",
              rank, r, w[0], want);
      return 1;
    }
  }
  const double rounds_ms = Now(CLOCK_MONOTONIC) - t0;
  free(w);
  free(g);
  t0 = Now(CLOCK_MONOTONIC);
  if (tessera_kv_close(kv) != 0) {
    fprintf(stderr, "scale_worker rank %d: close: %s\n", rank,
            tessera_last_error());
    return 1;
  }
  printf("SCALE rank=%d joined_unix_ms=%.3f barrier_ms=%.3f rounds_ms=%.3f "
         "close_ms=%.3f\n",
         rank, joined, barrier_ms, rounds_ms, Now(CLOCK_MONOTONIC) - t0);
  return 0;
fail:
  fprintf(stderr, "scale_worker rank %d: %s\n", rank, tessera_last_error());
  return 1;
}

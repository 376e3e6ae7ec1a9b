/* A worker for tools/bench/server_memory.py, written against the C API only so
 * that the same source builds against any Tessera (today's or an earlier
 * commit's) and measures it the same way.
 *
 *   round_worker VALUES ROUNDS
 *
 * Initialises key 1 with VALUES floats (dist_sync, no optimizer: the store
 * becomes each round's sum), then ROUNDS times pushes rank+1 everywhere and
 * pulls. Rank 0 prints one line per round:
 *   ROUND i push_ms=X pull_ms=Y
 * (a dist_sync push returns once the round is applied, so push_ms is the
 * round's completion latency seen by that worker) and checks the pulled value
 * n(n+1)/2 at a few places. Exit 0 when every check passed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tessera/c_api.h"

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: round_worker VALUES ROUNDS\n");
    return 2;
  }
  const size_t n = strtoull(argv[1], NULL, 10);
  const int rounds = atoi(argv[2]);
  TesseraKV* kv;
  if (tessera_kv_create("dist_sync", &kv) != 0) {
    fprintf(stderr, "round_worker: %s\n", tessera_last_error());
    return 1;
  }
  int rank = 0, workers = 0;
  tessera_kv_rank(kv, &rank);
  tessera_kv_num_workers(kv, &workers);
  float* w = malloc(n * sizeof(float));
  float* g = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) {
    w[i] = 0.0f;
    g[i] = (float)(rank + 1);
  }
  if (tessera_kv_init(kv, 1, w, n) != 0) goto fail;
  const float want = workers * (workers + 1) / 2.0f;
  for (int r = 0; r < rounds; ++r) {
    const double t0 = Now();
    if (tessera_kv_push(kv, 1, g, n) != 0) goto fail;
    const double t1 = Now();
    if (tessera_kv_pull(kv, 1, w, n) != 0) goto fail;
    const double t2 = Now();
    if (w[0] != want || w[n / 2] != want || w[n - 1] != want) {
      fprintf(stderr, "round_worker: round %d pulled %g, want %g\n", r, w[0],
              want);
      return 1;
    }
    if (rank == 0)
      printf("ROUND %d push_ms=%.3f pull_ms=%.3f\n", r, t1 - t0, t2 - t1);
  }
  fflush(stdout);
  free(w);
  free(g);
  if (tessera_kv_close(kv) != 0) {
    fprintf(stderr, "round_worker: close: %s\n", tessera_last_error());
    return 1;
  }
  return 0;
fail:
  fprintf(stderr, "round_worker rank %d: %s\n", rank, tessera_last_error());
  return 1;
}

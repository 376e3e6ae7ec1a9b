/* A worker for tools/bench/server_memory.py, written against the C API only so
 * that the same source builds against any Tessera (today's or an earlier
 * commit's) and measures it the same way.
 *
 *   round_worker VALUES ROUNDS [wide]
 *
 * Initialises key 1 with VALUES floats (dist_sync, no optimizer: the store
 * becomes each round's sum), then ROUNDS times pushes rank+1 everywhere and
 * pulls. Rank 0 prints one line per round:
 *   ROUND i push_ms=X pull_ms=Y
 * (a dist_sync push returns once the round is applied, so push_ms is the
 * round's completion latency seen by that worker) and checks the pulled value
 * n(n+1)/2 at a few places. Exit 0 when every check passed.
 *
 * With "wide", value i of rank r is +-(1 + f) x 2^e with f and the sign
 * pseudo-random and e spread over -30..29 (an outlier-heavy gradient, whose
 * sums do not fit a double): each worker checks 1,000 places of the pulled
 * sum against the exact sum rounded to nearest float32 (computed here in
 * 128-bit fixed point), and rank 0 prints the FNV-1a hash of the whole pulled
 * vector (SUMHASH), the same bits on every run whatever the arrival order. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tessera/c_api.h"

static uint64_t Mix(uint64_t x) { /* splitmix64 */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Wide value i of rank r: sign x m x 2^(e - 23), m a 24-bit integer. */
static void WideParts(int r, size_t i, int* negative, uint32_t* m, int* e) {
  const uint64_t h = Mix(((uint64_t)r << 40) ^ i);
  *negative = (int)(h & 1);
  *m = (uint32_t)((h >> 1) & 0x7fffff) | 0x800000u;
  *e = (int)((h >> 32) % 60) - 30;
}

static float WideValue(int r, size_t i) {
  int negative, e;
  uint32_t m;
  WideParts(r, i, &negative, &m, &e);
  const float v = ldexpf((float)m, e - 23);
  return negative ? -v : v;
}

/* The exact sum over ranks 0..workers-1 of value i, rounded to nearest
 * float32 (ties to even): in units of 2^-53 every value is m << (e + 30),
 * below 2^84, so 16+ of them add exactly in 128 bits. */
static float WideExact(int workers, size_t i) {
  __int128 sum = 0;
  for (int r = 0; r < workers; ++r) {
    int negative, e;
    uint32_t m;
    WideParts(r, i, &negative, &m, &e);
    const __int128 v = (__int128)m << (e + 30);
    sum += negative ? -v : v;
  }
  const int negative = sum < 0;
  unsigned __int128 mag =
      negative ? -(unsigned __int128)sum : (unsigned __int128)sum;
  int top = -1;
  for (int b = 127; b >= 0 && top < 0; --b)
    if ((mag >> b) & 1) top = b;
  float out;
  if (top < 24) {
    out = ldexpf((float)(uint32_t)mag, -53);
  } else {
    uint64_t keep = (uint64_t)(mag >> (top - 23));
    const int guard = (int)((mag >> (top - 24)) & 1);
    const int sticky =
        top >= 25 && (mag & ((((unsigned __int128)1) << (top - 24)) - 1)) != 0;
    int exponent = top - 23 - 53;
    if (guard && (sticky || (keep & 1))) {
      if (++keep == (1ull << 24)) {
        keep >>= 1;
        ++exponent;
      }
    }
    out = ldexpf((float)keep, exponent);
  }
  return negative ? -out : out;
}

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 4 && strcmp(argv[3], "wide") == 0)) {
    fprintf(stderr, "usage: round_worker VALUES ROUNDS [wide]\n");
    return 2;
  }
  const size_t n = strtoull(argv[1], NULL, 10);
  const int rounds = atoi(argv[2]);
  const int wide = argc == 4;
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
    g[i] = wide ? WideValue(rank, i) : (float)(rank + 1);
  }
  if (tessera_kv_init(kv, 1, w, n) != 0) goto fail;
  const float want = workers * (workers + 1) / 2.0f;
  for (int r = 0; r < rounds; ++r) {
    const double t0 = Now();
    if (tessera_kv_push(kv, 1, g, n) != 0) goto fail;
    const double t1 = Now();
    if (tessera_kv_pull(kv, 1, w, n) != 0) goto fail;
    const double t2 = Now();
    if (wide) {
      for (size_t k = 0; k < 1000; ++k) {
        const size_t i = (size_t)(Mix(k) % n);
        const float exact = WideExact(workers, i);
        if (memcmp(&w[i], &exact, sizeof(float)) != 0) {
          fprintf(stderr,
                  "round_worker: round %d value %zu pulled %a, exact sum %a\n",
                  r, i, w[i], exact);
          return 1;
        }
      }
      if (rank == 0) {
        uint64_t h = 0xcbf29ce484222325ull;
        const unsigned char* b = (const unsigned char*)w;
        for (size_t k = 0; k < n * sizeof(float); ++k)
          h = (h ^ b[k]) * 0x100000001b3ull;
        printf("SUMHASH %d %016llx\n", r, (unsigned long long)h);
      }
    } else if (w[0] != want || w[n / 2] != want || w[n - 1] != want) {
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

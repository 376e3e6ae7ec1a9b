/* A worker program written against the C API only (tessera/c_api.h), started
 * by the cluster tests. It checks the store's semantics from inside a real job
 * and exits 0 when every check passed, 1 with a message otherwise.
 *
 *   kv_check_worker barrier N [SLEEP_MS]   N barriers, then close
 *   kv_check_worker nightly                MXNet's nightly dist_sync check (sgd lr=-2)
 *   kv_check_worker allreduce              dist_sync without optimizer: pushpull sums
 *   kv_check_worker async                  dist_async: every push applied once
 *   kv_check_worker async_noopt            dist_async push without optimizer is an error
 *   kv_check_worker errors                 bad calls fail cleanly and change nothing
 *   kv_check_worker compress               2-bit pushes 0,.4,.1,.2,.3,.5 pull 0,0,n,n,2n,3n
 *   kv_check_worker async_api              the nightly check through the *_async calls
 *                                          and tessera_kv_wait, every operation of a
 *                                          round in flight at once
 *   kv_check_worker optimizer SPEC ROUNDS  prints the weights after ROUNDS pushes
 *   kv_check_worker soak ROUNDS [SLEEP_MS [DIE_AT RANK]]  the nightly check
 *       over ROUNDS rounds, a small key and one of 5000 values (split when
 *       TESSERA_BIGARRAY_BOUND <= 5000), and a hashed row key (issue #29): each
 *       rank pushes rank+1 into its own 64-bit id and into one id every rank
 *       names; prints an FNV-1a checksum of the final weights and rows. For restart tests, rank RANK's first life (TESSERA_RESTART_COUNT
 *       unset or 0) SIGKILLs itself: DIE_AT=init between its two inits (the
 *       others wait in the second init's barrier, or rank 0 has not stored the
 *       second key yet); DIE_AT=close while it waits in close's barrier (the
 *       others come 1 s later, and its next life 1.5 s later still, after they
 *       have finished); DIE_AT=push inside its push of the small key in round
 *       5, whose round stays open (the others come 1 s later); its next life
 *       does not pull before it pushes again. With SOAK_PRINT_ROUNDS=1 it
 *       prints "round I done at UNIX_SECONDS" after each round; SOAK_BIG_VALUES
 *       sets the big key's length (5000). Elastic jobs (TESSERA_ELASTIC):
 *       with SOAK_LEAVE=R:K rank R leaves the job (tessera_kv_leave) after
 *       round K, printing "soak left: rank R after round K", and every rank
 *       expects the rounds after K to sum the others' pushes only, scaled by
 *       n / (n - 1) (the servers' rescaling of a partial round). With
 *       SOAK_JOINER=J the ranks of the job expect a worker to join as rank J
 *       at some round (each value's increments then include its pushes,
 *       scaled by n / (n + 1)); the joiner itself runs with SOAK_JOIN=1,
 *       checks nothing and prints "soak joined: rank J, ROUNDS rounds".
 *       SOAK_CHECK=0 checks no value (a benchmark's worker killed at random).
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tessera/c_api.h"

static int rank_ = -1;

/* The store this program has open. When a call fails the program closes it before
 * exiting: tessera_kv_close leaves the job (at once when the job has failed),
 * frees the store and joins the client's threads. Exiting with finished threads
 * not joined is a "thread leak" to ThreadSanitizer (tools/tsan.sh), which then
 * ends the process with its own exit code (66) instead of 1. */
static TesseraKV* open_kv_ = NULL;

static void CloseAfterError(void) {
  TesseraKV* kv = open_kv_;
  open_kv_ = NULL;
  if (kv != NULL) (void)tessera_kv_close(kv);
}

/* tessera_kv_close frees the store even when it fails. */
static int Close(TesseraKV* kv) {
  open_kv_ = NULL;
  return tessera_kv_close(kv);
}

#define CHECK_OK(call)                                          \
  do {                                                          \
    if ((call) != 0) {                                          \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank_, #call, \
              tessera_last_error());                            \
      CloseAfterError();                                        \
      exit(1);                                                  \
    }                                                           \
  } while (0)

/* A failed call returns the status code of its failure (c_api.h). */
#define CHECK_FAILS(call, code, text)                                       \
  do {                                                                      \
    const int rc = (call);                                                  \
    if (rc == TESSERA_OK) {                                                 \
      fprintf(stderr, "rank %d: %s succeeded but should fail\n", rank_,     \
              #call);                                                       \
      exit(1);                                                              \
    }                                                                       \
    if (rc != (code)) {                                                     \
      fprintf(stderr, "rank %d: %s returned %d (%s), expected %d (%s)\n",   \
              rank_, #call, rc, tessera_last_error(), (int)(code), #code);  \
      exit(1);                                                              \
    }                                                                       \
    if (strstr(tessera_last_error(), text) == NULL) {                       \
      fprintf(stderr, "rank %d: %s: error '%s' lacks '%s'\n", rank_, #call, \
              tessera_last_error(), text);                                  \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

static void Fill(float* v, size_t n, float x) {
  for (size_t i = 0; i < n; ++i) v[i] = x;
}

static void ExpectAll(const float* v, size_t n, float want, const char* what,
                      int round) {
  for (size_t i = 0; i < n; ++i) {
    if (v[i] != want) {
      fprintf(stderr,
              "rank %d: %s round %d: element %zu is %.9g, expected %.9g\n",
              rank_, what, round, i, v[i], want);
      exit(1);
    }
  }
}

/* Elastic joins (soak, SOAK_JOINER): each value is its last one plus the
 * round's increment without the joiner or with it; once a value has seen the
 * joiner's pushes it sees them in every later round, and every value sees
 * them first in the same round (the joiner enters every slice's rounds at
 * one round). */
static int join_first_round_ = -1;

static void ExpectJoin(const float* v, size_t n, float* last,
                       unsigned char* joined, float without, float with,
                       const char* what, int round) {
  for (size_t i = 0; i < n; ++i) {
    const float a = last[i] + without, b = last[i] + with;
    if (!joined[i] && v[i] == a) {
      last[i] = a;
    } else if (v[i] == b) {
      if (!joined[i]) {
        if (join_first_round_ < 0) join_first_round_ = round;
        if (round != join_first_round_) {
          fprintf(stderr,
                  "rank %d: %s element %zu saw the joiner's push first in "
                  "round %d, other values in round %d\n",
                  rank_, what, i, round, join_first_round_);
          exit(1);
        }
      }
      joined[i] = 1;
      last[i] = b;
    } else {
      fprintf(stderr,
              "rank %d: %s round %d: element %zu is %.9g, expected %.9g "
              "%s%.9g (with the joiner's push)\n",
              rank_, what, round, i, v[i], a,
              joined[i] ? "(no more) or " : "or ", b);
      exit(1);
    }
  }
}

static TesseraKV* Create(const char* type) {
  TesseraKV* kv = NULL;
  CHECK_OK(tessera_kv_create(type, &kv));
  open_kv_ = kv;
  CHECK_OK(tessera_kv_rank(kv, &rank_));
  return kv;
}

enum { kSmall = 3, kBig = 99 };
static const size_t kSmallLen = 6;
static const size_t kBigLen = 1200 * 1200;

static int Nightly(void) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-2"));
  float* small = malloc(kSmallLen * sizeof(float));
  float* big = malloc(kBigLen * sizeof(float));
  float* grad = malloc(kBigLen * sizeof(float));
  Fill(small, kSmallLen, 1);
  Fill(big, kBigLen, 1);
  CHECK_OK(tessera_kv_init(kv, kSmall, small, kSmallLen));
  CHECK_OK(tessera_kv_init(kv, kBig, big, kBigLen));
  /* Priorities (docs/priority.md): init order by default; the big key made
   * the more urgent; a bad one refused. The values are the same. */
  int64_t p_small = 1, p_big = 1;
  CHECK_OK(tessera_kv_priority(kv, kSmall, &p_small));
  CHECK_OK(tessera_kv_priority(kv, kBig, &p_big));
  if (p_small != 0 || p_big != -1) {
    fprintf(stderr, "FAIL: default priorities %lld and %lld, want 0 and -1\n",
            (long long)p_small, (long long)p_big);
    return 1;
  }
  CHECK_OK(tessera_kv_set_priority(kv, kSmall, -5));
  if (tessera_kv_set_priority(kv, kBig, 2000000000) !=
      TESSERA_INVALID_ARGUMENT) {
    fprintf(stderr, "FAIL: priority 2000000000 taken\n");
    return 1;
  }
  for (int i = 0; i < 7; ++i) {
    Fill(grad, kBigLen, (float)(rank_ + 1));
    CHECK_OK(tessera_kv_push(kv, kSmall, grad, kSmallLen));
    CHECK_OK(tessera_kv_push(kv, kBig, grad, kBigLen));
    CHECK_OK(tessera_kv_pull(kv, kSmall, small, kSmallLen));
    CHECK_OK(tessera_kv_pull(kv, kBig, big, kBigLen));
    const float want = 1.0f + (float)(n * (n + 1) * (i + 1));
    ExpectAll(small, kSmallLen, want, "small key", i);
    ExpectAll(big, kBigLen, want, "1200x1200 key", i);
  }
  /* The same value without a copy: the lent parts tile the key in order. */
  TesseraPulled* view = NULL;
  CHECK_OK(tessera_kv_pull_view(kv, kBig, &view));
  if (tessera_pulled_size(view) != kBigLen) {
    fprintf(stderr, "FAIL: pull_view of %zu values, want %zu\n",
            tessera_pulled_size(view), kBigLen);
    return 1;
  }
  const size_t parts = tessera_pulled_num_parts(view);
  size_t covered = 0;
  for (size_t p = 0; p < parts; ++p) {
    size_t offset = 0, len = 0;
    const float* part = tessera_pulled_part(view, p, &offset, &len);
    if (part == NULL || offset != covered) {
      fprintf(stderr, "FAIL: pull_view part %zu at %zu, want %zu\n", p, offset,
              covered);
      return 1;
    }
    ExpectAll(part, len, 1.0f + (float)(n * (n + 1) * 7), "pull_view part",
              (int)p);
    covered += len;
  }
  if (covered != kBigLen || tessera_pulled_part(view, parts, NULL, NULL)) {
    fprintf(stderr, "FAIL: pull_view parts cover %zu of %zu values\n", covered,
            kBigLen);
    return 1;
  }
  tessera_pulled_free(view);
  CHECK_FAILS(tessera_kv_pull_view(kv, 42, &view), TESSERA_NOT_FOUND,
              "never initialised");
  CHECK_OK(Close(kv));
  printf("nightly ok: rank %d of %d, 7 rounds, pull_view in %zu parts\n", rank_,
         n, parts);
  free(small);
  free(big);
  free(grad);
  return 0;
}

static int AsyncApi(void) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0, servers = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  CHECK_OK(tessera_kv_num_servers(kv, &servers));
  const char* want_servers = getenv("DMLC_NUM_SERVER");
  if (want_servers == NULL || servers != atoi(want_servers)) {
    fprintf(stderr, "rank %d: num_servers %d, DMLC_NUM_SERVER %s\n", rank_,
            servers, want_servers == NULL ? "unset" : want_servers);
    return 1;
  }
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-2"));
  float* small = malloc(kSmallLen * sizeof(float));
  float* big = malloc(kBigLen * sizeof(float));
  float* grad = malloc(kBigLen * sizeof(float));
  float* big_out = malloc(kBigLen * sizeof(float));
  Fill(small, kSmallLen, 1);
  Fill(big, kBigLen, 1);
  CHECK_OK(tessera_kv_init(kv, kSmall, small, kSmallLen));
  CHECK_OK(tessera_kv_init(kv, kBig, big, kBigLen));
  for (int i = 0; i < 3; ++i) {
    Fill(grad, kBigLen, (float)(rank_ + 1));
    uint64_t ops[4];
    CHECK_OK(tessera_kv_push_async(kv, kSmall, grad, kSmallLen, &ops[0]));
    CHECK_OK(tessera_kv_push_async(kv, kBig, grad, kBigLen, &ops[1]));
    CHECK_OK(tessera_kv_pull_async(kv, kSmall, small, kSmallLen, &ops[2]));
    /* Both pushes borrow grad: wait for them before it changes. Then a
     * pushpull of zeros (a round that adds nothing) reads the key's value. */
    CHECK_OK(tessera_kv_wait(kv, ops[0]));
    CHECK_OK(tessera_kv_wait(kv, ops[1]));
    Fill(grad, kBigLen, 0);
    CHECK_OK(
        tessera_kv_pushpull_async(kv, kBig, grad, big_out, kBigLen, &ops[3]));
    CHECK_OK(tessera_kv_wait(kv, ops[2]));
    CHECK_OK(tessera_kv_wait(kv, ops[3]));
    /* The zeros round added nothing to kBig. */
    const float want = 1.0f + (float)(n * (n + 1) * (i + 1));
    ExpectAll(small, kSmallLen, want, "small key", i);
    ExpectAll(big_out, kBigLen, want, "1200x1200 key", i);
  }
  CHECK_FAILS(tessera_kv_wait(kv, 123456789), TESSERA_INVALID_ARGUMENT,
              "unknown operation handle");
  uint64_t op = 0;
  CHECK_FAILS(tessera_kv_pull_async(kv, 42, small, kSmallLen, &op),
              TESSERA_NOT_FOUND, "never initialised");
  CHECK_FAILS(tessera_kv_push_async(kv, kSmall, grad, kSmallLen, NULL),
              TESSERA_INVALID_ARGUMENT, "handle is NULL");
  CHECK_OK(tessera_kv_close(kv));
  printf("async_api ok: rank %d of %d\n", rank_, n);
  free(small);
  free(big);
  free(grad);
  free(big_out);
  return 0;
}

static uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const unsigned char* p = (const unsigned char*)data;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

static void* KillSelfSoon(void* unused) {
  (void)unused;
  usleep(300 * 1000);
  raise(SIGKILL);
  return NULL;
}

static int Soak(int rounds, int sleep_ms, const char* die_at, int die_rank) {
  const char* restarts = getenv("TESSERA_RESTART_COUNT");
  const int first_life = restarts == NULL || atoi(restarts) == 0;
  const char* rounds_env = getenv("SOAK_PRINT_ROUNDS");
  const int print_rounds = rounds_env != NULL && strcmp(rounds_env, "1") == 0;
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  int leave_rank = -1, leave_round = -1;
  const char* leave_env = getenv("SOAK_LEAVE");
  if (leave_env != NULL &&
      (sscanf(leave_env, "%d:%d", &leave_rank, &leave_round) != 2 ||
       leave_rank < 0 || leave_rank >= n || leave_round < 0 || n < 2)) {
    fprintf(stderr, "SOAK_LEAVE='%s': expected RANK:ROUND, RANK < %d\n",
            leave_env, n);
    return 2;
  }
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-2"));
  /* SOAK_BIG_VALUES: the big key's length (5000 by default; the catch-up
   * benchmark, tools/bench/failover.py --spare, makes it a shard of 1 GB). */
  const char* big_env = getenv("SOAK_BIG_VALUES");
  const size_t big_len =
      big_env != NULL && atoll(big_env) > 0 ? (size_t)atoll(big_env) : 5000;
  float small[6];
  float* big = malloc(big_len * sizeof(float));
  float* grad = malloc(big_len * sizeof(float));
  Fill(small, kSmallLen, 1);
  Fill(big, big_len, 1);
  CHECK_OK(tessera_kv_init(kv, kSmall, small, kSmallLen));
  if (strcmp(die_at, "init") == 0 && rank_ == die_rank && first_life) {
    usleep(200 * 1000); /* the others reach the second init's barrier */
    raise(SIGKILL);
  }
  CHECK_OK(tessera_kv_init(kv, kBig, big, big_len));
  /* Rows of 3: its own id (past 2^63) and one every rank names. */
  enum { kHashed = 97 };
  const uint64_t hashed_ids[2] = {(1ULL << 63) + 1000 + (uint64_t)rank_,
                                  (1ULL << 40) + 5};
  float hashed[6] = {0, 0, 0, 0, 0, 0}, hashed_grad[6];
  CHECK_OK(tessera_kv_init_hashed(kv, kHashed, 3, "capacity=1000"));
  /* A restarted worker (launch.py --restarts) goes on where its pushes stop. */
  uint64_t resume = 0;
  CHECK_OK(tessera_kv_resume_round(kv, &resume));
  if (resume > 0) {
    printf("rank %d: restarted; resuming at round %llu\n", rank_,
           (unsigned long long)resume);
    fflush(stdout);
    /* (Not with DIE_AT=push: its repeated push must be answered by itself.) */
    if (strcmp(die_at, "push") != 0) {
      CHECK_OK(tessera_kv_pull(kv, kSmall, small, kSmallLen));
      CHECK_OK(tessera_kv_pull(kv, kBig, big, big_len));
      CHECK_OK(tessera_kv_pull_rows(kv, kHashed, hashed_ids, 2, hashed));
    }
  }
  /* What each round adds (sgd lr=-2: twice the round's sum, as the servers
   * round it): every rank's pushes, or after SOAK_LEAVE's round the others',
   * scaled by n / (n - 1) in float32. */
  float want = 1.0f, want_own = 0.0f;
  for (int i = 0; i < (int)resume; ++i) {
    want += (float)(n * (n + 1));
    want_own += (float)(2 * (rank_ + 1));
  }
  const float scale = n > 1 ? (float)n / (float)(n - 1) : 1.0f;
  const char* check_env = getenv("SOAK_CHECK");
  const int no_checks = check_env != NULL && strcmp(check_env, "0") == 0;
  const char* join_env = getenv("SOAK_JOIN");
  const int joiner = join_env != NULL && strcmp(join_env, "1") == 0;
  const char* joiner_env = getenv("SOAK_JOINER");
  const int joiner_rank = joiner_env != NULL ? atoi(joiner_env) : -1;
  /* With a joiner: each value's last expected value and whether it has seen
   * the joiner (small key, big key, own id row, shared id row). */
  const float join_scale = (float)n / (float)(n + 1);
  const float inc_with =
      2.0f * ((float)(n * (n + 1) / 2 + joiner_rank + 1) * join_scale);
  const float own_with = 2.0f * ((float)(rank_ + 1) * join_scale);
  const size_t tracked = kSmallLen + big_len + 6;
  float* last = malloc(tracked * sizeof(float));
  unsigned char* seen = calloc(tracked, 1);
  for (size_t k = 0; k < tracked; ++k)
    last[k] = k < kSmallLen + big_len ? 1.0f : 0.0f;
  for (int i = (int)resume; i < rounds; ++i) {
    if (leave_round >= 0 && i > leave_round) {
      want += 2.0f * ((float)(n * (n + 1) / 2 - (leave_rank + 1)) * scale);
      want_own += 2.0f * ((float)(rank_ + 1) * scale);
    } else {
      want += (float)(n * (n + 1));
      want_own += (float)(2 * (rank_ + 1));
    }
    Fill(grad, big_len, (float)(rank_ + 1));
    if (strcmp(die_at, "push") == 0 && i == 5) {
      if (rank_ == die_rank && first_life) {
        pthread_t killer;
        pthread_create(&killer, NULL, KillSelfSoon, NULL);
      } else if (rank_ != die_rank) {
        usleep(1000 * 1000);
      }
    }
    CHECK_OK(tessera_kv_push(kv, kSmall, grad, kSmallLen));
    CHECK_OK(tessera_kv_push(kv, kBig, grad, big_len));
    Fill(hashed_grad, 6, (float)(rank_ + 1));
    CHECK_OK(tessera_kv_push_rows(kv, kHashed, hashed_ids, 2, hashed_grad));
    CHECK_OK(tessera_kv_pull(kv, kSmall, small, kSmallLen));
    CHECK_OK(tessera_kv_pull(kv, kBig, big, big_len));
    CHECK_OK(tessera_kv_pull_rows(kv, kHashed, hashed_ids, 2, hashed));
    if (joiner || no_checks) {
      /* Joined a running job, or SOAK_CHECK=0 (tools/bench/elastic.py kills a
       * worker at a moment nobody can predict): nothing to check against. */
    } else if (joiner_rank >= 0) {
      const float inc = (float)(n * (n + 1));
      ExpectJoin(small, kSmallLen, last, seen, inc, inc_with, "small key", i);
      ExpectJoin(big, big_len, last + kSmallLen, seen + kSmallLen, inc,
                 inc_with, "5000-value key", i);
      ExpectJoin(hashed, 3, last + kSmallLen + big_len,
                 seen + kSmallLen + big_len, (float)(2 * (rank_ + 1)), own_with,
                 "own hashed id", i);
      ExpectJoin(hashed + 3, 3, last + kSmallLen + big_len + 3,
                 seen + kSmallLen + big_len + 3, inc, inc_with,
                 "shared hashed id", i);
    } else {
      ExpectAll(small, kSmallLen, want, "small key", i);
      ExpectAll(big, big_len, want, "5000-value key", i);
      /* sgd lr=-2 from zeros: the own id gains 2(rank+1) a round, the shared
       * one 2 x (1 + ... + n). */
      ExpectAll(hashed, 3, want_own, "own hashed id", i);
      ExpectAll(hashed + 3, 3, want - 1.0f, "shared hashed id", i);
    }
    if (print_rounds) {
      /* tools/bench/failover.py: when each round was complete here. */
      struct timespec now;
      clock_gettime(CLOCK_REALTIME, &now);
      printf("round %d done at %lld.%06ld\n", i, (long long)now.tv_sec,
             now.tv_nsec / 1000);
      fflush(stdout);
    }
    if (sleep_ms > 0) usleep((useconds_t)sleep_ms * 1000);
    if (rank_ == leave_rank && i == leave_round) {
      CHECK_OK(tessera_kv_leave(kv));
      printf("soak left: rank %d after round %d\n", rank_, i);
      free(big);
      free(grad);
      free(last);
      free(seen);
      return 0;
    }
  }
  if (joiner_rank >= 0 && !joiner && !no_checks) {
    /* Every value saw the joiner's pushes (it joined before the end). */
    size_t without = 0;
    for (size_t k = 0; k < tracked; ++k) without += seen[k] ? 0 : 1;
    if (without != 0) {
      fprintf(stderr, "rank %d: %zu value(s) never saw the joiner's pushes\n",
              rank_, without);
      return 1;
    }
  }
  free(last);
  free(seen);
  if (joiner) {
    CHECK_OK(Close(kv));
    printf("soak joined: rank %d, %d rounds\n", rank_, rounds);
    free(big);
    free(grad);
    return 0;
  }
  uint64_t h = 14695981039346656037ULL;
  h = Fnv1a(h, small, sizeof(small));
  h = Fnv1a(h, big, big_len * sizeof(float));
  h = Fnv1a(h, hashed + 3, 3 * sizeof(float)); /* the same on every rank */
  if (strcmp(die_at, "close") == 0) {
    if (rank_ == die_rank && first_life) {
      pthread_t killer;
      pthread_create(&killer, NULL, KillSelfSoon, NULL);
    } else {
      usleep(rank_ == die_rank ? 1500 * 1000 : 1000 * 1000);
    }
  }
  CHECK_OK(Close(kv));
  printf("soak ok: rank %d of %d, %d rounds checksum=%016llx\n", rank_, n,
         rounds, (unsigned long long)h);
  free(big);
  free(grad);
  return 0;
}

static int AllReduce(void) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  const size_t len = 1000;
  float* value = calloc(len, sizeof(float));
  float* grad = malloc(len * sizeof(float));
  float* out = malloc(len * sizeof(float));
  CHECK_OK(tessera_kv_init(kv, 7, value, len));
  for (int round = 0; round < 3; ++round) {
    for (size_t j = 0; j < len; ++j)
      grad[j] = (float)((rank_ + 1) * (j + round));
    CHECK_OK(tessera_kv_pushpull(kv, 7, grad, out, len));
    for (size_t j = 0; j < len; ++j) {
      const float want = (float)((j + round) * (size_t)(n * (n + 1) / 2));
      if (out[j] != want) {
        fprintf(stderr,
                "rank %d: allreduce round %d element %zu is %g, expected %g\n",
                rank_, round, j, out[j], want);
        return 1;
      }
    }
  }
  CHECK_OK(Close(kv));
  printf("allreduce ok: rank %d of %d\n", rank_, n);
  free(value);
  free(grad);
  free(out);
  return 0;
}

static int Async(void) {
  TesseraKV* kv = Create("dist_async");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-1"));
  const size_t len = 1500000; /* split over the servers */
  float* value = calloc(len, sizeof(float));
  float* grad = malloc(len * sizeof(float));
  CHECK_OK(tessera_kv_init(kv, 5, value, len));
  Fill(grad, len, (float)(rank_ + 1));
  for (int i = 0; i < 10; ++i) CHECK_OK(tessera_kv_push(kv, 5, grad, len));
  CHECK_OK(tessera_kv_barrier(kv));
  CHECK_OK(tessera_kv_pull(kv, 5, value, len));
  ExpectAll(value, len, (float)(10 * n * (n + 1) / 2), "async key", 10);
  CHECK_OK(Close(kv));
  printf("async ok: rank %d of %d\n", rank_, n);
  free(value);
  free(grad);
  return 0;
}

static int AsyncNoOptimizer(void) {
  TesseraKV* kv = Create("dist_async");
  float value[4] = {1, 2, 3, 4};
  CHECK_OK(tessera_kv_init(kv, 1, value, 4));
  CHECK_FAILS(tessera_kv_push(kv, 1, value, 4), TESSERA_FAILED_PRECONDITION,
              "dist_async needs an optimizer");
  float out[4] = {0};
  CHECK_OK(tessera_kv_pull(kv, 1, out, 4)); /* the server is still serving */
  if (out[0] != 1 || out[3] != 4) {
    fprintf(stderr, "rank %d: value changed by a rejected push\n", rank_);
    return 1;
  }
  CHECK_OK(Close(kv));
  printf("async_noopt ok: rank %d\n", rank_);
  return 0;
}

static int Errors(void) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  float v[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  float out[8];
  CHECK_FAILS(tessera_kv_set_optimizer(kv, "bogus lr=1"),
              TESSERA_INVALID_ARGUMENT, "unknown optimizer 'bogus'");
  CHECK_FAILS(tessera_kv_set_optimizer(kv, "sgd foo=1"),
              TESSERA_INVALID_ARGUMENT, "unknown parameter 'foo'");
  CHECK_FAILS(tessera_kv_set_optimizer(kv, "sgd lr=abc"),
              TESSERA_INVALID_ARGUMENT, "expected a finite number");
  CHECK_FAILS(tessera_kv_set_gradient_compression(kv, "2bit", 0),
              TESSERA_INVALID_ARGUMENT, "expected a number > 0");
  CHECK_FAILS(tessera_kv_set_gradient_compression(kv, "4bit", 0.5f),
              TESSERA_INVALID_ARGUMENT, "expected 2bit or none");
  CHECK_FAILS(tessera_kv_set_pull_compression(kv, "3bit"),
              TESSERA_INVALID_ARGUMENT, "expected 2bit or none");
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-2"));
  CHECK_FAILS(tessera_kv_pull(kv, 42, out, 8), TESSERA_NOT_FOUND,
              "never initialised");
  CHECK_FAILS(tessera_kv_push(kv, 42, v, 8), TESSERA_NOT_FOUND,
              "never initialised");
  CHECK_OK(tessera_kv_init(kv, 2, v, 8));
  CHECK_FAILS(tessera_kv_push(kv, 2, v, 7), TESSERA_INVALID_ARGUMENT,
              "the key has 8");
  CHECK_FAILS(tessera_kv_pull(kv, 2, out, 9), TESSERA_INVALID_ARGUMENT,
              "the key has 8");
  CHECK_FAILS(tessera_kv_set_optimizer(kv, "adam"), TESSERA_FAILED_PRECONDITION,
              "before the first init");
  CHECK_FAILS(tessera_kv_set_gradient_compression(kv, "2bit", 0.5f),
              TESSERA_FAILED_PRECONDITION, "before the first init");
  CHECK_FAILS(tessera_kv_set_pull_compression(kv, "2bit"),
              TESSERA_FAILED_PRECONDITION, "before the first init");
  /* None of the rejected calls counted toward a round: one real round gives
   * exactly. */
  CHECK_OK(tessera_kv_push(kv, 2, v, 8));
  CHECK_OK(tessera_kv_pull(kv, 2, out, 8));
  ExpectAll(out, 8, 1.0f + 2.0f * (float)n, "after errors", 0);
  CHECK_OK(Close(kv));
  CHECK_FAILS(tessera_kv_barrier(NULL), TESSERA_INVALID_ARGUMENT, "kv is NULL");
  printf("errors ok: rank %d\n", rank_);
  return 0;
}

static int Compress(void) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  CHECK_OK(tessera_kv_set_gradient_compression(kv, "2bit", 0.5f));
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-2"));
  float* small = calloc(kSmallLen, sizeof(float));
  float* big = calloc(kBigLen, sizeof(float));
  float* grad = malloc(kBigLen * sizeof(float));
  CHECK_OK(tessera_kv_init(kv, kSmall, small, kSmallLen));
  CHECK_OK(tessera_kv_init(kv, kBig, big, kBigLen));
  const float pushes[6] = {0, 0.4f, 0.1f, 0.2f, 0.3f, 0.5f};
  const float pulls[6] = {0, 0, 1, 1, 2, 3}; /* times n */
  for (int i = 0; i < 6; ++i) {
    Fill(grad, kBigLen, pushes[i]);
    CHECK_OK(tessera_kv_push(kv, kSmall, grad, kSmallLen));
    CHECK_OK(tessera_kv_push(kv, kBig, grad, kBigLen));
    CHECK_OK(tessera_kv_pull(kv, kSmall, small, kSmallLen));
    CHECK_OK(tessera_kv_pull(kv, kBig, big, kBigLen));
    ExpectAll(small, kSmallLen, pulls[i] * (float)n, "2-bit small key", i);
    ExpectAll(big, kBigLen, pulls[i] * (float)n, "2-bit 1200x1200 key", i);
  }
  CHECK_OK(Close(kv));
  printf("compress ok: rank %d of %d\n", rank_, n);
  free(small);
  free(big);
  free(grad);
  return 0;
}

static int OptimizerRun(const char* spec, int rounds) {
  TesseraKV* kv = Create("dist_sync");
  CHECK_OK(tessera_kv_set_optimizer(kv, spec));
  float w[5] = {0.5f, -1.0f, 2.0f, 0.0f, 3.0f};
  float g[5];
  CHECK_OK(tessera_kv_init(kv, 11, w, 5));
  for (int t = 0; t < rounds; ++t) {
    for (int j = 0; j < 5; ++j)
      g[j] = 0.1f * (float)(j + 1) * (float)(t % 3 + 1) * (float)(rank_ + 1);
    CHECK_OK(tessera_kv_push(kv, 11, g, 5));
  }
  CHECK_OK(tessera_kv_pull(kv, 11, w, 5));
  printf("weights %.9g %.9g %.9g %.9g %.9g\n", w[0], w[1], w[2], w[3], w[4]);
  CHECK_OK(Close(kv));
  return 0;
}

/* A straggler (issue #31): ROUNDS dist_sync rounds of the small key; rank
   SLOW sleeps SLEEP_MS inside round AT, before its push, so that the others'
   pushes of that round wait for it, and again before a barrier after the
   rounds. Every round's value is checked. */
static int Straggler(int rounds, int slow, int sleep_ms, int at) {
  TesseraKV* kv = Create("dist_sync");
  int n = 0;
  CHECK_OK(tessera_kv_num_workers(kv, &n));
  CHECK_OK(tessera_kv_set_optimizer(kv, "sgd lr=-1"));
  float w[6], grad[6];
  Fill(w, kSmallLen, 0);
  CHECK_OK(tessera_kv_init(kv, kSmall, w, kSmallLen));
  for (int i = 0; i < rounds; ++i) {
    if (rank_ == slow && i == at) {
      printf("rank %d: sleeping %d ms in round %d\n", rank_, sleep_ms, i);
      fflush(stdout);
      usleep((useconds_t)sleep_ms * 1000);
    }
    Fill(grad, kSmallLen, 1);
    CHECK_OK(tessera_kv_push(kv, kSmall, grad, kSmallLen));
    CHECK_OK(tessera_kv_pull(kv, kSmall, w, kSmallLen));
    ExpectAll(w, kSmallLen, (float)(n * (i + 1)), "small key", i);
  }
  if (rank_ == slow) {
    printf("rank %d: sleeping %d ms before the barrier\n", rank_, sleep_ms);
    fflush(stdout);
    usleep((useconds_t)sleep_ms * 1000);
  }
  CHECK_OK(tessera_kv_barrier(kv));
  CHECK_OK(Close(kv));
  printf("straggler ok: rank %d, %d rounds\n", rank_, rounds);
  return 0;
}

static int Barriers(int count, int sleep_ms) {
  TesseraKV* kv = Create("dist_sync");
  for (int i = 0; i < count; ++i) {
    CHECK_OK(tessera_kv_barrier(kv));
    if (sleep_ms > 0) usleep((useconds_t)sleep_ms * 1000);
  }
  CHECK_OK(Close(kv));
  printf("barrier ok: rank %d, %d barriers\n", rank_, count);
  return 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) {
    fprintf(stderr, "usage: kv_check_worker MODE [ARGS]\n");
    return 2;
  }
  const char* mode = argv[1];
  if (strcmp(mode, "barrier") == 0) {
    return Barriers(argc > 2 ? atoi(argv[2]) : 3, argc > 3 ? atoi(argv[3]) : 0);
  }
  if (strcmp(mode, "nightly") == 0) return Nightly();
  if (strcmp(mode, "straggler") == 0 && argc > 5)
    return Straggler(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]),
                     atoi(argv[5]));
  if (strcmp(mode, "soak") == 0 && argc > 2)
    return Soak(atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 0,
                argc > 5 ? argv[4] : "", argc > 5 ? atoi(argv[5]) : -1);
  if (strcmp(mode, "allreduce") == 0) return AllReduce();
  if (strcmp(mode, "async") == 0) return Async();
  if (strcmp(mode, "async_noopt") == 0) return AsyncNoOptimizer();
  if (strcmp(mode, "errors") == 0) return Errors();
  if (strcmp(mode, "compress") == 0) return Compress();
  if (strcmp(mode, "async_api") == 0) return AsyncApi();
  if (strcmp(mode, "optimizer") == 0 && argc > 3)
    return OptimizerRun(argv[2], atoi(argv[3]));
  fprintf(stderr, "kv_check_worker: unknown mode '%s'\n", mode);
  return 2;
}

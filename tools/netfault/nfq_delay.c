/* nfq_delay: delays or drops the packets an nftables/iptables rule sends to an
 * NFQUEUE, for network-fault tests on kernels without `tc netem`.
 *
 *   nfq_delay --queue N [--delay-ms D] [--drop-percent P] [--seed S]
 *
 * Binds NFQUEUE number N (in the network namespace it runs in). Each packet is
 * dropped with probability P percent (0..100, decimals allowed); every other
 * packet is held and re-injected (NF_ACCEPT) D milliseconds after it arrived,
 * in arrival order. The loop is one thread: ppoll() on the netlink socket with
 * the time until the oldest held packet is due; verdicts are given later by
 * packet id, so holding packets never blocks receiving new ones.
 *
 * Prints "nfq_delay: queue N ready" on stdout once the queue is bound (a test
 * adds its `queue num N` rule after that line), and on SIGTERM/SIGINT releases
 * every held packet, prints its counters and exits 0:
 *   nfq_delay: queue N: seen X, dropped Y, delayed Z, released-early W
 * A bad flag prints one line naming it and what was expected, and exits 2.
 *
 * Needs CAP_NET_ADMIN. Example (in a namespace, all TCP going out of eth0):
 *   nfq_delay --queue 78 --delay-ms 50 &
 *   nft add table inet t
 *   nft add chain inet t out '{ type filter hook output priority 0 ; }'
 *   nft add rule inet t out oifname eth0 meta l4proto tcp queue num 78
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

enum {
  kExitBadFlag = 2,
  kQueueMaxLen = 65536,        /* packets the kernel may hold for us */
  kSocketBuffer = 16 << 20,    /* netlink receive buffer, bytes */
  kReceiveBuffer = 256 * 1024, /* one recv(); metadata only, so plenty */
};

typedef struct {
  uint32_t id;
  int64_t due_ns;
} HeldPacket;

/* A FIFO of held packets: the delay is constant, so arrival order is also the
 * order they fall due. A ring buffer that doubles when full. */
typedef struct {
  HeldPacket* items;
  size_t capacity;
  size_t head;
  size_t size;
} Fifo;

typedef struct {
  int queue;
  int64_t delay_ns;
  double drop_percent;
  uint64_t seed;
} Flags;

typedef struct {
  Flags flags;
  struct nfq_q_handle* qh;
  Fifo held;
  uint64_t rng;
  uint64_t seen;
  uint64_t dropped;
  uint64_t delayed;
  uint64_t released_early;
  uint64_t verdict_errors;
} State;

static volatile sig_atomic_t stop_signal = 0;

static void OnSignal(int sig) { stop_signal = sig; }

static int64_t NowNs(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* splitmix64: small, seedable, good enough for drop decisions. */
static uint64_t NextRandom(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static int FifoPush(Fifo* f, HeldPacket p) {
  if (f->size == f->capacity) {
    size_t capacity = f->capacity ? f->capacity * 2 : 1024;
    HeldPacket* items = malloc(capacity * sizeof(HeldPacket));
    if (items == NULL) return -1;
    for (size_t i = 0; i < f->size; ++i) {
      items[i] = f->items[(f->head + i) % f->capacity];
    }
    free(f->items);
    f->items = items;
    f->capacity = capacity;
    f->head = 0;
  }
  f->items[(f->head + f->size) % f->capacity] = p;
  ++f->size;
  return 0;
}

static HeldPacket* FifoFront(Fifo* f) {
  return f->size ? &f->items[f->head] : NULL;
}

static void FifoPop(Fifo* f) {
  f->head = (f->head + 1) % f->capacity;
  --f->size;
}

static void Verdict(State* st, uint32_t id, uint32_t verdict) {
  if (nfq_set_verdict(st->qh, id, verdict, 0, NULL) < 0) ++st->verdict_errors;
}

static int OnPacket(struct nfq_q_handle* qh, struct nfgenmsg* msg,
                    struct nfq_data* nfa, void* data) {
  (void)qh;
  (void)msg;
  State* st = data;
  struct nfqnl_msg_packet_hdr* hdr = nfq_get_msg_packet_hdr(nfa);
  if (hdr == NULL) return 0;
  const uint32_t id = ntohl(hdr->packet_id);
  ++st->seen;
  if (st->flags.drop_percent > 0) {
    /* 53 random bits -> a uniform double in [0, 100). */
    const double r =
        (double)(NextRandom(&st->rng) >> 11) * (100.0 / 9007199254740992.0);
    if (r < st->flags.drop_percent) {
      ++st->dropped;
      Verdict(st, id, NF_DROP);
      return 0;
    }
  }
  if (st->flags.delay_ns == 0) {
    Verdict(st, id, NF_ACCEPT);
    return 0;
  }
  HeldPacket p = {id, NowNs() + st->flags.delay_ns};
  if (FifoPush(&st->held, p) != 0) {
    ++st->released_early; /* out of memory: pass it on undelayed */
    Verdict(st, id, NF_ACCEPT);
    return 0;
  }
  ++st->delayed;
  return 0;
}

/* Accepts every held packet due by `now` (all of them when now < 0). */
static void ReleaseDue(State* st, int64_t now) {
  HeldPacket* p;
  while ((p = FifoFront(&st->held)) != NULL && (now < 0 || p->due_ns <= now)) {
    Verdict(st, p->id, NF_ACCEPT);
    FifoPop(&st->held);
  }
}

static int BadFlag(const char* flag, const char* value, const char* expected) {
  if (value == NULL) {
    fprintf(stderr, "nfq_delay: %s needs a value: %s\n", flag, expected);
  } else {
    fprintf(stderr, "nfq_delay: %s '%s': expected %s\n", flag, value, expected);
  }
  return kExitBadFlag;
}

static int ParseInt(const char* s, long long lo, long long hi, long long* out) {
  if (s == NULL || *s == '\0') return -1;
  char* end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static void Usage(FILE* out) {
  fprintf(out,
          "usage: nfq_delay --queue N [--delay-ms D] [--drop-percent P] "
          "[--seed S]\n"
          "  --queue N         NFQUEUE number to bind, 0..65535 (required)\n"
          "  --delay-ms D      hold each packet D ms, 0..600000 (default 0)\n"
          "  --drop-percent P  drop each packet with probability P%%, 0..100 "
          "(default 0)\n"
          "  --seed S          random seed, 0..2^64-1 (default 1)\n");
}

/* Returns -1 to go on, or the status to exit with (0 after --help, 2 for a
 * bad flag). */
static int ParseFlags(int argc, char** argv, Flags* flags) {
  flags->queue = -1;
  flags->delay_ns = 0;
  flags->drop_percent = 0;
  flags->seed = 1;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
      Usage(stdout);
      return 0;
    }
    const char* name = arg;
    const char* value = NULL;
    char flag[64];
    const char* eq = strchr(arg, '=');
    if (strncmp(arg, "--", 2) == 0 && eq != NULL) {
      size_t len = (size_t)(eq - arg);
      if (len >= sizeof(flag)) len = sizeof(flag) - 1;
      memcpy(flag, arg, len);
      flag[len] = '\0';
      name = flag;
      value = eq + 1;
    }
    const int known =
        strcmp(name, "--queue") == 0 || strcmp(name, "--delay-ms") == 0 ||
        strcmp(name, "--drop-percent") == 0 || strcmp(name, "--seed") == 0;
    if (!known) {
      fprintf(stderr,
              "nfq_delay: unknown flag '%s': expected --queue, --delay-ms, "
              "--drop-percent or --seed\n",
              arg);
      return kExitBadFlag;
    }
    if (value == NULL) value = (i + 1 < argc) ? argv[++i] : NULL;
    long long v = 0;
    if (strcmp(name, "--queue") == 0) {
      if (ParseInt(value, 0, 65535, &v) != 0) {
        return BadFlag(name, value, "a queue number in 0..65535");
      }
      flags->queue = (int)v;
    } else if (strcmp(name, "--delay-ms") == 0) {
      if (ParseInt(value, 0, 600000, &v) != 0) {
        return BadFlag(name, value, "milliseconds in 0..600000");
      }
      flags->delay_ns = (int64_t)v * 1000000;
    } else if (strcmp(name, "--drop-percent") == 0) {
      char* end = NULL;
      double p = value ? strtod(value, &end) : -1;
      if (value == NULL || *value == '\0' || *end != '\0' || !(p >= 0) ||
          p > 100) {
        return BadFlag(name, value, "a percentage in 0..100");
      }
      flags->drop_percent = p;
    } else {
      char* end = NULL;
      errno = 0;
      unsigned long long s = value ? strtoull(value, &end, 10) : 0;
      if (value == NULL || *value == '\0' || *value == '-' || *end != '\0' ||
          errno != 0) {
        return BadFlag(name, value, "a whole number in 0..2^64-1");
      }
      flags->seed = s;
    }
  }
  if (flags->queue < 0) {
    fprintf(stderr,
            "nfq_delay: --queue is required: a queue number in "
            "0..65535\n");
    return kExitBadFlag;
  }
  return -1;
}

int main(int argc, char** argv) {
  State st;
  memset(&st, 0, sizeof(st));
  const int exit_status = ParseFlags(argc, argv, &st.flags);
  if (exit_status >= 0) return exit_status;
  st.rng = st.flags.seed;

  /* Signals are blocked except inside ppoll(), so none is lost between the
   * stop check and the wait. */
  sigset_t block, wait_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &wait_mask);
  sigdelset(&wait_mask, SIGTERM);
  sigdelset(&wait_mask, SIGINT);
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);

  struct nfq_handle* h = nfq_open();
  if (h == NULL) {
    fprintf(stderr, "nfq_delay: nfq_open: %s (needs CAP_NET_ADMIN)\n",
            strerror(errno));
    return 1;
  }
  st.qh = nfq_create_queue(h, (uint16_t)st.flags.queue, OnPacket, &st);
  if (st.qh == NULL) {
    fprintf(stderr,
            "nfq_delay: cannot bind queue %d: %s (another program bound "
            "it?)\n",
            st.flags.queue, strerror(errno));
    nfq_close(h);
    return 1;
  }
  /* Metadata only: the packets go back unchanged, so no payload is copied. */
  if (nfq_set_mode(st.qh, NFQNL_COPY_META, 0) < 0) {
    fprintf(stderr, "nfq_delay: nfq_set_mode: %s\n", strerror(errno));
    nfq_destroy_queue(st.qh);
    nfq_close(h);
    return 1;
  }
  if (nfq_set_queue_maxlen(st.qh, kQueueMaxLen) < 0) {
    fprintf(stderr, "nfq_delay: warning: nfq_set_queue_maxlen: %s\n",
            strerror(errno));
  }
  /* GSO: large TCP segments arrive whole instead of being split first. */
  if (nfq_set_queue_flags(st.qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0) {
    fprintf(stderr, "nfq_delay: warning: NFQA_CFG_F_GSO: %s\n",
            strerror(errno));
  }
  const int fd = nfq_fd(h);
  nfnl_rcvbufsiz(nfq_nfnlh(h), kSocketBuffer);
  const int one = 1;
  setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof(one));

  printf("nfq_delay: queue %d ready (delay %lld ms, drop %g%%, seed %llu)\n",
         st.flags.queue, (long long)(st.flags.delay_ns / 1000000),
         st.flags.drop_percent, (unsigned long long)st.flags.seed);
  fflush(stdout);

  static char buf[kReceiveBuffer] __attribute__((aligned));
  int status = 0;
  while (!stop_signal) {
    struct timespec timeout;
    struct timespec* timeout_ptr = NULL;
    HeldPacket* next = FifoFront(&st.held);
    if (next != NULL) {
      int64_t wait = next->due_ns - NowNs();
      if (wait < 0) wait = 0;
      timeout.tv_sec = wait / 1000000000;
      timeout.tv_nsec = wait % 1000000000;
      timeout_ptr = &timeout;
    }
    struct pollfd pfd = {fd, POLLIN, 0};
    const int ready = ppoll(&pfd, 1, timeout_ptr, &wait_mask);
    if (ready < 0 && errno != EINTR) {
      fprintf(stderr, "nfq_delay: ppoll: %s\n", strerror(errno));
      status = 1;
      break;
    }
    if (ready > 0) {
      /* Drain what is there without blocking. */
      for (;;) {
        const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
          if (errno == ENOBUFS) continue; /* the kernel dropped some */
          fprintf(stderr, "nfq_delay: recv: %s\n", strerror(errno));
          status = 1;
          break;
        }
        nfq_handle_packet(h, buf, (int)n);
      }
      if (status != 0) break;
    }
    ReleaseDue(&st, NowNs());
  }
  /* Let every held packet go rather than have the kernel drop them. */
  st.released_early += st.held.size;
  ReleaseDue(&st, -1);
  nfq_destroy_queue(st.qh);
  nfq_close(h);
  free(st.held.items);
  printf(
      "nfq_delay: queue %d: seen %llu, dropped %llu, delayed %llu, "
      "released-early %llu, verdict-errors %llu\n",
      st.flags.queue, (unsigned long long)st.seen,
      (unsigned long long)st.dropped, (unsigned long long)st.delayed,
      (unsigned long long)st.released_early,
      (unsigned long long)st.verdict_errors);
  fflush(stdout);
  return status;
}

// ps_bound_bench: how close to raw ZeroMQ any parameter server's push + pull
// can come on this machine, beside raw ZeroMQ in the same run (issue #27).
//
//   ps_bound_bench [--mb=205] [--runs=5] [--window=16] [--span-mb=1024]
//                  [--row-length=1024] [--optimizer="sgd lr=0.1"]
//
// Two processes on loopback, PUSH/PULL sockets one way each, 1 MiB messages.
// Each run measures, one after the other, the same --mb of bytes moved:
//
//   raw     one-way stream of the bytes from one touched buffer (the seed
//           step's raw ZeroMQ baseline)
//   ideal   a push + pull with no work but the update: the worker streams
//           gradients (half the bytes, --window messages in flight), the
//           server applies --optimizer to consecutive weights of a --span-mb
//           store and answers each message with the updated weights, lent to
//           ZeroMQ without a copy; the worker does not read them
//   rows    the same with rows: each message carries random rows of
//           --row-length (and their ids); the server updates those rows in
//           the store, gathers them into its answer, and the worker copies
//           the answer into its packed output (what PushRows + PullRows must
//           do at the least, with no protocol at all)
//
// and prints GB/s (bytes moved, both directions counted, per second) and each
// ratio to raw, per run and the median. No checks of the values: the ratios
// are the point, and tools/bench/seed_step.py --okrows measures Tessera's own
// push + pull of rows against the same raw baseline.
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/optimizer.h"
#include "tools/bench/bench_util.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMessage = size_t{1} << 20;
// Each run moves its bytes twice over one connection and times the second
// pass: a fresh connection's first megabytes go slower (TCP's window grows),
// and a job's connections are warm.
constexpr size_t kPasses = 2;

struct Flags {
  double mb = 205;
  int runs = 5;
  size_t window = 16;
  size_t span_mb = 1024;
  size_t row_length = 1024;
  std::string optimizer = "sgd lr=0.1";
};

enum class Mode { kRaw, kIdeal, kRows };

void Die(const std::string& what) {
  std::fprintf(stderr, "ps_bound_bench: %s\n", what.c_str());
  std::exit(1);
}

// `bytes` of float32 `fill`, every page touched. (A byte pattern would make
// gradients of about 1e-38, whose updates are subnormal and slow.)
void* Touched(size_t bytes, float fill) {
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p == nullptr) Die(absl::StrCat("no memory for ", bytes, " bytes"));
  std::fill_n(static_cast<float*>(p), bytes / sizeof(float), fill);
  return p;
}

// A PULL socket bound to an ephemeral loopback port; returns the port.
int BindPull(void* socket) {
  if (zmq_bind(socket, "tcp://127.0.0.1:*") != 0)
    Die(absl::StrCat("bind: ", zmq_strerror(zmq_errno())));
  char endpoint[256];
  size_t size = sizeof(endpoint);
  zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, endpoint, &size);
  return std::atoi(std::strrchr(endpoint, ':') + 1);
}

void Connect(void* socket, int port) {
  if (zmq_connect(socket, absl::StrCat("tcp://127.0.0.1:", port).c_str()) != 0)
    Die(absl::StrCat("connect: ", zmq_strerror(zmq_errno())));
}

void Send(void* socket, const void* data, size_t size, int flags) {
  zmq_msg_t m;
  zmq_msg_init_data(&m, const_cast<void*>(data), size, nullptr, nullptr);
  if (zmq_msg_send(&m, socket, flags) < 0)
    Die(absl::StrCat("send: ", zmq_strerror(zmq_errno())));
}

// A PULL socket whose receives give up after 60 s (a peer that died).
void* PullSocket(void* context) {
  void* socket = zmq_socket(context, ZMQ_PULL);
  const int timeout_ms = 60 * 1000;
  zmq_setsockopt(socket, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  return socket;
}

// Receives one message part into `m` (initialised by the caller).
void Receive(void* socket, zmq_msg_t* m) {
  if (zmq_msg_recv(m, socket, 0) < 0)
    Die(absl::StrCat("receive: ", zmq_strerror(zmq_errno())));
}

void WriteInt(int fd, int v) {
  if (write(fd, &v, sizeof(v)) != sizeof(v)) Die("pipe write");
}
int ReadInt(int fd) {
  int v = 0;
  if (read(fd, &v, sizeof(v)) != sizeof(v)) Die("pipe read");
  return v;
}

// The server's side of one run; `messages` gradient messages (raw: the
// stream's messages).
void Serve(const Flags& flags, Mode mode, size_t messages, int to_parent,
           int from_parent) {
  auto opt = Optimizer::Create(flags.optimizer);
  if (!opt.ok()) Die(std::string(opt.status().message()));
  // Every page touched before the parent's clock starts.
  const size_t span = flags.span_mb << 20;
  float* weights =
      static_cast<float*>(Touched(mode == Mode::kRaw ? 4 : span, 0.5f));
  void* context = zmq_ctx_new();
  void* in = PullSocket(context);
  void* out = zmq_socket(context, ZMQ_PUSH);
  WriteInt(to_parent, BindPull(in));
  Connect(out, ReadInt(from_parent));
  const size_t row_bytes = flags.row_length * sizeof(float);
  // Answers in flight are at most --window; a ring of twice that many reply
  // buffers is never rewritten while ZeroMQ still sends one.
  std::vector<std::unique_ptr<float, decltype(&std::free)>> replies;
  for (size_t i = 0; i < 2 * flags.window; ++i)
    replies.emplace_back(static_cast<float*>(Touched(kMessage, 0.0f)),
                         &std::free);
  for (size_t i = 0; i < kPasses * messages; ++i) {
    zmq_msg_t ids, grad;
    zmq_msg_init(&ids);
    zmq_msg_init(&grad);
    if (mode == Mode::kRows) Receive(in, &ids);
    Receive(in, &grad);
    const float* g = static_cast<const float*>(zmq_msg_data(&grad));
    if (mode == Mode::kIdeal) {
      float* w = weights + (i * kMessage % span) / sizeof(float);
      (*opt)->Update(w, g, kMessage / sizeof(float), nullptr, 1);
      Send(out, w, kMessage, 0);  // lent: the next write there is span away
    } else if (mode == Mode::kRows) {
      const uint64_t* id = static_cast<const uint64_t*>(zmq_msg_data(&ids));
      const size_t n = zmq_msg_size(&ids) / sizeof(uint64_t);
      float* reply = replies[i % replies.size()].get();
      for (size_t r = 0; r < n; ++r) {
        float* w = weights + id[r] * flags.row_length;
        (*opt)->Update(w, g + r * flags.row_length, flags.row_length, nullptr,
                       1);
        std::memcpy(reply + r * flags.row_length, w, row_bytes);
      }
      Send(out, reply, n * row_bytes, 0);
    }
    zmq_msg_close(&ids);
    zmq_msg_close(&grad);
    if (mode == Mode::kRaw && (i + 1) % messages == 0) Send(out, "done", 4, 0);
  }
  zmq_close(in);
  zmq_close(out);
  zmq_ctx_term(context);  // every lent answer sent: then free the store
  std::free(weights);
}

// One run of `mode`: forks the server, drives it, returns GB/s.
double RunOnce(const Flags& flags, Mode mode) {
  const size_t bytes = static_cast<size_t>(flags.mb * 1e6);
  // raw streams every byte one way; the others move half each way.
  const size_t messages = std::max<size_t>(
      1, mode == Mode::kRaw ? bytes / kMessage : bytes / 2 / kMessage);
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0) Die("pipe");
  std::fflush(stdout);  // the child must not print the parent's lines again
  const pid_t pid = fork();
  if (pid < 0) Die("fork");
  if (pid == 0) {
    Serve(flags, mode, messages, up[1], down[0]);
    std::_Exit(0);
  }
  void* context = zmq_ctx_new();
  void* in = PullSocket(context);
  void* out = zmq_socket(context, ZMQ_PUSH);
  const int server_port = ReadInt(up[0]);
  WriteInt(down[1], BindPull(in));
  Connect(out, server_port);

  const size_t row_bytes = flags.row_length * sizeof(float);
  const size_t rows_per_message = kMessage / row_bytes;
  const size_t span_rows = (flags.span_mb << 20) / row_bytes;
  uint8_t* payload = static_cast<uint8_t*>(Touched(kMessage, 1.0f));
  // The gradients (a fresh region per message, as a training step's are)
  // and the packed output the rows go to.
  const size_t region = messages * kMessage;
  uint8_t* grads =
      static_cast<uint8_t*>(Touched(mode == Mode::kRaw ? 4 : region, 0.01f));
  uint8_t* packed =
      static_cast<uint8_t*>(Touched(mode == Mode::kRows ? region : 4, 0.0f));
  std::vector<uint64_t> ids(kPasses * messages * rows_per_message);
  std::mt19937_64 rng(7);
  for (uint64_t& id : ids) id = rng() % span_rows;

  double seconds = 0;
  for (size_t pass = 0; pass < kPasses; ++pass) {
    const Clock::time_point start = Clock::now();
    if (mode == Mode::kRaw) {
      for (size_t i = 0; i < messages; ++i) Send(out, payload, kMessage, 0);
      zmq_msg_t done;
      zmq_msg_init(&done);
      Receive(in, &done);
      zmq_msg_close(&done);
    } else {
      const uint64_t* pass_ids =
          ids.data() + pass * messages * rows_per_message;
      size_t sent = 0, answered = 0;
      while (answered < messages) {
        while (sent < messages && sent - answered < flags.window) {
          if (mode == Mode::kRows)
            Send(out, pass_ids + sent * rows_per_message,
                 rows_per_message * sizeof(uint64_t), ZMQ_SNDMORE);
          Send(out, grads + sent * kMessage, kMessage, 0);
          ++sent;
        }
        zmq_msg_t reply;
        zmq_msg_init(&reply);
        Receive(in, &reply);
        if (mode == Mode::kRows)
          std::memcpy(packed + answered * kMessage, zmq_msg_data(&reply),
                      zmq_msg_size(&reply));
        zmq_msg_close(&reply);
        ++answered;
      }
    }
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("server failed");
  std::free(payload);
  std::free(grads);
  std::free(packed);
  zmq_close(in);
  zmq_close(out);
  zmq_ctx_term(context);
  for (int fd : {up[0], up[1], down[0], down[1]}) close(fd);
  return messages * kMessage * (mode == Mode::kRaw ? 1 : 2) / seconds / 1e9;
}

int Main(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    bool ok = true;
    if (TakeFlag(argv[i], "mb", &v)) {
      ok = absl::SimpleAtod(v, &flags.mb) && flags.mb >= 2;
    } else if (TakeFlag(argv[i], "runs", &v)) {
      ok = absl::SimpleAtoi(v, &flags.runs) && flags.runs > 0;
    } else if (TakeFlag(argv[i], "window", &v)) {
      ok = absl::SimpleAtoi(v, &flags.window) && flags.window > 0;
    } else if (TakeFlag(argv[i], "span-mb", &v)) {
      ok = absl::SimpleAtoi(v, &flags.span_mb) && flags.span_mb >= 64;
    } else if (TakeFlag(argv[i], "row-length", &v)) {
      ok = absl::SimpleAtoi(v, &flags.row_length) && flags.row_length > 0 &&
           kMessage % (flags.row_length * sizeof(float)) == 0;
    } else if (TakeFlag(argv[i], "optimizer", &v)) {
      flags.optimizer = v;
      ok = Optimizer::Create(v).ok();
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "ps_bound_bench: bad flag %s (expected --mb=MB>=2, "
                   "--runs=N>0, --window=N>0, --span-mb=MB>=64, "
                   "--row-length=L with 1 MiB a multiple of its bytes, "
                   "--optimizer=SPEC)\n",
                   argv[i]);
      return 2;
    }
  }
  std::printf(
      "ps_bound_bench: %.0f MB moved per run, 1 MiB messages, window "
      "%zu, store %zu MiB, rows of %zu, optimizer \"%s\"\n\n",
      flags.mb, flags.window, flags.span_mb, flags.row_length,
      flags.optimizer.c_str());
  std::printf(
      "| run | raw GB/s | ideal GB/s | x raw | rows GB/s | x raw |\n"
      "|---:|---:|---:|---:|---:|---:|\n");
  std::vector<double> ideal_x, rows_x;
  for (int r = 0; r < flags.runs; ++r) {
    const double raw = RunOnce(flags, Mode::kRaw);
    const double ideal = RunOnce(flags, Mode::kIdeal);
    const double rows = RunOnce(flags, Mode::kRows);
    ideal_x.push_back(ideal / raw);
    rows_x.push_back(rows / raw);
    std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f |\n", r + 1, raw,
                ideal, ideal / raw, rows, rows / raw);
    std::fflush(stdout);
  }
  std::printf("\nmedian: ideal %.2fx raw, rows %.2fx raw\n", Median(ideal_x),
              Median(rows_x));
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) { return tessera::bench::Main(argc, argv); }

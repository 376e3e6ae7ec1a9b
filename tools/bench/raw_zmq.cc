#include "tools/bench/raw_zmq.h"

#include <zmq.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::bench {
namespace {

enum Command : uint32_t {
  kStream = 1,
  kPing = 2,
  kAcked = 3,
  kAck = 4,
  kQuit = 5,
  kTwoWay = 6
};

struct ControlHeader {
  uint32_t command = 0;
  uint32_t unused = 0;
  uint64_t size = 0;
  uint64_t count = 0;
};

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

// Aligned, touched memory that lives for the whole process.
uint8_t* Payload(size_t size) {
  static uint8_t* buffer = nullptr;
  static size_t capacity = 0;
  if (size > capacity) {
    std::free(buffer);
    capacity = ((size + 4095) / 4096) * 4096;
    buffer = static_cast<uint8_t*>(std::aligned_alloc(4096, capacity));
    std::memset(buffer, 1, capacity);
  }
  return buffer;
}

// Sends a small copied frame followed (when size > 0) by a zero-copy data
// frame.
bool SendParts(void* socket, const void* head, size_t head_size,
               const uint8_t* data, size_t size) {
  zmq_msg_t h;
  zmq_msg_init_size(&h, head_size);
  std::memcpy(zmq_msg_data(&h), head, head_size);
  if (zmq_msg_send(&h, socket, size > 0 ? ZMQ_SNDMORE : 0) < 0) {
    zmq_msg_close(&h);
    return false;
  }
  if (size == 0) return true;
  zmq_msg_t d;
  // A null free function marks constant data: ZeroMQ reads it in place.
  zmq_msg_init_data(&d, const_cast<uint8_t*>(data), size, nullptr, nullptr);
  if (zmq_msg_send(&d, socket, 0) < 0) {
    zmq_msg_close(&d);
    return false;
  }
  return true;
}

// Receives one multi-part message; returns the first part's bytes (up to
// `head_size` copied into `head`) and the total size of the other parts, -1 on
// error.
int64_t ReceiveParts(void* socket, void* head, size_t head_size) {
  int64_t data_bytes = 0;
  bool first = true;
  while (true) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, socket, 0) < 0) {
      zmq_msg_close(&m);
      return -1;
    }
    if (first) {
      if (head != nullptr) {
        std::memcpy(head, zmq_msg_data(&m),
                    std::min(head_size, zmq_msg_size(&m)));
      }
      first = false;
    } else {
      data_bytes += static_cast<int64_t>(zmq_msg_size(&m));
    }
    const bool more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    if (!more) return data_bytes;
  }
}

void SetCommon(void* socket) {
  const int linger = 0;
  zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof(linger));
}

// RawZmqPlan::curve: the peer finds the keys (the server's public key, its own
// public and secret keys, Z85, 40 characters each) in this variable.
constexpr char kCurveVariable[] = "TESSERA_BENCH_RAW_CURVE";

void SetCurveClient(void* socket, const std::string& keys) {
  zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, keys.data(), 40);
  zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, keys.data() + 40, 40);
  zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, keys.data() + 80, 40);
}

void SetCurveServer(void* socket, const char* secret_key) {
  const int on = 1;
  zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &on, sizeof(on));
  zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret_key, 40);
}

}  // namespace

int RunRawZmqPeer(int data_port, int control_port) {
  void* context = zmq_ctx_new();
  void* data = zmq_socket(context, ZMQ_PUSH);
  void* control = zmq_socket(context, ZMQ_PULL);
  SetCommon(data);
  SetCommon(control);
  if (const char* keys = std::getenv(kCurveVariable);
      keys != nullptr && std::strlen(keys) == 120) {
    SetCurveClient(data, keys);
    SetCurveClient(control, keys);
  }
  if (zmq_connect(data, absl::StrCat("tcp://127.0.0.1:", data_port).c_str()) !=
          0 ||
      zmq_connect(control,
                  absl::StrCat("tcp://127.0.0.1:", control_port).c_str()) !=
          0) {
    std::fprintf(stderr, "raw peer: connect: %s\n", ZmqError().c_str());
    return 1;
  }
  int code = 0;
  while (true) {
    ControlHeader c;
    if (ReceiveParts(control, &c, sizeof(c)) < 0) {
      code = 1;
      break;
    }
    if (c.command == kQuit) break;
    const uint8_t* payload = Payload(c.size);
    bool ok = true;
    uint64_t seq = 0;
    switch (c.command) {
      case kStream:
        for (uint64_t i = 0; i < c.count && ok; ++i) {
          ok = SendParts(data, &seq, sizeof(seq), payload, c.size);
          ++seq;
        }
        break;
      case kPing:
        ok = SendParts(data, &seq, sizeof(seq), payload, c.size);
        break;
      case kTwoWay: {
        // Streams `count` messages to the parent while receiving as many from
        // it on the control socket.
        bool sent = true;
        std::thread sender([&] {
          uint64_t n = 0;
          for (uint64_t i = 0; i < c.count && sent; ++i) {
            sent = SendParts(data, &n, sizeof(n), payload, c.size);
            ++n;
          }
        });
        for (uint64_t i = 0; i < c.count && ok; ++i) {
          ok =
              ReceiveParts(control, nullptr, 0) == static_cast<int64_t>(c.size);
        }
        sender.join();
        ok = ok && sent;
        break;
      }
      case kAcked:
        for (uint64_t i = 0; i < c.count && ok; ++i) {
          ok = SendParts(data, &seq, sizeof(seq), payload, c.size) &&
               ReceiveParts(control, nullptr, 0) >= 0;
          ++seq;
        }
        break;
      default:
        break;
    }
    if (!ok) {
      std::fprintf(stderr, "raw peer: %s\n", ZmqError().c_str());
      code = 1;
      break;
    }
  }
  zmq_close(data);
  zmq_close(control);
  zmq_ctx_term(context);
  return code;
}

namespace {

class RawZmqSession {
 public:
  RawZmqSession() {
    context_ = zmq_ctx_new();
    data_ = zmq_socket(context_, ZMQ_PULL);
    control_ = zmq_socket(context_, ZMQ_PUSH);
    SetCommon(data_);
    SetCommon(control_);
  }
  ~RawZmqSession() {
    if (peer_.pid > 0) {
      ControlHeader quit;
      quit.command = kQuit;
      SendParts(control_, &quit, sizeof(quit), nullptr, 0);
      if (WaitProcess(peer_, absl::Seconds(5)) < 0) KillProcess(peer_);
    }
    zmq_close(data_);
    zmq_close(control_);
    zmq_ctx_term(context_);
  }

  absl::Status Start(const RawZmqPlan& plan) {
    std::map<std::string, std::string> env;
    if (plan.curve) {
      char server_public[41], server_secret[41], client_public[41],
          client_secret[41];
      if (zmq_curve_keypair(server_public, server_secret) != 0 ||
          zmq_curve_keypair(client_public, client_secret) != 0) {
        return Error("zmq_curve_keypair");
      }
      SetCurveServer(data_, server_secret);
      SetCurveServer(control_, server_secret);
      env[kCurveVariable] =
          absl::StrCat(server_public, client_public, client_secret);
    }
    absl::StatusOr<int> data_port = BindAny(data_);
    if (!data_port.ok()) return data_port.status();
    absl::StatusOr<int> control_port = BindAny(control_);
    if (!control_port.ok()) return control_port.status();
    absl::StatusOr<ChildProcess> peer = SpawnProcess(
        {plan.self_exe,
         absl::StrCat("--raw-peer=", *data_port, ",", *control_port)},
        env, /*capture_stdout=*/false, plan.log_path);
    if (!peer.ok()) return peer.status();
    peer_ = *peer;
    return absl::OkStatus();
  }

  // Seconds to stream `count` messages of `size` bytes from the peer to here.
  absl::StatusOr<double> Stream(size_t size, uint64_t count) {
    ControlHeader c{kStream, 0, size, count};
    const double t0 = NowSeconds();
    if (!SendParts(control_, &c, sizeof(c), nullptr, 0)) return Error("stream");
    for (uint64_t i = 0; i < count; ++i) {
      if (ReceiveParts(data_, nullptr, 0) != static_cast<int64_t>(size))
        return Error("stream");
    }
    return NowSeconds() - t0;
  }

  // Seconds to stream `count` messages of `size` bytes each way at once: the
  // peer streams to here while this process streams to the peer.
  absl::StatusOr<double> TwoWay(size_t size, uint64_t count) {
    ControlHeader c{kTwoWay, 0, size, count};
    const uint8_t* payload = Payload(size);
    const double t0 = NowSeconds();
    if (!SendParts(control_, &c, sizeof(c), nullptr, 0))
      return Error("two-way");
    bool sent = true;
    std::thread sender([&] {
      uint64_t n = 0;
      for (uint64_t i = 0; i < count && sent; ++i) {
        sent = SendParts(control_, &n, sizeof(n), payload, size);
        ++n;
      }
    });
    bool ok = true;
    for (uint64_t i = 0; i < count && ok; ++i) {
      ok = ReceiveParts(data_, nullptr, 0) == static_cast<int64_t>(size);
    }
    sender.join();
    if (!ok || !sent) return Error("two-way");
    return NowSeconds() - t0;
  }

  // Round trip of `size` bytes each way, microseconds.
  absl::StatusOr<double> Ping(size_t size) {
    ControlHeader c{kPing, 0, size, 1};
    const double t0 = NowSeconds();
    if (!SendParts(control_, &c, sizeof(c), Payload(size), size))
      return Error("ping");
    if (ReceiveParts(data_, nullptr, 0) != static_cast<int64_t>(size))
      return Error("ping");
    return (NowSeconds() - t0) * 1e6;
  }

  // Per-message times (microseconds) of `count` messages each answered by an
  // ack.
  absl::StatusOr<std::vector<double>> Acked(size_t size, uint64_t count) {
    ControlHeader c{kAcked, 0, size, count};
    std::vector<double> us;
    double t = NowSeconds();
    if (!SendParts(control_, &c, sizeof(c), nullptr, 0)) return Error("acked");
    ControlHeader ack{kAck, 0, 0, 0};
    for (uint64_t i = 0; i < count; ++i) {
      if (ReceiveParts(data_, nullptr, 0) != static_cast<int64_t>(size))
        return Error("acked");
      if (!SendParts(control_, &ack, sizeof(ack), nullptr, 0))
        return Error("acked");
      const double now = NowSeconds();
      us.push_back((now - t) * 1e6);
      t = now;
    }
    return us;
  }

 private:
  absl::StatusOr<int> BindAny(void* socket) {
    if (zmq_bind(socket, "tcp://127.0.0.1:*") != 0) {
      return absl::UnavailableError(
          absl::StrCat("raw ZeroMQ bind: ", ZmqError()));
    }
    char last[256] = {0};
    size_t len = sizeof(last);
    zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &len);
    const std::string endpoint(last);
    return std::atoi(endpoint.c_str() + endpoint.rfind(':') + 1);
  }
  absl::Status Error(const char* what) {
    return absl::UnavailableError(
        absl::StrCat("raw ZeroMQ ", what, ": ", ZmqError()));
  }

  void* context_ = nullptr;
  void* data_ = nullptr;
  void* control_ = nullptr;
  ChildProcess peer_;
};

uint64_t Clamp(double n, uint64_t lo, uint64_t hi) {
  if (!(n > static_cast<double>(lo))) return lo;
  if (n > static_cast<double>(hi)) return hi;
  return static_cast<uint64_t>(n);
}

}  // namespace

absl::StatusOr<std::vector<RawZmqFigures>> MeasureRawZmq(
    const RawZmqPlan& plan) {
  RawZmqSession session;
  if (absl::Status s = session.Start(plan); !s.ok()) return s;
  std::vector<RawZmqFigures> out;
  for (size_t size : plan.sizes) {
    RawZmqFigures f;
    f.size = size;
    // Warm-up doubles as calibration.
    const uint64_t warm =
        Clamp(64.0 * (1 << 20) / static_cast<double>(size), 2, 2000);
    absl::StatusOr<double> t = session.Stream(size, warm);
    if (!t.ok()) return t.status();
    const uint64_t count = Clamp(plan.seconds / (*t / warm), 8, 1000000);
    t = session.Stream(size, count);
    if (!t.ok()) return t.status();
    f.gbps = static_cast<double>(size) * count / *t / 1e9;

    if (plan.two_way) {
      t = session.TwoWay(size, count);
      if (!t.ok()) return t.status();
      f.two_way_gbps = static_cast<double>(size) * count / *t / 1e9;
    }

    std::vector<double> rtt;
    double spent = 0;
    for (int i = 0; i < 5 || (spent < plan.seconds / 2 && i < 20000); ++i) {
      absl::StatusOr<double> us = session.Ping(size);
      if (!us.ok()) return us.status();
      if (i >= 2) rtt.push_back(*us);  // the first two warm up
      spent += *us * 1e-6;
    }
    f.rtt = Percentiles(rtt);

    if (plan.ack_cost) {
      const uint64_t n =
          Clamp(plan.seconds / 2 / (f.rtt.p50_us * 1e-6), 5, 20000);
      absl::StatusOr<std::vector<double>> us = session.Acked(size, n);
      if (!us.ok()) return us.status();
      double total = 0;
      for (double u : *us) total += u;
      f.acked_gbps = static_cast<double>(size) * n / (total * 1e-6) / 1e9;
      f.acked = Percentiles(*us);
    }
    out.push_back(f);
  }
  return out;
}

std::vector<RawZmqFigures> CombineRuns(
    const std::vector<RawZmqFigures>& before,
    const std::vector<RawZmqFigures>& after) {
  std::vector<RawZmqFigures> out = before;
  for (size_t i = 0; i < out.size() && i < after.size(); ++i) {
    RawZmqFigures& f = out[i];
    const RawZmqFigures& a = after[i];
    f.gbps_before = f.gbps;
    f.gbps_after = a.gbps;
    f.gbps = (f.gbps + a.gbps) / 2;
    f.two_way_gbps = (f.two_way_gbps + a.two_way_gbps) / 2;
    f.rtt_p50_before_us = f.rtt.p50_us;
    f.rtt_p50_after_us = a.rtt.p50_us;
    f.rtt.p50_us = (f.rtt.p50_us + a.rtt.p50_us) / 2;
    f.rtt.p99_us = (f.rtt.p99_us + a.rtt.p99_us) / 2;
    f.acked_gbps = (f.acked_gbps + a.acked_gbps) / 2;
    f.acked.p50_us = (f.acked.p50_us + a.acked.p50_us) / 2;
    f.acked.p99_us = (f.acked.p99_us + a.acked.p99_us) / 2;
  }
  return out;
}

double MeasureMemcpy(size_t size, double seconds) {
  std::unique_ptr<uint8_t, decltype(&std::free)> src(
      static_cast<uint8_t*>(std::aligned_alloc(64, ((size + 63) / 64) * 64)),
      &std::free);
  std::unique_ptr<uint8_t, decltype(&std::free)> dst(
      static_cast<uint8_t*>(std::aligned_alloc(64, ((size + 63) / 64) * 64)),
      &std::free);
  std::memset(src.get(), 1, size);
  std::memset(dst.get(), 2, size);
  std::memcpy(dst.get(), src.get(), size);
  uint64_t n = 0;
  const double t0 = NowSeconds();
  double t = t0;
  do {
    std::memcpy(dst.get(), src.get(), size);
    // Keeps the copy from being optimised away.
    asm volatile("" : : "r"(dst.get()) : "memory");
    ++n;
    t = NowSeconds();
  } while (t - t0 < seconds || n < 3);
  return static_cast<double>(size) * n / (t - t0) / 1e9;
}

}  // namespace tessera::bench

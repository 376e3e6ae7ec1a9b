// handshake_bench: what one connection's handshake costs a secured job, in
// CPU time of this process (both ends and their ZeroMQ I/O threads run here):
// a CURVE connection checked by the ZAP handler (what every connection was
// before sealed links; registrations still are) against a PLAIN one admitted
// by its pair's password (a sealed lane's: sealed_admission.h), and, for the sealed lane, the two X25519 a
// node computes per peer for the node keys (LinkKeys::ForPeer).
//
//   handshake_bench [--connections=200]
//
// Each mode: a receiving PULL socket with the job's security (as a node binds
// it), then N PUSH sockets connecting to it one after the other, each sending
// one message that must arrive (the handshake done); prints CPU ms per
// connection (user + system, getrusage) and the wall time.
#include <sys/resource.h>
#include <zmq.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/curve_keys.h"
#include "common/sealed_admission.h"
#include "common/sealed_link.h"
#include "common/zap_handler.h"

namespace tessera {
namespace {

double CpuSeconds() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

std::array<sealed::Key32, 3> RolePublics(const JobKeySet& set) {
  std::array<sealed::Key32, 3> publics;
  for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker})
    publics[static_cast<int>(r)] = *sealed::KeyFromZ85(set.of(r).public_key);
  return publics;
}

struct Figures {
  double cpu_ms_per_connection = 0;
  double wall_ms = 0;
};

// N connections of `mechanism` ("CURVE" or "PLAIN") into one receiver.
Figures Connect(const JobKeySet& set, bool curve, int n) {
  auto security = std::make_shared<ConnectionSecurity>();
  security->keys = *ParseKeyFile(FormatKeyFile(set, Role::kServer), "bench");
  security->encrypt = true;
  void* context = zmq_ctx_new();
  // A sealed lane admits each pair by its node keys (sealed_admission.h):
  // the receiver's own, and one worker node key per connection, each in its
  // table as a real job's would be. Their credentials are computed before
  // the clock starts: the figure is the receiver's side and the handshake.
  const std::array<sealed::Key32, 3> publics = RolePublics(set);
  auto own = std::make_shared<const sealed::LinkKeys>(*sealed::LinkKeys::Make(
      sealed::NodeKey::Generate(), Role::kServer,
      *sealed::KeyFromZ85(set.of(Role::kServer).secret_key), publics));
  auto admission = std::make_shared<sealed::Admission>(own);
  std::vector<std::pair<std::string, SecretString>> credentials;
  if (!curve) {
    const sealed::Key32 worker_secret =
        *sealed::KeyFromZ85(set.of(Role::kWorker).secret_key);
    for (int i = 0; i < n; ++i) {
      const sealed::LinkKeys worker = *sealed::LinkKeys::Make(
          sealed::NodeKey::Generate(), Role::kWorker, worker_secret, publics);
      admission->SetPeer(100 + i, Role::kWorker, worker.public_key());
      sealed::PeerSecrets p;
      if (!worker.ForPeer(own->public_key(), &p)) {
        std::fprintf(stderr, "handshake_bench: a key agreement failed\n");
        std::exit(1);
      }
      credentials.emplace_back(
          sealed::Admission::User(worker),
          sealed::Admission::Password(worker, p, Role::kServer,
                                      own->public_key()));
    }
  }
  std::unique_ptr<ZapHandler> zap =
      *ZapHandler::Start(context, security, admission);
  void* receiver = zmq_socket(context, ZMQ_PULL);
  const int on = 1;
  if (curve) {
    zmq_setsockopt(receiver, ZMQ_CURVE_SERVER, &on, sizeof(on));
    zmq_setsockopt(receiver, ZMQ_CURVE_SECRETKEY,
                   security->keys.secret_key.data(), 40);
    zmq_setsockopt(receiver, ZMQ_ZAP_DOMAIN, ZapHandler::kMainDomain,
                   std::strlen(ZapHandler::kMainDomain));
  } else {
    zmq_setsockopt(receiver, ZMQ_PLAIN_SERVER, &on, sizeof(on));
    zmq_setsockopt(receiver, ZMQ_ZAP_DOMAIN, ZapHandler::kSealedDomain,
                   std::strlen(ZapHandler::kSealedDomain));
  }
  zmq_bind(receiver, "tcp://127.0.0.1:*");
  char endpoint[256];
  size_t size = sizeof(endpoint);
  zmq_getsockopt(receiver, ZMQ_LAST_ENDPOINT, endpoint, &size);
  std::vector<void*> senders;
  const double cpu0 = CpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    void* s = zmq_socket(context, ZMQ_PUSH);
    if (curve) {
      zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY,
                     set.of(Role::kServer).public_key.data(), 40);
      zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY,
                     set.of(Role::kWorker).public_key.data(), 40);
      zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY,
                     set.of(Role::kWorker).secret_key.data(), 40);
    } else {
      const auto& [user, password] = credentials[i];
      zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, user.data(), user.size());
      zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, password.data(), password.size());
    }
    zmq_connect(s, endpoint);
    zmq_send(s, "x", 1, 0);
    char buf[8];
    if (zmq_recv(receiver, buf, sizeof(buf), 0) != 1) {
      std::fprintf(stderr, "handshake_bench: a message did not arrive\n");
      std::exit(1);
    }
    senders.push_back(s);
  }
  Figures f;
  f.wall_ms = std::chrono::duration<double, std::milli>(
                  std::chrono::steady_clock::now() - t0)
                  .count();
  f.cpu_ms_per_connection = (CpuSeconds() - cpu0) * 1e3 / n;
  const int zero = 0;
  for (void* s : senders) {
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_close(s);
  }
  zmq_setsockopt(receiver, ZMQ_LINGER, &zero, sizeof(zero));
  zmq_close(receiver);
  zap->Stop();
  zmq_ctx_term(context);
  return f;
}

int Main(int argc, char** argv) {
  int n = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--connections=", 0) != 0 ||
        !absl::SimpleAtoi(a.substr(14), &n) || n < 1) {
      std::fprintf(stderr,
                   "handshake_bench: bad flag '%s'; expected --connections=N\n",
                   a.c_str());
      return 2;
    }
  }
  const JobKeySet set = GenerateJobKeys().value();
  const Figures curve = Connect(set, true, n);
  const Figures plain = Connect(set, false, n);
  // The node keys' share of a sealed link: two X25519 per peer.
  const std::array<sealed::Key32, 3> publics = RolePublics(set);
  const sealed::LinkKeys keys = *sealed::LinkKeys::Make(
      sealed::NodeKey::Generate(), Role::kServer,
      *sealed::KeyFromZ85(set.of(Role::kServer).secret_key), publics);
  std::vector<sealed::Key32> peers;
  for (int i = 0; i < n; ++i)
    peers.push_back(sealed::NodeKey::Generate().public_key());
  const double cpu0 = CpuSeconds();
  sealed::PeerSecrets p;
  for (const sealed::Key32& peer : peers) (void)keys.ForPeer(peer, &p);
  const double per_peer_ms = (CpuSeconds() - cpu0) * 1e3 / n;
  std::printf("handshake_bench: %d connections each, one process (both ends)\n",
              n);
  std::printf("%-44s %10s %10s\n", "", "CPU ms/conn", "wall ms");
  std::printf("%-44s %10.3f %10.0f\n",
              "CURVE + ZAP (before; registrations now)",
              curve.cpu_ms_per_connection, curve.wall_ms);
  std::printf("%-44s %10.3f %10.0f\n",
              "PLAIN + ZAP, admitted per pair (sealed lane)",
              plain.cpu_ms_per_connection, plain.wall_ms);
  std::printf("%-44s %10.3f\n", "node keys: 2 x X25519 per peer (ForPeer)",
              per_peer_ms);
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) { return tessera::Main(argc, argv); }

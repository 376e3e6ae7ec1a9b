// TcpTap: a loopback TCP relay that keeps what its first client sent. A test
// points a node at the tap's port instead of a peer's (set the peer's port
// with SetTarget before the node connects); every connection is relayed both
// ways, and the first one's client-to-peer bytes are kept (up to a cap), to be
// written again later over a fresh connection: a replay of a whole ZeroMQ
// session (greeting, handshake, frames) as the client sent it, which PLAIN's
// handshake (no challenge) lets through to the peer's mechanism again: a
// replay of the records the session carried.
//
//   TcpTap tap;
//   tap.SetTarget(server_sealed_port);    // before the node connects to tap
//   ... the node talks to the peer through 127.0.0.1:tap.port() ...
//   TcpTap::Replay(server_sealed_port, tap.Captured(), [] { return seen; });
//
// Test-only (tests/support): nothing in the daemons can reach it.
#ifndef TESSERA_TESTS_SUPPORT_TCP_TAP_H_
#define TESSERA_TESTS_SUPPORT_TCP_TAP_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera {

class TcpTap {
 public:
  explicit TcpTap(size_t cap = 4 << 20) : cap_(cap) {
    listen_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = Loopback(0);
    socklen_t len = sizeof(addr);
    if (bind(listen_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
        listen(listen_, 8) == 0 &&
        getsockname(listen_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
    thread_ = std::thread([this] { Run(); });
  }
  ~TcpTap() {
    stop_.store(true);
    thread_.join();
    close(listen_);
  }
  TcpTap(const TcpTap&) = delete;
  TcpTap& operator=(const TcpTap&) = delete;

  int port() const { return port_; }  // 0: not listening
  void SetTarget(int port) { target_.store(port); }
  int target() const { return target_.load(); }
  // What the first connection's client sent so far (at most the cap).
  std::string Captured() const {
    absl::MutexLock lock(&mu_);
    return captured_;
  }

  // Connects to 127.0.0.1:port and writes `session`, a ZeroMQ client's
  // bytes (as Captured keeps them), as its client did: the greeting and the
  // PLAIN HELLO, then, once the peer's WELCOME came, the rest (a server
  // taking an INITIATE while it waits for its ZAP handler's answer drops the
  // connection as a protocol error). Keeps the connection open, reading what
  // the peer sends, until `done` says so or `bound` passed, then closes it
  // (closed with unread bytes, a socket resets the connection, and the peer
  // may drop what it had not read). False when a step failed.
  static bool Replay(int port, const std::string& session,
                     const std::function<bool()>& done,
                     absl::Duration bound = absl::Seconds(10)) {
    // The greeting (64 bytes), then HELLO: a short command (flags 4, a
    // one-byte size) or a long one (flags 6, eight bytes of size).
    constexpr size_t kGreeting = 64;
    if (session.size() < kGreeting + 2) return false;
    const auto* b = reinterpret_cast<const uint8_t*>(session.data());
    size_t hello_end = kGreeting + 2 + b[kGreeting + 1];
    if (b[kGreeting] == 6) {
      if (session.size() < kGreeting + 9) return false;
      uint64_t size = 0;
      for (int i = 1; i <= 8; ++i) size = (size << 8) | b[kGreeting + i];
      hello_end = kGreeting + 9 + size;
    }
    if (hello_end > session.size()) return false;
    const int fd = Connect(port);
    if (fd < 0) return false;
    const absl::Time deadline = absl::Now() + bound;
    bool ok = WriteAll(fd, session.data(), hello_end);
    std::string reply;
    char buf[4096];
    while (ok && reply.find("WELCOME") == std::string::npos &&
           absl::Now() < deadline) {
      pollfd p = {fd, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const ssize_t r = recv(fd, buf, sizeof(buf), 0);
      ok = r > 0;
      if (ok) reply.append(buf, static_cast<size_t>(r));
    }
    ok = ok &&
         WriteAll(fd, session.data() + hello_end, session.size() - hello_end);
    while (ok && !done() && absl::Now() < deadline) {
      pollfd p = {fd, POLLIN, 0};
      if (poll(&p, 1, 20) > 0 && recv(fd, buf, sizeof(buf), 0) <= 0) break;
    }
    shutdown(fd, SHUT_WR);
    while (recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
    }
    close(fd);
    return ok;
  }

 private:
  struct Pair {
    int client = -1, peer = -1;
    bool kept = false;  // the first connection: its client's bytes are kept
  };

  static sockaddr_in Loopback(int port) {
    sockaddr_in addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    return addr;
  }
  static int Connect(int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = Loopback(port);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }
  static bool WriteAll(int fd, const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }

  void Run() {
    std::vector<Pair> pairs;
    bool first = true;
    char buf[1 << 16];
    while (!stop_.load()) {
      std::vector<pollfd> fds = {{listen_, POLLIN, 0}};
      for (const Pair& p : pairs) {
        fds.push_back({p.client, POLLIN, 0});
        fds.push_back({p.peer, POLLIN, 0});
      }
      const size_t polled = pairs.size();
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if ((fds[0].revents & POLLIN) != 0) {
        Pair p;
        p.client = accept(listen_, nullptr, nullptr);
        p.peer = target_.load() > 0 ? Connect(target_.load()) : -1;
        if (p.client >= 0 && p.peer >= 0) {
          p.kept = std::exchange(first, false);
          pairs.push_back(p);
        } else {
          if (p.client >= 0) close(p.client);
          if (p.peer >= 0) close(p.peer);
        }
      }
      std::vector<Pair> open;
      for (size_t i = 0; i < polled; ++i) {
        Pair& p = pairs[i];
        bool alive = true;
        for (int side = 0; side < 2 && alive; ++side) {
          if ((fds[1 + 2 * i + side].revents & (POLLIN | POLLHUP | POLLERR)) ==
              0) {
            continue;
          }
          const int from = side == 0 ? p.client : p.peer;
          const int to = side == 0 ? p.peer : p.client;
          const ssize_t r = recv(from, buf, sizeof(buf), 0);
          alive = r > 0 && WriteAll(to, buf, static_cast<size_t>(r));
          if (alive && side == 0 && p.kept) Keep(buf, static_cast<size_t>(r));
        }
        if (alive) {
          open.push_back(p);
        } else {
          close(p.client);
          close(p.peer);
        }
      }
      // Pairs accepted in this pass were not polled yet: they stay.
      for (size_t i = polled; i < pairs.size(); ++i) open.push_back(pairs[i]);
      pairs.swap(open);
    }
    for (const Pair& p : pairs) {
      close(p.client);
      close(p.peer);
    }
  }
  void Keep(const char* p, size_t n) {
    absl::MutexLock lock(&mu_);
    captured_.append(p, std::min(n, cap_ - std::min(cap_, captured_.size())));
  }

  const size_t cap_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<int> target_{0};
  std::atomic<bool> stop_{false};
  mutable absl::Mutex mu_;
  std::string captured_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_TCP_TAP_H_

#include "common/net_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// A listening TCP socket on loopback (IPv4 or IPv6) and its port.
class Listener {
 public:
  explicit Listener(bool ipv6) {
    fd_ = socket(ipv6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (ipv6) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
      a6->sin6_family = AF_INET6;
      a6->sin6_addr = in6addr_loopback;
      len = sizeof(*a6);
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
      a4->sin_family = AF_INET;
      a4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      len = sizeof(*a4);
    }
    ok_ = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
          listen(fd_, 4) == 0 &&
          getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    port_ = ntohs(ipv6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }
  ~Listener() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  bool ok() const { return ok_; }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  bool ok_ = false;
  int port_ = 0;
};

// The scheduler's probe of a lost link (issue #46): a port nothing listens
// at is refused, a listening one answers, and what cannot be judged is
// unknown, never refused (a refusal is what makes a node dead).
TEST(ProbeTcpTest, RefusedOnlyWhereNothingListens) {
  for (const bool ipv6 : {false, true}) {
    SCOPED_TRACE(ipv6 ? "IPv6" : "IPv4");
    Listener listener(ipv6);
    if (ipv6 && !listener.ok()) GTEST_SKIP() << "no IPv6 loopback here";
    ASSERT_TRUE(listener.ok());
    const std::string endpoint =
        TcpEndpoint(ipv6 ? "::1" : "127.0.0.1", listener.port());
    EXPECT_EQ(ProbeTcp(endpoint, absl::Seconds(2)), TcpProbe::kAnswered)
        << endpoint;
    listener.Close();
    EXPECT_EQ(ProbeTcp(endpoint, absl::Seconds(2)), TcpProbe::kRefused)
        << endpoint;
  }
  for (const char* bad :
       {"", "127.0.0.1:80", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65536", "tcp://127.0.0.1:http", "tcp://localhost:80",
        "tcp://[::1:80", "ipc:///tmp/x:1"}) {
    EXPECT_EQ(ProbeTcp(bad, absl::Seconds(1)), TcpProbe::kUnknown) << bad;
  }
  EXPECT_STREQ(TcpProbeName(TcpProbe::kRefused), "refused");
  EXPECT_STREQ(TcpProbeName(TcpProbe::kAnswered), "answered");
  EXPECT_STREQ(TcpProbeName(TcpProbe::kUnknown), "unknown");
}

}  // namespace
}  // namespace tessera

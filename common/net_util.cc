#include "common/net_util.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {
namespace {

std::string AddressString(const sockaddr* addr) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr,
              buf, sizeof(buf));
  } else if (addr->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr,
              buf, sizeof(buf));
  }
  return buf;
}

bool IsLoopback(const std::string& ip) {
  return ip.rfind("127.", 0) == 0 || ip == "::1";
}

}  // namespace

bool IsIpv6(const std::string& ip) {
  in6_addr addr;
  return inet_pton(AF_INET6, ip.c_str(), &addr) == 1;
}

absl::StatusOr<std::string> ResolveHost(const std::string& host) {
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(bare.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host '", host, "': ", gai_strerror(rc)));
  }
  std::string v4, v6;
  for (addrinfo* it = result; it != nullptr; it = it->ai_next) {
    if (it->ai_family == AF_INET && v4.empty()) v4 = AddressString(it->ai_addr);
    if (it->ai_family == AF_INET6 && v6.empty())
      v6 = AddressString(it->ai_addr);
  }
  freeaddrinfo(result);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  return absl::InvalidArgumentError(
      absl::StrCat("host '", host, "' has no IP address"));
}

std::vector<std::string> InterfaceNames() {
  std::vector<std::string> names;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return names;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr) continue;
    if (it->ifa_addr->sa_family != AF_INET &&
        it->ifa_addr->sa_family != AF_INET6)
      continue;
    if (std::find(names.begin(), names.end(), it->ifa_name) == names.end()) {
      names.push_back(it->ifa_name);
    }
  }
  freeifaddrs(list);
  return names;
}

namespace {

// The address of interface `name`; with `prefer_ipv6` a global IPv6 address
// goes before the IPv4 one (a node must advertise an address of the scheduler's
// family: an IPv6 scheduler may have no IPv4 route to the node).
absl::StatusOr<std::string> InterfaceAddressPreferring(const std::string& name,
                                                       bool prefer_ipv6) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::InternalError(
        absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::string v4, v6_global, v6_link;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || name != it->ifa_name) continue;
    if (it->ifa_addr->sa_family == AF_INET && v4.empty()) {
      v4 = AddressString(it->ifa_addr);
    } else if (it->ifa_addr->sa_family == AF_INET6) {
      const auto* a6 = reinterpret_cast<const sockaddr_in6*>(it->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) {
        if (v6_link.empty()) {
          v6_link = AddressString(it->ifa_addr) + "%" + name;
        }
      } else if (v6_global.empty()) {
        v6_global = AddressString(it->ifa_addr);
      }
    }
  }
  freeifaddrs(list);
  if (prefer_ipv6 && !v6_global.empty()) return v6_global;
  if (!v4.empty()) return v4;
  if (!v6_global.empty()) return v6_global;
  if (!v6_link.empty()) return v6_link;
  return absl::InvalidArgumentError(absl::StrCat(
      "DMLC_INTERFACE='", name,
      "': no such network interface with an address (interfaces with one: ",
      absl::StrJoin(InterfaceNames(), ", "), ")"));
}

}  // namespace

absl::StatusOr<std::string> InterfaceAddress(const std::string& name) {
  return InterfaceAddressPreferring(name, /*prefer_ipv6=*/false);
}

absl::StatusOr<std::string> RouteSourceAddress(const std::string& remote_ip) {
  const bool v6 = IsIpv6(remote_ip);
  int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_DGRAM, 0);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_storage remote;
  std::memset(&remote, 0, sizeof(remote));
  socklen_t len = 0;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&remote);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(9);
    inet_pton(AF_INET6, remote_ip.c_str(), &a->sin6_addr);
    len = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&remote);
    a->sin_family = AF_INET;
    a->sin_port = htons(9);
    inet_pton(AF_INET, remote_ip.c_str(), &a->sin_addr);
    len = sizeof(sockaddr_in);
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&remote), len) != 0) {
    const std::string err = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("no route to ", remote_ip, ": ", err));
  }
  sockaddr_storage local;
  socklen_t local_len = sizeof(local);
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len);
  close(fd);
  return AddressString(reinterpret_cast<sockaddr*>(&local));
}

absl::StatusOr<std::string> AdvertisedAddress(const Options& options,
                                              const std::string& scheduler_ip) {
  if (!options.node_host.empty()) {
    absl::StatusOr<std::string> ip = ResolveHost(options.node_host);
    if (!ip.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DMLC_NODE_HOST='", options.node_host, "': ", ip.status().message()));
    }
    return ip;
  }
  if (!options.interface.empty()) {
    return InterfaceAddressPreferring(options.interface, IsIpv6(scheduler_ip));
  }
  if (IsLoopback(scheduler_ip))
    return scheduler_ip == "::1" ? "::1" : "127.0.0.1";
  return RouteSourceAddress(scheduler_ip);
}

std::string TcpEndpoint(const std::string& ip, int port) {
  const std::string port_str = port == 0 ? "*" : std::to_string(port);
  if (IsIpv6(ip) || ip.find(':') != std::string::npos) {
    return absl::StrCat("tcp://[", ip, "]:", port_str);
  }
  return absl::StrCat("tcp://", ip, ":", port_str);
}

TcpProbe ProbeTcp(const std::string& endpoint, absl::Duration timeout) {
  const std::string scheme = "tcp://";
  if (endpoint.rfind(scheme, 0) != 0) return TcpProbe::kUnknown;
  const std::string rest = endpoint.substr(scheme.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) return TcpProbe::kUnknown;
  std::string host = rest.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return TcpProbe::kUnknown;
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;  // no lookups
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) !=
      0) {
    return TcpProbe::kUnknown;
  }
  sockaddr_storage addr{};
  const socklen_t addr_len = found->ai_addrlen;
  std::memcpy(&addr, found->ai_addr, addr_len);
  freeaddrinfo(found);
  const int fd =
      socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return TcpProbe::kUnknown;
  TcpProbe result = TcpProbe::kUnknown;
  int err = 0;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), addr_len) == 0) {
    result = TcpProbe::kAnswered;
  } else if (errno == ECONNREFUSED) {
    result = TcpProbe::kRefused;
  } else if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    const int ms = static_cast<int>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(timeout)));
    socklen_t len = sizeof(err);
    if (poll(&p, 1, ms) == 1 &&
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0) {
      if (err == 0) result = TcpProbe::kAnswered;
      if (err == ECONNREFUSED) result = TcpProbe::kRefused;
    }
  }
  close(fd);
  return result;
}

const char* TcpProbeName(TcpProbe probe) {
  switch (probe) {
    case TcpProbe::kRefused:
      return "refused";
    case TcpProbe::kAnswered:
      return "answered";
    case TcpProbe::kUnknown:
      return "unknown";
  }
  return "unknown";
}

}  // namespace tessera

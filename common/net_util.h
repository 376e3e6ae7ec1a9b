// Addresses: which address a node binds and advertises, and how hosts are
// resolved.
//
//   absl::StatusOr<std::string> ip = ResolveHost("node-3");   // "10.0.0.3" or "fd00::3"
//   std::string endpoint = TcpEndpoint(*ip, 9000);            // "tcp://[fd00::3]:9000"
#ifndef TESSERA_COMMON_NET_UTIL_H_
#define TESSERA_COMMON_NET_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/options.h"

namespace tessera {

// True when `ip` is a numeric IPv6 address.
bool IsIpv6(const std::string& ip);

// Resolves a hostname or numeric address to a numeric address (IPv4 preferred).
// InvalidArgument naming the host when it does not resolve.
absl::StatusOr<std::string> ResolveHost(const std::string& host);

// The address of a network interface (IPv4 preferred, else a global IPv6, else
// a link-local one). InvalidArgument when it does not exist or has no address;
// the message lists the interfaces that do.
absl::StatusOr<std::string> InterfaceAddress(const std::string& name);

// Names of the interfaces that have an address.
std::vector<std::string> InterfaceNames();

// The local address the kernel would use to reach `remote_ip` (no packet is
// sent).
absl::StatusOr<std::string> RouteSourceAddress(const std::string& remote_ip);

// The address a node advertises (and binds): DMLC_NODE_HOST if set, else the
// address of DMLC_INTERFACE, else the loopback address when the scheduler is on
// loopback, else the address of the interface that routes to the scheduler.
// Errors name the variable.
absl::StatusOr<std::string> AdvertisedAddress(const Options& options,
                                              const std::string& scheduler_ip);

// "tcp://ip:port", with brackets around IPv6 addresses; port 0 gives
// "tcp://ip:*".
std::string TcpEndpoint(const std::string& ip, int port);

// What one TCP connection attempt to `endpoint` ("tcp://ip:port", as
// TcpEndpoint writes it) found within `timeout`. The scheduler asks before it
// takes a lost link for a dead node (Scheduler::CheckLostLinks): ZeroMQ's
// failed reconnects do not say why they failed.
enum class TcpProbe {
  kRefused,   // the host answered that nothing listens at the port
  kAnswered,  // something accepted the connection (closed at once, unused)
  kUnknown,   // no answer in time, no route, a malformed endpoint, or this
              // process could not try (out of descriptors, say)
};
TcpProbe ProbeTcp(const std::string& endpoint, absl::Duration timeout);
const char* TcpProbeName(TcpProbe probe);

}  // namespace tessera

#endif  // TESSERA_COMMON_NET_UTIL_H_

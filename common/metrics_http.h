// MetricsHttpServer: serves a MetricsRegistry's Prometheus text exposition at
// http://HOST:PORT/metrics, and what the process waits for as JSON at
// /debug/pending (common/debug_pending.h), with cpp-httplib (Debian's
// libcpp-httplib-dev), on a
// thread of its own (and one of httplib's for each connection being served,
// at most two at a time).
//
//   absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
//       StartMetricsServer(options, advertised_ip);   // nullptr when off
//   if (!http.ok()) { ... exit 2: the message names TESSERA_METRICS_PORT ... }
//
// The port is bound exclusively (SO_REUSEADDR, not httplib's SO_REUSEPORT,
// which would let two processes share a port and each get half the scrapes).
//
// Thread-safety: Start, port and the destructor from one thread; scrapes are
// served concurrently with everything else.
#ifndef TESSERA_COMMON_METRICS_HTTP_H_
#define TESSERA_COMMON_METRICS_HTTP_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/options.h"

namespace httplib {
class Server;
}

namespace tessera {

class MetricsHttpServer {
 public:
  // Listens on host:port (0: a free port) and serves `registry` (which must
  // outlive the server). Unavailable naming the address and the OS error when
  // the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, MetricsRegistry* registry);
  // Stops serving and joins the thread.
  ~MetricsHttpServer();

  int port() const { return port_; }
  // "http://127.0.0.1:9100/metrics" (IPv6 addresses in brackets).
  std::string url() const;

 private:
  MetricsHttpServer() = default;

  std::unique_ptr<httplib::Server> server_;
  std::string host_;
  int port_ = 0;
  std::thread thread_;
};

// Starts the process's metrics server when TESSERA_METRICS_PORT is set
// (options.metrics_port >= 0), on `host` (the node's advertised address), for
// MetricsRegistry::Global(), and logs its URL; nullptr when the variable is
// unset. InvalidArgument naming TESSERA_METRICS_PORT, the address and the
// reason when it cannot listen (a daemon exits 2).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsServer(
    const Options& options, const std::string& host);

}  // namespace tessera

#endif  // TESSERA_COMMON_METRICS_HTTP_H_

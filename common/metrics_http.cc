#include "common/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/debug_pending.h"
#include "common/logging.h"

namespace tessera {
namespace {

// Connections served at once: a scrape is a few kilobytes of text.
constexpr int kHttpThreads = 2;

std::string HostPort(const std::string& host, int port) {
  if (absl::StrContains(host, ':')) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, MetricsRegistry* registry) {
  std::unique_ptr<MetricsHttpServer> http(new MetricsHttpServer);
  http->host_ = host;
  http->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *http->server_;
  server.new_task_queue = [] { return new httplib::ThreadPool(kHttpThreads); };
  // Not SO_REUSEPORT (httplib's default): a port some other process listens
  // on must be an error, not a port shared with it.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_keep_alive_timeout(2);
  server.Get("/metrics",
             [registry](const httplib::Request&, httplib::Response& res) {
               res.set_content(registry->TextExposition(),
                               "text/plain; version=0.0.4; charset=utf-8");
             });
  // What the process waits for (common/debug_pending.h), as JSON.
  server.Get("/debug/pending",
             [](const httplib::Request&, httplib::Response& res) {
               res.set_content(DebugPendingRegistry::Global().Json() + "\n",
                               "application/json");
             });
  server.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("Tessera metrics: /metrics, /debug/pending\n",
                    "text/plain");
  });
  errno = 0;
  if (port == 0) {
    http->port_ = server.bind_to_any_port(host);
  } else {
    http->port_ = server.bind_to_port(host, port) ? port : -1;
  }
  if (http->port_ < 0) {
    const int err = errno;
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", HostPort(host, port), ": ",
                     err != 0 ? std::strerror(err) : "bind failed"));
  }
  http->thread_ = std::thread([&server] { server.listen_after_bind(); });
  // stop() before the thread has started listening would be lost (and the
  // destructor would wait for ever): return once it listens.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!server.is_running() && absl::Now() < deadline)
    absl::SleepFor(absl::Microseconds(200));
  return http;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string MetricsHttpServer::url() const {
  return absl::StrCat("http://", HostPort(host_, port_), "/metrics");
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsServer(
    const Options& options, const std::string& host) {
  if (options.metrics_port < 0) return nullptr;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      MetricsHttpServer::Start(host, options.metrics_port,
                               &MetricsRegistry::Global());
  if (!http.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TESSERA_METRICS_PORT=", options.metrics_port, ": ",
        http.status().message(),
        options.metrics_port != 0
            ? " (another process holds the port; pick a free one, or 0 for "
              "any)"
            : ""));
  }
  TESSERA_LOG(INFO) << "serving metrics at " << (*http)->url();
  return http;
}

}  // namespace tessera

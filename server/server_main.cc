// tessera-server: holds a shard of the weights of a Tessera job and updates
// them. Configured by the DMLC_* environment. Exit codes: 0 job done, 1 job
// failed (a peer died, the scheduler gave up or vanished), 2 bad configuration.
#include <iostream>
#include <memory>
#include <thread>

#include "common/logging.h"
#include "common/node.h"
#include "common/options.h"
#include "server/kv_server.h"

int main() {
  absl::StatusOr<tessera::Options> options =
      tessera::Options::FromEnvironment();
  if (!options.ok()) {
    std::cerr << "tessera-server: " << options.status().message() << "\n";
    return 2;
  }
  if (options->role != tessera::Role::kServer) {
    std::cerr << "tessera-server: DMLC_ROLE='"
              << tessera::RoleName(options->role) << "': expected server\n";
    return 2;
  }
  tessera::SetLogTag("server");
  tessera::SetLogVerbosity(options->verbose);
  int threads = options->server_threads;
  if (threads == 0) {
    threads = static_cast<int>(
        std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  }

  std::unique_ptr<tessera::Node> node;
  tessera::KVServer server(options->num_workers, threads,
                           [&node](int peer, tessera::Message msg) {
                             return node->Send(peer, std::move(msg));
                           });
  tessera::Node::Callbacks callbacks;
  callbacks.on_data = [&server](tessera::Message&& msg) {
    server.Handle(std::move(msg));
  };
  absl::StatusOr<std::unique_ptr<tessera::Node>> started =
      tessera::Node::Start(*options, std::move(callbacks));
  if (!started.ok()) {
    std::cerr << "tessera-server: " << started.status().message() << "\n";
    return absl::IsInvalidArgument(started.status()) ? 2 : 1;
  }
  node = *std::move(started);
  node->StartDelivery();
  TESSERA_VLOG(1) << "serving with " << threads << " update thread(s)";
  absl::Status result = node->WaitForTerminate();
  const tessera::wire::KVStats stats = server.stats();
  TESSERA_VLOG(1) << "pushes applied " << stats.pushes_applied() << ", rounds "
                  << stats.rounds_applied() << ", malformed "
                  << stats.malformed_messages() + node->malformed_count();
  node->Stop();
  server.Stop();
  if (!result.ok()) {
    std::cerr << "tessera-server: " << result.message() << "\n";
    return 1;
  }
  return 0;
}

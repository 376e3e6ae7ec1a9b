// Fuzzes everything that reads bytes from the network: the message codec
// (header and frame descriptors), then a live KVServer fed the decoded messages
// (key slices, float32 and 2-bit payloads, row-sparse ids and rows, compressed
// pulls, settings), and, since issue #46, the same messages to replicated
// servers: chain updates and their answers (KV_REPLICATE), state transfers
// (KV_TRANSFER: asks, slices, counts naming their slices; one without a view
// of the table gets the server's), inits at chain
// places, on a server that is a backup, a promoted primary, a replacement
// catching up, or one of a one-copy job. Probes (a push's header marked
// `probe`, no data: corpus push_probe, pushpull_probe_replicated) reach the
// same servers. Nothing may crash, hang or leak.
//
// Input layout: byte 0 = number of parts (1 + bits 0-1, 1..4), the server
// (bits 2-4: 0-3 the plain one, 4-7 the replicated ones below) and who sent
// it (bits 5-7: 0 the header's sender, else server rank bits - 1, so that the
// servers' own messages get past the sender checks); then per part but the
// last, a 2-byte little-endian length and that many bytes; the last part
// takes the rest.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "common/logging.h"
#include "common/message.h"
#include "common/replica_chain.h"
#include "server/kv_server.h"

namespace {

constexpr int kServers = 3;  // ranks of the replicated servers; this is 1

// The server states each replicated server was given (for the views of the
// table that transfer asks and counts carry).
std::vector<tessera::ServerState> states_of[8];

std::unique_ptr<tessera::KVServer> NewServer(int config) {
  auto server = std::make_unique<tessera::KVServer>(
      /*num_workers=*/2, /*num_threads=*/1,
      [](int, tessera::Message) { return absl::OkStatus(); });
  if (config < 4) return server;
  std::vector<tessera::ServerState> states(kServers);
  const bool single_copy = config == 7;
  // One copy: the chain is every server rank.
  server->set_replication(/*rank=*/1, kServers, single_copy ? kServers : 2,
                          absl::Seconds(1), single_copy);
  switch (config) {
    case 4:  // a backup and a primary, every server alive
      break;
    case 5:  // server 0 died: this one answers for its chains too
      states[0].dead = true;
      break;
    case 6:  // a replacement catching up: it takes transfers
    case 7:  // the same in a one-copy job
      states[1].catching_up = true;
      states[1].joined = 1;
      break;
  }
  states_of[config] = states;
  server->UpdateServers(states);
  if (config >= 6) {
    server->StartCatchUp([states] { return states; }, [] {});
  }
  return server;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    tessera::SetLogVerbosity(-1);
    return true;
  }();
  (void)quiet;
  static std::unique_ptr<tessera::KVServer> servers[8];
  static int inputs = 0;
  if (++inputs % 2000 == 0) {
    for (auto& server : servers) server.reset();  // bounds the keys made
  }

  if (size == 0) return 0;
  const size_t num_parts = 1 + data[0] % 4;
  const int config = (data[0] >> 2) % 8;
  const int sender = data[0] >> 5;
  std::unique_ptr<tessera::KVServer>& server = servers[config];
  if (server == nullptr) server = NewServer(config);
  size_t at = 1;
  std::vector<tessera::Buffer> parts;
  for (size_t i = 0; i < num_parts; ++i) {
    size_t len = size - at;
    if (i + 1 < num_parts) {
      if (at + 2 > size) break;
      len = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
      at += 2;
    }
    parts.push_back(tessera::Buffer::CopyOf(data + at, len));
    at += len;
  }
  tessera::CodecLimits limits;
  limits.max_message_bytes = 1 << 20;
  absl::StatusOr<tessera::Message> msg =
      tessera::DecodeMessage(std::move(parts), limits);
  if (!msg.ok()) return 0;
  (void)tessera::DebugString(*msg);
  // Keep arrays small so a run stays fast whatever the slice claims.
  if (msg->header.slice().total_length() > (1u << 16) ||
      msg->header.slice().row_length() > (1u << 8)) {
    return 0;
  }
  if (sender != 0) msg->header.set_sender(tessera::ServerId(sender - 1));
  // A transfer ask or count without a view is given the server's own (a
  // 64-bit digest is past guessing): it reaches the counting; one with a
  // view keeps it, and is refused unless it matches.
  if (config >= 4 && msg->header.command() == tessera::wire::KV_TRANSFER &&
      msg->header.transfer_view() == 0) {
    msg->header.set_transfer_view(tessera::StatesDigest(states_of[config]));
  }
  server->Handle(*std::move(msg));
  return 0;
}

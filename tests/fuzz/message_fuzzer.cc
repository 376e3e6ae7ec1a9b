// Fuzzes everything that reads bytes from the network: the message codec
// (header and frame descriptors), then a live KVServer fed the decoded messages
// (key slices, float32 and 2-bit payloads, row-sparse ids and rows, compressed
// pulls, settings). Nothing may crash, hang or leak.
//
// Input layout: byte 0 = number of parts (1..4); then per part but the last, a
// 2-byte little-endian length and that many bytes; the last part takes the
// rest.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/logging.h"
#include "common/message.h"
#include "server/kv_server.h"

namespace {

std::unique_ptr<tessera::KVServer> NewServer() {
  return std::make_unique<tessera::KVServer>(
      /*num_workers=*/2, /*num_threads=*/1,
      [](int, tessera::Message) { return absl::OkStatus(); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    tessera::SetLogVerbosity(-1);
    return true;
  }();
  (void)quiet;
  static std::unique_ptr<tessera::KVServer> server = NewServer();
  static int inputs = 0;
  if (++inputs % 2000 == 0)
    server = NewServer();  // bounds the keys a run creates

  if (size == 0) return 0;
  const size_t num_parts = 1 + data[0] % 4;
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
  server->Handle(*std::move(msg));
  return 0;
}

// Sealed sessions a test relayed (TcpTap): reading a ZeroMQ client's bytes
// (ZMTP 3 frames after the 64-byte greeting) for the last sealed record it
// carried, and framing records of the test's own to follow its handshake.
// Test-only (tests/support).
#ifndef TESSERA_TESTS_SUPPORT_SEALED_SESSION_H_
#define TESSERA_TESTS_SUPPORT_SEALED_SESSION_H_

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/sealed_link.h"

namespace tessera::testing {

// The handshake's end in a session TcpTap kept (after the greeting and the
// HELLO and INITIATE commands) and the prefix of its last whole sealed
// record (a ZeroMQ frame after the handshake); nullopt when there is none.
inline std::optional<sealed::Prefix> LastRecord(const std::string& session,
                                                size_t* handshake_end) {
  const auto* b = reinterpret_cast<const uint8_t*>(session.data());
  std::optional<sealed::Prefix> last;
  size_t pos = 64;  // the greeting
  while (pos + 2 <= session.size()) {
    const bool long_size = (b[pos] & 0x02) != 0;
    const size_t head = long_size ? 9 : 2;
    if (pos + head > session.size()) break;
    uint64_t size = b[pos + 1];
    for (size_t i = 2; long_size && i < head; ++i)
      size = (size << 8) | b[pos + i];
    if (pos + head + size > session.size()) break;
    const uint8_t* body = b + pos + head;
    if ((b[pos] & 0x04) != 0) {  // a command: HELLO, INITIATE, PING
      if (size > 9 && std::memcmp(body + 1, "INITIATE", 8) == 0)
        *handshake_end = pos + head + size;
    } else if (size >= sealed::kRecordOverhead) {
      sealed::Prefix p;
      if (sealed::DecodePrefix(body, &p).ok()) last = p;
    }
    pos += head + size;
  }
  return last;
}

// A ZeroMQ frame (the last of its message) holding `record`.
inline std::string ZmtpFrame(const std::vector<uint8_t>& record) {
  std::string out;
  if (record.size() < 256) {
    out = {'\0', static_cast<char>(record.size())};
  } else {
    out.push_back('\x02');
    for (int i = 7; i >= 0; --i)
      out.push_back(
          static_cast<char>((uint64_t{record.size()} >> (8 * i)) & 0xff));
  }
  out.append(reinterpret_cast<const char*>(record.data()), record.size());
  return out;
}

// Collects what a Sealer seals.
class Records : public sealed::RecordSink {
 public:
  uint8_t* Allocate(size_t size) override {
    records.emplace_back(size);
    return records.back().data();
  }
  absl::Status Emit() override { return absl::OkStatus(); }
  std::vector<std::vector<uint8_t>> records;
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_SUPPORT_SEALED_SESSION_H_

// Fuzzes what a worker does with a compressed pull's reply: the message codec,
// then PulledCopy::Apply on a copy that already holds version 1 of chain 7.
// Nothing may crash; a reply refused (any error) leaves the copy's values as
// they were; an accepted one leaves a copy of the right length.
//
// Input layout (as message_fuzzer's): byte 0 = number of parts (1..4); then
// per part but the last, a 2-byte little-endian length and that many bytes;
// the last part takes the rest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/logging.h"
#include "common/message.h"
#include "worker/client/pulled_copy.h"

namespace {

constexpr uint64_t kLength = 37;

tessera::Message WholeReply() {
  std::vector<float> v(kLength);
  for (size_t i = 0; i < kLength; ++i) v[i] = 0.25f * static_cast<float>(i);
  tessera::Message m;
  m.header.set_command(tessera::wire::KV_PULL);
  m.header.set_is_response(true);
  m.header.set_pull_chain(7);
  m.header.set_pull_version(1);
  m.header.set_pull_from_version(0);
  tessera::AddFloatFrame(&m,
                         tessera::Buffer::CopyOf(v.data(), kLength * sizeof(float)));
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    tessera::SetLogVerbosity(-1);
    return true;
  }();
  (void)quiet;
  if (size < 1) return 0;
  const size_t parts_wanted = 1 + data[0] % 4;
  std::vector<tessera::Buffer> parts;
  size_t at = 1;
  for (size_t p = 0; p + 1 < parts_wanted; ++p) {
    if (at + 2 > size) return 0;
    const size_t len = data[at] | (data[at + 1] << 8);
    at += 2;
    if (at + len > size) return 0;
    parts.push_back(tessera::Buffer::CopyOf(data + at, len));
    at += len;
  }
  parts.push_back(tessera::Buffer::CopyOf(data + at, size - at));
  absl::StatusOr<tessera::Message> msg = tessera::DecodeMessage(std::move(parts));
  if (!msg.ok()) return 0;
  tessera::PulledCopy copy(kLength);
  if (!copy.Apply(WholeReply()).ok()) std::abort();
  std::vector<float> before(kLength), after(kLength);
  copy.CopyTo(before.data());
  const absl::Status applied = copy.Apply(*msg);
  copy.CopyTo(after.data());
  if (!applied.ok() &&
      std::memcmp(before.data(), after.data(), kLength * sizeof(float)) != 0) {
    std::abort();  // a refused reply changed the copy
  }
  return 0;
}

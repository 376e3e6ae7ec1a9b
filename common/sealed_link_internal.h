// What the two halves of a sealed link (common/sealed_link.cc: keys, the
// cipher and the Sealer; common/sealed_receiver.cc: the SealedReceiver) share
// of the record format. Not part of sealed_link.h's interface.
#ifndef TESSERA_COMMON_SEALED_LINK_INTERNAL_H_
#define TESSERA_COMMON_SEALED_LINK_INTERNAL_H_

#include <zmq.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/sealed_link.h"

namespace tessera {
namespace sealed {
namespace internal {

// The first record's plaintext opens with the header's length and the pad
// that aligns the data frames after it.
inline constexpr size_t kLeadBytes = 8;

inline uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A node key's first characters, for logs.
inline std::string KeyText(const Key32& key) {
  char text[41];
  zmq_z85_encode(text, key.data(), key.size());
  return absl::StrCat(std::string(text, 8), "...");
}

}  // namespace internal
}  // namespace sealed
}  // namespace tessera

#endif  // TESSERA_COMMON_SEALED_LINK_INTERNAL_H_

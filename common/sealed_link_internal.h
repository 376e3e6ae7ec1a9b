// What the two halves of a sealed link (common/sealed_link.cc: keys, the
// cipher and the Sealer; common/sealed_receiver.cc: the SealedReceiver) share
// of the record format. Not part of sealed_link.h's interface.
#ifndef TESSERA_COMMON_SEALED_LINK_INTERNAL_H_
#define TESSERA_COMMON_SEALED_LINK_INTERNAL_H_

#include <zmq.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
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

// BLAKE2b-256 of a pair's transcript, which the link secret
// (DeriveLinkSecret) and the admission password (DeriveAdmission) share:
// `label`, the X25519 values `secrets` in order, the sending end's role (one
// byte) and node key, the receiving end's, `extra` (a link's number), and
// the job id with its length (u32, little-endian) before it, so that no
// other id and transcript hash the same bytes. The hash state is wiped.
Key32 HashTranscript(absl::string_view label,
                     std::initializer_list<const Key32*> secrets,
                     Role from_role, const Key32& from_key, Role to_role,
                     const Key32& to_key, absl::Span<const uint8_t> extra,
                     absl::string_view job_id);

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

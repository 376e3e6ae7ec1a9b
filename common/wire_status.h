// absl::Status on the wire: a reply carries its status as a wire::WireStatus
// (the absl::StatusCode and the message), and the receiver turns it back.
//
//   ToWire(status, reply.header.mutable_status());
//   absl::Status back = FromWire(reply.header.status());
#ifndef TESSERA_COMMON_WIRE_STATUS_H_
#define TESSERA_COMMON_WIRE_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "proto/tessera.pb.h"

namespace tessera {

inline void ToWire(const absl::Status& status, wire::WireStatus* out) {
  out->set_code(static_cast<int>(status.code()));
  out->set_message(std::string(status.message()));
}

// A code outside absl's range (a peer's bug or a malformed message) comes back
// as Unknown, with the message.
inline absl::Status FromWire(const wire::WireStatus& status) {
  if (status.code() == 0) return absl::OkStatus();
  const int code = status.code();
  const bool known = code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated);
  return absl::Status(known ? static_cast<absl::StatusCode>(code)
                            : absl::StatusCode::kUnknown,
                      status.message());
}

}  // namespace tessera

#endif  // TESSERA_COMMON_WIRE_STATUS_H_

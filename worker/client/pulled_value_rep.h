// PulledValue's representation (include/tessera/kv_worker.h): what a
// PullViewAsync's replies fill in, one frame per part of the key.
//
// Thread-safety: each part's reply writes only its own frame, before the
// tracker counts the reply; Wait returning OK orders those writes before the
// caller's reads.
#ifndef TESSERA_WORKER_CLIENT_PULLED_VALUE_REP_H_
#define TESSERA_WORKER_CLIENT_PULLED_VALUE_REP_H_

#include <cstdint>
#include <vector>

#include "common/buffer.h"
#include "tessera/kv_worker.h"

namespace tessera {

struct PulledValue::Rep {
  uint64_t length = 0;             // the key's values
  std::vector<uint64_t> offsets;   // per part, in values
  std::vector<uint64_t> lengths;   // per part, in values
  std::vector<Buffer> frames;      // per part: lengths[i] floats once replied
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_PULLED_VALUE_REP_H_

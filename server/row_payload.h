// What the row engines (RowEngine, HashedEngine) share about a row push's
// payload: a RAW frame of ids, then the rows' values as one float32 or 2-bit
// frame, or as several float32 frames of whole rows one after another.
//
//   TESSERA_RETURN_IF_ERROR(                 // CheckPush: before Take
//       CheckRowPush(msg, ids.size(), l, settings, names));
//   TESSERA_ASSIGN_OR_RETURN(bool two_bit,
//       CheckRowPayload(msg, ids.size(), l, settings, names));
//   Buffer decoded;
//   TESSERA_ASSIGN_OR_RETURN(std::vector<const float*> rows,
//       RowValues(msg, two_bit, ids.size(), l, settings.threshold, &decoded));
//   RowSums sums = SumRepeatedRows(ids, rows, l);   // a push's repeats added
//
// Not part of the public API.
#ifndef TESSERA_SERVER_ROW_PAYLOAD_H_
#define TESSERA_SERVER_ROW_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/buffer.h"
#include "common/message.h"
#include "server/slice_engine.h"

namespace tessera {

// How a refusal names the push: "<push>: N <ids> need ..." and "<payload>
// payload must be ...".
struct RowPayloadNames {
  std::string push;     // e.g. "row push of key 7"
  std::string ids;      // e.g. "row ids"
  std::string payload;  // e.g. "row push"
};

// Whether the payload of `num_ids` rows of `row_length` values is 2-bit (one
// TWO_BIT frame, with gradient compression set) rather than float32;
// InvalidArgument naming the push when the frames do not hold exactly those
// rows, or hold another encoding.
absl::StatusOr<bool> CheckRowPayload(const Message& msg, size_t num_ids,
                                     uint64_t row_length,
                                     const ServerSettings& settings,
                                     const RowPayloadNames& names);

// CheckRowPayload's checks, and that a 2-bit frame decodes (DataLoss naming
// the push): all of the payload an engine's Push could refuse, checked
// before the server takes the push's number (SliceEngine::CheckPush).
absl::Status CheckRowPush(const Message& msg, size_t num_ids,
                          uint64_t row_length, const ServerSettings& settings,
                          const RowPayloadNames& names);

// Row i's values, wherever its frame put them: pointers into the float32
// frames, or into `*decoded` (the 2-bit frame decoded; DataLoss when it does
// not decode). REQUIRES: CheckRowPayload passed, two_bit its answer.
absl::StatusOr<std::vector<const float*>> RowValues(
    const Message& msg, bool two_bit, size_t num_ids, uint64_t row_length,
    float threshold, Buffer* decoded);

// A push's rows with its repeated ids added first, in push order: each id
// once (in order of first appearance) and its row_length values.
struct RowSums {
  std::vector<uint64_t> ids;
  std::vector<float> values;  // ids.size() x row_length
};
RowSums SumRepeatedRows(const std::vector<uint64_t>& ids,
                        const std::vector<const float*>& rows,
                        uint64_t row_length);

}  // namespace tessera

#endif  // TESSERA_SERVER_ROW_PAYLOAD_H_

#include "server/row_payload.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"

namespace tessera {

absl::StatusOr<bool> CheckRowPayload(const Message& msg, size_t num_ids,
                                     uint64_t row_length,
                                     const ServerSettings& settings,
                                     const RowPayloadNames& names) {
  const uint64_t l = row_length;
  const uint64_t values = num_ids * l;
  const int frames = msg.header.frames_size();
  uint64_t given = 0;
  bool whole_rows = frames >= 2;
  for (int f = 1; f < frames; ++f) {
    given += msg.header.frames(f).num_values();
    whole_rows &= frames == 2 || msg.header.frames(f).num_values() % l == 0;
  }
  if (frames < 2 || given != values || !whole_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(names.push, ": ", num_ids, " ", names.ids, " need ",
                     values, " values of ", l, " per row",
                     frames > 2 ? " in frames of whole rows" : ""));
  }
  const bool two_bit =
      frames == 2 &&
      msg.header.frames(1).encoding() == wire::DataFrame::TWO_BIT &&
      settings.compression == "2bit";
  for (int f = 1; f < frames && !two_bit; ++f) {
    if (msg.header.frames(f).encoding() != wire::DataFrame::FLOAT32) {
      return absl::InvalidArgumentError(
          absl::StrCat(names.payload,
                       " payload must be float32, or 2-bit with gradient "
                       "compression set"));
    }
  }
  return two_bit;
}

absl::Status CheckRowPush(const Message& msg, size_t num_ids,
                          uint64_t row_length, const ServerSettings& settings,
                          const RowPayloadNames& names) {
  absl::StatusOr<bool> two_bit =
      CheckRowPayload(msg, num_ids, row_length, settings, names);
  if (!two_bit.ok() || !*two_bit) return two_bit.status();
  absl::Status codes =
      compression::TwoBitValidate(msg.data[1].data(), msg.data[1].size(),
                                  num_ids * row_length, settings.threshold);
  if (codes.ok()) return codes;
  return absl::Status(codes.code(),
                      absl::StrCat(names.push, ": ", codes.message()));
}

absl::StatusOr<std::vector<const float*>> RowValues(
    const Message& msg, bool two_bit, size_t num_ids, uint64_t row_length,
    float threshold, Buffer* decoded) {
  const uint64_t l = row_length;
  std::vector<const float*> rows;
  rows.reserve(num_ids);
  if (two_bit) {
    *decoded = Buffer::Allocate(num_ids * l * sizeof(float));
    absl::Status ok = compression::TwoBitDequantize(
        msg.data[1].data(), msg.data[1].size(), num_ids * l, threshold,
        decoded->mutable_floats());
    if (!ok.ok()) return ok;
    for (size_t i = 0; i < num_ids; ++i)
      rows.push_back(decoded->floats() + i * l);
    return rows;
  }
  for (int f = 1; f < msg.header.frames_size(); ++f) {
    const Buffer& part = msg.data[f];
    for (size_t at = 0; at < part.num_floats(); at += l)
      rows.push_back(part.floats() + at);
  }
  return rows;
}

RowSums SumRepeatedRows(const std::vector<uint64_t>& ids,
                        const std::vector<const float*>& rows,
                        uint64_t row_length) {
  const uint64_t l = row_length;
  RowSums out;
  absl::flat_hash_map<uint64_t, size_t> slot;
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* grad = rows[i];
    auto [it, added] = slot.try_emplace(ids[i], out.ids.size());
    if (added) {
      out.ids.push_back(ids[i]);
      out.values.insert(out.values.end(), grad, grad + l);
    } else {
      float* at = out.values.data() + it->second * l;
      for (uint64_t j = 0; j < l; ++j) at[j] += grad[j];
    }
  }
  return out;
}

}  // namespace tessera

#include "server/replication.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tessera {

void AddRowUpdate(Message* out, const std::vector<uint64_t>& ids,
                  const std::vector<uint32_t>* sightings,
                  const std::function<const float*(size_t)>& row,
                  uint64_t row_length) {
  Buffer id_bytes = Buffer::CopyOf(ids.data(), ids.size() * sizeof(uint64_t));
  AddRawFrame(out, std::move(id_bytes));
  if (sightings != nullptr) {
    AddRawFrame(out, Buffer::CopyOf(sightings->data(),
                                    sightings->size() * sizeof(uint32_t)));
  }
  Buffer values = Buffer::Allocate(ids.size() * row_length * sizeof(float));
  for (size_t i = 0; i < ids.size(); ++i) {
    std::memcpy(values.mutable_floats() + i * row_length, row(i),
                row_length * sizeof(float));
  }
  AddFloatFrame(out, std::move(values));
}

void MoveFrames(Message&& from, Message* to) {
  for (int i = 0; i < from.header.frames_size(); ++i) {
    *to->header.add_frames() = from.header.frames(i);
    to->data.push_back(std::move(from.data[i]));
  }
}

absl::StatusOr<RowUpdate> ParseRowUpdate(const Message& msg,
                                         uint64_t row_length,
                                         bool with_sightings) {
  const size_t frames = with_sightings ? 3 : 2;
  if (msg.data.size() != frames ||
      msg.header.frames_size() != static_cast<int>(frames) ||
      msg.data[0].size() % sizeof(uint64_t) != 0) {
    return absl::DataLossError("malformed row update");
  }
  RowUpdate u;
  const size_t n = msg.data[0].size() / sizeof(uint64_t);
  u.ids.resize(n);
  std::memcpy(u.ids.data(), msg.data[0].data(), n * sizeof(uint64_t));
  {
    // Each row once: a hashed table would admit a repeated id twice.
    std::vector<uint64_t> sorted = u.ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      return absl::DataLossError("malformed row update: a row id repeats");
  }
  if (with_sightings) {
    if (msg.data[1].size() != n * sizeof(uint32_t))
      return absl::DataLossError("malformed row update: sightings");
    u.sightings.resize(n);
    std::memcpy(u.sightings.data(), msg.data[1].data(), n * sizeof(uint32_t));
  }
  const Buffer& values = msg.data[frames - 1];
  if (msg.header.frames(static_cast<int>(frames) - 1).encoding() !=
          wire::DataFrame::FLOAT32 ||
      values.size() != n * row_length * sizeof(float)) {
    return absl::DataLossError(
        absl::StrCat("malformed row update: ", values.size(), " bytes for ", n,
                     " rows of ", row_length));
  }
  u.values = values.floats();
  return u;
}

}  // namespace tessera

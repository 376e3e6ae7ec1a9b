#include "worker/client/key_partitioner.h"

#include <algorithm>

#include "common/key_layout.h"

namespace tessera {

int KeyPartitioner::ServerOf(uint64_t key) const {
  return KeyHome(key, num_servers_);
}

std::vector<KeyPart> KeyPartitioner::Partition(uint64_t key,
                                               uint64_t length) const {
  std::vector<KeyPart> parts;
  if (length == 0) return parts;
  if (length < bound_ || num_servers_ == 1) {
    parts.push_back({ServerOf(key), 0, length});
    return parts;
  }
  for (int s = 0; s < num_servers_; ++s) {
    const uint64_t begin = SplitPartBegin(length, s, num_servers_);
    const uint64_t end = SplitPartBegin(length, s + 1, num_servers_);
    if (end > begin) parts.push_back({s, begin, end - begin});
  }
  return parts;
}

std::vector<KeyPart> KeyPartitioner::PartitionRows(uint64_t key,
                                                   uint64_t num_rows,
                                                   uint64_t row_length) const {
  std::vector<KeyPart> parts;
  if (num_rows == 0) return parts;
  if (num_rows * row_length < bound_ || num_servers_ == 1) {
    parts.push_back({ServerOf(key), 0, num_rows});
    return parts;
  }
  for (int s = 0; s < num_servers_; ++s) {
    const uint64_t begin = SplitPartBegin(num_rows, s, num_servers_);
    const uint64_t end = SplitPartBegin(num_rows, s + 1, num_servers_);
    if (end > begin) parts.push_back({s, begin, end - begin});
  }
  return parts;
}

std::vector<KeyPart> KeyPartitioner::Chunk(const std::vector<KeyPart>& parts,
                                           uint64_t max_elements) {
  std::vector<KeyPart> chunks;
  for (const KeyPart& part : parts) {
    for (uint64_t at = 0; at < part.length; at += max_elements) {
      chunks.push_back({part.server_rank, part.offset + at,
                        std::min(max_elements, part.length - at)});
    }
  }
  return chunks;
}

}  // namespace tessera

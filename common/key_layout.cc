#include "common/key_layout.h"

#include "common/split_mix.h"

namespace tessera {

int KeyHome(uint64_t key, int num_servers) {
  return static_cast<int>(SplitMix64(key) % static_cast<uint64_t>(num_servers));
}

uint64_t SplitPartBegin(uint64_t total, int part, int num_servers) {
  const uint64_t n = static_cast<uint64_t>(num_servers);
  const uint64_t p = static_cast<uint64_t>(part);
  // floor(total * p / n) as (total / n) * p + floor((total % n) * p / n):
  // equal, and neither product can overflow (p <= n, and n is an int).
  return total / n * p + total % n * p / n;
}

bool MayBeFirstMember(int first, const wire::KeySlice& slice, int num_servers) {
  if (num_servers < 1 || first < 0 || first >= num_servers) return false;
  if (slice.row_length() != 0 && slice.length() == 0 &&
      slice.total_length() == 0) {
    return slice.offset() == static_cast<uint64_t>(first);  // hashed
  }
  if (first == KeyHome(slice.key(), num_servers)) return true;
  if (num_servers == 1 || slice.length() == 0) return false;
  const uint64_t begin =
      SplitPartBegin(slice.total_length(), first, num_servers);
  const uint64_t end =
      SplitPartBegin(slice.total_length(), first + 1, num_servers);
  return slice.offset() >= begin && slice.offset() < end &&
         slice.length() <= end - slice.offset();
}

}  // namespace tessera

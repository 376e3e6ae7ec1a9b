// Counts of 2-bit codes on the wire (a local group's 2-bit push,
// docs/local_groups.md): per value the sum of the group's codes, an integer
// from -size to +size. Groups of at most 7 send them as signed 4-bit counts,
// two a byte (DataFrame::COUNTS4): value 2k in byte k's low half, value
// 2k + 1 in its high half (a last odd value's high half is 0).
//
//   std::vector<uint8_t> wire((n + 1) / 2);
//   PackCounts4(counts.data(), n, wire.data());     // counts in -8..7
//   UnpackCounts4(wire.data(), n, back.data());     // int8, the same counts
#ifndef TESSERA_COMMON_COMPRESSION_COUNTS_H_
#define TESSERA_COMMON_COMPRESSION_COUNTS_H_

#include <cstddef>
#include <cstdint>

namespace tessera::compression {

// The largest group whose counts fit 4 bits each way (-7..7).
inline constexpr int kMaxCounts4Group = 7;

// REQUIRES: every count in -8..7.
inline void PackCounts4(const int32_t* counts, size_t n, uint8_t* out) {
  for (size_t k = 0; 2 * k < n; ++k) {
    const uint32_t lo = static_cast<uint32_t>(counts[2 * k]) & 0xfu;
    const uint32_t hi =
        2 * k + 1 < n ? static_cast<uint32_t>(counts[2 * k + 1]) & 0xfu : 0u;
    out[k] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

inline void UnpackCounts4(const uint8_t* in, size_t n, int8_t* out) {
  // A half of 8..15 is -8..-1: shifted to the top of an int8 and back.
  for (size_t i = 0; i < n; ++i) {
    const uint8_t half = i % 2 == 0 ? (in[i / 2] & 0x0f) : (in[i / 2] >> 4);
    out[i] = static_cast<int8_t>(static_cast<int8_t>(half << 4) >> 4);
  }
}

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_COUNTS_H_

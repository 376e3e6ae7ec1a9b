// One whole SplitMix64 step, not its finaliser alone: 0x9e3779b97f4a7c15 is
// added to x first, then the finaliser mixes it (two xor-shift-multiply rounds
// and a last xor-shift), all in unsigned 64-bit arithmetic. A fixed, well-mixed
// 64-bit hash, the same in every process and on every machine. Which server
// holds a key or a hashed id, hashed rows' initial values and the admission
// sketch use it, so every process agrees on them.
//
//   const int server = static_cast<int>(SplitMix64(key) % num_servers);
#ifndef TESSERA_COMMON_SPLIT_MIX_H_
#define TESSERA_COMMON_SPLIT_MIX_H_

#include <cstdint>

namespace tessera {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace tessera

#endif  // TESSERA_COMMON_SPLIT_MIX_H_

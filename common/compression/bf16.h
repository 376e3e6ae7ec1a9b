// bfloat16 on the wire: the top 16 bits of a float32 (sign, 8 exponent bits,
// 7 fraction bits), so the range is float32's and only precision is lost.
// Row-sparse pulls travel this way under pull compression (docs/compression.md):
// half the bytes, no state on either side.
//
//   uint16_t h = FloatToBf16(x);        // rounded to nearest, ties to even
//   float y = Bf16ToFloat(h);           // exact
//   FloatsToBf16(in, n, out); Bf16ToFloats(in, n, out);
//
// Rounding: to the nearest bfloat16, ties to the even one (the rule of
// float32 arithmetic, and of PyTorch's and TensorFlow's conversions): values
// past the largest finite bfloat16 by half an ulp or more become infinities;
// subnormal float32 values round like any other (no flush to zero); a NaN
// stays a NaN (quiet, sign kept).
#ifndef TESSERA_COMMON_COMPRESSION_BF16_H_
#define TESSERA_COMMON_COMPRESSION_BF16_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/gpu/host_device.h"

namespace tessera::compression {

TESSERA_HOST_DEVICE inline uint16_t FloatBitsToBf16(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep it one, quiet
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Adding 0x7fff plus the kept part's lowest bit rounds to nearest, ties to
  // even; a carry out of the fraction moves the exponent (up to infinity).
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline uint16_t FloatToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return FloatBitsToBf16(bits);
}

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// n values each way: FloatToBf16 and Bf16ToFloat of each. Branch-free
// loops, compiled with -O3 in bf16.cc so that the compiler vectorises them
// (at -O2, GCC 12 leaves them scalar).
void FloatsToBf16(const float* in, size_t n, uint16_t* out);
void Bf16ToFloats(const uint16_t* in, size_t n, float* out);

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_BF16_H_

#include "common/compression/bf16.h"

namespace tessera::compression {

void FloatsToBf16(const float* in, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x0040u;
    out[i] = static_cast<uint16_t>(
        (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

void Bf16ToFloats(const uint16_t* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}

}  // namespace tessera::compression

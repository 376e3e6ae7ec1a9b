// The arithmetic of the 2-bit codec (format in two_bit.h), one element or one
// payload byte at a time, as TESSERA_HOST_DEVICE functions. The CUDA kernels
// (cuda/two_bit.cu) run them on the GPU, one thread per payload byte; the CPU
// codec's scalar loops (two_bit.cc) run them on the host; host tests run the
// kernels' per-byte bodies against the CPU codec on machines without a GPU.
// Names no CUDA type.
//
//   // Thread b of the quantize kernel, and the same work on the host:
//   out[b] = QuantizePayloadByte(grad, residual, len, b, t, -t);
//   // Thread b of the dequantize kernel; a non-zero result is malformed input:
//   const uint32_t flags = DequantizePayloadByte(in, len, b, t, -t, out);
//
// Bit-identity: an element sees exactly one rounded add (r + g) and one rounded
// subtract (r - taken, taken in {t, -t, 0}), written so that nvcc can neither
// contract nor reassociate them. Denormals are kept on both sides (the CUDA
// targets are built without -ftz), so host and device produce the same bits,
// infinities included. A NaN residual codes 0b00 from then on and stays NaN,
// but not bit for bit: the CPU passes the operand's payload on, a GPU need not
// (NVIDIA's return a canonical NaN).
#ifndef TESSERA_COMMON_COMPRESSION_TWO_BIT_KERNELS_H_
#define TESSERA_COMMON_COMPRESSION_TWO_BIT_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "common/gpu/host_device.h"

namespace tessera::compression::kernels {

inline constexpr uint32_t kCodeZero = 0b00;
inline constexpr uint32_t kCodeMinus = 0b10;  // Decodes to -t.
inline constexpr uint32_t kCodePlus = 0b11;   // Decodes to +t.

// What DequantizePayloadByte / CheckPayloadByte report, OR-ed together.
inline constexpr uint32_t kBadCodeFlag = 1;     // A code 0b01.
inline constexpr uint32_t kBadPaddingFlag = 2;  // A set bit past `len`.

// Lowest bit of the code of element k (0..3) of a byte: the first element sits
// in the two highest bits.
TESSERA_HOST_DEVICE constexpr uint32_t ByteShift(size_t k) {
  return static_cast<uint32_t>(6 - 2 * k);
}

// Lowest bit of the code of element j (0..15) of a 32-bit word read as
// little-endian: byte j / 4, slot j % 4.
TESSERA_HOST_DEVICE constexpr uint32_t WordShift(size_t j) {
  return static_cast<uint32_t>(8 * (j / 4) + 6 - 2 * (j % 4));
}

// How many of payload byte b's four elements lie below `len` (0 for padding).
TESSERA_HOST_DEVICE inline size_t ElementsInByte(size_t b, size_t len) {
  const size_t first = 4 * b;
  if (first >= len) return 0;
  return len - first < 4 ? len - first : 4;
}

// The bits of a byte that belong to its first `valid` (0..4) elements.
TESSERA_HOST_DEVICE inline uint32_t UsedBitsOfByte(size_t valid) {
  return valid == 0 ? 0u : (0xffu << (8 - 2 * valid)) & 0xffu;
}

// residual += grad, then codes the residual and takes away what the code
// stands for. Branch-free, so that the CPU's loops over it vectorise.
TESSERA_HOST_DEVICE inline uint32_t QuantizeElement(float grad, float* residual,
                                                    float t, float neg_t) {
  const float r = gpu::AddRoundedToNearest(*residual, grad);
  const bool pos = r >= t;  // False for NaN, as is neg: NaN codes 0b00.
  const bool neg = r <= neg_t;
  // r - (-t) == r + t exactly, and r - 0 == r for every r (-0 and NaN too).
  const float taken = pos ? t : (neg ? neg_t : 0.0f);
  *residual = gpu::SubRoundedToNearest(r, taken);
  return (pos ? kCodePlus : 0u) | (neg ? kCodeMinus : 0u);
}

// What a code decodes to: +t, -t, or 0 (0b00; 0b01 never reaches here, the
// payload is checked first).
TESSERA_HOST_DEVICE inline float DecodeElement(uint32_t code, float t,
                                               float neg_t) {
  return code == kCodePlus ? t : (code == kCodeMinus ? neg_t : 0.0f);
}

// Codes `valid` (1..4) consecutive elements into one byte, unused slots 0.
TESSERA_HOST_DEVICE inline uint32_t QuantizeByte(const float* grad,
                                                 float* residual, size_t valid,
                                                 float t, float neg_t) {
  uint32_t byte = 0;
  for (size_t k = 0; k < valid; ++k) {
    byte |= QuantizeElement(grad[k], &residual[k], t, neg_t) << ByteShift(k);
  }
  return byte;
}

// Payload byte b for `len` elements: codes elements 4b..4b+3 (those below
// `len`) of grad and residual; 0 for a padding byte.
TESSERA_HOST_DEVICE inline uint8_t QuantizePayloadByte(const float* grad,
                                                       float* residual,
                                                       size_t len, size_t b,
                                                       float t, float neg_t) {
  const size_t valid = ElementsInByte(b, len);
  if (valid == 0) return 0;
  return static_cast<uint8_t>(
      QuantizeByte(grad + 4 * b, residual + 4 * b, valid, t, neg_t));
}

// kBadPaddingFlag if a bit past the first `valid` elements is set,
// kBadCodeFlag if one of those elements holds the code 0b01.
TESSERA_HOST_DEVICE inline uint32_t CheckByte(uint32_t byte, size_t valid) {
  const uint32_t used = UsedBitsOfByte(valid);
  uint32_t bad = 0;
  if ((byte & ~used) != 0) bad |= kBadPaddingFlag;
  // 0b01: low bit set, high bit clear.
  if ((byte & used & 0x55u & ~(byte >> 1)) != 0) bad |= kBadCodeFlag;
  return bad;
}

// Decodes the first `valid` (0..4) elements of a byte into out[0..valid).
TESSERA_HOST_DEVICE inline void DequantizeByte(uint32_t byte, size_t valid,
                                               float t, float neg_t,
                                               float* out) {
  for (size_t k = 0; k < valid; ++k) {
    out[k] = DecodeElement((byte >> ByteShift(k)) & 0b11u, t, neg_t);
  }
}

// Payload byte b of `in` for `len` elements: writes the elements it holds to
// out[4b..), and returns CheckByte's flags (0 when the byte is well formed;
// otherwise what it wrote is unspecified).
TESSERA_HOST_DEVICE inline uint32_t DequantizePayloadByte(const uint8_t* in,
                                                          size_t len, size_t b,
                                                          float t, float neg_t,
                                                          float* out) {
  const uint32_t byte = in[b];
  const size_t valid = ElementsInByte(b, len);
  if (valid != 0) DequantizeByte(byte, valid, t, neg_t, out + 4 * b);
  return CheckByte(byte, valid);
}

}  // namespace tessera::compression::kernels

#endif  // TESSERA_COMMON_COMPRESSION_TWO_BIT_KERNELS_H_

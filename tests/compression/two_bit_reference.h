// Test-only: a plain, obviously correct scalar 2-bit codec, written from the
// format description element by element (no words, no masks), to check the real
// codecs against.
#ifndef TESSERA_TESTS_COMPRESSION_TWO_BIT_REFERENCE_H_
#define TESSERA_TESTS_COMPRESSION_TWO_BIT_REFERENCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::compression::testing_reference {

// residual += grad element-wise, codes each element, returns the packed bytes.
inline std::vector<uint8_t> Quantize(const std::vector<float>& grad,
                                     std::vector<float>& residual,
                                     float threshold) {
  const size_t len = grad.size();
  const size_t words = (len + 15) / 16;
  std::vector<uint8_t> out(4 * words, 0);
  for (size_t i = 0; i < len; ++i) {
    residual[i] += grad[i];
    unsigned code = 0b00;
    if (residual[i] >= threshold) {
      code = 0b11;
      residual[i] -= threshold;
    } else if (residual[i] <= -threshold) {
      code = 0b10;
      residual[i] += threshold;
    }
    // Byte i / 4; the first element of a byte sits in its two highest bits.
    const unsigned shift = 6 - 2 * static_cast<unsigned>(i % 4);
    out[i / 4] = static_cast<uint8_t>(out[i / 4] | (code << shift));
  }
  return out;
}

// Decodes a well-formed payload: 0b11 -> +t, 0b10 -> -t, otherwise 0.
inline std::vector<float> Dequantize(const std::vector<uint8_t>& in, size_t len,
                                     float threshold) {
  std::vector<float> out(len, 0.0f);
  for (size_t i = 0; i < len; ++i) {
    const unsigned code = (in[i / 4] >> (6 - 2 * (i % 4))) & 0b11u;
    if (code == 0b11) out[i] = threshold;
    if (code == 0b10) out[i] = -threshold;
  }
  return out;
}

}  // namespace tessera::compression::testing_reference

#endif  // TESSERA_TESTS_COMPRESSION_TWO_BIT_REFERENCE_H_

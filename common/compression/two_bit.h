// 2-bit gradient compression with error feedback, in MXNet's exact wire format.
//
// A worker keeps, per key, a residual array r (zeros at first) and a threshold
// t > 0. For every element, in float32 and in this order:
//
//   r += g
//   if r >= t:       code 0b11, r -= t     (decodes to +t)
//   elif r <= -t:    code 0b10, r += t     (decodes to -t)
//   else:            code 0b00             (decodes to 0)
//
// Only one t leaves the residual per push, so r may stay at or beyond t:
// nothing is lost, only delayed. Packing: 16 elements per 32-bit word,
// ceil(n/16) words; byte k holds elements 4k..4k+3 with the first element in
// the two highest bits; unused slots are 0. The byte order is fixed by that
// rule, so the payload is the same on every host.
//
// Example (worker pushes, server aggregates):
//
//   std::vector<float> residual(n, 0.0f);           // one per key, lives with the key
//   std::vector<uint8_t> wire(TwoBitCompressedBytes(n));
//   absl::Status s = TwoBitQuantize(grad, residual.data(), n, 0.5f, wire.data());
//   ...send wire...
//   // Server, for every push of the round:
//   absl::Status s = TwoBitDequantizeAdd(bytes, num_bytes, n, 0.5f, sum.data());
//   if (!s.ok()) { /* DataLoss: count, log, reject the push; sum is untouched */ }
//
// Thread-safety: the functions keep no state; concurrent calls are safe as long
// as they do not write the same arrays. The GPU versions live in two_bit_gpu.h.
#ifndef TESSERA_COMMON_COMPRESSION_TWO_BIT_H_
#define TESSERA_COMMON_COMPRESSION_TWO_BIT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace tessera::compression {

// Number of elements packed into one 32-bit word.
inline constexpr size_t kTwoBitElementsPerWord = 16;

// Size in bytes of the payload for `len` elements: 4 * ceil(len / 16). Never
// overflows.
size_t TwoBitCompressedBytes(size_t len);

// Quantizes `grad` (len floats) with error feedback: residual[i] += grad[i],
// then codes residual[i] by the rule above and subtracts what the code stands
// for. Writes exactly TwoBitCompressedBytes(len) bytes to `out`, padding slots
// zero. A NaN gradient makes that residual NaN, coded 0b00 from then on (as in
// MXNet). REQUIRES: `grad` and `out` do not overlap `residual`; `residual` is
// owned by the caller and persists between pushes of the same key. Errors:
// InvalidArgument if threshold <= 0 or is not finite, or if a pointer is null
// while len > 0. On error nothing is written.
absl::Status TwoBitQuantize(const float* grad, float* residual, size_t len,
                            float threshold, uint8_t* out);

// Decodes `in` (in_bytes bytes, typically straight from the network) into `len`
// floats. Errors, checked before anything is written (on error `out` is
// untouched):
//   InvalidArgument: threshold <= 0 or not finite; a null pointer with len > 0.
//   DataLoss: in_bytes != TwoBitCompressedBytes(len); a code 0b01 anywhere (no
//   encoder emits it); any set bit in the padding slots past `len`.
absl::Status TwoBitDequantize(const uint8_t* in, size_t in_bytes, size_t len,
                              float threshold, float* out);

// As TwoBitDequantize, with the same validation, but adds: out[i] +=
// decoded[i]. This is how a server sums the pushes of a round. On error `out`
// is untouched.
absl::Status TwoBitDequantizeAdd(const uint8_t* in, size_t in_bytes, size_t len,
                                 float threshold, float* out);

// The checks of TwoBitDequantize alone: OK exactly when it would decode.
absl::Status TwoBitValidate(const uint8_t* in, size_t in_bytes, size_t len,
                            float threshold);

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_TWO_BIT_H_

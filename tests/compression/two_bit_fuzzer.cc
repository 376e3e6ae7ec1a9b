// libFuzzer target for the 2-bit decoder, which reads bytes straight off the
// network.
//
// Input: 4 bytes of element count (little-endian, taken modulo 4096), 4 bytes
// of threshold (raw float bits), then the payload. Properties checked:
//   - the decoder never crashes, reads only in_bytes, writes only len floats;
//   - it fails with exactly InvalidArgument (bad threshold) or DataLoss (bad
//     bytes), and then leaves the output untouched;
//   - it accepts exactly the payloads a simple independent check accepts;
//   - an accepted payload re-encodes to itself (decoded values quantized with
//     a zero residual give the same bytes and a zero residual), and
//     DequantizeAdd onto zeros equals Dequantize.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/compression/two_bit.h"
#include "common/compression/two_bit_testing.h"

namespace {

using tessera::compression::TwoBitCompressedBytes;

void Require(bool condition) {
  if (!condition) std::abort();
}

// Independent validity check, one slot at a time.
bool PayloadIsValid(const uint8_t* in, size_t in_bytes, size_t len) {
  if (in_bytes != TwoBitCompressedBytes(len)) return false;
  for (size_t slot = 0; slot < 4 * in_bytes; ++slot) {
    const unsigned code = (in[slot / 4] >> (6 - 2 * (slot % 4))) & 0b11u;
    if (slot >= len && code != 0) return false;
    if (code == 0b01) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint32_t raw_len;
  float threshold;
  std::memcpy(&raw_len, data, 4);
  std::memcpy(&threshold, data + 4, 4);
  const size_t len = raw_len % 4096;
  tessera::compression::ForceBaselineSimdForTesting((raw_len >> 31) != 0);
  // Exactly-sized copies so ASan catches any read or write past the ends.
  const std::vector<uint8_t> payload(data + 8, data + size);
  const uint8_t* in = payload.empty() ? nullptr : payload.data();
  std::vector<float> out(len, 42.0f);
  float* out_ptr = out.empty() ? nullptr : out.data();

  const absl::Status s = tessera::compression::TwoBitDequantize(
      in, payload.size(), len, threshold, out_ptr);
  const bool threshold_ok = threshold > 0.0f && std::isfinite(threshold);
  if (!threshold_ok) {
    Require(s.code() == absl::StatusCode::kInvalidArgument);
  } else if (in == nullptr && len > 0) {
    Require(s.code() == absl::StatusCode::kInvalidArgument ||
            s.code() == absl::StatusCode::kDataLoss);
  } else {
    const bool valid = PayloadIsValid(in, payload.size(), len);
    Require(s.ok() == valid);
    if (!valid) Require(s.code() == absl::StatusCode::kDataLoss);
  }
  if (!s.ok()) {
    for (float v : out) Require(v == 42.0f);
    return 0;
  }

  for (float v : out) Require(v == threshold || v == -threshold || v == 0.0f);
  std::vector<float> residual(len, 0.0f);
  std::vector<uint8_t> again(TwoBitCompressedBytes(len), 0x5A);
  Require(tessera::compression::TwoBitQuantize(
              out.data(), residual.data(), len, threshold,
              again.empty() ? nullptr : again.data())
              .ok());
  Require(again == payload);
  for (float r : residual) Require(r == 0.0f);

  std::vector<float> sum(len, 0.0f);
  Require(tessera::compression::TwoBitDequantizeAdd(
              in, payload.size(), len, threshold,
              sum.empty() ? nullptr : sum.data())
              .ok());
  Require(sum == out);
  return 0;
}

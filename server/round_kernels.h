// The server's per-value loops of a round: the exact sum's additions and
// counts (ExactSum), and the compressed pulls' change coding (PullShadow).
// Each has a baseline loop (written for the vectoriser; SSE2 on x86-64) and,
// on x86-64, an AVX2 loop picked at run time when the CPU has AVX2, as the
// 2-bit codec picks its own (common/compression/two_bit.cc). The AVX2 loops do
// the same IEEE operations in the same order, lane by lane, so both give the
// same bits; round_kernels_test checks them against each other on every
// target the machine has (compression::ForceBaselineSimdForTesting switches
// these too).
//
// Not part of the public API.
#ifndef TESSERA_SERVER_ROUND_KERNELS_H_
#define TESSERA_SERVER_ROUND_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tessera::round_kernels {

// Knuth's TwoSum: x + y = *sum + the returned error, exactly (NaN when an
// input is not finite).
inline double TwoSum(double x, double y, double* sum) {
  const double s = x + y;
  const double bb = s - x;
  *sum = s;
  return (x - (s - bb)) + (y - bb);
}

inline bool IsZero(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof(bits));
  return (bits << 1) == 0;  // +0 or -0; not NaN
}

// One value of AddExactly: *a += v when exact; returns whether it was.
inline bool ExactAdd(double* a, float v) {
  const double x = *a;
  double s;
  const bool exact = IsZero(TwoSum(x, v, &s));
  *a = exact ? s : x;  // no branch: the baseline loop vectorises
  return exact;
}

// One value of AddPairExactly.
inline bool PairAdd(double* hi, double* lo, float v) {
  const double x = *hi;
  const double l = *lo;
  double s, t;
  const double e = TwoSum(x, v, &s);
  const bool exact = IsZero(TwoSum(l, e, &t));
  *hi = exact ? s : x;
  *lo = exact ? t : l;
  return exact;
}

// a[i] += v[i] for i < n where the addition is exact (Knuth's TwoSum: its
// error term is zero); elsewhere (it rounded, or an input was not finite)
// a[i] is left as it was and rounded[i] = 1 (else 0). Returns whether any
// was.
bool AddExactly(double* a, const float* v, uint8_t* rounded, size_t n);

// The same for pairs (ExactSum's second doubles): hi[i] + v[i] = s + e
// exactly (TwoSum), and where lo[i] + e is exact too (TwoSum again), hi[i] = s
// and lo[i] = lo[i] + e; elsewhere (the rest does not fit lo, or an input was
// not finite) both are left as they were and rounded[i] = 1 (else 0).
// Returns whether any was.
bool AddPairExactly(double* hi, double* lo, const float* v, uint8_t* rounded,
                    size_t n);

// counts[j] += the code (+1 for 0b11, -1 for 0b10, 0 for 0b00) of the values
// of `words` whole 2-bit payload words at `in` (16 values a word, MXNet's
// layout). The payload was validated.
void AddCodeWords(int32_t* counts, const uint8_t* in, size_t words);
// The same with counts[j] = the code: a round's first push, written over
// whatever the counts held (no pass to zero them first).
void SetCodeWords(int32_t* counts, const uint8_t* in, size_t words);

// out[i] = float(double(counts[i]) * t), correctly rounded once; `out` may be
// `counts` itself (each float over its count).
void CountsToFloats(const int32_t* counts, size_t n, float t, float* out);

// mean |w[i] - s[i]| over n > 0 values: each difference in float32, its
// magnitude added in double to one of eight partial sums (value i to sum
// i % 8, the rest to sum 0), summed ((0+1)+(2+3))+((4+5)+(6+7)).
double MeanAbsDifference(const float* w, const float* s, size_t n);

// Codes r = w[i] - s[i] against t (+ when r >= t, - when r <= -t, else 0)
// into out (TwoBitCompressedBytes(n) bytes, MXNet's layout, padding slots 0)
// and adds what each code stands for (+t, -t, +0.0f) to s[i] in float32, the
// addition a worker's TwoBitDequantizeAdd makes.
void CodeChange(const float* w, float* s, size_t n, float t, uint8_t* out);

}  // namespace tessera::round_kernels

#endif  // TESSERA_SERVER_ROUND_KERNELS_H_

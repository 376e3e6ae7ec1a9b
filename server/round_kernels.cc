#include "server/round_kernels.h"

#include <cmath>
#include <cstring>

#include "common/compression/simd.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TESSERA_ROUND_AVX2 1
#endif

namespace tessera::round_kernels {
namespace {

namespace k = compression::kernels;
constexpr size_t kWord = compression::kTwoBitElementsPerWord;  // 16

inline uint32_t LoadWord(const uint8_t* in) {
  uint32_t word;
  std::memcpy(&word, in, sizeof(word));  // little-endian hosts (x86, Arm)
  return word;
}

bool AddExactlyBaseline(double* __restrict a, const float* __restrict v,
                        uint8_t* __restrict rounded, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool exact = ExactAdd(a + i, v[i]);
    rounded[i] = !exact;
    bad |= !exact;
  }
  return bad != 0;
}

bool AddPairExactlyBaseline(double* __restrict hi, double* __restrict lo,
                            const float* __restrict v,
                            uint8_t* __restrict rounded, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool exact = PairAdd(hi + i, lo + i, v[i]);
    rounded[i] = !exact;
    bad |= !exact;
  }
  return bad != 0;
}

// The code of value j of a word: +1, -1 or 0.
inline int32_t CodeOf(uint32_t word, size_t j) {
  const uint32_t code = (word >> k::WordShift(j)) & 0b11u;
  return static_cast<int32_t>(code == k::kCodePlus) -
         static_cast<int32_t>(code == k::kCodeMinus);
}

template <bool kAdd>
void CodeWordsToCountsBaseline(int32_t* __restrict counts,
                               const uint8_t* __restrict in, size_t words) {
  for (size_t w = 0; w < words; ++w) {
    const uint32_t word = LoadWord(in + 4 * w);
    int32_t* c = counts + w * kWord;
    for (size_t j = 0; j < kWord; ++j) {
      if (kAdd) {
        c[j] += CodeOf(word, j);
      } else {
        c[j] = CodeOf(word, j);
      }
    }
  }
}

void CountsToFloatsBaseline(const int32_t* counts, size_t n, float t,
                            float* out) {
  const double td = t;
  for (size_t i = 0; i < n; ++i) {
    const float r = static_cast<float>(static_cast<double>(counts[i]) * td);
    std::memcpy(out + i, &r, sizeof(r));  // out may alias counts
  }
}

double SumParts(const double part[8], size_t n) {
  return (((part[0] + part[1]) + (part[2] + part[3])) +
          ((part[4] + part[5]) + (part[6] + part[7]))) /
         static_cast<double>(n);
}

void MeanAbsTail(const float* w, const float* s, size_t from, size_t n,
                 double part[8]) {
  for (size_t i = from; i < n; ++i)
    part[0] += std::fabs(static_cast<double>(w[i] - s[i]));
}

double MeanAbsDifferenceBaseline(const float* __restrict w,
                                 const float* __restrict s, size_t n) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j)
      part[j] += std::fabs(static_cast<double>(w[i + j] - s[i + j]));
  }
  MeanAbsTail(w, s, i, n, part);
  return SumParts(part, n);
}

// Codes value i of the change; adds its code's value to s[i].
inline uint32_t CodeOne(float w, float* s, float t, float neg_t) {
  const float r = w - *s;
  const bool pos = r >= t;  // False for NaN, as is neg: NaN codes 0b00.
  const bool neg = r <= neg_t;
  const float taken = pos ? t : (neg ? neg_t : 0.0f);
  *s = *s + taken;
  return (pos ? k::kCodePlus : 0u) | (neg ? k::kCodeMinus : 0u);
}

void CodeWordsBaseline(const float* __restrict w, float* __restrict s,
                       size_t words, float t, uint8_t* __restrict out) {
  const float neg_t = -t;
  for (size_t b = 0; b < words; ++b) {
    uint32_t word = 0;
    for (size_t j = 0; j < kWord; ++j) {
      const size_t i = b * kWord + j;
      word |= CodeOne(w[i], &s[i], t, neg_t) << k::WordShift(j);
    }
    std::memcpy(out + 4 * b, &word, sizeof(word));
  }
}

#if defined(TESSERA_ROUND_AVX2)
// TwoSum, four lanes: x + y = *sum + the returned error.
__attribute__((target("avx2"))) inline __m256d TwoSumAvx2(__m256d x, __m256d y,
                                                          __m256d* sum) {
  const __m256d s = _mm256_add_pd(x, y);
  const __m256d bb = _mm256_sub_pd(s, x);
  *sum = s;
  return _mm256_add_pd(_mm256_sub_pd(x, _mm256_sub_pd(s, bb)),
                       _mm256_sub_pd(y, bb));
}

__attribute__((target("avx2"))) bool AddExactlyAvx2(double* a, const float* v,
                                                    uint8_t* rounded,
                                                    size_t n) {
  const __m256d zero = _mm256_setzero_pd();
  int bad = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_loadu_pd(a + i);
    const __m256d y = _mm256_cvtps_pd(_mm_loadu_ps(v + i));
    __m256d s;
    const __m256d err = TwoSumAvx2(x, y, &s);
    // Ordered equal: true for +0 and -0, false for NaN.
    const __m256d exact = _mm256_cmp_pd(err, zero, _CMP_EQ_OQ);
    _mm256_storeu_pd(a + i, _mm256_blendv_pd(x, s, exact));
    const int inexact = ~_mm256_movemask_pd(exact) & 0xf;
    for (int q = 0; q < 4; ++q) rounded[i + q] = (inexact >> q) & 1;
    bad |= inexact;
  }
  for (; i < n; ++i) {
    const bool exact = ExactAdd(a + i, v[i]);
    rounded[i] = !exact;
    bad |= !exact;
  }
  return bad != 0;
}

__attribute__((target("avx2"))) bool AddPairExactlyAvx2(double* hi, double* lo,
                                                        const float* v,
                                                        uint8_t* rounded,
                                                        size_t n) {
  const __m256d zero = _mm256_setzero_pd();
  int bad = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_loadu_pd(hi + i);
    const __m256d y = _mm256_cvtps_pd(_mm_loadu_ps(v + i));
    __m256d s, t;
    const __m256d e = TwoSumAvx2(x, y, &s);
    const __m256d l = _mm256_loadu_pd(lo + i);
    const __m256d e2 = TwoSumAvx2(l, e, &t);
    // Ordered equal: true for +0 and -0, false for NaN.
    const __m256d exact = _mm256_cmp_pd(e2, zero, _CMP_EQ_OQ);
    _mm256_storeu_pd(hi + i, _mm256_blendv_pd(x, s, exact));
    _mm256_storeu_pd(lo + i, _mm256_blendv_pd(l, t, exact));
    const int inexact = ~_mm256_movemask_pd(exact) & 0xf;
    for (int q = 0; q < 4; ++q) rounded[i + q] = (inexact >> q) & 1;
    bad |= inexact;
  }
  for (; i < n; ++i) {
    const bool exact = PairAdd(hi + i, lo + i, v[i]);
    rounded[i] = !exact;
    bad |= !exact;
  }
  return bad != 0;
}

template <bool kAdd>
__attribute__((target("avx2"))) void CodeWordsToCountsAvx2(int32_t* counts,
                                                           const uint8_t* in,
                                                           size_t words) {
  const __m256i three = _mm256_set1_epi32(0b11);
  const __m256i two = _mm256_set1_epi32(0b10);
  const __m256i shifts[2] = {
      _mm256_setr_epi32(k::WordShift(0), k::WordShift(1), k::WordShift(2),
                        k::WordShift(3), k::WordShift(4), k::WordShift(5),
                        k::WordShift(6), k::WordShift(7)),
      _mm256_setr_epi32(k::WordShift(8), k::WordShift(9), k::WordShift(10),
                        k::WordShift(11), k::WordShift(12), k::WordShift(13),
                        k::WordShift(14), k::WordShift(15))};
  for (size_t w = 0; w < words; ++w) {
    const __m256i word =
        _mm256_set1_epi32(static_cast<int>(LoadWord(in + 4 * w)));
    int32_t* c = counts + w * kWord;
    for (int h = 0; h < 2; ++h) {
      const __m256i code =
          _mm256_and_si256(_mm256_srlv_epi32(word, shifts[h]), three);
      // (code == 0b10 ? -1 : 0) - (code == 0b11 ? -1 : 0): -1, +1 or 0.
      const __m256i delta = _mm256_sub_epi32(_mm256_cmpeq_epi32(code, two),
                                             _mm256_cmpeq_epi32(code, three));
      __m256i* at = reinterpret_cast<__m256i*>(c + 8 * h);
      _mm256_storeu_si256(
          at, kAdd ? _mm256_add_epi32(_mm256_loadu_si256(at), delta) : delta);
    }
  }
}

__attribute__((target("avx2"))) void CountsToFloatsAvx2(const int32_t* counts,
                                                        size_t n, float t,
                                                        float* out) {
  const __m256d td = _mm256_set1_pd(t);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128i c =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(counts + i));
    const __m128 r = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(c), td));
    _mm_storeu_ps(out + i, r);
  }
  CountsToFloatsBaseline(counts + i, n - i, t, out + i);
}

__attribute__((target("avx2"))) double MeanAbsDifferenceAvx2(const float* w,
                                                             const float* s,
                                                             size_t n) {
  const __m256d sign = _mm256_set1_pd(-0.0);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d =
        _mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(s + i));
    lo = _mm256_add_pd(
        lo, _mm256_andnot_pd(sign, _mm256_cvtps_pd(_mm256_castps256_ps128(d))));
    hi = _mm256_add_pd(
        hi,
        _mm256_andnot_pd(sign, _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1))));
  }
  double part[8];
  _mm256_storeu_pd(part, lo);
  _mm256_storeu_pd(part + 4, hi);
  MeanAbsTail(w, s, i, n, part);
  return SumParts(part, n);
}

// Bit i of an 8-bit lane mask placed at element i's low code bit in a word.
struct Spread {
  uint16_t v[256];
  Spread() {
    for (uint32_t m = 0; m < 256; ++m) {
      uint32_t out = 0;
      for (uint32_t j = 0; j < 8; ++j)
        if ((m >> j) & 1u) out |= 1u << k::WordShift(j);
      v[m] = static_cast<uint16_t>(out);
    }
  }
};
const Spread& SpreadTable() {
  static const Spread* table = new Spread;
  return *table;
}

__attribute__((target("avx2"))) void CodeWordsAvx2(const float* w, float* s,
                                                   size_t words, float t,
                                                   uint8_t* out) {
  const Spread& spread = SpreadTable();
  const __m256 tv = _mm256_set1_ps(t);
  const __m256 neg_t = _mm256_set1_ps(-t);
  for (size_t b = 0; b < words; ++b) {
    uint32_t word = 0;
    for (int h = 0; h < 2; ++h) {
      const size_t i = b * kWord + 8 * h;
      const __m256 sv = _mm256_loadu_ps(s + i);
      const __m256 r = _mm256_sub_ps(_mm256_loadu_ps(w + i), sv);
      const __m256 pos = _mm256_cmp_ps(r, tv, _CMP_GE_OQ);  // False for NaN.
      const __m256 neg = _mm256_cmp_ps(r, neg_t, _CMP_LE_OQ);
      const __m256 taken =
          _mm256_or_ps(_mm256_and_ps(pos, tv), _mm256_and_ps(neg, neg_t));
      _mm256_storeu_ps(s + i, _mm256_add_ps(sv, taken));
      const uint32_t pos_bits = static_cast<uint32_t>(_mm256_movemask_ps(pos));
      const uint32_t any_bits =
          static_cast<uint32_t>(_mm256_movemask_ps(_mm256_or_ps(pos, neg)));
      // A code is 0b11 (+) or 0b10 (-): its high bit for both, its low bit
      // for + alone. Half h of the word holds values 8h..8h+7 (two bytes).
      word |= (static_cast<uint32_t>(spread.v[pos_bits]) |
               static_cast<uint32_t>(spread.v[any_bits]) << 1)
              << (16 * h);
    }
    std::memcpy(out + 4 * b, &word, sizeof(word));
  }
}
#endif  // TESSERA_ROUND_AVX2

}  // namespace

bool AddExactly(double* a, const float* v, uint8_t* rounded, size_t n) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops()) return AddExactlyAvx2(a, v, rounded, n);
#endif
  return AddExactlyBaseline(a, v, rounded, n);
}

bool AddPairExactly(double* hi, double* lo, const float* v, uint8_t* rounded,
                    size_t n) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops())
    return AddPairExactlyAvx2(hi, lo, v, rounded, n);
#endif
  return AddPairExactlyBaseline(hi, lo, v, rounded, n);
}

void AddCodeWords(int32_t* counts, const uint8_t* in, size_t words) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops())
    return CodeWordsToCountsAvx2<true>(counts, in, words);
#endif
  CodeWordsToCountsBaseline<true>(counts, in, words);
}

void SetCodeWords(int32_t* counts, const uint8_t* in, size_t words) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops())
    return CodeWordsToCountsAvx2<false>(counts, in, words);
#endif
  CodeWordsToCountsBaseline<false>(counts, in, words);
}

void CountsToFloats(const int32_t* counts, size_t n, float t, float* out) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops()) return CountsToFloatsAvx2(counts, n, t, out);
#endif
  CountsToFloatsBaseline(counts, n, t, out);
}

double MeanAbsDifference(const float* w, const float* s, size_t n) {
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops()) return MeanAbsDifferenceAvx2(w, s, n);
#endif
  return MeanAbsDifferenceBaseline(w, s, n);
}

void CodeChange(const float* w, float* s, size_t n, float t, uint8_t* out) {
  const size_t words = n / kWord;
#if defined(TESSERA_ROUND_AVX2)
  if (compression::UseAvx2Loops()) {
    CodeWordsAvx2(w, s, words, t, out);
  } else {
    CodeWordsBaseline(w, s, words, t, out);
  }
#else
  CodeWordsBaseline(w, s, words, t, out);
#endif
  if (n % kWord == 0) return;
  // The last, partial word: its padding slots stay 0.
  const float neg_t = -t;
  uint32_t word = 0;
  for (size_t j = 0; words * kWord + j < n; ++j) {
    const size_t i = words * kWord + j;
    word |= CodeOne(w[i], &s[i], t, neg_t) << k::WordShift(j);
  }
  std::memcpy(out + 4 * words, &word, sizeof(word));
}

}  // namespace tessera::round_kernels

#include "common/compression/two_bit.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/compression/simd.h"
#include "common/compression/two_bit_kernels.h"
#include "common/compression/two_bit_testing.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define TESSERA_TWO_BIT_SSE2 1
#endif
#if defined(__x86_64__) && defined(TESSERA_TWO_BIT_SSE2) && \
    (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
// An AVX2 variant compiled beside the baseline build and picked at run time.
#define TESSERA_TWO_BIT_AVX2 1
#endif

namespace tessera::compression {
namespace {

// The per-element arithmetic and the bit layout are shared with the GPU
// kernels (two_bit_kernels.h); the SIMD loops below repeat the arithmetic lane
// by lane and are tested against it.
using kernels::DecodeElement;
using kernels::QuantizeElement;

// Bit position of the lowest bit of element j's code inside a word.
constexpr uint32_t Shift(size_t j) { return kernels::WordShift(j); }

// The wire format is defined by bytes; words are built in host order and
// written in little-endian order.
inline void StoreWord(uint32_t word, uint8_t* out) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(out, &word, sizeof(word));
  } else {
    for (int k = 0; k < 4; ++k) out[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

inline uint32_t LoadWord(const uint8_t* in) {
  uint32_t word;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&word, in, sizeof(word));
  } else {
    word = 0;
    for (int k = 0; k < 4; ++k) word |= static_cast<uint32_t>(in[k]) << (8 * k);
  }
  return word;
}

// Codes `n` <= 16 elements into one word with the GPU kernel's per-element
// function, so both produce the same bits. QuantizeElement is branch-free so
// that the n == 16 instance vectorises.
template <size_t kN>
inline uint32_t QuantizeWord(const float* __restrict grad,
                             float* __restrict residual, size_t n, float t,
                             float neg_t) {
  uint32_t word = 0;
  const size_t count = kN == kTwoBitElementsPerWord ? kN : n;
  for (size_t j = 0; j < count; ++j) {
    word |= QuantizeElement(grad[j], &residual[j], t, neg_t) << Shift(j);
  }
  return word;
}

#if defined(TESSERA_TWO_BIT_SSE2)
// kSpread[m] places bit i of the 8-bit mask m (element i of 8) at the code's
// low bit: byte i/4 of the result, bit 6 - 2 * (i % 4).
constexpr auto kSpread = [] {
  struct Table {
    uint16_t v[256];
  } table{};
  for (uint32_t m = 0; m < 256; ++m) {
    uint32_t out = 0;
    for (uint32_t i = 0; i < 8; ++i) {
      if ((m >> i) & 1u) out |= 1u << Shift(i);
    }
    table.v[m] = static_cast<uint16_t>(out);
  }
  return table;
}();

inline uint32_t Spread16(uint32_t mask16) {
  return kSpread.v[mask16 & 0xffu] |
         (static_cast<uint32_t>(kSpread.v[mask16 >> 8]) << 16);
}

// SSE2 version of QuantizeWord<16>: the same IEEE operations, four lanes at a
// time.
inline uint32_t QuantizeWordSse2(const float* grad, float* residual, __m128 t,
                                 __m128 neg_t) {
  __m128i pos_masks[4];
  __m128i any_masks[4];
  for (int q = 0; q < 4; ++q) {
    const __m128 r =
        _mm_add_ps(_mm_loadu_ps(residual + 4 * q), _mm_loadu_ps(grad + 4 * q));
    const __m128 pos = _mm_cmpge_ps(r, t);  // Ordered: false for NaN.
    const __m128 neg = _mm_cmple_ps(r, neg_t);
    // pos and neg exclude each other because t > 0.
    const __m128 taken = _mm_or_ps(_mm_and_ps(pos, t), _mm_and_ps(neg, neg_t));
    _mm_storeu_ps(residual + 4 * q, _mm_sub_ps(r, taken));
    pos_masks[q] = _mm_castps_si128(pos);
    any_masks[q] = _mm_castps_si128(_mm_or_ps(pos, neg));
  }
  const __m128i pos8 =
      _mm_packs_epi16(_mm_packs_epi32(pos_masks[0], pos_masks[1]),
                      _mm_packs_epi32(pos_masks[2], pos_masks[3]));
  const __m128i any8 =
      _mm_packs_epi16(_mm_packs_epi32(any_masks[0], any_masks[1]),
                      _mm_packs_epi32(any_masks[2], any_masks[3]));
  const uint32_t low_bits =
      Spread16(static_cast<uint32_t>(_mm_movemask_epi8(pos8)));
  const uint32_t high_bits =
      Spread16(static_cast<uint32_t>(_mm_movemask_epi8(any8))) << 1;
  return low_bits | high_bits;
}
#endif  // TESSERA_TWO_BIT_SSE2

#if defined(TESSERA_TWO_BIT_AVX2)
// Quantizes `words` whole words with AVX2: the same IEEE operations as
// QuantizeWord, eight lanes at a time (AVX2 alone implies no FMA).
__attribute__((target("avx2"))) void QuantizeWordsAvx2(const float* grad,
                                                       float* residual,
                                                       size_t words,
                                                       float threshold,
                                                       uint8_t* out) {
  const __m256 t = _mm256_set1_ps(threshold);
  const __m256 neg_t = _mm256_set1_ps(-threshold);
  for (size_t w = 0; w < words; ++w) {
    const float* g = grad + w * kTwoBitElementsPerWord;
    float* r = residual + w * kTwoBitElementsPerWord;
    uint32_t word = 0;
    for (int h = 0; h < 2; ++h) {
      const __m256 v =
          _mm256_add_ps(_mm256_loadu_ps(r + 8 * h), _mm256_loadu_ps(g + 8 * h));
      const __m256 pos = _mm256_cmp_ps(v, t, _CMP_GE_OQ);  // False for NaN.
      const __m256 neg = _mm256_cmp_ps(v, neg_t, _CMP_LE_OQ);
      const __m256 taken =
          _mm256_or_ps(_mm256_and_ps(pos, t), _mm256_and_ps(neg, neg_t));
      _mm256_storeu_ps(r + 8 * h, _mm256_sub_ps(v, taken));
      const uint32_t pos_bits = static_cast<uint32_t>(_mm256_movemask_ps(pos));
      const uint32_t any_bits =
          static_cast<uint32_t>(_mm256_movemask_ps(_mm256_or_ps(pos, neg)));
      word |= (static_cast<uint32_t>(kSpread.v[pos_bits]) |
               static_cast<uint32_t>(kSpread.v[any_bits]) << 1)
              << (16 * h);
    }
    StoreWord(word, out + 4 * w);
  }
}

// Decodes `words` whole, validated words with AVX2 (set or add).
template <bool kAdd>
__attribute__((target("avx2"))) void DecodeWordsAvx2(const uint8_t* in,
                                                     size_t words,
                                                     float threshold,
                                                     float* out) {
  const __m256 t = _mm256_set1_ps(threshold);
  const __m256 neg_t = _mm256_set1_ps(-threshold);
  const __m256i three = _mm256_set1_epi32(0b11);
  const __m256i two = _mm256_set1_epi32(0b10);
  const __m256i shifts[2] = {
      _mm256_setr_epi32(Shift(0), Shift(1), Shift(2), Shift(3), Shift(4),
                        Shift(5), Shift(6), Shift(7)),
      _mm256_setr_epi32(Shift(8), Shift(9), Shift(10), Shift(11), Shift(12),
                        Shift(13), Shift(14), Shift(15))};
  for (size_t w = 0; w < words; ++w) {
    const __m256i word =
        _mm256_set1_epi32(static_cast<int>(LoadWord(in + 4 * w)));
    float* o = out + w * kTwoBitElementsPerWord;
    for (int h = 0; h < 2; ++h) {
      const __m256i code =
          _mm256_and_si256(_mm256_srlv_epi32(word, shifts[h]), three);
      __m256 v = _mm256_or_ps(
          _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(code, three)),
                        t),
          _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(code, two)),
                        neg_t));
      if constexpr (kAdd) v = _mm256_add_ps(_mm256_loadu_ps(o + 8 * h), v);
      _mm256_storeu_ps(o + 8 * h, v);
    }
  }
}

std::atomic<bool> force_baseline_simd{false};

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have && !force_baseline_simd.load(std::memory_order_relaxed);
}
#endif  // TESSERA_TWO_BIT_AVX2

absl::Status CheckThreshold(float threshold) {
  if (!(threshold > 0.0f) || !std::isfinite(threshold)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "2-bit compression threshold must be finite and > 0, got ", threshold));
  }
  return absl::OkStatus();
}

// Validates a payload for `len` elements without writing anything.
absl::Status ValidatePayload(const uint8_t* in, size_t in_bytes, size_t len,
                             float threshold, const float* out) {
  if (absl::Status s = CheckThreshold(threshold); !s.ok()) return s;
  if (len > 0 && (in == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError(
        "2-bit dequantize: null input or output pointer with len > 0");
  }
  const size_t expected = TwoBitCompressedBytes(len);
  if (in_bytes != expected) {
    return absl::DataLossError(absl::StrCat("2-bit payload has ", in_bytes,
                                            " bytes, expected ", expected,
                                            " for ", len, " elements"));
  }
  const size_t words = expected / 4;
  const size_t tail = len % kTwoBitElementsPerWord;
  if (tail != 0) {
    uint32_t used = 0;
    for (size_t j = 0; j < tail; ++j) used |= 0b11u << Shift(j);
    const uint32_t last = LoadWord(in + 4 * (words - 1));
    if ((last & ~used) != 0) {
      return absl::DataLossError(
          absl::StrCat("2-bit payload has codes in the wrong place: padding "
                       "bits past element ",
                       len, " are set"));
    }
  }
  // A code 0b01 (padding slots are zero by now) has its low bit set and its
  // high bit clear.
  uint32_t bad_codes = 0;
  for (size_t w = 0; w < words; ++w) {
    const uint32_t word = LoadWord(in + 4 * w);
    bad_codes |= (word & 0x55555555u) & ~(word >> 1);
  }
  if (bad_codes != 0) {
    for (size_t w = 0; w < words; ++w) {
      const uint32_t word = LoadWord(in + 4 * w);
      const uint32_t bad = (word & 0x55555555u) & ~(word >> 1);
      if (bad == 0) continue;
      for (size_t j = 0; j < kTwoBitElementsPerWord; ++j) {
        if ((bad >> Shift(j)) & 1u) {
          return absl::DataLossError(
              absl::StrCat("2-bit payload holds the invalid code 0b01 at slot ",
                           w * kTwoBitElementsPerWord + j));
        }
      }
    }
  }
  return absl::OkStatus();
}

template <bool kAdd, size_t kN>
inline void DecodeWord(uint32_t word, size_t n, float t, float neg_t,
                       float* __restrict out) {
  const size_t count = kN == kTwoBitElementsPerWord ? kN : n;
  for (size_t j = 0; j < count; ++j) {
    const float v = DecodeElement((word >> Shift(j)) & 0b11u, t, neg_t);
    if constexpr (kAdd) {
      out[j] += v;
    } else {
      out[j] = v;
    }
  }
}

template <bool kAdd>
absl::Status Decode(const uint8_t* in, size_t in_bytes, size_t len,
                    float threshold, float* out) {
  if (absl::Status s = ValidatePayload(in, in_bytes, len, threshold, out);
      !s.ok()) {
    return s;
  }
  const float neg_t = -threshold;
  const size_t full = len / kTwoBitElementsPerWord;
  size_t w = 0;  // Whole words done so far.
#if defined(TESSERA_TWO_BIT_AVX2)
  if (HaveAvx2()) {
    DecodeWordsAvx2<kAdd>(in, full, threshold, out);
    w = full;
  }
#endif
  for (; w < full; ++w) {
    DecodeWord<kAdd, kTwoBitElementsPerWord>(
        LoadWord(in + 4 * w), kTwoBitElementsPerWord, threshold, neg_t,
        out + w * kTwoBitElementsPerWord);
  }
  if (const size_t tail = len % kTwoBitElementsPerWord; tail != 0) {
    DecodeWord<kAdd, 0>(LoadWord(in + 4 * full), tail, threshold, neg_t,
                        out + full * kTwoBitElementsPerWord);
  }
  return absl::OkStatus();
}

}  // namespace

void ForceBaselineSimdForTesting(bool force) {
#if defined(TESSERA_TWO_BIT_AVX2)
  force_baseline_simd.store(force, std::memory_order_relaxed);
#else
  (void)force;
#endif
}

bool UseAvx2Loops() {
#if defined(TESSERA_TWO_BIT_AVX2)
  return HaveAvx2();
#else
  return false;
#endif
}

bool TwoBitUsesAvx2ForTesting() {
#if defined(TESSERA_TWO_BIT_AVX2)
  return HaveAvx2();
#else
  return false;
#endif
}

size_t TwoBitCompressedBytes(size_t len) {
  return 4 * (len / kTwoBitElementsPerWord +
              (len % kTwoBitElementsPerWord != 0 ? 1 : 0));
}

absl::Status TwoBitQuantize(const float* grad, float* residual, size_t len,
                            float threshold, uint8_t* out) {
  if (absl::Status s = CheckThreshold(threshold); !s.ok()) return s;
  if (len > 0 && (grad == nullptr || residual == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError(
        "2-bit quantize: null grad, residual or output pointer with len > 0");
  }
  const float neg_t = -threshold;
  const size_t full = len / kTwoBitElementsPerWord;
  size_t w = 0;  // Whole words done so far.
#if defined(TESSERA_TWO_BIT_AVX2)
  if (HaveAvx2()) {
    QuantizeWordsAvx2(grad, residual, full, threshold, out);
    w = full;
  }
#endif
#if defined(TESSERA_TWO_BIT_SSE2)
  const __m128 t4 = _mm_set1_ps(threshold);
  const __m128 neg_t4 = _mm_set1_ps(neg_t);
  for (; w < full; ++w) {
    const size_t base = w * kTwoBitElementsPerWord;
    StoreWord(QuantizeWordSse2(grad + base, residual + base, t4, neg_t4),
              out + 4 * w);
  }
#else
  for (; w < full; ++w) {
    const size_t base = w * kTwoBitElementsPerWord;
    StoreWord(QuantizeWord<kTwoBitElementsPerWord>(grad + base, residual + base,
                                                   kTwoBitElementsPerWord,
                                                   threshold, neg_t),
              out + 4 * w);
  }
#endif
  if (const size_t tail = len % kTwoBitElementsPerWord; tail != 0) {
    const size_t base = full * kTwoBitElementsPerWord;
    StoreWord(
        QuantizeWord<0>(grad + base, residual + base, tail, threshold, neg_t),
        out + 4 * full);
  }
  return absl::OkStatus();
}

absl::Status TwoBitDequantize(const uint8_t* in, size_t in_bytes, size_t len,
                              float threshold, float* out) {
  return Decode</*kAdd=*/false>(in, in_bytes, len, threshold, out);
}

absl::Status TwoBitDequantizeAdd(const uint8_t* in, size_t in_bytes, size_t len,
                                 float threshold, float* out) {
  return Decode</*kAdd=*/true>(in, in_bytes, len, threshold, out);
}

absl::Status TwoBitValidate(const uint8_t* in, size_t in_bytes, size_t len,
                            float threshold) {
  const float unused = 0;
  return ValidatePayload(in, in_bytes, len, threshold, &unused);
}

}  // namespace tessera::compression

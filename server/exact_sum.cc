#include "server/exact_sum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/compression/two_bit_kernels.h"
#include "common/status_macros.h"
#include "server/round_kernels.h"

namespace tessera {
namespace {

constexpr int kLimbs = 5;
constexpr uint64_t kBlock = 64;

// Adds (negative: subtracts) m * 2^shift to the two's complement `limb`.
void AddShifted(uint64_t* limb, uint64_t m, int shift, bool negative) {
  const int idx = shift / 64;
  const int off = shift % 64;
  uint64_t part[kLimbs] = {0, 0, 0, 0, 0};
  part[idx] = m << off;
  if (off != 0 && idx + 1 < kLimbs) part[idx + 1] = m >> (64 - off);
  if (!negative) {
    unsigned __int128 carry = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const unsigned __int128 s =
          static_cast<unsigned __int128>(limb[i]) + part[i] + carry;
      limb[i] = static_cast<uint64_t>(s);
      carry = s >> 64;
    }
  } else {
    uint64_t borrow = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const uint64_t a = limb[i];
      const uint64_t d = a - part[i] - borrow;
      borrow = (a < part[i]) || (a - part[i] < borrow) ? 1 : 0;
      limb[i] = d;
    }
  }
}

// The 2-bit code of each slot of a payload byte as an int32 (+1, -1, 0), in
// element order.
struct CodeTable {
  int32_t code[256][4];
  CodeTable() {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      float v[4];
      compression::kernels::DequantizeByte(byte, 4, 1.0f, -1.0f, v);
      for (int k = 0; k < 4; ++k) code[byte][k] = static_cast<int32_t>(v[k]);
    }
  }
};
const CodeTable& Codes() {
  static const CodeTable* table = new CodeTable;
  return *table;
}

}  // namespace

void ExactSum::Wide::AddFloat(float v) {
  if (std::isnan(v)) {
    nan = true;
    return;
  }
  if (std::isinf(v)) {
    (v > 0 ? pos_inf : neg_inf) = true;
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t exponent = (bits >> 23) & 0xff;
  const uint32_t fraction = bits & 0x7fffff;
  if (exponent == 0 && fraction == 0) return;  // +-0
  // |v| = m * 2^(shift - 149): a subnormal is fraction * 2^-149.
  const uint64_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
  const int shift = exponent == 0 ? 0 : static_cast<int>(exponent) - 1;
  AddShifted(limb, m, shift, (bits >> 31) != 0);
}

void ExactSum::Wide::AddDouble(double d) {
  if (d == 0) return;
  int e = 0;
  const double f = std::frexp(std::fabs(d), &e);          // |d| = f * 2^e
  uint64_t m = static_cast<uint64_t>(std::ldexp(f, 53));  // exact
  int shift = e - 53 + 149;                               // in units of 2^-149
  if (shift < 0) {
    m >>= -shift;  // exact: d is a multiple of 2^-149
    shift = 0;
  }
  AddShifted(limb, m, shift, d < 0);
}

float ExactSum::Wide::Round() const {
  if (nan || (pos_inf && neg_inf))
    return std::numeric_limits<float>::quiet_NaN();
  if (pos_inf) return std::numeric_limits<float>::infinity();
  if (neg_inf) return -std::numeric_limits<float>::infinity();
  const bool negative = (limb[kLimbs - 1] >> 63) != 0;
  uint64_t mag[kLimbs];
  std::memcpy(mag, limb, sizeof(mag));
  if (negative) {  // two's complement negation
    uint64_t carry = 1;
    for (int i = 0; i < kLimbs; ++i) {
      mag[i] = ~mag[i] + carry;
      carry = (carry != 0 && mag[i] == 0) ? 1 : 0;
    }
  }
  int top = -1;  // highest set bit
  for (int i = kLimbs - 1; i >= 0 && top < 0; --i) {
    if (mag[i] != 0) top = 64 * i + 63 - __builtin_clzll(mag[i]);
  }
  if (top < 0) return 0.0f;
  auto bit = [&mag](int pos) -> uint64_t {
    return pos < 0 ? 0 : (mag[pos / 64] >> (pos % 64)) & 1;
  };
  float magnitude;
  if (top < 24) {
    // Below 2^-125: exactly a float (subnormal, or the smallest normals).
    magnitude = std::ldexp(static_cast<float>(mag[0]), -149);
  } else {
    // 24 significant bits, then round to nearest, ties to even.
    uint64_t keep = 0;
    for (int pos = top; pos > top - 24; --pos) keep = (keep << 1) | bit(pos);
    const uint64_t guard = bit(top - 24);
    bool sticky = false;
    for (int pos = top - 25; pos >= 0 && !sticky; --pos) {
      if (pos % 64 == 63 && mag[pos / 64] == 0) {
        pos -= 63;  // a whole zero limb
        continue;
      }
      sticky = bit(pos) != 0;
    }
    int exponent = top - 23 - 149;
    if (guard && (sticky || (keep & 1))) {
      if (++keep == (uint64_t{1} << 24)) {
        keep >>= 1;
        ++exponent;
      }
    }
    // Exact in double; the cast is exact, or infinity past the float range.
    magnitude =
        static_cast<float>(std::ldexp(static_cast<double>(keep), exponent));
  }
  return negative ? -magnitude : magnitude;
}

template <typename T>
void ExactSum::Array<T>::Allocate(uint64_t n) {
  if (n * sizeof(T) > buf_.size()) buf_ = Buffer::Allocate(n * sizeof(T));
  size_ = n;
}

template <typename T>
void ExactSum::Array<T>::Assign(uint64_t n, T fill) {
  Allocate(n);
  std::fill(data(), data() + n, fill);
}

template <typename T>
void ExactSum::Array<T>::Resize(uint64_t n, T fill) {
  if (n * sizeof(T) > buf_.size()) {
    // Grows by half at least, so a sparse sum growing row by row copies each
    // value a few times, not once per row.
    const uint64_t grown = std::max(n, size_ + size_ / 2);
    Buffer bigger = Buffer::Allocate(grown * sizeof(T));
    if (size_ != 0)
      std::memcpy(bigger.mutable_data(), buf_.data(), size_ * sizeof(T));
    buf_ = std::move(bigger);
  }
  if (n > size_) std::fill(data() + size_, data() + n, fill);
  size_ = n;
}

ExactSum::ExactSum(uint64_t length) : length_(length) {}

void ExactSum::StartDoubles(bool fill) {
  // -0 is addition's identity (-0 + -0 = -0, -0 + x = x): a sum of -0s stays
  // -0, as the rule for zeros says, where +0 would make it +0.
  if (fill) {
    acc_.Assign(length_, -0.0);
  } else {
    acc_.Allocate(length_);
  }
  lo_.Release();
  counts_.Release();  // the last Finish's floats, if it counted
  wide_bits_.assign((length_ + kBlock - 1) / kBlock, 0);
  mode_ = Mode::kDoubles;
}

void ExactSum::StartCounts(float threshold) {
  counts_.Assign(length_, 0);
  acc_.Release();  // the last Finish's floats, if it added doubles
  count_threshold_ = threshold;
  mode_ = Mode::kCounts;
}

void ExactSum::CountsToDoubles() {
  acc_.Allocate(length_);
  lo_.Release();
  const double t = count_threshold_;
  const int32_t* c = counts_.data();
  double* a = acc_.data();
  for (uint64_t i = 0; i < length_; ++i) a[i] = static_cast<double>(c[i]) * t;
  counts_.Release();
  wide_bits_.assign((length_ + kBlock - 1) / kBlock, 0);
  mode_ = Mode::kDoubles;
}

void ExactSum::Grow(uint64_t length) {
  length_ = length;
  if (mode_ == Mode::kDoubles) {
    acc_.Resize(length, -0.0);
    if (!lo_.empty()) lo_.Resize(length, 0.0);
    wide_bits_.resize((length + kBlock - 1) / kBlock, 0);
  } else if (mode_ == Mode::kCounts) {
    counts_.Resize(length, 0);
  }
}

void ExactSum::AddAt(uint64_t begin, const float* values, uint64_t count) {
  if (mode_ == Mode::kEmpty) StartDoubles();
  if (mode_ == Mode::kCounts) CountsToDoubles();
  const uint64_t end = begin + count;
  for (uint64_t at = begin; at < end;) {
    const uint64_t block_end = std::min(end, (at / kBlock + 1) * kBlock);
    AddRange(at, block_end, values + (at - begin));
    at = block_end;
  }
}

void ExactSum::AddCodes(uint64_t begin, const uint8_t* in, uint64_t first,
                        uint64_t count, bool set) {
  constexpr uint64_t kWord = compression::kTwoBitElementsPerWord;
  const CodeTable& table = Codes();
  int32_t* c = counts_.data() + begin;
  // `set`: the counts are written, not added to (the round's first push over
  // counts not zeroed).
  auto one = [&](uint64_t j) {
    const uint64_t v = first + j;
    const int32_t code = table.code[in[v / 4]][v % 4];
    c[j] = set ? code : c[j] + code;
  };
  uint64_t j = 0;
  // Values before the first whole payload word, one at a time.
  for (; j < count && (first + j) % kWord != 0; ++j) one(j);
  // Whole words: sixteen counts each.
  const uint64_t words = (count - j) / kWord;
  if (set) {
    round_kernels::SetCodeWords(c + j, in + (first + j) / 4, words);
  } else {
    round_kernels::AddCodeWords(c + j, in + (first + j) / 4, words);
  }
  for (j += kWord * words; j < count; ++j) one(j);
}

void ExactSum::AddTwoBitAt(uint64_t begin, const uint8_t* in, uint64_t first,
                           uint64_t count, float threshold) {
  if (mode_ == Mode::kEmpty && begin == 0 && count == length_) {
    // The round's first push covers every value: its codes are the counts
    // (no pass to zero them first).
    counts_.Allocate(length_);
    acc_.Release();  // the last Finish's floats, if it added doubles
    count_threshold_ = threshold;
    mode_ = Mode::kCounts;
    AddCodes(0, in, first, count, /*set=*/true);
    return;
  }
  if (mode_ == Mode::kEmpty) StartCounts(threshold);
  if (mode_ == Mode::kCounts && threshold == count_threshold_) {
    AddCodes(begin, in, first, count);
    return;
  }
  if (mode_ == Mode::kCounts) CountsToDoubles();
  // Another threshold: decoded a block at a time and added as floats.
  const CodeTable& table = Codes();
  float decoded[kBlock];
  for (uint64_t at = 0; at < count; at += kBlock) {
    const uint64_t n = std::min<uint64_t>(kBlock, count - at);
    for (uint64_t j = 0; j < n; ++j) {
      const uint64_t v = first + at + j;
      decoded[j] = static_cast<float>(table.code[in[v / 4]][v % 4]) * threshold;
    }
    AddAt(begin + at, decoded, n);
  }
}

void ExactSum::AddSlow(uint64_t i, float v) {
  double* a = acc_.data();
  if (std::isfinite(v)) {
    // hi + v = s + e exactly (TwoSum); the rest e joins lo if that is exact.
    if (lo_.empty()) lo_.Assign(length_, 0.0);
    if (round_kernels::PairAdd(a + i, lo_.data() + i, v)) return;
  }
  Wide& w = wide_[i];
  w.AddDouble(a[i]);
  if (!lo_.empty()) w.AddDouble(lo_.data()[i]);
  wide_bits_[i / kBlock] |= uint64_t{1} << (i % kBlock);
  w.AddFloat(v);
}

void ExactSum::AddFloats(const float* v) {
  if (mode_ == Mode::kCounts) CountsToDoubles();
  if (mode_ == Mode::kEmpty) {
    StartDoubles(/*fill=*/false);
    double* a = acc_.data();
    for (uint64_t i = 0; i < length_; ++i) {
      if (std::isfinite(v[i])) {
        a[i] = v[i];
      } else {
        a[i] = 0;
        AddSlow(i, v[i]);  // to wide_: not finite
      }
    }
    return;
  }
  for (uint64_t begin = 0; begin < length_; begin += kBlock)
    AddRange(begin, std::min(begin + kBlock, length_), v + begin);
}

void ExactSum::AddRange(uint64_t begin, uint64_t end, const float* v) {
  double* a = acc_.data();
  if (wide_bits_[begin / kBlock] == 0) {
    uint8_t rounded[kBlock];
    const bool any =
        lo_.empty()
            ? round_kernels::AddExactly(a + begin, v, rounded, end - begin)
            : round_kernels::AddPairExactly(a + begin, lo_.data() + begin, v,
                                            rounded, end - begin);
    if (!any) return;
    // The additions that would have rounded (or, with pairs, whose rest did
    // not fit) were not made: those elements take the slow path.
    for (uint64_t i = begin; i < end; ++i) {
      if (rounded[i - begin]) AddSlow(i, v[i - begin]);
    }
    return;
  }
  for (uint64_t i = begin; i < end; ++i) {
    const float y = v[i - begin];
    if (IsWide(i)) {
      wide_[i].AddFloat(y);
      continue;
    }
    if (!round_kernels::ExactAdd(a + i, y)) AddSlow(i, y);
  }
}

void ExactSum::AddCounts(const int8_t* in, float threshold) {
  if (mode_ == Mode::kEmpty) StartCounts(threshold);
  if (mode_ == Mode::kCounts && threshold == count_threshold_) {
    int32_t* c = counts_.data();
    for (uint64_t i = 0; i < length_; ++i) c[i] += in[i];
    return;
  }
  if (mode_ == Mode::kCounts) CountsToDoubles();
  // Another threshold (not seen in one round of a job): each count added as
  // that many +-threshold floats, a block and one unit of |count| at a time.
  float decoded[kBlock];
  for (uint64_t at = 0; at < length_; at += kBlock) {
    const uint64_t n = std::min<uint64_t>(kBlock, length_ - at);
    for (int unit = 1; unit <= 128; ++unit) {
      bool any = false;
      for (uint64_t j = 0; j < n; ++j) {
        const int c = in[at + j];
        const int size = c < 0 ? -c : c;
        decoded[j] = size >= unit ? (c < 0 ? -threshold : threshold) : 0.0f;
        any = any || size >= unit;
      }
      if (!any) break;
      AddAt(at, decoded, n);
    }
  }
}

absl::Status ExactSum::AddTwoBit(const uint8_t* in, size_t in_bytes,
                                 float threshold) {
  TESSERA_RETURN_IF_ERROR(
      compression::TwoBitValidate(in, in_bytes, length_, threshold));
  AddTwoBitAt(0, in, 0, length_, threshold);
  return absl::OkStatus();
}

namespace {

// The float32 nearest hi + lo (ties to even), or false when a neighbour of
// the result is not finite (the caller rounds exactly instead).
bool RoundPair(double hi, double lo, float* out) {
  // The same value as s + e with |e| <= half an ulp of s (TwoSum).
  double s;
  const double e = round_kernels::TwoSum(hi, lo, &s);
  const float r = static_cast<float>(s);
  if (e == 0.0 || static_cast<double>(r) == s) {
    // s is the value, or a float32 itself: e is far below half a float ulp.
    // s == 0 means hi == -lo: an exact zero, +0.
    *out = s == 0.0 ? 0.0f : r;
    return true;
  }
  if (!std::isfinite(r)) return false;
  const float other =
      std::nextafter(r, s > r ? std::numeric_limits<float>::infinity()
                              : -std::numeric_limits<float>::infinity());
  if (!std::isfinite(other)) return false;
  // Between two floats; e can only matter when s is their midpoint (a
  // double: 25 significant bits), where it says which side the value is on.
  const double mid =
      0.5 * (static_cast<double>(r) + static_cast<double>(other));
  if (s != mid) {
    *out = r;
    return true;
  }
  *out = e > 0 ? std::max(r, other) : std::min(r, other);
  return true;
}

}  // namespace

float ExactSum::RoundElement(uint64_t i) const {
  if (IsWide(i)) return wide_.at(i).Round();
  const double hi = acc_.data()[i];
  const double lo = lo_.empty() ? 0.0 : lo_.data()[i];
  if (lo == 0.0) return static_cast<float>(hi);
  float r;
  if (RoundPair(hi, lo, &r)) return r;
  Wide w;
  w.AddDouble(hi);
  w.AddDouble(lo);
  return w.Round();
}

size_t ExactSum::pair_elements() const {
  if (mode_ != Mode::kDoubles || lo_.empty()) return 0;
  size_t n = 0;
  for (uint64_t i = 0; i < length_; ++i)
    n += lo_.data()[i] != 0.0 && !IsWide(i);
  return n;
}

bool ExactSum::PackCounts(int8_t* out, float* threshold) const {
  if (mode_ != Mode::kCounts) return false;
  const int32_t* c = counts_.data();
  int32_t lo = 0, hi = 0;
  for (uint64_t i = 0; i < length_; ++i) {
    lo = std::min(lo, c[i]);
    hi = std::max(hi, c[i]);
    out[i] = static_cast<int8_t>(c[i]);
  }
  *threshold = count_threshold_;
  return lo >= -127 && hi <= 127;
}

const float* ExactSum::Finish() {
  float* out;
  if (mode_ == Mode::kEmpty) {
    counts_.Assign(length_, 0);  // int32 0 has the bits of +0.0f
    out = reinterpret_cast<float*>(counts_.data());
  } else if (mode_ == Mode::kCounts) {
    // In place: float i over count i.
    out = reinterpret_cast<float*>(counts_.data());
    round_kernels::CountsToFloats(counts_.data(), length_, count_threshold_,
                                  out);
  } else {
    unsigned char* bytes = reinterpret_cast<unsigned char*>(acc_.data());
    out = reinterpret_cast<float*>(bytes);
    float block[kBlock];
    for (uint64_t begin = 0; begin < length_; begin += kBlock) {
      const uint64_t n = std::min(kBlock, length_ - begin);
      const double* a = acc_.data() + begin;
      if (wide_bits_[begin / kBlock] == 0 && lo_.empty()) {
        for (uint64_t j = 0; j < n; ++j) block[j] = static_cast<float>(a[j]);
      } else {
        for (uint64_t j = 0; j < n; ++j) block[j] = RoundElement(begin + j);
      }
      // Front to back: block b's floats land on bytes blocks before it (or
      // itself, read above) held.
      std::memcpy(bytes + begin * sizeof(float), block, n * sizeof(float));
    }
    wide_.clear();
    std::fill(wide_bits_.begin(), wide_bits_.end(), 0);
    lo_.Release();
  }
  mode_ = Mode::kEmpty;
  return out;
}

void ExactSum::Release() {
  acc_.Release();
  lo_.Release();
  counts_.Release();
  std::vector<uint64_t>().swap(wide_bits_);
  absl::flat_hash_map<uint64_t, Wide>().swap(wide_);
  mode_ = Mode::kEmpty;
}

}  // namespace tessera

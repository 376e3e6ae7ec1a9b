// ExactSum: adds float32 vectors element by element and gives each element's
// exact sum rounded once to float32 (round to nearest, ties to even). The
// result is therefore the same bits whatever order the vectors are added in,
// with memory that does not grow with their number.
//
//   ExactSum sum(n);
//   sum.AddFloats(push_of_rank_2);                 // in any order
//   TESSERA_RETURN_IF_ERROR(sum.AddTwoBit(bytes, size, 0.5f));  // decoded straight in
//   const float* result = sum.Finish();            // n floats; a new sum starts
//
// How: each element accumulates in a double (8 bytes: twice the float32 data).
// A double holds a sum of float32 values exactly as long as the sum needs at
// most 53 significant bits, i.e. while the values added to one element stay
// within about 2^29 of each other in magnitude; every addition is checked
// (Knuth's TwoSum). An element whose next addition would round keeps the
// exact rest in a second double (a pair hi + lo, exact while the sum fits two
// runs of 53 bits: values within about 2^82 of each other); the second
// doubles are allocated for the whole sum the first time one is needed.
// Only an element whose rest does not fit the second double either moves to
// an exact 320-bit fixed-point accumulator (LSB 2^-149, the smallest float32)
// kept aside for it. All three hold the exact sum, so the final rounding gives
// the correctly rounded result whichever an element used (which can depend
// on order, and cannot show in the result).
//
// 2-bit pushes are counted, not added: every value of a payload with threshold
// t is +t, -t or 0, so while a sum has had only 2-bit pushes of one threshold
// each element's exact sum is c x t for an integer c, kept as an int32 (4
// bytes per element, half the double), and Finish rounds c x t once (exact in
// a double while |c| <= 2^29, t having 24 significant bits: a count moves by
// one per push naming the element, so that is half a billion pushes in one
// round). A float push or another threshold
// turns the counts into doubles, exactly, and the sum goes on as above.
// Special values: a NaN among the inputs, or both infinities, make the element
// NaN (one quiet NaN); one infinity wins over finite values. An element whose
// exact sum is zero is +0 unless every input was -0.
//
// Memory: 4 bytes per element while counting, 8 once doubles are used, 16
// once an element needed the pair, plus about 80 bytes per element that left
// the pair (values more than about 2^82 apart). Release() gives it all back
// (to Buffer's pool, where the next sum of that size finds it without page
// faults), so a server holds accumulators only for its open rounds.
//
// Thread-safety: none; one thread at a time.
#ifndef TESSERA_SERVER_EXACT_SUM_H_
#define TESSERA_SERVER_EXACT_SUM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/buffer.h"

namespace tessera {

class ExactSum {
 public:
  explicit ExactSum(uint64_t length);
  ExactSum(const ExactSum&) = delete;
  ExactSum& operator=(const ExactSum&) = delete;

  uint64_t length() const { return length_; }

  // Sparse use (the rows of a row-sparse key): grows the sum to `length`
  // values, the new ones zero. REQUIRES: length >= length().
  void Grow(uint64_t length);
  // Adds count values to elements [begin, begin + count). REQUIRES: a Grow
  // since the last Finish covered them.
  void AddAt(uint64_t begin, const float* values, uint64_t count);
  // Adds values [first, first + count) of a 2-bit payload (`in`, threshold
  // `threshold`) to elements [begin, begin + count). REQUIRES: the payload
  // was validated (compression::TwoBitValidate) and threshold > 0, finite.
  void AddTwoBitAt(uint64_t begin, const uint8_t* in, uint64_t first,
                   uint64_t count, float threshold);

  // Adds `values` (length floats).
  void AddFloats(const float* values);
  // Adds a 2-bit payload (MXNet's format, `threshold`) of length values,
  // decoded straight into the sum. Validated first: DataLoss (wrong size, a
  // code 0b01, a padding bit set) or InvalidArgument (threshold) and nothing
  // added.
  absl::Status AddTwoBit(const uint8_t* in, size_t in_bytes, float threshold);
  // Adds length counts of `threshold`s (a local group's sum of 2-bit codes,
  // docs/local_groups.md): value i is in[i] x threshold, exactly. REQUIRES:
  // threshold > 0, finite.
  void AddCounts(const int8_t* in, float threshold);

  // The sums, correctly rounded to float32, written over the accumulator's
  // own memory: valid until the next Add or Release. A new, empty sum starts
  // (zeros when nothing was added).
  const float* Finish();
  // Gives the memory back; the next Add allocates again (length() is kept).
  // Invalidates what Finish returned.
  void Release();

  // Elements that left the pair in the current sum (for tests and logs).
  size_t wide_elements() const { return wide_.size(); }
  // Elements holding a rest in the second double (tests; a scan).
  size_t pair_elements() const;
  // Whether the current sum is still counting 2-bit codes (tests).
  bool counting() const { return mode_ == Mode::kCounts; }
  // While counting (before Finish): the counts as int8 into `out` (length
  // values) and the threshold they count, when every count is within
  // -127..127. False otherwise (out is then unspecified). Finish turns the
  // same counts into the same floats as round_kernels::CountsToFloats of
  // them widened to int32 (a replicated update, server/replication.h).
  bool PackCounts(int8_t* out, float* threshold) const;
  // Bytes held: doubles, pairs and counts, and the exact accumulators.
  uint64_t bytes() const {
    return acc_.capacity_bytes() + lo_.capacity_bytes() +
           counts_.capacity_bytes() + wide_bits_.capacity() * sizeof(uint64_t) +
           wide_.capacity() * (sizeof(uint64_t) + sizeof(Wide) + 1);
  }

  // An exact accumulator for one element: two's complement fixed point with
  // its least significant bit worth 2^-149, wide enough for 2^40 float32
  // values of any magnitude; NaN and infinities are flags.
  struct Wide {
    uint64_t limb[5] = {0, 0, 0, 0, 0};  // little-endian
    bool nan = false;
    bool pos_inf = false;
    bool neg_inf = false;
    void AddFloat(float v);
    // REQUIRES: `d` is a sum of float32 values (a multiple of 2^-149).
    void AddDouble(double d);
    float Round() const;
  };

 private:
  // A growable array in memory from Buffer's pool (large ones are reused from
  // earlier sums, not faulted in page by page).
  template <typename T>
  class Array {
   public:
    T* data() { return reinterpret_cast<T*>(buf_.mutable_data()); }
    const T* data() const { return reinterpret_cast<const T*>(buf_.data()); }
    bool empty() const { return size_ == 0; }
    uint64_t capacity_bytes() const { return buf_.size(); }
    // n elements, all `fill`.
    void Assign(uint64_t n, T fill);
    // n elements, not initialised.
    void Allocate(uint64_t n);
    // n elements: the first min(n, old size) kept, the rest `fill`.
    void Resize(uint64_t n, T fill);
    void Release() {
      buf_ = Buffer();
      size_ = 0;
    }

   private:
    Buffer buf_;
    uint64_t size_ = 0;
  };

  enum class Mode {
    kEmpty,   // nothing added since the last Finish
    kCounts,  // counts_ x count_threshold_ (2-bit pushes of one threshold)
    kDoubles  // acc_ (+ lo_), and wide_ for the elements that left them
  };
  // The doubles start as -0, or (fill false) uninitialised for the caller
  // to write every one.
  void StartDoubles(bool fill = true);
  void StartCounts(float threshold);
  // Turns the counts into doubles, exactly.
  void CountsToDoubles();
  // counts_[begin + j] += code of payload value first + j, j < count (with
  // `set`: = code).
  void AddCodes(uint64_t begin, const uint8_t* in, uint64_t first,
                uint64_t count, bool set = false);
  // Element i's next addition does not fit its double: the rest goes to the
  // pair, or the element moves to wide_.
  void AddSlow(uint64_t i, float v);
  // Adds v[0..end-begin) to elements [begin, end) of one block.
  void AddRange(uint64_t begin, uint64_t end, const float* v);
  // Element i's exact sum, rounded. REQUIRES: mode_ == kDoubles.
  float RoundElement(uint64_t i) const;
  bool IsWide(uint64_t i) const { return (wide_bits_[i / 64] >> (i % 64)) & 1; }

  uint64_t length_;
  Mode mode_ = Mode::kEmpty;
  Array<double> acc_;      // doubles (hi), or (after Finish) floats
  Array<double> lo_;       // the pairs' second doubles; empty until needed
  Array<int32_t> counts_;  // counts, or (after Finish) floats
  float count_threshold_ = 0;
  std::vector<uint64_t> wide_bits_;  // element i has left the pair
  absl::flat_hash_map<uint64_t, Wide> wide_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_EXACT_SUM_H_

// HashedSpec: what a hashed row key does with ids it has not seen (issue #29),
// parsed from the text users give (C: tessera_kv_init_hashed's options,
// Python: init_hashed's keywords, which build it), and carried to the servers
// in the key's init.
//
//   absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(
//       "init=normal mean=0 std=0.01 seed=7 admit_after=2 expire_after=1000 "
//       "capacity=1000000");
//
// Fields (every one optional; unknown names and bad values are
// InvalidArgument naming them and what was expected):
//   init=zeros | uniform | normal   the row an id starts with (zeros)
//   low=, high=                     uniform's bounds (-0.05, 0.05)
//   mean=, std=                     normal's parameters (0, 0.01)
//   seed=N                          the initializer's seed (0)
//   admit_after=N                   pushes naming an id before it gets a row
//                                   (1: at once); counted in a sketch
//   expire_after=N                  rounds without a push after which a row is
//                                   evicted (0: never)
//   capacity=N                      rows a server holds for the key at most
//                                   (0: no bound)
//
// An id's initial row is a function of (seed, id, column) alone: the same on
// every server and in every run of the same build (InitialValue; normal's
// Box-Muller goes through libm's log and cos).
#ifndef TESSERA_COMMON_HASHED_SPEC_H_
#define TESSERA_COMMON_HASHED_SPEC_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tessera {

struct HashedSpec {
  enum class Init { kZeros, kUniform, kNormal };
  Init init = Init::kZeros;
  float low = -0.05f, high = 0.05f;   // uniform
  float mean = 0.0f, stddev = 0.01f;  // normal
  uint64_t seed = 0;
  uint64_t admit_after = 1;
  uint64_t expire_after = 0;
  uint64_t capacity = 0;

  static absl::StatusOr<HashedSpec> Parse(const std::string& text);
  // The canonical text: Parse(ToString()) gives the same spec.
  std::string ToString() const;

  // Value `column` of id's initial row.
  float InitialValue(uint64_t id, uint64_t column) const;
};

// The server of `num_servers` that holds hashed id `id`: SplitMix64 (one whole
// step, split_mix.h) of the id XORed with 0x2545f4914f6cdd1d, modulo
// `num_servers`. Ids spread evenly whatever their values.
int HashedServerOf(uint64_t id, int num_servers);

}  // namespace tessera

#endif  // TESSERA_COMMON_HASHED_SPEC_H_

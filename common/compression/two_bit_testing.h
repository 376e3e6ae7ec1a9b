// Test-only hooks of the CPU 2-bit codec (two_bit.h); not for production code.
//
// The codec picks an AVX2 loop at run time when the CPU has it and otherwise
// runs the baseline (SSE2 or scalar) loop. Tests force the baseline to check
// both paths against the same reference on one machine:
//
//   ForceBaselineSimdForTesting(true);
//   ...run the same checks...
//   ForceBaselineSimdForTesting(false);
#ifndef TESSERA_COMMON_COMPRESSION_TWO_BIT_TESTING_H_
#define TESSERA_COMMON_COMPRESSION_TWO_BIT_TESTING_H_

namespace tessera::compression {

// While `force` is true, every codec call in the process uses the baseline
// loop. Thread-safe (an atomic flag), but meant to be flipped between tests
// only.
void ForceBaselineSimdForTesting(bool force);

// Whether codec calls made now would take the AVX2 loop.
bool TwoBitUsesAvx2ForTesting();

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_TWO_BIT_TESTING_H_

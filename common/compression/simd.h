// Which loops the CPU code of the 2-bit codec and of the server's rounds
// (server/round_kernels.h) takes: the AVX2 ones when the CPU has AVX2 and no
// test forced the baseline (two_bit_testing.h, ForceBaselineSimdForTesting).
#ifndef TESSERA_COMMON_COMPRESSION_SIMD_H_
#define TESSERA_COMMON_COMPRESSION_SIMD_H_

namespace tessera::compression {

// True when AVX2 loops may run now (an atomic read; cheap enough per call of
// a loop over many values, not per value).
bool UseAvx2Loops();

}  // namespace tessera::compression

#endif  // TESSERA_COMMON_COMPRESSION_SIMD_H_

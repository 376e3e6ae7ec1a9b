// BlasCore: makes sure the CPU trainer's OpenBLAS runs kernels this CPU can
// run well, and computes right with them.
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels when it loads,
// by the CPU's family and model. A CPU newer than the library knows gets its
// generic fallback: Debian 12's OpenBLAS 0.3.21 runs "Prescott" (SSE3)
// kernels on a family 6, model 207 Xeon that has AVX-512, and the trainer's
// compute took 4.55 s there instead of 1.16 s with OPENBLAS_CORETYPE=SkylakeX
// (issue #27). OpenBLAS reads OPENBLAS_CORETYPE only when it loads, so when
// the library chose a core below what the CPU's features allow, the program
// sets it and starts itself again; the new process checks the kernels against
// a reference product and, should they compute wrong results on this CPU,
// goes back to the library's own choice. Each outcome is one line on stderr.
//
//   int main(int argc, char** argv) {
//     ChooseBlasKernels("tessera-worker", argv);   // may not return (exec)
//     ...
//
// Left alone: a user's OPENBLAS_CORETYPE, and TESSERA_BLAS_AUTO=0.
//
// Thread-safety: call ChooseBlasKernels from main before any thread starts.
#ifndef TESSERA_WORKER_TRAINER_BLAS_CORE_H_
#define TESSERA_WORKER_TRAINER_BLAS_CORE_H_

#include <string>

#include "absl/strings/string_view.h"

namespace tessera {

// What the CPU can run, as far as the choice of kernels goes.
struct CpuFeatures {
  bool avx2_fma = false;  // AVX2 and FMA3: Haswell's kernels
  bool avx512 = false;    // AVX-512 F, BW, DQ and VL: SkylakeX's kernels
};
CpuFeatures DetectCpuFeatures();

// The OPENBLAS_CORETYPE to use instead of `corename` (what
// openblas_get_corename() says the library chose), or "" when `corename`
// already uses what `cpu` has (or is not an x86 core this knows).
std::string BetterCoreType(absl::string_view corename, const CpuFeatures& cpu);

// Checks cblas_sgemm against a double-precision reference product of odd
// sizes (every kernel's edge paths) in both transposes the trainer uses.
// Returns the largest error relative to the product's magnitude; a right
// kernel stays below about 1e-6.
double SgemmError();

// The name of the kernels the loaded OpenBLAS uses.
std::string BlasCoreName();

// Run first in main (argv as main got it; `program` names the lines). May
// replace the process (execv of /proc/self/exe) to load OpenBLAS again with
// better kernels; returns when nothing is to be changed, or after it was.
void ChooseBlasKernels(const char* program, char** argv);

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_BLAS_CORE_H_

// Facts about the running process, for logs, benchmarks and metrics.
//
//   TESSERA_LOG(INFO) << "peak RSS " << PeakResidentBytes() / (1 << 20) << " MB";
#ifndef TESSERA_COMMON_PROCESS_INFO_H_
#define TESSERA_COMMON_PROCESS_INFO_H_

#include <cstdint>

namespace tessera {

// Resident set size now, and its peak so far (VmRSS and VmHWM of
// /proc/self/status), in bytes; 0 where /proc cannot be read.
uint64_t ResidentBytes();
uint64_t PeakResidentBytes();

}  // namespace tessera

#endif  // TESSERA_COMMON_PROCESS_INFO_H_

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

// When the process started, in seconds since the Unix epoch (field 22 of
// /proc/self/stat after the boot time of /proc/stat); 0 where /proc cannot be
// read.
double ProcessStartTimeSeconds();

}  // namespace tessera

#endif  // TESSERA_COMMON_PROCESS_INFO_H_

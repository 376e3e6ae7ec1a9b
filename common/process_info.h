// Facts about the running process, for logs, benchmarks and metrics.
//
//   TESSERA_LOG(INFO) << "peak RSS " << PeakResidentBytes() / (1 << 20) << " MB";
#ifndef TESSERA_COMMON_PROCESS_INFO_H_
#define TESSERA_COMMON_PROCESS_INFO_H_

#include <cstdint>
#include <string>

namespace tessera {

// Resident set size now, and its peak so far (VmRSS and VmHWM of
// /proc/self/status), in bytes; 0 where /proc cannot be read.
uint64_t ResidentBytes();
uint64_t PeakResidentBytes();

// When the process started, in seconds since the Unix epoch (field 22 of
// /proc/self/stat after the boot time of /proc/stat); 0 where /proc cannot be
// read.
double ProcessStartTimeSeconds();

// Where this process can share memory with others (host-local aggregation,
// docs/local_groups.md): the kernel's boot id and the device and inode of
// /dev/shm, "boot-id/dev:inode". Two processes with the same advertised host
// and the same key see the same POSIX shared memory. Empty when either
// cannot be read.
std::string SharedMemoryPlace();

}  // namespace tessera

#endif  // TESSERA_COMMON_PROCESS_INFO_H_

#include "common/process_info.h"

#include <cstdio>
#include <cstring>

namespace tessera {
namespace {

// The value of a "Name:   1234 kB" line of /proc/self/status, in bytes.
uint64_t StatusBytes(const char* name) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  const size_t len = std::strlen(name);
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, name, len) == 0 && line[len] == ':') {
      unsigned long long v = 0;
      if (std::sscanf(line + len + 1, "%llu", &v) == 1) kb = v;
      break;
    }
  }
  std::fclose(f);
  return kb * 1024;
}

}  // namespace

uint64_t ResidentBytes() { return StatusBytes("VmRSS"); }
uint64_t PeakResidentBytes() { return StatusBytes("VmHWM"); }

}  // namespace tessera

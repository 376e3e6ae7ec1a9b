#include "common/process_info.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

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

double ProcessStartTimeSeconds() {
  unsigned long long boot = 0;
  if (FILE* f = std::fopen("/proc/stat", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "btime %llu", &boot) == 1) break;
    }
    std::fclose(f);
  }
  FILE* f = std::fopen("/proc/self/stat", "r");
  if (f == nullptr || boot == 0) {
    if (f != nullptr) std::fclose(f);
    return 0;
  }
  char buf[1024] = {0};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // The command name (field 2) may hold spaces: count fields after its ')'.
  const std::string stat(buf, n);
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  unsigned long long ticks = 0;
  // After ')': field 3 (state) onwards; starttime is field 22.
  const char* p = stat.c_str() + paren + 1;
  for (int field = 3; field < 22 && *p != '\0'; ++field) {
    while (*p == ' ') ++p;
    while (*p != ' ' && *p != '\0') ++p;
  }
  if (std::sscanf(p, " %llu", &ticks) != 1) return 0;
  const long hz = sysconf(_SC_CLK_TCK);
  if (hz <= 0) return 0;
  return static_cast<double>(boot) + static_cast<double>(ticks) / hz;
}

std::string SharedMemoryPlace() {
  char boot[64] = {0};
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f == nullptr) return "";
  const bool read = std::fgets(boot, sizeof(boot), f) != nullptr;
  std::fclose(f);
  if (!read) return "";
  std::string id(boot);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  struct stat shm;
  if (id.empty() || stat("/dev/shm", &shm) != 0) return "";
  return id + "/" +
         std::to_string(static_cast<unsigned long long>(shm.st_dev)) + ":" +
         std::to_string(static_cast<unsigned long long>(shm.st_ino));
}

}  // namespace tessera

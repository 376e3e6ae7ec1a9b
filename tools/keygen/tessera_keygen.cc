// tessera-keygen: makes the keys of a job whose daemons are started by hand
// (tools/launch.py makes fresh ones for every job by itself).
//
//   tessera-keygen DIR
//
// writes DIR/scheduler.key, DIR/server.key and DIR/worker.key (mode 0600; DIR
// is created mode 0700 when missing), each holding its role's secret key and
// the three public keys (common/curve_keys.h). Copy each file only to the
// hosts that run that role, and point the daemons at it with
// TESSERA_KEY_FILE=PATH, or TESSERA_KEY_DIR=DIR when the files keep their
// names. Never overwrites a key. Exit codes: 0 written, 1 failed, 2 usage.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/status/statusor.h"
#include "common/curve_keys.h"

int main(int argc, char** argv) {
  if (argc != 2 || argv[1][0] == '-') {
    std::cerr << "usage: tessera-keygen DIR\n"
                 "  writes DIR/scheduler.key, DIR/server.key and "
                 "DIR/worker.key (mode 0600) for a job's daemons\n";
    return 2;
  }
  const std::string dir = argv[1];
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::cerr << "tessera-keygen: cannot create " << dir << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  absl::StatusOr<tessera::JobKeySet> keys = tessera::GenerateJobKeys();
  if (!keys.ok()) {
    std::cerr << "tessera-keygen: " << keys.status().message() << "\n";
    return 1;
  }
  if (absl::Status written = tessera::WriteKeyFiles(*keys, dir);
      !written.ok()) {
    std::cerr << "tessera-keygen: " << written.message() << "\n";
    return 1;
  }
  std::cout << "tessera-keygen: wrote " << dir << "/scheduler.key, " << dir
            << "/server.key and " << dir
            << "/worker.key (mode 0600)\n"
               "Copy each to the hosts of its role only, then start every "
               "daemon with TESSERA_KEY_DIR=<that folder> (or "
               "TESSERA_KEY_FILE=<its file>).\n";
  return 0;
}

// tessera-keygen: makes the keys of a job: the one writer of Tessera key
// files (tools/launch.py runs it for every job it starts; users run it for
// daemons started by hand).
//
//   tessera-keygen DIR
//   tessera-keygen --servers S --workers W DIR
//
// writes DIR/scheduler.key, DIR/server.key and DIR/worker.key (mode 0600; DIR
// is created mode 0700 when missing), each holding its role's secret key and
// the three public keys (common/curve_keys.h). With --servers and --workers,
// also DIR/server-I.key (I in 0..S-1) and DIR/worker-I.key (0..W-1): each
// process's own file, its role's keys plus a key pair of its own, and
// scheduler.key lists every one of those public keys, so that the scheduler
// takes a registration only from a key of the list (a worker's file then
// speaks for that worker only). Copy each file only to the host that runs its
// process (server.key and worker.key to every host of their role when the
// processes have no files of their own), and point the daemons at it with
// TESSERA_KEY_FILE=PATH, or TESSERA_KEY_DIR=DIR when the role files keep
// their names. Never overwrites a key. Exit codes: 0 written, 1 failed, 2
// usage.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/curve_keys.h"

namespace {

constexpr char kUsage[] =
    "usage: tessera-keygen [--servers S --workers W] DIR\n"
    "  writes DIR/scheduler.key, DIR/server.key and DIR/worker.key (mode "
    "0600) for a job's daemons;\n"
    "  with --servers and --workers also DIR/server-I.key and "
    "DIR/worker-I.key, a key of its own\n"
    "  for every process, listed in scheduler.key\n";

struct Flags {
  std::string dir;
  int servers = -1;  // -1: no per-process keys
  int workers = -1;
};

// InvalidArgument naming the flag and what it expects. At most 100,000
// processes of a kind: the scheduler reads key files of up to 16 MiB
// (common/curve_keys.cc), about 290,000 node-key lines.
absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--servers" || arg == "--workers") {
      int* slot = arg == "--servers" ? &flags.servers : &flags.workers;
      if (i + 1 >= argc || !absl::SimpleAtoi(argv[i + 1], slot) || *slot < 0 ||
          *slot > 100000) {
        return absl::InvalidArgumentError(
            absl::StrCat(arg, " '", i + 1 < argc ? argv[i + 1] : "",
                         "': expected a whole number in 0..100000"));
      }
      ++i;
    } else if (!arg.empty() && arg[0] == '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown flag '", arg, "': expected --servers or --workers"));
    } else if (!flags.dir.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "one DIR expected, got '", flags.dir, "' and '", arg, "'"));
    } else {
      flags.dir = arg;
    }
  }
  if (flags.dir.empty())
    return absl::InvalidArgumentError("DIR: expected the folder to write to");
  if ((flags.servers < 0) != (flags.workers < 0)) {
    return absl::InvalidArgumentError(
        "--servers and --workers go together: give both or neither");
  }
  return flags;
}

int Fail(const absl::Status& status) {
  std::cerr << "tessera-keygen: " << status.message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::cerr << "tessera-keygen: " << flags.status().message() << "\n"
              << kUsage;
    return 2;
  }
  const std::string& dir = flags->dir;
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::cerr << "tessera-keygen: cannot create " << dir << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  // An existing folder must be one the daemons will read keys from.
  if (absl::Status folder = tessera::CheckKeyFolder(dir); !folder.ok())
    return Fail(folder);
  absl::StatusOr<tessera::JobKeySet> keys = tessera::GenerateJobKeys();
  if (!keys.ok()) return Fail(keys.status());
  if (flags->servers < 0) {
    if (absl::Status written = tessera::WriteKeyFiles(*keys, dir);
        !written.ok()) {
      return Fail(written);
    }
    std::cout << "tessera-keygen: wrote " << dir << "/scheduler.key, " << dir
              << "/server.key and " << dir
              << "/worker.key (mode 0600)\n"
                 "Copy each to the hosts of its role only, then start every "
                 "daemon with TESSERA_KEY_DIR=<that folder> (or "
                 "TESSERA_KEY_FILE=<its file>).\n";
    return 0;
  }
  absl::StatusOr<tessera::NodeKeyFiles> nodes =
      tessera::GenerateNodeKeyFiles(*keys, flags->servers, flags->workers);
  if (!nodes.ok()) return Fail(nodes.status());
  std::vector<std::pair<std::string, tessera::SecretString>> files = {
      {"scheduler.key", nodes->scheduler},
      {"server.key", tessera::FormatKeyFile(*keys, tessera::Role::kServer)},
      {"worker.key", tessera::FormatKeyFile(*keys, tessera::Role::kWorker)}};
  for (size_t i = 0; i < nodes->servers.size(); ++i)
    files.emplace_back(absl::StrCat("server-", i, ".key"), nodes->servers[i]);
  for (size_t i = 0; i < nodes->workers.size(); ++i)
    files.emplace_back(absl::StrCat("worker-", i, ".key"), nodes->workers[i]);
  for (const auto& [name, text] : files) {
    if (absl::Status written =
            tessera::WritePrivateFile(absl::StrCat(dir, "/", name), text);
        !written.ok()) {
      return Fail(written);
    }
  }
  if (absl::Status synced = tessera::SyncFolder(dir); !synced.ok())
    return Fail(synced);
  std::cout << "tessera-keygen: wrote scheduler.key (listing "
            << nodes->servers.size() + nodes->workers.size()
            << " process keys), server.key, worker.key, "
            << nodes->servers.size() << " server-I.key and "
            << nodes->workers.size() << " worker-I.key into " << dir
            << " (mode 0600)\n"
               "Copy each process's file to its host only, and start it with "
               "TESSERA_KEY_FILE=<its file>.\n";
  return 0;
}

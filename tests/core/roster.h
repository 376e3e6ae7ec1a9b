// Roster: key files as launch.py writes them for a test's ProcessCluster:
// each node's holds its role's keys plus a node key of its own, and the
// scheduler's lists every node key (the roster).
//
//   const Roster nodes(c, {"server 0", "worker 0", "worker 1"});
//   c.Spawn("scheduler", {...}, {{"TESSERA_KEY_FILE", nodes.scheduler_file()}});
//   c.Spawn("server 0", {...}, {{"TESSERA_KEY_FILE", nodes[0].file}});
#ifndef TESSERA_TESTS_CORE_ROSTER_H_
#define TESSERA_TESTS_CORE_ROSTER_H_

#include <sys/stat.h>
#include <zmq.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/curve_keys.h"
#include "gtest/gtest.h"
#include "tests/core/process_cluster.h"

namespace tessera::testing {

class Roster {
 public:
  struct NodeKeys {
    std::string name, role, file;
    CurveKeyPair pair;
  };

  // `names`: "server 0", "worker 1", ... (the role is the first word).
  Roster(ProcessCluster& c, const std::vector<std::string>& names) {
    std::string roster;
    for (const std::string& name : names) {
      NodeKeys n;
      n.name = name;
      n.role = name.substr(0, name.find(' '));
      char pub[41], sec[41];
      EXPECT_EQ(zmq_curve_keypair(pub, sec), 0);
      n.pair.public_key = pub;
      n.pair.secret_key = std::string_view(sec);
      n.file = c.dir() + "/" + n.role + "-" + name.substr(n.role.size() + 1) +
               ".key";
      Write(n.file, Read(c.KeyFile(n.role == "server" ? Role::kServer
                                                      : Role::kWorker)) +
                        "node-secret-key " + n.pair.secret_key + "\n");
      roster += "node-key " + n.role + " " + n.pair.public_key + "\n";
      nodes_.push_back(n);
    }
    scheduler_file_ = c.dir() + "/scheduler-roster.key";
    Write(scheduler_file_, Read(c.KeyFile(Role::kScheduler)) + roster);
  }

  const NodeKeys& operator[](size_t i) const { return nodes_[i]; }
  const std::string& scheduler_file() const { return scheduler_file_; }

 private:
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static void Write(const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
    EXPECT_EQ(chmod(path.c_str(), 0600), 0);
  }

  std::vector<NodeKeys> nodes_;
  std::string scheduler_file_;
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_CORE_ROSTER_H_

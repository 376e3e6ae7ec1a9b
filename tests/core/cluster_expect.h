// Helpers shared by the multi-process tests (cluster_test, fault_test).
#ifndef TESSERA_TESTS_CORE_CLUSTER_EXPECT_H_
#define TESSERA_TESTS_CORE_CLUSTER_EXPECT_H_

#include <cstdint>
#include <regex>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/core/process_cluster.h"

namespace tessera::testing {

// A number from a process's exit summary ("wrong sender 0", "pushes applied
// 24", ...); -1 when the line is missing.
inline int64_t SummaryCount(const std::string& log, const std::string& name) {
  std::smatch m;
  const std::regex re(name + " (\\d+)");
  if (!std::regex_search(log, m, re)) return -1;
  int64_t n = -1;
  (void)absl::SimpleAtoi(m[1].str(), &n);
  return n;
}

// The C-API test worker (tests/core/kv_check_worker.c).
inline const std::string& Worker() {
  static const std::string* path =
      new std::string(BinaryPath("tests/core/kv_check_worker"));
  return *path;
}

// Every process of `c` ends within `bound`, each with exit code 0.
inline void ExpectAllExitZero(ProcessCluster& c, absl::Duration bound) {
  ASSERT_TRUE(c.WaitAll(bound)) << "job did not end within " << bound << "\n"
                                << c.AllLogs();
  for (const Child& child : c.children()) {
    EXPECT_EQ(ProcessCluster::ExitCode(child), 0) << child.name << "\n"
                                                  << c.AllLogs();
  }
}

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_CORE_CLUSTER_EXPECT_H_

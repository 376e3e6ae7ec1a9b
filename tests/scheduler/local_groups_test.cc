// Which workers the scheduler puts in one local group (issue #47): the same
// advertised host and shared-memory place, two or more of them, numbered by
// their smallest rank; nothing for a job that cannot be grouped.
#include "scheduler/local_groups.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

wire::NodeInfo Worker(int rank, const std::string& host,
                      const std::string& place) {
  wire::NodeInfo n;
  n.set_role(wire::WORKER);
  n.set_id(9 + 2 * rank);
  n.set_rank(rank);
  n.set_host(host);
  n.set_local_key(place);
  return n;
}

// (group, local rank, size) of each node.
std::vector<std::vector<uint32_t>> Places(
    const std::vector<wire::NodeInfo>& infos) {
  std::vector<std::vector<uint32_t>> out;
  for (const wire::NodeInfo& n : infos)
    out.push_back({n.local_group(), n.local_rank(), n.local_size()});
  return out;
}

TEST(LocalGroupsTest, WorkersOfOneHostAndPlaceFormAGroupInRankOrder) {
  std::vector<wire::NodeInfo> infos = {
      Worker(0, "10.0.0.2", "boot-b/5:1"), Worker(1, "10.0.0.1", "boot-a/5:1"),
      Worker(2, "10.0.0.2", "boot-b/5:1"), Worker(3, "10.0.0.1", "boot-a/5:1"),
      Worker(4, "10.0.0.1", "boot-a/5:1")};
  EXPECT_EQ(AssignLocalGroups(&infos), 2);
  // Group 1 holds rank 0 (the smallest), group 2 rank 1.
  EXPECT_EQ(Places(infos),
            (std::vector<std::vector<uint32_t>>{
                {1, 0, 2}, {2, 0, 3}, {1, 1, 2}, {2, 1, 3}, {2, 2, 3}}));
}

TEST(LocalGroupsTest, AloneOnAPlaceOrNotAskingIsNoGroup) {
  std::vector<wire::NodeInfo> infos = {
      Worker(0, "10.0.0.1", "boot-a/5:1"),
      Worker(1, "10.0.0.1", "boot-a/5:2"),            // another /dev/shm
      Worker(2, "10.0.0.1", ""),                      // did not ask
      Worker(3, "10.0.0.2", "boot-a/5:1"),            // another host
      Worker(4, "10.0.0.1", std::string(129, 'x'))};  // not a place
  wire::NodeInfo server;
  server.set_role(wire::SERVER);
  server.set_host("10.0.0.1");
  server.set_local_key("boot-a/5:1");
  infos.push_back(server);
  EXPECT_EQ(AssignLocalGroups(&infos), 0);
  for (const wire::NodeInfo& n : infos) {
    EXPECT_EQ(n.local_group(), 0u) << n.rank();
    EXPECT_EQ(n.local_size(), 0u) << n.rank();
  }
}

TEST(LocalGroupsTest, ADeadWorkerIsLeftOut) {
  std::vector<wire::NodeInfo> infos = {Worker(0, "h", "p"), Worker(1, "h", "p"),
                                       Worker(2, "h", "p")};
  infos[1].set_dead(true);
  EXPECT_EQ(AssignLocalGroups(&infos), 1);
  EXPECT_EQ(Places(infos), (std::vector<std::vector<uint32_t>>{
                               {1, 0, 2}, {0, 0, 0}, {1, 1, 2}}));
}

TEST(LocalGroupsTest, ElasticJobsAndJobsWhoseSlicesMoveAreNotGrouped) {
  for (int job = 0; job < 2; ++job) {
    Options o;
    o.num_workers = 2;
    o.num_servers = 2;
    if (job == 0) {
      o.elastic_min = 1;
      o.elastic_max = 2;
    } else {
      o.single_copy = true;  // TESSERA_MAX_SERVERS, one copy
    }
    std::vector<wire::NodeInfo> infos = {Worker(0, "h", "p"),
                                         Worker(1, "h", "p")};
    FormLocalGroups(o, &infos);
    EXPECT_EQ(Places(infos),
              (std::vector<std::vector<uint32_t>>{{0, 0, 0}, {0, 0, 0}}));
    EXPECT_EQ(infos[0].local_key(), "");
  }
  Options plain;  // replicated slices stay where they are: grouped
  plain.num_workers = 2;
  plain.num_servers = 2;
  plain.replicas = 2;
  std::vector<wire::NodeInfo> infos = {Worker(0, "h", "p"),
                                       Worker(1, "h", "p")};
  FormLocalGroups(plain, &infos);
  EXPECT_EQ(Places(infos),
            (std::vector<std::vector<uint32_t>>{{1, 0, 2}, {1, 1, 2}}));
  EXPECT_EQ(infos[1].local_key(), "");  // the table carries only the groups
}

TEST(LocalGroupsTest, NoncesAreNeverZero) {
  EXPECT_NE(LocalGroupNonce(), 0u);
  EXPECT_NE(LocalGroupNonce(), LocalGroupNonce());
}

}  // namespace
}  // namespace tessera

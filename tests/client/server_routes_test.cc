// Where a worker's requests go when slices have chains
// (worker/client/server_routes.h): the acting primary for pushes and pulls,
// the first live member from an init's place, unchanged without chains or
// states, and which chains' primaries an update moved.
#include "worker/client/server_routes.h"

#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

Message Request(wire::Command command, int place = 0) {
  Message m;
  m.header.set_command(command);
  m.header.set_replica(place);
  return m;
}

TEST(ServerRoutesTest, WithoutChainsOrStatesARequestGoesWhereItWasSent) {
  ServerRoutes plain(3, 1, false);
  Message push = Request(wire::KV_PUSH);
  EXPECT_EQ(plain.Route(ServerId(1), &push), ServerId(1));
  EXPECT_TRUE(plain.Update(std::vector<ServerState>(3)).empty());
  std::vector<ServerState> states(3);
  states[1].dead = true;
  plain.Update(states);
  EXPECT_EQ(plain.Route(ServerId(1), &push), ServerId(1));

  ServerRoutes chained(3, 2, false);
  EXPECT_EQ(chained.Route(ServerId(1), &push), ServerId(1));  // no states yet
  EXPECT_EQ(chained.Route(kSchedulerId, &push), kSchedulerId);
}

TEST(ServerRoutesTest, ADeadPrimarysSlicesGoToTheNextLiveMember) {
  // 3 servers, chains of 2: rank 1's slices live on 1 and 2.
  ServerRoutes routes(3, 2, false);
  EXPECT_TRUE(routes.Update(std::vector<ServerState>(3)).empty());  // first
  Message pull = Request(wire::KV_PULL);
  EXPECT_EQ(routes.Route(ServerId(1), &pull), ServerId(1));
  std::vector<ServerState> states(3);
  states[1].dead = true;
  // Chains whose primary moved: the one starting at rank 1 only (rank 0's
  // chain 0, 1 keeps 0; rank 2's chain 2, 0 keeps 2).
  EXPECT_EQ(routes.Update(states), (std::vector<int>{1}));
  EXPECT_EQ(routes.Route(ServerId(1), &pull), ServerId(2));
  EXPECT_EQ(routes.Route(ServerId(0), &pull), ServerId(0));
  // Both members dead: it goes where it was sent (the scheduler ends the
  // job).
  states[2].dead = true;
  EXPECT_EQ(routes.Update(states), (std::vector<int>{1, 2}));
  EXPECT_EQ(routes.Route(ServerId(1), &pull), ServerId(1));
  // A changed number of servers reports no moves.
  EXPECT_TRUE(routes.Update(std::vector<ServerState>(4)).empty());
}

TEST(ServerRoutesTest, AnInitGoesToTheFirstLiveMemberFromItsPlace) {
  ServerRoutes routes(3, 2, false);
  std::vector<ServerState> states(3);
  routes.Update(states);
  // The init for place 1 of the chain starting at rank 2 (ranks 2, 0) is
  // sent to rank 0 (KVClient addresses it by the rank at that place).
  Message init = Request(wire::KV_INIT, 1);
  EXPECT_EQ(routes.Route(ServerId(0), &init), ServerId(0));
  EXPECT_EQ(init.header.replica(), 1u);
  // Rank 0 dead: the init for its place goes on to the next member, rank 2,
  // at place 0 (wrapping round the chain).
  states[0].dead = true;
  routes.Update(states);
  init = Request(wire::KV_INIT, 1);
  EXPECT_EQ(routes.Route(ServerId(0), &init), ServerId(2));
  EXPECT_EQ(init.header.replica(), 0u);
}

TEST(ServerRoutesTest, WithOneCopyAnInitGoesWhereTheSliceIs) {
  // One copy that moves: the chain is every server; a replacement catching
  // up does not hold it yet.
  ServerRoutes routes(3, 3, true);
  std::vector<ServerState> states(3);
  states[0] = ServerState{false, true, 1};  // rank 0 replaced, catching up
  routes.Update(states);
  Message init = Request(wire::KV_INIT, 0);
  EXPECT_EQ(routes.Route(ServerId(0), &init), ServerId(1));
  EXPECT_EQ(init.header.replica(), 1u);  // rank 1 is place 1 of rank 0's chain
  Message push = Request(wire::KV_PUSH);
  EXPECT_EQ(routes.Route(ServerId(0), &push), ServerId(1));
  EXPECT_EQ(routes.Route(ServerId(2), &push), ServerId(2));
}

}  // namespace
}  // namespace tessera

// Host-local aggregation (issue #47, docs/local_groups.md): which workers of
// a job share a host and sum their gradients there before pushing.
//
// A worker that asks to group registers a local key (where it can share
// memory: common/local_key.h). At the job's formation the scheduler puts the
// workers with the same advertised host and the same local key in one group,
// numbered 1, 2, ... in the order of their smallest rank; a group's members
// get local ranks 0, 1, ... in rank order. A worker alone on its host (or
// the only one there that asked) is in no group. Only a job whose workers
// stay and whose slices move only by fail-over is grouped: not an elastic
// job, not one of one copy whose servers come and go (TESSERA_MAX_SERVERS
// with TESSERA_REPLICAS=1); there the workers' requests are ignored, and the
// scheduler says so once. Replicated jobs are grouped: a group's push is
// replicated and resent as any push.
//
//   std::vector<wire::NodeInfo> infos = ...;  // ranked (AssignIds)
//   const int groups = AssignLocalGroups(&infos);
#ifndef TESSERA_SCHEDULER_LOCAL_GROUPS_H_
#define TESSERA_SCHEDULER_LOCAL_GROUPS_H_

#include <cstdint>
#include <vector>

#include "common/options.h"
#include "proto/tessera.pb.h"

namespace tessera {

// Sets local_group, local_rank and local_size of the workers of `infos`
// (ranked; absent entries and other roles untouched) that registered a
// local_key; clears them on every other node. Returns the number of groups.
int AssignLocalGroups(std::vector<wire::NodeInfo>* infos);

// Clears every node's request to group (the job cannot be grouped); returns
// how many workers had asked.
int RefuseLocalGroups(std::vector<wire::NodeInfo>* infos);

// 64 random bits, never 0: NodeTable.local_group_nonce.
uint64_t LocalGroupNonce();

// At the job's formation: AssignLocalGroups, or RefuseLocalGroups in a job
// that cannot be grouped (`options`: elastic, or slices of one copy moving),
// with a log line either way when some worker asked. The local keys are
// cleared (the node table carries the groups, not where they share memory).
// Returns the largest group's size (0: no group).
int FormLocalGroups(const Options& options, std::vector<wire::NodeInfo>* infos);

}  // namespace tessera

#endif  // TESSERA_SCHEDULER_LOCAL_GROUPS_H_

#include "scheduler/local_groups.h"

#include <sodium.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "common/logging.h"

namespace tessera {

namespace {

constexpr size_t kMaxLocalKey = 128;

void ClearGroup(wire::NodeInfo* n) {
  n->clear_local_group();
  n->clear_local_rank();
  n->clear_local_size();
}

}  // namespace

int AssignLocalGroups(std::vector<wire::NodeInfo>* infos) {
  // Members by (host, local key), each list in rank order.
  std::map<std::pair<std::string, std::string>, std::vector<wire::NodeInfo*>>
      by_place;
  for (wire::NodeInfo& n : *infos) {
    ClearGroup(&n);
    // A key longer than any SharedMemoryPlace is not one (it would be
    // copied into every node's table).
    if (n.role() != wire::WORKER || n.dead() || n.local_key().empty() ||
        n.local_key().size() > kMaxLocalKey)
      continue;
    by_place[{n.host(), n.local_key()}].push_back(&n);
  }
  std::vector<std::vector<wire::NodeInfo*>> groups;
  for (auto& [place, members] : by_place) {
    if (members.size() < 2) continue;
    std::sort(members.begin(), members.end(),
              [](const wire::NodeInfo* a, const wire::NodeInfo* b) {
                return a->rank() < b->rank();
              });
    groups.push_back(members);
  }
  // Numbered by their smallest rank, so the numbers do not depend on the
  // hosts' addresses.
  std::sort(groups.begin(), groups.end(),
            [](const std::vector<wire::NodeInfo*>& a,
               const std::vector<wire::NodeInfo*>& b) {
              return a.front()->rank() < b.front()->rank();
            });
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t m = 0; m < groups[g].size(); ++m) {
      wire::NodeInfo* n = groups[g][m];
      n->set_local_group(static_cast<uint32_t>(g + 1));
      n->set_local_rank(static_cast<uint32_t>(m));
      n->set_local_size(static_cast<uint32_t>(groups[g].size()));
    }
  }
  return static_cast<int>(groups.size());
}

uint64_t LocalGroupNonce() {
  uint64_t nonce = 0;
  if (sodium_init() < 0) std::abort();  // no randomness to be had
  while (nonce == 0) randombytes_buf(&nonce, sizeof(nonce));
  return nonce;
}

int RefuseLocalGroups(std::vector<wire::NodeInfo>* infos) {
  int asked = 0;
  for (wire::NodeInfo& n : *infos) {
    if (!n.local_key().empty()) ++asked;
    n.clear_local_key();
    ClearGroup(&n);
  }
  return asked;
}

int FormLocalGroups(const Options& options,
                    std::vector<wire::NodeInfo>* infos) {
  if (options.elastic() || options.single_copy) {
    const int asked = RefuseLocalGroups(infos);
    if (asked > 0) {
      TESSERA_LOG(WARNING)
          << asked
          << " worker(s) asked to group with the workers on their host "
             "(TESSERA_LOCAL_GROUP=1), but an elastic job, or one whose "
             "slices move between servers (TESSERA_MAX_SERVERS with one copy), "
             "is not grouped: every worker pushes for itself";
    }
    return 0;
  }
  int asked = 0, grouped = 0, largest = 0;
  for (const wire::NodeInfo& n : *infos) asked += n.local_key().empty() ? 0 : 1;
  const int groups = AssignLocalGroups(infos);
  for (wire::NodeInfo& n : *infos) {
    grouped += n.local_size() > 0 ? 1 : 0;
    largest = std::max(largest, static_cast<int>(n.local_size()));
    n.clear_local_key();
  }
  if (asked > 0) {
    TESSERA_LOG(INFO) << asked
                      << " worker(s) asked to group with the workers on their "
                         "host (TESSERA_LOCAL_GROUP=1): "
                      << grouped << " in " << groups << " group(s)";
  }
  return largest;
}

}  // namespace tessera

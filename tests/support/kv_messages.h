// The KV messages a worker sends, built by hand for tests that hand them to a
// KVServer directly (ServerHarness): one whole-key slice each, from worker
// rank `rank`, on the data plane, with a request id of its own. Test-only
// (tests/support).
//
//   h.server().Handle(Init(7, {1, 1}));
//   h.server().Handle(Push(/*rank=*/0, 7, /*seq=*/0, {0.5f, 0.5f}));
//   h.server().Handle(Pull(/*rank=*/0, 7, /*length=*/2));
//   std::vector<float> w = ValuesOf(*h.NextReply());
//
// Thread-safety: the builders may be called from any thread.
#ifndef TESSERA_TESTS_SUPPORT_KV_MESSAGES_H_
#define TESSERA_TESTS_SUPPORT_KV_MESSAGES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/message.h"

namespace tessera::testing {

// Request ids 1, 2, 3, ... in the order asked, across the process.
uint64_t NextRequestId();

// A `cmd` of the whole key `key` (`length` values), no data frames.
Message KeyMessage(wire::Command cmd, int rank, uint64_t key, uint64_t length);

// A copy of `v`'s bytes.
Buffer Floats(const std::vector<float>& v);

// The values of `m`'s one data frame; empty unless it has exactly one.
std::vector<float> ValuesOf(const Message& m);

// Rank 0's init of `key` to `value`, dist_sync or (not `sync`) dist_async.
Message Init(uint64_t key, const std::vector<float>& value, bool sync = true);

// Push number `seq` of `rank` to `key` (a pushpull with KV_PUSHPULL).
Message Push(int rank, uint64_t key, uint64_t seq,
             const std::vector<float>& grad, wire::Command cmd = wire::KV_PUSH);

// A pull of `length` values made after `push_seq` pushes of `rank` to `key`.
Message Pull(int rank, uint64_t key, uint64_t length, uint64_t push_seq = 0);

// Rank 0's request for the optimizer `spec` ("sgd lr=0.1").
Message SetOptimizer(const std::string& spec);

// Rank 0's KV_SET_COMPRESSION to 2-bit codes of `threshold`.
Message SetTwoBit(float threshold);

// The value of `series` (a name with its labels, as exposed:
// `tessera_server_ssp_clock{rank="0"}`) in this process's metrics, or
// `absent` when it is not there. Every KVServer alive adds its samples.
double MetricValue(const std::string& series, double absent);

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_SUPPORT_KV_MESSAGES_H_

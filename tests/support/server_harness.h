// ServerHarness: a KVServer in one process, no sockets. A test hands it
// messages through server().Handle and reads the replies the server sent, in
// the order it sent them. Test-only (tests/support).
//
//   ServerHarness h(/*num_workers=*/2);
//   h.server().Handle(Init(7, {1, 1}));
//   std::optional<Message> r = h.NextReply();
//
// Thread-safety: the server sends from its own threads; NextReply and Pending
// may be called from any thread.
#ifndef TESSERA_TESTS_SUPPORT_SERVER_HARNESS_H_
#define TESSERA_TESTS_SUPPORT_SERVER_HARNESS_H_

#include <cstddef>
#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/message.h"
#include "server/kv_server.h"

namespace tessera::testing {

// A server and the replies it sent, each with the recipient it was sent to
// and the sender ServerId(0).
class ServerHarness {
 public:
  explicit ServerHarness(int num_workers, int threads = 2,
                         WaitingLimits limits = WaitingLimits(),
                         SyncRound::Mode sum_mode = SyncRound::Mode::kExact);

  KVServer& server() { return server_; }

  // The next reply that is not an acknowledgement (with `skip_acks`, any
  // reply otherwise), waiting up to 5 s; nullopt when none came.
  std::optional<Message> NextReply(bool skip_acks = true);
  // Replies (acknowledgements included) sent and not yet taken, after
  // `settle`.
  size_t Pending(absl::Duration settle = absl::Milliseconds(50));

 private:
  absl::Mutex mu_;
  std::deque<Message> replies_ ABSL_GUARDED_BY(mu_);
  KVServer server_;
};

}  // namespace tessera::testing

#endif  // TESSERA_TESTS_SUPPORT_SERVER_HARNESS_H_

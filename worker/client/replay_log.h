// ReplayLog: what a worker keeps so that a server restarted from its
// checkpoint (or from nothing) can be brought back to where the job is: the
// settings it sent (optimizer, compression), its inits (rank 0's values), and
// every push that the server's last checkpoint does not hold yet. A push is
// kept after its reply until a later reply says a checkpoint holds it.
//
//   ReplayLog log;
//   log.KeepSetting(msg);                                  // set_optimizer
//   log.DeclareKey(key, parts);
//   tracker callback: log.Keep(answered.request.part, answered.msg,
//                              answered.request.replayed, reply);
//   for (ReplayLog::Entry& e : log.For(server_rank)) { ...send e.msg... }
//
// Only servers that checkpoint (their replies say so) make the log keep
// anything, so a job without checkpoints pays nothing.
//
// Thread-safety: all methods are thread-safe.
#ifndef TESSERA_WORKER_CLIENT_REPLAY_LOG_H_
#define TESSERA_WORKER_CLIENT_REPLAY_LOG_H_

#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/message.h"
#include "worker/client/key_partitioner.h"
#include "worker/client/request_tracker.h"

namespace tessera {

class ReplayLog {
 public:
  // A settings message (by command: a newer one replaces the older).
  void KeepSetting(const Message& msg);
  void DeclareKey(uint64_t key, const std::vector<KeyPart>& parts);
  void ForgetKey(uint64_t key);

  // After a reply to `request` (sent for `part`): keeps an init (when it
  // succeeded) or a push when the server checkpoints, copying frames that may
  // borrow the caller's memory, and drops what the reply says is durable.
  void Keep(const RequestTracker::PartRef& part, const Message& request,
            bool replayed, const wire::Header& reply);

  struct Entry {
    KeyPart part;  // server_rank 0..: the settings' part names only the server
    Message msg;
    RequestTracker::PartRef ref;
  };
  // What to send a restarted server, in order: settings, inits, pushes.
  std::vector<Entry> For(int server_rank) const;

 private:
  struct PushCopy {
    uint64_t seq = 0;
    Message msg;  // owns its bytes
  };
  struct KeyLog {
    std::vector<KeyPart> parts;
    std::vector<Message> init;                 // per part (rank 0)
    std::vector<std::deque<PushCopy>> pushes;  // per part, oldest first
  };

  mutable absl::Mutex mu_;
  std::map<int, Message> settings_ ABSL_GUARDED_BY(mu_);  // by command
  std::map<uint64_t, KeyLog> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_REPLAY_LOG_H_

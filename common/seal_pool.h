// SealPool: threads that go on sealing links whose work waited for room, so
// that a caller's Send returns once its message is queued, and several links
// are sealed at once on several cores. The ZeroMQ transport's sealed lane
// (zmq_transport_internal.h) hands a link's pump to it from the free callback
// of the record that made room (zmq_record_sink.h).
//
//   SealPool pool(4);
//   pool.Schedule([link] { ... seal what waits on `link` ... });
//   pool.ScheduleAfter(absl::Milliseconds(200), [link] { ... });
//   pool.Stop();   // drops what waits, joins the threads
//
// Thread-safety: Schedule from any thread (ZeroMQ's I/O thread included);
// Stop from one thread, and not from a pool thread.
#ifndef TESSERA_COMMON_SEAL_POOL_H_
#define TESSERA_COMMON_SEAL_POOL_H_

#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera::zmq_internal {

class SealPool {
 public:
  // Starts up to `threads` threads, as work comes.
  explicit SealPool(int threads) : threads_(threads) {}
  ~SealPool() { Stop(); }

  // Runs `work` on a pool thread; dropped once the pool has stopped.
  void Schedule(std::function<void()> work);
  // Runs `work` on a pool thread once `delay` has passed (a link's new
  // connection after a refusal); dropped once the pool has stopped.
  void ScheduleAfter(absl::Duration delay, std::function<void()> work);

  // Drops the work that waits and joins the threads. Idempotent.
  void Stop();

 private:
  void Run();

  const int threads_;
  absl::Mutex mu_;
  absl::CondVar work_came_;  // queue_ or timed_ grew, or the pool stopped
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  // Work for later, by when it is due.
  std::multimap<absl::Time, std::function<void()>> timed_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;  // added under mu_, joined in Stop
};

}  // namespace tessera::zmq_internal

#endif  // TESSERA_COMMON_SEAL_POOL_H_

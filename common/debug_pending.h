// DebugPending: what this process waits for, for the person asking why a
// job is slow or stuck: a worker's requests without a reply, a server's open
// dist_sync rounds and held messages, its threads' phases, the scheduler's
// open barriers and node table. Each part that owns such state adds a
// section that fills a wire::DebugPending (proto/tessera.proto); the process
// serves the whole at GET /debug/pending on its metrics port
// (MetricsHttpServer) and logs it on SIGUSR1 (InstallPendingDump).
//
//   DebugPendingRegistry::Section s = DebugPendingRegistry::Global().Add(
//       [this](wire::DebugPending* out) { ... });  // removed with `s`
//   std::string json = DebugPendingRegistry::Global().Json();
//
// Thread-safety: thread-safe. Fill functions run on the asking thread with
// the registry's lock held: they may take their owner's locks, and an owner
// must not drop its section while holding a lock its fill takes.
#ifndef TESSERA_COMMON_DEBUG_PENDING_H_
#define TESSERA_COMMON_DEBUG_PENDING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "proto/tessera.pb.h"

namespace tessera {

class DebugPendingRegistry {
 public:
  using FillFn = std::function<void(wire::DebugPending*)>;

  // A section of the registry; removed when destroyed. Move-only.
  class Section {
   public:
    Section() = default;
    Section(Section&& other) noexcept { *this = std::move(other); }
    Section& operator=(Section&& other) noexcept;
    Section(const Section&) = delete;
    Section& operator=(const Section&) = delete;
    ~Section() { Reset(); }
    void Reset();

   private:
    friend class DebugPendingRegistry;
    DebugPendingRegistry* registry_ = nullptr;
    uint64_t id_ = 0;
  };

  static DebugPendingRegistry& Global();

  [[nodiscard]] Section Add(FillFn fill);
  // The process's pid and the time, then every section's part, in the order
  // they were added.
  wire::DebugPending Collect() const;
  // Collect() as one line of JSON, with the proto's field names; empty lists
  // and zeros included, so a reader finds every field.
  std::string Json() const;

 private:
  void Remove(uint64_t id);

  mutable absl::Mutex mu_;
  std::map<uint64_t, FillFn> sections_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

// DebugPending as JSON (what Json() does, for one already collected).
std::string PendingJson(const wire::DebugPending& pending);

// On SIGUSR1 the process logs "pending: " and the registry's JSON, from a
// thread of its own (the handler only writes a byte to a pipe). Installed
// only while SIGUSR1 has its default action (which would end the process):
// a program that handles SIGUSR1 itself keeps its handler. Idempotent; does
// nothing after StartPendingDumpThread.
void InstallPendingDump();

// For programs that own their main (the daemons, through StartDaemon): blocks
// SIGUSR1 in the calling thread, and so in every thread it starts later, and
// dumps as above from a thread that waits for the signal (sigwait): no
// handler runs at all, so the dump comes whatever the other threads do
// (ThreadSanitizer, for one, defers a handler until the interrupted thread
// calls into it, which a thread waiting on a futex does not). Call first
// thing in main, before any thread is started. Idempotent.
void StartPendingDumpThread();

}  // namespace tessera

#endif  // TESSERA_COMMON_DEBUG_PENDING_H_

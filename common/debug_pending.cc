#include "common/debug_pending.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <thread>

#include "absl/time/clock.h"
#include "common/logging.h"

namespace tessera {

DebugPendingRegistry::Section& DebugPendingRegistry::Section::operator=(
    Section&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = other.registry_;
    id_ = other.id_;
    other.registry_ = nullptr;
    other.id_ = 0;
  }
  return *this;
}

void DebugPendingRegistry::Section::Reset() {
  if (registry_ != nullptr) registry_->Remove(id_);
  registry_ = nullptr;
  id_ = 0;
}

DebugPendingRegistry& DebugPendingRegistry::Global() {
  static DebugPendingRegistry* const registry = new DebugPendingRegistry;
  return *registry;
}

DebugPendingRegistry::Section DebugPendingRegistry::Add(FillFn fill) {
  absl::MutexLock lock(&mu_);
  Section s;
  s.registry_ = this;
  s.id_ = next_id_++;
  sections_[s.id_] = std::move(fill);
  return s;
}

void DebugPendingRegistry::Remove(uint64_t id) {
  absl::MutexLock lock(&mu_);
  sections_.erase(id);
}

wire::DebugPending DebugPendingRegistry::Collect() const {
  wire::DebugPending out;
  out.set_pid(getpid());
  out.set_time_s(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  absl::MutexLock lock(&mu_);
  for (const auto& [id, fill] : sections_) fill(&out);
  return out;
}

std::string PendingJson(const wire::DebugPending& pending) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(pending, &json, options)
           .ok()) {
    return "{}";
  }
  return json;
}

std::string DebugPendingRegistry::Json() const {
  return PendingJson(Collect());
}

namespace {

int dump_pipe[2] = {-1, -1};

void OnUsr1(int) {
  const int saved = errno;
  const char byte = 1;
  (void)!write(dump_pipe[1], &byte, 1);  // async-signal-safe
  errno = saved;
}

void DumpLoop() {
  char byte;
  while (true) {
    const ssize_t n = read(dump_pipe[0], &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    TESSERA_LOG(INFO) << "pending: " << DebugPendingRegistry::Global().Json();
  }
}

std::atomic<bool> dump_thread_started{false};

}  // namespace

void StartPendingDumpThread() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    if (pthread_sigmask(SIG_BLOCK, &usr1, nullptr) != 0) return;
    dump_thread_started.store(true);
    // The thread lives as long as the process (it waits in sigwait).
    std::thread([usr1] {
      while (true) {
        int signal = 0;
        if (sigwait(&usr1, &signal) != 0) continue;
        TESSERA_LOG(INFO) << "pending: "
                          << DebugPendingRegistry::Global().Json();
      }
    }).detach();
  });
}

void InstallPendingDump() {
  if (dump_thread_started.load()) return;
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old;
    if (sigaction(SIGUSR1, nullptr, &old) != 0) return;
    if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return;
    // Close-on-exec (a child does not dump its parent), and the handler never
    // blocks on a full pipe (a dump is already due then).
    if (pipe2(dump_pipe, O_CLOEXEC) != 0) return;
    fcntl(dump_pipe[1], F_SETFL, fcntl(dump_pipe[1], F_GETFL) | O_NONBLOCK);
    // The thread lives as long as the process (it blocks in read).
    std::thread(DumpLoop).detach();
    struct sigaction act = {};
    act.sa_handler = OnUsr1;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &act, nullptr);
  });
}

}  // namespace tessera

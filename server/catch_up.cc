#include "server/catch_up.h"

#include <utility>

#include "common/logging.h"

namespace tessera {

bool CatchUp::Start(Options options) {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || stopped_) return false;
    started_ = true;
    options_ = std::move(options);
    started_at_ = absl::Now();
  }
  thread_ = std::thread([this] { Loop(); });
  return true;
}

bool CatchUp::active() const {
  absl::MutexLock lock(&mu_);
  return started_ && !done_;
}

bool CatchUp::SentAll(int rank) const {
  auto c = counted_.find(rank);
  auto t = taken_.find(rank);
  const size_t got = t == taken_.end() ? 0 : t->second.size();
  return c != counted_.end() && got >= c->second;
}

void CatchUp::Counted(int rank, uint64_t total) {
  {
    absl::MutexLock lock(&mu_);
    if (!started_) return;
    counted_[rank] = total;
  }
  Check();
}

void CatchUp::Took(int rank, uint64_t key, uint64_t offset, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!started_) return;
  if (taken_[rank].insert({key, offset}).second) bytes_ += bytes;
}

void CatchUp::Check() {
  std::function<void()> report;
  {
    absl::MutexLock lock(&mu_);
    if (!started_ || done_) return;
    const std::vector<ServerState> states = options_.states();
    uint64_t slices = 0;
    for (int r = 0;
         r < options_.num_servers && r < static_cast<int>(states.size()); ++r) {
      if (r == options_.rank || states[r].dead) continue;
      if (!SentAll(r)) return;
      slices += counted_[r];
    }
    done_ = true;
    TESSERA_LOG(INFO) << "caught up: " << slices << " key slice(s), " << bytes_
                      << " bytes, in "
                      << absl::FormatDuration(absl::Now() - started_at_);
    report = options_.caught_up;
  }
  if (report) report();
}

void CatchUp::Restart() {
  absl::MutexLock lock(&mu_);
  if (!started_ || done_) return;
  counted_.clear();
  ask_again_ = true;
}

void CatchUp::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void CatchUp::Loop() {
  uint64_t asked = 0;
  absl::MutexLock lock(&mu_);
  const auto ask_one = options_.ask;  // set once, by Start
  while (!stopped_ && !done_) {
    const std::vector<ServerState> states = options_.states();
    std::vector<int> ask;
    for (int r = 0;
         r < options_.num_servers && r < static_cast<int>(states.size()); ++r) {
      if (r != options_.rank && !states[r].dead && !SentAll(r))
        ask.push_back(r);
    }
    // The asks go out without the lock: the answers come back on other
    // threads and take it.
    mu_.Unlock();
    for (int r : ask) ask_one(r, ++asked);
    mu_.Lock();
    if (done_ || stopped_) break;
    // A Restart while the asks went out is seen here too (a flag, not a
    // signal that only a waiting thread would get).
    mu_.AwaitWithTimeout(absl::Condition(this, &CatchUp::Woken),
                         options_.resend);
    ask_again_ = false;
  }
}

}  // namespace tessera

#include "server/catch_up.h"

#include <iterator>
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
    // Under the lock, so that Stop sees it; Loop takes the lock first.
    thread_ = std::thread([this] { Loop(); });
  }
  return true;
}

bool CatchUp::active() const {
  absl::MutexLock lock(&mu_);
  return started_ && !done_;
}

bool CatchUp::Counted(int rank, uint64_t request_id, uint64_t view,
                      std::vector<SliceId> slices) {
  {
    absl::MutexLock lock(&mu_);
    if (!started_) return false;
    auto asked = asked_of_.find(request_id);
    auto answered = answered_.find(rank);
    if (request_id < current_from_ || asked == asked_of_.end() ||
        asked->second.rank != rank || asked->second.view != view ||
        (answered != answered_.end() && request_id < answered->second)) {
      TESSERA_VLOG(1) << "dropped server " << rank << "'s count for ask "
                      << request_id << ": not its current ask (asks "
                      << current_from_ << ".." << asked_ << " are current)";
      return false;
    }
    answered_[rank] = request_id;
    counted_view_[rank] = view;
    // Its earlier asks can no longer count: forgotten, so that the asks
    // kept stay the ones still unanswered (one a resend, between deaths).
    for (auto it = asked_of_.begin();
         it != asked_of_.end() && it->first < request_id;) {
      it = it->second.rank == rank ? asked_of_.erase(it) : std::next(it);
    }
    std::set<SliceId>& counted = counted_[rank];
    counted = std::set<SliceId>(slices.begin(), slices.end());
    const std::set<SliceId>& taken = taken_[rank];
    size_t missing = 0;
    for (const SliceId& slice : counted) missing += taken.count(slice) == 0;
    missing_[rank] = missing;
  }
  Check();
  return true;
}

void CatchUp::Took(int rank, uint64_t key, uint64_t offset, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!started_) return;
  if (!taken_[rank].insert({key, offset}).second) return;  // taken before
  bytes_ += bytes;
  auto counted = counted_.find(rank);
  if (counted != counted_.end() && counted->second.count({key, offset}) != 0)
    --missing_[rank];
}

void CatchUp::Check() {
  std::function<void()> report;
  {
    absl::MutexLock lock(&mu_);
    if (!started_ || done_) return;
    const std::vector<ServerState> states = options_.states();
    // Counts made under another view of the table than the one judged here
    // do not count: a death this server has seen but not yet handed to
    // Restart moves slices to servers whose counts did not name them.
    const uint64_t view = StatesDigest(states);
    uint64_t slices = 0;
    for (int r = 0;
         r < options_.num_servers && r < static_cast<int>(states.size()); ++r) {
      if (r == options_.rank || states[r].dead) continue;
      auto counted_view = counted_view_.find(r);
      if (!SentAll(r) || counted_view == counted_view_.end() ||
          counted_view->second != view) {
        return;
      }
      slices += counted_[r].size();
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
  counted_view_.clear();
  missing_.clear();
  answered_.clear();
  asked_of_.clear();
  current_from_ = asked_ + 1;
  ask_again_ = true;
}

void CatchUp::Stop() {
  absl::MutexLock stopping(&stop_mu_);
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void CatchUp::Loop() {
  absl::MutexLock lock(&mu_);
  const auto ask_one = options_.ask;  // set once, by Start
  while (!stopped_ && !done_) {
    const std::vector<ServerState> states = options_.states();
    std::vector<std::pair<int, uint64_t>> ask;  // (rank, request id)
    const uint64_t view = StatesDigest(states);
    for (int r = 0;
         r < options_.num_servers && r < static_cast<int>(states.size()); ++r) {
      if (r != options_.rank && !states[r].dead && !SentAll(r)) {
        ask.push_back({r, ++asked_});
        asked_of_[asked_] = Ask{r, view};
      }
    }
    // The asks go out without the lock: the answers come back on other
    // threads and take it.
    mu_.Unlock();
    for (const auto& [r, id] : ask) ask_one(r, id, view);
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

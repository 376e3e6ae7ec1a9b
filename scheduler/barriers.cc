#include "scheduler/barriers.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/message.h"

namespace tessera {

const char* BarrierGroupName(int group) {
  if (group == (kGroupServers | kGroupWorkers)) return "servers and workers";
  return (group & kGroupServers) ? "servers" : "workers";
}

Barriers::Barriers(Membership membership, Settings settings, ReleaseFn release,
                   Counter* released)
    : membership_(std::move(membership)),
      settings_(settings),
      release_(std::move(release)),
      released_(released) {}

int Barriers::Present(int group) const {
  auto waiting = waiting_.find(group);
  int present =
      waiting == waiting_.end() ? 0 : static_cast<int>(waiting->second.size());
  // A worker that has finished passed every later barrier: a restarted
  // worker's last barrier (its earlier life died in the one the others
  // passed before they finished) must not wait for it.
  if (group & kGroupWorkers) present += membership_.finished();
  return present;
}

void Barriers::Enter(int sender, uint64_t request_id, int group,
                     const std::string& tag, bool join_if_open,
                     absl::Time now) {
  const int expected = membership_.expected(group);
  if (released_request_[sender] == request_id) {
    // A repeat of a request already released: its answer was lost.
    release_(sender, request_id);
    return;
  }
  auto& waiting = waiting_[group];
  if (join_if_open && released_tags_[group].count(tag) != 0) {
    // A restarted node whose earlier life passed this barrier with the
    // others (or whom they passed: a finished worker): nobody waits for it
    // there. Otherwise it joins as anyone does, whether the others wait
    // there already or have yet to come (they may still be storing the key
    // whose barrier it is: answering at once then left them waiting in it
    // for ever).
    release_(sender, request_id);
    return;
  }
  if (waiting.empty()) {
    tag_[group] = tag;
    opened_[group] = now;
    next_report_[group] = absl::ZeroDuration();
  }
  // A node waits in a barrier once. Its newest request is the one to
  // answer: a restarted node asks again under a new request id.
  waiting.insert_or_assign(sender, request_id);
  const int present = Present(group);
  TESSERA_VLOG(1) << "barrier " << group << ": " << present << "/" << expected;
  if (present >= expected) Release(group, now);
}

void Barriers::Release(int group, absl::Time now) {
  std::map<int, uint64_t>& waiting = waiting_[group];
  if (!tag_[group].empty()) released_tags_[group].insert(tag_[group]);
  for (const auto& [id, request] : waiting) {
    released_request_[id] = request;
    release_(id, request);
  }
  waiting.clear();
  if (released_ != nullptr) released_->Increment();
  auto opened = opened_.find(group);
  if (opened != opened_.end()) {
    std::deque<absl::Duration>& recent = recent_[group];
    recent.push_back(now - opened->second);
    if (recent.size() > kRecent) recent.pop_front();
    opened_.erase(opened);
  }
}

void Barriers::Leave(int id) {
  for (auto& [group, waiting] : waiting_) waiting.erase(id);
}

void Barriers::Forget(int id) {
  released_request_.erase(id);
  Leave(id);
}

void Barriers::ReleaseComplete(absl::Time now) {
  for (auto& [group, waiting] : waiting_) {
    if (waiting.empty()) continue;
    if (Present(group) >= membership_.expected(group)) Release(group, now);
  }
}

bool Barriers::Waits(int group, int id) const {
  auto waiting = waiting_.find(group);
  return waiting != waiting_.end() && waiting->second.count(id) != 0;
}

void Barriers::CheckLate(absl::Time now) {
  for (const auto& [group, opened] : opened_) {
    const absl::Duration age = now - opened;
    absl::Duration median = absl::ZeroDuration();
    auto recent = recent_.find(group);
    if (recent != recent_.end() && !recent->second.empty()) {
      std::vector<absl::Duration> d(recent->second.begin(),
                                    recent->second.end());
      std::nth_element(d.begin(), d.begin() + d.size() / 2, d.end());
      median = d[d.size() / 2];
    }
    const absl::Duration threshold =
        median == absl::ZeroDuration()
            ? 10 * settings_.late_min
            : std::max(settings_.late_min, settings_.late_factor * median);
    absl::Duration& next = next_report_[group];
    if (age < threshold || age < next) continue;
    next = 2 * age;
    const std::vector<std::string> missing = membership_.missing(group);
    const std::string tag = tag_[group];
    const std::string why =
        median == absl::ZeroDuration()
            ? std::string("no barrier of the group has been released yet")
            : absl::StrCat(static_cast<int64_t>(age / median),
                           "x the group's recent median barrier of ",
                           absl::FormatDuration(
                               absl::Trunc(median, absl::Milliseconds(1))));
    TESSERA_LOG(WARNING)
        << "barrier of the " << BarrierGroupName(group)
        << (tag.empty() ? "" : absl::StrCat(" ('", tag, "')")) << " has waited "
        << absl::FormatDuration(absl::Trunc(age, absl::Milliseconds(100)))
        << " for "
        << (missing.empty()
                ? "nobody"
                : absl::StrJoin(
                      missing.begin(),
                      missing.begin() + std::min<size_t>(missing.size(), 16),
                      ", "))
        << (missing.size() > 16
                ? absl::StrCat(", ... (", missing.size(), " in all)")
                : "")
        << " (" << why << ")";
  }
}

void Barriers::Fill(wire::DebugPending* out, absl::Time now) const {
  for (const auto& [group, waiting] : waiting_) {
    if (waiting.empty()) continue;
    wire::OpenBarrier* b = out->add_barriers();
    b->set_group(BarrierGroupName(group));
    auto tag = tag_.find(group);
    if (tag != tag_.end()) b->set_tag(tag->second);
    for (const auto& [id, request] : waiting) b->add_ids_in(id);
    for (std::string& m : membership_.missing(group))
      b->add_missing(std::move(m));
    auto opened = opened_.find(group);
    if (opened != opened_.end())
      b->set_age_s(absl::ToDoubleSeconds(now - opened->second));
  }
}

}  // namespace tessera

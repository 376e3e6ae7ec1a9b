#include "common/zap_hold_queue.h"

#include "absl/strings/str_cat.h"
#include "common/secret_string.h"

namespace tessera {

ZapRequest::~ZapRequest() {
  for (std::string& part : frames) WipeString(&part);
}

absl::string_view ZapRequest::address() const {
  return frames.size() > 3 ? absl::string_view(frames[3]) : "";
}

ZapHoldQueue::ZapHoldQueue(Limits limits) : limits_(limits) {}

size_t ZapHoldQueue::held_from(absl::string_view address) const {
  auto it = of_.find(address);
  return it == of_.end() ? 0 : it->second.size();
}

std::optional<ZapRequest> ZapHoldQueue::Hold(ZapRequest request,
                                             std::string* why) {
  const std::string address(request.address());
  const size_t mine = held_from(address);
  if (mine >= limits_.max_per_address) {
    *why = absl::StrCat(mine, " connections from ", address,
                        " already wait for their keys");
    return request;
  }
  if (held_.size() < limits_.max_held) {
    Insert(std::move(request));
    return std::nullopt;
  }
  if (by_count_.empty() || by_count_.rbegin()->first <= mine) {
    *why = absl::StrCat(held_.size(),
                        " connections already wait for their keys, none from "
                        "an address with more than ",
                        mine, " of them (",
                        address.empty() ? std::string("?") : address, ")");
    return request;
  }
  // The newest of the address holding the most gives up its slot.
  const auto [most, most_address] = *by_count_.rbegin();
  ZapRequest out = Remove(held_.find(*of_.at(most_address).rbegin()));
  *why = absl::StrCat(held_.size() + 1,
                      " connections already wait for their keys, ", most,
                      " from ", most_address,
                      " (the most); its newest gives up its slot to one from ",
                      address.empty() ? std::string("?") : address);
  Insert(std::move(request));
  return out;
}

void ZapHoldQueue::Insert(ZapRequest request) {
  if (request.seq == 0) request.seq = next_seq_++;
  const uint64_t seq = request.seq;
  const std::string address(request.address());
  std::set<uint64_t>& mine = of_[address];
  mine.insert(seq);
  Recount(address, mine.size() - 1, mine.size());
  of_key_[request.key].insert(seq);
  held_.emplace(seq, std::move(request));
}

ZapRequest ZapHoldQueue::Remove(std::map<uint64_t, ZapRequest>::iterator it) {
  ZapRequest out = std::move(it->second);
  held_.erase(it);
  const std::string address(out.address());
  auto of = of_.find(address);
  of->second.erase(out.seq);
  Recount(address, of->second.size() + 1, of->second.size());
  if (of->second.empty()) of_.erase(of);
  auto claiming = of_key_.find(out.key);
  claiming->second.erase(out.seq);
  if (claiming->second.empty()) of_key_.erase(claiming);
  return out;
}

void ZapHoldQueue::Recount(const std::string& address, size_t from, size_t to) {
  if (from > 0) by_count_.erase({from, address});
  if (to > 0) by_count_.insert({to, address});
}

std::vector<ZapRequest> ZapHoldQueue::TakeAll() {
  std::vector<ZapRequest> out;
  out.reserve(held_.size());
  for (auto& [seq, request] : held_) out.push_back(std::move(request));
  held_.clear();
  of_.clear();
  by_count_.clear();
  of_key_.clear();
  return out;
}

std::vector<ZapRequest> ZapHoldQueue::TakeKey(absl::string_view key) {
  std::vector<ZapRequest> out;
  auto it = of_key_.find(key);
  if (it == of_key_.end()) return out;
  const std::set<uint64_t> seqs = it->second;  // Remove changes it
  for (uint64_t seq : seqs) out.push_back(Remove(held_.find(seq)));
  return out;
}

std::vector<ZapRequest> ZapHoldQueue::TakeExpired(absl::Time now) {
  // Arrival order is expiry order: every request waits as long.
  std::vector<ZapRequest> out;
  while (!held_.empty() && held_.begin()->second.until <= now)
    out.push_back(Remove(held_.begin()));
  return out;
}

}  // namespace tessera

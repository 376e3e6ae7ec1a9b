// ZapHoldQueue: the requests a ZAP handler (zap_handler.h) holds: sealed-lane
// connections whose node key this node does not know yet, their answer
// unsent until the node table names the key or their time is up. They are
// found by the key they claim (TakeKey), so that a change of the table
// re-decides only the requests whose key it added.
//
// Slots are bounded in all (`max_held`) and per source address
// (`max_per_address`, the address the ZAP request names), so that whoever
// can reach the port cannot take the slots of the peers that come late
// (joins, restarts). A request from an address holding `max_per_address`
// already is refused. A job's nodes set it to the job's process count (a
// host's processes share its address: zmq_transport.cc), at least 64. When all `max_held` are taken, a request takes the
// slot of the newest request of the address holding the most, if that
// address holds more than the newcomer's; else the newcomer is refused. So
// a flood from a few addresses loses its own newest slots, and a filled
// queue refuses only those holding as many as anyone.
//
//   ZapHoldQueue held(ZapHoldQueue::Limits{});
//   request.until = absl::Now() + absl::Seconds(10);
//   std::string why;
//   if (std::optional<ZapRequest> refused = held.Hold(std::move(request), &why))
//     Refuse(*refused, why);                 // the newcomer, or another
//   for (ZapRequest& r : held.TakeKey(added_key)) Decide(r);
//   for (ZapRequest& r : held.TakeExpired(absl::Now())) Refuse(r, "...");
//
// Thread-safety: none; the ZAP handler's thread only.
#ifndef TESSERA_COMMON_ZAP_HOLD_QUEUE_H_
#define TESSERA_COMMON_ZAP_HOLD_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tessera {

// A request off a ZAP handler's ROUTER socket: its routing id and its frames
// after the empty delimiter (RFC 27: version, request id, domain, address,
// identity, mechanism, credentials), wiped when it goes (a PLAIN password).
struct ZapRequest {
  std::string routing_id;
  std::vector<std::string> frames;
  absl::Time until;  // a held one's last chance
  std::string key;   // the node key it claims (its 32 bytes): what it awaits
  uint64_t seq = 0;  // its place in arrival order, once held
  ZapRequest() = default;
  ZapRequest(ZapRequest&&) = default;
  ZapRequest& operator=(ZapRequest&&) = default;
  ~ZapRequest();
  // The connecting peer's address (frame 3), or "" in a malformed one.
  absl::string_view address() const;
};

class ZapHoldQueue {
 public:
  struct Limits {
    size_t max_held = 4096;
    size_t max_per_address = 64;
  };

  explicit ZapHoldQueue(Limits limits);

  // Holds `request` until Take* gives it back. Returns the request refused
  // to keep the bounds, with `why` set: `request` itself, or the newest of
  // the address holding the most (`request` then holds its slot); nullopt
  // when none is. A request given back by Take* keeps its place in arrival
  // order when held again.
  std::optional<ZapRequest> Hold(ZapRequest request, std::string* why);
  // Removes and returns every held request, in arrival order.
  std::vector<ZapRequest> TakeAll();
  // Removes and returns those claiming `key`, in arrival order.
  std::vector<ZapRequest> TakeKey(absl::string_view key);
  // Removes and returns those whose `until` is not after `now`.
  std::vector<ZapRequest> TakeExpired(absl::Time now);

  size_t size() const { return held_.size(); }
  // How many are held from `address`.
  size_t held_from(absl::string_view address) const;

 private:
  void Insert(ZapRequest request);
  ZapRequest Remove(std::map<uint64_t, ZapRequest>::iterator it);
  // Moves `address` from holding `from` requests to `to` in by_count_.
  void Recount(const std::string& address, size_t from, size_t to);

  const Limits limits_;
  uint64_t next_seq_ = 1;
  std::map<uint64_t, ZapRequest> held_;  // by seq: arrival order
  // Each address's held requests (their seqs); no empty entry.
  absl::flat_hash_map<std::string, std::set<uint64_t>> of_;
  std::set<std::pair<size_t, std::string>> by_count_;  // (held, address)
  // The held requests claiming each key (their seqs); no empty entry.
  absl::flat_hash_map<std::string, std::set<uint64_t>> of_key_;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_ZAP_HOLD_QUEUE_H_

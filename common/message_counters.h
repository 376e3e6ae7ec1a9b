// MessageCounters: messages and bytes a transport sent and received, by
// command (tessera_messages_{sent,received}_total and
// tessera_{sent,received}_bytes_total{command="KV_PUSH"}). The series are made
// once, for every command of the wire protocol, so counting is two relaxed
// atomic additions and no lookup.
//
//   MessageCounters counters(&MetricsRegistry::Global());
//   counters.Sent(msg.header.command(), header_bytes + data_bytes);
//
// Thread-safety: thread-safe.
#ifndef TESSERA_COMMON_MESSAGE_COUNTERS_H_
#define TESSERA_COMMON_MESSAGE_COUNTERS_H_

#include <array>
#include <cstdint>

#include "common/metrics.h"
#include "common/transport.h"
#include "proto/tessera.pb.h"

namespace tessera {

class MessageCounters {
 public:
  explicit MessageCounters(MetricsRegistry* registry);

  // `bytes`: the header frame and every data frame (what crosses the wire
  // before the transport's own framing and encryption).
  void Sent(int command, uint64_t bytes) { Count(sent_, command, bytes); }
  void Received(int command, uint64_t bytes) {
    Count(received_, command, bytes);
  }

 private:
  // Commands are small numbers (tessera.proto); anything else counts as
  // "other".
  static constexpr int kSlots = 64;
  struct Series {
    Counter* messages = nullptr;
    Counter* bytes = nullptr;
  };
  using Table = std::array<Series, kSlots + 1>;

  static void Count(Table& table, int command, uint64_t bytes) {
    Series& s = table[command >= 0 && command < kSlots &&
                              table[command].messages != nullptr
                          ? command
                          : kSlots];
    s.messages->Increment();
    s.bytes->Increment(bytes);
  }

  Table sent_;
  Table received_;
};

// Collectors of what `transport` counts itself: malformed messages dropped
// (tessera_transport_malformed_messages_total), messages dropped for a wrong
// sender and connections refused for want of the job's keys. REQUIRES:
// `transport` outlives the handles.
CollectorHandles AddTransportCollectors(MetricsRegistry* registry,
                                        const Transport* transport);

}  // namespace tessera

#endif  // TESSERA_COMMON_MESSAGE_COUNTERS_H_

#include "common/message_counters.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera {

MessageCounters::MessageCounters(MetricsRegistry* registry) {
  auto make = [registry](Table& table, const char* direction,
                         const char* verb) {
    const std::string messages =
        std::string("tessera_messages_") + direction + "_total";
    const std::string bytes =
        std::string("tessera_") + direction + "_bytes_total";
    const std::string messages_help = std::string("Messages ") + verb +
                                      " (requests and replies), by command.";
    const std::string bytes_help =
        std::string("Bytes of messages ") + verb +
        " (header and data frames, before ZeroMQ framing and encryption), by "
        "command.";
    auto series = [&](const std::string& command) {
      const MetricLabels labels = {{"command", command}};
      return Series{registry->GetCounter(messages, messages_help, labels),
                    registry->GetCounter(bytes, bytes_help, labels)};
    };
    const google::protobuf::EnumDescriptor* commands =
        wire::Command_descriptor();
    for (int i = 0; i < commands->value_count(); ++i) {
      const int number = commands->value(i)->number();
      if (number <= 0 || number >= kSlots) continue;  // CMD_UNKNOWN: "other"
      table[number] = series(commands->value(i)->name());
    }
    table[kSlots] = series("other");
  };
  make(sent_, "sent", "sent");
  make(received_, "received", "received");
}

std::string DescribeSealedDrops(const SealedDrops& d) {
  std::string out = absl::StrCat(d.total());
  const std::pair<const char*, uint64_t> reasons[] = {
      {"malformed", d.malformed},       {"unauthentic", d.unauthentic},
      {"replayed", d.replayed},         {"out of order", d.out_of_order},
      {"unknown key", d.unknown_key},   {"incomplete", d.incomplete},
      {"wrong sender", d.wrong_sender}, {"unsealed", d.unsealed},
      {"throttled", d.throttled}};
  std::string parts;
  for (const auto& [reason, n] : reasons) {
    if (n != 0)
      absl::StrAppend(&parts, parts.empty() ? "" : ", ", reason, " ", n);
  }
  if (!parts.empty()) absl::StrAppend(&out, " (", parts, ")");
  return out;
}

CollectorHandles AddTransportCollectors(MetricsRegistry* registry,
                                        const Transport* transport) {
  CollectorHandles handles;
  auto add = [&](const char* name, const char* help,
                 uint64_t (Transport::*count)() const) {
    handles.push_back(registry->AddCollector(
        name, help, MetricType::kCounter,
        [transport, count](MetricSamples* out) {
          out->push_back({{}, static_cast<double>((transport->*count)())});
        }));
  };
  add("tessera_transport_malformed_messages_total",
      "Malformed messages dropped by the transport (undecodable header, "
      "frame count or sizes that do not match).",
      &Transport::malformed_count);
  add("tessera_transport_wrong_sender_messages_total",
      "Messages dropped because their claimed sender did not match the key "
      "of their connection.",
      &Transport::wrong_sender_count);
  add("tessera_transport_refused_connections_total",
      "Connections refused for want of the job's keys.",
      &Transport::refused_connection_count);
  add("tessera_transport_unsent_dropped_total",
      "Messages taken for sending and dropped before they went out: still "
      "waiting to be sealed when their link was replaced, forgotten or "
      "closed, or discarded at the job's end; or queued in ZeroMQ for a "
      "sealed link's connection that its peer refused.",
      &Transport::unsent_dropped_count);
  add("tessera_transport_redials_total",
      "Sealed links connected again because the peer's ZAP handler refused "
      "their connection (ZeroMQ never connects a refused socket again).",
      &Transport::redial_count);
  handles.push_back(registry->AddCollector(
      "tessera_transport_sealed_dropped_total",
      "Sealed records and messages dropped before anything read them, by "
      "reason: malformed, unauthentic (failed to open: altered, another "
      "link's or another job's), replayed, out_of_order, unknown_key (no "
      "node of the table), incomplete (cut short), wrong_sender (claims "
      "another node, or a record of another node key than its connection's), "
      "unsealed (came without a seal), throttled (from a connection whose "
      "records failed to open too often lately).",
      MetricType::kCounter, [transport](MetricSamples* out) {
        const SealedDrops d = transport->sealed_drops();
        const std::pair<const char*, uint64_t> reasons[] = {
            {"malformed", d.malformed},       {"unauthentic", d.unauthentic},
            {"replayed", d.replayed},         {"out_of_order", d.out_of_order},
            {"unknown_key", d.unknown_key},   {"incomplete", d.incomplete},
            {"wrong_sender", d.wrong_sender}, {"unsealed", d.unsealed},
            {"throttled", d.throttled}};
        for (const auto& [reason, n] : reasons)
          out->push_back({{{"reason", reason}}, static_cast<double>(n)});
      }));
  return handles;
}

}  // namespace tessera

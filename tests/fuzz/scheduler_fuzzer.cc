// Fuzzes the scheduler with what nodes send it (issue #46): registrations
// (first lives, restarts, repeats, spares, elastic workers joining, turned
// away), barriers, heartbeats, goodbyes and leaves, hand-back and caught-up
// reports, acknowledgements of its notices. A Scheduler runs over a transport
// that hands it the input's messages one by one and then stops it; every
// send, connect and disconnect succeeds and goes nowhere. Nothing may crash,
// hang, or grow without bound.
//
// Input layout: byte 0 picks the job (bits 0-1: 0 two servers and two
// workers; 1 replicated, TESSERA_REPLICAS=2 over three servers, spares
// allowed; 2 elastic workers, TESSERA_ELASTIC=1:4; 3 one copy over up to four
// server ranks, TESSERA_MAX_SERVERS=4); then messages, each a 2-byte
// little-endian length and that many bytes of a serialized wire::Header. The
// seeds (corpus/scheduler) form each job and then change it.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/message.h"
#include "common/options.h"
#include "common/transport.h"
#include "scheduler/scheduler.h"

namespace {

// Hands the scheduler the messages it was given, then Cancelled (Run ends).
class ScriptTransport : public tessera::Transport {
 public:
  explicit ScriptTransport(std::deque<tessera::Message> script)
      : script_(std::move(script)) {}
  absl::StatusOr<int> Bind(const std::string&, int port) override {
    return port;
  }
  absl::Status Connect(int, const std::string&, int) override {
    return absl::OkStatus();
  }
  void Disconnect(int) override {}
  absl::Status Send(int, const tessera::Message&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<tessera::Message> Receive(absl::Duration) override {
    if (script_.empty()) return absl::CancelledError("script done");
    tessera::Message m = std::move(script_.front());
    script_.pop_front();
    return m;
  }
  uint64_t malformed_count() const override { return 0; }
  void Close() override {}

 private:
  std::deque<tessera::Message> script_;
};

tessera::Options JobOptions(int job) {
  std::map<std::string, std::string> env = {
      {"DMLC_ROLE", "scheduler"},        {"DMLC_PS_ROOT_URI", "127.0.0.1"},
      {"DMLC_PS_ROOT_PORT", "7000"},     {"DMLC_NUM_SERVER", "2"},
      {"DMLC_NUM_WORKER", "2"},          {"TESSERA_INSECURE", "1"},
      {"PS_HEARTBEAT_INTERVAL", "1000"}, {"PS_HEARTBEAT_TIMEOUT", "10000"}};
  switch (job) {
    case 1:
      env["DMLC_NUM_SERVER"] = "3";
      env["TESSERA_REPLICAS"] = "2";
      break;
    case 2:
      env["TESSERA_ELASTIC"] = "1:4";
      break;
    case 3:
      env["TESSERA_MAX_SERVERS"] = "4";
      break;
  }
  absl::StatusOr<tessera::Options> options =
      tessera::ParseOptions([&env](const std::string& name) {
        auto it = env.find(name);
        return it == env.end() ? std::optional<std::string>()
                               : std::optional<std::string>(it->second);
      });
  if (!options.ok()) {
    TESSERA_LOG(ERROR) << "fuzzer job " << job << ": " << options.status();
    abort();
  }
  return *options;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    tessera::SetLogVerbosity(-1);
    return true;
  }();
  (void)quiet;
  static const tessera::Options jobs[4] = {JobOptions(0), JobOptions(1),
                                           JobOptions(2), JobOptions(3)};
  if (size == 0) return 0;
  const int job = data[0] % 4;
  std::deque<tessera::Message> script;
  size_t at = 1;
  while (at + 2 <= size && script.size() < 256) {
    const size_t len =
        std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    at += 2;
    tessera::Message m;
    if (m.header.ParseFromArray(data + at, static_cast<int>(len)))
      script.push_back(std::move(m));
    at += len;
  }
  tessera::Scheduler scheduler(
      jobs[job], std::make_unique<ScriptTransport>(std::move(script)));
  if (!scheduler.Bind().ok()) return 0;
  (void)scheduler.Run();
  return 0;
}

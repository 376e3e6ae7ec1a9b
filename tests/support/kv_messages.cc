#include "tests/support/kv_messages.h"

#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/metrics.h"

namespace tessera::testing {

uint64_t NextRequestId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

Message KeyMessage(wire::Command cmd, int rank, uint64_t key, uint64_t length) {
  Message m;
  m.header.set_command(cmd);
  m.header.set_sender(WorkerId(rank));
  m.header.set_request_id(NextRequestId());
  m.header.set_plane(wire::DATA);
  wire::KeySlice* s = m.header.mutable_slice();
  s->set_key(key);
  s->set_length(length);
  s->set_total_length(length);
  return m;
}

Buffer Floats(const std::vector<float>& v) {
  return Buffer::CopyOf(v.data(), v.size() * sizeof(float));
}

std::vector<float> ValuesOf(const Message& m) {
  if (m.data.size() != 1) return {};
  const Buffer& b = m.data[0];
  return std::vector<float>(b.floats(), b.floats() + b.num_floats());
}

Message Init(uint64_t key, const std::vector<float>& value, bool sync) {
  Message m = KeyMessage(wire::KV_INIT, 0, key, value.size());
  m.header.mutable_kv_options()->set_sync_mode(sync);
  AddFloatFrame(&m, Floats(value));
  return m;
}

Message Push(int rank, uint64_t key, uint64_t seq,
             const std::vector<float>& grad, wire::Command cmd) {
  Message m = KeyMessage(cmd, rank, key, grad.size());
  m.header.set_push_seq(seq);
  AddFloatFrame(&m, Floats(grad));
  return m;
}

Message Pull(int rank, uint64_t key, uint64_t length, uint64_t push_seq) {
  Message m = KeyMessage(wire::KV_PULL, rank, key, length);
  m.header.set_push_seq(push_seq);
  return m;
}

Message SetOptimizer(const std::string& spec) {
  Message m;
  m.header.set_command(wire::KV_SET_OPTIMIZER);
  m.header.set_sender(WorkerId(0));
  m.header.set_request_id(NextRequestId());
  m.header.mutable_kv_options()->set_optimizer_spec(spec);
  return m;
}

Message SetTwoBit(float threshold) {
  Message m;
  m.header.set_command(wire::KV_SET_COMPRESSION);
  m.header.set_sender(WorkerId(0));
  m.header.set_request_id(NextRequestId());
  m.header.mutable_kv_options()->set_compression_type("2bit");
  m.header.mutable_kv_options()->set_compression_threshold(threshold);
  return m;
}

double MetricValue(const std::string& series, double absent) {
  for (absl::string_view line :
       absl::StrSplit(MetricsRegistry::Global().TextExposition(), '\n')) {
    if (!absl::StartsWith(line, series + " ")) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
  }
  return absent;
}

}  // namespace tessera::testing

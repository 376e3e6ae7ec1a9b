// Fuzzes the sealed record layer's receiving end (common/sealed_link.h), the
// first code a secured node runs on bytes from its sealed lane. Two kinds of
// input reach it: records made up byte by byte (the prefix checks, parking,
// replay checks; their tags never verify), and records sealed with the link's
// real key around fuzzed headers and data (after authentication: header
// parsing, frame assembly across records, sizes that do not match), with a
// byte of one record flipped now and then. Nothing may crash, hang or leak,
// and a message that comes out must have the frames its header describes.
//
// Input: a sequence of operations, each one byte then its operands.
//   0: a raw record: 2-byte little-endian length, that many bytes
//   1: a sealed message: 1-byte header length, the header, 2-byte data
//      length, the data (cut into frames of up to 3 parts), 1 byte: which
//      record to flip a bit in (0: none)
//   2: a new link (a new sealer with the next link number)
//   3: the sender's key leaves the directory, or comes back
//   4: release parked records
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/logging.h"
#include "common/sealed_link.h"

namespace tessera::sealed {
namespace {

constexpr int kSender = 9;

Key32 Fill(uint8_t v) {
  Key32 k;
  k.fill(v);
  return k;
}

class Sink : public RecordSink {
 public:
  uint8_t* Allocate(size_t size) override {
    records.emplace_back(std::make_shared<std::vector<uint8_t>>(size));
    return records.back()->data();
  }
  absl::Status Emit() override { return absl::OkStatus(); }
  std::vector<std::shared_ptr<std::vector<uint8_t>>> records;
};

struct Input {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool Take(size_t n, const uint8_t** out) {
    if (size - at < n) return false;
    *out = data + at;
    at += n;
    return true;
  }
  bool Byte(uint8_t* out) {
    const uint8_t* p;
    if (!Take(1, &p)) return false;
    *out = *p;
    return true;
  }
  bool Short(size_t* out) {
    const uint8_t* p;
    if (!Take(2, &p)) return false;
    *out = p[0] | (p[1] << 8);
    return true;
  }
};

void Feed(SealedReceiver& receiver, const std::vector<uint8_t>& bytes) {
  auto owned = std::make_shared<std::vector<uint8_t>>(bytes);
  Record r;
  r.data = owned->data();
  r.size = owned->size();
  r.owner = owned;
  r.connection_role = Role::kWorker;
  std::vector<Message> ready;
  receiver.Accept(std::move(r), &ready);
  for (const Message& m : ready) {
    // What comes out is whole.
    if (static_cast<size_t>(m.header.frames_size()) != m.data.size()) abort();
    for (size_t i = 0; i < m.data.size(); ++i) {
      if (m.header.frames(static_cast<int>(i)).num_bytes() != m.data[i].size())
        abort();
      // Every byte is read (ASan checks the frame's memory).
      uint8_t sum = 0;
      for (size_t b = 0; b < m.data[i].size(); ++b) sum ^= m.data[i].data()[b];
      static volatile uint8_t sink;
      sink = sum;
    }
    (void)DebugString(m);
  }
}

}  // namespace
}  // namespace tessera::sealed

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera::sealed;
  static bool quiet = [] {
    tessera::SetLogVerbosity(-1);
    return true;
  }();
  (void)quiet;
  static const NodeKey worker = NodeKey::FromSecret(Fill(3));
  static const NodeKey server = NodeKey::FromSecret(Fill(5));
  // Role keys: X25519 pairs made from fixed secrets.
  static const std::array<NodeKey, 3> roles = {NodeKey::FromSecret(Fill(7)),
                                               NodeKey::FromSecret(Fill(9)),
                                               NodeKey::FromSecret(Fill(11))};
  static const std::array<Key32, 3> publics = {
      roles[0].public_key(), roles[1].public_key(), roles[2].public_key()};
  static const std::shared_ptr<const LinkKeys> worker_keys =
      std::make_shared<const LinkKeys>(
          *LinkKeys::Make(worker, tessera::Role::kWorker, Fill(11), publics));
  static const std::shared_ptr<const LinkKeys> server_keys =
      std::make_shared<const LinkKeys>(
          *LinkKeys::Make(server, tessera::Role::kServer, Fill(9), publics));
  static PeerSecrets to_server = [] {
    PeerSecrets p;
    (void)worker_keys->ForPeer(server.public_key(), &p);
    return p;
  }();

  SealedReceiver::Options o;
  o.keys = server_keys;
  o.limits.max_message_bytes = 1 << 16;
  o.max_parked = 8;
  o.park_time = absl::ZeroDuration();
  SealedReceiver receiver(std::move(o));
  (void)receiver.SetPeer(kSender, tessera::Role::kWorker, worker.public_key());
  bool known = true;
  uint32_t link = 1;
  auto new_sealer = [&] {
    return std::make_unique<Sealer>(
        tessera::Role::kWorker, worker.public_key(), link,
        worker_keys->SendingSecret(to_server, tessera::Role::kServer,
                                   server.public_key(), link),
        /*record_bytes=*/64, /*rekey_bytes=*/512);
  };
  std::unique_ptr<Sealer> sealer = new_sealer();

  Input in{data, size};
  uint8_t op;
  while (in.Byte(&op)) {
    switch (op % 5) {
      case 0: {
        size_t n;
        const uint8_t* bytes;
        if (!in.Short(&n)) return 0;
        n = std::min(n, in.size - in.at);
        if (!in.Take(n, &bytes)) return 0;
        std::vector<uint8_t> record(bytes, bytes + n);
        // Half of them get a well-formed prefix for the known key.
        if (op & 8 && record.size() >= kRecordOverhead) {
          Prefix p;
          p.flags = static_cast<uint8_t>(op >> 4) & 3;
          p.role = tessera::Role::kWorker;
          p.node_key = worker.public_key();
          p.link = link;
          p.seq = sealer->next_seq();
          p.length = static_cast<uint32_t>(record.size() - kRecordOverhead);
          EncodePrefix(p, record.data());
        }
        tessera::sealed::Feed(receiver, record);
        break;
      }
      case 1: {
        uint8_t header_size, flip;
        size_t data_size;
        const uint8_t *header, *body;
        if (!in.Byte(&header_size) || !in.Take(header_size, &header) ||
            !in.Short(&data_size)) {
          return 0;
        }
        data_size = std::min(data_size, in.size - in.at);
        if (!in.Take(data_size, &body) || !in.Byte(&flip)) return 0;
        std::vector<tessera::Buffer> frames;
        const size_t cut = data_size / 3;
        for (size_t start = 0, part = 0; part < 3; ++part) {
          const size_t end = part == 2 ? data_size : start + cut;
          frames.push_back(tessera::Buffer::CopyOf(body + start, end - start));
          start = end;
        }
        Sink sink;
        (void)sealer->Seal(absl::Span<const uint8_t>(header, header_size),
                           frames, sink);
        for (size_t r = 0; r < sink.records.size(); ++r) {
          std::vector<uint8_t> record = *sink.records[r];
          if (flip != 0 && r == (flip >> 3) % sink.records.size())
            record[(flip * 131u) % record.size()] ^= 1u << (flip & 7);
          tessera::sealed::Feed(receiver, record);
        }
        break;
      }
      case 2:
        ++link;
        sealer = new_sealer();
        break;
      case 3:
        if (known) {
          receiver.RemovePeer(kSender);
        } else {
          (void)receiver.SetPeer(kSender, tessera::Role::kWorker,
                                 worker.public_key());
        }
        known = !known;
        break;
      case 4: {
        std::vector<tessera::Message> ready;
        receiver.ReleaseParked(&ready);
        break;
      }
    }
  }
  return 0;
}

// seal_bench: what sealing and opening a message costs one core (the record
// layer of common/sealed_link.h, AES-256-GCM through OpenSSL), beside memcpy
// of the same bytes in the same run.
//
//   seal_bench [--sizes=4K,64K,1M,16M] [--records=64K,256K,1M] [--seconds=0.3]
//
// For each message size and record size it prints GB/s of plaintext for:
//   seal   the sender's work: every record allocated (as ZeroMQ does for a
//          message) and sealed from the caller's frame
//   open   the receiver's work: every record opened, the header's in place
//          and the data straight into the message's frames
//   memcpy one copy of the frame into fresh memory
// and the AES-256-GCM rate of `openssl speed`'s loop for reference (one
// record's worth, in place, no allocation).
#include <openssl/opensslv.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/curve_keys.h"
#include "common/sealed_link.h"

namespace tessera::sealed {
namespace {

using Clock = std::chrono::steady_clock;

bool ParseSize(absl::string_view text, size_t* out) {
  size_t scale = 1;
  if (!text.empty() && (text.back() == 'K' || text.back() == 'k'))
    scale = 1 << 10;
  if (!text.empty() && (text.back() == 'M' || text.back() == 'm'))
    scale = 1 << 20;
  if (scale != 1) text.remove_suffix(1);
  uint64_t n = 0;
  if (!absl::SimpleAtoi(text, &n) || n == 0) return false;
  *out = static_cast<size_t>(n) * scale;
  return true;
}

bool ParseList(absl::string_view text, std::vector<size_t>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    size_t n;
    if (!ParseSize(part, &n)) return false;
    out->push_back(n);
  }
  return !out->empty();
}

// Keeps every record of one message, each in memory of its own. The memory
// is kept from one pass to the next, as the transport reuses its record
// blocks (a fresh mapping per record would time page faults, not sealing).
class KeepSink : public RecordSink {
 public:
  uint8_t* Allocate(size_t size) override {
    if (used_ == records.size() || capacity_[used_] < size) {
      auto block = std::shared_ptr<uint8_t[]>(new uint8_t[size]);
      std::memset(block.get(), 0, size);
      if (used_ == records.size()) {
        records.push_back(block);
        capacity_.push_back(size);
        sizes.push_back(size);
      } else {
        records[used_] = block;
        capacity_[used_] = size;
      }
    }
    sizes[used_] = size;
    return records[used_++].get();
  }
  absl::Status Emit() override { return absl::OkStatus(); }
  void Clear() { used_ = 0; }
  size_t count() const { return used_; }
  std::vector<std::shared_ptr<uint8_t[]>> records;
  std::vector<size_t> sizes;

 private:
  std::vector<size_t> capacity_;
  size_t used_ = 0;
};

// Runs `body` until `seconds` pass (at least 3 times); GB/s of `bytes` each.
template <typename Body>
double Rate(double seconds, size_t bytes, Body body) {
  int runs = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  while (runs < 3 || elapsed < seconds) {
    body();
    ++runs;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return static_cast<double>(bytes) * runs / elapsed / 1e9;
}

int Main(int argc, char** argv) {
  std::vector<size_t> sizes = {4 << 10, 64 << 10, 1 << 20, 16 << 20};
  std::vector<size_t> record_sizes = {64 << 10, 256 << 10, 1 << 20};
  double seconds = 0.3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool ok = true;
    if (a.rfind("--sizes=", 0) == 0) {
      ok = ParseList(a.substr(8), &sizes);
    } else if (a.rfind("--records=", 0) == 0) {
      ok = ParseList(a.substr(10), &record_sizes);
    } else if (a.rfind("--seconds=", 0) == 0) {
      ok = absl::SimpleAtod(a.substr(10), &seconds) && seconds > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "seal_bench: bad flag '%s'; expected --sizes=4K,1M "
                   "--records=64K,256K --seconds=0.3\n",
                   a.c_str());
      return 2;
    }
  }
  const JobKeySet keys = GenerateJobKeys().value();
  const NodeKey worker = NodeKey::Generate(), server = NodeKey::Generate();
  std::array<Key32, 3> publics;
  for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker})
    publics[static_cast<int>(r)] = *KeyFromZ85(keys.of(r).public_key);
  auto keys_of = [&](Role role, const NodeKey& node) {
    return std::make_shared<const LinkKeys>(*LinkKeys::Make(
        node, role, *KeyFromZ85(keys.of(role).secret_key), publics));
  };
  const std::shared_ptr<const LinkKeys> worker_keys =
      keys_of(Role::kWorker, worker);
  const std::shared_ptr<const LinkKeys> server_keys =
      keys_of(Role::kServer, server);
  PeerSecrets to_server;
  if (!worker_keys->ForPeer(server.public_key(), &to_server)) return 1;
  const Key32 secret = worker_keys->SendingSecret(to_server, Role::kServer,
                                                  server.public_key(), 1);

  std::printf(
      "seal_bench: one core, AES-256-GCM (OpenSSL %s); GB/s of "
      "plaintext\n",
      OPENSSL_VERSION_STR);
  std::printf("%-10s %-10s %10s %10s %10s %12s\n", "message", "record", "seal",
              "open", "memcpy", "aes in place");
  for (size_t size : sizes) {
    Buffer frame = Buffer::Allocate(size);
    for (size_t i = 0; i < size; ++i) frame.mutable_data()[i] = uint8_t(i * 7);
    Message msg;
    msg.header.set_command(wire::KV_PUSH);
    msg.header.set_sender(9);
    msg.header.set_recipient(8);
    msg.header.set_request_id(1);
    msg.header.set_plane(wire::DATA);
    msg.header.mutable_slice()->set_key(3);
    msg.header.mutable_slice()->set_length(size / 4);
    AddFloatFrame(&msg, frame);
    const std::string header = msg.header.SerializeAsString();
    const absl::Span<const uint8_t> header_span(
        reinterpret_cast<const uint8_t*>(header.data()), header.size());
    for (size_t record : record_sizes) {
      Sealer sealer(Role::kWorker, worker.public_key(), 1, secret, record);
      KeepSink sink;
      const double seal = Rate(seconds, size, [&] {
        sink.Clear();
        (void)sealer.Seal(header_span, msg.data, sink);
      });
      // Open: a fresh receiver per pass would count key derivation; instead
      // one link, fed one sealed copy of the message per pass.
      SealedReceiver::Options o;
      o.keys = server_keys;
      o.on_drop = [](uint64_t n, const std::string& why) {
        if (n == 1)
          std::fprintf(stderr, "seal_bench: dropped: %s\n", why.c_str());
      };
      SealedReceiver receiver(o);
      (void)receiver.SetPeer(9, Role::kWorker, worker.public_key());
      std::vector<KeepSink> passes(8);
      size_t next = passes.size();
      uint64_t opened = 0;
      auto refill = [&] {
        for (KeepSink& s : passes) {
          s.Clear();
          (void)sealer.Seal(header_span, msg.data, s);
        }
        next = 0;
      };
      double open_seconds = 0;
      int open_runs = 0;
      while (open_runs < 3 || open_seconds < seconds) {
        if (next == passes.size()) refill();
        KeepSink& s = passes[next++];
        std::vector<Message> ready;
        const auto start = Clock::now();
        for (size_t r = 0; r < s.count(); ++r) {
          Record rec;
          rec.data = s.records[r].get();
          rec.size = s.sizes[r];
          rec.owner = s.records[r];
          rec.connection_role = Role::kWorker;
          receiver.Accept(std::move(rec), &ready);
        }
        open_seconds +=
            std::chrono::duration<double>(Clock::now() - start).count();
        opened += ready.size();
        ++open_runs;
      }
      if (opened != static_cast<uint64_t>(open_runs) ||
          receiver.counts().total() != 0) {
        const DropCounts c = receiver.counts();
        std::fprintf(stderr,
                     "seal_bench: %llu of %d messages opened (dropped: %llu "
                     "unauthentic, %llu malformed, %llu replayed, %llu wrong "
                     "sender, %llu "
                     "parked)\n",
                     static_cast<unsigned long long>(opened), open_runs,
                     static_cast<unsigned long long>(c.unauthentic),
                     static_cast<unsigned long long>(c.malformed),
                     static_cast<unsigned long long>(c.replayed),
                     static_cast<unsigned long long>(c.wrong_sender),
                     static_cast<unsigned long long>(receiver.parked()));
        return 1;
      }
      const double open =
          static_cast<double>(size) * open_runs / open_seconds / 1e9;
      std::vector<uint8_t> copy;
      const double memcpy_rate = Rate(seconds, size, [&] {
        std::unique_ptr<uint8_t[]> dest(new uint8_t[size]);
        std::memcpy(dest.get(), frame.data(), size);
        copy.assign(dest.get(), dest.get() + 1);
      });
      const size_t piece = std::min(size, record);
      std::vector<uint8_t> in_place(frame.data(), frame.data() + piece);
      Cipher cipher;
      cipher.SetKey(EpochKey(secret, 0));
      uint8_t aad[kPrefixBytes] = {0}, tag[kTagBytes];
      uint64_t seq = 0;
      const double aes = Rate(seconds, piece, [&] {
        cipher.BeginSeal(0, seq++, aad, sizeof(aad));
        cipher.Update(in_place.data(), in_place.data(), piece);
        if (!cipher.EndSeal(tag)) std::abort();
      });
      std::printf("%-10zu %-10zu %10.2f %10.2f %10.2f %12.2f\n", size, record,
                  seal, open, memcpy_rate, aes);
    }
  }
  return 0;
}

}  // namespace
}  // namespace tessera::sealed

int main(int argc, char** argv) { return tessera::sealed::Main(argc, argv); }

// The receiving half of a sealed link: SealedReceiver (declared in
// common/sealed_link.h) opens records, checks their order and assembles
// messages from them; records of unknown senders are parked. The sending half,
// the keys and the cipher are in common/sealed_link.cc.
#include <openssl/evp.h>
#include <sodium.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/sealed_link.h"
#include "common/sealed_link_internal.h"
#include "common/sender_check.h"
#include "common/status_macros.h"

namespace tessera {
namespace sealed {
using internal::GetU32;
using internal::KeyText;
using internal::kLeadBytes;

namespace {
// Connections whose failed opens are remembered before old ones are
// forgotten.
constexpr size_t kMaxStrikes = 4096;
}  // namespace

struct SealedReceiver::Peer {
  int id = 0;
  Role role = Role::kWorker;
  Key32 key{};
  std::optional<PeerSecrets> secrets;  // LinkKeys::ForPeer, once needed
  bool have_link = false;
  uint32_t link = 0;
  uint32_t epoch = 0;
  uint64_t next_seq = 0;
  Key32 secret{};
  std::unique_ptr<Cipher> cipher;
  ~Peer() { WipeBytes(secret.data(), secret.size()); }
  // The message being assembled from the link's records.
  bool assembling = false;
  Message msg;
  // Writable start of each frame; null for a frame lent whole from the
  // first record, and for one no byte has reached yet: its memory is taken
  // when its first byte arrives, so that a header announcing gigabytes costs
  // nothing until they come.
  std::vector<uint8_t*> dest;
  std::vector<size_t> sizes;  // each frame's size, from the header
  size_t frame = 0;           // the frame the next byte goes to
  size_t offset = 0;          // within it
  uint64_t remaining = 0;     // bytes still to come
};

SealedReceiver::SealedReceiver(Options options)
    : options_(std::move(options)) {}

SealedReceiver::~SealedReceiver() = default;

absl::Status SealedReceiver::SetPeer(int id, Role role, const Key32& node_key,
                                     const PeerSecrets* secrets) {
  absl::MutexLock lock(&mu_);
  auto old = key_of_.find(id);
  if (old != key_of_.end() && old->second == node_key) {
    peers_.at(node_key)->role = role;
    return absl::OkStatus();
  }
  if (auto taken = peers_.find(node_key); taken != peers_.end()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "node key ", KeyText(node_key), " of node ", id, " is the key of node ",
        taken->second->id, "; kept with node ", taken->second->id));
  }
  if (old != key_of_.end()) peers_.erase(old->second);
  auto peer = std::make_unique<Peer>();
  peer->id = id;
  peer->role = role;
  peer->key = node_key;
  if (secrets != nullptr) peer->secrets = *secrets;
  peers_[node_key] = std::move(peer);
  key_of_[id] = node_key;
  directory_changed_ = true;
  return absl::OkStatus();
}

void SealedReceiver::RemovePeer(int id) {
  absl::MutexLock lock(&mu_);
  auto it = key_of_.find(id);
  if (it == key_of_.end()) return;
  peers_.erase(it->second);
  key_of_.erase(it);
}

DropCounts SealedReceiver::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

size_t SealedReceiver::parked() const {
  absl::MutexLock lock(&mu_);
  return parked_.size();
}

size_t SealedReceiver::struck_connections() const {
  absl::MutexLock lock(&mu_);
  return strikes_.size();
}

void SealedReceiver::Drop(uint64_t DropCounts::*counter,
                          const std::string& why) {
  const uint64_t n = ++(counts_.*counter);
  if (options_.on_drop) options_.on_drop(n, why);
}

void SealedReceiver::Accept(Record record, std::vector<Message>* ready) {
  absl::MutexLock lock(&mu_);
  if (directory_changed_ && !parked_.empty()) ReleaseLocked(ready);
  AcceptLocked(std::move(record), ready);
}

void SealedReceiver::ReleaseParked(std::vector<Message>* ready) {
  absl::MutexLock lock(&mu_);
  if (parked_.empty()) return;
  ReleaseLocked(ready);
}

void SealedReceiver::ReleaseLocked(std::vector<Message>* ready) {
  directory_changed_ = false;
  const absl::Time now = absl::Now();
  std::deque<Parked> still;
  std::deque<Parked> parked = std::move(parked_);
  parked_.clear();
  parked_bytes_ = 0;
  parked_of_.clear();
  for (Parked& p : parked) {
    Prefix prefix;
    (void)DecodePrefix(p.record.data, &prefix);  // checked when parked
    auto it = peers_.find(prefix.node_key);
    if (it != peers_.end()) {
      OpenCounted(p.record, prefix, *it->second, ready);
    } else if (now - p.arrived > options_.park_time) {
      Drop(&DropCounts::unknown_key,
           absl::StrCat("a record from node key ", KeyText(prefix.node_key),
                        ", which is no node of this job's table (waited ",
                        absl::FormatDuration(options_.park_time), ")"));
    } else {
      parked_bytes_ += p.record.size;
      if (p.record.connection != 0) {
        ParkedOf& of = parked_of_[p.record.connection];
        ++of.records;
        of.bytes += p.record.size;
      }
      still.push_back(std::move(p));
    }
  }
  parked_ = std::move(still);
}

void SealedReceiver::AcceptLocked(Record record, std::vector<Message>* ready) {
  if (!strikes_.empty() && Throttled(record, absl::Now())) return;
  if (record.size < kRecordOverhead) {
    Drop(&DropCounts::malformed,
         absl::StrCat("a record of ", record.size, " bytes; at least ",
                      kRecordOverhead, " are needed"));
    return;
  }
  Prefix prefix;
  if (absl::Status s = DecodePrefix(record.data, &prefix); !s.ok()) {
    Drop(&DropCounts::malformed, std::string(s.message()));
    return;
  }
  if (prefix.length != record.size - kRecordOverhead) {
    Drop(&DropCounts::malformed,
         absl::StrCat("a record of ", record.size, " bytes says it holds ",
                      prefix.length, " bytes of plaintext"));
    return;
  }
  if (prefix.role != record.connection_role) {
    Drop(&DropCounts::wrong_sender,
         absl::StrCat("a record sealed by a ", RoleName(prefix.role),
                      " came on a connection of the ",
                      RoleName(record.connection_role), " key"));
    return;
  }
  if (record.connection_key.has_value() &&
      prefix.node_key != *record.connection_key) {
    // A connection is admitted for one node key (sealed_admission.h).
    Drop(&DropCounts::wrong_sender,
         absl::StrCat("a record claiming node key ", KeyText(prefix.node_key),
                      " came on connection #", record.connection,
                      ", admitted for node key ",
                      KeyText(*record.connection_key)));
    return;
  }
  auto it = peers_.find(prefix.node_key);
  if (it == peers_.end() && options_.accept_first_scheduler &&
      prefix.role == Role::kScheduler &&
      record.connection_role == Role::kScheduler &&
      (prefix.flags & kFirst) != 0 && !key_of_.contains(kSchedulerId)) {
    auto peer = std::make_unique<Peer>();
    peer->id = kSchedulerId;
    peer->role = Role::kScheduler;
    peer->key = prefix.node_key;
    Peer& scheduler = *peer;
    peers_[prefix.node_key] = std::move(peer);
    key_of_[kSchedulerId] = prefix.node_key;
    if (!OpenCounted(record, prefix, scheduler, ready)) {
      peers_.erase(prefix.node_key);
      key_of_.erase(kSchedulerId);
    }
    return;
  }
  if (it == peers_.end()) {
    Park(std::move(record), prefix);
    return;
  }
  OpenCounted(record, prefix, *it->second, ready);
}

void SealedReceiver::Park(Record record, const Prefix& prefix) {
  if (parked_.size() >= options_.max_parked ||
      parked_bytes_ + record.size > options_.max_parked_bytes) {
    Drop(&DropCounts::unknown_key,
         absl::StrCat("a record from node key ", KeyText(prefix.node_key),
                      ", which is no node of this job's table (",
                      parked_.size(), " records already wait)"));
    return;
  }
  if (record.connection != 0) {
    ParkedOf& of = parked_of_[record.connection];
    if (of.records >= options_.max_parked_per_connection ||
        of.bytes + record.size > options_.max_parked_bytes_per_connection) {
      Drop(&DropCounts::unknown_key,
           absl::StrCat("a record from node key ", KeyText(prefix.node_key),
                        ", which is no node of this job's table (", of.records,
                        " records of its connection already "
                        "wait)"));
      return;
    }
    ++of.records;
    of.bytes += record.size;
  }
  parked_bytes_ += record.size;
  parked_.push_back({std::move(record), absl::Now()});
}

std::optional<SealedReceiver::StrikeKey> SealedReceiver::StrikeKeyOf(
    const Record& record) {
  // By connection, not by node key: the pair's admission password crosses
  // the link in the clear, so whoever read it could open a connection of
  // the peer's key and, striking that key, have the real peer's records
  // dropped unread (found by the review of 2026-11-29).
  if (record.connection != 0) return StrikeKey(record.connection, Key32{});
  return std::nullopt;
}

bool SealedReceiver::Throttled(const Record& record, absl::Time now) {
  std::optional<StrikeKey> key = StrikeKeyOf(record);
  if (!key.has_value()) return false;
  auto it = strikes_.find(*key);
  if (it == strikes_.end() || now >= it->second.blocked_until) return false;
  Strikes& s = it->second;
  if (s.logged) {
    ++counts_.throttled;  // logged once per back-off
    return true;
  }
  s.logged = true;
  Drop(&DropCounts::throttled,
       absl::StrCat("records of connection #", record.connection,
                    record.connection_key.has_value()
                        ? absl::StrCat(" (node key ",
                                       KeyText(*record.connection_key), ")")
                        : std::string(),
                    ", unread for ", absl::FormatDuration(s.current), ": ",
                    options_.max_failed_opens, " of its records failed to ",
                    "open within ",
                    absl::FormatDuration(options_.failed_open_window)));
  return true;
}

bool SealedReceiver::OpenCounted(Record& record, const Prefix& prefix,
                                 Peer& peer, std::vector<Message>* ready) {
  const uint64_t failed = counts_.unauthentic;
  const bool opened = Open(record, prefix, peer, ready);
  if (counts_.unauthentic != failed) Strike(record);
  return opened;
}

void SealedReceiver::Strike(const Record& record) {
  std::optional<StrikeKey> key = StrikeKeyOf(record);
  if (!key.has_value()) return;
  const absl::Time now = absl::Now();
  if (strikes_.size() >= kMaxStrikes && !strikes_.contains(*key)) {
    // Forget connections neither blocked nor failing lately.
    absl::erase_if(strikes_, [&](const auto& entry) {
      return now >= entry.second.blocked_until &&
             now - entry.second.window_start > options_.failed_open_window;
    });
    if (strikes_.size() >= kMaxStrikes) {
      // All of them are: the one whose block ends first (an unblocked one
      // first, the oldest failing) goes, so that the map stays bounded.
      auto oldest = strikes_.begin();
      for (auto it = strikes_.begin(); it != strikes_.end(); ++it) {
        if (std::tie(it->second.blocked_until, it->second.window_start) <
            std::tie(oldest->second.blocked_until, oldest->second.window_start))
          oldest = it;
      }
      strikes_.erase(oldest);
    }
  }
  Strikes& s = strikes_[*key];
  if (s.back_off == absl::ZeroDuration()) s.back_off = options_.first_back_off;
  if (now - s.window_start > options_.failed_open_window) {
    s.window_start = now;
    s.failures = 0;
  }
  if (++s.failures < options_.max_failed_opens) return;
  s.failures = 0;
  s.window_start = now;
  s.current = s.back_off;
  s.blocked_until = now + s.current;
  s.logged = false;
  s.back_off = std::min(s.back_off * 2, options_.max_back_off);
}

bool SealedReceiver::Open(Record& record, const Prefix& prefix, Peer& peer,
                          std::vector<Message>* ready) {
  // "worker id 9", made only when a drop is logged.
  auto from = [&peer] {
    return absl::StrCat(RoleName(peer.role), " id ", peer.id);
  };
  if (prefix.role != peer.role) {
    Drop(&DropCounts::wrong_sender,
         absl::StrCat("a record sealed as a ", RoleName(prefix.role),
                      " with the node key of ", from()));
    return false;
  }
  if (peer.have_link) {
    if (prefix.link < peer.link ||
        (prefix.link == peer.link &&
         (prefix.epoch < peer.epoch || prefix.seq < peer.next_seq))) {
      Drop(&DropCounts::replayed,
           absl::StrCat("a record from ", from(), " (link ", prefix.link,
                        ", epoch ", prefix.epoch, ", record ", prefix.seq,
                        ") already passed: the link is at link ", peer.link,
                        ", epoch ", peer.epoch, ", record ", peer.next_seq));
      return false;
    }
  }
  if ((prefix.flags & kFirst) == 0)
    return OpenNext(record, prefix, peer, ready);
  if (peer.have_link && prefix.link == peer.link &&
      prefix.epoch == peer.epoch) {
    return OpenFirst(record, prefix, peer, *peer.cipher, ready);
  }
  // A new link or epoch: a key of its own, kept only if the record opens.
  Key32 secret = peer.secret;
  if (!peer.have_link || prefix.link != peer.link) {
    // Servers link to servers in a replicated job (an update goes to the
    // slice's backups); workers never link to workers. The link's key binds
    // both node keys in order, so the two directions never share one.
    if (peer.role == options_.keys->role() && peer.role != Role::kServer) {
      Drop(&DropCounts::wrong_sender,
           absl::StrCat("a record from ", from(),
                        ": workers never link to workers"));
      return false;
    }
    if (!peer.secrets.has_value()) {
      PeerSecrets secrets;
      if (!options_.keys->ForPeer(peer.key, &secrets)) {
        Drop(&DropCounts::unauthentic,
             absl::StrCat("the node key of ", from(), " is of small order"));
        return false;
      }
      peer.secrets = secrets;
    }
    secret = options_.keys->ReceivingSecret(*peer.secrets, peer.role, peer.key,
                                            prefix.link);
  }
  auto cipher = std::make_unique<Cipher>();
  cipher->SetKey(EpochKey(secret, prefix.epoch));
  if (!OpenFirst(record, prefix, peer, *cipher, ready)) return false;
  // OpenFirst committed the sequence; commit the key.
  peer.secret = secret;
  peer.cipher = std::move(cipher);
  return true;
}

bool SealedReceiver::OpenFirst(Record& record, const Prefix& prefix, Peer& peer,
                               Cipher& cipher, std::vector<Message>* ready) {
  uint8_t* plain = record.data + kPrefixBytes;
  cipher.BeginOpen(prefix.epoch, prefix.seq, record.data, kPrefixBytes);
  cipher.Update(plain, plain, prefix.length);
  if (!cipher.EndOpen(plain + prefix.length)) {
    Drop(&DropCounts::unauthentic,
         absl::StrCat("a record that does not open (link ", prefix.link,
                      ", record ", prefix.seq, ", claimed by ",
                      RoleName(peer.role), " id ", peer.id, ")"));
    return false;
  }
  // Authentic: the link moves on whatever the record holds.
  peer.have_link = true;
  peer.link = prefix.link;
  peer.epoch = prefix.epoch;
  peer.next_seq = prefix.seq + 1;
  if (peer.assembling) {
    peer.assembling = false;
    peer.msg = Message();
    peer.dest.clear();
    Drop(&DropCounts::incomplete,
         absl::StrCat("a message from ", RoleName(peer.role), " id ", peer.id,
                      " lost its last ", peer.remaining,
                      " bytes (a new message began)"));
  }
  Message msg;
  size_t here = 0;
  uint64_t total = 0;
  if (!ReadFirstHeader(plain, prefix, peer, &msg, &here, &total)) return true;
  // Frames whole in this record are lent from it; the others get memory of
  // their own, which the next records are opened into.
  if (!LayOutFrames(record, plain + (prefix.length - here), here, peer, msg))
    return true;
  peer.msg = std::move(msg);
  peer.remaining = total - here;
  peer.assembling = true;
  if (peer.remaining == 0) Finish(peer, ready);
  return true;
}

void SealedReceiver::DropMalformed(const Peer& peer, const std::string& why) {
  Drop(&DropCounts::malformed,
       absl::StrCat("a message from ", RoleName(peer.role), " id ", peer.id,
                    ": ", why));
}

bool SealedReceiver::ReadFirstHeader(const uint8_t* plain, const Prefix& prefix,
                                     const Peer& peer, Message* msg,
                                     size_t* here, uint64_t* total) {
  const size_t length = prefix.length;
  if (length < kLeadBytes) {
    DropMalformed(peer, "its first record is too short for a header");
    return false;
  }
  const uint32_t header_size = GetU32(plain);
  const uint32_t pad = GetU32(plain + 4);
  if (pad >= 16 || uint64_t{kLeadBytes} + header_size + pad > length) {
    DropMalformed(peer,
                  absl::StrCat("a header of ", header_size, " bytes and ", pad,
                               " of padding in a record of ", length));
    return false;
  }
  if (absl::Status s = DecodeHeader(plain + kLeadBytes, header_size,
                                    options_.limits, &msg->header);
      !s.ok()) {
    DropMalformed(peer, std::string(s.message()));
    return false;
  }
  *total = 0;
  for (const wire::DataFrame& d : msg->header.frames()) {
    if (options_.max_frame_bytes >= 0 &&
        d.num_bytes() > static_cast<uint64_t>(options_.max_frame_bytes)) {
      DropMalformed(peer, absl::StrCat("a frame of ", d.num_bytes(),
                                       " bytes; this node takes at most ",
                                       options_.max_frame_bytes,
                                       " (TESSERA_MAX_MESSAGE_BYTES)"));
      return false;
    }
    *total += d.num_bytes();
  }
  *here = length - kLeadBytes - header_size - pad;
  const bool last = (prefix.flags & kLast) != 0;
  if (*here > *total || (last && *here != *total) ||
      (!last && *here == *total)) {
    DropMalformed(
        peer, absl::StrCat("its header describes ", *total,
                           " bytes of data; the first record holds ", *here,
                           last ? " and is the last" : " and is not the last"));
    return false;
  }
  return true;
}

bool SealedReceiver::LayOutFrames(const Record& record, const uint8_t* data,
                                  size_t here, Peer& peer, Message& msg) {
  std::shared_ptr<void> owner = record.owner;
  size_t at = 0;
  peer.dest.clear();
  peer.sizes.clear();
  peer.frame = msg.header.frames_size();
  peer.offset = 0;
  for (int i = 0; i < msg.header.frames_size(); ++i) {
    const size_t size = msg.header.frames(i).num_bytes();
    peer.sizes.push_back(size);
    if (at + size <= here) {
      const uint8_t* p = data + at;
      if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) {
        msg.data.push_back(Buffer::CopyOf(p, size));
      } else {
        msg.data.push_back(Buffer::Wrap(p, size, owner));
      }
      peer.dest.push_back(nullptr);
      at += size;
      continue;
    }
    const size_t present = here > at ? here - at : 0;
    if (static_cast<size_t>(i) < peer.frame) {
      peer.frame = static_cast<size_t>(i);
      peer.offset = present;
    }
    peer.dest.push_back(nullptr);
    msg.data.emplace_back();
    if (present > 0) {
      // The frame this record ends in: its memory now.
      if (!AllocateFrame(peer, msg, static_cast<size_t>(i))) return false;
      std::memcpy(peer.dest[i], data + at, present);
    }
    at += present;
  }
  return true;
}

bool SealedReceiver::AllocateFrame(Peer& peer, Message& msg, size_t i) {
  try {
    msg.data[i] = Buffer::Allocate(peer.sizes[i]);
  } catch (const std::bad_alloc&) {
    const uint64_t size = peer.sizes[i];
    peer.assembling = false;
    peer.msg = Message();
    peer.dest.clear();
    peer.sizes.clear();
    Drop(&DropCounts::malformed,
         absl::StrCat("a message from ", RoleName(peer.role), " id ", peer.id,
                      ": no memory for its frame of ", size, " bytes"));
    return false;
  }
  peer.dest[i] = msg.data[i].mutable_data();
  return true;
}

bool SealedReceiver::OpenNext(Record& record, const Prefix& prefix, Peer& peer,
                              std::vector<Message>* ready) {
  // "worker id 9", made only when a drop is logged.
  auto from = [&peer] {
    return absl::StrCat(RoleName(peer.role), " id ", peer.id);
  };
  if (!peer.assembling || prefix.link != peer.link ||
      prefix.epoch != peer.epoch || prefix.seq != peer.next_seq) {
    Drop(&DropCounts::out_of_order,
         absl::StrCat("a record from ", from(), " (link ", prefix.link,
                      ", record ", prefix.seq,
                      ") continues no message in progress"));
    return false;
  }
  if (prefix.length == 0 || prefix.length > peer.remaining) {
    Drop(&DropCounts::malformed,
         absl::StrCat("a record from ", from(), " of ", prefix.length,
                      " bytes; its message has ", peer.remaining, " to come"));
    return false;
  }
  // Opened straight into the frames; a record that fails leaves the cursor
  // where it was, and the authentic record with this number overwrites what
  // it wrote.
  Peer& p = peer;
  p.cipher->BeginOpen(prefix.epoch, prefix.seq, record.data, kPrefixBytes);
  const uint8_t* in = record.data + kPrefixBytes;
  size_t left = prefix.length;
  size_t frame = p.frame, offset = p.offset;
  while (left > 0) {
    const size_t size = p.sizes[frame];
    const size_t n = std::min(left, size - offset);
    if (n > 0 && p.dest[frame] == nullptr && !AllocateFrame(p, p.msg, frame)) {
      return false;
    }
    if (n > 0) p.cipher->Update(in, p.dest[frame] + offset, n);
    in += n;
    left -= n;
    offset += n;
    if (offset == size) {
      ++frame;
      offset = 0;
      while (frame < p.sizes.size() && p.sizes[frame] == 0) ++frame;
    }
  }
  if (!p.cipher->EndOpen(in)) {
    Drop(&DropCounts::unauthentic,
         absl::StrCat("a record that does not open (link ", prefix.link,
                      ", record ", prefix.seq, ", claimed by ", from(), ")"));
    return false;
  }
  p.next_seq = prefix.seq + 1;
  p.frame = frame;
  p.offset = offset;
  p.remaining -= prefix.length;
  const bool last = (prefix.flags & kLast) != 0;
  if (last != (p.remaining == 0)) {
    p.assembling = false;
    p.msg = Message();
    p.dest.clear();
    p.sizes.clear();
    Drop(&DropCounts::malformed,
         absl::StrCat("a message from ", from(),
                      last ? " ended before its header's size"
                           : " went on past its header's size"));
    return true;
  }
  if (p.remaining == 0) Finish(p, ready);
  return true;
}

void SealedReceiver::Finish(Peer& peer, std::vector<Message>* ready) {
  peer.assembling = false;
  peer.dest.clear();
  Message msg = std::move(peer.msg);
  peer.msg = Message();
  const wire::Header& h = msg.header;
  absl::Status allowed = CheckClaimedSender(h, peer.role);
  if (!allowed.ok()) {
    // The seal says who sent it: named, since the claimed sender may be
    // anyone's.
    allowed = absl::PermissionDeniedError(
        absl::StrCat(allowed.message(), " (sealed by ", RoleName(peer.role),
                     " id ", peer.id, ")"));
  } else if (h.sender() != peer.id) {
    allowed = absl::PermissionDeniedError(
        absl::StrCat("it claims sender ", h.sender(),
                     ", but it was sealed with the node key of ",
                     RoleName(peer.role), " id ", peer.id));
  }
  if (!allowed.ok()) {
    Drop(&DropCounts::wrong_sender,
         absl::StrCat(allowed.message(), ": ", DebugString(msg)));
    return;
  }
  ready->push_back(std::move(msg));
}

}  // namespace sealed
}  // namespace tessera

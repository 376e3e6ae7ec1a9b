#include "common/sealed_link.h"

#include <openssl/evp.h>
#include <sodium.h>
#include <zmq.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/sender_check.h"
#include "common/status_macros.h"

namespace tessera {
namespace sealed {
namespace {

constexpr char kMagic[4] = {'T', 'S', 'L', '1'};
constexpr char kLinkLabel[] = "tessera sealed link v1";
constexpr char kEpochLabel[] = "epoch";

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint8_t RoleByte(Role r) { return static_cast<uint8_t>(r); }

// The first record's plaintext opens with the header's length and the pad
// that aligns the data frames after it.
constexpr size_t kLeadBytes = 8;
size_t PadFor(size_t header_size) {
  return (16 - (kLeadBytes + header_size) % 16) % 16;
}

const EVP_CIPHER* Aes256Gcm() {
  static const EVP_CIPHER* cipher = [] {
    // Fetched once; EVP_aes_256_gcm() would fetch it on every key change.
    EVP_CIPHER* fetched = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
    return fetched != nullptr ? static_cast<const EVP_CIPHER*>(fetched)
                              : EVP_aes_256_gcm();
  }();
  return cipher;
}

std::string KeyText(const Key32& key) {
  char text[41];
  zmq_z85_encode(text, key.data(), key.size());
  return absl::StrCat(std::string(text, 8), "...");
}

}  // namespace

// --- Keys -----------------------------------------------------------------

NodeKey NodeKey::Generate() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (sodium_init() < 0) std::abort();  // no usable random source
  });
  NodeKey k;
  randombytes_buf(k.secret_.data(), k.secret_.size());
  crypto_scalarmult_base(k.public_.data(), k.secret_.data());
  return k;
}

NodeKey NodeKey::FromSecret(const Key32& secret) {
  NodeKey k;
  k.secret_ = secret;
  crypto_scalarmult_base(k.public_.data(), k.secret_.data());
  return k;
}

NodeKey::~NodeKey() { sodium_memzero(secret_.data(), secret_.size()); }

bool NodeKey::Agree(const Key32& peer, Key32* shared) const {
  return crypto_scalarmult(shared->data(), secret_.data(), peer.data()) == 0;
}

std::optional<Key32> KeyFromZ85(const std::string& z85) {
  if (z85.size() != 40) return std::nullopt;
  Key32 key;
  if (zmq_z85_decode(key.data(), z85.c_str()) == nullptr) return std::nullopt;
  return key;
}

std::string NodeKeyProblem(const std::string& key) {
  if (key.size() != 32)
    return absl::StrCat("it has ", key.size(), " bytes, not 32");
  const auto* b = reinterpret_cast<const uint8_t*>(key.data());
  if ((b[31] & 0x80) != 0) {
    return "its bit 255 is set (X25519 ignores it: the key is a twin of the "
           "one without it)";
  }
  // 2^255 - 19, little-endian: ed ff ... ff 7f.
  bool at_least_p = b[31] == 0x7f && b[0] >= 0xed;
  for (int i = 1; i < 31 && at_least_p; ++i) at_least_p = b[i] == 0xff;
  if (at_least_p) {
    return "it is not below 2^255 - 19 (X25519 reduces it: the key is a twin "
           "of a smaller one)";
  }
  // Any clamped scalar is a multiple of 8: a point of small order gives 0.
  Key32 scalar;
  scalar.fill(0x5a);
  Key32 product;
  if (crypto_scalarmult(product.data(), scalar.data(), b) != 0)
    return "it is of small order (every key agreement with it gives zero)";
  return std::string();
}

std::optional<LinkKeys> LinkKeys::Make(
    NodeKey node_key, Role role, const Key32& role_secret,
    const std::array<Key32, 3>& role_publics) {
  LinkKeys keys(std::move(node_key), role, role_secret);
  for (int r = 0; r < 3; ++r) {
    if (!keys.node_key_.Agree(role_publics[r], &keys.node_x_role_[r]))
      return std::nullopt;
  }
  return keys;
}

LinkKeys::LinkKeys(NodeKey node_key, Role role, const Key32& role_secret)
    : node_key_(std::move(node_key)), role_(role), role_secret_(role_secret) {}

LinkKeys::~LinkKeys() {
  sodium_memzero(role_secret_.data(), role_secret_.size());
  for (Key32& shared : node_x_role_)
    sodium_memzero(shared.data(), shared.size());
}

bool LinkKeys::ForPeer(const Key32& peer_key, PeerSecrets* out) const {
  return node_key_.Agree(peer_key, &out->ee) &&
         crypto_scalarmult(out->se.data(), role_secret_.data(),
                           peer_key.data()) == 0;
}

Key32 LinkKeys::SendingSecret(const PeerSecrets& peer, Role peer_role,
                              const Key32& peer_key, uint32_t link) const {
  // X25519(s_A, E_B) and X25519(e_A, S_B), A being this process.
  return DeriveLinkSecret(peer.ee, peer.se,
                          node_x_role_[static_cast<int>(peer_role)], role_,
                          public_key(), peer_role, peer_key, link);
}

Key32 LinkKeys::ReceivingSecret(const PeerSecrets& peer, Role peer_role,
                                const Key32& peer_key, uint32_t link) const {
  // The same two, B being this process: X25519(e_B, S_A), X25519(s_B, E_A).
  return DeriveLinkSecret(peer.ee, node_x_role_[static_cast<int>(peer_role)],
                          peer.se, peer_role, peer_key, role_, public_key(),
                          link);
}

Key32 DeriveLinkSecret(const Key32& ee, const Key32& es_a_b,
                       const Key32& es_b_a, Role from_role,
                       const Key32& from_key, Role to_role, const Key32& to_key,
                       uint32_t link) {
  crypto_generichash_state state;
  crypto_generichash_init(&state, nullptr, 0, 32);
  crypto_generichash_update(&state,
                            reinterpret_cast<const uint8_t*>(kLinkLabel),
                            sizeof(kLinkLabel) - 1);
  crypto_generichash_update(&state, ee.data(), ee.size());
  crypto_generichash_update(&state, es_a_b.data(), es_a_b.size());
  crypto_generichash_update(&state, es_b_a.data(), es_b_a.size());
  const uint8_t from = RoleByte(from_role), to = RoleByte(to_role);
  crypto_generichash_update(&state, &from, 1);
  crypto_generichash_update(&state, from_key.data(), from_key.size());
  crypto_generichash_update(&state, &to, 1);
  crypto_generichash_update(&state, to_key.data(), to_key.size());
  uint8_t link_bytes[4];
  PutU32(link_bytes, link);
  crypto_generichash_update(&state, link_bytes, sizeof(link_bytes));
  Key32 out;
  crypto_generichash_final(&state, out.data(), out.size());
  sodium_memzero(&state, sizeof(state));  // it hashed the link's secrets
  return out;
}

Key32 EpochKey(const Key32& link_secret, uint32_t epoch) {
  uint8_t message[sizeof(kEpochLabel) - 1 + 4];
  std::memcpy(message, kEpochLabel, sizeof(kEpochLabel) - 1);
  PutU32(message + sizeof(kEpochLabel) - 1, epoch);
  Key32 out;
  crypto_generichash(out.data(), out.size(), message, sizeof(message),
                     link_secret.data(), link_secret.size());
  return out;
}

// --- Prefix ---------------------------------------------------------------

void EncodePrefix(const Prefix& p, uint8_t out[kPrefixBytes]) {
  std::memcpy(out, kMagic, 4);
  out[4] = p.flags;
  out[5] = RoleByte(p.role);
  out[6] = out[7] = 0;
  std::memcpy(out + 8, p.node_key.data(), 32);
  PutU32(out + 40, p.link);
  PutU32(out + 44, p.epoch);
  PutU64(out + 48, p.seq);
  PutU32(out + 56, p.length);
  PutU32(out + 60, 0);
}

absl::Status DecodePrefix(const uint8_t in[kPrefixBytes], Prefix* p) {
  if (std::memcmp(in, kMagic, 4) != 0)
    return absl::InvalidArgumentError("not a sealed record (magic)");
  if ((in[4] & ~(kFirst | kLast)) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("unknown record flags ", static_cast<int>(in[4])));
  if (in[5] > RoleByte(Role::kWorker))
    return absl::InvalidArgumentError(
        absl::StrCat("unknown sender role ", static_cast<int>(in[5])));
  if (in[6] != 0 || in[7] != 0 || GetU32(in + 60) != 0)
    return absl::InvalidArgumentError("reserved prefix bytes are not zero");
  p->flags = in[4];
  p->role = static_cast<Role>(in[5]);
  std::memcpy(p->node_key.data(), in + 8, 32);
  p->link = GetU32(in + 40);
  p->epoch = GetU32(in + 44);
  p->seq = GetU64(in + 48);
  p->length = GetU32(in + 56);
  return absl::OkStatus();
}

// --- Cipher ---------------------------------------------------------------

Cipher::Cipher() : ctx_(EVP_CIPHER_CTX_new()) {}

Cipher::~Cipher() { EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(ctx_)); }

void Cipher::SetKey(const Key32& key) {
  key_ok_ = ctx_ != nullptr &&
            EVP_CipherInit_ex(static_cast<EVP_CIPHER_CTX*>(ctx_), Aes256Gcm(),
                              nullptr, key.data(), nullptr, 1) == 1;
}

namespace {
// False when OpenSSL failed (the record must then be neither sent nor taken).
bool Begin(void* ctx, uint32_t epoch, uint64_t seq, const uint8_t* aad,
           size_t aad_size, int enc) {
  uint8_t iv[12];
  PutU32(iv, epoch);
  PutU64(iv + 4, seq);
  auto* c = static_cast<EVP_CIPHER_CTX*>(ctx);
  if (EVP_CipherInit_ex(c, nullptr, nullptr, nullptr, iv, enc) != 1)
    return false;
  int out = 0;
  return EVP_CipherUpdate(c, nullptr, &out, aad, static_cast<int>(aad_size)) ==
         1;
}
}  // namespace

void Cipher::BeginSeal(uint32_t epoch, uint64_t seq, const uint8_t* aad,
                       size_t aad_size) {
  sealing_ = true;
  ok_ = key_ok_ && Begin(ctx_, epoch, seq, aad, aad_size, 1);
}

void Cipher::BeginOpen(uint32_t epoch, uint64_t seq, const uint8_t* aad,
                       size_t aad_size) {
  sealing_ = false;
  ok_ = key_ok_ && Begin(ctx_, epoch, seq, aad, aad_size, 0);
}

void Cipher::Update(const uint8_t* in, uint8_t* out, size_t size) {
  if (!ok_) return;  // the record fails at End (and ctx_ may be null)
  auto* c = static_cast<EVP_CIPHER_CTX*>(ctx_);
  // EVP counts in int; a piece is at most one record.
  while (size > 0) {
    const int n = static_cast<int>(std::min<size_t>(size, 1 << 30));
    int written = 0;
    if (EVP_CipherUpdate(c, out, &written, in, n) != 1 || written != n)
      ok_ = false;
    in += n;
    out += n;
    size -= static_cast<size_t>(n);
  }
}

bool Cipher::EndSeal(uint8_t tag[kTagBytes]) {
  auto* c = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t unused[16];
  int out = 0;
  if (!ok_ || EVP_CipherFinal_ex(c, unused, &out) != 1 ||
      EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) != 1) {
    std::memset(tag, 0, kTagBytes);
    return false;
  }
  return true;
}

bool Cipher::EndOpen(const uint8_t tag[kTagBytes]) {
  auto* c = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t expected[kTagBytes];
  std::memcpy(expected, tag, kTagBytes);
  if (!ok_ ||
      EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, kTagBytes, expected) != 1)
    return false;
  uint8_t unused[16];
  int out = 0;
  return EVP_CipherFinal_ex(c, unused, &out) > 0;
}

// --- Sealer ---------------------------------------------------------------

Sealer::Sealer(Role own_role, const Key32& own_key, uint32_t link,
               const Key32& link_secret, size_t record_bytes,
               uint64_t rekey_bytes)
    : role_(own_role),
      key_(own_key),
      link_(link),
      secret_(link_secret),
      record_bytes_(std::max<size_t>(record_bytes, 64)),
      rekey_bytes_(rekey_bytes) {
  cipher_.SetKey(EpochKey(secret_, epoch_));
}

absl::Status Sealer::SealRecord(
    uint8_t flags, absl::Span<const absl::Span<const uint8_t>> pieces,
    size_t length, RecordSink& sink) {
  uint8_t* out = sink.Allocate(kRecordOverhead + length);
  Prefix p;
  p.flags = flags;
  p.role = role_;
  p.node_key = key_;
  p.link = link_;
  p.epoch = epoch_;
  p.seq = seq_++;
  p.length = static_cast<uint32_t>(length);
  EncodePrefix(p, out);
  cipher_.BeginSeal(p.epoch, p.seq, out, kPrefixBytes);
  uint8_t* at = out + kPrefixBytes;
  for (absl::Span<const uint8_t> piece : pieces) {
    cipher_.Update(piece.data(), at, piece.size());
    at += piece.size();
  }
  if (!cipher_.EndSeal(at)) {
    // Never send what may not be ciphertext (the buffer could hold the
    // plaintext): the message fails; its receiver drops its earlier records.
    return absl::InternalError(
        "sealing a record failed in OpenSSL (AES-256-GCM); the message is "
        "not sent");
  }
  sealed_under_key_ += length;
  return sink.Emit();
}

absl::Status Sealer::SealNext(SealJob& job, RecordSink& sink) {
  static const uint8_t kZeros[16] = {0};
  if (!job.started) {
    job.started = true;
    job.data_left = 0;
    for (const Buffer& f : job.frames) job.data_left += f.size();
    job.frame = 0;
    job.offset = 0;
    // A message starts under a fresh key once this one has sealed its share.
    if (sealed_under_key_ > 0 &&
        sealed_under_key_ + job.header.size() + job.data_left > rekey_bytes_) {
      ++epoch_;
      sealed_under_key_ = 0;
      cipher_.SetKey(EpochKey(secret_, epoch_));
    }
  }
  std::vector<absl::Span<const uint8_t>> pieces;
  if (!job.header_sent) {
    job.header_sent = true;
    uint8_t lead[kLeadBytes];
    PutU32(lead, static_cast<uint32_t>(job.header.size()));
    const size_t pad = PadFor(job.header.size());
    PutU32(lead + 4, static_cast<uint32_t>(pad));
    const size_t first = kLeadBytes + job.header.size() + pad;
    pieces = {absl::Span<const uint8_t>(lead, kLeadBytes),
              absl::Span<const uint8_t>(
                  reinterpret_cast<const uint8_t*>(job.header.data()),
                  job.header.size()),
              absl::Span<const uint8_t>(kZeros, pad)};
    if (first + job.data_left <= record_bytes_) {
      // The whole message in one record.
      for (const Buffer& f : job.frames) {
        if (!f.empty()) pieces.emplace_back(f.data(), f.size());
      }
      const size_t length = first + static_cast<size_t>(job.data_left);
      job.data_left = 0;
      return SealRecord(kFirst | kLast, pieces, length, sink);
    }
    // The header alone; the data follows in records of record_bytes_.
    return SealRecord(job.data_left == 0 ? kFirst | kLast : kFirst, pieces,
                      first, sink);
  }
  const size_t length =
      static_cast<size_t>(std::min<uint64_t>(job.data_left, record_bytes_));
  size_t need = length;
  while (need > 0) {
    const Buffer& f = job.frames[job.frame];
    const size_t n = std::min(need, f.size() - job.offset);
    if (n > 0) pieces.emplace_back(f.data() + job.offset, n);
    need -= n;
    job.offset += n;
    if (job.offset == f.size()) {
      ++job.frame;
      job.offset = 0;
    }
  }
  job.data_left -= length;
  return SealRecord(job.data_left == 0 ? kLast : 0, pieces, length, sink);
}

absl::Status Sealer::Seal(absl::Span<const uint8_t> header,
                          const std::vector<Buffer>& frames, RecordSink& sink) {
  SealJob job;
  job.header.assign(reinterpret_cast<const char*>(header.data()),
                    header.size());
  job.frames = frames;
  do {
    TESSERA_RETURN_IF_ERROR(SealNext(job, sink));
  } while (!job.done());
  return absl::OkStatus();
}

// --- SealedReceiver -------------------------------------------------------

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

Sealer::~Sealer() {
  // The object's constness ends as its destruction begins.
  Key32& secret = const_cast<Key32&>(secret_);
  WipeBytes(secret.data(), secret.size());
}

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
  for (Parked& p : parked) {
    Prefix prefix;
    (void)DecodePrefix(p.record.data, &prefix);  // checked when parked
    auto it = peers_.find(prefix.node_key);
    if (it != peers_.end()) {
      Open(p.record, prefix, *it->second, ready);
    } else if (now - p.arrived > options_.park_time) {
      Drop(&DropCounts::unknown_key,
           absl::StrCat("a record from node key ", KeyText(prefix.node_key),
                        ", which is no node of this job's table (waited ",
                        absl::FormatDuration(options_.park_time), ")"));
    } else {
      parked_bytes_ += p.record.size;
      still.push_back(std::move(p));
    }
  }
  parked_ = std::move(still);
}

void SealedReceiver::AcceptLocked(Record record, std::vector<Message>* ready) {
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
    if (!Open(record, prefix, scheduler, ready)) {
      peers_.erase(prefix.node_key);
      key_of_.erase(kSchedulerId);
    }
    return;
  }
  if (it == peers_.end()) {
    if (parked_.size() >= options_.max_parked ||
        parked_bytes_ + record.size > options_.max_parked_bytes) {
      Drop(&DropCounts::unknown_key,
           absl::StrCat("a record from node key ", KeyText(prefix.node_key),
                        ", which is no node of this job's table (",
                        parked_.size(), " records already wait)"));
      return;
    }
    parked_bytes_ += record.size;
    parked_.push_back({std::move(record), absl::Now()});
    return;
  }
  Open(record, prefix, *it->second, ready);
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
  const size_t length = prefix.length;
  auto malformed =
      [&](const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        Drop(&DropCounts::malformed,
             absl::StrCat("a message from ", RoleName(peer.role), " id ",
                          peer.id, ": ", why));
      };
  if (length < kLeadBytes) {
    malformed("its first record is too short for a header");
    return true;
  }
  const uint32_t header_size = GetU32(plain);
  const uint32_t pad = GetU32(plain + 4);
  if (pad >= 16 || uint64_t{kLeadBytes} + header_size + pad > length) {
    malformed(absl::StrCat("a header of ", header_size, " bytes and ", pad,
                           " of padding in a record of ", length));
    return true;
  }
  Message msg;
  if (absl::Status s = DecodeHeader(plain + kLeadBytes, header_size,
                                    options_.limits, &msg.header);
      !s.ok()) {
    malformed(std::string(s.message()));
    return true;
  }
  uint64_t total = 0;
  for (const wire::DataFrame& d : msg.header.frames()) {
    if (options_.max_frame_bytes >= 0 &&
        d.num_bytes() > static_cast<uint64_t>(options_.max_frame_bytes)) {
      malformed(absl::StrCat(
          "a frame of ", d.num_bytes(), " bytes; this node takes at most ",
          options_.max_frame_bytes, " (TESSERA_MAX_MESSAGE_BYTES)"));
      return true;
    }
    total += d.num_bytes();
  }
  const size_t here = length - kLeadBytes - header_size - pad;
  const bool last = (prefix.flags & kLast) != 0;
  if (here > total || (last && here != total) || (!last && here == total)) {
    malformed(absl::StrCat("its header describes ", total,
                           " bytes of data; the first record holds ", here,
                           last ? " and is the last" : " and is not the last"));
    return true;
  }
  // Frames whole in this record are lent from it; the others get memory of
  // their own, which the next records are opened into.
  const uint8_t* data = plain + kLeadBytes + header_size + pad;
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
      if (!AllocateFrame(peer, msg, static_cast<size_t>(i))) return true;
      std::memcpy(peer.dest[i], data + at, present);
    }
    at += present;
  }
  peer.msg = std::move(msg);
  peer.remaining = total - here;
  peer.assembling = true;
  if (peer.remaining == 0) Finish(peer, ready);
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
  if (allowed.ok() && h.sender() != peer.id) {
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

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
#include "common/sealed_link_internal.h"
#include "common/sender_check.h"
#include "common/status_macros.h"

namespace tessera {
namespace sealed {
using internal::GetU32;
using internal::KeyText;
using internal::kLeadBytes;

namespace {

constexpr char kMagic[4] = {'T', 'S', 'L', '1'};
constexpr char kLinkLabel[] = "tessera sealed link v2";
constexpr char kEpochLabel[] = "epoch";

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint8_t RoleByte(Role r) { return static_cast<uint8_t>(r); }

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

std::optional<LinkKeys> LinkKeys::Make(NodeKey node_key, Role role,
                                       const Key32& role_secret,
                                       const std::array<Key32, 3>& role_publics,
                                       std::string job_id) {
  LinkKeys keys(std::move(node_key), role, role_secret, std::move(job_id));
  for (int r = 0; r < 3; ++r) {
    if (!keys.node_key_.Agree(role_publics[r], &keys.node_x_role_[r]))
      return std::nullopt;
  }
  return keys;
}

LinkKeys::LinkKeys(NodeKey node_key, Role role, const Key32& role_secret,
                   std::string job_id)
    : node_key_(std::move(node_key)),
      role_(role),
      job_id_(std::move(job_id)),
      role_secret_(role_secret) {}

LinkKeys::~LinkKeys() {
  sodium_memzero(role_secret_.data(), role_secret_.size());
  for (Key32& shared : node_x_role_)
    sodium_memzero(shared.data(), shared.size());
  // peers_'s PeerSecrets wipe themselves.
}

bool LinkKeys::ForPeer(const Key32& peer_key, PeerSecrets* out) const {
  {
    absl::MutexLock lock(&peers_->mu);
    auto it = peers_->secrets.find(peer_key);
    if (it != peers_->secrets.end()) {
      *out = it->second;
      return true;
    }
  }
  if (!node_key_.Agree(peer_key, &out->ee) ||
      crypto_scalarmult(out->se.data(), role_secret_.data(), peer_key.data()) !=
          0) {
    // Nothing of a half-made agreement, nor of what `out` held before, stays.
    sodium_memzero(out->ee.data(), out->ee.size());
    sodium_memzero(out->se.data(), out->se.size());
    return false;
  }
  absl::MutexLock lock(&peers_->mu);
  peers_->secrets.emplace(peer_key, *out);
  return true;
}

void LinkKeys::Forget(const Key32& peer_key) const {
  absl::MutexLock lock(&peers_->mu);
  peers_->secrets.erase(peer_key);  // PeerSecrets wipes itself
}

size_t LinkKeys::cached_peers() const {
  absl::MutexLock lock(&peers_->mu);
  return peers_->secrets.size();
}

Key32 LinkKeys::SendingSecret(const PeerSecrets& peer, Role peer_role,
                              const Key32& peer_key, uint32_t link) const {
  // X25519(s_A, E_B) and X25519(e_A, S_B), A being this process.
  return DeriveLinkSecret(peer.ee, peer.se,
                          node_x_role_[static_cast<int>(peer_role)], role_,
                          public_key(), peer_role, peer_key, link, job_id_);
}

Key32 LinkKeys::ReceivingSecret(const PeerSecrets& peer, Role peer_role,
                                const Key32& peer_key, uint32_t link) const {
  // The same two, B being this process: X25519(e_B, S_A), X25519(s_B, E_A).
  return DeriveLinkSecret(peer.ee, node_x_role_[static_cast<int>(peer_role)],
                          peer.se, peer_role, peer_key, role_, public_key(),
                          link, job_id_);
}

namespace internal {

Key32 HashTranscript(absl::string_view label,
                     std::initializer_list<const Key32*> secrets,
                     Role from_role, const Key32& from_key, Role to_role,
                     const Key32& to_key, absl::Span<const uint8_t> extra,
                     absl::string_view job_id) {
  crypto_generichash_state state;
  crypto_generichash_init(&state, nullptr, 0, 32);
  crypto_generichash_update(
      &state, reinterpret_cast<const uint8_t*>(label.data()), label.size());
  for (const Key32* secret : secrets)
    crypto_generichash_update(&state, secret->data(), secret->size());
  const uint8_t from = RoleByte(from_role), to = RoleByte(to_role);
  crypto_generichash_update(&state, &from, 1);
  crypto_generichash_update(&state, from_key.data(), from_key.size());
  crypto_generichash_update(&state, &to, 1);
  crypto_generichash_update(&state, to_key.data(), to_key.size());
  crypto_generichash_update(&state, extra.data(), extra.size());
  uint8_t job_id_length[4];
  PutU32(job_id_length, static_cast<uint32_t>(job_id.size()));
  crypto_generichash_update(&state, job_id_length, sizeof(job_id_length));
  crypto_generichash_update(
      &state, reinterpret_cast<const uint8_t*>(job_id.data()), job_id.size());
  Key32 out;
  crypto_generichash_final(&state, out.data(), out.size());
  sodium_memzero(&state, sizeof(state));  // it hashed the pair's secrets
  return out;
}

}  // namespace internal

Key32 DeriveLinkSecret(const Key32& ee, const Key32& es_a_b,
                       const Key32& es_b_a, Role from_role,
                       const Key32& from_key, Role to_role, const Key32& to_key,
                       uint32_t link, absl::string_view job_id) {
  uint8_t link_bytes[4];
  PutU32(link_bytes, link);
  return internal::HashTranscript(kLinkLabel, {&ee, &es_a_b, &es_b_a},
                                  from_role, from_key, to_role, to_key,
                                  link_bytes, job_id);
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

Sealer::~Sealer() {
  // The object's constness ends as its destruction begins.
  Key32& secret = const_cast<Key32&>(secret_);
  WipeBytes(secret.data(), secret.size());
}

}  // namespace sealed
}  // namespace tessera

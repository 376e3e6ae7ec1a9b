// SealedLink: the record layer of a secured job's data links. Messages between
// workers and servers, and from nodes to the scheduler, travel as records
// sealed with AES-256-GCM under keys that only the link's two processes can
// derive; docs/security.md gives the design and the threat model.
//
// Every process makes a node key (X25519) when it starts and never stores it.
// Its public half reaches the scheduler in the registration (over CURVE, with
// the role's key) and every peer in the node table (from the scheduler). With
// e, E a process's node key and s, S its role's CURVE key (the key file's),
// the key of the link from A to B is (Noise's KK pattern)
//
//   secret = BLAKE2b-256("tessera sealed link v2" || X25519(e_A, E_B) ||
//                        X25519(s_A, E_B) || X25519(e_A, S_B) ||
//                        A's role || E_A || B's role || E_B || link number ||
//                        length of the job id (u32) || job id)
//   key(epoch) = BLAKE2b-256(key = secret, "epoch" || epoch)
//
// The job id (TESSERA_JOB_ID, empty when unset) tells apart jobs that share
// key files: a record sealed under another job id fails to open (counted
// unauthentic), as one sealed under another job's keys does.
//
// X25519(e_A, E_B) takes A's node key: another process of A's role cannot
// speak for A. X25519(s_A, E_B) takes A's role key: a worker cannot seal as
// the scheduler (X25519 of two role keys would not do: a worker computes the
// scheduler-worker one as well as the scheduler does). X25519(e_A, S_B) takes
// B's role key to read: a node table that gave A a forged key for B (a
// compromised scheduler) does not yield the link's key. Keys are fresh per
// link (A counts the links it opens), per direction (the transcript is
// ordered) and per life of either process (node keys).
//
// A message (its serialized header, then its data frames) is cut into records
// of at most `record_bytes` of plaintext; each record is one ZeroMQ frame:
//
//   [64-byte prefix, sent in the clear and authenticated as associated data]
//     "TSL1" | flags (1 first, 2 last) | sender role | 0 0 |
//     sender node key (32) | link (u32) | epoch (u32) | sequence (u64) |
//     plaintext length (u32) | 0 0 0 0
//   [ciphertext][16-byte GCM tag]
//
// The nonce is epoch || sequence; the sequence counts the link's records, so
// no nonce repeats under a key. The first record's plaintext starts with the
// header's length, a pad length and the header, padded so that data frames
// start 16-byte aligned; a message bigger than one record sends its header in
// a record of its own, so its data frames are opened straight into place.
//
// The receiver opens a record only if it comes from a node key of its
// directory (the node table), with a sequence above every one it took from
// that link, on the link's newest number and epoch; anything else is dropped
// and counted before anything reads it, and a record that fails to open
// changes no state. The message's claimed sender must be the node the key
// belongs to.
//
// Who may connect to a sealed lane at all is the admission's business
// (sealed_admission.h): a PLAIN password of the pair of processes, derived
// from the same X25519 values as the link keys; the connection is then bound
// to the connecting process's node key (Record::connection_key), and a
// record of another key on it is dropped. A connection whose records keep
// failing to open (each may cost a key set-up) is throttled: its records are
// dropped unread for a growing back-off (Options::max_failed_opens).
//
//   NodeKey key = NodeKey::Generate();
//   Sealer sealer(Role::kWorker, key.public_key(), /*link=*/1, secret);
//   sealer.Seal(header_bytes, frames, sink);           // sink: one call per record
//   SealedReceiver receiver(options);
//   receiver.SetPeer(9, Role::kWorker, worker_key);     // from the node table
//   receiver.Accept(std::move(record), &ready);         // ready: whole messages
//
// Thread-safety: a Sealer is used by one thread at a time (its link's lock).
// SealedReceiver is thread-safe: its lock is held while a record is opened, so
// SetPeer never changes a link under it.
#ifndef TESSERA_COMMON_SEALED_LINK_H_
#define TESSERA_COMMON_SEALED_LINK_H_

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/buffer.h"
#include "common/message.h"
#include "common/options.h"
#include "common/secret_string.h"
#include "common/send_order.h"

namespace tessera {
namespace sealed {

using Key32 = std::array<uint8_t, 32>;

inline constexpr size_t kPrefixBytes = 64;
inline constexpr size_t kTagBytes = 16;
inline constexpr size_t kRecordOverhead = kPrefixBytes + kTagBytes;
inline constexpr uint8_t kFirst = 1;
inline constexpr uint8_t kLast = 2;
// Plaintext per record unless the header needs more (see Sealer).
inline constexpr size_t kDefaultRecordBytes = 256 << 10;
// A key seals at most this many bytes; then the link moves to the next epoch.
// TLS 1.3 (RFC 8446, 5.5) allows AES-GCM about 2^38 bytes per key for a 2^-57
// margin; 2^36 keeps four times below it.
inline constexpr uint64_t kRekeyBytes = uint64_t{1} << 36;

// A process's X25519 key pair, made when it starts; the secret half never
// leaves the process.
class NodeKey {
 public:
  static NodeKey Generate();
  // From a known secret (tests).
  static NodeKey FromSecret(const Key32& secret);
  NodeKey(const NodeKey&) = default;
  NodeKey& operator=(const NodeKey&) = default;
  ~NodeKey();

  const Key32& public_key() const { return public_; }
  // X25519(secret, peer); false for a peer key of small order (the shared
  // secret would be zero).
  bool Agree(const Key32& peer, Key32* shared) const;

 private:
  NodeKey() = default;
  Key32 secret_{};
  Key32 public_{};
};

// A 32-byte key from its Z85 text (key files); nullopt when it is not one.
std::optional<Key32> KeyFromZ85(const std::string& z85);

// Why `key` (raw bytes, as a registration carries it) cannot be a node key,
// or empty when it can: 32 bytes, canonical (bit 255 clear and below
// 2^255 - 19) and not of small order. X25519 ignores bit 255 and reduces
// mod 2^255 - 19, so a non-canonical key is a byte-different twin of a
// canonical one (the same secrets), and a key of small order agrees zero
// with everyone. Node keys made by NodeKey::Generate are canonical.
std::string NodeKeyProblem(const std::string& key);

// X25519 of one process's keys with one peer's node key, which both
// directions of their links use: ee = X25519(e_own, E_peer) and
// se = X25519(s_own, E_peer).
struct PeerSecrets {
  PeerSecrets() = default;
  PeerSecrets(const PeerSecrets&) = default;
  PeerSecrets& operator=(const PeerSecrets&) = default;
  ~PeerSecrets() {
    WipeBytes(ee.data(), ee.size());
    WipeBytes(se.data(), se.size());
  }
  Key32 ee{};
  Key32 se{};
};

// A process's half of every link key: its node key, its role's secret key
// and every role's public key.
class LinkKeys {
 public:
  // nullopt when a key agreement fails (a key of small order).
  // `job_id` (TESSERA_JOB_ID; empty when unset) goes into every link's
  // transcript.
  static std::optional<LinkKeys> Make(NodeKey node_key, Role role,
                                      const Key32& role_secret,
                                      const std::array<Key32, 3>& role_publics,
                                      std::string job_id = std::string());
  LinkKeys(LinkKeys&&) = default;
  LinkKeys& operator=(LinkKeys&&) = default;
  ~LinkKeys();

  const NodeKey& node_key() const { return node_key_; }
  const Key32& public_key() const { return node_key_.public_key(); }
  Role role() const { return role_; }
  const std::string& job_id() const { return job_id_; }

  // The X25519 values for a peer's node key; false for a key of small order.
  // Computed once per key and kept (a peer's sending and receiving links
  // share them): a node table names every node of the job, and a worker
  // links to the servers only, so nothing is computed for a key until a link
  // needs it (two X25519 for each of 288 table entries, in each of a 289-node
  // job's processes, were most of the CPU a sealed job spent over an
  // insecure one).
  bool ForPeer(const Key32& peer_key, PeerSecrets* out) const;
  // Drops what ForPeer kept for `peer_key` (wiped): a peer gone from the node
  // table (its process left or restarted with a new key). A later ForPeer
  // computes it again.
  void Forget(const Key32& peer_key) const;
  // How many peers' values ForPeer keeps.
  size_t cached_peers() const;
  // The secret of the link this process opens to a peer (of `peer_role`, node
  // key `peer_key`), numbered `link`; and of one a peer opens to it.
  Key32 SendingSecret(const PeerSecrets& peer, Role peer_role,
                      const Key32& peer_key, uint32_t link) const;
  Key32 ReceivingSecret(const PeerSecrets& peer, Role peer_role,
                        const Key32& peer_key, uint32_t link) const;
  // X25519(e_own, S_role): what a receiver's admission check (and link key)
  // takes of a peer's role key (sealed_admission.h).
  const Key32& node_x_role(Role role) const {
    return node_x_role_[static_cast<int>(role)];
  }

 private:
  LinkKeys(NodeKey node_key, Role role, const Key32& role_secret,
           std::string job_id);
  NodeKey node_key_;
  Role role_;
  std::string job_id_;
  Key32 role_secret_{};
  std::array<Key32, 3> node_x_role_{};  // X25519(e_own, S_r), by Role
  // ForPeer's results, by peer key (wiped with the keys).
  struct PeerCache {
    absl::Mutex mu;
    std::map<Key32, PeerSecrets> secrets ABSL_GUARDED_BY(mu);
  };
  std::unique_ptr<PeerCache> peers_ = std::make_unique<PeerCache>();
};

// The secret of the link from A to B, from the three X25519 values above
// (as either end computes them) and the transcript, which ends with the job
// id.
Key32 DeriveLinkSecret(const Key32& ee, const Key32& es_a_b,
                       const Key32& es_b_a, Role from_role,
                       const Key32& from_key, Role to_role, const Key32& to_key,
                       uint32_t link, absl::string_view job_id);
// The key of one epoch of a link.
Key32 EpochKey(const Key32& link_secret, uint32_t epoch);

// The fields of a record's prefix.
struct Prefix {
  uint8_t flags = 0;
  Role role = Role::kWorker;  // the sender's
  Key32 node_key{};           // the sender's
  uint32_t link = 0;
  uint32_t epoch = 0;
  uint64_t seq = 0;
  uint32_t length = 0;  // plaintext bytes
};
void EncodePrefix(const Prefix& p, uint8_t out[kPrefixBytes]);
// InvalidArgument for a prefix no sender writes (magic, flags, role, zero
// bytes).
absl::Status DecodePrefix(const uint8_t in[kPrefixBytes], Prefix* p);

// AES-256-GCM with one key (OpenSSL's EVP).
class Cipher {
 public:
  Cipher();
  ~Cipher();
  Cipher(const Cipher&) = delete;
  Cipher& operator=(const Cipher&) = delete;

  void SetKey(const Key32& key);
  // One record: Begin, Update for each piece of plaintext (or ciphertext,
  // with Open), then End. Pieces may be split anywhere; in and out may be the
  // same pointer.
  void BeginSeal(uint32_t epoch, uint64_t seq, const uint8_t* aad,
                 size_t aad_size);
  void BeginOpen(uint32_t epoch, uint64_t seq, const uint8_t* aad,
                 size_t aad_size);
  void Update(const uint8_t* in, uint8_t* out, size_t size);
  // Writes the tag. False when any OpenSSL call of the record (or of the
  // key's SetKey) failed: the record must not be sent.
  [[nodiscard]] bool EndSeal(uint8_t tag[kTagBytes]);
  // False when the record does not authenticate, or an OpenSSL call failed.
  bool EndOpen(const uint8_t tag[kTagBytes]);

 private:
  void* ctx_;  // EVP_CIPHER_CTX
  bool sealing_ = false;
  bool key_ok_ = false;  // SetKey succeeded
  bool ok_ = false;      // every call of the record so far succeeded
};

// Where sealed records go: Allocate gives a writable buffer for one record
// (the transport's ZeroMQ message), Emit sends the record last allocated.
class RecordSink {
 public:
  virtual ~RecordSink() = default;
  virtual uint8_t* Allocate(size_t size) = 0;
  virtual absl::Status Emit() = 0;
};

// One message on its way through a Sealer, record by record: its serialized
// header and its frames (held by reference until sealed).
struct SealJob {
  std::string header;
  std::vector<Buffer> frames;
  // Where sealing stands (the Sealer's business).
  bool started = false;
  bool header_sent = false;
  uint64_t data_left = 0;
  size_t frame = 0;
  size_t offset = 0;
  bool done() const { return started && header_sent && data_left == 0; }
  // To be sealed again from its start (on a new connection).
  void Restart() {
    started = header_sent = false;
    data_left = 0;
    frame = offset = 0;
  }
  // Where the transport's queue puts it (common/send_order.h).
  OrderTag order;
};

// The sending end of one link.
class Sealer {
 public:
  Sealer(Role own_role, const Key32& own_key, uint32_t link,
         const Key32& link_secret, size_t record_bytes = kDefaultRecordBytes,
         uint64_t rekey_bytes = kRekeyBytes);
  ~Sealer();  // wipes the link's secret

  // Seals the next record of `job` (the first call starts it) into `sink`.
  // REQUIRES: !job.done(); the link's messages go through one at a time.
  // Errors are the sink's.
  absl::Status SealNext(SealJob& job, RecordSink& sink);

  // Seals one whole message as records: `header` (serialized) and `frames`,
  // whose sizes the header describes.
  absl::Status Seal(absl::Span<const uint8_t> header,
                    const std::vector<Buffer>& frames, RecordSink& sink);

  uint32_t link() const { return link_; }
  uint32_t epoch() const { return epoch_; }
  uint64_t next_seq() const { return seq_; }

 private:
  absl::Status SealRecord(uint8_t flags,
                          absl::Span<const absl::Span<const uint8_t>> pieces,
                          size_t length, RecordSink& sink);

  const Role role_;
  const Key32 key_;
  const uint32_t link_;
  const Key32 secret_;
  const size_t record_bytes_;
  const uint64_t rekey_bytes_;
  uint32_t epoch_ = 0;
  uint64_t seq_ = 0;
  uint64_t sealed_under_key_ = 0;
  Cipher cipher_;
};

// Why records and messages were dropped.
struct DropCounts {
  uint64_t malformed = 0;  // a prefix or a message no sender writes
  uint64_t unauthentic =
      0;  // failed to open (altered, another link's, another job's)
  uint64_t replayed = 0;      // sequence, epoch or link already passed
  uint64_t out_of_order = 0;  // a continuation that is not the next record
  uint64_t unknown_key = 0;   // from a node key not (or no longer) in the table
  uint64_t incomplete = 0;    // messages cut short (their rest never came)
  uint64_t wrong_sender =
      0;  // a message whose claimed sender is not the key's node, or a record
          // of another node key than its connection's
  uint64_t throttled = 0;  // from a connection that failed too often lately
  uint64_t total() const {
    return malformed + unauthentic + replayed + out_of_order + unknown_key +
           incomplete + wrong_sender + throttled;
  }
};

// One received record: its bytes (writable: records are opened in place) and
// what keeps them alive.
struct Record {
  uint8_t* data = nullptr;
  size_t size = 0;
  std::shared_ptr<void> owner;
  // The role the record's connection authenticated as (its ZAP User-Id).
  Role connection_role = Role::kWorker;
  // Which connection it came on (numbered by the ZAP handler from 1; 0: not
  // known, as in tests that feed records by hand).
  uint64_t connection = 0;
  // The node key the connection was admitted with (a sealed lane's, whose
  // ZAP User-Id names it, sealed_admission.h): only records of that key are
  // taken from it. None on the scheduler's CURVE lane.
  std::optional<Key32> connection_key;
};

// The receiving end of every link into one process.
class SealedReceiver {
 public:
  struct Options {
    // This process's keys (required).
    std::shared_ptr<const LinkKeys> keys;
    CodecLimits limits;
    int64_t max_frame_bytes = -1;  // -1: no limit beyond `limits`
    // Records from node keys not yet in the directory wait (a peer's first
    // message can come before this process's node table); at most this many,
    // for at most this long.
    size_t max_parked = 1024;
    uint64_t max_parked_bytes = uint64_t{64} << 20;
    // ... and at most this many from one connection, so that one holder of a
    // role's password cannot fill the queue for everyone else (issue #46).
    // A legitimate connection parks only what it sends in the moment before
    // this process has the node table; a record dropped here is resent.
    size_t max_parked_per_connection = 128;
    uint64_t max_parked_bytes_per_connection = uint64_t{8} << 20;
    absl::Duration park_time = absl::Seconds(10);
    // A node takes the scheduler's node key (as id 1) from the first record
    // that opens with the scheduler's role secret, on a connection of the
    // scheduler's key: only a holder of the scheduler's role key can seal
    // one. (Its first message, a node table or an abort, comes before the
    // node could know the key; the table then names the same key.)
    bool accept_first_scheduler = false;
    // Records that fail to open cost key set-ups (a new link or epoch): a
    // connection (by its number, not its node key) whose records failed to
    // open `max_failed_opens` times within `failed_open_window` has its
    // records dropped unread (counted throttled, logged once per back-off)
    // for `first_back_off`, doubling at each new back-off up to
    // `max_back_off`. A restarted peer has a new node key: a fresh start.
    int max_failed_opens = 8;
    absl::Duration failed_open_window = absl::Seconds(10);
    absl::Duration first_back_off = absl::Seconds(1);
    absl::Duration max_back_off = absl::Seconds(64);
    // Called for each drop, with the counter's new value and why; may log.
    std::function<void(uint64_t n, const std::string& why)> on_drop;
  };

  explicit SealedReceiver(Options options);
  ~SealedReceiver();

  // The node `id` (of `role`) seals with `node_key`; replaces the key it had
  // (a restarted node), whose records are then refused. `secrets`, when
  // given, are keys().ForPeer(node_key) (else computed when the first record
  // needs them). A key another id holds is never moved: AlreadyExists naming
  // both ids, and nothing changes (a node claiming another's public key
  // would otherwise cut that node off).
  absl::Status SetPeer(int id, Role role, const Key32& node_key,
                       const PeerSecrets* secrets = nullptr);
  void RemovePeer(int id);

  // Takes one record; appends the messages it completes to `ready`.
  void Accept(Record record, std::vector<Message>* ready);
  // Opens parked records whose key is now known (in arrival order) and drops
  // those that waited too long. Cheap when nothing is parked.
  void ReleaseParked(std::vector<Message>* ready);

  DropCounts counts() const;
  size_t parked() const;
  // Connections whose failed opens are remembered (at most 4,096).
  size_t struck_connections() const;
  const Key32& own_key() const { return options_.keys->public_key(); }

 private:
  struct Peer;
  struct Parked {
    Record record;
    absl::Time arrived;
  };

  void Drop(uint64_t DropCounts::*counter, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where a connection's failed opens are counted: its number (the key
  // part stays zero).
  using StrikeKey = std::pair<uint64_t, Key32>;
  struct Strikes {
    int failures = 0;
    absl::Time window_start = absl::InfinitePast();
    absl::Time blocked_until = absl::InfinitePast();
    absl::Duration back_off;  // the next one's
    absl::Duration current;   // the one in force
    bool logged = false;      // its first drop was logged
  };
  static std::optional<StrikeKey> StrikeKeyOf(const Record& record);
  // True (the record dropped, counted) while the record's connection is
  // throttled.
  bool Throttled(const Record& record, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Open, counting a failure to open against the record's connection.
  bool OpenCounted(Record& record, const Prefix& prefix, Peer& peer,
                   std::vector<Message>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Strike(const Record& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AcceptLocked(Record record, std::vector<Message>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(std::vector<Message>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A record of a node key not (yet) in the directory: parked, or dropped
  // past the queue's bounds.
  void Park(Record record, const Prefix& prefix)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A record whose sender's key the directory has; true when it opened.
  bool Open(Record& record, const Prefix& prefix, Peer& peer,
            std::vector<Message>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool OpenFirst(Record& record, const Prefix& prefix, Peer& peer,
                 Cipher& cipher, std::vector<Message>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OpenFirst's steps: the lead and header of a first record's plaintext
  // (`here`: its data bytes; `total`: the message's), and the frames laid out
  // (lent whole from the record, or memory of their own). False: dropped as
  // malformed.
  bool ReadFirstHeader(const uint8_t* plain, const Prefix& prefix,
                       const Peer& peer, Message* msg, size_t* here,
                       uint64_t* total) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool LayOutFrames(const Record& record, const uint8_t* data, size_t here,
                    Peer& peer, Message& msg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropMalformed(const Peer& peer, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool OpenNext(Record& record, const Prefix& prefix, Peer& peer,
                std::vector<Message>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(Peer& peer, std::vector<Message>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes memory for frame `i` of `msg`, the message `peer` assembles, when
  // its first byte arrives. Without memory the message is dropped (counted
  // malformed) and false returned.
  bool AllocateFrame(Peer& peer, Message& msg, size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Key32> key_of_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key32, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  DropCounts counts_ ABSL_GUARDED_BY(mu_);
  bool directory_changed_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Parked> parked_ ABSL_GUARDED_BY(mu_);
  uint64_t parked_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  struct ParkedOf {
    size_t records = 0;
    uint64_t bytes = 0;
  };
  // By connection (none for connection 0).
  absl::flat_hash_map<uint64_t, ParkedOf> parked_of_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StrikeKey, Strikes> strikes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sealed
}  // namespace tessera

#endif  // TESSERA_COMMON_SEALED_LINK_H_

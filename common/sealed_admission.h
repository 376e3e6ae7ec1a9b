// Admission to a sealed lane (issue #46): who may open a connection to a
// worker's or server's sealed lane (sealed_link.h), decided by the node's ZAP
// handler (zap_handler.h) from the connection's PLAIN hello.
//
// A process A connecting to the sealed lane of a process B presents
//
//   username = A's role ":" Z85(E_A)
//   password = Z85(BLAKE2b-256("tessera sealed lane admission v1" ||
//                  X25519(e_A, E_B) || X25519(s_A, E_B) ||
//                  A's role || E_A || B's role || E_B ||
//                  length of the job id (u32) || job id))
//
// with e, E the processes' node keys and s, S their roles' keys, as in the
// link key (sealed_link.h). B computes the same from X25519(e_B, E_A) and
// X25519(e_B, S_A). Only A (node secret and role secret) and B can: the
// password is one pair's, for one life of each, so one read off the wire
// (PLAIN sends it in the clear) opens no other pair's lane, nor this pair's
// after either process restarts. It says nothing of the keys (a hash).
//
// B admits A when E_A is in its directory (the node table) with A's claimed
// role and the password is that pair's. The scheduler's key reaches B after
// the scheduler's first message (the node table itself), so a connection
// claiming the scheduler's role with a key B does not know is checked with
// one X25519 (the role-key term proves the scheduler's role key); the key
// then stands as the scheduler's, and other scheduler claims are refused
// without arithmetic. Failed scheduler checks are limited per source address
// (the connection's, from its ZAP request) and in all, so that no one address
// can spend the budget the real scheduler's claim needs: past
// kSchedulerFailuresPerAddressPerSecond failures from an address in a second
// its next claims are refused unchecked, and past kSchedulerFailuresPerSecond
// failures in all, every other address's are (the ceiling on the X25519
// spent). The configured scheduler address (a node's DMLC_PS_ROOT_URI,
// resolved) has its own kSchedulerFailuresPerAddressPerSecond outside the
// ceiling: failing claims from other addresses, however many, cannot hold
// the scheduler up, only failing claims from its own host (processes behind
// one address share its budget). A scheduler whose connections come from
// another address (behind NAT, another interface) is checked within the
// ceiling, which 16 flooding addresses can spend.
// A connection of any other role whose key B does not yet know waits (kWait):
// the ZAP handler holds its answer until the table names the key.
//
//   Admission admission(link_keys, "10.0.0.1");  // the scheduler's address
//   admission.SetPeer(9, Role::kWorker, key);             // from the table
//   Admission::Verdict v =
//       admission.Check(user, password, "10.0.0.7", &user_id, &why);
//
// Thread-safety: thread-safe. Check does at most two X25519 (the pair's
// password, the first time a key is claimed; a scheduler claim's check),
// outside the lock.
#ifndef TESSERA_COMMON_SEALED_ADMISSION_H_
#define TESSERA_COMMON_SEALED_ADMISSION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/sealed_link.h"

namespace tessera {
namespace sealed {

// The admission password of the pair (from, to), from X25519(e_from, E_to)
// and X25519(s_from, E_to) as the sender computes them (or X25519(e_to,
// E_from) and X25519(e_to, S_from), the receiver).
Key32 DeriveAdmission(const Key32& ee, const Key32& se, Role from_role,
                      const Key32& from_key, Role to_role, const Key32& to_key,
                      absl::string_view job_id);

// "worker:<Z85 of the node key>", and back (false for anything else).
std::string AdmissionUser(Role role, const Key32& node_key);
bool ParseAdmissionUser(absl::string_view user, Role* role, Key32* node_key);
// Z85 of a 32-byte key (40 characters).
std::string Z85Key(const Key32& key);

class Admission {
 public:
  enum class Verdict { kAdmit, kRefuse, kWait };
  // Failed scheduler checks a second: in all, and from one address.
  static constexpr int kSchedulerFailuresPerSecond = 64;
  static constexpr int kSchedulerFailuresPerAddressPerSecond = 4;

  // `scheduler_address`: the scheduler's as a connection from it shows it
  // (DMLC_PS_ROOT_URI resolved; an IPv4-mapped IPv6 address is taken as
  // the IPv4 one), whose failed scheduler checks have a budget of their own
  // outside kSchedulerFailuresPerSecond; empty: none is known.
  explicit Admission(std::shared_ptr<const LinkKeys> keys,
                     absl::string_view scheduler_address = "");

  // The node `id` (of `role`) has `node_key`. Replaces the key the id had.
  // Nothing is computed until a connection claims the key.
  void SetPeer(int id, Role role, const Key32& node_key);
  void RemovePeer(int id);

  // A PLAIN hello's credentials, from `address` (the connecting peer's, as
  // its ZAP request gives it; what failed scheduler checks are limited by).
  // kAdmit sets `user_id` (the username, which names the verified key);
  // kRefuse sets `why`.
  Verdict Check(absl::string_view user, absl::string_view password,
                absl::string_view address, std::string* user_id,
                std::string* why);

  // Changes whenever a key is added (a waiting connection may be admitted).
  uint64_t version() const { return version_.load(); }
  // The keys added after `version` (SetPeer's), into `keys`; returns the
  // version they reach. `*complete` is false (and `keys` empty) when some of
  // them are forgotten (kAddedRemembered are kept): any key may be new.
  uint64_t AddedSince(uint64_t version, std::vector<Key32>* keys,
                      bool* complete) const;
  static constexpr size_t kAddedRemembered = 4096;

  // What this process presents to `peer_key` (of `peer_role`): username
  // and password; `secrets` are keys.ForPeer(peer_key).
  static std::string User(const LinkKeys& keys);
  static SecretString Password(const LinkKeys& keys, const PeerSecrets& secrets,
                               Role peer_role, const Key32& peer_key);

 private:
  struct Known {
    int id = 0;
    Role role = Role::kWorker;
    std::string password;  // Z85 of the pair's admission key
  };
  Verdict CheckScheduler(const Key32& key, absl::string_view password,
                         absl::string_view address, std::string* why);
  // Whether a scheduler claim from `address` may be checked now (`why` set
  // when not); starts a new second's counts.
  bool MayCheckScheduler(const Key32& key, absl::string_view address,
                         absl::Time now, std::string* why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Computes the expected password of a known key of `role` the first time
  // one is needed (an X25519, outside the lock). False (`why` set) for a key
  // of small order.
  bool ExpectKnown(const Key32& key, Role role, std::string* why);
  std::string Expected(const Key32& ee, Role role, const Key32& key) const;

  const std::shared_ptr<const LinkKeys> keys_;
  const std::string scheduler_address_;  // normalized (NormalAddress)
  // Whether a claim from `address` (normalized) spends the scheduler's own
  // budget: never when no scheduler address is known (an unresolved one
  // must not exempt connections that report no address).
  bool IsSchedulerAddress(absl::string_view address) const {
    return !scheduler_address_.empty() && address == scheduler_address_;
  }
  std::atomic<uint64_t> version_{0};  // changed under mu_
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key32, Known> known_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, Key32> key_of_ ABSL_GUARDED_BY(mu_);
  // The last kAddedRemembered keys SetPeer added, with the version each
  // made.
  std::deque<std::pair<uint64_t, Key32>> added_ ABSL_GUARDED_BY(mu_);
  // The scheduler's key once a scheduler claim checked out (before the
  // table names it).
  std::optional<Key32> scheduler_ ABSL_GUARDED_BY(mu_);
  absl::Time failures_since_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int failures_ ABSL_GUARDED_BY(mu_) = 0;
  // This second's failed scheduler checks by address: at most
  // kSchedulerFailuresPerSecond entries (one per failure at most), and the
  // scheduler's address.
  absl::flat_hash_map<std::string, int> failures_of_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sealed
}  // namespace tessera

#endif  // TESSERA_COMMON_SEALED_ADMISSION_H_

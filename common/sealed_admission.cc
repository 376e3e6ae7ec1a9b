#include "common/sealed_admission.h"

#include <sodium.h>
#include <zmq.h>

#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/curve_keys.h"
#include "common/sealed_link_internal.h"

namespace tessera {
namespace sealed {
using internal::KeyText;

namespace {

constexpr char kAdmissionLabel[] = "tessera sealed lane admission v1";

// An address as failed scheduler checks are counted by: at most 64
// characters, an IPv4-mapped IPv6 address ("::ffff:10.0.0.1", an IPv4 peer
// of a dual-stack socket) as the IPv4 one.
std::string NormalAddress(absl::string_view address) {
  address = address.substr(0, 64);
  constexpr absl::string_view kMapped = "::ffff:";
  if (address.size() > kMapped.size() &&
      absl::EqualsIgnoreCase(address.substr(0, kMapped.size()), kMapped) &&
      address.find('.') != absl::string_view::npos)
    address.remove_prefix(kMapped.size());
  return std::string(address);
}

}  // namespace

Key32 DeriveAdmission(const Key32& ee, const Key32& se, Role from_role,
                      const Key32& from_key, Role to_role, const Key32& to_key,
                      absl::string_view job_id) {
  return internal::HashTranscript(kAdmissionLabel, {&ee, &se}, from_role,
                                  from_key, to_role, to_key, {}, job_id);
}

std::string Z85Key(const Key32& key) {
  char text[kZ85KeyLength + 1];
  zmq_z85_encode(text, key.data(), key.size());
  std::string out(text, kZ85KeyLength);
  sodium_memzero(text, sizeof(text));  // a password is encoded here too
  return out;
}

std::string AdmissionUser(Role role, const Key32& node_key) {
  return absl::StrCat(RoleName(role), ":", Z85Key(node_key));
}

bool ParseAdmissionUser(absl::string_view user, Role* role, Key32* node_key) {
  const size_t colon = user.find(':');
  if (colon == absl::string_view::npos) return false;
  const absl::string_view name = user.substr(0, colon);
  bool found = false;
  for (Role r : {Role::kScheduler, Role::kServer, Role::kWorker}) {
    if (name == RoleName(r)) {
      *role = r;
      found = true;
    }
  }
  if (!found) return false;
  std::optional<Key32> key = KeyFromZ85(std::string(user.substr(colon + 1)));
  if (!key.has_value()) return false;
  *node_key = *key;
  return true;
}

Admission::Admission(std::shared_ptr<const LinkKeys> keys,
                     absl::string_view scheduler_address)
    : keys_(std::move(keys)),
      scheduler_address_(scheduler_address.empty()
                             ? std::string()
                             : NormalAddress(scheduler_address)) {}

std::string Admission::User(const LinkKeys& keys) {
  return AdmissionUser(keys.role(), keys.public_key());
}

SecretString Admission::Password(const LinkKeys& keys,
                                 const PeerSecrets& secrets, Role peer_role,
                                 const Key32& peer_key) {
  Key32 k =
      DeriveAdmission(secrets.ee, secrets.se, keys.role(), keys.public_key(),
                      peer_role, peer_key, keys.job_id());
  SecretString out(Z85Key(k));
  WipeBytes(k.data(), k.size());
  return out;
}

std::string Admission::Expected(const Key32& ee, Role role,
                                const Key32& key) const {
  Key32 k =
      DeriveAdmission(ee, keys_->node_x_role(role), role, key, keys_->role(),
                      keys_->public_key(), keys_->job_id());
  std::string out = Z85Key(k);
  WipeBytes(k.data(), k.size());
  return out;
}

void Admission::SetPeer(int id, Role role, const Key32& node_key) {
  // The pair's password is computed when the first connection claims the
  // key (Check): a worker is never connected to by the table's workers.
  Known known{id, role, std::string()};
  absl::MutexLock lock(&mu_);
  if (auto old = key_of_.find(id); old != key_of_.end()) {
    if (auto it = known_.find(old->second);
        it != known_.end() && it->second.id == id) {
      WipeString(&it->second.password);
      known_.erase(it);
    }
  }
  if (id == kSchedulerId && scheduler_.has_value() && *scheduler_ != node_key) {
    // A key taken from a scheduler claim that the table does not confirm.
    if (auto it = known_.find(*scheduler_);
        it != known_.end() && it->second.id == id) {
      WipeString(&it->second.password);
      known_.erase(it);
    }
  }
  key_of_[id] = node_key;
  known_[node_key] = std::move(known);
  if (id == kSchedulerId) scheduler_ = node_key;
  added_.emplace_back(version_.fetch_add(1) + 1, node_key);
  if (added_.size() > kAddedRemembered) added_.pop_front();
}

uint64_t Admission::AddedSince(uint64_t version, std::vector<Key32>* keys,
                               bool* complete) const {
  keys->clear();
  absl::MutexLock lock(&mu_);
  const uint64_t now = version_.load();
  // Versions are consecutive: the oldest kept must be version + 1 or less.
  *complete = now == version ||
              (!added_.empty() && added_.front().first <= version + 1);
  if (!*complete) return now;
  for (auto it = added_.rbegin(); it != added_.rend() && it->first > version;
       ++it)
    keys->push_back(it->second);
  return now;
}

void Admission::RemovePeer(int id) {
  absl::MutexLock lock(&mu_);
  auto old = key_of_.find(id);
  if (old == key_of_.end()) return;
  if (auto it = known_.find(old->second);
      it != known_.end() && it->second.id == id) {
    WipeString(&it->second.password);
    known_.erase(it);
  }
  key_of_.erase(old);
}

Admission::Verdict Admission::Check(absl::string_view user,
                                    absl::string_view password,
                                    absl::string_view address,
                                    std::string* user_id, std::string* why) {
  Role role;
  Key32 key;
  if (!ParseAdmissionUser(user, &role, &key)) {
    *why = absl::StrCat("PLAIN user '", user.substr(0, 48),
                        "' names no role and node key");
    return Verdict::kRefuse;
  }
  if (!ExpectKnown(key, role, why)) return Verdict::kRefuse;
  Verdict verdict = Verdict::kWait;
  {
    absl::MutexLock lock(&mu_);
    auto it = known_.find(key);
    if (it != known_.end()) {
      if (it->second.role != role) {
        *why = absl::StrCat("node key ", KeyText(key), " is a ",
                            RoleName(it->second.role), "'s; it claims to be a ",
                            RoleName(role));
        return Verdict::kRefuse;
      }
      verdict = SamePassword(it->second.password, password) ? Verdict::kAdmit
                                                            : Verdict::kRefuse;
      if (verdict == Verdict::kRefuse) {
        *why = absl::StrCat(RoleName(role), " node key ", KeyText(key),
                            " with a password not its pair's");
      }
    }
  }
  if (verdict == Verdict::kWait && role == Role::kScheduler)
    verdict = CheckScheduler(key, password, address, why);
  if (verdict == Verdict::kAdmit) *user_id = std::string(user);
  return verdict;
}

bool Admission::ExpectKnown(const Key32& key, Role role, std::string* why) {
  {
    absl::MutexLock lock(&mu_);
    auto it = known_.find(key);
    if (it == known_.end() || it->second.role != role ||
        !it->second.password.empty())
      return true;  // unknown, a role Check refuses, or computed already
  }
  // The key agreement (kept by LinkKeys for the links too), outside the lock.
  PeerSecrets secrets;
  if (!keys_->ForPeer(key, &secrets)) {
    *why = absl::StrCat("node key ", KeyText(key), " is of small order");
    return false;
  }
  std::string expected = Expected(secrets.ee, role, key);
  absl::MutexLock lock(&mu_);
  auto it = known_.find(key);
  if (it != known_.end() && it->second.role == role &&
      it->second.password.empty()) {
    it->second.password = std::move(expected);
  } else {
    WipeString(&expected);
  }
  return true;
}

bool Admission::MayCheckScheduler(const Key32& key, absl::string_view address,
                                  absl::Time now, std::string* why) {
  if (scheduler_.has_value()) {
    *why = absl::StrCat("scheduler node key ", KeyText(key),
                        " is not the scheduler's (", KeyText(*scheduler_), ")");
    return false;
  }
  if (now - failures_since_ > absl::Seconds(1)) {
    failures_since_ = now;
    failures_ = 0;
    failures_of_.clear();
  }
  if (auto it = failures_of_.find(address);
      it != failures_of_.end() &&
      it->second >= kSchedulerFailuresPerAddressPerSecond) {
    *why = absl::StrCat("scheduler node key ", KeyText(key),
                        ", unchecked: too many failed scheduler claims from ",
                        address, " this second");
    return false;
  }
  // The scheduler's own address is not held up by the others' failures.
  if (!IsSchedulerAddress(address) &&
      failures_ >= kSchedulerFailuresPerSecond) {
    *why = absl::StrCat("scheduler node key ", KeyText(key),
                        ", unchecked: too many failed scheduler claims "
                        "this second");
    return false;
  }
  return true;
}

Admission::Verdict Admission::CheckScheduler(const Key32& key,
                                             absl::string_view password,
                                             absl::string_view address,
                                             std::string* why) {
  const std::string from = NormalAddress(address);  // a key of failures_of_
  {
    absl::MutexLock lock(&mu_);
    if (!MayCheckScheduler(key, from, absl::Now(), why))
      return Verdict::kRefuse;
  }
  // One X25519, outside the lock: the role-key term is the proof.
  Key32 ee;
  const bool agreed = keys_->node_key().Agree(key, &ee);
  std::string expected = agreed ? Expected(ee, Role::kScheduler, key) : "";
  WipeBytes(ee.data(), ee.size());
  const bool ok = agreed && SamePassword(expected, password);
  absl::MutexLock lock(&mu_);
  if (!ok) {
    if (!IsSchedulerAddress(from)) ++failures_;
    ++failures_of_[from];
    WipeString(&expected);
    *why = absl::StrCat(
        "scheduler node key ", KeyText(key),
        agreed ? " with a password not its pair's" : " of small order");
    return Verdict::kRefuse;
  }
  if (scheduler_.has_value() && *scheduler_ != key) {
    WipeString(&expected);
    *why = absl::StrCat("scheduler node key ", KeyText(key),
                        " is not the scheduler's");
    return Verdict::kRefuse;
  }
  scheduler_ = key;
  known_[key] = Known{kSchedulerId, Role::kScheduler, std::move(expected)};
  return Verdict::kAdmit;
}

}  // namespace sealed
}  // namespace tessera

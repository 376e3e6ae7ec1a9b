#include "common/curve_keys.h"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/message.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

constexpr Role kRoles[] = {Role::kScheduler, Role::kServer, Role::kWorker};
// Largest key file read: a few hundred bytes are expected.
// The scheduler's file lists every node's key: about 60 bytes a node.
constexpr size_t kMaxKeyFileBytes = 16 << 20;
// Binds the PLAIN passwords to their purpose (see PlainPassword).
constexpr char kPasswordLabel[] = "tessera auth-only password v1";

absl::Status NoCurve() {
  return absl::FailedPreconditionError(
      "this ZeroMQ library was built without CURVE security "
      "(zmq_has(\"curve\") "
      "is 0); install one built with libsodium (Debian's libzmq5), or set "
      "TESSERA_INSECURE=1");
}

bool DecodeKey(absl::string_view z85, uint8_t out[32]) {
  if (z85.size() != kZ85KeyLength) return false;
  // zmq_z85_decode wants a terminated string: a copy on the stack, wiped
  // (the text may be a secret key).
  char text[kZ85KeyLength + 1];
  std::memcpy(text, z85.data(), kZ85KeyLength);
  text[kZ85KeyLength] = '\0';
  const bool ok = zmq_z85_decode(out, text) != nullptr;
  sodium_memzero(text, sizeof(text));
  return ok;
}

std::string EncodeKey(const uint8_t key[32]) {
  char text[kZ85KeyLength + 1];
  zmq_z85_encode(text, key, 32);
  std::string out(text, kZ85KeyLength);
  sodium_memzero(text, sizeof(text));  // a password is encoded here too
  return out;
}

// The public key (Z85) of a secret one (Z85); nullopt when it is not a key.
// As zmq_curve_public, whose decoded secret stays on its stack.
std::optional<std::string> PublicOf(absl::string_view z85_secret) {
  uint8_t secret[32], pub[32];
  const bool ok = DecodeKey(z85_secret, secret) && sodium_init() >= 0 &&
                  crypto_scalarmult_base(pub, secret) == 0;
  sodium_memzero(secret, sizeof(secret));
  if (!ok) return std::nullopt;
  return EncodeKey(pub);
}

std::string KeyName(Role role) {
  return absl::StrCat(RoleName(role), "-public-key");
}

// BLAKE2b-256 of the password label and both public keys, keyed by the
// Diffie-Hellman secret of `own_secret` and `peer_public`: the client role's
// secret with the server role's public key, or the other way round.
std::optional<SecretString> Password(absl::string_view own_secret,
                                     absl::string_view peer_public,
                                     absl::string_view client_public,
                                     absl::string_view server_public) {
  uint8_t secret[32], peer[32], client[32], server[32], shared[32];
  if (!DecodeKey(own_secret, secret) || !DecodeKey(peer_public, peer) ||
      !DecodeKey(client_public, client) || !DecodeKey(server_public, server) ||
      sodium_init() < 0) {
    sodium_memzero(secret, sizeof(secret));
    return std::nullopt;
  }
  const bool ok = crypto_scalarmult(shared, secret, peer) == 0;
  sodium_memzero(secret, sizeof(secret));
  if (!ok) return std::nullopt;
  crypto_generichash_state state;
  crypto_generichash_init(&state, shared, sizeof(shared), 32);
  crypto_generichash_update(&state,
                            reinterpret_cast<const uint8_t*>(kPasswordLabel),
                            sizeof(kPasswordLabel) - 1);
  crypto_generichash_update(&state, client, 32);
  crypto_generichash_update(&state, server, 32);
  uint8_t token[32];
  crypto_generichash_final(&state, token, sizeof(token));
  sodium_memzero(&state, sizeof(state));  // keyed by the shared secret
  sodium_memzero(shared, sizeof(shared));
  SecretString out(EncodeKey(token));
  sodium_memzero(token, sizeof(token));
  return out;
}

}  // namespace

std::optional<Role> JobKeys::RoleOfKey(absl::string_view z85) const {
  for (Role r : kRoles) {
    if (public_key(r) == z85) return r;
  }
  auto it = node_keys.find(z85);
  if (it != node_keys.end()) return it->second;
  return std::nullopt;
}

bool JobKeys::IsRoleKey(absl::string_view z85) const {
  for (Role r : kRoles) {
    if (public_key(r) == z85) return true;
  }
  return false;
}

absl::StatusOr<CurveKeyPair> GenerateKeyPair() {
  if (!zmq_has("curve")) return NoCurve();
  char pub[kZ85KeyLength + 1], sec[kZ85KeyLength + 1];
  if (zmq_curve_keypair(pub, sec) != 0) {
    return absl::InternalError(
        absl::StrCat("zmq_curve_keypair: ", zmq_strerror(zmq_errno())));
  }
  CurveKeyPair pair;
  pair.public_key.assign(pub, kZ85KeyLength);
  pair.secret_key.assign(sec, kZ85KeyLength);
  sodium_memzero(sec, sizeof(sec));
  return pair;
}

absl::StatusOr<JobKeySet> GenerateJobKeys() {
  JobKeySet set;
  for (CurveKeyPair& pair : set.pairs) {
    absl::StatusOr<CurveKeyPair> made = GenerateKeyPair();
    if (!made.ok()) return made.status();
    pair = *std::move(made);
  }
  return set;
}

absl::StatusOr<NodeKeyFiles> GenerateNodeKeyFiles(const JobKeySet& set,
                                                  int num_servers,
                                                  int num_workers) {
  if (num_servers < 0 || num_workers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("node counts must not be negative, got ", num_servers,
                     " servers and ", num_workers, " workers"));
  }
  NodeKeyFiles files;
  // The node keys the scheduler lists (public), then its file in one piece:
  // a secret's text that grows leaves copies in freed memory.
  std::string roster;
  for (Role role : {Role::kServer, Role::kWorker}) {
    const int count = role == Role::kServer ? num_servers : num_workers;
    std::vector<SecretString>& out =
        role == Role::kServer ? files.servers : files.workers;
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<CurveKeyPair> own = GenerateKeyPair();
      if (!own.ok()) return own.status();
      out.push_back(SecretString(
          absl::StrCat(FormatKeyFile(set, role), "# This process's own key (",
                       RoleName(role), " ", i, ").\nnode-secret-key ",
                       own->secret_key, "\n")));
      absl::StrAppend(&roster, "node-key ", RoleName(role), " ",
                      own->public_key, "\n");
    }
  }
  files.scheduler = absl::StrCat(
      FormatKeyFile(set, Role::kScheduler),
      "# Every node's own key: a node registers with one of them.\n", roster);
  return files;
}

SecretString FormatKeyFile(const JobKeySet& set, Role role) {
  std::string publics;
  for (Role r : kRoles)
    absl::StrAppend(&publics, KeyName(r), " ", set.of(r).public_key, "\n");
  return SecretString(absl::StrCat(
      "# Tessera job keys, role ", RoleName(role),
      ". Private: keep this file mode 0600.\nrole ", RoleName(role),
      "\nsecret-key ", set.of(role).secret_key, "\n", publics));
}

namespace {

// One line of a key file (not blank, not a comment) into `keys`; `have_role`
// set by a "role" line.
absl::Status ParseKeyLine(absl::string_view line, int line_number,
                          const std::string& origin, JobKeys* keys,
                          bool* have_role) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, " line ", line_number, ": ", why));
  };
  std::vector<absl::string_view> words =
      absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
  if (words.size() == 3 && words[0] == "node-key") {
    std::optional<Role> role;
    for (Role r : kRoles) {
      if (words[1] == RoleName(r) && r != Role::kScheduler) role = r;
    }
    if (!role.has_value()) {
      return bad(absl::StrCat("node-key of role '", words[1],
                              "': expected server or worker"));
    }
    uint8_t raw_key[32];
    if (!DecodeKey(words[2], raw_key)) {
      return bad(absl::StrCat("node-key: expected a key of ", kZ85KeyLength,
                              " Z85 characters"));
    }
    if (!keys->node_keys.emplace(std::string(words[2]), *role).second)
      return bad("node-key listed twice");
    return absl::OkStatus();
  }
  if (words.size() != 2) {
    return bad(
        "expected 'NAME VALUE' (role, secret-key, "
        "scheduler-public-key, server-public-key, worker-public-key, "
        "node-secret-key) or 'node-key ROLE KEY'");
  }
  const absl::string_view name = words[0], value = words[1];
  if (name == "role") {
    bool known = false;
    for (Role r : kRoles) {
      if (value == RoleName(r)) {
        keys->role = r;
        known = true;
      }
    }
    if (!known) {
      return bad(absl::StrCat("role '", value,
                              "': expected scheduler, server or worker"));
    }
    *have_role = true;
    return absl::OkStatus();
  }
  std::string* slot = nullptr;
  if (name == "secret-key") slot = &keys->secret_key;
  if (name == "node-secret-key") slot = &keys->node_secret_key;
  for (Role r : kRoles) {
    if (name == KeyName(r)) slot = &keys->public_keys[static_cast<int>(r)];
  }
  if (slot == nullptr) return bad(absl::StrCat("unknown name '", name, "'"));
  uint8_t raw_key[32];
  if (!DecodeKey(value, raw_key)) {
    return bad(absl::StrCat(name, ": expected a key of ", kZ85KeyLength,
                            " Z85 characters"));
  }
  sodium_memzero(raw_key, sizeof(raw_key));
  // Into the slot's own storage: no temporary copy of a secret.
  slot->assign(value.data(), value.size());
  return absl::OkStatus();
}

// What a parsed key file must hold, and how its keys must relate: every
// role's public key, the node's own secret key's (derived into
// `node_public_key`), none a role's key twice or of small order.
absl::Status CheckKeys(bool have_role, const std::string& origin,
                       JobKeys* keys) {
  std::string missing;
  if (!have_role) missing = "role";
  if (keys->secret_key.empty())
    absl::StrAppend(&missing, missing.empty() ? "" : ", ", "secret-key");
  for (Role r : kRoles) {
    if (keys->public_key(r).empty())
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", KeyName(r));
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": missing ", missing));
  }
  std::optional<std::string> derived = PublicOf(keys->secret_key);
  if (!derived.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": the secret key is not a CURVE key"));
  }
  if (*derived != keys->public_key(keys->role)) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": the secret key does not belong to ",
                     KeyName(keys->role), " (keys of different jobs mixed?)"));
  }
  if (!keys->node_secret_key.empty()) {
    derived = PublicOf(keys->node_secret_key);
    if (!derived.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": node-secret-key is not a CURVE key"));
    }
    keys->node_public_key = *derived;
    if (keys->IsRoleKey(keys->node_public_key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin,
          ": node-secret-key is a role's key; a node's own must differ"));
    }
  }
  for (const auto& [key, role] : keys->node_keys) {
    if (keys->IsRoleKey(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin, ": node-key ", KeyPrefix(key), " is a role's key"));
    }
  }
  for (Role a : kRoles) {
    for (Role b : kRoles) {
      if (a < b && keys->public_key(a) == keys->public_key(b)) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ": ", KeyName(a), " and ", KeyName(b),
                         " are the same key; every role needs its own"));
      }
    }
    // Sealed links agree keys with every role's key: one of small order
    // would agree to zero.
    uint8_t secret[32], peer[32], shared[32];
    const bool agrees = DecodeKey(keys->secret_key, secret) &&
                        DecodeKey(keys->public_key(a), peer) &&
                        crypto_scalarmult(shared, secret, peer) == 0;
    sodium_memzero(secret, sizeof(secret));
    sodium_memzero(shared, sizeof(shared));
    if (!agrees) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin, ": ", KeyName(a), " is not a usable key (small order)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobKeys> ParseKeyFile(absl::string_view text,
                                     const std::string& origin) {
  JobKeys keys;
  bool have_role = false;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    TESSERA_RETURN_IF_ERROR(
        ParseKeyLine(line, line_number, origin, &keys, &have_role));
  }
  TESSERA_RETURN_IF_ERROR(CheckKeys(have_role, origin, &keys));
  return keys;
}

absl::Status WritePrivateFile(const std::string& path, absl::string_view text) {
  const int fd = ::open(
      path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    if (errno == EEXIST) {
      return absl::AlreadyExistsError(
          absl::StrCat(path, " exists; keys are never overwritten"));
    }
    return absl::UnavailableError(
        absl::StrCat("cannot create ", path, ": ", why));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(path.c_str());  // no half-written secret is left behind
      return absl::UnavailableError(
          absl::StrCat("cannot write ", path, ": ", why));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(path.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot write ", path, ": ", why));
  }
  return absl::OkStatus();
}

absl::Status WriteKeyFiles(const JobKeySet& set, const std::string& dir) {
  for (Role r : kRoles) {
    const std::string path = absl::StrCat(dir, "/", RoleName(r), ".key");
    if (absl::Status s = WritePrivateFile(path, FormatKeyFile(set, r));
        !s.ok()) {
      return s;
    }
  }
  return SyncFolder(dir);
}

namespace {

// CheckKeyFolder's judgement of a folder already stat'ed.
absl::Status CheckFolderStat(const std::string& dir, const struct stat& st) {
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a folder"));
  }
  const uid_t me = ::geteuid();
  if (st.st_uid != me && st.st_uid != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the folder %s belongs to uid %d, neither this process's user (uid "
        "%d) nor root: its owner can put files there or replace them",
        dir, st.st_uid, me));
  }
  if ((st.st_mode & 022) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the folder %s has mode %04o: its group or others can put files "
        "there or replace them; expected a folder only its owner writes "
        "(chmod go-w %s, or a folder of its own: tessera-keygen makes one "
        "mode 0700)",
        dir, st.st_mode & 07777, dir));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKeyFolder(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read the folder ", dir, ": ", std::strerror(errno)));
  }
  return CheckFolderStat(dir, st);
}

absl::Status SyncFolder(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot sync the folder ", dir, ": ", why));
  }
  ::close(fd);
  return absl::OkStatus();
}

namespace {

// A key file's mode and owner: readable by its owner only, who is this
// process's user.
absl::Status CheckKeyFileStat(const std::string& origin,
                              const std::string& path, const struct stat& st) {
  if ((st.st_mode & 077) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: mode %04o lets its group or others at the secret key; expected "
        "0600 or 0400 (chmod 600 %s)",
        origin, st.st_mode & 07777, path));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the file belongs to uid %d, not to this process's user (uid "
        "%d): a key file someone else put there is not this job's key",
        origin, st.st_uid, ::geteuid()));
  }
  return absl::OkStatus();
}

// Opens the key file at `path` for reading, its size into `st`, after the
// checks of it and its folder (CheckKeyFileStat, CheckFolderStat).
absl::StatusOr<int> OpenKeyFile(const std::string& path,
                                const std::string& origin, struct stat* st) {
  // The folder is opened first and the file through it, without following a
  // link: the folder judged below is the one the file was read from (a link,
  // or a folder renamed between the two, could otherwise lead elsewhere).
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  const std::string name =
      slash == std::string::npos ? path : path.substr(slash + 1);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ": cannot open its folder ", dir, ": ", std::strerror(errno)));
  }
  const int fd =
      name.empty()
          ? -1
          : ::openat(dir_fd, name.c_str(),
                     O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    const int err = name.empty() ? EISDIR : errno;
    ::close(dir_fd);
    if (err == ELOOP) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin,
          ": a symbolic link; expected the key file itself (a link "
          "could lead to a file in a folder others write)"));
    }
    if (err == EISDIR) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": expected a regular file"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": cannot open: ", std::strerror(err)));
  }
  absl::Cleanup close_file = [fd] { ::close(fd); };
  if (::fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
    ::close(dir_fd);
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": expected a regular file"));
  }
  struct stat folder_st;
  const bool folder_read = ::fstat(dir_fd, &folder_st) == 0;
  const int folder_errno = errno;
  ::close(dir_fd);
  TESSERA_RETURN_IF_ERROR(CheckKeyFileStat(origin, path, *st));
  if (!folder_read) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": cannot read the folder ", dir, ": ",
                     std::strerror(folder_errno)));
  }
  if (absl::Status folder = CheckFolderStat(dir, folder_st); !folder.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": ", folder.message()));
  }
  std::move(close_file).Cancel();
  return fd;
}

}  // namespace

namespace curve_keys_internal {

absl::Status ReadKeyText(int fd, const std::string& origin, std::string* text) {
  constexpr size_t kMostCapacity = kMaxKeyFileBytes + 4096 + 1;
  char buf[4096];
  absl::Cleanup wipe = [&buf] { sodium_memzero(buf, sizeof(buf)); };
  while (text->size() <= kMaxKeyFileBytes) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": cannot read: ", std::strerror(errno)));
    }
    if (n == 0) break;
    if (text->size() + static_cast<size_t>(n) > text->capacity()) {
      // More than the file's size said (a file system that does not know
      // it): a string of twice the room, the old one wiped, never a string
      // left to grow by itself.
      size_t room = std::max<size_t>(text->capacity(), 4096);
      while (room < text->size() + static_cast<size_t>(n)) room *= 2;
      std::string bigger;
      bigger.reserve(std::min(room, kMostCapacity));
      bigger.append(*text);
      WipeString(text);
      text->swap(bigger);
    }
    text->append(buf, static_cast<size_t>(n));
  }
  if (text->size() > kMaxKeyFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ": over ", kMaxKeyFileBytes, " bytes; not a key file"));
  }
  return absl::OkStatus();
}

}  // namespace curve_keys_internal

absl::StatusOr<JobKeys> ReadKeyFile(const std::string& path,
                                    const std::string& variable) {
  const std::string origin = absl::StrCat(variable, "=", path);
  struct stat st;
  TESSERA_ASSIGN_OR_RETURN(const int fd, OpenKeyFile(path, origin, &st));
  // Room for the whole file at once (outgrown only when the file system did
  // not know its size); wiped on every way out.
  std::string text;
  text.reserve(
      std::min<size_t>(static_cast<size_t>(st.st_size), kMaxKeyFileBytes) +
      4096 + 1);
  absl::Cleanup wipe = [&text] { WipeString(&text); };
  absl::Status read = curve_keys_internal::ReadKeyText(fd, origin, &text);
  ::close(fd);
  TESSERA_RETURN_IF_ERROR(read);
  return ParseKeyFile(text, origin);
}

absl::StatusOr<std::shared_ptr<const ConnectionSecurity>>
LoadConnectionSecurity(const Options& options) {
  if (options.insecure) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      TESSERA_LOG(WARNING)
          << "TESSERA_INSECURE=1: connections are neither authenticated nor "
             "encrypted; anyone who can reach this node's port can send it "
             "commands and data";
    });
    return std::shared_ptr<const ConnectionSecurity>();
  }
  std::string path, variable;
  if (!options.key_file.empty()) {
    path = options.key_file;
    variable = "TESSERA_KEY_FILE";
  } else if (!options.key_dir.empty()) {
    path = absl::StrCat(options.key_dir, "/", RoleName(options.role), ".key");
    variable = "TESSERA_KEY_DIR";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "no keys for this job's connections: set TESSERA_KEY_FILE to this ",
        RoleName(options.role),
        "'s key file or TESSERA_KEY_DIR to a folder "
        "holding ",
        RoleName(options.role),
        ".key (tessera-keygen DIR makes "
        "them; tools/launch.py does it for every job), or TESSERA_INSECURE=1 "
        "to run without authentication or encryption"));
  }
  if (!zmq_has("curve")) return NoCurve();
  absl::StatusOr<JobKeys> keys = ReadKeyFile(path, variable);
  if (!keys.ok()) return keys.status();
  if (keys->role != options.role) {
    return absl::InvalidArgumentError(absl::StrCat(
        variable, "=", path, ": keys of role ", RoleName(keys->role),
        "; this process is a ", RoleName(options.role), " (DMLC_ROLE)"));
  }
  auto security = std::make_shared<ConnectionSecurity>();
  security->keys = *std::move(keys);
  security->encrypt = !options.auth_only;
  security->job_id = options.job_id;
  TESSERA_VLOG(1) << "connections "
                  << (security->encrypt
                          ? "authenticated and encrypted (CURVE)"
                          : "authenticated, not encrypted (TESSERA_AUTH_ONLY)")
                  << " with the " << RoleName(options.role) << " key "
                  << KeyPrefix(security->keys.public_key(options.role));
  return std::shared_ptr<const ConnectionSecurity>(std::move(security));
}

SecretString PlainPassword(const JobKeys& keys, Role server) {
  const std::string& client_public = keys.public_key(keys.role);
  const std::string& server_public = keys.public_key(server);
  return Password(keys.secret_key, server_public, client_public, server_public)
      .value_or(SecretString());
}

SecretString ExpectedPlainPassword(const JobKeys& keys, Role client) {
  const std::string& client_public = keys.public_key(client);
  const std::string& server_public = keys.public_key(keys.role);
  return Password(keys.secret_key, client_public, client_public, server_public)
      .value_or(SecretString());
}

bool SamePassword(absl::string_view want, absl::string_view password) {
  if (want.empty() || password.size() != want.size()) return false;
  return sodium_memcmp(want.data(), password.data(), want.size()) == 0;
}

bool CheckPlainPassword(const JobKeys& keys, Role client,
                        absl::string_view password) {
  return SamePassword(ExpectedPlainPassword(keys, client), password);
}

std::string KeyPrefix(absl::string_view z85) {
  return absl::StrCat(z85.substr(0, 8), "...");
}

std::optional<Role> RoleOfNodeId(int id) {
  if (id == kSchedulerId) return Role::kScheduler;
  if (IsServerId(id)) return Role::kServer;
  if (IsWorkerId(id)) return Role::kWorker;
  return std::nullopt;
}

}  // namespace tessera

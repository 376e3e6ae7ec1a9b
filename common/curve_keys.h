// CurveKeys: the keys of a secured job, their file format, and how a node
// finds its own.
//
// A job has three CURVE key pairs, one per role (scheduler, server, worker).
// Every process gets one file holding its role's secret key and the three
// public keys, so a worker never holds a server's or the scheduler's secret
// key and cannot pose as either. tools/launch.py makes fresh keys for every
// job; `tessera-keygen DIR` makes them for daemons started by hand:
//
//   # Tessera job keys, role worker. Private: keep this file mode 0600.
//   role worker
//   secret-key <40 characters of Z85>
//   scheduler-public-key <Z85>
//   server-public-key <Z85>
//   worker-public-key <Z85>
//
// tools/launch.py also gives every process a key pair of its own, for its
// identity towards the scheduler (`node-secret-key <Z85>`), and lists every
// process's public one in the scheduler's file (`node-key <role> <Z85>`, one
// line each), so that a worker's keys are only that worker's.
//
//   absl::StatusOr<std::shared_ptr<const ConnectionSecurity>> s =
//       LoadConnectionSecurity(options);   // TESSERA_KEY_FILE / _DIR / _INSECURE
//   if (!s.ok()) { std::cerr << s.status().message(); return 2; }
//
// With TESSERA_AUTH_ONLY=1 the same keys authenticate connections through
// ZeroMQ's PLAIN mechanism and bytes travel unencrypted (trusted links): a
// client's password is a hash of the Diffie-Hellman secret of its role's key
// and the receiving role's key, which only those two roles can compute.
//
// All functions are thread-compatible and keep no state.
#ifndef TESSERA_COMMON_CURVE_KEYS_H_
#define TESSERA_COMMON_CURVE_KEYS_H_

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/options.h"
#include "common/secret_string.h"

namespace tessera {

// Z85 text of a 32-byte CURVE key: 40 characters.
inline constexpr size_t kZ85KeyLength = 40;

struct CurveKeyPair {
  std::string public_key;   // Z85
  SecretString secret_key;  // Z85
};

// Every role's key pair: what tessera-keygen and the tests make.
struct JobKeySet {
  std::array<CurveKeyPair, 3> pairs;  // indexed by Role
  const CurveKeyPair& of(Role role) const {
    return pairs[static_cast<int>(role)];
  }
};

// What one process holds: its role's secret key and every role's public key;
// with keys made by tools/launch.py, also a key pair of its own (its node
// identity key) and, the scheduler, every node's public identity key.
struct JobKeys {
  Role role = Role::kWorker;
  SecretString secret_key;                 // Z85, of `role`
  std::array<std::string, 3> public_keys;  // Z85, indexed by Role
  // This process's own key pair (Z85; empty: none, the role key stands in).
  SecretString node_secret_key;
  std::string node_public_key;
  // The scheduler's roster: every node's identity key and its role. When it
  // is there, a node registers only with a key of it, and a restarted node
  // only with the key its earlier life registered with.
  absl::flat_hash_map<std::string, Role> node_keys;

  const std::string& public_key(Role r) const {
    return public_keys[static_cast<int>(r)];
  }
  // The role of a role key or of a node key of the roster (O(1)); nullopt
  // for a key of no role.
  std::optional<Role> RoleOfKey(absl::string_view z85) const;
  // True for one of the three role keys (not a node's own).
  bool IsRoleKey(absl::string_view z85) const;
};

// How a transport secures its sockets.
struct ConnectionSecurity {
  JobKeys keys;
  // true: CURVE (authenticated and encrypted). false: PLAIN authentication
  // with passwords derived from the keys, bytes in the clear
  // (TESSERA_AUTH_ONLY=1).
  bool encrypt = true;
  // TESSERA_JOB_ID (options.h), bound into every sealed link's key: a node
  // of another job id opens none of this node's records, nor this node any
  // of its, even with the same key files. Not used by PLAIN (auth only).
  std::string job_id;
};

// A fresh CURVE key pair, and fresh key pairs for the three roles. Internal
// when ZeroMQ lacks CURVE.
absl::StatusOr<CurveKeyPair> GenerateKeyPair();
absl::StatusOr<JobKeySet> GenerateJobKeys();

// A job's key files when every server and worker has a key of its own (what
// tools/launch.py hands out, through `tessera-keygen --servers S --workers
// W`): each node's file is its role's plus its `node-secret-key`, and the
// scheduler's lists every node's public key (`node-key ROLE KEY`).
struct NodeKeyFiles {
  SecretString scheduler;
  std::vector<SecretString> servers;  // by launch index
  std::vector<SecretString> workers;
};
absl::StatusOr<NodeKeyFiles> GenerateNodeKeyFiles(const JobKeySet& set,
                                                  int num_servers,
                                                  int num_workers);

// The key file of `role` (the format above).
SecretString FormatKeyFile(const JobKeySet& set, Role role);

// Parses a key file. `origin` names it in errors ("TESSERA_KEY_FILE=/a/b").
// InvalidArgument naming the line for anything malformed, and when the
// secret key does not belong to the file's own public key.
absl::StatusOr<JobKeys> ParseKeyFile(absl::string_view text,
                                     const std::string& origin);

// Creates `path` mode 0600 holding `text`, never replacing a file
// (AlreadyExists) nor following a symbolic link, and syncs it.
absl::Status WritePrivateFile(const std::string& path, absl::string_view text);
// Writes scheduler.key, server.key and worker.key into `dir` (which must
// exist), each created mode 0600; an existing file is an error (AlreadyExists).
// Syncs the folder after them.
absl::Status WriteKeyFiles(const JobKeySet& set, const std::string& dir);

// OK when `dir` may hold key files: a folder owned by this process's user
// (or root) that neither its group nor others can write to, so that no one
// else can put a file there or replace one. InvalidArgument saying why not.
absl::Status CheckKeyFolder(const std::string& dir);
// Syncs the folder `dir`, so that the files just created in it survive a
// crash of the machine.
absl::Status SyncFolder(const std::string& dir);

// Reads and parses the key file at `path`. InvalidArgument, naming
// `variable` and the path, when it cannot be read, is not a regular file,
// can be read or written by its group or others (a key others can read is no
// secret: chmod 600), is not owned by this process's user (a file someone
// else put there is not this job's key), or lies in a folder CheckKeyFolder
// refuses.
absl::StatusOr<JobKeys> ReadKeyFile(const std::string& path,
                                    const std::string& variable);

// The security a node's transport uses, from options.key_file / key_dir /
// insecure / auth_only / job_id (see options.h). nullptr when TESSERA_INSECURE=1 (after
// one warning line). InvalidArgument naming the variable when no keys are
// configured, they cannot be read, or they are another role's.
absl::StatusOr<std::shared_ptr<const ConnectionSecurity>>
LoadConnectionSecurity(const Options& options);

// TESSERA_AUTH_ONLY: the password `keys.role` presents to a receiving socket
// of role `server`, and the check of a password claimed by role `client`
// against this process's own role. Z85, 40 characters.
SecretString PlainPassword(const JobKeys& keys, Role server);
bool CheckPlainPassword(const JobKeys& keys, Role client,
                        absl::string_view password);
// The password `client` presents to this process's role (what
// CheckPlainPassword compares with; a receiver computes it once per role), and
// the constant-time comparison; an empty `want` matches nothing.
SecretString ExpectedPlainPassword(const JobKeys& keys, Role client);
bool SamePassword(absl::string_view want, absl::string_view password);

// A key as logs show it: its first 8 characters and "...".
std::string KeyPrefix(absl::string_view z85);

// The role a node id belongs to (1 the scheduler, even ids from 8 servers, odd
// ids from 9 workers; the scheduler's provisional ids for registering nodes
// follow the same parity); nullopt for other ids.
std::optional<Role> RoleOfNodeId(int id);

namespace curve_keys_internal {
// ReadKeyFile's reading, apart for its tests: what is left of `fd` appended
// to `text`, which starts with the room the file's size asked for. Outgrown
// (a file system that reports no size), it moves to a string of twice the
// room and the old one is wiped: no copy of the text is left in freed
// memory. At most 16 MiB.
absl::Status ReadKeyText(int fd, const std::string& origin, std::string* text);
}  // namespace curve_keys_internal

}  // namespace tessera

#endif  // TESSERA_COMMON_CURVE_KEYS_H_

#include "common/options.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

absl::Status BadValue(const std::string& name, const std::string& value,
                      const std::string& expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, "='", value, "': expected ", expected));
}

absl::Status Missing(const std::string& name, const std::string& expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, " is not set: expected ", expected));
}

// Reads an integer in [lo, hi]. Unset -> `fallback`, or an error when required.
absl::StatusOr<int64_t> ReadInt(const EnvLookup& env, const std::string& name,
                                int64_t lo, int64_t hi,
                                std::optional<int64_t> fallback,
                                const std::string& expected) {
  std::optional<std::string> raw = env(name);
  if (!raw.has_value() || absl::StripAsciiWhitespace(*raw).empty()) {
    if (fallback.has_value()) return *fallback;
    return Missing(name, expected);
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*raw), &value) ||
      value < lo || value > hi) {
    return BadValue(name, *raw, expected);
  }
  return value;
}

absl::StatusOr<absl::Duration> ReadSeconds(const EnvLookup& env,
                                           const std::string& name,
                                           absl::Duration fallback,
                                           bool allow_zero) {
  std::optional<std::string> raw = env(name);
  if (!raw.has_value() || absl::StripAsciiWhitespace(*raw).empty())
    return fallback;
  double seconds = 0;
  const char* expected =
      allow_zero ? "a number of seconds >= 0" : "a number of seconds > 0";
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(*raw), &seconds) ||
      !std::isfinite(seconds) || seconds < 0 || (!allow_zero && seconds == 0) ||
      seconds > 1e7) {
    return BadValue(name, *raw, expected);
  }
  return absl::Seconds(seconds);
}

std::string ReadString(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> raw = env(name);
  return raw.has_value() ? std::string(absl::StripAsciiWhitespace(*raw))
                         : std::string();
}

// TESSERA_JOB_ID: empty when unset; set, 1 to 64 characters a shell and a log
// line show as they are.
absl::StatusOr<std::string> ReadJobId(const EnvLookup& env) {
  constexpr char kExpected[] =
      "1 to 64 letters, digits, '.', '_' or '-' (or leave it unset: jobs "
      "that set none share the empty id)";
  std::optional<std::string> raw = env("TESSERA_JOB_ID");
  // Set but empty (`export TESSERA_JOB_ID=`) reads as unset, as for every
  // other variable (ReadString).
  if (!raw.has_value() || absl::StripAsciiWhitespace(*raw).empty())
    return std::string();
  const bool ok =
      raw->size() <= 64 && std::all_of(raw->begin(), raw->end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
               c == '_' || c == '-';
      });
  if (!ok) return BadValue("TESSERA_JOB_ID", *raw, kExpected);
  return *raw;
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kScheduler:
      return "scheduler";
    case Role::kServer:
      return "server";
    case Role::kWorker:
      return "worker";
  }
  return "unknown";
}

namespace {

// ParseOptions's parts, each reading one group of variables into `o`.

// Who this process is and where the job is: DMLC_*, PORT and the ports of
// the node's other endpoints.
absl::Status ParseCluster(const EnvLookup& env, Options& o) {
  const std::string role = ReadString(env, "DMLC_ROLE");
  if (role.empty()) return Missing("DMLC_ROLE", "scheduler, server or worker");
  if (role == "scheduler") {
    o.role = Role::kScheduler;
  } else if (role == "server") {
    o.role = Role::kServer;
  } else if (role == "worker") {
    o.role = Role::kWorker;
  } else {
    return BadValue("DMLC_ROLE", role, "scheduler, server or worker");
  }
  o.root_uri = ReadString(env, "DMLC_PS_ROOT_URI");
  if (o.root_uri.empty()) {
    return Missing("DMLC_PS_ROOT_URI",
                   "the scheduler's IP address or hostname");
  }
  TESSERA_ASSIGN_OR_RETURN(
      o.root_port, ReadInt(env, "DMLC_PS_ROOT_PORT", 1, 65535, std::nullopt,
                           "a port number in 1..65535"));
  TESSERA_ASSIGN_OR_RETURN(
      o.num_servers, ReadInt(env, "DMLC_NUM_SERVER", 1, 100000, std::nullopt,
                             "a whole number >= 1"));
  TESSERA_ASSIGN_OR_RETURN(
      o.num_workers, ReadInt(env, "DMLC_NUM_WORKER", 1, 100000, std::nullopt,
                             "a whole number >= 1"));
  o.interface = ReadString(env, "DMLC_INTERFACE");
  o.node_host = ReadString(env, "DMLC_NODE_HOST");
  TESSERA_ASSIGN_OR_RETURN(
      o.port, ReadInt(env, "PORT", 0, 65535, 0, "a port number in 0..65535"));
  TESSERA_ASSIGN_OR_RETURN(
      o.task_id, ReadInt(env, "DMLC_TASK_ID", 0, 1 << 30, -1,
                         "a whole number >= 0 (the process's place in its "
                         "launcher's start order)"));
  return absl::OkStatus();
}

// Logging, heartbeats and deadlines.
absl::Status ParseTiming(const EnvLookup& env, Options& o) {
  TESSERA_ASSIGN_OR_RETURN(o.verbose,
                           ReadInt(env, "PS_VERBOSE", 0, 2, 0, "0, 1 or 2"));
  TESSERA_ASSIGN_OR_RETURN(
      o.heartbeat_interval,
      ReadSeconds(env, "PS_HEARTBEAT_INTERVAL", o.heartbeat_interval,
                  /*allow_zero=*/true));
  TESSERA_ASSIGN_OR_RETURN(
      o.heartbeat_timeout,
      ReadSeconds(env, "PS_HEARTBEAT_TIMEOUT", o.heartbeat_timeout,
                  /*allow_zero=*/false));
  if (o.heartbeat_interval > absl::ZeroDuration() &&
      o.heartbeat_timeout <= o.heartbeat_interval) {
    return BadValue(
        "PS_HEARTBEAT_TIMEOUT", ReadString(env, "PS_HEARTBEAT_TIMEOUT"),
        absl::StrCat("a number of seconds greater than PS_HEARTBEAT_INTERVAL (",
                     absl::FormatDuration(o.heartbeat_interval), ")"));
  }
  TESSERA_ASSIGN_OR_RETURN(
      o.start_timeout,
      ReadSeconds(env, "TESSERA_START_TIMEOUT", o.start_timeout, false));
  TESSERA_ASSIGN_OR_RETURN(
      o.request_timeout,
      ReadSeconds(env, "TESSERA_TIMEOUT", o.request_timeout, false));
  return absl::OkStatus();
}

// How keys are spread and summed, and how big a message may be.
absl::Status ParseKeys(const EnvLookup& env, Options& o) {
  TESSERA_ASSIGN_OR_RETURN(o.server_threads,
                           ReadInt(env, "TESSERA_SERVER_THREADS", 0, 256, 0,
                                   "a whole number in 0..256"));
  int64_t bound = 0;
  TESSERA_ASSIGN_OR_RETURN(
      bound, ReadInt(env, "MXNET_KVSTORE_BIGARRAY_BOUND", 1, int64_t{1} << 40,
                     1000000, "a whole number >= 1"));
  TESSERA_ASSIGN_OR_RETURN(
      bound, ReadInt(env, "TESSERA_BIGARRAY_BOUND", 1, int64_t{1} << 40, bound,
                     "a whole number >= 1"));
  o.bigarray_bound = static_cast<uint64_t>(bound);
  TESSERA_ASSIGN_OR_RETURN(
      o.max_frame_bytes,
      ReadInt(env, "TESSERA_MAX_MESSAGE_BYTES", 1 << 20, int64_t{1} << 40,
              o.max_frame_bytes, "a number of bytes in 1048576..2^40"));
  TESSERA_ASSIGN_OR_RETURN(
      o.chunk_bytes, ReadInt(env, "TESSERA_CHUNK_BYTES", 4096, int64_t{1} << 30,
                             o.chunk_bytes, "a number of bytes in 4096..2^30"));
  if (o.chunk_bytes > o.max_frame_bytes) {
    return BadValue("TESSERA_CHUNK_BYTES",
                    ReadString(env, "TESSERA_CHUNK_BYTES"),
                    absl::StrCat("at most TESSERA_MAX_MESSAGE_BYTES (",
                                 o.max_frame_bytes, ")"));
  }
  const std::string sum = ReadString(env, "TESSERA_SYNC_SUM");
  if (!sum.empty() && sum != "exact" && sum != "arrival")
    return BadValue("TESSERA_SYNC_SUM", sum, "exact or arrival");
  o.exact_sync_sum = sum != "arrival";
  const std::string order = ReadString(env, "TESSERA_SEND_ORDER");
  if (!order.empty() && order != "priority" && order != "fifo")
    return BadValue("TESSERA_SEND_ORDER", order, "priority or fifo");
  o.send_priority = order != "fifo";
  TESSERA_ASSIGN_OR_RETURN(
      o.send_credit_bytes,
      ReadInt(env, "TESSERA_SEND_CREDIT_BYTES", 0, int64_t{1} << 30,
              o.send_credit_bytes,
              "a number of bytes in 0..1073741824 (0: the kernel's own "
              "socket buffers)"));
  TESSERA_ASSIGN_OR_RETURN(
      o.late_min, ReadSeconds(env, "TESSERA_LATE_MIN", o.late_min, false));
  TESSERA_ASSIGN_OR_RETURN(
      o.staleness,
      ReadInt(env, "TESSERA_STALENESS", 0, kMaxStaleness, -1,
              absl::StrCat("a whole number of steps in 0..", kMaxStaleness,
                           " (dist_ssp's staleness bound)")));
  if (const std::string factor = ReadString(env, "TESSERA_LATE_FACTOR");
      !factor.empty()) {
    if (!absl::SimpleAtod(factor, &o.late_factor) ||
        !std::isfinite(o.late_factor) || o.late_factor < 1 ||
        o.late_factor > 1e6) {
      return BadValue("TESSERA_LATE_FACTOR", factor, "a number in 1..1000000");
    }
  }
  return absl::OkStatus();
}

// Restarts, acknowledged delivery and its testing aid.
// TESSERA_MAX_SERVERS: the most server ranks (DMLC_NUM_SERVER of them start).
absl::Status ParseMaxServers(const EnvLookup& env, Options& o) {
  if (const std::string max = ReadString(env, "TESSERA_MAX_SERVERS");
      !max.empty()) {
    // Replicated: every chain of `replicas` ranks must hold a server at the
    // start (the job's servers take ranks spread evenly over the most). One
    // copy of each slice: a slice of a rank without a server is answered by
    // the next rank that has one, so any number of ranks will do.
    const bool single = o.replicas < 2;
    // One copy: each slice keeps a few bytes per server rank (transfers in
    // flight), so the ranks are bounded.
    const int most = single ? std::max(o.num_servers, 256)
                            : std::min(o.num_servers * o.replicas, 100000);
    int value = 0;
    if (!absl::SimpleAtoi(max, &value) || value < o.num_servers ||
        value > most) {
      return BadValue(
          "TESSERA_MAX_SERVERS", max,
          single
              ? absl::StrCat("a whole number of server ranks from "
                             "DMLC_NUM_SERVER (",
                             o.num_servers, ") to ", most)
              : absl::StrCat("a whole number of server ranks from "
                             "DMLC_NUM_SERVER (",
                             o.num_servers,
                             ") to DMLC_NUM_SERVER x TESSERA_REPLICAS (", most,
                             "): each chain of TESSERA_REPLICAS ranks "
                             "needs a server at the start"));
    }
    o.single_copy = single;
    if (value > o.num_servers) {
      o.initial_servers = o.num_servers;
      o.num_servers = value;
    }
  }
  return absl::OkStatus();
}

// TESSERA_ELASTIC=MIN:MAX: the workers an elastic job may shrink and grow to.
absl::Status ParseElastic(const EnvLookup& env, Options& o) {
  if (const std::string elastic = ReadString(env, "TESSERA_ELASTIC");
      !elastic.empty()) {
    const std::string expected = absl::StrCat(
        "MIN:MAX, whole numbers with 1 <= MIN <= DMLC_NUM_WORKER (",
        o.num_workers, ") <= MAX <= 100000");
    std::vector<std::string> parts = absl::StrSplit(elastic, ':');
    int min = 0, max = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &min) ||
        !absl::SimpleAtoi(parts[1], &max) || min < 1 || min > o.num_workers ||
        max < o.num_workers || max > 100000) {
      return BadValue("TESSERA_ELASTIC", elastic, expected);
    }
    o.elastic_min = min;
    o.elastic_max = max;
  }
  return absl::OkStatus();
}

absl::Status ParseDelivery(const EnvLookup& env, Options& o) {
  int64_t restarts = 0;
  TESSERA_ASSIGN_OR_RETURN(restarts,
                           ReadInt(env, "TESSERA_RESTART_COUNT", 0, 1000000, 0,
                                   "a whole number >= 0"));
  o.restart_count = static_cast<uint64_t>(restarts);
  TESSERA_ASSIGN_OR_RETURN(
      o.replicas,
      ReadInt(env, "TESSERA_REPLICAS", 1, std::max(o.num_servers, 1), 1,
              absl::StrCat("a whole number in 1..DMLC_NUM_SERVER (",
                           o.num_servers, ")")));
  if (!o.exact_sync_sum && o.replicas > 2) {
    // A promoted backup sums the round again from the resent pushes; in
    // arrival order that is other bits than the dead primary's sum, which the
    // other backup may already hold (and keeps: the update's number is one it
    // has). With exact sums both are the same bits (server/replication.h).
    return absl::InvalidArgumentError(absl::StrCat(
        "TESSERA_SYNC_SUM=arrival with TESSERA_REPLICAS=", o.replicas,
        ": arrival-order sums allow at most 2 replicas (after a primary's "
        "death its backups could keep different sums of the same round); use "
        "TESSERA_SYNC_SUM=exact (the default) or TESSERA_REPLICAS=2"));
  }
  TESSERA_RETURN_IF_ERROR(ParseMaxServers(env, o));
  int64_t flag = 0;
  TESSERA_ASSIGN_OR_RETURN(flag,
                           ReadInt(env, "TESSERA_SPARE", 0, 1, 0, "0 or 1"));
  o.spare = flag == 1;
  if (o.spare && (o.role != Role::kServer || o.chain_length() < 2)) {
    return absl::InvalidArgumentError(
        "TESSERA_SPARE=1: a spare is a server of a job with TESSERA_REPLICAS "
        ">= 2 or TESSERA_MAX_SERVERS (it takes the rank of a dead server, or "
        "of one that has none)");
  }
  TESSERA_RETURN_IF_ERROR(ParseElastic(env, o));
  TESSERA_ASSIGN_OR_RETURN(
      flag, ReadInt(env, "TESSERA_LOCAL_GROUP", 0, 1, 0, "0 or 1"));
  o.local_group = flag == 1;
  TESSERA_ASSIGN_OR_RETURN(flag, ReadInt(env, "PS_RESEND", 0, 1, 1, "0 or 1"));
  o.resend = flag == 1;
  int64_t ms = 0;
  TESSERA_ASSIGN_OR_RETURN(ms,
                           ReadInt(env, "PS_RESEND_TIMEOUT", 1, 3600000, 1000,
                                   "a number of milliseconds in 1..3600000"));
  o.resend_timeout = absl::Milliseconds(ms);
  TESSERA_ASSIGN_OR_RETURN(o.resend_retries,
                           ReadInt(env, "TESSERA_RESEND_RETRIES", 1, 1000, 8,
                                   "a whole number in 1..1000"));
  TESSERA_ASSIGN_OR_RETURN(o.drop_percent, ReadInt(env, "PS_DROP_MSG", 0, 99, 0,
                                                   "a percentage in 0..99"));
  return absl::OkStatus();
}

// The job's keys, and the node's other endpoints (metrics, sealed lane).
absl::Status ParseSecurity(const EnvLookup& env, Options& o) {
  o.key_file = ReadString(env, "TESSERA_KEY_FILE");
  o.key_dir = ReadString(env, "TESSERA_KEY_DIR");
  int64_t flag = 0;
  TESSERA_ASSIGN_OR_RETURN(flag,
                           ReadInt(env, "TESSERA_INSECURE", 0, 1, 0, "0 or 1"));
  o.insecure = flag == 1;
  TESSERA_ASSIGN_OR_RETURN(
      flag, ReadInt(env, "TESSERA_AUTH_ONLY", 0, 1, 0, "0 or 1"));
  o.auth_only = flag == 1;
  TESSERA_ASSIGN_OR_RETURN(
      flag, ReadInt(env, "TESSERA_CORE_DUMPS", 0, 1, 0, "0 or 1"));
  o.core_dumps = flag == 1;
  if (o.insecure && o.auth_only) {
    return BadValue("TESSERA_AUTH_ONLY", "1",
                    "0 when TESSERA_INSECURE=1 (no authentication at all); "
                    "set one of them");
  }
  TESSERA_ASSIGN_OR_RETURN(o.job_id, ReadJobId(env));
  TESSERA_ASSIGN_OR_RETURN(
      o.metrics_port, ReadInt(env, "TESSERA_METRICS_PORT", 0, 65535, -1,
                              "a port number in 0..65535 (0: any free port)"));
  TESSERA_ASSIGN_OR_RETURN(
      o.sealed_port, ReadInt(env, "TESSERA_SEALED_PORT", 0, 65535, 0,
                             "a port number in 0..65535 (0: any free port)"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Options> ParseOptions(const EnvLookup& env) {
  Options o;
  TESSERA_RETURN_IF_ERROR(ParseCluster(env, o));
  TESSERA_RETURN_IF_ERROR(ParseTiming(env, o));
  TESSERA_RETURN_IF_ERROR(ParseKeys(env, o));
  TESSERA_RETURN_IF_ERROR(ParseDelivery(env, o));
  TESSERA_RETURN_IF_ERROR(ParseSecurity(env, o));
  return o;
}

absl::StatusOr<Options> Options::FromEnvironment() {
  return ParseOptions(
      [](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      });
}

}  // namespace tessera

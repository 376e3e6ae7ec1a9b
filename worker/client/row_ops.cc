// KVClient's row operations (see worker/client/kv_client_internal.h for the
// rooms): a row-sparse or hashed key's pushes and pulls of named rows, cut by
// the servers' parts and slices, with their windows per server.
#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/bf16.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/trace.h"
#include "worker/client/kv_client.h"
#include "worker/client/kv_client_internal.h"
#include "worker/client/pulled_value_rep.h"

namespace tessera {

using client_internal::kRowPushInflightChunks;
using client_internal::PushWindow;

namespace {

// Sorted ids (the usual case) put each server's rows in one run of the
// caller's arrays: then the frames borrow them, as a dense push borrows its
// gradient, pinned until the push completes. `at`: a part's rows, as places
// in the caller's arrays, in push order.
bool IsOneRun(const std::vector<size_t>& at) {
  const size_t n = at.size();
  return n == 0 || at.back() - at.front() + 1 == n;
}

// One part of a row push, uncompressed: the row ids, then the values in
// frames of whole rows (message.h, RowsPerFrame), borrowed from the caller's
// arrays (pinning `op`) when they are one run, else gathered.
Message FloatRowsBody(const std::vector<size_t>& at,
                      absl::Span<const uint64_t> row_ids,
                      absl::Span<const float> rows, uint64_t l,
                      size_t chunk_bytes, RequestTracker& tracker,
                      uint64_t op) {
  const size_t n = at.size();
  Message body;
  wire::DataFrame* d = body.header.add_frames();
  d->set_encoding(wire::DataFrame::RAW);
  d->set_num_bytes(n * sizeof(uint64_t));
  // The values in frames of whole rows (message.h, RowsPerFrame).
  const size_t per_frame = RowsPerFrame(n, l * sizeof(float), chunk_bytes);
  if (IsOneRun(at)) {
    const size_t k0 = n == 0 ? 0 : at.front();
    body.data.push_back(Buffer::Wrap(row_ids.data() + k0, n * sizeof(uint64_t),
                                     tracker.Pin(op)));
    for (size_t j = 0; j < n || j == 0; j += per_frame) {
      const size_t count = std::min(per_frame, n - j);
      AddFloatFrame(&body,
                    Buffer::Wrap(rows.data() + (k0 + j) * l,
                                 count * l * sizeof(float), tracker.Pin(op)));
      if (n == 0) break;
    }
    return body;
  }
  // Gathered straight into the frames.
  Buffer ids = Buffer::Allocate(n * sizeof(uint64_t));
  uint64_t* id_out = reinterpret_cast<uint64_t*>(ids.mutable_data());
  for (size_t j = 0; j < n; ++j) id_out[j] = row_ids[at[j]];
  body.data.push_back(std::move(ids));
  for (size_t j = 0; j < n; j += per_frame) {
    const size_t count = std::min(per_frame, n - j);
    Buffer values = Buffer::Allocate(count * l * sizeof(float));
    float* v_out = values.mutable_floats();
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(v_out + i * l, rows.data() + at[j + i] * l,
                  l * sizeof(float));
    }
    AddFloatFrame(&body, std::move(values));
  }
  return body;
}

// A part's distinct row ids, in push order.
struct DistinctRows {
  std::vector<uint64_t> ids;
  std::vector<size_t> first;  // ids[j]'s first place in `at`
  bool repeats = false;
};

DistinctRows FindDistinctRows(const std::vector<size_t>& at,
                              absl::Span<const uint64_t> row_ids) {
  const size_t n = at.size();
  DistinctRows distinct;
  absl::flat_hash_map<uint64_t, size_t> seen;
  seen.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    if (seen.try_emplace(row_ids[at[j]], distinct.ids.size()).second) {
      distinct.ids.push_back(row_ids[at[j]]);
      distinct.first.push_back(j);
    } else {
      distinct.repeats = true;
    }
  }
  return distinct;
}

// The values to code: the caller's run as it is, or gathered into
// `gathered` (and repeats added in).
const float* RowsToCode(const std::vector<size_t>& at,
                        absl::Span<const uint64_t> row_ids,
                        absl::Span<const float> rows, uint64_t l,
                        const DistinctRows& distinct, Buffer* gathered) {
  const size_t n = at.size();
  const size_t m = distinct.ids.size();
  const bool repeats = distinct.repeats;
  if (IsOneRun(at) && !repeats)
    return rows.data() + (n == 0 ? 0 : at.front() * l);
  *gathered = Buffer::Allocate(m * l * sizeof(float));
  float* g = gathered->mutable_floats();
  absl::flat_hash_map<uint64_t, size_t> slot;
  if (repeats) slot.reserve(m);
  for (size_t j = 0; j < m; ++j) {
    std::memcpy(g + j * l, rows.data() + at[distinct.first[j]] * l,
                l * sizeof(float));
    if (repeats) slot.emplace(distinct.ids[j], j);
  }
  if (repeats) {
    std::vector<bool> taken(n, false);
    for (size_t j = 0; j < m; ++j) taken[distinct.first[j]] = true;
    for (size_t j = 0; j < n; ++j) {
      if (taken[j]) continue;
      float* to = g + slot[row_ids[at[j]]] * l;
      const float* v = rows.data() + at[j] * l;
      for (uint64_t i = 0; i < l; ++i) to[i] += v[i];
    }
  }
  return gathered->floats();
}

// A row pull request's reply, copied into the caller's rows: `at`, the
// places in `base` (in rows of `l`) of the rows asked for, in order.
absl::Status CopyPulledRows(const Message& reply, float* base,
                            const std::vector<uint64_t>& at, uint64_t l,
                            wire::DataFrame::Encoding want) {
  // Frames of whole rows, in order, all of the asked encoding.
  uint64_t values = 0;
  bool ok =
      !reply.data.empty() &&
      static_cast<size_t>(reply.header.frames_size()) == reply.data.size();
  for (int f = 0; ok && f < reply.header.frames_size(); ++f) {
    const wire::DataFrame& d = reply.header.frames(f);
    ok = d.encoding() == want && d.num_values() % l == 0;
    values += d.num_values();
  }
  if (!ok || values != at.size() * l) {
    return absl::DataLossError(absl::StrCat(
        "row pull reply from node ", reply.header.sender(), " does not carry ",
        at.size(), " rows of ", l,
        want == wire::DataFrame::BF16 ? " as bfloat16" : " as float32"));
  }
  size_t k = 0;
  for (const Buffer& frame : reply.data) {
    if (want == wire::DataFrame::BF16) {
      const uint16_t* rows = reinterpret_cast<const uint16_t*>(frame.data());
      for (size_t i = 0; i < frame.size() / (2 * l); ++i, ++k)
        compression::Bf16ToFloats(rows + i * l, l, base + at[k] * l);
    } else {
      const float* rows = frame.floats();
      for (size_t i = 0; i < frame.num_floats() / l; ++i, ++k)
        std::memcpy(base + at[k] * l, rows + i * l, l * sizeof(float));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KVClient::RowKey> KVClient::CheckRows(
    uint64_t key, absl::Span<const uint64_t> row_ids, const char* what) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    return absl::NotFoundError(
        absl::StrCat(what, " of key ", key,
                     ": the key was never initialised (call init first)"));
  }
  const KeyInfo& info = it->second;
  if (info.row_length == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " of key ", key, ": the key is dense (init, not init_rows)"));
  }
  if (info.hashed) return RowKey{info.row_length, true};
  const uint64_t num_rows = info.length / info.row_length;
  for (uint64_t id : row_ids) {
    if (id >= num_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of key ", key, ": row id ", id, " is past its ",
                       num_rows, " rows"));
    }
  }
  return RowKey{info.row_length, false};
}

size_t KVClient::PartOfRow(const std::vector<KeyPart>& parts, bool hashed,
                           uint64_t id) const {
  if (hashed)
    return static_cast<size_t>(HashedServerOf(id, options_.num_servers));
  // Parts are in increasing offset: the last one starting at or before id.
  auto after = std::upper_bound(
      parts.begin(), parts.end(), id,
      [](uint64_t v, const KeyPart& p) { return v < p.offset; });
  if (after == parts.begin()) return parts.size();  // not reached (CheckRows)
  const size_t i = static_cast<size_t>(after - parts.begin()) - 1;
  return id < parts[i].offset + parts[i].length ? i : parts.size();
}

absl::StatusOr<OpHandle> KVClient::PushRowsAsync(
    uint64_t key, absl::Span<const uint64_t> row_ids,
    absl::Span<const float> rows) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_ASSIGN_OR_RETURN(const RowKey row_key,
                           CheckRows(key, row_ids, "row push"));
  const uint64_t l = row_key.row_length;
  const bool hashed = row_key.hashed;
  std::vector<KeyPart> row_parts;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(const KeyInfo* info,
                             KeyInfoLocked(key, "row push"));
    row_parts = info->parts;
  }
  if (rows.size() != row_ids.size() * l) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row push of key ", key, ": ", row_ids.size(), " row ids need ",
        row_ids.size() * l, " values, not ", rows.size()));
  }
  bool two_bit;
  float threshold;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    threshold = threshold_;
  }
  // Each part's rows: where each is in the caller's arrays, in push order.
  std::vector<std::vector<size_t>> at_of(row_parts.size());
  for (size_t k = 0; k < row_ids.size(); ++k) {
    const size_t i = PartOfRow(row_parts, hashed, row_ids[k]);
    if (i >= at_of.size())  // CheckRows let only ids of the key through
      return absl::InternalError(absl::StrCat(
          "row push of key ", key, ": no part holds row ", row_ids[k]));
    at_of[i].push_back(k);
  }
  return SendPush(
      wire::KV_PUSH, key, nullptr,
      [&, l](uint64_t op, size_t part_index,
             const KeyPart&) -> absl::StatusOr<Message> {
        const std::vector<size_t>& at = at_of[part_index];
        if (two_bit) {
          return TwoBitRowsBody(key, at, row_ids, rows, l, threshold);
        }
        return FloatRowsBody(at, row_ids, rows, l,
                             static_cast<size_t>(options_.chunk_bytes),
                             *tracker_, op);
      });
}

absl::StatusOr<Message> KVClient::TwoBitRowsBody(
    uint64_t key, const std::vector<size_t>& at,
    absl::Span<const uint64_t> row_ids, absl::Span<const float> rows,
    uint64_t l, float threshold) {
  Message body;
  wire::DataFrame* d = body.header.add_frames();
  d->set_encoding(wire::DataFrame::RAW);
  // 2-bit: duplicates summed first (in push order), so each row's error
  // feedback sees its whole gradient once.
  const DistinctRows distinct = FindDistinctRows(at, row_ids);
  const std::vector<uint64_t>& ids = distinct.ids;
  const size_t m = ids.size();
  const size_t count = m * l;
  // The values to code: the caller's run as it is, or gathered (and
  // repeats added in).
  Buffer gathered;
  const float* values = RowsToCode(at, row_ids, rows, l, distinct, &gathered);
  body.data.push_back(
      Buffer::CopyOf(ids.data(), ids.size() * sizeof(uint64_t)));
  d->set_num_bytes(ids.size() * sizeof(uint64_t));
  // Each row's residual: what earlier pushes of it have not sent yet.
  Buffer residual = Buffer::Allocate(count * sizeof(float));
  float* r = residual.mutable_floats();
  {
    absl::MutexLock lock(&mu_);
    KeyInfo& info = keys_[key];
    for (size_t k = 0; k < m; ++k) {
      auto [it, added] =
          info.row_slot.try_emplace(ids[k], info.row_slot.size());
      std::memcpy(r + k * l, info.RowResidual(it->second, l),
                  l * sizeof(float));
    }
  }
  trace::Span span("kv", "compress");
  span.Arg("key", static_cast<int64_t>(key));
  span.Arg("values", static_cast<int64_t>(count));
  Buffer packed = Buffer::Allocate(compression::TwoBitCompressedBytes(count));
  TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
      values, r, count, threshold, packed.mutable_data()));
  {
    absl::MutexLock lock(&mu_);
    KeyInfo& info = keys_[key];
    for (size_t k = 0; k < m; ++k) {
      std::memcpy(info.RowResidual(info.row_slot[ids[k]], l), r + k * l,
                  l * sizeof(float));
    }
  }
  AddTwoBitFrame(&body, std::move(packed), count);
  return body;
}

absl::StatusOr<OpHandle> KVClient::PullRowsAsync(
    uint64_t key, absl::Span<const uint64_t> row_ids, absl::Span<float> out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_ASSIGN_OR_RETURN(const RowKey row_key,
                           CheckRows(key, row_ids, "row pull"));
  const uint64_t l = row_key.row_length;
  if (out.size() != row_ids.size() * l) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row pull of key ", key, ": ", row_ids.size(), " row ids need ",
        row_ids.size() * l, " values of output, not ", out.size()));
  }
  std::vector<KeyPart> parts;
  RowPull pull{.key = key, .row_length = l, .out = out.data()};
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(const KeyInfo* info,
                             KeyInfoLocked(key, "row pull"));
    TESSERA_RETURN_IF_ERROR(info->out_of_step);
    parts = info->parts;
    pull.total = info->length / l;
    pull.pushed = info->next_seq;
    pull.bf16 = pull_two_bit_;  // pull compression: rows come as bfloat16
    ++stats_.pulls;
  }
  // Each part's rows, and where each goes in `out`.
  std::vector<std::vector<uint64_t>> ids_of(parts.size()), at_of(parts.size());
  for (size_t k = 0; k < row_ids.size(); ++k) {
    const size_t i = PartOfRow(parts, row_key.hashed, row_ids[k]);
    if (i >= parts.size())  // CheckRows let only ids of the key through
      return absl::InternalError(absl::StrCat(
          "row pull of key ", key, ": no part holds row ", row_ids[k]));
    ids_of[i].push_back(row_ids[k]);
    at_of[i].push_back(k);
  }
  pull.op = tracker_->NewOp();
  for (size_t i = 0; i < parts.size(); ++i)
    SendRowPullRequests(pull, i, parts[i], ids_of[i], at_of[i]);
  return pull.op;
}

void KVClient::SendRowPullRequests(const RowPull& pull, size_t part_index,
                                   const KeyPart& part,
                                   const std::vector<uint64_t>& part_ids,
                                   const std::vector<uint64_t>& part_at) {
  const uint64_t l = pull.row_length;
  const size_t value_bytes = pull.bf16 ? sizeof(uint16_t) : sizeof(float);
  // A pull need not visit every server. The rows it asks one server for
  // go in requests of about a slice each (pulls have no round to keep
  // whole), so that the server answers the first while the worker asks
  // for the next and copies the first into place: the stages overlap.
  const size_t per_request =
      RowsPerFrame(part_ids.size(), l * value_bytes,
                   static_cast<size_t>(options_.chunk_bytes));
  for (size_t first = 0; first < part_ids.size(); first += per_request) {
    const size_t count = std::min(per_request, part_ids.size() - first);
    std::vector<uint64_t> ids(part_ids.begin() + first,
                              part_ids.begin() + first + count);
    std::vector<uint64_t> at(part_at.begin() + first,
                             part_at.begin() + first + count);
    Message msg = SliceMessage(wire::KV_PULL, pull.key, part, pull.total, l);
    msg.header.set_push_seq(pull.pushed);  // sees this worker's pushes
    msg.header.set_pull_compressed(pull.bf16);
    wire::DataFrame* d = msg.header.add_frames();
    d->set_encoding(wire::DataFrame::RAW);
    d->set_num_bytes(ids.size() * sizeof(uint64_t));
    msg.data.push_back(
        Buffer::CopyOf(ids.data(), ids.size() * sizeof(uint64_t)));
    RequestTracker::Request request;
    request.op = pull.op;
    request.server = ServerId(part.server_rank);
    request.length = ids.size() * l;
    request.part = {pull.key, part_index, true};
    float* base = pull.out;
    const auto want =
        pull.bf16 ? wire::DataFrame::BF16 : wire::DataFrame::FLOAT32;
    request.on_reply = [base, at = std::move(at), l,
                        want](const Message& reply) {
      return CopyPulledRows(reply, base, at, l, want);
    };
    tracker_->Send(request, std::move(msg));
  }
}

std::map<int, int> KVClient::RowPushWindows(
    const std::vector<KeyPart>& parts,
    const std::vector<Message>& bodies) const {
  std::map<int, uint64_t> largest;  // by server rank: its largest slice
  for (size_t i = 0; i < parts.size(); ++i) {
    uint64_t bytes = 0;
    for (const Buffer& b : bodies[i].data) bytes += b.size();
    uint64_t& most = largest[parts[i].server_rank];
    most = std::max(most, bytes);
  }
  const uint64_t budget =
      kRowPushInflightChunks * static_cast<uint64_t>(options_.chunk_bytes);
  const int most_slices = std::max(2, PushWindow(options_));
  std::map<int, int> windows;
  for (const auto& [server, bytes] : largest) {
    windows[server] = static_cast<int>(std::clamp<uint64_t>(
        budget / std::max<uint64_t>(bytes, 1), 2, most_slices));
  }
  return windows;
}

}  // namespace tessera

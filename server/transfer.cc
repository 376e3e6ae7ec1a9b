// KVServer's slice movement (server/replication.h: "Replacements"): the
// slices a live server sends to a replacement, and on the replacement the
// transfers it takes; its asking and counting is CatchUp (server/catch_up.h).
#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/wire_status.h"
#include "server/key_store.h"
#include "server/kv_server.h"
#include "server/kv_server_shard.h"

namespace tessera {

// A count names its slices in a RAW frame: (key, offset) as little-endian
// uint64 pairs, as row ids travel.
static_assert(std::endian::native == std::endian::little,
              "the transfer count's frame is written in host order");
constexpr size_t kSliceNameBytes = 2 * sizeof(uint64_t);

void KVServer::TransferRequested(int rank, const wire::Header& request) {
  struct Job {
    absl::Mutex mu;
    std::vector<uint64_t> slices ABSL_GUARDED_BY(mu);  // (key, offset) pairs
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    bool other_view ABSL_GUARDED_BY(mu) = false;  // a shard saw another table
  };
  auto job = std::make_shared<Job>();
  {
    absl::MutexLock lock(&job->mu);
    job->remaining = shards_.size();
  }
  const uint64_t request_id = request.request_id();
  const uint64_t view = request.transfer_view();
  for (auto& shard : shards_) {
    Post(shard.get(), [this, job, rank, request_id, view](Shard* s) {
      // Only a rank this server knows as a replacement, under the table the
      // replacement asked under: one asking before a table change reached
      // here, or after, asks again (a count from another table would name
      // the wrong slices).
      const bool same_view = StatesDigest(s->states) == view;
      std::vector<uint64_t> mine;
      if (same_view && s->states[rank].catching_up && !s->states[rank].dead) {
        for (const auto& [id, owned] : s->store.keys()) {
          StoredKey* key = owned.get();
          if (!key->replicated || !Active(*s, *key)) continue;
          const int place = ChainOf(*key).PlaceOf(rank);
          if (place < 0 || place == static_cast<int>(key->replica)) continue;
          // One copy: only the slices it will answer for.
          if (single_copy_ && !MovesTo(*s, *key, rank)) continue;
          mine.push_back(key->key);
          mine.push_back(key->offset);
          // Not answered yet: sent again only when it may have been lost
          // (a re-ask every PS_RESEND_TIMEOUT must not resend a slice in
          // flight, gigabytes for a big shard).
          if (key->transfer[place] == StoredKey::kNoTransfer ||
              (key->transfer[place] == StoredKey::kTransferSent &&
               absl::Now() - key->transfer_sent[place] > 8 * replica_resend_)) {
            SendTransfer(key, place);
          }
        }
      }
      absl::MutexLock lock(&job->mu);
      job->slices.insert(job->slices.end(), mine.begin(), mine.end());
      if (!same_view) job->other_view = true;
      if (--job->remaining != 0) return;
      if (job->other_view) {
        TESSERA_VLOG(1) << "no transfer count for server " << rank << "'s ask "
                        << request_id << ": it asked under another table";
        return;
      }
      if (!s->states[rank].catching_up) return;  // not (yet) known as one
      Message count;
      count.header.set_command(wire::KV_TRANSFER);
      count.header.set_is_response(true);
      count.header.set_request_id(request_id);
      count.header.set_transfer_view(view);
      count.header.set_transfer_total(job->slices.size() / 2);
      Buffer names = Buffer::Allocate(job->slices.size() * sizeof(uint64_t));
      if (!job->slices.empty()) {
        std::memcpy(names.mutable_data(), job->slices.data(), names.size());
      }
      AddRawFrame(&count, std::move(names));
      absl::Status sent = send_(ServerId(rank), std::move(count));
      if (!sent.ok()) {
        ++failed_server_sends_;
        TESSERA_VLOG(1) << "transfer count to server " << rank << ": "
                        << sent.message();
      }
    });
  }
}

void KVServer::SendTransfer(StoredKey* key, int place) {
  wire::ServerCheckpoint saved;
  {
    const Settings set = settings();
    saved.set_optimizer_spec(set.optimizer_spec);
    saved.set_compression_type(set.compression);
    saved.set_compression_threshold(set.threshold);
  }
  wire::CheckpointKey* k = saved.add_keys();
  key->Snapshot(k);
  k->set_replica(static_cast<uint32_t>(place));
  // Which workers its rounds (or a dist_ssp slice's bound) wait for: a
  // replacement may have come after a worker joined, and the joiner's entry
  // is known here only.
  if (CarriesMembers(*key)) key->engine->MemberStates(k->mutable_members());
  // Serialized straight into the frame (no intermediate string).
  const size_t size = saved.ByteSizeLong();
  Buffer bytes = Buffer::Allocate(size);
  saved.SerializeWithCachedSizesToArray(bytes.mutable_data());
  Message msg;
  msg.header.set_command(wire::KV_TRANSFER);
  msg.header.mutable_slice()->set_key(key->key);
  msg.header.mutable_slice()->set_offset(key->offset);
  msg.header.set_replica_seq(key->replica_seq);
  msg.header.set_replica(static_cast<uint32_t>(place));
  AddRawFrame(&msg, std::move(bytes));
  key->transfer[place] = StoredKey::kTransferSent;
  key->transfer_sent[place] = absl::Now();
  const int rank = ChainOf(*key).RankAt(place);
  absl::Status sent = send_(ServerId(rank), std::move(msg));
  if (!sent.ok()) ++failed_server_sends_;
  TESSERA_VLOG(1) << "sent key " << key->key << " offset " << key->offset
                  << " (" << size << " bytes, update " << key->replica_seq
                  << ") to replacement server " << rank
                  << (sent.ok() ? "" : ": " + std::string(sent.message()));
}

void KVServer::TransferAnswered(Shard* shard, const Message& msg) {
  const wire::Header& h = msg.header;
  StoredKey* key = shard->store.Find(h.slice().key(), h.slice().offset());
  if (key == nullptr || !key->replicated) return;
  const int place = ChainOf(*key).PlaceOf(RankOfId(h.sender()));
  if (place < 0 || place == static_cast<int>(key->replica)) return;
  if (!FromWire(h.status()).ok()) {
    TESSERA_LOG(WARNING) << "server " << RankOfId(h.sender())
                         << " refused the transfer of key " << key->key << ": "
                         << h.status().message();
    key->transfer[place] = StoredKey::kNoTransfer;  // sent again when asked
    return;
  }
  if (key->transfer[place] != StoredKey::kTransferSent) return;
  key->transfer[place] = StoredKey::kTransferHeld;
  key->acked[place] = std::max(key->acked[place], h.replica_seq());
  AnswerReplicated(shard, key);
}

void KVServer::TakeTransfer(Shard* shard, Message&& msg) {
  const wire::Header& h = msg.header;
  const int from = RankOfId(h.sender());
  auto answer = [&](const absl::Status& status) {
    Message reply = NewReply(msg, status, nullptr);
    reply.header.set_replica_seq(h.replica_seq());
    SendReply(msg, std::move(reply));
  };
  wire::ServerCheckpoint saved;
  if (msg.data.size() != 1 ||
      !saved.ParseFromArray(msg.data[0].data(),
                            static_cast<int>(msg.data[0].size())) ||
      saved.keys_size() != 1 || saved.keys(0).key() != h.slice().key() ||
      saved.keys(0).offset() != h.slice().offset() ||
      saved.keys(0).replica_seq() != h.replica_seq() ||
      saved.keys(0).replica() >= static_cast<uint32_t>(replicas_)) {
    ++malformed_;
    answer(absl::DataLossError(absl::StrCat("malformed transfer of key ",
                                            h.slice().key(), " offset ",
                                            h.slice().offset())));
    return;
  }
  const wire::CheckpointKey& k = saved.keys(0);
  // Only from the slice's acting primary as this server sees the chain.
  const SliceChain chain = SliceChain::Around(
      rank_, static_cast<int>(k.replica()), num_servers_, replicas_);
  const int primary = chain.Primary(shard->states);
  if (from != primary) {
    DropMisplaced(h, "transfer", chain, primary);
    return;
  }
  StoredKey* key = shard->store.Find(k.key(), k.offset());
  const bool catching_up = catch_up_.active();
  // A slice new here only while catching up; one held here only at the
  // place it holds it (the sender names the place, and with it the chain).
  if ((key == nullptr && !catching_up && !single_copy_) ||
      (key != nullptr && (!key->replicated || key->replica != k.replica()))) {
    ++malformed_;
    answer(absl::FailedPreconditionError(absl::StrCat(
        "transfer of key ", k.key(), " offset ", k.offset(), " as place ",
        k.replica(), ": not a slice this server receives there")));
    return;
  }
  if (key == nullptr || key->replica_seq < k.replica_seq()) {
    // The job's optimizer and compression: a replacement has none yet (with
    // one copy a slice can come after the catch-up, or be its first).
    if (catching_up || (single_copy_ && key == nullptr)) {
      if (absl::Status set = InstallSettings(saved, "transfer"); !set.ok()) {
        ++malformed_;
        answer(set);
        return;
      }
    }
    const bool added = key == nullptr;
    if (!added) shard->store.Erase(k.key(), k.offset());
    if (absl::Status restored = shard->store.Restore(k); !restored.ok()) {
      ++malformed_;
      answer(restored);
      return;
    }
    key = shard->store.Find(k.key(), k.offset());
    shard->moved_away.erase({k.key(), k.offset()});
    MakeReplicated(key, k.replica());
    key->replica_seq = k.replica_seq();
    TakeMembers(key, k.members(), "transfer");
    if (added) num_keys_.fetch_add(1);
  }
  catch_up_.Took(from, k.key(), k.offset(), msg.data[0].size());
  answer(absl::OkStatus());
  catch_up_.Check();
}

void KVServer::TransferCounted(int rank, const Message& msg) {
  const uint64_t total = msg.header.transfer_total();
  if (msg.data.size() != 1 || msg.header.frames_size() != 1 ||
      msg.header.frames(0).encoding() != wire::DataFrame::RAW ||
      msg.data[0].size() / kSliceNameBytes != total ||
      msg.data[0].size() % kSliceNameBytes != 0) {
    ++malformed_;
    TESSERA_LOG(WARNING) << "dropped server " << rank
                         << "'s transfer count: " << total
                         << " slice(s) and a frame that does not name them";
    return;
  }
  std::vector<CatchUp::SliceId> slices(total);
  const uint8_t* at = msg.data[0].data();
  for (CatchUp::SliceId& slice : slices) {
    std::memcpy(&slice.first, at, sizeof(uint64_t));
    std::memcpy(&slice.second, at + sizeof(uint64_t), sizeof(uint64_t));
    at += kSliceNameBytes;
  }
  catch_up_.Counted(rank, msg.header.request_id(), msg.header.transfer_view(),
                    std::move(slices));
}

void KVServer::StartCatchUp(std::function<std::vector<ServerState>()> states,
                            std::function<void()> caught_up) {
  if (replicas_ <= 1) return;
  CatchUp::Options options;
  options.rank = rank_;
  options.num_servers = num_servers_;
  options.resend = replica_resend_;
  options.states = std::move(states);
  options.caught_up = std::move(caught_up);
  options.ask = [this](int rank, uint64_t id, uint64_t view) {
    Message request;
    request.header.set_command(wire::KV_TRANSFER);
    request.header.set_request_id(id);
    request.header.set_transfer_view(view);
    if (!send_(ServerId(rank), std::move(request)).ok()) ++failed_server_sends_;
  };
  if (!catch_up_.Start(std::move(options))) return;  // started, or stopped
  if (single_copy_) {
    TESSERA_LOG(INFO) << "this server takes rank " << rank_
                      << ": asking the live servers for the key slices it "
                         "will answer for";
  } else {
    TESSERA_LOG(INFO) << "this server replaces a dead one (rank " << rank_
                      << "): asking the live servers for its key slices";
  }
}

}  // namespace tessera

#include "server/round_engine.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"
#include "common/status_macros.h"

namespace tessera {

void SyncRound::Contribute(int rank, const wire::Header& request) {
  contributed_[rank] = true;
  requests_.push_back(request);
  ++count_;
}

absl::Status SyncRound::AddFloats(int rank, const Buffer& values,
                                  const wire::Header& request) {
  if (values.size() != length_ * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push of ", values.size(), " bytes for ", length_, " float32 values"));
  }
  if (contributed_.size() == 1) {
    single_ = values;
  } else if (mode_ == Mode::kArrival) {
    if (arrival_.empty()) arrival_ = Buffer::Allocate(length_ * sizeof(float));
    float* out = arrival_.mutable_floats();
    const float* in = values.floats();
    if (count_ == 0) {
      std::memcpy(out, in, length_ * sizeof(float));
    } else {
      for (uint64_t i = 0; i < length_; ++i) out[i] += in[i];
    }
  } else {
    if (sum_ == nullptr) sum_ = std::make_unique<ExactSum>(length_);
    sum_->AddFloats(values.floats());
  }
  Contribute(rank, request);
  return absl::OkStatus();
}

absl::Status SyncRound::AddTwoBit(int rank, const Buffer& packed,
                                  float threshold,
                                  const wire::Header& request) {
  if (contributed_.size() == 1) {
    Buffer decoded = Buffer::Allocate(length_ * sizeof(float));
    absl::Status s =
        compression::TwoBitDequantize(packed.data(), packed.size(), length_,
                                      threshold, decoded.mutable_floats());
    if (!s.ok()) return s;
    single_ = std::move(decoded);
  } else if (mode_ == Mode::kArrival) {
    if (arrival_.empty()) arrival_ = Buffer::Allocate(length_ * sizeof(float));
    float* out = arrival_.mutable_floats();
    if (count_ == 0) std::memset(out, 0, length_ * sizeof(float));
    absl::Status s = compression::TwoBitDequantizeAdd(
        packed.data(), packed.size(), length_, threshold, out);
    if (!s.ok()) return s;
  } else {
    if (sum_ == nullptr) sum_ = std::make_unique<ExactSum>(length_);
    absl::Status s = sum_->AddTwoBit(packed.data(), packed.size(), threshold);
    if (!s.ok()) return s;
  }
  Contribute(rank, request);
  return absl::OkStatus();
}

absl::Status SyncRound::AddCounts(int rank, const Buffer& counts,
                                  float threshold,
                                  const wire::Header& request) {
  if (counts.size() != length_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push of ", counts.size(), " counts for ", length_, " values"));
  }
  const int8_t* in = reinterpret_cast<const int8_t*>(counts.data());
  if (mode_ == Mode::kArrival) {
    if (arrival_.empty()) arrival_ = Buffer::Allocate(length_ * sizeof(float));
    float* out = arrival_.mutable_floats();
    if (count_ == 0) std::memset(out, 0, length_ * sizeof(float));
    for (uint64_t i = 0; i < length_; ++i)
      out[i] += static_cast<float>(static_cast<double>(in[i]) * threshold);
  } else {
    if (sum_ == nullptr) sum_ = std::make_unique<ExactSum>(length_);
    sum_->AddCounts(in, threshold);
  }
  Contribute(rank, request);
  return absl::OkStatus();
}

void SyncRound::ReplaceRequest(int sender, const wire::Header& request) {
  for (wire::Header& h : requests_) {
    if (h.sender() == sender) h = request;
  }
}

SyncRound::Sum SyncRound::Finish(bool want_counts, bool rescale) {
  Sum sum;
  const float factor = rescale ? members_.Scale(count_) : 1.0f;
  const bool partial = factor != 1.0f;
  if (want_counts && !partial && sum_ != nullptr && sum_->counting() &&
      contributed_.size() > 1) {
    sum.counts = Buffer::Allocate(length_);
    if (!sum_->PackCounts(reinterpret_cast<int8_t*>(sum.counts.mutable_data()),
                          &sum.threshold)) {
      sum.counts = Buffer();
    }
  }
  if (contributed_.size() == 1) {
    sum.push = std::move(single_);
    single_ = Buffer();
    sum.values = sum.push.floats();
  } else if (mode_ == Mode::kArrival) {
    sum.values = arrival_.floats();
  } else {
    sum.values = sum_->Finish();
  }
  if (partial) {
    scaled_ = Buffer::Allocate(length_ * sizeof(float));
    float* out = scaled_.mutable_floats();
    for (uint64_t i = 0; i < length_; ++i) out[i] = sum.values[i] * factor;
    sum.values = out;
  }
  contributed_.assign(contributed_.size(), false);
  count_ = 0;
  members_.NextRound();
  return sum;
}

void SyncRound::Release() {
  if (sum_ != nullptr) sum_->Release();
  arrival_ = Buffer();
  scaled_ = Buffer();
}

std::vector<wire::Header> SyncRound::TakeRequests() {
  std::vector<wire::Header> out;
  out.swap(requests_);
  return out;
}

void RowRound::AddRows(const uint64_t* rows, size_t count,
                       const float* values) {
  const uint64_t l = row_length_;
  for (size_t k = 0; k < count; ++k) {
    auto [it, added] = slot_.try_emplace(rows[k], rows_.size());
    if (added) {
      rows_.push_back(rows[k]);
      if (mode_ == SyncRound::Mode::kExact) {
        exact_.Grow(rows_.size() * l);
      } else {
        arrival_.resize(rows_.size() * l, 0.0f);
      }
    }
    const float* v = values + k * l;
    if (mode_ == SyncRound::Mode::kExact) {
      exact_.AddAt(it->second * l, v, l);
    } else {
      float* out = arrival_.data() + it->second * l;
      for (uint64_t j = 0; j < l; ++j) out[j] += v[j];
    }
  }
}

void RowRound::Contribute(int rank, const wire::Header& request) {
  contributed_[rank] = true;
  requests_.push_back(request);
  ++count_;
}

void RowRound::Add(int rank, const uint64_t* rows, size_t count,
                   const float* values, const wire::Header& request) {
  AddRows(rows, count, values);
  Contribute(rank, request);
}

void RowRound::Add(int rank, std::vector<uint64_t> rows,
                   std::vector<Buffer> parts, const wire::Header& request) {
  bool increasing = contributed_.size() == 1 && !rows.empty();
  for (size_t k = 1; increasing && k < rows.size(); ++k)
    increasing = rows[k - 1] < rows[k];
  if (!increasing) {
    size_t first = 0;
    for (const Buffer& part : parts) {
      const size_t n = part.num_floats() / row_length_;
      AddRows(rows.data() + first, n, part.floats());
      first += n;
    }
  } else {
    rows_ = std::move(rows);
    single_ = std::move(parts);
  }
  Contribute(rank, request);
}

absl::Status RowRound::AddTwoBit(int rank, std::vector<uint64_t> rows,
                                 const Buffer& packed, float threshold,
                                 const wire::Header& request) {
  const uint64_t l = row_length_;
  const uint64_t values = rows.size() * l;
  bool increasing = contributed_.size() == 1 && !rows.empty();
  for (size_t k = 1; increasing && k < rows.size(); ++k)
    increasing = rows[k - 1] < rows[k];
  if (increasing || mode_ == SyncRound::Mode::kArrival) {
    // Decoded: one worker's push is the sum; the arrival mode adds floats.
    Buffer decoded = Buffer::Allocate(values * sizeof(float));
    TESSERA_RETURN_IF_ERROR(
        compression::TwoBitDequantize(packed.data(), packed.size(), values,
                                      threshold, decoded.mutable_floats()));
    if (increasing) {
      std::vector<Buffer> parts;
      parts.push_back(std::move(decoded));
      Add(rank, std::move(rows), std::move(parts), request);
    } else {
      Add(rank, rows.data(), rows.size(), decoded.floats(), request);
    }
    return absl::OkStatus();
  }
  TESSERA_RETURN_IF_ERROR(compression::TwoBitValidate(
      packed.data(), packed.size(), values, threshold));
  for (size_t k = 0; k < rows.size(); ++k) {
    auto [it, added] = slot_.try_emplace(rows[k], rows_.size());
    if (added) {
      rows_.push_back(rows[k]);
      exact_.Grow(rows_.size() * l);
    }
    exact_.AddTwoBitAt(it->second * l, packed.data(), k * l, l, threshold);
  }
  Contribute(rank, request);
  return absl::OkStatus();
}

void RowRound::ReplaceRequest(int sender, const wire::Header& request) {
  for (wire::Header& h : requests_) {
    if (h.sender() == sender) h = request;
  }
}

RowRound::Sum RowRound::Finish(bool rescale) {
  Sum sum;
  const float factor = rescale ? members_.Scale(count_) : 1.0f;
  const bool partial = factor != 1.0f;
  sum.rows.swap(rows_);
  slot_.clear();
  if (!single_.empty()) {
    scratch_.clear();
    sum.row_values.reserve(sum.rows.size());
    for (const Buffer& part : single_) {
      for (size_t at = 0; at < part.num_floats(); at += row_length_)
        sum.row_values.push_back(part.floats() + at);
    }
    sum.push = std::move(single_);
    single_.clear();
  } else if (mode_ == SyncRound::Mode::kExact) {
    sum.values = sum.rows.empty() ? nullptr : exact_.Finish();
  } else {
    sum.values = arrival_.data();
    scratch_.swap(arrival_);  // valid until the next Add
    arrival_.clear();
    sum.values = scratch_.data();
  }
  if (partial && sum.values != nullptr) {
    // Workers left or joined: the sum of m pushes times n / m (a kept push
    // is never partial: it is one worker's of a one-worker job).
    const size_t n = sum.rows.size() * row_length_;
    if (sum.values != scratch_.data()) {
      scratch_.assign(sum.values, sum.values + n);
    }
    for (size_t i = 0; i < n; ++i) scratch_[i] *= factor;
    sum.values = scratch_.data();
  }
  contributed_.assign(contributed_.size(), false);
  count_ = 0;
  members_.NextRound();
  return sum;
}

std::vector<wire::Header> RowRound::TakeRequests() {
  std::vector<wire::Header> out;
  out.swap(requests_);
  return out;
}

}  // namespace tessera

#include "worker/trainer/batch_loader.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

// Uniform integer in [0, bound) from a 64-bit generator, without modulo bias.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % bound;
}

}  // namespace

absl::Status BatchLoader::Validate(const Options& o, int num_items) {
  if (o.batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be positive, got ", o.batch_size));
  }
  if (o.num_workers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be positive, got ", o.num_workers));
  }
  if (o.rank < 0 || o.rank >= o.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank must be in 0..", o.num_workers - 1, ", got ", o.rank));
  }
  if (o.epochs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("epochs must not be negative, got ", o.epochs));
  }
  if (o.prefetch_depth <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefetch_depth must be positive, got ", o.prefetch_depth));
  }
  if (num_items / o.num_workers == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a data set of ", num_items, " items leaves worker shards empty with ",
        o.num_workers, " workers"));
  }
  return absl::OkStatus();
}

std::vector<int> BatchLoader::ShardIndices(int num_items, int rank,
                                           int num_workers) {
  std::vector<int> shard;
  shard.reserve(num_items / num_workers + 1);
  for (int i = rank; i < num_items; i += num_workers) shard.push_back(i);
  return shard;
}

std::vector<int> BatchLoader::EpochOrder(const std::vector<int>& shard,
                                         uint64_t seed, int epoch) {
  std::vector<int> order = shard;
  std::seed_seq seq{static_cast<uint32_t>(seed),
                    static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(epoch), 0x7e55e7au};
  std::mt19937_64 rng(seq);
  for (size_t i = order.size(); i > 1; --i) {
    std::swap(order[i - 1], order[UniformBelow(rng, i)]);
  }
  return order;
}

BatchLoader::BatchLoader(const LabeledImages* data, const Options& options)
    : data_(data),
      options_(options),
      shard_(ShardIndices(data->count, options.rank, options.num_workers)) {
  const int smallest_shard = data->count / options.num_workers;
  batches_per_epoch_ = std::max(1, smallest_shard / options.batch_size);
  samples_per_epoch_ =
      std::min(smallest_shard, batches_per_epoch_ * options.batch_size);
  producer_ = std::thread([this] { Produce(); });
}

BatchLoader::~BatchLoader() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  producer_.join();
}

Batch BatchLoader::Gather(const std::vector<int>& order, int epoch,
                          int index) const {
  const int dim = data_->dim();
  const int begin = index * options_.batch_size;
  const int end = std::min(begin + options_.batch_size, samples_per_epoch_);
  Batch b;
  b.epoch = epoch;
  b.index = index;
  b.size = end - begin;
  b.images.resize(static_cast<size_t>(b.size) * dim);
  b.labels.resize(b.size);
  constexpr float kScale = 1.0f / 255.0f;
  for (int r = 0; r < b.size; ++r) {
    const int item = order[begin + r];
    const uint8_t* src = data_->image(item);
    float* dst = b.images.data() + static_cast<size_t>(r) * dim;
    for (int k = 0; k < dim; ++k) dst[k] = src[k] * kScale;
    b.labels[r] = data_->labels[item];
  }
  return b;
}

void BatchLoader::Produce() {
  const size_t depth = static_cast<size_t>(options_.prefetch_depth);
  auto has_room = [this, depth]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || queue_.size() < depth;
  };
  for (int epoch = 0; epoch < options_.epochs; ++epoch) {
    const std::vector<int> order =
        options_.shuffle ? EpochOrder(shard_, options_.seed, epoch) : shard_;
    for (int index = 0; index <= batches_per_epoch_; ++index) {
      Entry entry;
      if (index < batches_per_epoch_) {
        entry.batch = Gather(order, epoch, index);
      } else {
        entry.end_of_epoch = true;
      }
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&has_room));
      if (stop_) return;
      queue_.push_back(std::move(entry));
      peak_queued_ = std::max(peak_queued_, queue_.size());
    }
  }
}

std::optional<Batch> BatchLoader::Next() {
  if (epochs_consumed_ >= options_.epochs) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty();
  };
  mu_.Await(absl::Condition(&ready));
  Entry entry = std::move(queue_.front());
  queue_.pop_front();
  if (entry.end_of_epoch) {
    ++epochs_consumed_;
    return std::nullopt;
  }
  return std::move(entry.batch);
}

size_t BatchLoader::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

size_t BatchLoader::peak_queued() const {
  absl::MutexLock lock(&mu_);
  return peak_queued_;
}

}  // namespace tessera

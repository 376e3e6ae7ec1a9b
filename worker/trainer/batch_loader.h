// BatchLoader: feeds a worker its shard of a data set, batch by batch, from a
// background thread that gathers and converts the next batches while the
// current training step runs.
//
// Worker r of n owns the items i with i % n == r. Each epoch shuffles the shard
// from (seed, epoch), so every run with the same seed sees the same order. All
// workers run the same number of steps per epoch (the smallest shard decides),
// which dist_sync needs: a worker that ran one step more would wait for a round
// that never completes.
//
//   tessera::BatchLoader loader(&data.train, {.batch_size = 128, .rank = r,
//                                             .num_workers = n, .seed = 42,
//                                             .epochs = 10});
//   for (int e = 0; e < 10; ++e) {
//     while (std::optional<tessera::Batch> b = loader.Next()) Train(*b);
//   }
#ifndef TESSERA_WORKER_TRAINER_BATCH_LOADER_H_
#define TESSERA_WORKER_TRAINER_BATCH_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "worker/trainer/idx_reader.h"

namespace tessera {

// One batch, ready for the model: pixels scaled to [0, 1].
struct Batch {
  int epoch = 0;
  int index = 0;                // batch number within the epoch, from 0
  int size = 0;                 // rows in this batch
  std::vector<float> images;    // size x dim, row-major
  std::vector<int32_t> labels;  // size
};

class BatchLoader {
 public:
  struct Options {
    int batch_size = 128;
    int rank = 0;
    int num_workers = 1;
    uint64_t seed = 0;
    int epochs = 1;
    bool shuffle = true;
    // Batches the background thread may hold ready (the queue's bound).
    int prefetch_depth = 4;
  };

  // Checks options against a data set of `num_items` items: InvalidArgument
  // names the bad field.
  static absl::Status Validate(const Options& options, int num_items);

  // Starts the background thread. `data` is not owned and must outlive the
  // loader. REQUIRES: Validate(options, data->count).ok().
  BatchLoader(const LabeledImages* data, const Options& options);
  // Stops the background thread (it may be blocked on a full queue).
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Returns the next batch of the current epoch, or nullopt once the epoch is
  // over (the call after that starts the next epoch). After the last epoch it
  // returns nullopt. Blocks while the background thread prepares the batch.
  // Call from one thread.
  std::optional<Batch> Next();

  // Steps each worker runs per epoch: max(1, floor(smallest_shard /
  // batch_size)). The remainder of a shard is left out of that epoch (a
  // different part each epoch).
  int batches_per_epoch() const { return batches_per_epoch_; }
  // Items used per epoch by this worker.
  int samples_per_epoch() const { return samples_per_epoch_; }

  // Batches currently waiting in the queue, and the most there ever were.
  size_t queued() const;
  size_t peak_queued() const;

  // Items of worker `rank`'s shard of n items, ascending.
  static std::vector<int> ShardIndices(int num_items, int rank,
                                       int num_workers);
  // The order of `shard` in `epoch`: a Fisher-Yates shuffle driven by
  // mt19937_64, whose sequence the C++ standard fixes, so the order is the same
  // on every platform.
  static std::vector<int> EpochOrder(const std::vector<int>& shard,
                                     uint64_t seed, int epoch);

 private:
  // An entry of the queue: a batch, or the end of an epoch.
  struct Entry {
    bool end_of_epoch = false;
    Batch batch;
  };

  void Produce();
  Batch Gather(const std::vector<int>& order, int epoch, int index) const;

  const LabeledImages* const data_;
  const Options options_;
  const std::vector<int> shard_;
  int batches_per_epoch_ = 0;
  int samples_per_epoch_ = 0;

  mutable absl::Mutex mu_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  size_t peak_queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int epochs_consumed_ = 0;  // consumer thread only

  std::thread producer_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_BATCH_LOADER_H_

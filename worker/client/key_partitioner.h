// KeyPartitioner: which server holds which part of a key's array. Every worker
// computes the same placement from (number of servers, bound): arrays shorter
// than the bound live whole on one server chosen by hashing the key; longer
// ones are split into contiguous, nearly equal parts, one per server (as
// MXNet's MXNET_KVSTORE_BIGARRAY_BOUND).
//
//   KeyPartitioner p(/*num_servers=*/2, /*bigarray_bound=*/1000000);
//   for (const KeyPart& part : p.Partition(key, length)) { ... part.server_rank ... }
#ifndef TESSERA_WORKER_CLIENT_KEY_PARTITIONER_H_
#define TESSERA_WORKER_CLIENT_KEY_PARTITIONER_H_

#include <cstdint>
#include <vector>

namespace tessera {

struct KeyPart {
  int server_rank = 0;
  uint64_t offset = 0;  // first element
  uint64_t length = 0;  // number of elements, > 0
};

class KeyPartitioner {
 public:
  // REQUIRES: num_servers >= 1, bigarray_bound >= 1.
  KeyPartitioner(int num_servers, uint64_t bigarray_bound)
      : num_servers_(num_servers), bound_(bigarray_bound) {}

  // The parts of `key`, in increasing offset; empty when length is 0.
  std::vector<KeyPart> Partition(uint64_t key, uint64_t length) const;

  // The server of an array that is not split.
  int ServerOf(uint64_t key) const;

  // A row-sparse key of num_rows x row_length: as Partition, but in whole rows
  // (offset and length count rows).
  std::vector<KeyPart> PartitionRows(uint64_t key, uint64_t num_rows,
                                     uint64_t row_length) const;

  // `parts` with each one longer than `max_elements` cut into consecutive
  // slices of at most that many elements (the last one shorter), on the same
  // server. REQUIRES: max_elements >= 1.
  static std::vector<KeyPart> Chunk(const std::vector<KeyPart>& parts,
                                    uint64_t max_elements);

 private:
  int num_servers_;
  uint64_t bound_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_KEY_PARTITIONER_H_

// IDX reader: decodes the (optionally gzip-compressed) IDX files of MNIST-style
// data sets, such as Fashion-MNIST, into memory once.
//
// Pixels stay as bytes (60,000 x 784 bytes for the Fashion-MNIST training set);
// the batch loader converts the rows it gathers into floats, off the training
// thread.
//
//   absl::StatusOr<tessera::LabeledImages> train = tessera::LoadLabeledImages(
//       "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
//       "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz");
//   if (!train.ok()) { std::cerr << train.status().message() << "\n"; return 2;
//   }
//
// Errors (the message always starts with the file's path):
//   NotFound         the file cannot be opened;
//   DataLoss         bad magic number, a truncated header or payload, a corrupt
//   gzip
//                    stream, a label outside 0..num_classes-1;
//   InvalidArgument  the images and labels files disagree on the number of
//   items.
#ifndef TESSERA_WORKER_TRAINER_IDX_READER_H_
#define TESSERA_WORKER_TRAINER_IDX_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera {

// One decoded IDX file of unsigned bytes.
struct IdxArray {
  std::vector<uint32_t> dims;  // e.g. {60000, 28, 28}
  std::vector<uint8_t> data;   // product(dims) bytes, row-major
};

// Reads an IDX file of unsigned bytes (type 0x08) with `expected_rank`
// dimensions. gzip files are decompressed; uncompressed files are read as they
// are. Thread-safe (no shared state).
absl::StatusOr<IdxArray> ReadIdxFile(const std::string& path,
                                     int expected_rank);

// Images with their labels, decoded in memory.
struct LabeledImages {
  int count = 0;                // number of images
  int rows = 0;                 // pixel rows per image
  int cols = 0;                 // pixel columns per image
  std::vector<uint8_t> pixels;  // count * rows * cols, image after image
  std::vector<uint8_t> labels;  // count labels, each in 0..num_classes-1

  int dim() const { return rows * cols; }
  const uint8_t* image(int i) const {
    return pixels.data() + static_cast<size_t>(i) * dim();
  }
};

// Reads an images file (rank 3) and its labels file (rank 1). `max_items` > 0
// keeps only the first max_items images (for quick runs); 0 keeps all.
absl::StatusOr<LabeledImages> LoadLabeledImages(const std::string& images_path,
                                                const std::string& labels_path,
                                                int max_items = 0,
                                                int num_classes = 10);

// Fashion-MNIST's four files in `dir` (train-images-idx3-ubyte.gz and so on).
struct FashionMnist {
  LabeledImages train;
  LabeledImages test;
};
absl::StatusOr<FashionMnist> LoadFashionMnist(const std::string& dir,
                                              int train_subset = 0,
                                              int test_subset = 0);

}  // namespace tessera

#endif  // TESSERA_WORKER_TRAINER_IDX_READER_H_

// End-to-end training on the CPU without the network: the batch loader feeds
// the MLP, a local SGD step stands in for the servers. A few hundred steps on
// 2,000 Fashion-MNIST images must take training accuracy above 0.7.
#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/trainer/batch_loader.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/mlp.h"

namespace tessera {
namespace {

TEST(TrainingSanityTest, LocalSgdLearnsFashionMnistSubset) {
  const char* env = std::getenv("FASHION_MNIST_DIR");
  const std::string dir =
      env != nullptr && *env != 0 ? env : "/usr/share/datasets/fashion-mnist";
  struct stat st;
  if (stat((dir + "/train-images-idx3-ubyte.gz").c_str(), &st) != 0) {
    GTEST_SKIP() << "Fashion-MNIST not found in " << dir;
  }
  absl::StatusOr<FashionMnist> data = LoadFashionMnist(dir, 2000, 1000);
  ASSERT_TRUE(data.ok()) << data.status();
  SetCpuMathThreads(1);

  constexpr int kBatch = 32, kEpochs = 5;
  MlpConfig config;
  config.sizes = {784, 256, 128, 10};
  config.seed = 42;
  absl::StatusOr<std::unique_ptr<Mlp>> mlp =
      CreateMlp(MlpDevice::kCpu, config, kBatch);
  ASSERT_TRUE(mlp.ok()) << mlp.status();

  BatchLoader::Options options;
  options.batch_size = kBatch;
  options.seed = 42;
  options.epochs = kEpochs;
  BatchLoader loader(&data->train, options);
  int steps = 0;
  double first_loss = 0, last_epoch_loss = 0;
  for (int e = 0; e < kEpochs; ++e) {
    last_epoch_loss = 0;
    int rows = 0;
    while (std::optional<Batch> b = loader.Next()) {
      absl::StatusOr<MlpBatchStats> s = (*mlp)->ForwardBackward(
          b->images.data(), b->labels.data(), b->size, nullptr);
      ASSERT_TRUE(s.ok()) << s.status();
      if (steps == 0) first_loss = s->loss_sum / s->rows;
      last_epoch_loss += s->loss_sum;
      rows += s->rows;
      ASSERT_TRUE((*mlp)->LocalSgdStep(0.1f, 1.0f / b->size).ok());
      ++steps;
    }
    last_epoch_loss /= rows;
  }
  EXPECT_GE(steps, 300);
  EXPECT_LT(last_epoch_loss, 0.6 * first_loss);

  std::vector<float> x(data->train.pixels.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = data->train.pixels[i] / 255.0f;
  std::vector<int32_t> y(data->train.labels.begin(), data->train.labels.end());
  absl::StatusOr<MlpBatchStats> train =
      (*mlp)->Evaluate(x.data(), y.data(), 2000);
  ASSERT_TRUE(train.ok()) << train.status();
  const double accuracy = static_cast<double>(train->correct) / train->rows;
  EXPECT_GT(accuracy, 0.7) << "after " << steps << " steps";
}

}  // namespace
}  // namespace tessera

#include "tools/bench/model_zoo.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::bench {

uint64_t ParamSpec::size() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t ModelSpec::num_tensors() const {
  uint64_t n = 0;
  for (const LayerSpec& l : layers) n += l.params.size();
  return n;
}

uint64_t ModelSpec::num_params() const {
  uint64_t n = 0;
  for (const LayerSpec& l : layers)
    for (const ParamSpec& p : l.params) n += p.size();
  return n;
}

double ModelSpec::forward_flops() const {
  double f = 0;
  for (const LayerSpec& l : layers) f += l.forward_flops;
  return f;
}

std::string ModelNames() { return "resnet50, vgg16, bert-base, mlp"; }

namespace {

// Norm layers: mean, variance, normalise, scale and shift.
constexpr double kNormFlopsPerElement = 4;

// Appends layers in forward order, as the model's modules run.
class ModelBuilder {
 public:
  explicit ModelBuilder(ModelSpec* m) : m_(m) {}

  // A kxk convolution of `in` -> `out` channels producing hw x hw outputs.
  void Conv(const std::string& name, uint64_t in, uint64_t out, uint64_t k,
            uint64_t hw, bool bias) {
    LayerSpec l{name, {{name + ".weight", {out, in, k, k}}}, 0};
    if (bias) l.params.push_back({name + ".bias", {out}});
    l.forward_flops = 2.0 * out * in * k * k * hw * hw;
    m_->layers.push_back(std::move(l));
  }

  // Batch norm (2-d images, hw x hw) or layer norm (hw = 1, `rows` tokens).
  void Norm(const std::string& name, uint64_t channels, uint64_t elements) {
    m_->layers.push_back(
        {name,
         {{name + ".weight", {channels}}, {name + ".bias", {channels}}},
         kNormFlopsPerElement * elements});
  }

  // A Linear of `in` -> `out` applied to `rows` rows a sample, plus
  // `extra_flops` that are counted with it.
  void Linear(const std::string& name, uint64_t in, uint64_t out, uint64_t rows,
              double extra_flops = 0) {
    m_->layers.push_back(
        {name,
         {{name + ".weight", {out, in}}, {name + ".bias", {out}}},
         2.0 * in * out * rows + extra_flops});
  }

  void Embedding(const std::string& name, uint64_t rows, uint64_t dim) {
    m_->layers.push_back({name, {{name + ".weight", {rows, dim}}}, 0});
  }

 private:
  ModelSpec* m_;
};

// torchvision's Bottleneck: conv1 1x1, conv2 3x3 (with the stride), conv3 1x1
// to 4 x planes, then the downsample branch (registered and run after bn3).
void Bottleneck(ModelBuilder* b, const std::string& p, uint64_t in,
                uint64_t planes, uint64_t hw_in, uint64_t stride) {
  const uint64_t hw = hw_in / stride, out = 4 * planes;
  b->Conv(p + ".conv1", in, planes, 1, hw_in, false);
  b->Norm(p + ".bn1", planes, planes * hw_in * hw_in);
  b->Conv(p + ".conv2", planes, planes, 3, hw, false);
  b->Norm(p + ".bn2", planes, planes * hw * hw);
  b->Conv(p + ".conv3", planes, out, 1, hw, false);
  b->Norm(p + ".bn3", out, out * hw * hw);
  if (stride != 1 || in != out) {
    b->Conv(p + ".downsample.0", in, out, 1, hw, false);
    b->Norm(p + ".downsample.1", out, out * hw * hw);
  }
}

ModelSpec ResNet50() {
  ModelSpec m{"resnet50", "a 224x224 image", {}};
  ModelBuilder b(&m);
  b.Conv("conv1", 3, 64, 7, 112, false);
  b.Norm("bn1", 64, 64 * 112 * 112);
  uint64_t in = 64, hw = 56;  // after the 3x3 max-pool
  const uint64_t blocks[4] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const uint64_t planes = 64u << stage;
    for (uint64_t i = 0; i < blocks[stage]; ++i) {
      const uint64_t stride = (stage > 0 && i == 0) ? 2 : 1;
      Bottleneck(&b, absl::StrCat("layer", stage + 1, ".", i), in, planes, hw,
                 stride);
      in = 4 * planes;
      hw /= stride;
    }
  }
  b.Linear("fc", 2048, 1000, 1);
  return m;
}

ModelSpec Vgg16() {
  ModelSpec m{"vgg16", "a 224x224 image", {}};
  ModelBuilder b(&m);
  // Configuration "D"; 0 is a 2x2 max-pool. Module indices count the ReLUs
  // and pools, as torchvision's nn.Sequential does.
  const int cfg[] = {64, 64,  0,   128, 128, 0,   256, 256, 256,
                     0,  512, 512, 512, 0,   512, 512, 512, 0};
  uint64_t in = 3, hw = 224;
  int index = 0;
  for (int c : cfg) {
    if (c == 0) {
      hw /= 2;
      index += 1;
      continue;
    }
    b.Conv(absl::StrCat("features.", index), in, c, 3, hw, true);
    in = c;
    index += 2;  // the conv and its ReLU
  }
  b.Linear("classifier.0", 512 * 7 * 7, 4096, 1);
  b.Linear("classifier.3", 4096, 4096, 1);
  b.Linear("classifier.6", 4096, 1000, 1);
  return m;
}

ModelSpec BertBase(uint64_t seq) {
  ModelSpec m{"bert-base", absl::StrCat("a sequence of ", seq, " tokens"), {}};
  ModelBuilder b(&m);
  const uint64_t h = 768, inter = 3072;
  b.Embedding("embeddings.word_embeddings", 30522, h);
  b.Embedding("embeddings.position_embeddings", 512, h);
  b.Embedding("embeddings.token_type_embeddings", 2, h);
  b.Norm("embeddings.LayerNorm", h, seq * h);
  for (int i = 0; i < 12; ++i) {
    const std::string p = absl::StrCat("encoder.layer.", i);
    b.Linear(p + ".attention.self.query", h, h, seq);
    b.Linear(p + ".attention.self.key", h, h, seq);
    b.Linear(p + ".attention.self.value", h, h, seq);
    // Scores (Q K^T) and their product with V: 2 x seq^2 x hidden each.
    b.Linear(p + ".attention.output.dense", h, h, seq, 4.0 * seq * seq * h);
    b.Norm(p + ".attention.output.LayerNorm", h, seq * h);
    b.Linear(p + ".intermediate.dense", h, inter, seq);
    b.Linear(p + ".output.dense", inter, h, seq);
    b.Norm(p + ".output.LayerNorm", h, seq * h);
  }
  b.Linear("pooler.dense", h, h, 1);  // the first token only
  return m;
}

ModelSpec QuickStartMlp() {
  ModelSpec m{"mlp", "a 28x28 image", {}};
  ModelBuilder b(&m);
  b.Linear("fc1", 784, 256, 1);
  b.Linear("fc2", 256, 128, 1);
  b.Linear("fc3", 128, 10, 1);
  return m;
}

}  // namespace

absl::StatusOr<ModelSpec> MakeModel(const std::string& name, int seq_len) {
  if (name == "resnet50") return ResNet50();
  if (name == "vgg16") return Vgg16();
  if (name == "mlp") return QuickStartMlp();
  if (name == "bert-base") {
    if (seq_len < 1 || seq_len > 512) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--seq-len=", seq_len, ": expected 1..512 (BERT's positions)"));
    }
    return BertBase(seq_len);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--model=", name, ": expected one of ", ModelNames()));
}

}  // namespace tessera::bench

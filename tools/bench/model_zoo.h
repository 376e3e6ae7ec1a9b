// The parameter tensors and per-layer compute of real models, for the
// model-replay benchmark (tools/bench/model_replay.cc, issue #48): every
// parameter tensor's shape in forward order, grouped into layers (a layer is
// a module that holds parameters), and each layer's forward FLOPs for one
// sample.
//
//   absl::StatusOr<ModelSpec> m = MakeModel("resnet50", /*seq_len=*/128);
//   for (const LayerSpec& layer : m->layers)
//     for (const ParamSpec& p : layer.params) ... p.name, p.shape, p.size() ...
//
// Where the shapes come from (the lists are built here by the same loops the
// model code uses, and checked against the published parameter counts:
// tests/bench/model_replay_smoke_test.py):
//   resnet50   torchvision.models.resnet50() (v1.5: stride on the 3x3 conv),
//              list(model.named_parameters()): 161 tensors, 25,557,032
//              parameters (batch-norm running statistics are buffers, not
//              parameters, and are not listed)
//   vgg16      torchvision.models.vgg16() (configuration "D", no batch norm):
//              32 tensors, 138,357,544 parameters
//   bert-base  HuggingFace transformers BertModel.from_pretrained(
//              "bert-base-uncased") (vocabulary 30,522, hidden 768, 12 layers,
//              intermediate 3,072, 512 positions, 2 token types, with the
//              pooler): 199 tensors, 109,482,240 parameters; Linear weights
//              are [out, in] as PyTorch stores them
//   mlp        the quick-start MLP 784-256-128-10 (tools/quickstart.sh):
//              6 tensors, 235,146 parameters; the smoke test's tiny model
//
// FLOPs: a multiply-add is 2 FLOPs. Convolution 2 x Cout x Cin x kh x kw x
// Hout x Wout (224 x 224 images); Linear 2 x in x out per row (BERT: per
// token, seq_len tokens a sample); batch and layer norm 4 FLOPs per output
// element; an embedding lookup 0. Convolutions and Linears alone give the
// published 4.09 G multiply-adds per image for ResNet-50 and 15.47 G for
// VGG-16; with the norms, 4.11 G and 15.47 G; BERT-base 11.18 G per
// sequence of 128 tokens. Attention's two matrix products (2 x 2 x
// seq_len^2 x hidden a sample) hold no parameters and are counted in the
// layer that follows them, attention.output.dense. ReLU, GELU, pooling,
// softmax and residual additions are not counted (well under 1% of the
// FLOPs of these models).
//
// Thread-compatible; pure functions.
#ifndef TESSERA_TOOLS_BENCH_MODEL_ZOO_H_
#define TESSERA_TOOLS_BENCH_MODEL_ZOO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::bench {

struct ParamSpec {
  std::string name;  // PyTorch's, e.g. "layer1.0.conv1.weight"
  std::vector<uint64_t> shape;
  uint64_t size() const;  // the product of `shape`
};

struct LayerSpec {
  std::string name;               // the module, e.g. "layer1.0.conv1"
  std::vector<ParamSpec> params;  // in PyTorch's order
  double forward_flops = 0;       // for one sample
};

struct ModelSpec {
  std::string name;
  std::string sample;             // what one sample is, e.g. "a 224x224 image"
  std::vector<LayerSpec> layers;  // in forward order

  uint64_t num_tensors() const;
  uint64_t num_params() const;
  double forward_flops() const;  // per sample, all layers
};

// The models' names, for messages: "resnet50, vgg16, bert-base, mlp".
std::string ModelNames();

// `name` is one of ModelNames(); `seq_len` (tokens a sample) is BERT's only.
// InvalidArgument for another name or a seq_len outside 1..512.
absl::StatusOr<ModelSpec> MakeModel(const std::string& name, int seq_len);

}  // namespace tessera::bench

#endif  // TESSERA_TOOLS_BENCH_MODEL_ZOO_H_

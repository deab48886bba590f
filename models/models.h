// zinc models: the built-in models, written against engine/model.h only.
//
// - GPT: a GPT-2-style decoder. Learned token and position embeddings,
//   pre-LayerNorm blocks (attention then a 4x GELU MLP, each with a residual
//   add), a final LayerNorm, and an output head tied to the token embedding.
//   GPT-2 initialisation: weights N(0, 0.02), the two residual projections of
//   each layer N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1.
//   Blocks: 0 = embeddings {wte (V,C), wpe (block_size,C)}, 1..n_layer = the
//   transformer layers, n_layer+1 = the final LayerNorm. Optionally
//   recomputes each layer's activations in backward (gradient_checkpointing).
// - MLP: a next-token MLP. Position t sees the embeddings of tokens
//   t-context+1..t (zeros before the sequence start), concatenated, then
//   n_layer GELU layers of width `hidden`, then a linear head to V logits.
//   Blocks: 0 = embeddings {wte (V,C)}, 1..n_layer = hidden layers,
//   n_layer+1 = head.
// Models own their activations (sized at the first forward for a (B,T) and
// regrown if the shape changes); one model instance serves one engine.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "engine/model.h"

namespace zinc::models {

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t block_size = 256;  // max sequence length (rows of wpe)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  // Activation checkpointing (Hugging Face's name): keep only each layer's
  // input in forward and recompute the layer's activations in its backward.
  // Saves (n_layer - 1) sets of layer activations, about 14 (N,C) fp32
  // buffers plus the attention probabilities (B,H,T,T) per layer, at the
  // cost of about one extra forward of the layers per step. Gradients are
  // bit-identical to the run without it.
  bool gradient_checkpointing = false;
  // Where forward and backward run (zinc-train: the config's "device"). kCuda
  // needs a CUDA build and a GPU; make_gpt throws naming the reason otherwise.
  Device device = Device::kCpu;
};

struct MlpConfig {
  int64_t vocab_size = 256;
  int64_t context = 4;
  int64_t n_embd = 32;
  int64_t hidden = 256;
  int64_t n_layer = 2;
};

// A size rule a model config breaks: the field, named as in the struct (and
// in zinc-train's `model` section), and what is wrong with it, e.g.
// {"n_embd", "must be divisible by n_head 3, got 100"}.
struct SizeError {
  std::string field;
  std::string message;
};

// The first size rule `cfg` breaks, or nothing: the one place the models'
// size rules live. make_gpt / make_mlp throw it; zinc-train reports it at
// the JSON path of the field.
std::optional<SizeError> size_error(const GptConfig& cfg);
std::optional<SizeError> size_error(const MlpConfig& cfg);

// Throw zinc::Error("gpt: FIELD: MESSAGE") (or "mlp: ...") for the first
// rule size_error() finds broken.
std::shared_ptr<Model> make_gpt(const GptConfig& cfg);
std::shared_ptr<Model> make_mlp(const MlpConfig& cfg);

}  // namespace zinc::models

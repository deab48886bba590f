// Tiny built-in models shared by the engine tests: small enough that a test
// trains them for tens of steps in milliseconds, with awkward sizes (13
// tokens, 9 positions, 12-wide) so every block needs padding.
#pragma once

#include <memory>
#include <vector>

#include "engine/engine.h"
#include "models/models.h"

namespace zinc::testing_models {

constexpr int64_t kVocab = 13;
constexpr int64_t kSeq = 9;

inline std::shared_ptr<Model> tiny_gpt(int64_t n_layer = 2, bool gradient_checkpointing = false) {
  models::GptConfig g;
  g.vocab_size = kVocab;
  g.block_size = kSeq;
  g.gradient_checkpointing = gradient_checkpointing;
  g.n_layer = n_layer;
  g.n_head = 2;
  g.n_embd = 12;
  return models::make_gpt(g);
}

// A two-layer GPT of the tiny vocabulary and sequence, `n_embd` wide (wider
// than tiny_gpt where a layer must be cut between ranks' shards inside its
// tensors), on `device` (Device::kCuda: the GPU path, on a GPU or under
// kernel emulation: tests/cuda_emu).
inline std::shared_ptr<Model> small_gpt(int64_t n_embd, Device device = Device::kCpu) {
  models::GptConfig g;
  g.vocab_size = kVocab;
  g.block_size = kSeq;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = n_embd;
  g.device = device;
  return models::make_gpt(g);
}

inline std::shared_ptr<Model> tiny_mlp() {
  models::MlpConfig m;
  m.vocab_size = kVocab;
  m.context = 3;
  m.n_embd = 6;
  m.hidden = 20;
  m.n_layer = 2;
  return models::make_mlp(m);
}

// All parameters of an engine, in block order (padding included).
inline std::vector<float> params_of(const Engine& e, int blocks) {
  std::vector<float> out;
  for (int b = 0; b < blocks; ++b) {
    std::vector<float> s = e.full_params(b);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

}  // namespace zinc::testing_models

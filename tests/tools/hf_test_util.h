// Shared by the Hugging Face tests (hf_model_test.cpp, hf_multirank_test.cpp):
// the fixtures of tests/fixtures/hf, their reference.safetensors, and a
// StepContext that holds a model's initial values in fp32.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/model.h"
#include "tools/safetensors_read.h"

namespace zinc::tools {

inline std::string fixture(const std::string& name) { return std::string(ZINC_SOURCE_DIR) + "/tests/fixtures/hf/" + name; }

// The fixtures zinc loads: tests/fixtures/hf/loaded.txt, one name per line
// ('#' starts a comment).
inline std::vector<std::string> loaded_fixtures() {
  std::ifstream in(std::string(ZINC_SOURCE_DIR) + "/tests/fixtures/hf/loaded.txt");
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') out.push_back(line);
  return out;
}
inline const std::vector<std::string> kFixtures = loaded_fixtures();

// reference.safetensors: input_ids and targets (I32), logits, loss, grad.NAME.
struct Reference {
  explicit Reference(const std::string& dir) : file(dir + "/reference.safetensors") {
    ids = ints("input_ids", B, T);
    targets = ints("targets", B, T);
    logits = floats("logits");
    loss = floats("loss").at(0);
  }
  std::vector<float> floats(const std::string& name) const {
    const StoredTensor* t = file.find(name);
    if (!t) throw Error("reference has no " + name);
    std::vector<float> v(static_cast<size_t>(t->numel()));
    file.read_f32(*t, 0, t->numel(), v.data());
    return v;
  }
  std::vector<int32_t> ints(const std::string& name, int64_t& b, int64_t& t) const {
    const StoredTensor* e = file.find(name);
    if (!e || e->stored_dtype != "I32" || e->shape.size() != 2) throw Error("reference: bad " + name);
    b = e->shape[0];
    t = e->shape[1];
    std::vector<int32_t> v(static_cast<size_t>(e->numel()));
    std::ifstream in(file.path(), std::ios::binary);
    in.seekg(e->begin);
    in.read(reinterpret_cast<char*>(v.data()), e->bytes());
    return v;
  }
  Batch batch() const {
    Batch b;
    b.B = B;
    b.T = T;
    b.inputs = ids;
    b.targets = targets;
    return b;
  }
  SafetensorsFile file;
  int64_t B = 0, T = 0;
  std::vector<int32_t> ids, targets;
  std::vector<float> logits;
  float loss = 0;
};

// fp32 parameters of a model filled from its initial_values, and gradients.
class HostContext final : public StepContext {
 public:
  explicit HostContext(const Model& m) {
    for (size_t b = 0; b < m.blocks().size(); ++b) {
      const BlockSpec& s = m.blocks()[b];
      layouts.push_back(BlockLayout::from_spec(s));
      params.emplace_back(static_cast<size_t>(layouts.back().numel), 0.0f);
      grads_.emplace_back(static_cast<size_t>(layouts.back().numel), 0.0f);
      for (size_t p = 0; p < s.params.size(); ++p)
        EXPECT_TRUE(m.initial_values(static_cast<int>(b), static_cast<int>(p), 0, layouts[b].numels[p],
                                     params[b].data() + layouts[b].offsets[p]));
    }
  }
  DType compute_dtype() const override { return DType::kF32; }
  BlockParams acquire_params(int b) override { return {params[b].data(), DType::kF32, &layouts[b]}; }
  void release_params(int) noexcept override {}
  BlockGrads grads(int b) override { return {grads_[b].data(), &layouts[b]}; }
  void grads_ready(int) override {}
  uint64_t dropout_seed() const override { return seed; }

  uint64_t seed = 0;  // the forwards' dropout stream (0: nothing dropped)
  std::vector<BlockLayout> layouts;
  std::vector<std::vector<float>> params, grads_;
};

// The squares of every reference gradient (grad.*), summed: the squared
// global gradient norm transformers' (or PEFT's) parameters give.
inline double reference_grad_squares(const Reference& ref) {
  double sq = 0;
  for (const StoredTensor& t : ref.file.tensors())
    if (t.name.rfind("grad.", 0) == 0)
      for (float g : ref.floats(t.name)) sq += static_cast<double>(g) * g;
  return sq;
}

// Rank `rank`'s rows of the reference batch split over `world` ranks.
inline Batch rank_rows(const Reference& ref, int rank, int world) {
  const int64_t rows = ref.B / world;
  Batch mine;
  mine.B = rows;
  mine.T = ref.T;
  mine.inputs.assign(ref.ids.begin() + rank * rows * ref.T, ref.ids.begin() + (rank + 1) * rows * ref.T);
  mine.targets.assign(ref.targets.begin() + rank * rows * ref.T, ref.targets.begin() + (rank + 1) * rows * ref.T);
  return mine;
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}


}  // namespace zinc::tools

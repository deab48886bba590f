// Shared by the multi-rank engine tests: one training run described by a
// RunSpec (the tiny models of tiny_models.h on synthetic data), its final
// fp32 weights, and the tolerance for runs that differ only in summation
// order.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "data/data.h"
#include "engine/engine.h"
#include "tests/engine/tiny_models.h"

namespace zinc::testing_train {

inline std::shared_ptr<Model> make_model(const std::string& kind) {
  return kind == "gpt" ? testing_models::tiny_gpt() : testing_models::tiny_mlp();
}

struct RunSpec {
  std::string model = "gpt";
  int stage = 0;
  bool overlap = false;
  int64_t global_batch = 8;
  int64_t gas = 1;
  bool bf16 = false;
  std::string wire = "";
  int64_t bucket = 500000000;
  int steps = 20;
  std::string offload = "none";
  // Replace the optimizer / add a scheduler section when not null.
  nlohmann::json optimizer, scheduler;
  // Merged into zero_optimization (stage 3's keys, offload_param, ...).
  nlohmann::json zero_extra = nlohmann::json::object();
  // Top-level sections set as given (fp16, ...).
  nlohmann::json top_extra = nlohmann::json::object();
  // Builds the model instead of make_model(model) when set.
  std::function<std::shared_ptr<Model>()> make;
  // Called with the engine after training (its counters).
  std::function<void(Engine&)> inspect;
  // The data instead of the synthetic source below when set.
  std::function<std::shared_ptr<const DataSource>()> source;
};

// The engine config of a RunSpec.
inline nlohmann::json make_config(const RunSpec& r) {
  nlohmann::json cfg = {{"train_batch_size", r.global_batch},
                        {"gradient_accumulation_steps", r.gas},
                        {"gradient_clipping", 1.0},
                        {"bf16", {{"enabled", r.bf16}}},
                        {"zero_optimization",
                         {{"stage", r.stage},
                          {"overlap_comm", r.overlap},
                          {"reduce_bucket_size", r.bucket},
                          {"allgather_bucket_size", r.bucket}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  if (!r.wire.empty()) cfg["communication_data_type"] = r.wire;
  if (r.offload != "none") {
    cfg["zero_optimization"]["sub_group_size"] = 2048;
    cfg["zero_optimization"]["offload_optimizer"] = {
        {"device", r.offload}, {"nvme_path", ::testing::TempDir()}, {"buffer_count", 4}};
    cfg["aio"] = {{"block_size", 8192}, {"queue_depth", 4}};
  }
  for (const auto& [k, v] : r.zero_extra.items()) cfg["zero_optimization"][k] = v;
  for (const auto& [k, v] : r.top_extra.items()) cfg[k] = v;
  if (!r.optimizer.is_null()) cfg["optimizer"] = r.optimizer;
  if (!r.scheduler.is_null()) cfg["scheduler"] = r.scheduler;
  return cfg;
}

// All full fp32 weights of an engine, the used elements of each block
// (padding depends on the world size). A collective at stages 1-3.
inline std::vector<float> all_weights(Engine& e) {
  std::vector<float> out;
  const auto& specs = e.model().blocks();
  for (size_t b = 0; b < specs.size(); ++b) {
    std::vector<float> p = e.full_params(static_cast<int>(b));
    BlockLayout l = BlockLayout::from_spec(specs[b]);
    out.insert(out.end(), p.begin(), p.begin() + l.numel);
  }
  return out;
}

// Trains and returns all full fp32 weights.
inline std::vector<float> train(const RunSpec& r, std::shared_ptr<comm::Communicator> comm,
                                std::vector<double>* losses = nullptr) {
  const int world = comm ? comm->size() : 1;
  const int rank = comm ? comm->rank() : 0;
  const nlohmann::json cfg = make_config(r);
  auto model = r.make ? r.make() : make_model(r.model);
  Engine e = Engine::initialize(model, cfg, comm);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  auto src = r.source ? r.source() : std::shared_ptr<const DataSource>(make_data_source(dc));
  DataLoader loader(src, r.global_batch / r.gas / world, r.gas, world, rank, 7);
  for (int s = 0; s < r.steps; ++s) {
    double l = e.train_batch(loader);
    if (losses) losses->push_back(l);
  }
  std::vector<float> out = all_weights(e);
  if (r.inspect) r.inspect(e);
  return out;
}

// Every (stage, optimizer offload) pair a config allows (offload needs
// stage >= 1), in fp32 and bf16: fn(bf16, stage, offload, a label).
template <class Fn>
void for_each_stage_and_offload(Fn&& fn) {
  for (bool bf16 : {false, true})
    for (int stage : {0, 1, 2, 3})
      for (const char* offload : {"none", "cpu", "nvme"}) {
        if (stage == 0 && std::string(offload) != "none") continue;
        fn(bf16, stage, std::string(offload),
           std::string(bf16 ? "bf16" : "fp32") + " stage " + std::to_string(stage) + " offload " + offload);
      }
}

// Weights of two runs that differ only in summation order (across ranks or
// micro-batches). Two measures, both tight:
// - relative difference over weights with |w| >= 1e-2, which must stay below
//   1e-4 after 20 Adam steps (fp32 rounding, compounded);
// - absolute difference over all weights, below 2e-4: a few weights have a
//   gradient that is zero in exact arithmetic and pure rounding noise in
//   practice (the attention key bias: softmax ignores a constant added to
//   every score), and Adam turns noise of either sign into steps of up to lr;
//   with lr 1e-2 they drift by ~1e-4 between any two summation orders.
struct Diff {
  double rel = 0, abs = 0;
};
inline Diff diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  Diff d;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double e = std::fabs(double(a[i]) - b[i]);
    d.abs = std::max(d.abs, e);
    if (std::fabs(b[i]) >= 1e-2) d.rel = std::max(d.rel, e / std::fabs(double(b[i])));
  }
  return d;
}
#define EXPECT_CLOSE_WEIGHTS(a, b, what)                 \
  do {                                                   \
    ::zinc::testing_train::Diff d_ =                     \
        ::zinc::testing_train::diff((a), (b));           \
    EXPECT_LT(d_.rel, 1e-4) << what;                     \
    EXPECT_LT(d_.abs, 2e-4) << what;                     \
  } while (0)


// Activation checkpointing (Note [activation checkpointing], models/gpt/model.cpp)
// changes memory, not numbers: the same runs with and without it, in fp32
// and bf16, at stage 0 and at stage 3 (where backward gathers the layers
// again), with gradient accumulation, give bit-identical losses, gradient
// norms and weights on `comm`'s world (null: one rank).
inline void expect_gradient_checkpointing_bit_identical(std::shared_ptr<comm::Communicator> comm) {
  for (bool bf16 : {false, true})
    for (int stage : {0, 3})
      for (int64_t gas : {1, 2}) {
        const std::string what = std::string(bf16 ? "bf16" : "fp32") + " stage " + std::to_string(stage) +
                                 " accumulation " + std::to_string(gas);
        std::vector<double> losses[2];
        std::vector<float> weights[2];
        double norm[2] = {0, 0};
        for (int ck = 0; ck < 2; ++ck) {
          RunSpec r;
          r.bf16 = bf16;
          r.stage = stage;
          r.gas = gas;
          r.steps = 4;
          r.overlap = stage == 3;
          // No block persists or stays gathered: backward gathers every
          // layer again (with prefetch) before recomputing it.
          if (stage == 3)
            r.zero_extra = {{"stage3_param_persistence_threshold", 0}, {"stage3_max_reuse_distance", 0}};
          r.make = [ck] { return testing_models::tiny_gpt(3, ck == 1); };
          r.inspect = [&norm, ck](Engine& e) { norm[ck] = e.global_grad_norm(); };
          weights[ck] = train(r, comm, &losses[ck]);
        }
        EXPECT_EQ(losses[0], losses[1]) << what;
        EXPECT_GT(norm[0], 0) << what;
        EXPECT_EQ(norm[0], norm[1]) << what;
        EXPECT_TRUE(weights[0] == weights[1]) << what << ": weights differ";
      }
  // LoRA adapters (with their dropout on the GPT): the recomputation must
  // make every adapter's U again, the MLP's down (c_proj) projection's too,
  // whose product the recomputation otherwise skips.
  for (const char* kind : {"gpt", "llama"})
    for (bool bf16 : {false, true}) {
      const std::string what = std::string("LoRA ") + kind + (bf16 ? " bf16" : " fp32");
      std::vector<double> losses[2];
      std::vector<float> weights[2];
      for (int ck = 0; ck < 2; ++ck) {
        RunSpec r;
        r.bf16 = bf16;
        r.gas = 2;
        r.steps = 4;
        const bool gpt = kind == std::string("gpt");
        r.make = [ck, gpt]() -> std::shared_ptr<Model> {
          models::LoraConfig lora;
          lora.r = 2;
          if (gpt) {
            models::GptConfig g;
            g.vocab_size = testing_models::kVocab;
            g.block_size = testing_models::kSeq;
            g.n_layer = 3;
            g.n_head = 2;
            g.n_embd = 12;
            g.gradient_checkpointing = ck == 1;
            lora.dropout = 0.1;
            lora.targets = {"c_attn", "c_proj", "c_fc"};
            g.lora = lora;
            return models::make_gpt(g);
          }
          models::LlamaConfig c;
          c.vocab_size = testing_models::kVocab;
          c.max_position_embeddings = testing_models::kSeq;
          c.hidden_size = 12;
          c.intermediate_size = 20;
          c.num_hidden_layers = 3;
          c.num_attention_heads = 2;
          c.num_key_value_heads = 1;
          c.gradient_checkpointing = ck == 1;
          lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
          c.lora = lora;
          return models::make_llama(c);
        };
        weights[ck] = train(r, comm, &losses[ck]);
      }
      EXPECT_EQ(losses[0], losses[1]) << what;
      EXPECT_TRUE(weights[0] == weights[1]) << what << ": weights differ";
    }
}

}  // namespace zinc::testing_train

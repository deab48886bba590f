// zinc engine: the training engine (public header of engine/).
//
//   auto engine = zinc::Engine::initialize(model, config);
//   for each micro-batch: engine.forward(batch); engine.backward(); engine.step();
//   // or: engine.train_batch(loader) for one whole global batch
//
// step() updates weights only at a gradient-accumulation boundary (every
// gradient_accumulation_steps micro-batches), as DeepSpeed's engine does.
// The engine owns the parameters (fp32 master weights, the bf16 compute copy
// with bf16 on), the gradient accumulators and the optimizer states, laid out
// as one flat vector per model block (see engine/model.h).
//
// Threading: one Engine is driven from one thread. Kernels inside use the
// OpenMP pool.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/data.h"
#include "engine/model.h"

namespace zinc {

// Time spent per phase since the engine started (wall_clock_breakdown).
struct StepTimings {
  double forward_s = 0, backward_s = 0, step_s = 0;
};

class Engine {
 public:
  // Validates the config against the model and allocates all state.
  // Throws ConfigError for a config that cannot train this model.
  static Engine initialize(std::shared_ptr<Model> model, const Config& config);
  static Engine initialize(std::shared_ptr<Model> model, const nlohmann::json& config);

  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  ~Engine();

  // One micro-batch forward; returns its mean loss.
  float forward(const Batch& batch);
  // Backward of the last forward; gradients accumulate.
  void backward();
  // At an accumulation boundary: global norm, clipping, AdamW, schedule
  // advance, gradients zeroed. Elsewhere: nothing.
  void step();
  // gradient_accumulation_steps x (next micro-batch, forward, backward, step).
  // Returns the mean loss over the whole global batch.
  float train_batch(DataLoader& loader);
  // Forward only (no gradients kept); mean loss.
  float evaluate(const Batch& batch);

  // True when the micro-batch most recently run through backward() completes
  // a global batch (so the next step() will update weights).
  bool is_gradient_accumulation_boundary() const;
  // Pre-clip global L2 norm of the averaged gradient at the last boundary.
  double global_grad_norm() const;
  // Learning rate applied by the most recent optimizer step (before the
  // first step: the one the first step will use).
  double learning_rate() const;
  // Optimizer steps taken (global batches completed), skipped ones included.
  int64_t global_steps() const;
  int64_t skipped_steps() const;
  int64_t micro_steps() const;
  // Mean loss over the micro-batches of the last completed global batch.
  double last_batch_loss() const;

  const Config& config() const;
  Model& model();
  DType compute_dtype() const;
  int64_t num_parameters() const;  // unpadded
  StepTimings timings() const;

  // The fp32 master weights of one block (its flat layout).
  std::span<const float> master_params(int block) const;
  // Bytes of model state this rank holds (params, grads, optimizer).
  int64_t model_state_bytes() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinc

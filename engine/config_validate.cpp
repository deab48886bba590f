// zinc engine: Config::validate, the rules that span several keys (the batch
// triad, stage and offload combinations, ...), for parsed configs and for
// configs built in code alike.
#include "engine/config.h"
#include "engine/config_reader.h"

namespace zinc {

using namespace config;

void Config::validate() const {
  // The batch triad, for configs built in code as well as parsed ones.
  if (world_size < 1) throw ConfigError("", "world size must be >= 1, got " + std::to_string(world_size));
  if (train_batch_size < 1 || train_micro_batch_size_per_gpu < 1 || gradient_accumulation_steps < 1 ||
      train_micro_batch_size_per_gpu > kMaxBatch || gradient_accumulation_steps > kMaxBatch ||
      pipeline.stages < 1 || tensor_parallel.size < 1 || sequence_parallel_size < 1 ||
      world_size % model_parallel_size() != 0 ||
      static_cast<__int128>(train_micro_batch_size_per_gpu) * gradient_accumulation_steps * data_parallel_size() !=
          train_batch_size) {
    throw ConfigError("train_batch_size",
                      "the batch triad does not multiply out: train_batch_size " +
                          std::to_string(train_batch_size) + " != train_micro_batch_size_per_gpu " +
                          std::to_string(train_micro_batch_size_per_gpu) + " * gradient_accumulation_steps " +
                          std::to_string(gradient_accumulation_steps) + " * data-parallel size " +
                          std::to_string(pipeline.stages >= 1 && tensor_parallel.size >= 1 && sequence_parallel_size >= 1 &&
                                                 world_size % model_parallel_size() == 0
                                             ? data_parallel_size() : world_size));
  }
  // Pipeline stages (Note [pipeline parallelism] in engine/pipeline.cpp).
  if (pipelined()) {
    if (zero.stage > 1)
      throw ConfigError("zero_optimization.stage",
                        "pipeline stages compose with ZeRO stages 0 and 1 (as DeepSpeed's pipeline engine does): "
                        "stages 2 and 3 would reduce and gather every micro-batch's gradients and parameters, got " +
                            std::to_string(zero.stage));
    if (optimizer.one_bit())
      throw ConfigError("optimizer.type", "the 1-bit optimizers compress whole-model gradients over every rank and "
                                          "do not run with pipeline stages yet");
  }
  // Tensor parts (Note [tensor parallelism] in engine/tensor_parallel.cpp).
  if (tensor_split()) {
    // What the GPU path refuses with parts: check_device_covered (config.cpp).
    if (optimizer.one_bit())
      throw ConfigError("optimizer.type", "the 1-bit optimizers compress whole-model gradients over every rank and "
                                          "do not run with tensor parallelism yet");
    if (gradients_on_nvme())
      throw ConfigError("zero_optimization.offload_optimizer.device",
                        "tensor parts sum the gradients of the weights every part holds whole (norms, biases) over "
                        "the parts in memory; ZeRO-3 with the optimizer states on NVMe keeps the gradients there: "
                        "use \"cpu\"");
  }
  // Sequence ranks (Note [sequence parallelism] in engine/sequence_parallel.cpp).
  if (sequence_split()) {
    if (optimizer.one_bit())
      throw ConfigError("optimizer.type", "the 1-bit optimizers stand each rank's gradient for the replicas' mean, "
                                          "and a sequence rank's is one slice's share: they do not run with "
                                          "sequence_parallel_size yet");
  }
  // Expert ranks (Note [expert parallelism] in engine/expert_parallel.cpp).
  if (expert_split()) {
    if (expert_parallel.size < 1 || world_size % (model_parallel_size() * expert_parallel.size) != 0)
      throw ConfigError("expert_parallel.autoep_size",
                        std::to_string(expert_parallel.size) + " expert ranks do not divide the " +
                            std::to_string(world_size / model_parallel_size()) + " replicas of this run");
    const char* with = pipelined() ? "pipeline stages" : tensor_split() ? "tensor parts" : sequence_split() ? "sequence ranks" : nullptr;
    if (with)
      throw ConfigError("expert_parallel.autoep_size",
                        std::string("expert parallelism does not compose with ") + with +
                            " yet; run the expert ranks with ZeRO data parallelism alone");
    if (optimizer.one_bit())
      throw ConfigError("optimizer.type", "the 1-bit optimizers compress whole-model gradients over every rank and "
                                          "do not run with expert parallelism yet");
    if (gradients_on_nvme())
      throw ConfigError("zero_optimization.offload_optimizer.device",
                        "expert parallelism sums the dense weights' gradients over the expert ranks in memory; "
                        "ZeRO-3 with the optimizer states on NVMe keeps the gradients there: use \"cpu\"");
  }
  if (!(gradient_clipping >= 0)) {
    throw ConfigError("gradient_clipping", "must be >= 0, got " + num(gradient_clipping));
  }
  if (steps_per_print < 1) {
    throw ConfigError("steps_per_print", "must be >= 1, got " + std::to_string(steps_per_print));
  }
  if (grad_accum_dtype != DType::kF32) {
    throw ConfigError("data_types.grad_accum_dtype", "only \"fp32\" is implemented, got \"" +
                                                         std::string(dtype_name(grad_accum_dtype)) + "\"");
  }
  if (optimizer.type == OptimizerType::kAdamW && !optimizer.adam.adam_w_mode) {
    throw ConfigError("optimizer.params.adam_w_mode", "type AdamW needs adam_w_mode true");
  }
  // DeepSpeed's engine asserts "1bit-Adam is not compatible with ZeRO" at
  // any stage above 0: after the freeze every rank keeps the whole momentum
  // and updates every weight, which partitioned states cannot.
  if (optimizer.one_bit() && zero.stage != 0) {
    throw ConfigError("zero_optimization.stage",
                      std::string(optimizer_type_name(optimizer.type)) +
                      " is not compatible with ZeRO (as in DeepSpeed, which refuses every stage above 0): "
                      "after the freeze each rank keeps the whole momentum and updates every weight; set stage 0, "
                      "got " + std::to_string(zero.stage));
  }
  if ((scheduler.type == SchedulerType::kWarmupDecayLR || scheduler.type == SchedulerType::kWarmupCosineLR) &&
      scheduler.total_num_steps < 1) {
    throw ConfigError("scheduler.params.total_num_steps", std::string("required for ") +
                                                              scheduler_type_name(scheduler.type) +
                                                              " (the step at which the decay ends)");
  }

  // ZeRO: inconsistent combinations first, then what zinc does not do yet.
  const auto& oo = zero.offload_optimizer;
  const auto& op = zero.offload_param;
  if (op.device != OffloadDevice::kNone && zero.stage != 3) {
    throw ConfigError(
        "zero_optimization.offload_param",
        "parameter offload needs ZeRO stage 3 (parameters are only partitioned there), got stage " +
            std::to_string(zero.stage));
  }
  if (oo.device != OffloadDevice::kNone && zero.stage == 0) {
    throw ConfigError("zero_optimization.offload_optimizer",
                      "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0");
  }
  for (const auto* o : {&oo, &op}) {
    const char* name = o == &oo ? "offload_optimizer" : "offload_param";
    if (o->device == OffloadDevice::kNvme && o->nvme_path.empty()) {
      throw ConfigError(std::string("zero_optimization.") + name + ".nvme_path",
                        "required for device \"nvme\"");
    }
  }
  // Partial offload (Note [a share of the states on the GPU] in
  // engine/gpu_offload.cpp): the other share of the states lives on the GPU.
  if (oo.ratio < 1.0) {
    const std::string key = "zero_optimization.offload_optimizer.ratio";
    const std::string got = "got ratio " + num(oo.ratio);
    if (oo.device == OffloadDevice::kNone)
      throw ConfigError(key, "the offloaded share of the optimizer states, with offload_optimizer.device \"none\" "
                             "(nothing offloaded); set device \"cpu\" or \"nvme\", or remove ratio (" + got + ")");
    if (device != Device::kCuda)
      throw ConfigError(key, "partial offload (ratio < 1) keeps the rest of the optimizer states on the GPU, and "
                             "this run computes on the CPU; set \"device\": \"cuda\" or ratio 1 (" + got + ")");
    if (world_size > 1)
      throw ConfigError(key, "partial offload (ratio < 1) runs on one rank (one GPU) in zinc, not yet on " +
                                 std::to_string(world_size) + " (" + got + ")");
    if (optimizer.type != OptimizerType::kAdamW && optimizer.type != OptimizerType::kAdam)
      throw ConfigError(key, std::string("partial offload (ratio < 1) updates its GPU share with the GPU's AdamW; "
                                         "the optimizer is ") + optimizer_type_name(optimizer.type) + " (" + got + ")");
  }
}

}  // namespace zinc

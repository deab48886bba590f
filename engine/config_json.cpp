// zinc engine: a parsed Config written back as a ds_config document (see
// to_json in config.h). zinc-train's --check prints it, and a training run's
// config event carries it.
//
// Each key has DeepSpeed's documented name (stage3_prefetch_bucket_size, not
// the alias prefetch_bucket_size; bf16, not bfloat16). A key is written only
// where the parser reads it for the section's type, so that the document
// parses back to the same settings without warnings: a scheduler's params
// are those of its type, and no scheduler is `null` (a constant lr).
#include <string>

#include "engine/config.h"

namespace zinc {

using nlohmann::json;

namespace {

json offload_json(const OffloadConfig& o, bool is_param) {
  json j = {{"device", offload_device_name(o.device)},
            {"nvme_path", o.nvme_path.empty() ? json(nullptr) : json(o.nvme_path)},
            {"pin_memory", o.pin_memory},
            {"buffer_count", o.buffer_count}};
  if (is_param) {
    j["buffer_size"] = o.buffer_size;
    j["max_in_cpu"] = o.max_in_cpu;
  } else {
    j["ratio"] = o.ratio;
  }
  return j;
}

// The params of the schedule's type, from optim's key table.
json scheduler_json(const SchedulerConfig& s) {
  if (s.type == SchedulerType::kConstant) return nullptr;
  json p = json::object();
  for (const optim::ScheduleKey& k : optim::schedule_keys()) {
    if (!k.takes(s.type)) continue;
    json& v = p[k.name];
    if (k.number) v = s.*k.number;
    if (k.integer) v = k.nullable && s.*k.integer == k.null_value ? json(nullptr) : json(s.*k.integer);
    if (k.flag) v = s.*k.flag;
    if (k.warmup) v = optim::warmup_type_name(s.*k.warmup);
  }
  return {{"type", scheduler_type_name(s.type)}, {"params", p}};
}

const char* tag_validation_name(TagValidation t) {
  switch (t) {
    case TagValidation::kIgnore: return "Ignore";
    case TagValidation::kWarn: return "Warn";
    case TagValidation::kFail: return "Fail";
  }
  return "?";
}

}  // namespace

json to_json(const Config& c) {
  const OptimizerConfig& o = c.optimizer;
  const ZeroConfig& z = c.zero;
  json j;
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["gradient_clipping"] = c.gradient_clipping;
  j["steps_per_print"] = c.steps_per_print;
  j["wall_clock_breakdown"] = c.wall_clock_breakdown;
  j["bf16"] = {{"enabled", c.bf16}};
  j["fp16"] = {{"enabled", c.fp16.enabled},
               {"loss_scale", c.fp16.loss_scale},
               {"initial_scale_power", c.fp16.initial_scale_power},
               {"loss_scale_window", c.fp16.loss_scale_window},
               {"hysteresis", c.fp16.hysteresis},
               {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
               {"min_loss_scale", c.fp16.min_loss_scale}};
  j["data_types"] = {{"grad_accum_dtype", std::string(dtype_name(c.grad_accum_dtype))}};
  j["communication_data_type"] =
      c.communication_data_type ? json(std::string(dtype_name(*c.communication_data_type))) : json(nullptr);
  json op = {{"lr", o.lr()},
             {"betas", {o.beta1(), o.beta2()}},
             {"eps", o.eps()},
             {"weight_decay", o.weight_decay()},
             {"bias_correction", o.bias_correction()}};
  if (o.type == OptimizerType::kLamb) {
    op["max_coeff"] = o.lamb.max_coeff;
    op["min_coeff"] = o.lamb.min_coeff;
    op["eps_inside_sqrt"] = o.lamb.eps_inside_sqrt;
  } else if (o.one_bit()) {
    if (o.type == OptimizerType::kZeroOneAdam) {
      op["var_freeze_step"] = o.onebit.var_freeze_step;
      op["var_update_scaler"] = o.onebit.var_update_scaler;
      op["local_step_scaler"] = o.onebit.local_step_scaler;
      op["local_step_clipper"] = o.onebit.local_step_clipper;
    } else {
      op["freeze_step"] = o.onebit.freeze_step;
    }
    if (o.type == OptimizerType::kOneBitLamb) {
      op["max_coeff"] = o.lamb.max_coeff;
      op["min_coeff"] = o.lamb.min_coeff;
      op["coeff_beta"] = o.onebit.coeff_beta;
      op["factor_max"] = o.onebit.factor_max;
      op["factor_min"] = o.onebit.factor_min;
      op["factor_threshold"] = o.onebit.factor_threshold;
    }
    op["cuda_aware"] = o.onebit.cuda_aware;
    op["comm_backend_name"] = o.onebit.comm_backend_name;
  } else {
    op["adam_w_mode"] = o.adam.adam_w_mode;
    if (!o.decay_vectors) op["decay_norms_and_biases"] = false;  // zinc's key: written only where it is not DeepSpeed's rule
  }
  j["optimizer"] = {{"type", optimizer_type_name(o.type)}, {"params", op}};
  j["scheduler"] = scheduler_json(c.scheduler);
  j["zero_optimization"] = {
      {"stage", z.stage},
      {"overlap_comm", z.overlap_comm},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"allgather_partitions", z.allgather_partitions},
      {"offload_optimizer", offload_json(z.offload_optimizer, false)},
      {"offload_param", offload_json(z.offload_param, true)},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"stage3_model_persistence_threshold", z.stage3_model_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
  };
  j["aio"] = {{"block_size", c.aio.block_size},
              {"queue_depth", c.aio.queue_depth},
              {"intra_op_parallelism", c.aio.intra_op_parallelism},
              {"single_submit", c.aio.single_submit},
              {"overlap_events", c.aio.overlap_events}};
  j["device"] = device_name(c.device);
  j["csv_monitor"] = {{"enabled", c.csv_monitor.enabled},
                      {"output_path", c.csv_monitor.output_path},
                      {"job_name", c.csv_monitor.job_name}};
  j["tensorboard"] = {{"enabled", c.tensorboard.enabled},
                      {"output_path", c.tensorboard.output_path},
                      {"job_name", c.tensorboard.job_name}};
  j["checkpoint"] = {{"tag_validation", tag_validation_name(c.checkpoint.tag_validation)}};
  if (c.activation_checkpointing.given) {
    const ActivationCheckpointingConfig& ac = c.activation_checkpointing;
    j["activation_checkpointing"] = {
        {"partition_activations", ac.partition_activations},
        {"contiguous_memory_optimization", ac.contiguous_memory_optimization},
        {"cpu_checkpointing", ac.cpu_checkpointing},
        {"number_checkpoints", ac.number_checkpoints ? json(*ac.number_checkpoints) : json(nullptr)},
        {"synchronize_checkpoint_boundary", ac.synchronize_checkpoint_boundary},
        {"profile", ac.profile}};
  }
  if (c.pipelined()) {
    const char* part = c.pipeline.partition == PipePartition::kUniform ? "uniform" : "parameters";
    j["pipeline"] = {{"stages", c.pipeline.stages},
                     {"partition", c.pipeline.partition == PipePartition::kType ? "type:" + c.pipeline.type_regex
                                                                                 : std::string(part)}};
  }
  if (c.tensor_split()) j["tensor_parallel"] = {{"autotp_size", c.tensor_parallel.size}};
  if (c.sequence_split()) j["sequence_parallel_size"] = c.sequence_parallel_size;
  if (c.expert_split()) {
    j["expert_parallel"] = {{"enabled", true}, {"autoep_size", c.expert_parallel.size}};
    if (!c.expert_parallel.preset_model.empty()) j["expert_parallel"]["preset_model"] = c.expert_parallel.preset_model;
  }
  return j;
}

}  // namespace zinc

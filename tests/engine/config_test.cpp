// Tests for engine/config: defaults, the batch triad, strict validation with
// messages that name the path and the rule, warnings for ignored DeepSpeed
// keys, sections left to the caller, file loading and --set overrides.
// zinc-train's experiment sections (model, data, run, comm) are tested in
// tests/tools/experiment_config_test.cpp.
#include "engine/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "tests/engine/config_test_util.h"

namespace zinc {
namespace {

using nlohmann::json;
using testing_config::any_warning_has;
using testing_config::base;
using testing_config::expect_parts;
using testing_config::with;

using testing_config::config_error;
using testing_config::temp_path;
using testing_config::write_file;

// ---------------------------------------------------------------------------
// Defaults

TEST(ConfigDefaults, MatchDeepSpeedAndHeader) {
  Config c = Config::parse(base());
  EXPECT_EQ(c.world_size, 1);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.0);  // DeepSpeed's GRADIENT_CLIPPING_DEFAULT: no clipping
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_FALSE(c.wall_clock_breakdown);
  EXPECT_FALSE(c.bf16);
  EXPECT_EQ(c.grad_accum_dtype, DType::kF32);
  EXPECT_FALSE(c.communication_data_type.has_value());
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.eps, 1e-8);
  EXPECT_TRUE(c.optimizer.adam.adam_w_mode);
  EXPECT_TRUE(c.optimizer.adam.bias_correction);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kConstant);
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_FALSE(c.zero.overlap_comm);  // stage 0: DeepSpeed's default is false
  EXPECT_TRUE(c.zero.contiguous_gradients);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.csv_monitor.enabled);
  EXPECT_EQ(c.csv_monitor.job_name, "DeepSpeedJobName");
  EXPECT_FALSE(c.tensorboard.enabled);
  EXPECT_EQ(c.tensorboard.output_path, "");
  EXPECT_EQ(c.tensorboard.job_name, "DeepSpeedJobName");
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigDefaults, OverlapCommDefaultFollowsStage) {
  // overlap_comm defaults to (stage == 3), as in DeepSpeed.
  EXPECT_FALSE(Config::parse(with({{"zero_optimization", {{"stage", 0}}}})).zero.overlap_comm);
  EXPECT_TRUE(
      Config::parse(with({{"zero_optimization", {{"stage", 0}, {"overlap_comm", true}}}})).zero.overlap_comm);
  EXPECT_TRUE(Config::parse(with({{"zero_optimization", {{"stage", 3}}}})).zero.overlap_comm);
  EXPECT_FALSE(
      Config::parse(with({{"zero_optimization", {{"stage", 3}, {"overlap_comm", false}}}})).zero.overlap_comm);
  EXPECT_FALSE(Config::parse(with({{"zero_optimization", {{"stage", 2}}}})).zero.overlap_comm);
}

// ---------------------------------------------------------------------------
// Batch triad

TEST(ConfigBatch, AllThreeConsistent) {
  Config c = Config::parse(
      {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 4}},
      2);
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(c.world_size, 2);
}

TEST(ConfigBatch, AnyTwoGiveTheThird) {
  Config a = Config::parse({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}, 2);
  EXPECT_EQ(a.gradient_accumulation_steps, 4);
  Config b = Config::parse({{"train_batch_size", 32}, {"gradient_accumulation_steps", 2}}, 2);
  EXPECT_EQ(b.train_micro_batch_size_per_gpu, 8);
  Config c = Config::parse({{"train_micro_batch_size_per_gpu", 3}, {"gradient_accumulation_steps", 5}}, 2);
  EXPECT_EQ(c.train_batch_size, 30);
}

TEST(ConfigBatch, OneAloneMeansNoAccumulation) {
  Config a = Config::parse({{"train_batch_size", 16}}, 4);
  EXPECT_EQ(a.gradient_accumulation_steps, 1);
  EXPECT_EQ(a.train_micro_batch_size_per_gpu, 4);
  Config b = Config::parse({{"train_micro_batch_size_per_gpu", 6}}, 2);
  EXPECT_EQ(b.gradient_accumulation_steps, 1);
  EXPECT_EQ(b.train_batch_size, 12);
}

TEST(ConfigBatch, MismatchNamesAllValuesAndWorldSize) {
  std::string e = config_error(
      {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}},
      2);
  expect_parts(e, {"train_batch_size", "32", "train_micro_batch_size_per_gpu 4",
                   "gradient_accumulation_steps 2", "world size 2", "(= 16)"});
}

TEST(ConfigBatch, RefusesRemaindersMissingValuesAndNonPositive) {
  expect_parts(config_error({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4}}, 2),
               {"train_batch_size: 30 is not divisible by", "(= 8)"});
  expect_parts(config_error({{"train_batch_size", 9}}, 2),
               {"train_batch_size: 9 is not divisible by world size 2"});
  expect_parts(config_error({{"gradient_accumulation_steps", 4}}),
               {"gradient_accumulation_steps:", "train_batch_size or train_micro_batch_size_per_gpu"});
  expect_parts(config_error(json::object()), {"train_batch_size: missing"});
  expect_parts(config_error({{"train_batch_size", 0}}), {"train_batch_size: must be >= 1, got 0"});
  expect_parts(config_error({{"train_micro_batch_size_per_gpu", 2.5}}),
               {"train_micro_batch_size_per_gpu: expected an integer, got 2.5"});
}

// ---------------------------------------------------------------------------
// Bad configs: each names the path and the rule.

TEST(ConfigErrors, WrongTypesShowTheValue) {
  EXPECT_CONFIG_ERROR(with({{"gradient_clipping", "abc"}}),
                      "gradient_clipping: expected a number, got \"abc\"");
  EXPECT_CONFIG_ERROR(with({{"wall_clock_breakdown", 1}}),
                      "wall_clock_breakdown: expected true or false, got 1");
  EXPECT_CONFIG_ERROR(with({{"bf16", {{"enabled", "auto"}}}}),
                      "bf16.enabled: expected true or false, got \"auto\"", "placeholder");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", 7}}), "zero_optimization: expected an object, got 7");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "Adam"}, {"params", {{"betas", 0.9}}}}}}),
                      "optimizer.params.betas: expected a list of two numbers");
}

// The update takes 1 - beta as 1 - float(beta) (DeepSpeed's CPU Adam's
// arithmetic): a beta that is 1 in fp32 would freeze its moment (the run
// blew up without a NaN), and one whose 1 - beta is more than 1% off is said.
TEST(ConfigErrors, ABetaThatIsOneInFp32IsRefused) {
  for (const char* type : {"AdamW", "Lamb"}) {
    EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", type}, {"params", {{"betas", {0.9, 0.99999999}}}}}}}),
                        "optimizer.params.betas[1]: 0.99999999 is 1 in fp32");
    EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", type}, {"params", {{"betas", {1 - 1e-9, 0.999}}}}}}}),
                        "optimizer.params.betas[0]: 0.999999999 is 1 in fp32");
    const Config near = Config::parse(with({{"optimizer", {{"type", type}, {"params", {{"betas", {0.9, 0.9999999}}}}}}}));
    EXPECT_TRUE(any_warning_has(near, "optimizer.params.betas[1]: 0.9999999: 1 - beta is 1.19209e-07 in fp32"));
    EXPECT_TRUE(any_warning_has(near, "19% off 1e-07"));
    const Config usual = Config::parse(with({{"optimizer", {{"type", type}, {"params", {{"betas", {0.9, 0.999}}}}}}}));
    EXPECT_FALSE(any_warning_has(usual, "betas"));
  }
}

TEST(ConfigErrors, TopLevelMustBeAnObject) {
  EXPECT_CONFIG_ERROR(json::array({1, 2}), "top level", "JSON object");
}

TEST(ConfigErrors, OutOfRange) {
  EXPECT_CONFIG_ERROR(with({{"gradient_clipping", -1}}), "gradient_clipping: must be >= 0, got -1");
  EXPECT_CONFIG_ERROR(with({{"steps_per_print", 0}}), "steps_per_print: must be >= 1, got 0");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"offload_optimizer", {{"buffer_count", 1}}}}}}),
                      "zero_optimization.offload_optimizer.buffer_count: must be >= 2, got 1");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"betas", {0.9, 1.0}}}}}}}),
                      "optimizer.params.betas[1]: must be in [0, 1), got 1.0");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0}}}}}}),
                      "optimizer.params.lr: must be > 0, got 0");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage", 4}}}}),
                      "zero_optimization.stage: must be in [0, 3], got 4");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"reduce_bucket_size", 5.5e8 + 0.5}}}}),
                      "zero_optimization.reduce_bucket_size: expected an integer");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"block_size", 1000}}}}), "aio.block_size: must be in [4096, 1073741824], got 1000");
  // The NVMe store's own ranges, refused by the config (and so by --check):
  // 2^32 + 8 once ran as a queue depth of 8, narrowed to an int.
  EXPECT_CONFIG_ERROR(with({{"aio", {{"queue_depth", 4294967304LL}}}}), "aio.queue_depth: must be in [1, 4096]");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"intra_op_parallelism", 257}}}}), "aio.intra_op_parallelism: must be in [1, 256]");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"block_size", int64_t{1} << 62}}}}), "aio.block_size: must be in [4096,");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"block_size", 6000}}}}), "aio.block_size: must be a multiple of 4096");
}

TEST(ConfigErrors, UnknownKeysSuggestTheNearestKnownKey) {
  EXPECT_CONFIG_ERROR(with({{"gradient_cliping", 1.0}}),
                      "gradient_cliping: unknown key (did you mean 'gradient_clipping'?)");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"offload_optimizer", {{"buffer_cout", 4}}}}}}),
      "zero_optimization.offload_optimizer.buffer_cout: unknown key (did you mean 'buffer_count'?)");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_step", 10}}}}}}),
                      "scheduler.params.warmup_num_step: unknown key (did you mean 'warmup_num_steps'?)");
  // Nothing close: small sections list what they accept.
  EXPECT_CONFIG_ERROR(with({{"csv_monitor", {{"zzzzzzzz", 1}}}}),
                      "csv_monitor.zzzzzzzz: unknown key; known keys here:", "job_name");
  // DeepSpeed splits the offload keys: ratio is not an offload_param key.
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"offload_param", {{"ratio", 0.5}}}}}}),
                      "zero_optimization.offload_param.ratio: unknown key");
}

// Issue 32: at the top level DeepSpeed reads the keys it knows and ignores
// the rest, and real files carry other tools' keys there. zinc warns about
// each and goes on, except for a key one edit from a known one (a typo that
// would drop a setting without a word) and a key with a control character.
TEST(ConfigTopLevel, KeysDeepSpeedDoesNotReadAreWarnedAboutTyposRefused) {
  const Config c = Config::parse(with({{"_comment", "LLaMA-Factory's note"},
                                       {"fp8", {{"enabled", true}}},
                                       {"dynamic_train", true},
                                       {"gradient_clipings", 0.5}}));
  auto warned = [&](const std::string& key) {
    for (const std::string& w : c.warnings)
      if (w.rfind(key + ": not a DeepSpeed key; ignored", 0) == 0) return w;
    return std::string();
  };
  EXPECT_NE(warned("_comment"), "");
  EXPECT_NE(warned("fp8"), "");
  EXPECT_NE(warned("dynamic_train"), "");
  // Two edits from gradient_clipping: warned, with the nearest key named.
  EXPECT_NE(warned("gradient_clipings").find("if you meant 'gradient_clipping'"), std::string::npos);
  EXPECT_EQ(c.warnings.size(), 4u);
  EXPECT_EQ(c.gradient_clipping, 0.0);  // the default: the misspelt 0.5 was ignored
  // One edit (inserted, deleted, replaced, swapped, or case): refused.
  EXPECT_CONFIG_ERROR(with({{"train_batch_sise", 8}}), "train_batch_sise: unknown key (did you mean 'train_batch_size'?)");
  EXPECT_CONFIG_ERROR(with({{"steps_per_prin", 8}}), "steps_per_prin: unknown key (did you mean 'steps_per_print'?)");
  EXPECT_CONFIG_ERROR(with({{"zero_optimziation", {{"stage", 1}}}}),
                      "zero_optimziation: unknown key (did you mean 'zero_optimization'?)");
  EXPECT_CONFIG_ERROR(with({{"Gradient_Clipping", 1.0}}),
                      "Gradient_Clipping: unknown key (did you mean 'gradient_clipping'?)");
  EXPECT_CONFIG_ERROR(with({{"fp166", {{"enabled", true}}}}), "fp166: unknown key (did you mean 'fp16'?)");
  // Nested sections stay strict, as DeepSpeed's are.
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"_comment", "x"}}}}), "zero_optimization._comment: unknown key");
  // Expert ranks (tests/engine/expert_parallel_test.cpp): read, and at one
  // rank two expert ranks cannot be made.
  EXPECT_CONFIG_ERROR(with({{"expert_parallel", {{"enabled", true}, {"autoep_size", 2}}}}),
                      "expert_parallel.autoep_size", "multiple of 2 ranks");
  EXPECT_NO_THROW(Config::parse(with({{"expert_parallel", {{"enabled", false}}}})));
}

// DeepSpeed 0.19's WarmupLR warms up to the optimizer's lr when warmup_max_lr
// is absent; WarmupDecayLR keeps its 0.001.
TEST(ConfigScheduler, WarmupLrPeaksAtTheOptimizersLrByDefault) {
  const json opt = {{"type", "AdamW"}, {"params", {{"lr", 4e-3}}}};
  EXPECT_EQ(Config::parse(with({{"optimizer", opt}, {"scheduler", {{"type", "WarmupLR"}}}})).scheduler.warmup_max_lr,
            4e-3);
  EXPECT_EQ(Config::parse(with({{"optimizer", opt},
                                {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 1e-2}}}}}}))
                .scheduler.warmup_max_lr,
            1e-2);
  EXPECT_EQ(Config::parse(with({{"optimizer", opt},
                                {"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", 10}}}}}}))
                .scheduler.warmup_max_lr,
            0.001);
}

TEST(ConfigErrors, AliasAndNameBothSet) {
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"prefetch_bucket_size", 10}, {"stage3_prefetch_bucket_size", 20}}}}),
      "zero_optimization.prefetch_bucket_size: set twice", "alias 'stage3_prefetch_bucket_size'");
}

TEST(ConfigErrors, PrecisionModes) {
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}}),
                      "fp16.enabled: fp16 and bf16 cannot both be enabled");
  EXPECT_CONFIG_ERROR(with({{"amp", {{"enabled", true}, {"opt_level", "O1"}}}}), "amp.enabled:", "bf16");
  EXPECT_CONFIG_ERROR(with({{"data_types", {{"grad_accum_dtype", "bf16"}}}}),
                      "data_types.grad_accum_dtype: \"bf16\" is not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"fp16_master_weights_and_grads", true}}}}),
                      "fp16.fp16_master_weights_and_grads: not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"initial_scale_power", 2}, {"min_loss_scale", 8}}}}),
                      "fp16.initial_scale_power: 2^2 is below fp16.min_loss_scale 8");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"loss_scale", -1}}}}), "fp16.loss_scale: must be >= 0");
  // A static scale past 2^-64..2^64: 1e-40 made the unscaling factor inf in
  // fp32 and every weight NaN; 1e300 overflowed every step for good.
  for (double s : {1e-40, 1e-300, 1e300})
    EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"loss_scale", s}}}}),
                        "fp16.loss_scale: a static loss scale must lie between 2^-64 and 2^64 (0: dynamic)");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"hysteresis", 0}}}}), "fp16.hysteresis: must be >= 1");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", true}, {"loss_scale_windw", 10}}}}),
                      "fp16.loss_scale_windw: unknown key", "did you mean 'loss_scale_window'");
  EXPECT_CONFIG_ERROR(with({{"bf16", {{"enabled", true}, {"bf16_master_weights_and_grads", true}}}}),
                      "bf16.bf16_master_weights_and_grads: not implemented in zinc");
}

TEST(ConfigErrors, ZeroStagesAndOffload) {
  EXPECT_EQ(Config::parse(with({{"zero_optimization", {{"stage", 1}}}})).zero.stage, 1);
  const Config z3 = Config::parse(with({{"zero_optimization",
                                        {{"stage", 3},
                                         {"stage3_prefetch_bucket_size", 1000},
                                         {"stage3_param_persistence_threshold", 10},
                                         {"stage3_max_live_parameters", 5000},
                                         {"stage3_max_reuse_distance", 0}}}}));
  EXPECT_EQ(z3.zero.stage, 3);
  EXPECT_EQ(z3.zero.stage3_prefetch_bucket_size, 1000);
  EXPECT_EQ(z3.zero.stage3_param_persistence_threshold, 10);
  EXPECT_EQ(z3.zero.stage3_max_live_parameters, 5000);
  EXPECT_EQ(z3.zero.stage3_max_reuse_distance, 0);
  EXPECT_EQ(Config::parse(with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}}}}))
                .zero.offload_param.device,
            OffloadDevice::kCpu);
  EXPECT_EQ(Config::parse(with({{"zero_optimization",
                                 {{"stage", 3}, {"offload_param", {{"device", "nvme"}, {"nvme_path", "/tmp"}}}}}}))
                .zero.offload_param.device,
            OffloadDevice::kNvme);
  // DeepSpeed's parameter buffer pool sizes nothing in zinc: warned about.
  const Config pool = Config::parse(
      with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "cpu"}, {"buffer_size", 1000}}}}}}));
  EXPECT_TRUE(any_warning_has(pool, "zero_optimization.offload_param.buffer_size"));
  // Partial offload keeps the other share on the GPU: on the CPU path it is
  // refused naming why (the GPU's own refusals: cuda_config_test.cpp).
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}}}}}),
      "zero_optimization.offload_optimizer.ratio: partial offload (ratio < 1) keeps the rest of the optimizer "
      "states on the GPU, and this run computes on the CPU",
      "got ratio 0.5");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.25}}}}}}),
      "zero_optimization.offload_optimizer.ratio: partial offload (ratio < 1) keeps the rest");
  // A share outside (0, 1], or not a number.
  for (const json& bad : {json(0), json(-0.5), json(1.5)})
    EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", bad}}}}}}),
                        "zero_optimization.offload_optimizer.ratio: must be in (0, 1], got");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", "half"}}}}}}),
      "zero_optimization.offload_optimizer.ratio: expected a number, got \"half\"");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}}}),
                      "zero_optimization.offload_param: parameter offload needs ZeRO stage 3", "got stage 2");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}}}}),
                      "zero_optimization.offload_param.nvme_path: required for device \"nvme\"");
  EXPECT_EQ(Config::parse(with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}}))
                .zero.offload_optimizer.device,
            OffloadDevice::kCpu);
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}}}),
      "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"ratio", 0.5}}}}}}),
      "zero_optimization.offload_optimizer.ratio: the offloaded share of the optimizer states, with "
      "offload_optimizer.device \"none\"");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"offload_optimizer", {{"device", "disk"}}}}}}),
      "zero_optimization.offload_optimizer.device: must be one of none, cpu, nvme, got \"disk\"");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"zero_quantized_gradients", true}}}}),
                      "zero_optimization.zero_quantized_gradients: not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"zero_hpz_partition_size", 8}}}}),
                      "zero_optimization.zero_hpz_partition_size: not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"use_gds", true}}}}), "aio.use_gds: not implemented in zinc", "GPU");
}

TEST(ConfigErrors, OptimizerAndScheduler) {
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "Lion"}}}}),
                      "optimizer.type: \"Lion\" is not implemented in zinc; supported: Adam, AdamW, Lamb, OneBitAdam, "
                      "ZeroOneAdam, OneBitLamb");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "Lam"}}}}), "(did you mean 'Lamb'?)");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"lr", 1e-3}}}}}}), "optimizer.type: missing");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "Adam"}, {"params", {{"amsgrad", true}}}}}}),
                      "optimizer.params.amsgrad: not implemented in zinc");
  EXPECT_CONFIG_ERROR(
      with({{"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 10}}}}}}),
      "scheduler.params.total_num_steps: required for WarmupDecayLR");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "LRRangeTest"}, {"params", json::object()}}}}),
                      "scheduler.type: \"LRRangeTest\" is not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupCosine"}}}}),
                      "scheduler.type: must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle",
                      "(did you mean 'WarmupCosineLR'?)");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_type", "cosine"}}}}}}),
                      "scheduler.params.warmup_type: must be one of log, linear, got \"cosine\"");
  EXPECT_CONFIG_ERROR(
      with({{"scheduler",
             {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 10}, {"warmup_max_lr", 1}}}}}}),
      "scheduler.params.warmup_max_lr: not a WarmupCosineLR parameter");
}

TEST(ConfigErrors, UnimplementedFeaturesThatChangeTheResult) {
  EXPECT_CONFIG_ERROR(with({{"sparse_gradients", true}}), "sparse_gradients: not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"elasticity", {{"enabled", true}, {"max_train_batch_size", 64}}}}),
                      "elasticity: not implemented in zinc");
  EXPECT_CONFIG_ERROR(with({{"progressive_layer_drop", {{"enabled", true}}}}),
                      "progressive_layer_drop: not implemented");
  // Disabled, they are fine.
  EXPECT_NO_THROW(Config::parse(with({{"sparse_gradients", false}, {"elasticity", {{"enabled", false}}}})));
}

// Sections a caller parses itself (zinc-train's experiment sections):
// without caller_sections they are top-level keys DeepSpeed does not read
// (warned about, ignored); named, the engine leaves them alone and still
// suggests them for a misspelt key.
TEST(ConfigCallerSections, SkippedWhenNamedWarnedAboutOtherwise) {
  const json doc = with({{"model", {{"n_embd", 100}}}, {"extra", {{"anything", 1}}}});
  const Config unnamed = Config::parse(doc);
  ASSERT_EQ(unnamed.warnings.size(), 2u);
  EXPECT_EQ(unnamed.warnings[0].rfind("extra: not a DeepSpeed key; ignored", 0), 0u) << unnamed.warnings[0];
  EXPECT_EQ(unnamed.warnings[1].rfind("model: not a DeepSpeed key; ignored", 0), 0u) << unnamed.warnings[1];
  const Config c = Config::parse(doc, 1, {"model", "extra"});
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_TRUE(c.warnings.empty());
  try {
    Config::parse(with({{"modle", json::object()}}), 1, {"model", "data"});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "modle: unknown key (did you mean 'model'?)");
  }
  // The engine's own sections are still checked next to them.
  try {
    Config::parse(with({{"model", 1}, {"zero_optimization", {{"stage", 5}}}}), 1, {"model"});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "zero_optimization.stage");
  }
}

TEST(ConfigErrors, ValidateChecksConfigsBuiltInCode) {
  Config c;  // triad unset
  expect_parts(
      [&] {
        try {
          c.validate();
        } catch (const ConfigError& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      {"train_batch_size", "does not multiply out"});
}

// torch_adam: DeepSpeed's engine builds torch.optim.AdamW from the keys
// given, whose weight decay without one is torch's 0.01 (zinc took 0); and
// it takes no bias_correction (DeepSpeed fails building it).
TEST(ConfigOptimizer, TorchAdamTakesTorchsDefaultWeightDecay) {
  auto opt = [](const nlohmann::json& params, const char* type = "AdamW") {
    return with({{"optimizer", {{"type", type}, {"params", params}}}});
  };
  EXPECT_DOUBLE_EQ(Config::parse(opt({{"lr", 1e-3}, {"torch_adam", true}})).optimizer.adam.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(Config::parse(opt({{"lr", 1e-3}, {"torch_adam", true}, {"weight_decay", 0.0}})).optimizer.adam.weight_decay,
                   0.0);
  EXPECT_DOUBLE_EQ(Config::parse(opt({{"lr", 1e-3}})).optimizer.adam.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(  // type Adam: adam_w_mode true by default, so torch.optim.AdamW too
      Config::parse(opt({{"lr", 1e-3}, {"torch_adam", true}}, "Adam")).optimizer.adam.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(  // Adam in L2 mode: torch.optim.Adam, whose default is 0
      Config::parse(opt({{"lr", 1e-3}, {"torch_adam", true}, {"adam_w_mode", false}}, "Adam")).optimizer.adam.weight_decay,
      0.0);
  EXPECT_CONFIG_ERROR(opt({{"lr", 1e-3}, {"torch_adam", true}, {"bias_correction", false}}),
                      "optimizer.params.bias_correction", "torch_adam");
}

// bf16.check_grad_overflow true is DeepSpeed's default and what zinc does
// (a step whose gradients are not finite is skipped): said only for false.
TEST(ConfigWarnings, Bf16CheckGradOverflowIsSaidOnlyWhenTurnedOff) {
  EXPECT_FALSE(any_warning_has(Config::parse(with({{"bf16", {{"enabled", true}, {"check_grad_overflow", true}}}})),
                               "check_grad_overflow"));
  EXPECT_TRUE(any_warning_has(Config::parse(with({{"bf16", {{"enabled", true}, {"check_grad_overflow", false}}}})),
                              "zinc always skips a step whose gradient norm is not finite"));
}

// ---------------------------------------------------------------------------
// Accepted DeepSpeed spellings

TEST(ConfigAccepts, DeepSpeedSpellingsAndForms) {
  Config c = Config::parse(with({
      {"bfloat16", {{"enabled", true}}},
      {"optimizer",
       {{"type", "adamw"},
        {"params", {{"lr", 3e-4}, {"betas", {0.8, 0.95}}, {"weight_decay", 0.1}, {"torch_adam", true}}}}},
      {"zero_optimization",
       {{"stage", 0},
        {"reduce_bucket_size", 5e8},
        {"stage3_prefetch_bucket_size", 2e7},
        {"stage3_param_persistence_threshold", 1e4},
        {"offload_optimizer", nullptr}}},
      {"aio", {{"thread_count", 2}, {"block_size", 262144}}},
      {"csv_monitor", {{"enabled", true}, {"output_path", "out/"}, {"job_name", "j"}}},
      {"communication_data_type", "bf16"},
      {"data_types", {{"grad_accum_dtype", "fp32"}}},
      {"fp16", {{"enabled", false}, {"loss_scale", 0}, {"initial_scale_power", 16}}},
  }));
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.beta2, 0.95);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 20000000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 10000);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_TRUE(c.csv_monitor.enabled);
  EXPECT_EQ(c.csv_monitor.output_path, "out/");
  EXPECT_EQ(c.communication_data_type, DType::kBF16);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigAccepts, Fp16SectionWithDeepSpeedsDefaults) {
  Config d = Config::parse(with({{"fp16", {{"enabled", true}}}}));
  EXPECT_TRUE(d.fp16.enabled);
  EXPECT_EQ(d.fp16.loss_scale, 0);
  EXPECT_EQ(d.fp16.initial_scale_power, 16);
  EXPECT_EQ(d.fp16.loss_scale_window, 1000);
  EXPECT_EQ(d.fp16.hysteresis, 2);
  EXPECT_FALSE(d.fp16.consecutive_hysteresis);
  EXPECT_EQ(d.fp16.min_loss_scale, 1);
  EXPECT_FALSE(d.communication_data_type.has_value());  // the engine puts fp16 on the wire
  Config c = Config::parse(with({{"fp16",
                                  {{"enabled", true},
                                   {"loss_scale", 0},
                                   {"initial_scale_power", 12},
                                   {"loss_scale_window", 500},
                                   {"hysteresis", 3},
                                   {"consecutive_hysteresis", true},
                                   {"min_loss_scale", 0.5},
                                   {"auto_cast", false}}},
                                 {"communication_data_type", "fp32"}}));
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_EQ(c.communication_data_type, DType::kF32);
  EXPECT_TRUE(c.warnings.empty());
  Config wire = Config::parse(with({{"communication_data_type", "fp16"}}));
  EXPECT_EQ(wire.communication_data_type, DType::kF16);
}

TEST(ConfigAccepts, LossScalingKeysInTheBf16SectionAreIgnoredWithAWarning) {
  Config c = Config::parse(with({{"bf16", {{"enabled", true}, {"loss_scale", 0}, {"initial_scale_power", 16},
                                           {"loss_scale_window", 1000}, {"hysteresis", 2}, {"min_loss_scale", 1}}}}));
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.warnings.size(), 4u);
  for (const std::string& w : c.warnings) EXPECT_NE(w.find("bf16 trains without loss scaling"), std::string::npos) << w;
}

TEST(ConfigAccepts, AdamWModeFollowsTheType) {
  Config adam =
      Config::parse(with({{"optimizer", {{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}}}));
  EXPECT_EQ(adam.optimizer.type, OptimizerType::kAdam);
  EXPECT_FALSE(adam.optimizer.adam.adam_w_mode);
  EXPECT_TRUE(Config::parse(with({{"optimizer", {{"type", "Adam"}}}})).optimizer.adam.adam_w_mode);
  Config adamw =
      Config::parse(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}}}));
  EXPECT_TRUE(adamw.optimizer.adam.adam_w_mode);
  EXPECT_TRUE(any_warning_has(adamw, "optimizer.params.adam_w_mode"));
}

TEST(ConfigAccepts, Schedulers) {
  Config w = Config::parse(with({{"scheduler",
                                  {{"type", "WarmupLR"},
                                   {"params",
                                    {{"warmup_min_lr", 0},
                                     {"warmup_max_lr", 0.01},
                                     {"warmup_num_steps", 50},
                                     {"warmup_type", "linear"}}}}}}));
  EXPECT_EQ(w.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_DOUBLE_EQ(w.scheduler.warmup_max_lr, 0.01);
  EXPECT_EQ(w.scheduler.warmup_num_steps, 50);
  EXPECT_EQ(w.scheduler.warmup_type, WarmupType::kLinear);
  Config cos = Config::parse(with({{"scheduler",
                                    {{"type", "WarmupCosineLR"},
                                     {"params",
                                      {{"total_num_steps", 1000},
                                       {"warmup_min_ratio", 0.1},
                                       {"cos_min_ratio", 0.01},
                                       {"warmup_num_steps", 0},
                                       {"last_batch_iteration", -1}}}}}}));
  EXPECT_EQ(cos.scheduler.total_num_steps, 1000);
  EXPECT_DOUBLE_EQ(cos.scheduler.warmup_min_ratio, 0.1);
  EXPECT_DOUBLE_EQ(cos.scheduler.cos_min_ratio, 0.01);
  EXPECT_EQ(cos.scheduler.warmup_num_steps, 0);
  EXPECT_TRUE(cos.warnings.empty());
}

TEST(ConfigAccepts, LambWithEveryFusedLambParameter) {
  Config d = Config::parse(with({{"optimizer", {{"type", "lamb"}}}}));
  EXPECT_EQ(d.optimizer.type, OptimizerType::kLamb);
  EXPECT_DOUBLE_EQ(d.optimizer.lamb.max_coeff, 10.0);  // FusedLamb's defaults
  EXPECT_DOUBLE_EQ(d.optimizer.lamb.min_coeff, 0.01);
  EXPECT_FALSE(d.optimizer.lamb.eps_inside_sqrt);
  EXPECT_TRUE(d.optimizer.lamb.bias_correction);
  Config c = Config::parse(with({{"optimizer",
                                  {{"type", "LAMB"},
                                   {"params",
                                    {{"lr", 0.002},
                                     {"betas", {0.8, 0.95}},
                                     {"eps", 1e-6},
                                     {"weight_decay", 0.01},
                                     {"bias_correction", false},
                                     {"max_coeff", 5.0},
                                     {"min_coeff", 0.1},
                                     {"max_grad_norm", 0.0},
                                     {"eps_inside_sqrt", true},
                                     {"amsgrad", false}}}}}}));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kLamb);
  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "Lamb");
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.lr, 0.002);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.weight_decay, 0.01);
  EXPECT_FALSE(c.optimizer.lamb.bias_correction);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.max_coeff, 5.0);
  EXPECT_DOUBLE_EQ(c.optimizer.lamb.min_coeff, 0.1);
  EXPECT_TRUE(c.optimizer.lamb.eps_inside_sqrt);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigErrors, LambParameters) {
  auto lamb = [](const json& params) { return with({{"optimizer", {{"type", "Lamb"}, {"params", params}}}}); };
  EXPECT_CONFIG_ERROR(lamb({{"amsgrad", true}}), "optimizer.params.amsgrad: not implemented in zinc",
                      "FusedLamb does not support the AMSGrad variant");
  EXPECT_CONFIG_ERROR(lamb({{"max_grad_norm", 1.0}}), "optimizer.params.max_grad_norm:",
                      "use the top-level gradient_clipping");
  EXPECT_CONFIG_ERROR(lamb({{"adam_w_mode", true}}), "optimizer.params.adam_w_mode: an Adam parameter");
  EXPECT_CONFIG_ERROR(lamb({{"min_coeff", 2.0}, {"max_coeff", 1.0}}), "optimizer.params.min_coeff: must be <= max_coeff 1, got 2");
  EXPECT_CONFIG_ERROR(lamb({{"max_coeff", 0}}), "optimizer.params.max_coeff: must be > 0, got 0");
  EXPECT_CONFIG_ERROR(lamb({{"eps_inside_sqrt", 1}}), "optimizer.params.eps_inside_sqrt: expected true or false, got 1");
  EXPECT_CONFIG_ERROR(lamb({{"max_cof", 1}}), "optimizer.params.max_cof", "did you mean 'max_coeff'");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"max_coeff", 5.0}}}}}}),
                      "optimizer.params.max_coeff: a Lamb parameter; type AdamW does not take it");
}

TEST(ConfigAccepts, OneCycleWithDeepSpeedDefaults) {
  Config d = Config::parse(
      with({{"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 1e-4}, {"cycle_max_lr", 1e-3}}}}}}));
  EXPECT_EQ(d.scheduler.type, SchedulerType::kOneCycle);
  EXPECT_STREQ(scheduler_type_name(d.scheduler.type), "OneCycle");
  EXPECT_DOUBLE_EQ(d.scheduler.cycle_min_lr, 1e-4);
  EXPECT_DOUBLE_EQ(d.scheduler.cycle_max_lr, 1e-3);
  EXPECT_DOUBLE_EQ(d.scheduler.decay_lr_rate, 0.0);
  EXPECT_EQ(d.scheduler.cycle_first_step_size, 2000);
  EXPECT_EQ(d.scheduler.cycle_second_step_size, -1);
  EXPECT_EQ(d.scheduler.decay_step_size, 0);
  EXPECT_TRUE(d.scheduler.cycle_momentum);
  EXPECT_DOUBLE_EQ(d.scheduler.cycle_min_mom, 0.8);
  EXPECT_DOUBLE_EQ(d.scheduler.cycle_max_mom, 0.9);
  EXPECT_DOUBLE_EQ(d.scheduler.decay_mom_rate, 0.0);
  // The default Adam beta2 0.999 is replaced by DeepSpeed's 0.99 while momentum cycles: said once.
  EXPECT_TRUE(any_warning_has(d, "scheduler.params.cycle_momentum: OneCycle sets the optimizer's betas to (momentum, 0.99)"));

  Config c = Config::parse(with({{"optimizer", {{"type", "Adam"}, {"params", {{"betas", {0.9, 0.99}}}}}},
                                 {"scheduler",
                                  {{"type", "OneCycle"},
                                   {"params",
                                    {{"cycle_min_lr", 0.001},
                                     {"cycle_max_lr", 0.01},
                                     {"decay_lr_rate", 0.5},
                                     {"cycle_first_step_size", 100},
                                     {"cycle_second_step_size", nullptr},
                                     {"cycle_first_stair_count", 0},
                                     {"cycle_second_stair_count", nullptr},
                                     {"decay_step_size", 10},
                                     {"cycle_momentum", true},
                                     {"cycle_min_mom", 0.85},
                                     {"cycle_max_mom", 0.95},
                                     {"decay_mom_rate", 0.0},
                                     {"last_batch_iteration", -1}}}}}}));
  EXPECT_EQ(c.scheduler.cycle_first_step_size, 100);
  EXPECT_EQ(c.scheduler.cycle_second_step_size, -1);
  EXPECT_EQ(c.scheduler.decay_step_size, 10);
  EXPECT_DOUBLE_EQ(c.scheduler.decay_lr_rate, 0.5);
  EXPECT_DOUBLE_EQ(c.scheduler.cycle_min_mom, 0.85);
  EXPECT_DOUBLE_EQ(c.scheduler.cycle_max_mom, 0.95);
  EXPECT_TRUE(c.warnings.empty());

  Config stairs = Config::parse(with(
      {{"scheduler",
        {{"type", "OneCycle"},
         {"params", {{"cycle_min_lr", 0}, {"cycle_max_lr", 1}, {"cycle_momentum", false}, {"cycle_first_stair_count", 4}}}}}}));
  EXPECT_FALSE(stairs.scheduler.cycle_momentum);
  // DeepSpeed 0.19 holds lr and momentum flat across each stair: parsed, not ignored.
  EXPECT_EQ(stairs.scheduler.cycle_first_stair_count, 4);
  EXPECT_EQ(stairs.scheduler.cycle_second_stair_count, -1);  // null/absent: the first's count
  EXPECT_TRUE(stairs.warnings.empty());
}

TEST(ConfigErrors, OneCycleParameters) {
  auto oc = [](const json& params) { return with({{"scheduler", {{"type", "OneCycle"}, {"params", params}}}}); };
  EXPECT_CONFIG_ERROR(oc({{"cycle_max_lr", 0.1}}), "scheduler.params.cycle_min_lr: required for OneCycle");
  EXPECT_CONFIG_ERROR(oc({{"cycle_min_lr", 0.1}}), "scheduler.params.cycle_max_lr: required for OneCycle");
  const json lrs = {{"cycle_min_lr", 0.01}, {"cycle_max_lr", 0.1}};
  auto plus = [&](const char* k, const json& v) {
    json p = lrs;
    p[k] = v;
    return oc(p);
  };
  EXPECT_CONFIG_ERROR(plus("cycle_first_step_size", 0), "scheduler.params.cycle_first_step_size: must be >= 1, got 0");
  // 0 is allowed (DeepSpeed 0.19: non-negative): a cycle that only rises.
  EXPECT_CONFIG_ERROR(plus("cycle_second_step_size", -2), "scheduler.params.cycle_second_step_size: must be >= 0");
  EXPECT_CONFIG_ERROR(plus("cycle_min_mom", 1.0), "scheduler.params.cycle_min_mom: must be in [0, 1), got 1");
  EXPECT_CONFIG_ERROR(plus("decay_step_size", -1), "scheduler.params.decay_step_size: must be >= 0");
  EXPECT_CONFIG_ERROR(plus("cycle_momentum", "yes"), "scheduler.params.cycle_momentum: expected true or false");
  EXPECT_CONFIG_ERROR(plus("warmup_num_steps", 10), "scheduler.params.warmup_num_steps: not a OneCycle parameter (used by WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  EXPECT_CONFIG_ERROR(plus("cycle_max_mon", 0.9), "scheduler.params.cycle_max_mon",
                      "did you mean 'cycle_max_mom'");
}

// ---------------------------------------------------------------------------
// Warnings: known DeepSpeed keys that zinc ignores, logged and recorded.

TEST(ConfigWarnings, ParsedKeysWithoutAnEffectAreWarnedAbout) {
  Config c = Config::parse(with({{"zero_optimization", {{"stage", 2}, {"reduce_scatter", false}, {"allgather_partitions", false}}}}));
  EXPECT_TRUE(any_warning_has(c, "zero_optimization.reduce_scatter: false is ignored"));
  EXPECT_TRUE(any_warning_has(c, "zero_optimization.allgather_partitions: false is ignored"));
  Config d = Config::parse(with({{"zero_optimization", {{"stage", 2}, {"reduce_scatter", true}, {"allgather_partitions", true}}}}));
  EXPECT_TRUE(d.warnings.empty());
}

TEST(ConfigWarnings, IgnoredFeaturesAreRecorded) {
  Config c = Config::parse(with({{"comms_logger", {{"enabled", true}}}}));
  ASSERT_EQ(c.warnings.size(), 1u);
  expect_parts(c.warnings[0], {"comms_logger", "ignored"});

  Config off = Config::parse(with({{"comms_logger", {{"enabled", false}}}, {"wandb", {{"enabled", false}}}}));
  EXPECT_TRUE(off.warnings.empty());

  Config many = Config::parse(with({{"prescale_gradients", true},
                                    {"gradient_predivide_factor", 2.0},
                                    {"flops_profiler", {{"enabled", true}}},
                                    {"zero_optimization", {{"load_from_fp32_weights", false}}},
                                    {"bf16", {{"enabled", true}, {"immediate_grad_update", true}}}}));
  EXPECT_TRUE(any_warning_has(many, "prescale_gradients: ignored"));
  EXPECT_TRUE(any_warning_has(many, "gradient_predivide_factor: ignored"));
  EXPECT_TRUE(any_warning_has(many, "flops_profiler: ignored"));
  EXPECT_TRUE(any_warning_has(many, "zero_optimization.load_from_fp32_weights: ignored"));
  EXPECT_TRUE(any_warning_has(many, "bf16.immediate_grad_update: ignored"));
}

TEST(ConfigMonitors, TensorBoardIsParsedAsDeepSpeedNamesIt) {
  Config c = Config::parse(with({{"tensorboard", {{"enabled", true}, {"output_path", "tb/"}, {"job_name", "j"}}}}));
  EXPECT_TRUE(c.tensorboard.enabled);
  EXPECT_EQ(c.tensorboard.output_path, "tb/");
  EXPECT_EQ(c.tensorboard.job_name, "j");
  EXPECT_FALSE(c.csv_monitor.enabled);
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_CONFIG_ERROR(with({{"tensorboard", {{"job_nam", "j"}}}}), "tensorboard.job_nam: unknown key",
                      "job_name");
  EXPECT_CONFIG_ERROR(with({{"tensorboard", {{"enabled", "yes"}}}}), "tensorboard.enabled", "expected");
}

TEST(ConfigMonitors, OnlineMonitorsAreRefusedWhenEnabled) {
  for (const char* key : {"wandb", "comet"}) {
    SCOPED_TRACE(key);
    const std::string e = config_error(with({{key, {{"enabled", true}, {"project", "p"}}}}));
    expect_parts(e, {std::string(key) + ".enabled", "network service", "tensorboard", "csv_monitor"});
    EXPECT_EQ(e.find('\n'), std::string::npos);  // one line
    Config off = Config::parse(with({{key, {{"enabled", false}, {"project", "p"}}}}));
    EXPECT_TRUE(off.warnings.empty());
  }
  EXPECT_CONFIG_ERROR(with({{"wandb", {{"enabled", false}, {"projekt", "p"}}}}), "wandb.projekt: unknown key",
                      "project");
}

TEST(ConfigWarnings, ScheduleShorterThanWarmup) {
  Config c = Config::parse(with(
      {{"scheduler",
        {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", 10}, {"warmup_num_steps", 100}}}}}}));
  EXPECT_TRUE(any_warning_has(c, "scheduler.params.total_num_steps: 10 is less than warmup_num_steps 100"));
}

// OneBitAdam: DeepSpeed's keys and defaults (deepspeed/runtime/fp16/onebit/
// adam.py), its update's fixed settings, and its refusals.
TEST(ConfigOneBitAdam, KeysDefaultsAndRefusals) {
  auto onebit = [](const json& params) {
    return with({{"optimizer", {{"type", "OneBitAdam"}, {"params", params}}}});
  };
  Config c = Config::parse(onebit({{"lr", 4e-4}, {"weight_decay", 0.01}, {"bias_correction", false},
                                   {"cuda_aware", false}, {"comm_backend_name", "mpi"}}));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kOneBitAdam);
  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "OneBitAdam");
  EXPECT_EQ(c.optimizer.onebit.freeze_step, 100000);  // DeepSpeed's default
  EXPECT_EQ(c.optimizer.onebit.comm_backend_name, "mpi");
  EXPECT_DOUBLE_EQ(c.optimizer.lr(), 4e-4);
  EXPECT_FALSE(c.optimizer.adam.bias_correction);
  EXPECT_TRUE(c.optimizer.adam.adam_w_mode);
  EXPECT_TRUE(c.warnings.empty());
  // DeepSpeed spells it both ways in its own examples.
  EXPECT_NO_THROW(Config::parse(with({{"optimizer", {{"type", "OnebitAdam"}}}})));
  // The config round trip keeps it.
  EXPECT_EQ(Config::parse(to_json(c)).optimizer, c.optimizer);
  // Settings DeepSpeed's OnebitAdam accepts and ignores: a warning each.
  Config w = Config::parse(onebit({{"bias_correction", true}, {"eps_inside_sqrt", true}, {"max_grad_norm", 1.0}}));
  EXPECT_TRUE(any_warning_has(w, "optimizer.params.bias_correction: true has no effect"));
  EXPECT_TRUE(any_warning_has(w, "optimizer.params.eps_inside_sqrt: true has no effect"));
  EXPECT_TRUE(any_warning_has(w, "optimizer.params.max_grad_norm: has no effect"));
  EXPECT_CONFIG_ERROR(onebit({{"freeze_step", 0}}), "optimizer.params.freeze_step");
  EXPECT_CONFIG_ERROR(onebit({{"amsgrad", true}}), "optimizer.params.amsgrad", "AMSGrad");
  EXPECT_CONFIG_ERROR(onebit({{"adam_w_mode", false}}), "optimizer.params.adam_w_mode: not a OneBitAdam parameter");
  EXPECT_CONFIG_ERROR(onebit({{"comm_backend_name", "hccl"}}), "optimizer.params.comm_backend_name: \"hccl\"",
                      "Ascend");
  EXPECT_CONFIG_ERROR(onebit({{"comm_backend_name", "gloo"}}), "not one of DeepSpeed's");
  EXPECT_CONFIG_ERROR(onebit({{"var_freeze_step", 10}}), "optimizer.params.var_freeze_step");
  EXPECT_CONFIG_ERROR(onebit({{"local_step_scaler", 10}}), "optimizer.params.local_step_scaler: not a OneBitAdam");
  // ZeroOneAdam: its own keys and DeepSpeed's defaults.
  auto zero_one = [](const json& params) {
    return with({{"optimizer", {{"type", "ZeroOneAdam"}, {"params", params}}}});
  };
  Config z = Config::parse(zero_one({{"lr", 4e-4}, {"var_freeze_step", 12500}, {"local_step_scaler", 32678}}));
  EXPECT_EQ(z.optimizer.type, OptimizerType::kZeroOneAdam);
  EXPECT_EQ(z.optimizer.onebit.var_freeze_step, 12500);
  EXPECT_EQ(z.optimizer.onebit.var_update_scaler, 16);
  EXPECT_EQ(z.optimizer.onebit.local_step_scaler, 32678);
  EXPECT_EQ(z.optimizer.onebit.local_step_clipper, 16);
  EXPECT_FALSE(z.optimizer.adam.bias_correction);
  EXPECT_EQ(Config::parse(to_json(z)).optimizer, z.optimizer);
  EXPECT_EQ(Config::parse(zero_one(json::object())).optimizer.onebit.var_freeze_step, 100000);
  EXPECT_CONFIG_ERROR(zero_one({{"freeze_step", 10}}), "optimizer.params.freeze_step: not a ZeroOneAdam parameter");
  EXPECT_CONFIG_ERROR(zero_one({{"var_update_scaler", 0}}), "optimizer.params.var_update_scaler");
  EXPECT_CONFIG_ERROR(zero_one({{"local_step_clipper", 0}}), "optimizer.params.local_step_clipper");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "ZeroOneAdam"}}}, {"zero_optimization", {{"stage", 1}}}}),
                      "zero_optimization.stage: ZeroOneAdam is not compatible with ZeRO");
  // OneBitLamb: Lamb's coefficient bounds and its own factor keys.
  auto lamb = [](const json& params) {
    return with({{"optimizer", {{"type", "OneBitLamb"}, {"params", params}}}});
  };
  Config l = Config::parse(lamb({{"lr", 5e-3}, {"max_coeff", 0.3}, {"min_coeff", 0.01}, {"freeze_step", 1000},
                                 {"coeff_beta", 0.9}, {"factor_max", 2.0}, {"factor_min", 0.5},
                                 {"factor_threshold", 0.1}}));
  EXPECT_EQ(l.optimizer.type, OptimizerType::kOneBitLamb);
  EXPECT_DOUBLE_EQ(l.optimizer.lr(), 5e-3);
  EXPECT_DOUBLE_EQ(l.optimizer.lamb.max_coeff, 0.3);
  EXPECT_EQ(l.optimizer.onebit.freeze_step, 1000);
  EXPECT_DOUBLE_EQ(l.optimizer.onebit.factor_max, 2.0);
  EXPECT_FALSE(l.optimizer.lamb.bias_correction);
  EXPECT_EQ(Config::parse(to_json(l)).optimizer, l.optimizer);
  const Config ld = Config::parse(lamb(json::object()));  // DeepSpeed's defaults
  EXPECT_DOUBLE_EQ(ld.optimizer.lamb.max_coeff, 10.0);
  EXPECT_DOUBLE_EQ(ld.optimizer.onebit.factor_max, 4.0);
  EXPECT_DOUBLE_EQ(ld.optimizer.onebit.factor_min, 0.5);
  EXPECT_DOUBLE_EQ(ld.optimizer.onebit.coeff_beta, 0.9);
  EXPECT_CONFIG_ERROR(lamb({{"factor_min", 3.0}, {"factor_max", 2.0}}), "optimizer.params.factor_min: must be <= factor_max");
  EXPECT_CONFIG_ERROR(lamb({{"min_coeff", 3.0}, {"max_coeff", 2.0}}), "optimizer.params.min_coeff: must be <= max_coeff");
  EXPECT_CONFIG_ERROR(lamb({{"var_freeze_step", 3}}), "optimizer.params.var_freeze_step: not a OneBitLamb parameter");
  EXPECT_CONFIG_ERROR(onebit({{"coeff_beta", 0.5}}), "optimizer.params.coeff_beta: not a OneBitAdam parameter");
  EXPECT_CONFIG_ERROR(lamb({{"freeze_stpe", 3}}), "optimizer.params.freeze_stpe: unknown key (did you mean 'freeze_step'?)");
  // ZeRO: DeepSpeed asserts "1bit-Adam is not compatible with ZeRO" above stage 0.
  for (int stage : {1, 2, 3})
    EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "OneBitAdam"}}}, {"zero_optimization", {{"stage", stage}}}}),
                        "zero_optimization.stage: OneBitAdam is not compatible with ZeRO",
                        "got " + std::to_string(stage));
}

}  // namespace
}  // namespace zinc

// Tests for keys that earlier DeepSpeed releases accepted (engine/config.cpp,
// parse_legacy and the legacy spellings in parse_zero): harmless ones parse
// with a warning naming them as ignored, or take effect where DeepSpeed gave
// them one; ones that change training are refused with the key and the
// reason; a misspelling of one still gets "did you mean".
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "engine/config.h"
#include "tests/engine/config_test_util.h"

namespace zinc {
namespace {

using nlohmann::json;
using testing_config::any_warning_has;
using testing_config::config_error;
using testing_config::with;

TEST(ConfigLegacy, HarmlessKeysWarnAsIgnored) {
  struct Case {
    json patch;
    const char* key;
  };
  const Case cases[] = {
      {{{"zero_reduce_scatter", false}}, "zero_reduce_scatter: ignored"},
      {{{"zero_max_elements_per_comm", 1000}}, "zero_max_elements_per_comm: ignored"},
      {{{"allgather_size", 1000}, {"zero_optimization", {{"stage", 2}}}}, "allgather_size: ignored"},
      {{{"zero_optimization", {{"stage", 2}, {"find_unused_parameters", true}}}},
       "zero_optimization.find_unused_parameters: ignored"},
      {{{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"pipeline", true}}}}}},
       "zero_optimization.offload_optimizer.pipeline: ignored"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.patch.dump());
    Config cfg = Config::parse(with(c.patch));
    EXPECT_TRUE(any_warning_has(cfg, c.key)) << json(cfg.warnings).dump();
    // The result is that of the config without the key.
    json plain = with(c.patch);
    for (const char* k : {"zero_reduce_scatter", "zero_max_elements_per_comm", "allgather_size"}) plain.erase(k);
    if (plain.contains("zero_optimization")) {
      plain["zero_optimization"].erase("find_unused_parameters");
      if (plain["zero_optimization"].contains("offload_optimizer"))
        plain["zero_optimization"]["offload_optimizer"].erase("pipeline");
    }
    Config ref = Config::parse(plain);
    EXPECT_EQ(to_json(cfg), to_json(ref));
  }
  // DeepSpeed reads the sequence-parallel wire type from
  // seq_parallel_comm_data_type; its constants.py documents it as
  // seq_parallel_communication_data_type, which configs copy (Accelerate's
  // ALST example) and DeepSpeed never reads. zinc has no sequence
  // parallelism: both spellings are warned about as ignored.
  for (const char* key : {"seq_parallel_comm_data_type", "seq_parallel_communication_data_type"}) {
    Config cfg = Config::parse(with({{key, "bf16"}}));
    EXPECT_TRUE(any_warning_has(cfg, std::string(key) + ": ignored")) << json(cfg.warnings).dump();
    EXPECT_EQ(to_json(cfg), to_json(Config::parse(with(json::object()))));
    testing_config::expect_parts(config_error(with({{key, "int8"}})), {key, "int8"});
  }
  // At DeepSpeed's defaults they say nothing.
  Config quiet = Config::parse(with({{"zero_reduce_scatter", true}, {"zero_max_elements_per_comm", 500000000},
                                     {"fp32_allreduce", false}, {"sequence_parallel_size", 1}}));
  EXPECT_TRUE(quiet.warnings.empty()) << json(quiet.warnings).dump();
}

TEST(ConfigLegacy, KeysThatTakeEffect) {
  // The boolean ZeRO form's bucket, as DeepSpeed maps it.
  Config z = Config::parse(with({{"zero_optimization", true}, {"allgather_size", 12345}}));
  EXPECT_EQ(z.zero.stage, 1);
  EXPECT_EQ(z.zero.allgather_bucket_size, 12345);
  // cpu_offload_params: DeepSpeed 0.4's spelling of cpu_offload_param.
  Config p = Config::parse(with({{"zero_optimization", {{"stage", 3}, {"cpu_offload_params", true}}}}));
  EXPECT_EQ(p.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(any_warning_has(p, "cpu_offload_params: deprecated"));
  // fp32_allreduce: zinc reduces in fp32 already; with a bf16 wire it contradicts.
  EXPECT_EQ(to_json(Config::parse(with({{"fp32_allreduce", true}}))), to_json(Config::parse(with(json::object()))));
  testing_config::expect_parts(config_error(with({{"fp32_allreduce", true}, {"communication_data_type", "bf16"}})),
                               {"fp32_allreduce: ", "bf16", "keep one"});
  // data_parallel_size must be the world size.
  EXPECT_NO_THROW(Config::parse(with({{"data_parallel_size", 2}}), 2));
  testing_config::expect_parts(config_error(with({{"data_parallel_size", 4}}), 2),
                               {"data_parallel_size: 4 differs from the 2 ranks"});
}

TEST(ConfigLegacy, KeysThatChangeTrainingAreRefusedWithTheReason) {
  struct Case {
    json patch;
    std::vector<std::string> parts;
  };
  const Case cases[] = {
      {{{"sequence_parallel_size", 2}}, {"sequence_parallel_size: 2 sequence ranks do not divide the one rank"}},
      {{{"curriculum_learning", {{"enabled", true}, {"curriculum_type", "seqlen"}}}},
       {"curriculum_learning: not implemented in zinc", "sequence lengths"}},
      {{{"progressive_layer_drop", {{"enabled", true}, {"theta", 0.5}}}},
       {"progressive_layer_drop: not implemented in zinc", "layer drop"}},
      {{{"data_efficiency",
         {{"enabled", true}, {"data_routing", {{"enabled", true}, {"random_ltd", {{"enabled", true}}}}}}}},
       {"data_efficiency.data_routing.random_ltd: not implemented in zinc", "token dropping"}},
      {{{"data_efficiency",
         {{"enabled", true},
          {"data_sampling", {{"enabled", true}, {"curriculum_learning", {{"enabled", true}}}}}}}},
       {"data_efficiency.data_sampling.curriculum_learning: not implemented in zinc", "data order"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.patch.dump());
    testing_config::expect_parts(config_error(with(c.patch)), c.parts);
  }
  // They are refused for what they ask at every world size, before a batch
  // triad written for one rank is (DeepSpeedExamples' random-LTD and
  // compression configs: train_batch_size = micro-batch = 32).
  for (int ws : {1, 2, 4}) {
    testing_config::expect_parts(
        config_error({{"train_batch_size", 32},
                      {"train_micro_batch_size_per_gpu", 32},
                      {"compression_training", {{"weight_quantization", {{"shared_parameters", {{"enabled", true}}}}}}}},
                     ws),
        {"compression_training: not implemented in zinc"});
  }
  // Switched off, they parse.
  EXPECT_NO_THROW(Config::parse(with({{"curriculum_learning", {{"enabled", false}}},
                                      {"data_efficiency", {{"enabled", false}}},
                                      {"progressive_layer_drop", {{"enabled", false}}}})));
}

TEST(ConfigLegacy, MisspeltLegacyKeysGetDidYouMean) {
  testing_config::expect_parts(config_error(with({{"zero_reduce_scater", true}})),
                               {"zero_reduce_scater: unknown key", "did you mean 'zero_reduce_scatter'"});
  testing_config::expect_parts(config_error(with({{"fp32_allreduse", true}})), {"did you mean 'fp32_allreduce'"});
  testing_config::expect_parts(
      config_error(with({{"zero_optimization", {{"stage", 2}, {"find_unused_parameter", true}}}})),
      {"did you mean 'find_unused_parameters'"});
}

}  // namespace
}  // namespace zinc

// Tests for the config serializers (engine/config_json.cpp's to_json(Config),
// tools' to_json(ExperimentConfig) and to_json(TrainerConfig)): parsing what
// they write gives back the same settings, for configs that set every field
// away from its default (a field the serializer forgets comes back as the
// default and fails the comparison), for every file in configs/ and for the
// real configs in tests/configs/real/ with zinc's sections added.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "engine/config.h"
#include "tools/auto_config.h"
#include "tools/experiment_config.h"

namespace zinc::tools {
namespace {

using nlohmann::json;

// Parses `doc` at `world` ranks, serializes it, parses that, and compares the
// settings of both parses (Config, ExperimentConfig, TrainerConfig).
void expect_round_trip(const json& doc, int world, const std::string& what) {
  SCOPED_TRACE(what);
  ParsedExperiment a = parse_experiment(doc, world);
  json out = to_json(a.config);
  out.update(to_json(a.experiment));
  if (doc.contains("trainer")) out["trainer"] = to_json(parse_trainer(doc));
  ParsedExperiment b = parse_experiment(out, world);
  EXPECT_TRUE(b.auto_values.empty()) << "the serialized config has no \"auto\" left";
  // The serialized config warns about nothing the original did not (a key
  // that is warned about by nature, such as activation_checkpointing's
  // partition_activations, warns in both).
  auto subset = [](const std::vector<std::string>& x, const std::vector<std::string>& of) {
    for (const std::string& w : x)
      if (std::find(of.begin(), of.end(), w) == of.end()) return false;
    return true;
  };
  EXPECT_TRUE(subset(b.config.warnings, a.config.warnings))
      << "new warnings on the serialized config: " << json(b.config.warnings).dump();
  EXPECT_TRUE(subset(b.experiment.warnings, a.experiment.warnings)) << json(b.experiment.warnings).dump();
  Config ca = a.config, cb = b.config;
  ca.source = cb.source = json();
  ca.warnings.clear();
  cb.warnings.clear();
  EXPECT_TRUE(ca == cb) << "before: " << to_json(ca).dump() << "\nafter:  " << to_json(cb).dump();
  ExperimentConfig ea = a.experiment, eb = b.experiment;
  ea.warnings.clear();
  eb.warnings.clear();
  EXPECT_TRUE(ea == eb) << "before: " << to_json(ea).dump() << "\nafter:  " << to_json(eb).dump();
  EXPECT_TRUE(parse_trainer(doc) == parse_trainer(out)) << to_json(parse_trainer(out)).dump();
  // A second round gives the same document: nothing drifts.
  json again = to_json(b.config);
  again.update(to_json(b.experiment));
  if (doc.contains("trainer")) again["trainer"] = to_json(parse_trainer(out));
  EXPECT_EQ(out, again);
}

// Every engine field away from DeepSpeed's default, and every trainer
// argument away from the Trainer's, agreeing with the DeepSpeed values they
// would fill (Note [the Trainer's contradictions] in tools/auto_config.cpp).
json every_field_set() {
  return json::parse(R"({
    "train_batch_size": 24, "gradient_accumulation_steps": 3,
    "gradient_clipping": 0.5, "steps_per_print": 7, "wall_clock_breakdown": true,
    "bf16": {"enabled": true}, "communication_data_type": "bf16",
    "optimizer": {"type": "Adam", "params": {"lr": 0.002, "betas": [0.8, 0.95], "eps": 1e-6,
                  "weight_decay": 0.1, "bias_correction": false, "adam_w_mode": false}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 0.002,
                  "warmup_num_steps": 5, "warmup_type": "linear", "total_num_steps": 50}},
    "zero_optimization": {"stage": 3, "overlap_comm": false, "contiguous_gradients": true,
      "reduce_bucket_size": 1000, "allgather_bucket_size": 2000, "sub_group_size": 3000,
      "stage3_prefetch_bucket_size": 4000, "stage3_param_persistence_threshold": 50,
      "stage3_model_persistence_threshold": 6000, "stage3_max_live_parameters": 7000,
      "stage3_max_reuse_distance": 8000,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pin_memory": true, "buffer_count": 6},
      "offload_param": {"device": "cpu", "pin_memory": true}},
    "aio": {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 2, "single_submit": true,
            "overlap_events": false},
    "csv_monitor": {"enabled": true, "output_path": "/tmp/csv", "job_name": "j"},
    "tensorboard": {"enabled": true, "output_path": "/tmp/tb", "job_name": "t"},
    "checkpoint": {"tag_validation": "Fail"},
    "model": {"type": "gpt", "vocab_size": 100, "block_size": 64, "n_layer": 3, "n_head": 2, "n_embd": 32},
    "data": {"type": "synthetic", "seq_len": 32, "vocab_size": 50, "determinism": 0.5, "seed": 9},
    "run": {"steps": 9, "seed": 3, "eval_interval": 0, "eval_batches": 2, "checkpoint_interval": 4,
            "output_dir": "/tmp/o", "checkpoint_dir": "/tmp/c", "keep_last": 2},
    "comm": {"backend": "mpi", "timeout_seconds": 30},
    "trainer": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "learning_rate": 0.002,
                "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1,
                "max_grad_norm": 0.5, "warmup_steps": 5, "warmup_ratio": 0.1, "bf16": true, "fp16": false}
  })");
}

TEST(ConfigJson, EveryFieldAwayFromItsDefaultRoundTrips) {
  const json doc = every_field_set();
  expect_round_trip(doc, 2, "every field set");
  // The test has teeth: each of these settings differs from a default parse.
  Config c = Config::parse(doc, 2, ExperimentConfig::sections());
  Config d = Config::parse(json{{"train_batch_size", 24}}, 2);
  EXPECT_NE(c.optimizer, d.optimizer);
  EXPECT_NE(c.scheduler, d.scheduler);
  EXPECT_NE(c.zero, d.zero);
  EXPECT_NE(c.aio, d.aio);
  EXPECT_NE(c.csv_monitor, d.csv_monitor);
  EXPECT_NE(c.tensorboard, d.tensorboard);
  EXPECT_NE(c.checkpoint, d.checkpoint);
}

TEST(ConfigJson, OtherSchedulesAndSections) {
  json doc = every_field_set();
  doc["scheduler"] = {{"type", "WarmupCosineLR"},
                      {"params", {{"warmup_min_ratio", 0.1}, {"cos_min_ratio", 0.01}, {"warmup_num_steps", 5},
                                  {"total_num_steps", 30}}}};
  doc["optimizer"]["type"] = "AdamW";
  doc["optimizer"]["params"].erase("adam_w_mode");
  doc["train_batch_size"] = 12;  // 1 replica x the trainer's 4 x 3
  expect_round_trip(doc, 1, "WarmupCosineLR");
  doc["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 0.002}, {"warmup_num_steps", 5}}}};
  doc["data"] = {{"type", "text"}, {"path", "/tmp/x.txt"}, {"seq_len", 16}, {"eval_fraction", 0.1}};
  doc["model"] = {{"type", "mlp"}, {"context", 2}, {"hidden", 16}, {"n_embd", 8}, {"n_layer", 1}};
  doc["zero_optimization"] = {{"stage", 1}};
  doc.erase("communication_data_type");
  expect_round_trip(doc, 1, "WarmupLR, text data, mlp, stage 1");
  doc.erase("scheduler");
  doc.erase("optimizer");
  doc.erase("trainer");
  doc["data"] = {{"type", "tokens"}, {"path", "/tmp/x.bin"}, {"seq_len", 16}};
  expect_round_trip(doc, 4, "no optimizer or scheduler, token data");
}

TEST(ConfigJson, EveryConfigInTheRepoRoundTrips) {
  namespace fs = std::filesystem;
  const json zinc_sections = {{"model", {{"type", "gpt"}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 64}}},
                              {"data", {{"type", "synthetic"}, {"vocab_size", 32}, {"seq_len", 32}}},
                              // The Trainer's defaults: a real config's concrete
                              // values are what its users pass the Trainer.
                              {"trainer", json::object()}};
  int n = 0;
  for (const char* dir : {"configs", "tests/configs/real"}) {
    for (const fs::directory_entry& e : fs::directory_iterator(fs::path(ZINC_SOURCE_DIR) / dir)) {
      if (e.path().extension() != ".json" || e.path().filename() == "expect.json") continue;
      json doc = read_json_file(e.path().string());
      if (std::string(dir) != "configs") {
        doc.update(zinc_sections);
        // A real config zinc refuses (expect.json) has nothing to round-trip.
        try {
          parse_experiment(doc, 2);
        } catch (const ConfigError&) {
          continue;
        }
      }
      // configs/ name a global batch; 2 ranks split it. A config with
      // pipeline stages, tensor parts, sequence or expert ranks needs a rank
      // per stage, part, slice and expert rank.
      const int stages = (doc.contains("pipeline") ? doc["pipeline"].value("stages", 1) : 1) *
                         (doc.contains("tensor_parallel") ? doc["tensor_parallel"].value("autotp_size", 1) : 1) *
                         doc.value("sequence_parallel_size", 1) *
                         (doc.contains("expert_parallel") ? doc["expert_parallel"].value("autoep_size", 1) : 1);
      for (int world : {stages, 2 * stages}) {
        expect_round_trip(doc, world, e.path().string() + " at " + std::to_string(world) + " ranks");

      }
      ++n;
    }
  }
  EXPECT_GE(n, 10);
}

}  // namespace
}  // namespace zinc::tools

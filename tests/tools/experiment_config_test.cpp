// Tests for tools/experiment_config: zinc-train's experiment sections (model,
// data, run, comm) parsed beside the engine's DeepSpeed sections: defaults,
// strict validation with messages that name the path and the rule, the
// models' size rules at their JSON paths, warnings, the comm section alone,
// and every shipped config.
#include "tools/experiment_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/gpt/gpt.h"
#include "tools/experiment.h"
#include "tools/run_loop.h"
#include "tests/engine/config_test_util.h"

namespace zinc::tools {
namespace {

using nlohmann::json;

using testing_config::any_warning_has;
using testing_config::base;
using testing_config::expect_parts;
using testing_config::with;

// The ConfigError message of parsing the whole document `j`, or a test
// failure if it parses.
std::string config_error(const json& j, int world_size = 1) {
  return testing_config::error_of_parse([world_size](const json& d) { parse_experiment(d, world_size); }, j);
}

// ---------------------------------------------------------------------------

TEST(ExperimentConfigDefaults, MatchTheHeader) {
  const ParsedExperiment p = parse_experiment(base());
  EXPECT_EQ(p.experiment.model.type, "gpt");
  EXPECT_EQ(p.experiment.data.type, DataType::kSynthetic);
  EXPECT_EQ(p.experiment.run.steps, 100);
  // A plain ds_config: the defaulted model and data are said (issue 32).
  EXPECT_FALSE(p.experiment.model_given);
  EXPECT_FALSE(p.experiment.data_given);
  ASSERT_EQ(p.experiment.warnings.size(), 2u);
  EXPECT_EQ(p.experiment.warnings[0], "model: no model section: zinc-train trains its default model, a gpt of 4 "
                                      "layers of 128 from random weights (set model, or model.from_pretrained)");
  EXPECT_EQ(p.experiment.warnings[1],
            "data: no data section: zinc-train trains on synthetic tokens (set data.type and data.path)");
  EXPECT_TRUE(p.config.warnings.empty());
  const ParsedExperiment given = parse_experiment(with({{"model", json::object()}, {"data", json::object()}}));
  EXPECT_TRUE(given.experiment.model_given && given.experiment.data_given);
  EXPECT_TRUE(given.experiment.warnings.empty());
  EXPECT_EQ(p.config.train_micro_batch_size_per_gpu, 8);
}

TEST(ExperimentConfigDefaults, RunSeedIsTheEnginesInitSeed) {
  EXPECT_EQ(parse_experiment(base()).config.seed, 42u);
  EXPECT_EQ(parse_experiment(with({{"run", {{"seed", 7}}}})).config.seed, 7u);
}

TEST(ExperimentConfigErrors, WrongTypesShowTheValue) {
  EXPECT_CONFIG_ERROR(with({{"run", {{"steps", 2.5}}}}), "run.steps: expected an integer, got 2.5");
}

TEST(ExperimentConfigErrors, OutOfRange) {
  EXPECT_CONFIG_ERROR(with({{"data", {{"vocab_size", 1}}}}), "data.vocab_size: must be in [2, 16777216], got 1");
  EXPECT_CONFIG_ERROR(with({{"data", {{"eval_fraction", 1.0}}}}),
                      "data.eval_fraction: must be in [0, 1), got 1.0");
  EXPECT_CONFIG_ERROR(with({{"data", {{"seed", -1}}}}), "data.seed: must be >= 0, got -1");
}

// data.token_dtype: the width of a headerless token file, round-tripped in
// the resolved config; anything but uint16 or uint32 is refused naming both.
TEST(ExperimentConfigData, TokenDtype) {
  const json d = {{"type", "tokens"}, {"path", "train.bin"}, {"token_dtype", "uint32"}};
  const ParsedExperiment p = parse_experiment(with({{"data", d}}));
  EXPECT_EQ(p.experiment.data.token_bytes, 4);
  EXPECT_EQ(to_json(p.experiment)["data"]["token_dtype"], "uint32");
  EXPECT_EQ(parse_experiment(with({{"data", {{"type", "tokens"}, {"path", "train.bin"}}}})).experiment.data.token_bytes, 0);
  const std::string e = config_error(with({{"data", {{"type", "tokens"}, {"path", "x"}, {"token_dtype", "int8"}}}}));
  EXPECT_NE(e.find("data.token_dtype"), std::string::npos) << e;
  EXPECT_NE(e.find("uint32"), std::string::npos) << e;
  EXPECT_EQ(parse_experiment(with({{"data", {{"type", "tokens"}, {"path", "x"}, {"vocab_size", 152064}}}}))
                .experiment.data.vocab_size,
            152064);
}

TEST(ExperimentConfigErrors, UnknownKeys) {
  // Nothing close: small sections list what they accept.
  EXPECT_CONFIG_ERROR(with({{"run", {{"zzzzzzzz", 1}}}}),
                      "run.zzzzzzzz: unknown key; known keys here:", "steps");
  // A misspelt section is the engine's unknown top-level key, with the
  // experiment's sections among the suggestions.
  EXPECT_EQ(config_error(with({{"modle", {{"n_embd", 64}}}})), "modle: unknown key (did you mean 'model'?)");
  EXPECT_CONFIG_ERROR(with({{"gradient_cliping", 1.0}}),
                      "gradient_cliping: unknown key (did you mean 'gradient_clipping'?)");
  EXPECT_CONFIG_ERROR(with({{"traner", json::object()}}), "traner: unknown key (did you mean 'trainer'?)");
}

TEST(ExperimentConfigErrors, ZincSections) {
  EXPECT_CONFIG_ERROR(with({{"model", {{"n_embd", 100}, {"n_head", 3}}}}),
                      "model.n_embd: must be divisible by n_head 3, got 100");
  EXPECT_CONFIG_ERROR(with({{"model", {{"block_size", 64}}}, {"data", {{"seq_len", 128}}}}),
                      "model.block_size: must be >= data.seq_len 128, got 64");
  EXPECT_CONFIG_ERROR(with({{"data", {{"type", "text"}}}}), "data.path: required for type \"text\"");
  EXPECT_CONFIG_ERROR(with({{"data", {{"type", "csv"}}}}),
                      "data.type: must be one of synthetic, text, tokens");
  EXPECT_CONFIG_ERROR(with({{"model", {{"type", "gtp"}}}}),
                      "model.type: must be one of gpt, mlp, llama, ", "got \"gtp\"",  // then every other family
                      "did you mean 'gpt'");
  EXPECT_CONFIG_ERROR(with({{"model", {{"vocab_size", 32}}}, {"data", {{"vocab_size", 64}}}}),
                      "model.vocab_size: must be >= the data's vocabulary 64");
  EXPECT_CONFIG_ERROR(with({{"run", {{"output_dir", ""}}}}), "run.output_dir: must not be empty");
  // mlp does not care about heads: the key is ignored, and said so.
  ParsedExperiment mlp = parse_experiment(
      with({{"model", {{"type", "mlp"}, {"n_embd", 100}, {"n_head", 3}}}, {"data", json::object()}}));
  ASSERT_EQ(mlp.experiment.warnings.size(), 1u);
  EXPECT_EQ(mlp.experiment.warnings[0], "model.n_head: ignored: not a size of model.type \"mlp\" (it is gpt's)");
}

TEST(ExperimentConfigErrors, ValidateChecksConfigsBuiltInCode) {
  ExperimentConfig e;
  models::GptConfig g;
  g.n_embd = 100;
  g.n_head = 3;
  e.model.settings.model = models::gpt::family_config(g);
  try {
    e.validate();
    FAIL() << "no error";
  } catch (const ConfigError& err) {
    EXPECT_EQ(std::string(err.what()), "model.n_embd: must be divisible by n_head 3, got 100");
  }
}

TEST(ExperimentConfigWarnings, IgnoredKeysAreRecorded) {
  const ParsedExperiment p =
      parse_experiment(with({{"data", {{"type", "text"}, {"path", "x.txt"}, {"determinism", 0.5}}}}));
  EXPECT_TRUE(any_warning_has(p.experiment, "data.determinism: ignored"));
  EXPECT_TRUE(p.config.warnings.empty());
}

TEST(ExperimentConfigRun, CheckpointFolderDefaultsUnderTheOutputFolder) {
  EXPECT_EQ(parse_experiment(with({{"run", {{"output_dir", "out"}}}})).experiment.run.checkpoint_dir,
            "out/checkpoints");
  const ParsedExperiment p = parse_experiment(
      with({{"run", {{"checkpoint_dir", "ck"}, {"checkpoint_interval", 5}, {"keep_last", 2}}}}));
  EXPECT_EQ(p.experiment.run.checkpoint_dir, "ck");
  EXPECT_EQ(p.experiment.run.checkpoint_interval, 5);
  EXPECT_EQ(p.experiment.run.keep_last, 2);
  EXPECT_CONFIG_ERROR(with({{"run", {{"keep_last", -1}}}}), "run.keep_last");
  EXPECT_CONFIG_ERROR(with({{"run", {{"checkpoint_dir", ""}}}}), "run.checkpoint_dir: must not be empty");
}

// ---------------------------------------------------------------------------
// The comm section

TEST(ExperimentConfigComm, BackendAndTimeout) {
  const ExperimentConfig d = parse_experiment(with(json::object())).experiment;
  EXPECT_EQ(d.comm.backend, CommBackend::kAuto);
  EXPECT_EQ(d.comm.timeout_seconds, 600);
  const ExperimentConfig c =
      parse_experiment(with({{"comm", {{"backend", "shm"}, {"timeout_seconds", 2.5}}}})).experiment;
  EXPECT_EQ(c.comm.backend, CommBackend::kShm);
  EXPECT_EQ(c.comm.timeout_seconds, 2.5);
  EXPECT_CONFIG_ERROR(with({{"comm", {{"backend", "nccl"}}}}), "comm.backend", "\"nccl\"");
  EXPECT_CONFIG_ERROR(with({{"comm", {{"timeout_seconds", 0}}}}), "comm.timeout_seconds", "0");
  EXPECT_CONFIG_ERROR(with({{"comm", {{"timeout_seconds", 1e-9}}}}), "comm.timeout_seconds: must be >= 1");
  EXPECT_CONFIG_ERROR(with({{"comm", {{"timeout", 5}}}}), "comm.timeout", "timeout_seconds");
}

// The comm section alone (zinc-train needs the transport before the world
// size, and so the rest of the config, is known): the same rules, strictly.
TEST(ExperimentConfigComm, SectionAloneIsParsedStrictly) {
  const CommConfig c =
      ExperimentConfig::parse_comm(with({{"comm", {{"backend", "shm"}, {"timeout_seconds", 2.5}}}}));
  EXPECT_EQ(c.backend, CommBackend::kShm);
  EXPECT_EQ(c.timeout_seconds, 2.5);
  EXPECT_EQ(ExperimentConfig::parse_comm(with(json::object())).backend, CommBackend::kAuto);
  EXPECT_EQ(ExperimentConfig::parse_comm(json::array({1})).backend, CommBackend::kAuto);  // parse_experiment reports it
  try {
    ExperimentConfig::parse_comm(with({{"comm", {{"backend", "nccl"}}}}));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "comm.backend");
  }
  EXPECT_THROW(ExperimentConfig::parse_comm(with({{"comm", {{"timeout_seconds", "x"}}}})), ConfigError);
}

// ---------------------------------------------------------------------------

TEST(ExperimentConfigLoad, EveryShippedConfigParses) {
  // configs/ sits two folders above this file.
  std::filesystem::path dir =
      std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "configs";
  if (!std::filesystem::is_directory(dir)) GTEST_SKIP() << "no configs/ folder at " << dir;
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    const json doc = read_json_file(entry.path().string());
    // A config with pipeline stages, tensor parts, sequence or expert ranks
    // needs a rank per stage, part, slice and expert rank.
    const int world = (doc.contains("pipeline") ? doc["pipeline"].value("stages", 1) : 1) *
                      (doc.contains("tensor_parallel") ? doc["tensor_parallel"].value("autotp_size", 1) : 1) *
                      doc.value("sequence_parallel_size", 1) *
                      (doc.contains("expert_parallel") ? doc["expert_parallel"].value("autoep_size", 1) : 1);
    EXPECT_NO_THROW({
      const ParsedExperiment p = parse_experiment(doc, world);
      EXPECT_TRUE(p.config.warnings.empty()) << p.config.warnings.front();
      EXPECT_TRUE(p.experiment.warnings.empty()) << p.experiment.warnings.front();
    });
    ++n;
  }
  EXPECT_GT(n, 0);
}


// model.pack_frozen_weights (Note [packed frozen weights] in
// kernels/matmul.cpp): on by default, reaches the model's LoRA config as
// built, false turns it off, a wrong type names the path.
TEST(ExperimentConfigModel, PackFrozenWeightsReachesTheLoraConfig) {
  const json lora = {{"lora", {{"r", 4}, {"target_modules", {"c_attn"}}}}};
  auto parsed = [&](const json& extra) {
    json model = lora;
    model.update(extra);
    return parse_experiment(with({{"model", model}})).experiment.model;
  };
  EXPECT_TRUE(parsed(json::object()).pack_frozen_weights);
  EXPECT_TRUE(parsed(json::object()).built_lora(parsed(json::object()).lora).pack_base);
  const ModelConfig off = parsed({{"pack_frozen_weights", false}});
  EXPECT_FALSE(off.pack_frozen_weights);
  EXPECT_FALSE(off.built_lora(off.lora).pack_base);
  EXPECT_CONFIG_ERROR(with({{"model", {{"pack_frozen_weights", "no"}}}}),
                      "model.pack_frozen_weights: expected true or false");
}

// Activation checkpointing is switched on by model.gradient_checkpointing or
// by the trainer section's TrainingArguments flag; either alone turns it on,
// both given and different is an error naming both paths, and the mlp
// refuses it at whichever path asked. The built model holds less.
TEST(ExperimentConfigModel, GradientCheckpointingFromTheModelOrTheTrainerSection) {
  auto on = [](const json& patch) { return parse_experiment(with(patch)).experiment.model.gradient_checkpointing; };
  EXPECT_FALSE(on(json::object()));
  EXPECT_TRUE(on({{"model", {{"gradient_checkpointing", true}}}}));
  EXPECT_TRUE(on({{"trainer", {{"gradient_checkpointing", true}}}}));
  EXPECT_TRUE(on({{"model", {{"gradient_checkpointing", true}}}, {"trainer", {{"gradient_checkpointing", true}}}}));
  EXPECT_FALSE(on({{"trainer", {{"gradient_checkpointing", false}}}}));
  EXPECT_FALSE(on({{"model", {{"gradient_checkpointing", false}}}, {"trainer", {{"gradient_checkpointing", false}}}}));
  EXPECT_EQ(config_error(with({{"model", {{"gradient_checkpointing", false}}},
                               {"trainer", {{"gradient_checkpointing", true}}}})),
            "model.gradient_checkpointing: false conflicts with trainer.gradient_checkpointing true; give one of "
            "them, or both the same");
  EXPECT_CONFIG_ERROR(with({{"model", {{"gradient_checkpointing", true}}},
                            {"trainer", {{"gradient_checkpointing", false}}}}),
                      "model.gradient_checkpointing: true conflicts with trainer.gradient_checkpointing false");
  EXPECT_CONFIG_ERROR(with({{"model", {{"type", "mlp"}, {"gradient_checkpointing", true}}}}),
                      "model.gradient_checkpointing: not supported by model.type \"mlp\"");
  EXPECT_CONFIG_ERROR(with({{"model", {{"type", "mlp"}}}, {"trainer", {{"gradient_checkpointing", true}}}}),
                      "trainer.gradient_checkpointing: not supported by model.type \"mlp\"");
  EXPECT_NO_THROW(parse_experiment(with({{"model", {{"type", "mlp"}, {"gradient_checkpointing", false}}}})));
  EXPECT_CONFIG_ERROR(with({{"model", {{"gradient_checkpointing", "yes"}}}}),
                      "model.gradient_checkpointing: expected true or false");
  EXPECT_CONFIG_ERROR(with({{"trainer", {{"gradient_checkpointing", 1}}}}),
                      "trainer.gradient_checkpointing: expected true or false");
  EXPECT_CONFIG_ERROR(with({{"model", {{"gradient_checkpoint", true}}}}),
                      "model.gradient_checkpoint: unknown key (did you mean 'gradient_checkpointing'?)");

  // DeepSpeed's section alone does not switch it on, and says so.
  const json ds = {{"activation_checkpointing", {{"partition_activations", false}}}};
  const ParsedExperiment alone = parse_experiment(with(ds));
  EXPECT_FALSE(alone.experiment.model.gradient_checkpointing);
  EXPECT_TRUE(any_warning_has(alone.experiment, "activation_checkpointing: does not switch checkpointing on"));
  json both = ds;
  both["model"] = {{"gradient_checkpointing", true}};
  both["data"] = json::object();
  const ParsedExperiment with_model = parse_experiment(with(both));
  EXPECT_TRUE(with_model.experiment.warnings.empty());
  EXPECT_TRUE(with_model.config.warnings.empty());

  // The flag reaches the model: a model section of 4 layers with it holds
  // 3 sets of layer activations fewer.
  const json m = {{"model", {{"n_layer", 4}, {"n_embd", 32}, {"n_head", 2}}}, {"data", {{"seq_len", 16}}}};
  json mc = m;
  mc["trainer"] = {{"gradient_checkpointing", true}};
  const Experiment plain = build_experiment(with(m)), ck = build_experiment(with(mc));
  const int64_t a = plain.model->activation_memory(8, 16, DType::kF32)->saved;
  const int64_t b = ck.model->activation_memory(8, 16, DType::kF32)->saved;
  EXPECT_LT(b, a);
  EXPECT_GT(a - b, 3 * 14 * 8 * 16 * 32 * 4);  // 3 sets of at least 14 (N,C) buffers
}

// OneCycle's momentum grows after the cycle (decay_mom_rate): a run whose
// last step would reach beta1 = 1 is refused before it trains (and by
// --check), naming the first such step; a shorter run of it starts.
TEST(ExperimentConfigRun, OneCycleMomentumReachingOneWithinTheRunIsRefusedAtTheStart) {
  auto doc = [](int64_t steps) {
    return with({{"scheduler", {{"type", "OneCycle"},
                                {"params", {{"cycle_min_lr", 0.01}, {"cycle_max_lr", 0.1}, {"cycle_first_step_size", 1},
                                            {"decay_step_size", 1}, {"decay_mom_rate", 0.5}}}}},
                 {"model", {{"n_layer", 1}, {"n_embd", 32}, {"n_head", 2}}},
                 {"data", {{"seq_len", 16}}},
                 {"run", {{"steps", steps}}}});
  };
  EXPECT_NO_THROW(build_experiment(doc(2)));  // steps 1-2: the cycle, beta1 from 0.9 to 0.8 and back
  for (int64_t steps : {int64_t{3}, int64_t{1000000000000}}) {
    try {
      build_experiment(doc(steps));
      ADD_FAILURE() << "expected a ConfigError at " << steps << " steps";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.path(), "scheduler.params.decay_mom_rate");
      EXPECT_NE(std::string(e.what()).find("reaches 1.35") , std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("at optimizer step 3 of run.steps " + std::to_string(steps)),
                std::string::npos) << e.what();
    }
  }
}

// Data of fewer samples than one global batch trains, each batch holding
// samples more than once: said, naming the file and both counts.
TEST(ExperimentConfigData, DataSmallerThanOneGlobalBatchIsSaid) {
  const std::string path = (std::filesystem::temp_directory_path() / "zinc_small_data.txt").string();
  auto doc = [&](int64_t batch) {
    return with({{"train_batch_size", batch}, {"train_micro_batch_size_per_gpu", batch},
                 {"model", {{"n_layer", 1}, {"n_embd", 32}, {"n_head", 2}}},
                 {"data", {{"type", "text"}, {"path", path}, {"seq_len", 16}}}});
  };
  { std::ofstream(path) << std::string(16 * 6 + 1, 'a'); }  // 6 samples of 16
  const Experiment small = build_experiment(doc(8));
  EXPECT_TRUE(testing_config::any_warning_has(
      small.config, "data: 6 samples an epoch (" + path + "), fewer than one global batch of 8 (train_batch_size)"));
  const Experiment enough = build_experiment(doc(6));
  EXPECT_FALSE(testing_config::any_warning_has(enough.config, "samples an epoch"));
  std::filesystem::remove(path);
}

// A million layers held 4 GB just to plan (--estimate), ten million were
// killed by the OOM killer: the layers are bounded before anything is built.
TEST(ExperimentConfigModel, LayersPastAnyModelsAreRefusedBeforeAnythingIsBuilt) {
  for (const json& model : {json{{"type", "gpt"}, {"n_layer", 10000000}, {"n_head", 2}, {"n_embd", 32}},
                            json{{"type", "mlp"}, {"n_layer", 4097}}}) {
    try {
      build_experiment(with({{"model", model}, {"data", {{"seq_len", 16}}}}));
      ADD_FAILURE() << model.dump();
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.path(), "model.n_layer") << e.what();
      EXPECT_NE(std::string(e.what()).find("must be in [1, 4096]"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(build_experiment(with({{"model", {{"type", "mlp"}, {"n_layer", 4096}}}, {"data", {{"seq_len", 16}}}})));
}

// check_resume reads the checkpoint's data position before anything loads:
// a value near INT64_MAX overflowed the loader's arithmetic and aborted the
// run (SIGABRT), a fraction was truncated, a string or a missing one raised
// a JSON library error naming no file after the states had loaded. Each is
// now one line naming the metadata; Engine.load_checkpoint (position not
// required) still takes a checkpoint without one.
TEST(ExperimentConfigResume, ADataPositionThatIsNoPositionIsRefusedNamingTheFile) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(testing::TempDir()) / ("zinc_resume_position_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const Experiment ex = build_experiment(
      with({{"model", {{"n_layer", 1}, {"n_embd", 16}, {"n_head", 2}}}, {"data", {{"seq_len", 8}}}}));
  Engine engine = Engine::initialize(ex.model, ex.config);
  const DataLoader loader(ex.data, 8, 1, 1, 0, 7);
  const std::function<const std::string&()> no_base = []() -> const std::string& {
    static const std::string none;
    return none;
  };
  auto refusal = [&](const json& client, bool required = true) {
    engine.save_checkpoint(dir.string(), "t", client);
    try {
      check_resume(ex, dir.string(), "t", loader, no_base, required);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string meta = (dir / "t" / "metadata.json").string();
  for (const json& bad : {json(int64_t{9223372036854775792}), json(192.5), json("192"), json(-8)}) {
    const std::string got = refusal({{"samples", bad}});
    expect_parts(got, {"checkpoint " + meta + ": client_state.samples is " + bad.dump(),
                       "not a data position (an integer from 0 to 2^62); nothing was loaded"});
  }
  expect_parts(refusal(json::object()), {"checkpoint " + meta + " has no client_state.samples", "nothing was loaded"});
  EXPECT_EQ(refusal(json::object(), /*required=*/false), "");
  EXPECT_EQ(refusal({{"samples", 64}}), "");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zinc::tools

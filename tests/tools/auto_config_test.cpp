// "auto" values (tools/auto_config.h): each rule, its source, the `trainer`
// section's strictness, and an "auto" without a rule left for the parser to
// report at its path.
#include "tools/auto_config.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "tests/engine/config_test_util.h"
#include "tools/experiment_config.h"

namespace zinc::tools {
namespace {

using nlohmann::json;

// The Hugging Face Trainer's usual ZeRO-2 config, every value "auto".
json hf_config() {
  return {{"fp16", {{"enabled", "auto"}, {"loss_scale", 0}, {"initial_scale_power", 16}}},
          {"bf16", {{"enabled", "auto"}}},
          {"optimizer",
           {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"betas", "auto"}, {"eps", "auto"}, {"weight_decay", "auto"}}}}},
          {"scheduler",
           {{"type", "WarmupDecayLR"},
            {"params",
             {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}, {"total_num_steps", "auto"}}}}},
          {"zero_optimization",
           {{"stage", 3},
            {"reduce_bucket_size", "auto"},
            {"stage3_prefetch_bucket_size", "auto"},
            {"stage3_param_persistence_threshold", "auto"}}},
          {"gradient_accumulation_steps", "auto"},
          {"gradient_clipping", "auto"},
          {"train_batch_size", "auto"},
          {"train_micro_batch_size_per_gpu", "auto"},
          {"model", {{"type", "gpt"}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 64}}},
          {"data", {{"type", "synthetic"}, {"vocab_size", 32}, {"seq_len", 16}}},
          {"run", {{"steps", 200}}}};
}

const AutoValue* find(const ResolvedConfig& r, const std::string& path) {
  for (const AutoValue& a : r.values)
    if (a.path == path) return &a;
  return nullptr;
}

TEST(AutoConfig, TheTrainersRulesFromTheTrainerSection) {
  json doc = hf_config();
  doc["trainer"] = {{"per_device_train_batch_size", 4}, {"gradient_accumulation_steps", 3}, {"learning_rate", 1e-3},
                    {"adam_beta1", 0.8},  {"adam_beta2", 0.95},  {"adam_epsilon", 1e-6},
                    {"weight_decay", 0.1}, {"max_grad_norm", 0.5}, {"warmup_steps", 7}};
  const ResolvedConfig r = resolve_auto(doc, 2);
  const json& d = r.doc;
  EXPECT_EQ(d["train_micro_batch_size_per_gpu"], 4);
  EXPECT_EQ(d["gradient_accumulation_steps"], 3);
  EXPECT_EQ(d["train_batch_size"], 24);  // 2 ranks x 4 x 3
  EXPECT_EQ(d["gradient_clipping"], 0.5);
  EXPECT_EQ(d["optimizer"]["params"]["lr"], 1e-3);
  EXPECT_EQ(d["optimizer"]["params"]["betas"], json::array({0.8, 0.95}));
  EXPECT_EQ(d["optimizer"]["params"]["eps"], 1e-6);
  EXPECT_EQ(d["optimizer"]["params"]["weight_decay"], 0.1);
  EXPECT_EQ(d["scheduler"]["params"]["warmup_min_lr"], 0.0);
  EXPECT_EQ(d["scheduler"]["params"]["warmup_max_lr"], 1e-3);
  EXPECT_EQ(d["scheduler"]["params"]["warmup_num_steps"], 7);
  EXPECT_EQ(d["scheduler"]["params"]["total_num_steps"], 200);
  EXPECT_EQ(d["zero_optimization"]["reduce_bucket_size"], 64 * 64);
  EXPECT_EQ(d["zero_optimization"]["stage3_prefetch_bucket_size"], static_cast<int64_t>(0.9 * 64 * 64));
  EXPECT_EQ(d["zero_optimization"]["stage3_param_persistence_threshold"], 640);
  EXPECT_EQ(d["fp16"]["enabled"], false);
  EXPECT_EQ(d["bf16"]["enabled"], true);
  ASSERT_NE(find(r, "optimizer.params.lr"), nullptr);
  EXPECT_EQ(find(r, "optimizer.params.lr")->source, "trainer.learning_rate");
  EXPECT_NE(find(r, "train_batch_size")->source.find("2 ranks"), std::string::npos);
  EXPECT_NE(find(r, "zero_optimization.reduce_bucket_size")->source.find("model.n_embd 64"), std::string::npos);
  EXPECT_EQ(r.values.size(), 17u);
  // The resolved document parses, at the world size it was resolved for.
  const ParsedExperiment p = parse_experiment(doc, 2);
  EXPECT_EQ(p.config.train_batch_size, 24);
  EXPECT_EQ(p.config.zero.stage, 3);
  EXPECT_TRUE(p.config.bf16);
  EXPECT_EQ(p.auto_values.size(), 17u);
}

TEST(AutoConfig, TrainerDefaultsWarmupRatioAndPrecision) {
  json doc = hf_config();
  ResolvedConfig r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["train_micro_batch_size_per_gpu"], 8);  // the Trainer's defaults
  EXPECT_EQ(r.doc["train_batch_size"], 8);
  EXPECT_EQ(r.doc["optimizer"]["params"]["lr"], 5e-5);
  EXPECT_EQ(r.doc["gradient_clipping"], 1.0);
  EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_num_steps"], 0);

  doc["trainer"] = {{"warmup_ratio", 0.033}};
  r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_num_steps"], 7);  // ceil(0.033 x 200)
  doc["trainer"] = {{"warmup_steps", 0.033}};  // transformers 5: a float below 1 is the ratio
  r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_num_steps"], 7);
  EXPECT_EQ(find(r, "scheduler.params.warmup_num_steps")->source, "ceil(trainer.warmup_steps 0.033 x run.steps 200)");
  // ... over a warmup_ratio beside it, 0 included (which once overwrote the
  // share, leaving no warmup without a word); the section reads back as given.
  for (double ratio : {0.0, 0.5}) {
    doc["trainer"] = {{"warmup_steps", 0.033}, {"warmup_ratio", ratio}};
    r = resolve_auto(doc, 1);
    EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_num_steps"], 7) << ratio;
    const TrainerConfig t = parse_trainer(doc);
    EXPECT_EQ(to_json(t)["warmup_steps"], 0.033);
    EXPECT_EQ(to_json(t)["warmup_ratio"], ratio);
  }

  doc["trainer"] = {{"bf16", false}};
  EXPECT_EQ(resolve_auto(doc, 1).doc["bf16"]["enabled"], false);
  doc["trainer"] = {{"fp16", true}};
  r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["fp16"]["enabled"], true);
  EXPECT_EQ(r.doc["bf16"]["enabled"], false);  // fp16 asked for: bf16 stays off
  EXPECT_EQ(find(r, "bf16.enabled")->source, "off: fp16 is enabled");

  // Concrete values are kept, and train_batch_size follows them.
  doc = hf_config();
  doc["train_micro_batch_size_per_gpu"] = 2;
  doc["gradient_accumulation_steps"] = 5;
  r = resolve_auto(doc, 4);
  EXPECT_EQ(r.doc["train_batch_size"], 40);
  EXPECT_EQ(find(r, "train_micro_batch_size_per_gpu"), nullptr);
}

// Issue 32: without a `trainer` section the values are TrainingArguments'
// defaults, and each says so; DeepSpeed's older section name `bfloat16`
// (transformers' ZeRO-3 bf16 template) resolves like `bf16`.
TEST(AutoConfig, DefaultsAreNamedAsDefaultsAndBfloat16IsBf16) {
  json doc = hf_config();
  ResolvedConfig r = resolve_auto(doc, 1);
  EXPECT_EQ(find(r, "optimizer.params.lr")->source,
            "trainer.learning_rate (the Trainer's default: the config has no trainer section)");
  EXPECT_EQ(find(r, "train_micro_batch_size_per_gpu")->source,
            "trainer.per_device_train_batch_size (the Trainer's default: the config has no trainer section)");
  doc["trainer"] = {{"learning_rate", 1e-4}};
  r = resolve_auto(doc, 1);
  EXPECT_EQ(find(r, "optimizer.params.lr")->source, "trainer.learning_rate");
  EXPECT_EQ(find(r, "train_micro_batch_size_per_gpu")->source, "trainer.per_device_train_batch_size");

  doc = hf_config();
  doc.erase("bf16");
  doc["bfloat16"] = {{"enabled", "auto"}};
  r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["bfloat16"]["enabled"], true);  // fp16 "auto" resolves off, so bf16 is on
  ASSERT_NE(find(r, "bfloat16.enabled"), nullptr);
  EXPECT_TRUE(parse_experiment(doc, 1).config.bf16);
  doc["trainer"] = {{"bf16", false}};
  EXPECT_FALSE(parse_experiment(doc, 1).config.bf16);
}

TEST(AutoConfig, TrainerSectionIsStrictAndAnAutoWithoutARuleIsReportedAtItsPath) {
  json doc = hf_config();
  doc["trainer"] = {{"learning_rat", 1e-3}};
  testing_config::expect_parts(
      testing_config::error_of_parse([](const json& d) { resolve_auto(d, 1); }, doc),
      {"trainer.learning_rat", "did you mean 'learning_rate'"});
  doc["trainer"] = {{"per_device_train_batch_size", 0}};
  testing_config::expect_parts(testing_config::error_of_parse([](const json& d) { resolve_auto(d, 1); }, doc),
                               {"trainer.per_device_train_batch_size"});
  doc = hf_config();
  doc["zero_optimization"]["sub_group_size"] = "auto";
  testing_config::expect_parts(testing_config::error_of_parse([](const json& d) { parse_experiment(d, 1); }, doc),
                               {"zero_optimization.sub_group_size", "\"auto\" is a placeholder"});
}


// Note [the Trainer's contradictions]: a concrete DeepSpeed value that
// differs from what the trainer section would fill it with is refused, as
// transformers' fill_match does, every difference named in one line; one
// that agrees (1 and 1.0 too), or whose argument the section leaves at the
// Trainer's default, is kept.
TEST(AutoConfig, ConcreteValuesThatContradictTheTrainerSectionAreRefused) {
  auto refusal = [](const json& d) {
    return testing_config::error_of_parse([](const json& doc) { resolve_auto(doc, 2); }, d);
  };
  json doc = hf_config();
  doc["trainer"] = {{"learning_rate", 2e-5}};
  doc["optimizer"]["params"]["lr"] = 1e-4;
  std::string e = refusal(doc);
  testing_config::expect_parts(e, {"optimizer.params.lr: 0.0001 against trainer.learning_rate 2e-05",
                                   "the config's trainer section contradicts this value", "\"auto\""});
  EXPECT_EQ(e.find(" against ", e.find(" against ") + 1), std::string::npos) << e;  // one difference

  doc["trainer"] = {{"learning_rate", 2e-5}, {"per_device_train_batch_size", 4}, {"adam_beta2", 0.95},
                    {"bf16", false}};
  doc["train_micro_batch_size_per_gpu"] = 8;
  doc["optimizer"]["params"]["betas"] = {0.9, 0.999};
  doc["scheduler"]["params"]["warmup_max_lr"] = 3e-5;
  doc["bf16"]["enabled"] = true;
  e = refusal(doc);
  testing_config::expect_parts(
      e, {"train_micro_batch_size_per_gpu: 8 against trainer.per_device_train_batch_size 4",
          "; optimizer.params.lr 0.0001 against trainer.learning_rate 2e-05",
          "; optimizer.params.betas [0.9,0.999] against trainer.adam_beta1, adam_beta2 [0.9,0.95]",
          "; scheduler.params.warmup_max_lr 3e-05 against trainer.learning_rate 2e-05",
          "; bf16.enabled true against trainer.bf16 false", "contradicts these values"});
  EXPECT_EQ(e.rfind("train_micro_batch_size_per_gpu", 0), 0u) << e;  // the first one's path leads

  // DeepSpeed's older spelling bfloat16 is held too, and named once, by its
  // documented name.
  doc = hf_config();
  doc["trainer"] = {{"bf16", false}};
  doc.erase("bf16");
  doc["bfloat16"] = {{"enabled", true}};
  e = refusal(doc);
  testing_config::expect_parts(e, {"bf16.enabled: true against trainer.bf16 false", "contradicts this value"});
  EXPECT_EQ(e.find(" against ", e.find(" against ") + 1), std::string::npos) << e;

  // train_batch_size, as the Trainer computes it from the replicas.
  doc = hf_config();
  doc["trainer"] = {{"per_device_train_batch_size", 4}};
  doc["train_batch_size"] = 16;
  testing_config::expect_parts(
      refusal(doc), {"train_batch_size: 16 against 2 replicas x trainer.per_device_train_batch_size x "
                     "trainer.gradient_accumulation_steps = 8"});
  doc["train_batch_size"] = 8;
  EXPECT_EQ(resolve_auto(doc, 2).doc["train_micro_batch_size_per_gpu"], 4);

  // A value of the wrong type is the parser's to name.
  doc = hf_config();
  doc["trainer"] = {{"adam_beta1", 0.8}};
  doc["optimizer"]["params"]["betas"] = {"0.9", "0.999"};
  EXPECT_NO_THROW(resolve_auto(doc, 2));
  testing_config::expect_parts(testing_config::error_of_parse([](const json& d) { parse_experiment(d, 2); }, doc),
                               {"optimizer.params.betas"});

  doc = hf_config();
  doc["trainer"] = {{"warmup_steps", 7}};
  doc["scheduler"]["params"]["warmup_num_steps"] = 10;
  testing_config::expect_parts(refusal(doc), {"scheduler.params.warmup_num_steps: 10 against trainer.warmup_steps 7"});

  // Agreeing values, values the section leaves out, and "auto" pass.
  doc = hf_config();
  doc["trainer"] = {{"max_grad_norm", 1.0}, {"per_device_train_batch_size", 4}, {"gradient_accumulation_steps", 2},
                    {"fp16", false}};
  doc["gradient_clipping"] = 1;
  doc["train_micro_batch_size_per_gpu"] = 4;
  doc["fp16"]["enabled"] = false;
  doc["optimizer"]["params"]["lr"] = 1e-4;  // trainer.learning_rate not given: nothing to contradict
  doc["optimizer"]["params"]["weight_decay"] = 0.3;
  doc["trainer"]["weight_decay"] = 0.0;  // given at the Trainer's default: not held (Note)
  const ResolvedConfig r = resolve_auto(doc, 2);
  EXPECT_EQ(r.doc["optimizer"]["params"]["lr"], 1e-4);
  EXPECT_EQ(r.doc["train_batch_size"], 16);
  // Without a trainer section the Trainer's defaults contradict nothing.
  doc.erase("trainer");
  doc["train_micro_batch_size_per_gpu"] = 3;
  EXPECT_EQ(resolve_auto(doc, 2).doc["train_batch_size"], 6);
}

// No optimizer or scheduler section (LLaMA-Factory's configs): with a
// trainer section, the Trainer's own AdamW and linear schedule; without
// one, nothing is added.
TEST(AutoConfig, MissingOptimizerAndSchedulerAreTheTrainersOwn) {
  json doc = hf_config();
  doc.erase("optimizer");
  doc.erase("scheduler");
  EXPECT_FALSE(resolve_auto(doc, 1).doc.contains("optimizer"));
  doc["trainer"] = {{"learning_rate", 2e-3}, {"weight_decay", 0.05}, {"warmup_steps", 10}};
  const ResolvedConfig r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["optimizer"]["type"], "AdamW");
  EXPECT_EQ(r.doc["optimizer"]["params"]["lr"], 2e-3);
  EXPECT_EQ(r.doc["optimizer"]["params"]["weight_decay"], 0.05);
  EXPECT_EQ(r.doc["scheduler"]["type"], "WarmupDecayLR");
  EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_type"], "linear");  // the Trainer's linear (DeepSpeed's default: log)
  EXPECT_EQ(r.doc["scheduler"]["params"]["warmup_num_steps"], 10);
  EXPECT_EQ(r.doc["scheduler"]["params"]["total_num_steps"], 200);
  ASSERT_NE(find(r, "optimizer.type"), nullptr);
  EXPECT_NE(find(r, "optimizer.type")->source.find("no optimizer section"), std::string::npos);
  const ParsedExperiment p = parse_experiment(doc, 1);
  EXPECT_EQ(p.config.optimizer.lr(), 2e-3);
  // The Trainer's AdamW decays no bias or norm weight (zinc's key, which
  // the printed config keeps); an optimizer section of the user's decays
  // everything, as DeepSpeed's one parameter group.
  EXPECT_EQ(r.doc["optimizer"]["params"]["decay_norms_and_biases"], false);
  EXPECT_FALSE(p.config.optimizer.decay_vectors);
  doc["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 2e-3}}}};
  EXPECT_TRUE(parse_experiment(doc, 1).config.optimizer.decay_vectors);
}

// Accelerate's ZeRO-3 templates leave stage3_gather_16bit_weights_on_model_save
// "auto"; Accelerate fills it from zero3_save_16bit_model (default false).
// It only decides what a model save writes, so the run parses with it off.
TEST(AutoConfig, Gather16BitWeightsOnSaveIsAcceleratesDefault) {
  json doc = hf_config();
  doc["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = "auto";
  const ResolvedConfig r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"], false);
  const AutoValue* a = find(r, "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  ASSERT_NE(a, nullptr);
  EXPECT_NE(a->source.find("zero3_save_16bit_model"), std::string::npos);
  EXPECT_EQ(parse_experiment(doc, 1).config.zero.stage, 3);
  // The newer spelling resolves the same way.
  doc["zero_optimization"].erase("stage3_gather_16bit_weights_on_model_save");
  doc["zero_optimization"]["gather_16bit_weights_on_model_save"] = "auto";
  EXPECT_EQ(resolve_auto(doc, 1).doc["zero_optimization"]["gather_16bit_weights_on_model_save"], false);
}

// The ZeRO bucket rules follow the model's hidden size, as the Trainer's
// model.config.hidden_size: n_embd for the GPT, hidden_size for the Llama,
// and config.json's for a model folder (before, n_embd for every model, so
// a Llama's buckets were sized from the GPT's default width).
TEST(AutoConfig, BucketRulesFollowTheModelsHiddenSize) {
  json doc = hf_config();
  doc["model"] = {{"type", "llama"}, {"hidden_size", 96}, {"intermediate_size", 128}, {"num_hidden_layers", 2},
                  {"num_attention_heads", 4}};
  ResolvedConfig r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["zero_optimization"]["reduce_bucket_size"], 96 * 96);
  EXPECT_EQ(r.doc["zero_optimization"]["stage3_param_persistence_threshold"], 960);
  EXPECT_NE(find(r, "zero_optimization.reduce_bucket_size")->source.find("model.hidden_size 96"), std::string::npos);
  EXPECT_EQ(parse_experiment(doc, 1).config.zero.reduce_bucket_size, 96 * 96);

  const std::string dir = std::string(ZINC_SOURCE_DIR) + "/tests/fixtures/hf/llama_gqa";
  doc["model"] = {{"from_pretrained", dir}};
  r = resolve_auto(doc, 1);
  EXPECT_EQ(r.doc["zero_optimization"]["reduce_bucket_size"], 32 * 32);  // its config.json's hidden_size
  EXPECT_NE(find(r, "zero_optimization.reduce_bucket_size")->source.find("config.json"), std::string::npos);

  // No "auto" bucket: the folder's config.json is not read for it.
  doc["zero_optimization"] = {{"stage", 2}};
  doc["model"] = {{"from_pretrained", "/nonexistent-zinc-folder"}};
  EXPECT_EQ(resolve_auto(doc, 1).doc["zero_optimization"], json({{"stage", 2}}));
}

}  // namespace
}  // namespace zinc::tools

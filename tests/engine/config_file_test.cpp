// Tests for engine/config, continued (config_test.cpp has the defaults, the
// batch triad, errors, accepted forms and warnings): config files and
// --set overrides, hostile inputs, "did you mean", DeepSpeed's checkpoint
// keys, the remaining sections, and "device".
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
// Files

TEST(ConfigLoad, ReadsAFile) {
  std::string path = temp_path("ok.json");
  write_file(path,
             R"({"train_batch_size": 16, "gradient_accumulation_steps": 2, "bf16": {"enabled": true}})");
  Config c = Config::load(path, 2);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_TRUE(c.bf16);
  std::remove(path.c_str());
}

TEST(ConfigLoad, MissingFileIsAnIoErrorNamingThePath) {
  std::string path = temp_path("does_not_exist.json");
  try {
    Config::load(path);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_parts(e.what(), {path, "No such file"});
  }
}

TEST(ConfigLoad, SyntaxErrorNamesFileAndLine) {
  std::string path = temp_path("bad.json");
  write_file(path, "{\n  \"train_batch_size\": 8,\n  \"bf16\": {\"enabled\": tru}\n}\n");
  try {
    Config::load(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    expect_parts(e.what(), {path, "JSON syntax error at line 3"});
  }
  std::remove(path.c_str());
}

TEST(ConfigLoad, DuplicateKeysAreRefused) {
  std::string path = temp_path("dup.json");
  write_file(path, R"({"train_batch_size": 8, "zero_optimization": {"stage": 0, "stage": 1}})");
  try {
    Config::load(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    expect_parts(e.what(), {path, "zero_optimization.stage: duplicate key 'stage'"});
  }
  std::remove(path.c_str());
}

// ---------------------------------------------------------------------------
// --set overrides

TEST(ConfigOverride, ParsesJsonValuesAndBareWords) {
  json j = base();
  apply_override(j, "optimizer.params.lr=3e-4");
  apply_override(j, "optimizer.type=AdamW");
  apply_override(j, "bf16.enabled=true");
  apply_override(j, "optimizer.params.betas=[0.8,0.9]");
  apply_override(j, "csv_monitor.output_path=runs/a=b");
  EXPECT_DOUBLE_EQ(j["optimizer"]["params"]["lr"].get<double>(), 3e-4);
  EXPECT_EQ(j["optimizer"]["type"], "AdamW");
  EXPECT_EQ(j["bf16"]["enabled"], true);
  EXPECT_EQ(j["csv_monitor"]["output_path"], "runs/a=b");
  apply_override(j, "optimizer.params.betas.1=0.95");
  EXPECT_DOUBLE_EQ(j["optimizer"]["params"]["betas"][1].get<double>(), 0.95);
  Config c = Config::parse(j);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.adam.beta2, 0.95);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.csv_monitor.output_path, "runs/a=b");
}

TEST(ConfigOverride, MalformedAssignmentsAreErrors) {
  json j = base();
  auto config_error_of = [&](const std::string& a) {
    try {
      apply_override(j, a);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "expected a ConfigError for " << a;
    return std::string();
  };
  expect_parts(config_error_of("optimizer.type"), {"optimizer.type", "key.path=value"});
  expect_parts(config_error_of("a..b=1"), {"empty component"});
  expect_parts(config_error_of("train_micro_batch_size_per_gpu.x=1"),
               {"train_micro_batch_size_per_gpu", "not an object"});
  apply_override(j, "list=[1,2]");
  expect_parts(config_error_of("list.5=3"), {"list.5", "out of range"});
  expect_parts(config_error_of("list.x=3"), {"list.x", "index it with a number"});
}

TEST(ConfigOverride, OverriddenValuesAreValidatedByParse) {
  json j = base();
  apply_override(j, "zero_optimization.stage=4");
  EXPECT_CONFIG_ERROR(j, "zero_optimization.stage: must be");
}

// ---------------------------------------------------------------------------
// Hostile files and overrides (issue 27): each ends in a ConfigError naming
// the file or override, the place and the rule; never in a crash or in an
// exception of another type.

// The ConfigError message of `f`, or a test failure: an exception of
// another type fails the test with its message instead of ending the run.
template <typename F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a ConfigError, got " << typeid(e).name() << ": " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

std::string nested_lists(size_t depth) { return std::string(depth, '[') + "1" + std::string(depth, ']'); }

std::string nested_objects(size_t depth) {
  std::string s;
  for (size_t i = 0; i < depth; ++i) s += "{\"a\": ";
  return s + "1" + std::string(depth, '}');
}

TEST(ConfigLoad, NestingPastTheLimitIsRefusedWithItsPlace) {
  // 100,000 levels overflowed the stack where the document was copied.
  const std::string path = temp_path("deep.json");
  write_file(path, nested_lists(100000));
  expect_parts(config_error_of([&] { Config::load(path); }),
               {path, "line 1, column 65", "[0][0][0]", "nested deeper than 64 levels"});
  write_file(path, "{\"train_batch_size\": 8,\n \"amp\": " + nested_objects(100) + "}");
  expect_parts(config_error_of([&] { Config::load(path); }), {path, "line 2, column ", "amp.a.a.a", "nested deeper than 64"});
  // The limit itself is a document like any other: it copies, compares,
  // dumps and goes away.
  write_file(path, nested_lists(kMaxConfigDepth));
  const json j = read_json_file(path);
  json copy = j;
  EXPECT_EQ(copy, j);
  EXPECT_EQ(copy.dump(), nested_lists(kMaxConfigDepth));
  write_file(path, nested_lists(kMaxConfigDepth + 1));
  expect_parts(config_error_of([&] { read_json_file(path); }), {"line 1, column 65", "nested deeper than 64"});
  std::remove(path.c_str());
}

TEST(ConfigLoad, NumberPastADoubleNamesFileLinePathAndRule) {
  // json::parse threw a bare [json.exception.out_of_range.406].
  const std::string path = temp_path("huge.json");
  const std::string line3 = R"(  "optimizer": {"type": "AdamW", "params": {"lr": 1e400, "betas": [0.9, -1e999]}})";
  write_file(path, "{\n  \"train_batch_size\": 8,\n" + line3 + "\n}\n");
  expect_parts(config_error_of([&] { Config::load(path); }),
               {path, "line 3, column " + std::to_string(line3.find("1e400") + 1), "optimizer.params.lr",
                "number 1e400 is out of range", "fit in a double"});
  write_file(path, R"({"optimizer": {"params": {"betas": [0.9, -1e999]}}})");
  expect_parts(config_error_of([&] { Config::load(path); }), {path, "optimizer.params.betas[1]", "-1e999"});
  std::remove(path.c_str());
}

TEST(ConfigOverride, NumbersPastADoubleAndDeepValuesAreRefused) {
  json j = base();
  expect_parts(config_error_of([&] { apply_override(j, "optimizer.params.lr=1e400"); }),
               {"--set optimizer.params.lr=1e400", "optimizer.params.lr", "number 1e400 is out of range"});
  expect_parts(config_error_of([&] { apply_override(j, "a.b=" + nested_lists(100000)); }),
               {"a.b[0][0]", "nested deeper than 64"});
  // The path's components and the value's nesting share the limit: 63
  // components leave room for one list.
  std::string path = "k";
  for (int i = 1; i < 63; ++i) path += ".k";
  apply_override(j, path + "=[1]");
  expect_parts(config_error_of([&] { apply_override(j, path + "=[[1]]"); }), {"nested deeper than 64"});
  std::string long_path = "a";
  for (int i = 0; i < 100000; ++i) long_path += ".a";
  expect_parts(config_error_of([&] { apply_override(j, long_path + "=1"); }), {"100001 components", "64 levels"});
  // A syntax error is still a bare word.
  apply_override(j, "csv_monitor.job_name=[1, 2");
  EXPECT_EQ(j["csv_monitor"]["job_name"], "[1, 2");
}

TEST(ConfigOverride, ListIndexPastSizeTIsOutOfRange) {
  // std::stoul threw std::out_of_range ("stoul").
  json j = base();
  apply_override(j, "x=[1,2]");
  expect_parts(config_error_of([&] { apply_override(j, "x.99999999999999999999=1"); }),
               {"x.99999999999999999999", "index 99999999999999999999 is out of range for a list of 2"});
}

TEST(ConfigOverride, TextThatIsNotUtf8IsRefused) {
  // A bare word of any bytes was stored, and the first dump() of the
  // document threw nlohmann's type_error.316.
  json j = base();
  expect_parts(config_error_of([&] { apply_override(j, "csv_monitor.job_name=\xff\xfe"); }),
               {"csv_monitor.job_name", "value is not UTF-8"});
  expect_parts(config_error_of([&] { apply_override(j, "csv_\xc3monitor.x=1"); }), {"path is not UTF-8"});
  apply_override(j, "csv_monitor.job_name=caf\xc3\xa9");  // UTF-8 is fine
  EXPECT_NO_THROW(j.dump());
}

TEST(ConfigErrors, ControlCharactersInKeysAreEscapedInMessages) {
  // A NUL in a key ended what() there: zinc-train and Python printed a
  // message cut short (or an empty one).
  const std::vector<std::pair<std::string, std::string>> keys = {
      {std::string("optim\0izer", 10), "optim\\u0000izer"}, {std::string("\0zero", 5), "\\u0000zero"},
      {"a\nb", "a\\u000ab"}};
  for (const auto& [key, shown] : keys) {
    const std::string e = config_error(with({{key, 1}}));
    expect_parts(e, {shown + ": unknown key"});
  }
  expect_parts(config_error(with({{"zero_optimization", {{std::string("st\0age", 6), 1}}}})),
               {"zero_optimization.st\\u0000age: unknown key (did you mean 'stage'?)"});
  const std::string path = temp_path("nul_key.json");
  write_file(path, R"({"zero_optimization": {"st\u0000age": 0, "st\u0000age": 1}})");
  expect_parts(config_error_of([&] { Config::load(path); }),
               {path, "zero_optimization.st\\u0000age: duplicate key 'st\\u0000age'"});
  std::remove(path.c_str());
}

TEST(ConfigErrors, FileNamesCannotHoldANulByte) {
  // The system reads a name up to its first NUL: "/tmp\0/x" would be /tmp.
  const std::string name("/tmp\0/x", 7);
  EXPECT_CONFIG_ERROR(with({{"zero_optimization",
                             {{"stage", 1}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", name}}}}}}),
                      "zero_optimization.offload_optimizer.nvme_path", "NUL byte", "\"/tmp\\u0000/x\"");
  EXPECT_CONFIG_ERROR(with({{"csv_monitor", {{"output_path", name}}}}), "csv_monitor.output_path", "NUL byte");
  EXPECT_CONFIG_ERROR(with({{"csv_monitor", {{"job_name", name}}}}), "csv_monitor.job_name", "NUL byte");
}

// ---------------------------------------------------------------------------

TEST(DidYouMean, NearestWithinTheThreshold) {
  std::vector<std::string> keys = {"steps_per_print", "gradient_clipping", "train_batch_size"};
  EXPECT_EQ(did_you_mean("stpes_per_print", keys), "steps_per_print");
  EXPECT_EQ(did_you_mean("Gradient_Clipping", keys), "gradient_clipping");
  EXPECT_EQ(did_you_mean("optimizer", keys), "");
  EXPECT_EQ(did_you_mean("x", {}), "");
}


// DeepSpeed's checkpoint section: tag_validation is kept (any case), the
// others warn or are refused with the reason.
TEST(ConfigCheckpoint, EachDeepSpeedKeyIsKeptWarnedOrRefused) {
  EXPECT_EQ(Config::parse(base()).checkpoint.tag_validation, TagValidation::kWarn);
  EXPECT_EQ(Config::parse(with({{"checkpoint", {{"tag_validation", "fail"}}}})).checkpoint.tag_validation,
            TagValidation::kFail);
  Config ig = Config::parse(with({{"checkpoint", {{"tag_validation", "Ignore"}}}}));
  EXPECT_EQ(ig.checkpoint.tag_validation, TagValidation::kIgnore);
  EXPECT_TRUE(ig.warnings.empty());
  expect_parts(config_error(with({{"checkpoint", {{"tag_validation", "Sometimes"}}}})),
               {"checkpoint.tag_validation", "Sometimes"});

  Config off = Config::parse(with({{"checkpoint",
                                    {{"load_universal", false},
                                     {"use_node_local_storage", false},
                                     {"parallel_write", {{"pipeline_stage", false}}}}}}));
  EXPECT_TRUE(off.warnings.empty());
  Config on = Config::parse(with({{"checkpoint",
                                   {{"load_universal", true},
                                    {"parallel_write", {{"pipeline_stage", true}}},
                                    {"writer", {{"type", "fast"}}}}}}));
  EXPECT_TRUE(any_warning_has(on, "checkpoint.load_universal: ignored"));
  EXPECT_TRUE(any_warning_has(on, "without conversion"));
  EXPECT_TRUE(any_warning_has(on, "checkpoint.parallel_write: ignored"));
  EXPECT_TRUE(any_warning_has(on, "already writes its own shards in parallel"));
  EXPECT_TRUE(any_warning_has(on, "checkpoint.writer"));
  expect_parts(config_error(with({{"checkpoint", {{"use_node_local_storage", true}}}})),
               {"checkpoint.use_node_local_storage", "every rank sees"});
}


// Megatron-DeepSpeed's "bfloat16": {"enabled": true, "loss_scale": 1.0}
// parses (the older spelling, and a loss scale DeepSpeed never read there);
// a scale other than 0 or 1 is named as ignored.
TEST(ConfigPrecision, MegatronBfloat16SectionWithLossScale) {
  Config c = Config::parse(with({{"bfloat16", {{"enabled", true}, {"loss_scale", 1.0}}}}));
  EXPECT_TRUE(c.bf16);
  EXPECT_TRUE(c.warnings.empty());
  Config w = Config::parse(with({{"bf16", {{"enabled", true}, {"loss_scale", 1024}}}}));
  EXPECT_TRUE(any_warning_has(w, "bf16.loss_scale: ignored"));
  expect_parts(config_error(with({{"bf16", {{"enabled", true}, {"loss_scale", "big"}}}})), {"bf16.loss_scale"});
}


// Sections that real configs carry (LLaMA-Factory's ds_z3_config.json) and
// that change nothing: silent when off, a warning when on.
TEST(ConfigWarnings, CommsConfigAndMonitorConfig) {
  Config off = Config::parse(with({{"comms_config", {{"verbose", false}}}}));
  EXPECT_TRUE(off.warnings.empty());
  Config on = Config::parse(with({{"comms_config", {{"verbose", true}}},
                                  {"monitor_config", {{"enabled", true}, {"tag", "DeepSpeedMonitor"},
                                                      {"csv_monitor", {{"enabled", false}}}}}}));
  EXPECT_TRUE(any_warning_has(on, "comms_config"));
  EXPECT_TRUE(any_warning_has(on, "monitor_config"));
}


// activation_checkpointing: DeepSpeed's keys and defaults are parsed and
// kept; a section of defaults (the form configs carry, number_checkpoints
// null or false included) is silent; each key set is a warning naming its
// path and why it changes nothing; wrong types, ranges and unknown keys are
// errors with the path.
TEST(ConfigActivationCheckpointing, DeepSpeedKeysParsedDefaultsSilentSetKeysWarned) {
  const ActivationCheckpointingConfig d = Config::parse(base()).activation_checkpointing;
  EXPECT_FALSE(d.given);
  EXPECT_FALSE(d.partition_activations);
  EXPECT_FALSE(d.contiguous_memory_optimization);
  EXPECT_FALSE(d.cpu_checkpointing);
  EXPECT_FALSE(d.number_checkpoints.has_value());
  EXPECT_FALSE(d.synchronize_checkpoint_boundary);
  EXPECT_FALSE(d.profile);

  for (const json& n : {json(nullptr), json(false)}) {
    Config off = Config::parse(with({{"activation_checkpointing",
                                      {{"partition_activations", false},
                                       {"cpu_checkpointing", false},
                                       {"contiguous_memory_optimization", false},
                                       {"number_checkpoints", n},
                                       {"synchronize_checkpoint_boundary", false},
                                       {"profile", false}}}}));
    EXPECT_TRUE(off.activation_checkpointing.given);
    EXPECT_FALSE(off.activation_checkpointing.number_checkpoints.has_value());
    EXPECT_TRUE(off.warnings.empty()) << off.warnings.front();
  }

  Config on = Config::parse(with({{"activation_checkpointing",
                                   {{"partition_activations", true},
                                    {"cpu_checkpointing", true},
                                    {"contiguous_memory_optimization", true},
                                    {"number_checkpoints", 24},
                                    {"synchronize_checkpoint_boundary", true},
                                    {"profile", true}}}}));
  const ActivationCheckpointingConfig& a = on.activation_checkpointing;
  EXPECT_TRUE(a.partition_activations && a.cpu_checkpointing && a.contiguous_memory_optimization &&
              a.synchronize_checkpoint_boundary && a.profile);
  EXPECT_EQ(a.number_checkpoints, 24);
  EXPECT_EQ(on.warnings.size(), 6u);
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.partition_activations: ignored"));
  EXPECT_TRUE(any_warning_has(on, "zinc's tensor parts each keep the whole layer inputs"));
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.contiguous_memory_optimization: ignored"));
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.number_checkpoints: ignored"));
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.cpu_checkpointing: no effect"));
  EXPECT_TRUE(any_warning_has(on, "already live in host RAM"));
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.synchronize_checkpoint_boundary: no effect"));
  EXPECT_TRUE(any_warning_has(on, "activation_checkpointing.profile: ignored"));

  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"partition_activation", true}}}}),
                      "activation_checkpointing.partition_activation", "did you mean 'partition_activations'");
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"number_checkpoints", 0}}}}),
                      "activation_checkpointing.number_checkpoints", "must be >= 1, got 0");
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"number_checkpoints", true}}}}),
                      "activation_checkpointing.number_checkpoints", "expected an integer");
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"cpu_checkpointing", "yes"}}}}),
                      "activation_checkpointing.cpu_checkpointing", "expected true or false");
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", true}}), "activation_checkpointing",
                      "expected an object");
}

}  // namespace
}  // namespace zinc

// ---- "device" ------------------------------------------------------------------
namespace zinc {
namespace {
using testing_config::with;

TEST(ConfigDevice, DefaultsToCpuAndAcceptsCpuAndAuto) {
  EXPECT_EQ(Config::parse(testing_config::base()).device, Device::kCpu);
  EXPECT_EQ(Config::parse(with({{"device", "cpu"}})).device, Device::kCpu);
  const Device autod = Config::parse(with({{"device", "auto"}})).device;
  EXPECT_EQ(autod, cuda_status().devices > 0 ? Device::kCuda : Device::kCpu);
}

TEST(ConfigDevice, UnknownValueIsAnErrorNamingTheChoices) {
  const std::string e = testing_config::error_of_parse([](const json& j) { Config::parse(j); }, with({{"device", "gpu"}}));
  testing_config::expect_parts(e, {"device", "\"cpu\", \"cuda\" or \"auto\"", "gpu"});
}

TEST(ConfigDevice, CudaWithoutAGpuSaysWhy) {
  if (cuda_status().devices > 0) GTEST_SKIP() << "this machine has a GPU";
  const std::string e = testing_config::error_of_parse(
      [](const json& j) { Config::parse(j); },
      with({{"device", "cuda"}, {"zero_optimization", {{"offload_optimizer", {{"device", "cpu"}}}}}}));
  testing_config::expect_parts(e, {"device"});
  if (cuda_status().built)
    testing_config::expect_parts(e, {"no GPU is visible"});
  else
    testing_config::expect_parts(e, {"built without CUDA"});
}

}  // namespace
}  // namespace zinc

#include "tools/experiment.h"

#include <filesystem>

#include "core/device.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <limits>
#include <filesystem>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "tools/output_folder.h"
#include "kernels/kernels.h"
#include "optim/optim.h"
#include "models/models.h"
#include "tools/hf_model.h"
#include "tools/peft_adapter.h"

namespace zinc::tools {

namespace {

// model.from_pretrained: the folder's model, after checking that the
// section's size keys and the data agree with its config.json.
std::shared_ptr<Model> load_from_pretrained(const ModelConfig& m, const DataSource& data, Device device,
                                            std::optional<HfConfig>& out) {
  const HfConfig& hf = out.emplace(read_hf_config(m.from_pretrained));
  const std::string file = m.from_pretrained + "/config.json";
  const std::string& type = hf.family->name;
  auto given = [&](const char* k) { return std::find(m.given.begin(), m.given.end(), k) != m.given.end(); };
  if (given("type") && m.type != type) {
    throw ConfigError("model.type", "\"" + m.type + "\" disagrees with " + file + ": architectures \"" +
                                        hf.architecture + "\" (a " + type + "); leave model.type out");
  }
  // Each size key the section gave, against config.json's value of the
  // same name (the family's section_keys say where the names differ).
  const nlohmann::json& raw = hf.raw;
  for (const std::string& k : m.given) {
    if (k == "type") continue;
    std::string hf_key = k;
    nlohmann::json mine;
    if (k == "vocab_size") {
      mine = m.vocab_size;
    } else {
      const auto& keys = hf.family->section_keys;
      auto it = std::find_if(keys.begin(), keys.end(), [&](const auto& p) { return p.first == k; });
      if (it == keys.end()) throw ConfigError("model." + k, "not a size of a " + hf.architecture + " (from " + file + ")");
      if (!it->second.empty()) hf_key = it->second;
      mine = m.given_values.at(k);
    }
    const bool has = raw.contains(hf_key) && !raw[hf_key].is_null();
    if (!has || raw[hf_key] != mine) {
      throw ConfigError("model." + k, mine.dump() + " disagrees with " + file + ": " + hf_key + " " +
                                          (has ? raw[hf_key].dump() : "(not given)") +
                                          "; leave model." + k + " out to take the folder's");
    }
  }
  const int64_t V = hf.model->vocab_size();
  if (data.vocab_size() > V)
    throw ConfigError("model.from_pretrained", "the data's vocabulary " + std::to_string(data.vocab_size()) +
                                                   " exceeds the model's vocab_size " + std::to_string(V) + " (" + file + ")");
  const int64_t max_T = hf.model->max_positions();
  if (data.seq_len() > max_T)
    throw ConfigError("data.seq_len", std::to_string(data.seq_len()) + " exceeds the model's " +
                                          (hf.family->max_positions_key + " ") +
                                          std::to_string(max_T) + " (" + file + ")");
  const models::LoraConfig lora = m.built_lora(m.adapter.empty() ? m.lora : read_peft_adapter_config(m.adapter));
  std::shared_ptr<Model> model = load_pretrained(hf, device, m.gradient_checkpointing, lora, m.adapter);
  if (lora.enabled()) {
    // The folder's config as the model was built: with its adapters (what
    // an export merges or writes in PEFT's format).
    std::unique_ptr<models::FamilyConfig> fc = out->model->clone();
    fc->set_lora(lora);
    out->model = std::move(fc);
  }
  return model;
}

// A monitor writing inside a checkpoint tag loses its files: the next save
// of that tag swaps the folder out, and pruning removes it. So does an NVMe
// offload folder, whose scratch files the run has open (a save removed
// them under the running engine). The tags are the names a save makes
// (global_step<N>), its partial and old folders (".<tag>..."), and `latest`.
void check_folders_outside_tags(const Config& c, const RunConfig& run) {
  namespace fs = std::filesystem;
  std::vector<std::tuple<std::string, fs::path, std::string>> folders;  // key, folder, what it is
  for (const auto& [key, m] : {std::pair<const char*, const MonitorConfig*>{"csv_monitor", &c.csv_monitor},
                               std::pair<const char*, const MonitorConfig*>{"tensorboard", &c.tensorboard}})
    if (m->enabled)
      folders.emplace_back(std::string(key) + ".output_path", fs::path(m->output_path) / m->job_name, "with job_name, the folder ");
  for (const auto& [key, o] : {std::pair<const char*, const OffloadConfig*>{"offload_optimizer", &c.zero.offload_optimizer},
                               std::pair<const char*, const OffloadConfig*>{"offload_param", &c.zero.offload_param}})
    if (o->device == OffloadDevice::kNvme)
      folders.emplace_back(std::string("zero_optimization.") + key + ".nvme_path", fs::path(o->nvme_path),
                           "the NVMe folder ");
  for (const auto& [key, folder, what] : folders) {
    std::error_code ec;
    const fs::path dir = fs::weakly_canonical(fs::absolute(folder, ec), ec);
    if (const std::string tag = tag_holding(dir.string(), run.checkpoint_dir); !tag.empty())
      throw ConfigError(key, what + dir.string() + " lies in the checkpoint tag " + tag + " of run.checkpoint_dir " +
                                 run.checkpoint_dir +
                                 ", which a checkpoint save replaces and pruning removes; choose another folder");
  }
}

// OneCycle with cycle_momentum raises beta1 after the cycle (DeepSpeed's
// decay_mom_rate); a step whose beta1 reaches 1 ends the run there. The
// schedule is known from the config, so the step is found here, for
// --check and before anything trains. beta1 stays below cycle_max_mom
// inside the cycle and grows with the step after it, so the first step
// at 1 is found by halving.
void check_schedule_betas(const Config& c, const RunConfig& run) {
  const optim::LrSchedule schedule(c.scheduler, c.optimizer.lr());
  if (!schedule.sets_betas() || run.steps <= 0) return;
  auto reaches_one = [&](int64_t s) { return !(schedule.betas_at(s).beta1 < 1); };
  if (!reaches_one(run.steps - 1)) return;
  int64_t lo = 0, hi = run.steps - 1;  // the first step in [lo, hi] reaching 1
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (reaches_one(mid)) hi = mid; else lo = mid + 1;
  }
  throw ConfigError("scheduler.params.decay_mom_rate",
                    "OneCycle's momentum reaches " + std::to_string(schedule.betas_at(lo).beta1) +
                        " at optimizer step " + std::to_string(lo + 1) + " of run.steps " +
                        std::to_string(run.steps) + "; beta1 must stay below 1 (lower decay_mom_rate, or raise "
                        "decay_step_size)");
}

}  // namespace

Experiment build_experiment(const nlohmann::json& doc, int world_size) {
  Experiment e;
  ParsedExperiment parsed = parse_experiment(doc, world_size);
  e.config = std::move(parsed.config);
  e.experiment = std::move(parsed.experiment);
  e.auto_values = std::move(parsed.auto_values);
  check_folders_outside_tags(e.config, e.experiment.run);
  check_schedule_betas(e.config, e.experiment.run);
  const ModelConfig& m = e.experiment.model;
  e.data = make_data_source(e.experiment.data);
  if (const int64_t n = e.data->num_samples(); n < e.config.train_batch_size) {
    // Each global batch draws its samples without repeats while the epoch
    // lasts, then from the next epoch's order: a batch over more samples
    // than the data holds trains some of them twice or more in one step.
    const std::string why = "data: " + std::to_string(n) + " samples an epoch (" + e.experiment.data.path +
                            "), fewer than one global batch of " + std::to_string(e.config.train_batch_size) +
                            " (train_batch_size): each batch holds samples more than once";
    log_warn_rank0("config: " + why);
    e.config.warnings.push_back(why);
  }
  if (e.experiment.run.eval_interval > 0) {
    e.eval_data = make_eval_data_source(e.experiment.data, *e.data);
    if (!e.eval_data)
      throw ConfigError("run.eval_interval", "evaluation needs held-out data: set data.eval_fraction > 0");
  }
  const int64_t V = m.vocab_size > 0 ? m.vocab_size : e.data->vocab_size();
  if (V < e.data->vocab_size())
    throw ConfigError("model.vocab_size", "must be >= the data's vocabulary (" +
                                              std::to_string(e.data->vocab_size()) + "), got " +
                                              std::to_string(V));
  auto build = [&] {
    if (!m.from_pretrained.empty()) {
      e.model = load_from_pretrained(m, *e.data, e.config.device, e.hf);
    } else {
      std::unique_ptr<models::FamilyConfig> model = m.settings.model->clone();
      model->set_lora(m.built_lora(m.lora));
      model->fit_data(V, e.data->seq_len());
      if (auto bad = model->size_error()) throw ConfigError("model." + bad->field, bad->message);
      e.model = model->build(e.config.device, m.gradient_checkpointing);
      if (!model->family().architectures.empty()) e.hf = hf_config_of(*model);
    }
    // The GPU path's refusals that need the model, made here (and by
    // --check) rather than when the engine splits the stages.
    if (e.config.pipelined()) plan_pipeline(*e.model, e.config);
  };
  if (!e.config.device_auto) {
    build();
    return e;
  }
  try {
    build();
  } catch (const ConfigError& err) {
    // "auto" chose the GPU, which this model does not run on: the CPU, said.
    const std::string what = err.what();
    if (what.find("GPU") == std::string::npos && what.rfind("device", 0) != 0) throw;  // not the device's refusal
    const std::string why = std::string("\"auto\" stays on the CPU: ") + err.what();
    log_warn("config: device: " + why);
    e.config.warnings.push_back("device: " + why);
    e.config.device = Device::kCpu;
    e.config.device_auto = false;
    e.config.validate();
    build();
  }
  return e;
}

nlohmann::json load_document(const std::string& path, const std::vector<std::string>& overrides) {
  nlohmann::json doc = read_json_file(path);
  for (const std::string& o : overrides) apply_override(doc, o);
  return doc;
}

Experiment load_experiment(const std::string& path, const std::vector<std::string>& overrides,
                           int world_size) {
  return build_experiment(load_document(path, overrides), world_size);
}

int64_t eval_batches_held(const DataSource& source, int64_t micro) {
  const int64_t n = source.num_samples();
  return micro <= 0 ? 0 : n / micro + (n % micro != 0 ? 1 : 0);
}

double evaluate(Engine& engine, const DataSource& source, int64_t batches, int64_t micro) {
  // The mean over every target of the batches (a batch's loss is the mean
  // over its own targets, so each is weighted by their count).
  const int64_t T = source.seq_len();
  batches = std::min(batches, eval_batches_held(source, micro));  // each held-out sample once at most
  double total = 0, targets = 0;
  int64_t next = 0;
  for (int64_t b = 0; b < batches; ++b) {
    Batch batch;
    batch.B = micro;
    batch.T = T;
    batch.inputs.resize(static_cast<size_t>(micro * T));
    batch.targets.resize(static_cast<size_t>(micro * T));
    if (source.has_positions()) batch.positions.resize(static_cast<size_t>(micro * T));
    for (int64_t i = 0; i < micro; ++i, ++next) {
      if (next < source.num_samples()) {
        read_sample(source, next, batch, i);
        continue;
      }
      // Past the set's end (its last micro-batch): a row of no targets, so
      // that each sample counts once whatever the micro-batch (the rows
      // once wrapped to the set's start and counted those twice).
      const size_t at = static_cast<size_t>(i * T);
      std::fill_n(batch.inputs.begin() + at, T, 0);
      std::fill_n(batch.targets.begin() + at, T, kIgnoreTarget);
      if (!batch.positions.empty())
        for (int64_t t = 0; t < T; ++t) batch.positions[at + static_cast<size_t>(t)] = static_cast<int32_t>(t);
    }
    int64_t n = 0;
    for (int32_t t : batch.targets) n += t != kIgnoreTarget;
    const double loss = engine.evaluate(batch);  // every rank: a collective at stage 3
    if (n == 0) continue;  // no targets: NaN, which would make the mean NaN
    total += loss * static_cast<double>(n);
    targets += static_cast<double>(n);
  }
  return targets > 0 ? total / targets : std::numeric_limits<double>::quiet_NaN();  // no targets: no loss, not 0
}

int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

int64_t current_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

std::string kernel_paths() {
  return cpu_isa_summary() + " | " + kernels::matmul_paths_summary() + " | optimizer: " +
         std::string(optim::isa_name(optim::active_isa())) + " | " + cuda_status().summary();
}

}  // namespace zinc::tools

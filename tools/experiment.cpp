#include "tools/experiment.h"

#include "core/device.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>

#include <utility>

#include "core/cpu.h"
#include "core/error.h"
#include "kernels/kernels.h"
#include "optim/optim.h"
#include "models/models.h"

namespace zinc::tools {

Experiment build_experiment(const nlohmann::json& doc, int world_size) {
  Experiment e;
  ParsedExperiment parsed = parse_experiment(doc, world_size);
  e.config = std::move(parsed.config);
  e.experiment = std::move(parsed.experiment);
  e.auto_values = std::move(parsed.auto_values);
  const ModelConfig& m = e.experiment.model;
  e.data = make_data_source(e.experiment.data);
  if (e.experiment.run.eval_interval > 0) {
    e.eval_data = make_eval_data_source(e.experiment.data);
    if (!e.eval_data)
      throw ConfigError("run.eval_interval", "evaluation needs held-out data: set data.eval_fraction > 0");
  }
  const int64_t V = m.vocab_size > 0 ? m.vocab_size : e.data->vocab_size();
  if (V < e.data->vocab_size())
    throw ConfigError("model.vocab_size", "must be >= the data's vocabulary (" +
                                              std::to_string(e.data->vocab_size()) + "), got " +
                                              std::to_string(V));
  if (m.type == ModelType::kGpt) {
    models::GptConfig g;
    g.vocab_size = V;
    g.block_size = m.block_size > 0 ? m.block_size : e.data->seq_len();
    if (g.block_size < e.data->seq_len())
      throw ConfigError("model.block_size", "must be >= data.seq_len (" +
                                                std::to_string(e.data->seq_len()) + "), got " +
                                                std::to_string(g.block_size));
    g.n_layer = m.n_layer;
    g.n_head = m.n_head;
    g.n_embd = m.n_embd;
    g.gradient_checkpointing = m.gradient_checkpointing;
    g.device = e.config.device;
    e.model = models::make_gpt(g);
  } else if (m.type == ModelType::kMlp) {
    models::MlpConfig c;
    c.vocab_size = V;
    c.context = m.context;
    c.n_embd = m.n_embd;
    c.hidden = m.hidden;
    c.n_layer = m.n_layer;
    if (e.config.device != Device::kCpu)
      throw ConfigError("device", "model \"mlp\" computes on the CPU only (the GPU path has the GPT)");
    e.model = models::make_mlp(c);
  } else {
    // Only reachable with a value cast from outside the enum.
    throw ConfigError("model.type", "unknown model '" + std::string(model_type_name(m.type)) +
                                        "' (expected \"gpt\" or \"mlp\")");
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

double evaluate(Engine& engine, const DataSource& source, int64_t batches, int64_t micro) {
  const int64_t T = source.seq_len();
  double total = 0;
  int64_t next = 0;
  for (int64_t b = 0; b < batches; ++b) {
    Batch batch;
    batch.B = micro;
    batch.T = T;
    batch.inputs.resize(static_cast<size_t>(micro * T));
    batch.targets.resize(static_cast<size_t>(micro * T));
    for (int64_t i = 0; i < micro; ++i, ++next)
      source.sample(next % source.num_samples(), batch.inputs.data() + i * T, batch.targets.data() + i * T);
    total += engine.evaluate(batch);
  }
  return total / static_cast<double>(batches);
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

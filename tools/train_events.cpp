#include "tools/train_events.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

#include "tools/auto_config.h"
#include "tools/config_check.h"

namespace zinc::tools {

nlohmann::json config_event(const Experiment& ex, const nlohmann::json& doc, int world_size) {
  const nlohmann::json resolved = resolved_document(ex.config, ex.experiment, parse_trainer(doc));
  return {{"event", "config"}, {"world_size", world_size}, {"config", resolved}};
}

std::optional<nlohmann::json> auto_event(const Experiment& ex) {
  if (ex.auto_values.empty()) return std::nullopt;
  nlohmann::json values = nlohmann::json::array();
  for (const AutoValue& a : ex.auto_values) values.push_back({{"path", a.path}, {"value", a.value}, {"source", a.source}});
  return nlohmann::json{{"event", "auto"}, {"values", values}};
}

nlohmann::json resume_event(const std::string& dir, int64_t step) {
  return {{"event", "resume"}, {"dir", dir}, {"step", step}};
}

nlohmann::json step_event(const Engine& engine, int64_t step, double loss, double tokens_per_s, double elapsed_s) {
  nlohmann::json ev = {{"event", "step"},         {"step", step},
                       {"loss", loss},            {"lr", engine.learning_rate()},
                       {"grad_norm", engine.global_grad_norm()},
                       {"tokens_per_s", tokens_per_s}, {"elapsed_s", elapsed_s}};
  if (engine.config().fp16.enabled) {
    ev["loss_scale"] = engine.loss_scale();
    ev["skipped_steps"] = engine.skipped_steps();
  }
  return ev;
}

nlohmann::json eval_event(int64_t step, double loss) { return {{"event", "eval"}, {"step", step}, {"loss", loss}}; }

nlohmann::json checkpoint_event(int64_t step, const std::string& path, double seconds) {
  return {{"event", "checkpoint"}, {"step", step}, {"path", path}, {"seconds", seconds}};
}

void prune_checkpoints(const std::string& dir, int64_t keep) {
  namespace fs = std::filesystem;
  if (keep <= 0) return;
  std::vector<std::pair<long long, fs::path>> tags;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("global_step", 0) != 0) continue;
    char* end = nullptr;
    const long long step = std::strtoll(n.c_str() + 11, &end, 10);
    if (end && *end == '\0') tags.emplace_back(step, e.path());
  }
  std::sort(tags.begin(), tags.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < tags.size(); ++i) fs::remove_all(tags[i].second, ec);
}

}  // namespace zinc::tools

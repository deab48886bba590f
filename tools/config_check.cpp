#include "tools/config_check.h"

#include <unistd.h>

#include <climits>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "engine/config.h"
#include "engine/engine.h"

// Note [--check]
// --------------
// `zinc-train CONFIG --check` answers "would this run start, and with what?"
// without training. It does what a start does up to the engine: reads the
// file, applies --set, resolves "auto", parses every section, opens the data
// and builds the model (build_experiment), and then checks what the engine
// and the run would otherwise find out later, where that is cheap and leaves
// nothing behind: each nvme_path is a folder this process may write, and the
// folders the run creates (csv_monitor's, tensorboard's, the checkpoints') can
// be created.
// So a config that --check accepts also starts; what it cannot see is what
// only running tells (memory, disk space, the peers under mpirun).
//
// The resolved config is to_json(Config) (DeepSpeed's key names) with the
// experiment and trainer sections. Each leaf's source is found by looking
// the leaf up, in this order, in the "auto" values resolve_auto filled, in
// the --set overrides (applied to an empty document), and in the file (under
// either spelling of a key that has an alias, such as bfloat16 for bf16); a
// member of the batch triad that none of these gives was derived from the
// other two; everything else is a default.

namespace zinc::tools {
namespace {

using nlohmann::json;

// Other spellings zinc's parser accepts for a documented name, per section
// ("" is the top level).
const std::map<std::pair<std::string, std::string>, std::string>& aliases() {
  static const std::map<std::pair<std::string, std::string>, std::string> kAliases = {
      {{"", "bf16"}, "bfloat16"},
      {{"zero_optimization", "stage3_prefetch_bucket_size"}, "prefetch_bucket_size"},
      {{"zero_optimization", "stage3_param_persistence_threshold"}, "param_persistence_threshold"},
      {{"zero_optimization", "stage3_model_persistence_threshold"}, "model_persistence_threshold"},
      {{"zero_optimization", "stage3_max_live_parameters"}, "max_live_parameters"},
      {{"zero_optimization", "stage3_max_reuse_distance"}, "max_reuse_distance"},
      {{"aio", "intra_op_parallelism"}, "thread_count"},
  };
  return kAliases;
}

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

}  // namespace

const json* find_config_path(const json& doc, const std::string& path) {
  const json* cur = &doc;
  std::string section;
  for (const std::string& key : split(path)) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end()) {
      auto a = aliases().find({section, key});
      if (a != aliases().end()) it = cur->find(a->second);
    }
    if (it == cur->end()) return nullptr;
    cur = &*it;
    section = section.empty() ? key : section + "." + key;
  }
  return cur;
}

namespace {

// A path with each alias spelling replaced by its documented name.
std::string documented(const std::string& path) {
  std::string out, section;
  for (const std::string& key : split(path)) {
    std::string name = key;
    for (const auto& [k, alias] : aliases())
      if (k.first == section && alias == key) name = k.second;
    out = out.empty() ? name : out + "." + name;
    section = section.empty() ? key : section + "." + key;
  }
  return out;
}

void leaves(const json& j, const std::string& path, std::vector<std::pair<std::string, json>>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it) leaves(*it, path.empty() ? it.key() : path + "." + it.key(), out);
  } else {
    out.emplace_back(path, j);
  }
}

std::string ranks_words(int world) { return std::to_string(world) + (world == 1 ? " rank" : " ranks"); }

// Why no folder can be made in the folder `dir` ("" when one can): one is
// made and removed again. access() says yes to root everywhere, and /proc
// or /sys take no new folders whatever their modes say.
std::string folder_probe(const std::string& dir) {
  std::string t = (std::filesystem::path(dir) / ".zinc-check-XXXXXX").string();
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) return std::strerror(errno);
  ::rmdir(buf.data());
  return "";
}

// A folder the run creates (with create_directories): it exists as a folder
// this process may write, or its nearest existing ancestor is one and the
// names below it fit the file system's limits.
void check_creatable(const std::string& key, const std::string& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = fs::absolute(folder, ec);
  if (ec) throw ConfigError(key, "cannot resolve " + folder + ": " + ec.message());
  if (p.string().size() >= PATH_MAX)
    throw ConfigError(key, folder + ": cannot create it, its path is longer than the system's " +
                               std::to_string(PATH_MAX - 1) + " bytes");
  for (const fs::path& part : p)
    if (part.string().size() > NAME_MAX)
      throw ConfigError(key, folder + ": cannot create it, the name " + part.string().substr(0, 40) + "... is longer "
                             "than the file system's " + std::to_string(NAME_MAX) + " bytes");
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  if (!fs::is_directory(p, ec))
    throw ConfigError(key, folder + ": " + p.string() + " exists and is not a folder");
  if (const std::string why = folder_probe(p.string()); !why.empty())
    throw ConfigError(key, folder + ": cannot create it, " + p.string() + " takes no new folder (" + why + ")");
}

}  // namespace

void check_checkpoint_path_room(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = fs::absolute(dir, ec);
  if (ec) throw ConfigError("run.checkpoint_dir", "cannot resolve " + dir + ": " + ec.message());
  // The deepest path a save writes below the folder: a tag's partial
  // folder of a 20-digit step and a rank file's temporary.
  const std::string deepest = "/.global_step18446744073709551615.partial/.onebit1000000000.json.zinc-tmp";
  if (p.string().size() + deepest.size() >= PATH_MAX)
    throw ConfigError("run.checkpoint_dir",
                      dir + ": its path is " + std::to_string(p.string().size()) + " bytes, and a save writes files " +
                          "up to " + std::to_string(deepest.size()) + " bytes below it, past the system's limit of " +
                          std::to_string(PATH_MAX - 1) + " bytes for a path; choose a folder with a shorter path");
  for (const fs::path& part : p)
    if (part.string().size() > NAME_MAX)
      throw ConfigError("run.checkpoint_dir", dir + ": the name " + part.string().substr(0, 40) +
                                                  "... is longer than the file system's " + std::to_string(NAME_MAX) +
                                                  " bytes");
}

json resolved_document(const Config& c, const ExperimentConfig& e) {
  json j = to_json(c);
  j.update(to_json(e));
  j["trainer"] = to_json(e.trainer);
  return j;
}

std::vector<ConfigEntry> config_sources(const json& resolved, const json& file_doc, const json& set_doc,
                                        const std::vector<AutoValue>& autos, int world, const json* merged) {
  // A file key counts where the overrides left it: a --set of a whole
  // section replaces the file's keys inside it (shown as [file] before,
  // with the defaults' values).
  auto in_file = [&](const std::string& p) {
    return find_config_path(file_doc, p) && (!merged || find_config_path(*merged, p));
  };
  std::vector<std::pair<std::string, json>> flat;
  leaves(resolved, "", flat);
  std::vector<ConfigEntry> out;
  const char* kTriad[] = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"};
  auto given = [&](const std::string& p) {
    for (const AutoValue& a : autos)
      if (a.path == p) return true;
    return find_config_path(set_doc, p) || in_file(p);
  };
  int triad_given = 0;
  for (const char* k : kTriad) triad_given += given(k) ? 1 : 0;
  for (auto& [path, value] : flat) {
    ConfigEntry e{path, value, "default", ""};
    const AutoValue* a = nullptr;
    for (const AutoValue& v : autos)
      if (v.path == path) a = &v;
    if (a) {
      e.source = "auto";
      e.from = a->source;
    } else if (find_config_path(set_doc, path)) {
      e.source = "--set";
    } else if (in_file(path)) {
      e.source = "file";
    } else if (path == kTriad[0] || path == kTriad[1] || (path == kTriad[2] && triad_given == 2)) {
      const json& r = resolved;
      e.source = "derived";
      if (path == kTriad[0])
        e.from = "micro-batch " + r[kTriad[1]].dump() + " x accumulation " + r[kTriad[2]].dump() + " x " +
                 ranks_words(world);
      else if (path == kTriad[1])
        e.from = "train_batch_size " + r[kTriad[0]].dump() + " / (accumulation " + r[kTriad[2]].dump() + " x " +
                 ranks_words(world) + ")";
      else
        e.from = "train_batch_size " + r[kTriad[0]].dump() + " / (micro-batch " + r[kTriad[1]].dump() + " x " +
                 ranks_words(world) + ")";
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<ConfigEntry> unused_keys(const json& resolved, const json& file_doc, const json& set_doc,
                                     const json* merged) {
  std::vector<ConfigEntry> out;
  for (const auto& [doc, source] : {std::pair<const json*, const char*>{&file_doc, "file"}, {&set_doc, "--set"}}) {
    std::vector<std::pair<std::string, json>> flat;
    if (doc->is_object() && !doc->empty()) leaves(*doc, "", flat);  // no --set: no root leaf
    for (auto& [path, value] : flat) {
      // A leaf under a key the resolved config holds as a leaf (an array
      // given as an object, a null section) is used through that key.
      std::string p = documented(path);
      bool used = false;
      for (std::string q = p;; q = q.substr(0, q.rfind('.'))) {
        if (const json* r = find_config_path(resolved, q)) {
          used = !r->is_object() || q == p;
          break;
        }
        if (q.find('.') == std::string::npos) break;
      }
      // The path as messages show keys (a NUL in a key would end the line printed).
      // A file key an override replaced (itself or a section above it) is not the file's any more.
      const bool replaced = source == std::string("file") &&
                            (find_config_path(set_doc, path) || (merged && !find_config_path(*merged, path)));
      if (!used && !replaced)
        out.push_back({config::key_text(path), value, source, ""});
    }
  }
  return out;
}

void check_startable(const Experiment& ex) {
  namespace fs = std::filesystem;
  const Config& c = ex.config;
  const auto nvme = [](const char* key, const OffloadConfig& o) {
    const std::string k = std::string("zero_optimization.") + key + ".nvme_path";
    std::error_code ec;
    if (!fs::exists(o.nvme_path, ec)) throw ConfigError(k, "nvme_path " + o.nvme_path + " does not exist");
    if (!fs::is_directory(o.nvme_path, ec)) throw ConfigError(k, "nvme_path " + o.nvme_path + " is not a folder");
    if (const std::string why = folder_probe(o.nvme_path); !why.empty())
      throw ConfigError(k, "nvme_path " + o.nvme_path + " takes no new folder for the run's files (" + why + ")");
  };
  if (c.zero.stage >= 1 && c.zero.offload_optimizer.device == OffloadDevice::kNvme)
    nvme("offload_optimizer", c.zero.offload_optimizer);
  if (c.zero.stage == 3 && c.zero.offload_param.device == OffloadDevice::kNvme)
    nvme("offload_param", c.zero.offload_param);
  if (c.csv_monitor.enabled)
    check_creatable("csv_monitor.output_path", (fs::path(c.csv_monitor.output_path) / c.csv_monitor.job_name).string());
  if (c.tensorboard.enabled)
    check_creatable("tensorboard.output_path", (fs::path(c.tensorboard.output_path) / c.tensorboard.job_name).string());
  check_checkpoint_path_room(ex.experiment.run.checkpoint_dir);  // a stop signal saves there too
  if (ex.experiment.run.checkpoint_interval > 0) check_creatable("run.checkpoint_dir", ex.experiment.run.checkpoint_dir);
  // Sequence ranks: the model splits its rows and the rows divide.
  if (c.sequence_split()) describe_sequence_ranks(*ex.model, c, ex.data->seq_len());
  // Expert ranks: the model shares out its experts so.
  if (c.expert_split()) describe_expert_parts(*ex.model, c);
}

CheckReport check_config(const std::string& path, const std::vector<std::string>& overrides, int world) {
  CheckReport rep;
  rep.world_size = world;
  LogCapture capture(LogLevel::kWarn);
  try {
    const json file_doc = read_json_file(path);
    json doc = file_doc, set_doc = json::object();
    for (const std::string& o : overrides) {
      apply_override(doc, o);
      apply_override(set_doc, o);
    }
    const Experiment ex = build_experiment(doc, world);
    check_startable(ex);
    if (ex.config.pipelined()) rep.pipeline = plan_pipeline(*ex.model, ex.config).describe(world);
    if (ex.config.tensor_split()) rep.tensor_parts = describe_tensor_parts(*ex.model, ex.config);
    if (ex.config.expert_split()) rep.expert_ranks = describe_expert_parts(*ex.model, ex.config);
    if (ex.config.sequence_split())
      rep.sequence_ranks = describe_sequence_ranks(*ex.model, ex.config, ex.data->seq_len());
    rep.resolved = resolved_document(ex.config, ex.experiment);
    rep.entries = config_sources(rep.resolved, file_doc, set_doc, ex.auto_values, world, &doc);
    rep.unused = unused_keys(rep.resolved, file_doc, set_doc, &doc);
    for (ConfigEntry& u : rep.unused)  // such as fp16.enabled "auto" with bf16 chosen
      for (const AutoValue& a : ex.auto_values)
        if (a.path == u.path) u = {u.path, a.value, "auto", a.source};
    rep.ok = true;
  } catch (const std::exception& e) {
    rep.refusals.push_back(e.what());
  }
  for (std::string w : capture.messages()) {
    if (w.rfind("config: ", 0) == 0) w = w.substr(8);
    rep.warnings.push_back(std::move(w));
  }
  return rep;
}

json CheckReport::to_json() const {
  auto entries_json = [](const std::vector<ConfigEntry>& v) {
    json a = json::array();
    for (const ConfigEntry& e : v) {
      json o = {{"path", e.path}, {"value", e.value}, {"source", e.source}};
      if (!e.from.empty()) o["from"] = e.from;
      a.push_back(std::move(o));
    }
    return a;
  };
  return {{"event", "check"},        {"ok", ok},
          {"world_size", world_size}, {"config", resolved},
          {"keys", entries_json(entries)}, {"unused", entries_json(unused)},
          {"warnings", warnings},    {"refusals", refusals}, {"pipeline", pipeline},
          {"tensor_parts", tensor_parts},
          {"sequence_ranks", sequence_ranks},
          {"expert_ranks", expert_ranks}};
}

}  // namespace zinc::tools

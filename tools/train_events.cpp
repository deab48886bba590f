#include "tools/train_events.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include "tools/auto_config.h"
#include "tools/config_check.h"
#include "tools/output_folder.h"
#include "tools/peft_adapter.h"
#include "tools/resources.h"
#include "core/error.h"
#include "engine/rank_agreement.h"
#include "tools/hf_model.h"
#include "tools/run_loop.h"

namespace zinc::tools {

nlohmann::json config_event(const Experiment& ex, int world_size) {
  const nlohmann::json resolved = resolved_document(ex.config, ex.experiment);
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

nlohmann::json step_event(const Engine& engine, int64_t step, double loss, double tokens_per_s, double elapsed_s,
                          std::optional<double> comm_wait_share) {
  nlohmann::json ev = {{"event", "step"},         {"step", step},
                       {"loss", loss},            {"lr", engine.learning_rate()},
                       {"grad_norm", engine.global_grad_norm()},
                       {"tokens_per_s", tokens_per_s}, {"elapsed_s", elapsed_s}};
  if (engine.config().fp16.enabled) {
    ev["loss_scale"] = engine.loss_scale();
    ev["skipped_steps"] = engine.skipped_steps();
  }
  if (comm_wait_share) ev["comm_wait_share"] = *comm_wait_share;
  if (engine.config().wall_clock_breakdown) {  // this rank's seconds so far in each phase
    const StepTimings t = engine.timings();
    ev["forward_s"] = t.forward_s;
    ev["backward_s"] = t.backward_s;
    ev["optimizer_step_s"] = t.step_s;
    if (t.update_behind_s > 0) {  // the GPU path's update behind the forward
      ev["update_behind_s"] = t.update_behind_s;
      ev["update_wait_s"] = t.update_wait_s;
    }
  }
  return ev;
}

nlohmann::json eval_event(int64_t step, double loss) { return {{"event", "eval"}, {"step", step}, {"loss", loss}}; }

nlohmann::json checkpoint_event(int64_t step, const std::string& path, double seconds) {
  return {{"event", "checkpoint"}, {"step", step}, {"path", path}, {"seconds", seconds}};
}

void prune_checkpoints(const std::string& dir, int64_t keep, int64_t step) {
  ckpt::prune(dir, keep, "global_step" + std::to_string(step));
}

void check_room(const Experiment& ex, comm::Communicator& comm, const std::vector<ExportOnDisk>& exports) {
  const std::vector<std::string> no_room =
      resource_refusals(ex, comm.local_size(), comm.local_rank(), comm.rank() == 0 ? exports : std::vector<ExportOnDisk>{});
  double failed = no_room.empty() ? 0 : comm.rank() + 1;
  if (comm.size() > 1) comm.all_reduce_max_f64(&failed, 1);
  if (!no_room.empty()) {
    std::string what = "no room for this run: " + no_room[0];
    for (size_t i = 1; i < no_room.size(); ++i) what += " | " + no_room[i];
    throw Error(what);
  }
  if (failed > 0)
    throw Error("no room for this run on rank " + std::to_string(static_cast<int>(failed) - 1) +
                "'s host (its error is on its output)");
}

namespace {
// Rank 0 takes the lock `take` makes; every rank learns whether it could
// (one all-reduce) and throws if not.
std::unique_ptr<ckpt::DirLock> hold(const std::string& dir, const std::string& key, const std::string& what,
                                    comm::Communicator& comm,
                                    const std::function<std::unique_ptr<ckpt::DirLock>()>& take) {
  std::unique_ptr<ckpt::DirLock> lock;
  std::string error;
  if (comm.rank() == 0) {
    try {
      lock = take();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  double failed = error.empty() ? 0 : 1;
  if (comm.size() > 1) comm.all_reduce_max_f64(&failed, 1);
  if (!error.empty()) throw IoError(key + ": " + error);
  if (failed > 0)
    throw IoError(key + ": rank 0 could not take the " + what + " " + dir + " (its error is on its output)");
  return lock;
}
}  // namespace

std::unique_ptr<ckpt::DirLock> hold_checkpoint_dir(const RunConfig& run, comm::Communicator& comm) {
  const std::string& dir = run.checkpoint_dir;
  check_checkpoint_path_room(dir);
  std::unique_ptr<ckpt::DirLock> lock =
      hold(dir, "run.checkpoint_dir", "checkpoint folder", comm, [&] {
        auto own = std::make_unique<ckpt::DirLock>(dir, "checkpoint folder", "", ckpt::LockUse::kRun);
        // An export into this folder (another run's --save-pretrained,
        // zinc-export) locks it from beside it (lock_output_folder): that
        // lock is held too, so that neither is refused only at its end,
        // after training. Where the parent takes no file (the root, a
        // folder this user cannot write) no export can replace the folder.
        namespace fs = std::filesystem;
        std::error_code ec;
        const fs::path p = fs::canonical(dir, ec);
        if (!ec && p.has_parent_path() && p != p.root_path() && ::access(p.parent_path().c_str(), W_OK) == 0)
          own->also_hold(lock_output_folder(dir, "run.checkpoint_dir", "checkpoint folder", ckpt::LockUse::kRun));
        return own;
      });
  if (comm.size() == 1) return lock;
  // Rank 0's lock holds its pid and host: every rank must read it there.
  auto holder = [&] {
    std::string who;
    std::getline(std::ifstream(dir + "/.zinc.lock"), who);
    return who;
  };
  const std::string at_root = broadcast_text(comm, comm.rank() == 0 ? holder() : std::string(), 0);
  double other = comm.rank() != 0 && holder() != at_root ? comm.size() - comm.rank() : 0;  // the lowest
  comm.all_reduce_max_f64(&other, 1);
  if (other > 0) {
    const int r = comm.size() - static_cast<int>(other);
    throw IoError("run.checkpoint_dir " + dir + " is another folder on rank " + std::to_string(r) +
                  " than on rank 0 (" + (comm.rank() == r ? "here" : "there") + " it holds no lock of rank 0's, " +
                  at_root + "): a relative path is taken from each rank's working directory, and every rank writes "
                  "its part of each checkpoint into the one folder: give a path that names the same folder on every "
                  "rank (on a file system their hosts share)");
  }
  return lock;
}

void agree_on_inputs(const Experiment& ex, comm::Communicator& comm) {
  if (comm.size() == 1) return;
  nlohmann::json mine = nlohmann::json::object();
  const DataConfig& d = ex.experiment.data;
  if (d.type != DataType::kSynthetic) mine["data.path"] = data_fingerprint(d);
  if (!ex.experiment.model.from_pretrained.empty() && ex.hf)
    mine["model.from_pretrained"] = hf_weights_fingerprint(ex.experiment.model.from_pretrained);
  // A LoRA adapter folder read at the start (model.adapter): ranks that
  // started from different adapters trained on without a word.
  const std::string& adapter = ex.experiment.model.adapter;
  if (!adapter.empty()) {
    std::vector<std::pair<std::string, std::string>> files;
    for (const char* f : {kAdapterConfigFile, kAdapterWeightsFile}) {
      const std::filesystem::path p = std::filesystem::path(adapter) / f;
      std::error_code ec;
      if (std::filesystem::is_regular_file(p, ec)) files.emplace_back(f, p.string());
    }
    mine["model.adapter"] = ckpt::sampled_files_digest(files, "the adapter");
  }
  const std::optional<RankDifference> diff = rank_difference(comm, mine);
  if (!diff) return;
  const bool data = diff->path == "data.path", is_adapter = diff->path == "model.adapter";
  throw Error(diff->path + ": the ranks read different files under one path: rank " + std::to_string(diff->other) +
              "'s " + (data ? d.path : is_adapter ? adapter : ex.experiment.model.from_pretrained) +
              " differs from rank 0's (a sampled digest of " +
              (data ? "the data files" : is_adapter ? "the adapter's files" : "the safetensors files") +
              "); a relative path is taken from each rank's working directory: give every rank the same files "
              "(nothing was trained)");
}

std::unique_ptr<ckpt::DirLock> hold_output_folder(const std::string& dir, const std::string& key,
                                                  const std::vector<std::string>& inputs, comm::Communicator& comm) {
  return hold(dir, key, "export folder", comm, [&] {
    check_output_folder(dir, key, inputs);
    check_model_kind(dir, key, key == "--save-adapter");
    return lock_output_folder(dir, key, "export folder", ckpt::LockUse::kRun);
  });
}

std::vector<std::string> run_inputs(const Experiment& ex, const std::string& config_path) {
  std::vector<std::string> in = {config_path, ex.experiment.model.from_pretrained, ex.experiment.model.adapter,
                                 ex.experiment.run.checkpoint_dir};
  const DataConfig& d = ex.experiment.data;
  for (const std::string* p : {&d.path, &d.mask_path, &d.documents_path}) in.push_back(*p);
  // A model or adapter folder of symbolic links: the files they lead to
  // are read too (an export into their folder replaced the model).
  for (const std::string* folder : {&ex.experiment.model.from_pretrained, &ex.experiment.model.adapter})
    for (std::string& target : link_targets(*folder)) in.push_back(std::move(target));
  // The NVMe offload folders, where the run keeps its scratch files: an
  // export folder there would hold the run's own folder when it ends.
  for (const OffloadConfig* o : {&ex.config.zero.offload_optimizer, &ex.config.zero.offload_param})
    if (o->device == OffloadDevice::kNvme) in.push_back(o->nvme_path);
  return in;
}

}  // namespace zinc::tools

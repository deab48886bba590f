// zinc tools: the run loop of a config-only training run, written once for
// zinc-train (tools/zinc_train.cpp) and the Python module's zinc.train
// (python/src/module.cpp, TrainRun).
//
// What it owns: the step cadence (run.steps, from a resume's step on), the
// step events every steps_per_print steps and at the last step, the
// held-out loss every eval_interval steps and at the last step, the
// checkpoints every checkpoint_interval steps and at the last step (with
// run.keep_last's pruning), a stop requested at a step boundary (saved
// before it ends the run), the monitors' curves (csv_monitor, tensorboard:
// tools/monitor.h), and the summary's figures
// that both report. The events are tools/train_events.h's, the objects
// zinc-train --json prints one per line and zinc.train yields as dicts.
//
// What it leaves to its callers (hooks): where the events go (zinc-train
// prints rank 0's, as JSON lines or as progress lines; zinc.train returns
// every rank's) and how a stop is requested (zinc-train: its signal thread's
// flag; zinc.train: none, a Ctrl-C is raised as KeyboardInterrupt between
// the steps by the module). Setting up the run (the room check, the
// checkpoint folder's lock, the engine) is the callers' too.
//
// Every rank makes the same calls in the same order (the evaluation, the
// saves and the stop's agreement are collectives). One thread; no Python.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "data/data.h"
#include "engine/engine.h"
#include "tools/experiment.h"

namespace zinc::tools {

class Monitors;

// The client state a checkpoint resumes from, added to `client` (zinc-train's,
// zinc.train's and Engine.save_checkpoint's alike: each resumes the
// others'): the data position and step, and where the model is a Hugging
// Face one its config.json, source folder, LoRA settings and the frozen
// base's digest (base_fingerprint, asked only with LoRA).
void add_resume_state(nlohmann::json& client, const Experiment& ex, const DataLoader& loader, int64_t step,
                      const std::function<const std::string&()>& base_fingerprint);
// The data's sampled digest (ckpt::sampled_files_digest) over the files
// the source reads (data, mask, documents); "" for the synthetic source,
// which its config states.
std::string data_fingerprint(const DataConfig& data);
// Before a resume reads anything (zinc-train --resume, Python's
// load_checkpoint): dir/tag's LoRA adapters against this run's (rank,
// targets and scale, which no block records; the frozen base's digest,
// from base_fingerprint, where the checkpoint records one), and its data
// position against `loader`'s micro-batch layout. Throws naming the
// checkpoint and both sides. Warns where the data's length or the model's
// settings (config.json's) differ from the saved run's. position_required:
// a checkpoint without client_state.samples is refused (zinc-train's
// resume; Engine.load_checkpoint keeps the loader where it is).
void check_resume(const Experiment& ex, const std::string& dir, const std::string& tag, const DataLoader& loader,
                  const std::function<const std::string&()>& base_fingerprint, bool position_required = true);

class RunLoop {
 public:
  struct Hooks {
    // Each event as the loop makes it, before the next step of the loop's
    // work begins (a checkpoint event once its save is complete). Every rank.
    std::function<void(const nlohmann::json&)> on_event;
    // Asked at every step boundary: nonzero stops the run there (the value,
    // a signal number for zinc-train, is stopped_by()). Under several ranks
    // the largest value over the ranks is taken, so every rank stops at the
    // same boundary. Not set: the loop never stops early (and no
    // collective is made for it).
    std::function<int()> stop_requested;
  };

  // engine, loader and ex outlive the loop; comm: the run's communicator,
  // null for a single rank.
  RunLoop(Engine& engine, DataLoader& loader, const Experiment& ex, comm::Communicator* comm, Hooks hooks);
  ~RunLoop();
  RunLoop(const RunLoop&) = delete;
  RunLoop& operator=(const RunLoop&) = delete;

  // Before start(): continues from dir's latest checkpoint (the engine's
  // state and the data loader's position); the resume event.
  nlohmann::json resume(const std::string& dir);
  // The config event (and the auto event when the config has "auto"
  // values); the run's clock starts here.
  std::vector<nlohmann::json> start();
  // Trains the next step: its events (step, eval, checkpoint, as the
  // cadences say), or nullopt once the run is over (its last step done, or
  // stopped). A stop requested at this step's boundary saves (once) and ends
  // the run: stopped_by() says so.
  std::optional<std::vector<nlohmann::json>> step();
  // {"event":"summary","steps","final_loss","tokens_per_s","elapsed_s",
  //  "world_size","zero_stage","skipped_steps","loss_floor"} (+
  // "final_eval_loss" with held-out data), elapsed_s up to this call.
  // zinc-train adds the process-wide figures (peak RSS, communication
  // shares, NVMe traffic) to it.
  nlohmann::json summary() const;

  int64_t first_step() const { return first_step_; }  // 1, or a resume's step + 1
  int64_t steps() const { return steps_; }            // run.steps
  int64_t done_steps() const { return done_; }        // the last step trained (first_step() - 1 before one)
  int stopped_by() const { return stopped_by_; }      // the stop_requested value that ended the run; 0: none
  double loss() const { return loss_; }               // the last step's global-batch loss
  double eval_loss() const { return eval_loss_; }     // the last held-out loss (NaN before one)
  int64_t eval_step() const { return eval_step_; }     // the step it was taken at (0 before one)
  int64_t tokens_per_step() const { return tokens_per_step_; }

 private:
  void emit(std::vector<nlohmann::json>& evs, nlohmann::json ev);
  void save(int64_t step, std::vector<nlohmann::json>& evs);
  // hf_weights_fingerprint of model.from_pretrained, where LoRA leaves it
  // frozen (and out of the checkpoints); computed once. Empty otherwise.
  const std::string& base_fingerprint();
  std::optional<std::string> base_fingerprint_;

  using Clock = std::chrono::steady_clock;
  Engine& engine_;
  DataLoader& loader_;
  const Experiment& ex_;
  comm::Communicator* comm_;
  Hooks hooks_;
  std::unique_ptr<Monitors> monitor_;
  int world_ = 1, rank_ = 0;
  int64_t steps_ = 0, tokens_per_step_ = 0;
  int64_t first_step_ = 1, done_ = 0, last_saved_ = 0, step_last_ = 0;
  int stopped_by_ = 0;
  double loss_, eval_loss_;
  int64_t eval_step_ = 0;
  double comm_wait_last_ = 0;  // engine.comm_wait_seconds() at the last step event
  // Note [training time]: seconds in evaluations and checkpoint saves, how
  // many, and their sum at the last step event.
  double eval_s_ = 0, save_s_ = 0, aside_last_ = 0;
  int64_t evals_ = 0, saves_ = 0;
  double eta_seconds(int64_t step, double elapsed) const;
  Clock::time_point t0_, t_last_;
};

}  // namespace zinc::tools

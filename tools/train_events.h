// zinc tools: the JSON events of a training run, one function per event, as
// zinc-train --json prints them (one object per line) and the Python module's
// zinc.train yields them (as dicts). Building them in one place keeps the two
// identical; tools/run_loop.h makes them, for both. Pure functions of their
// arguments; any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "tools/experiment.h"
#include "tools/resources.h"

namespace zinc::tools {

// {"event":"config","world_size":W,"config":<the resolved document>}: every
// key of the run with the value it takes.
// One --json line: an event as JSON text, with a byte that is not UTF-8 (a
// path named on the command line in another encoding) written as U+FFFD
// rather than ending the run (nlohmann's strict dump threw after a resume
// had loaded).
inline std::string json_line(const nlohmann::json& ev) {
  return ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::json config_event(const Experiment& ex, int world_size);
// {"event":"auto","values":[{"path","value","source"}...]}: the "auto" values
// resolved; nullopt when the document has none.
std::optional<nlohmann::json> auto_event(const Experiment& ex);
// {"event":"resume","dir":DIR,"step":N}
nlohmann::json resume_event(const std::string& dir, int64_t step);
// {"event":"step","step","loss","lr","grad_norm","tokens_per_s","elapsed_s"}
// (+ "loss_scale" and "skipped_steps" with fp16, + "comm_wait_share" when
// given): after optimizer step `step`, whose global batch had mean loss
// `loss`. tokens_per_s, elapsed_s and comm_wait_share (the share of the time
// since the last step event this rank sat blocked on communication; runs of
// several ranks) are the caller's.
nlohmann::json step_event(const Engine& engine, int64_t step, double loss, double tokens_per_s, double elapsed_s,
                          std::optional<double> comm_wait_share = std::nullopt);
// {"event":"eval","step":N,"loss":L}: held-out loss after step N.
nlohmann::json eval_event(int64_t step, double loss);
// {"event":"checkpoint","step":N,"path":P,"seconds":S}
nlohmann::json checkpoint_event(int64_t step, const std::string& path, double seconds);

}  // namespace zinc::tools

namespace zinc::tools {

// run.keep_last after the save of global_step<step> (rank 0): ckpt::prune,
// which never removes the newest save, the tag `latest` names, or a tag of a
// higher step.
void prune_checkpoints(const std::string& dir, int64_t keep, int64_t step);

// Room for the run (tools/resources.h) on every rank's host: throws
// zinc::Error "no room for this run: ..." on every rank if any rank's host
// lacks it (one all-reduce, so that no rank goes on to wait for the others).
// exports: what rank 0 writes at the end (--save-weights, ...).
void check_room(const Experiment& ex, comm::Communicator& comm, const std::vector<ExportOnDisk>& exports = {});

// The run's hold on run.checkpoint_dir from its start: created, proved
// writable and locked by rank 0 (ckpt::DirLock) for as long as the result
// lives, so an unwritable folder fails before any training and a second run
// on the folder is refused naming the holder's pid. Every rank learns the
// outcome (one all-reduce) and throws if rank 0 could not take it, and
// every other rank finds rank 0's lock in its own view of the folder, or all
// throw: the ranks write one checkpoint into it (a relative path from two
// working directories, or a folder the hosts do not share, failed at the
// first save).
std::unique_ptr<ckpt::DirLock> hold_checkpoint_dir(const RunConfig& run, comm::Communicator& comm);
// Every rank reads the same files under the config's paths (a relative
// path is taken from each rank's own working directory): the training data
// (data_fingerprint) and model.from_pretrained's weights
// (hf_weights_fingerprint) are compared over all ranks; throws zinc::Error
// on every rank naming the key and the lowest rank that differs.
void agree_on_inputs(const Experiment& ex, comm::Communicator& comm);
// The same hold on the folder an export will replace at the run's end
// (--save-pretrained's): checked as tools/output_folder.h checks it (not,
// and not holding, any of `inputs`, the folders and files the run reads) and
// locked, so that a refusal comes before training, not after it. Errors
// begin with `key`.
std::unique_ptr<ckpt::DirLock> hold_output_folder(const std::string& dir, const std::string& key,
                                                  const std::vector<std::string>& inputs, comm::Communicator& comm);
// What a run reads, for hold_output_folder: the config file, the
// pretrained model's folder, the data files, the checkpoint folder.
std::vector<std::string> run_inputs(const Experiment& ex, const std::string& config_path);

}  // namespace zinc::tools

// zinc tools: a folder of the user's replaced as one unit (Note [export
// folders] in output_folder.cpp): a Hugging Face export is written into a
// staging folder beside the destination and swapped in with one rename, so
// that a reader (transformers, zinc) finds the old folder or the new one,
// never a mix, whatever moment a kill lands.
// Threading: one thread; one OutputFolder per destination in a process.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/checkpoint.h"

namespace zinc::tools {

// The checks an output folder must pass before anything is written (and
// before a run's training, so that a refusal comes at its start): `dir` is
// not empty and holds no NUL byte; it is not a file; it is not, and does not
// hold, any of `inputs` (folders and files the run reads, compared by
// identity: core/files.h); it is not the current folder nor one holding it;
// it is not a mount point (a mount point cannot be renamed); and it holds no
// subfolder (a replaced folder keeps the user's files by hard links, which
// folders cannot have). Throws Error starting with `what` ("--save-pretrained
// DIR", ...) and saying what to do instead.
void check_output_folder(const std::string& dir, const std::string& what, const std::vector<std::string>& inputs);

// An export keeps the user's files in its folder, but not the other kind
// of model folder's: a full model's export into a folder holding a PEFT
// adapter (adapter_config.json), or an adapter's into one holding a full
// model (config.json and its weights), leaves a folder that transformers
// loads as the adapter over its base model, ignoring the full model.
// Refused (Error naming the file) for `adapter` false and true respectively.
void check_model_kind(const std::string& dir, const std::string& what, bool adapter);

// The pretrained model folder a checkpoint was trained from, as its
// client_state.hf_source names it, for zinc-export. `dir`: the folder
// (absolute, as zinc-train now writes it), or "" when it names none, or
// names it by a relative path (an earlier zinc wrote the config's path as
// given, relative to a working folder zinc-export cannot know: resolved
// here, it read another folder's tokenizer). `relative` is then that path,
// and `protect` where it might be (from the current folder and from the
// checkpoint folder's parent), with the files the folder's symbolic links
// lead to: no export may write there.
struct CheckpointSource {
  std::string dir, relative;
  std::vector<std::string> protect;
};
CheckpointSource checkpoint_source(const std::string& hf_source, const std::string& checkpoint_dir);

// Why an output at `path` may not lie inside the folder `in` that a run
// reads, or "" where it may: inside a model or adapter folder (config.json
// or adapter_config.json in it) an export would replace or mix with the
// model's files; inside a checkpoint tag (a folder with metadata.json, or
// global_step<N>, a dot folder or `latest` of a checkpoint folder) the next
// save of the tag swaps it out and pruning removes it. Elsewhere in the
// folder (an NVMe folder, a checkpoint folder beside its tags) it may.
std::string protected_by(const std::string& path, const std::string& in);
// The tag of the checkpoint folder `checkpoint_dir` that holds `path`
// (global_step<N>, a dot folder a save makes or leaves, `latest`), or "":
// what a save of that tag swaps out and pruning removes.
std::string tag_holding(const std::string& path, const std::string& checkpoint_dir);
// The checkpoint tag (a folder holding metadata.json, in a folder holding
// `latest`: any zinc checkpoint's, not only the one a run reads) above
// `path`, or "": another run's next save of that tag swaps it out, and its
// pruning removes it.
std::string enclosing_checkpoint_tag(const std::string& path);

// The lock that guards `path` (an export folder, or the file set a
// safetensors export writes at PATH) against a second writer: a file
// beside it (PARENT/.NAME.zinc.lock), since the folder itself is replaced.
// The parent is created. Throws IoError naming the holder's pid when
// another process holds it; `kind` names what is locked in that message.
// `use`: kRun where a run holds it for its whole length (ckpt::DirLock).
std::unique_ptr<ckpt::DirLock> lock_output_folder(const std::string& path, const std::string& what,
                                                  const std::string& kind = "export folder",
                                                  ckpt::LockUse use = ckpt::LockUse::kWrite);

class OutputFolder {
 public:
  // Checks `dir` (check_output_folder), takes its lock, finishes or removes
  // what an earlier writer killed part-way left beside it, and creates the
  // empty staging folder PARENT/.NAME.zinc-staging.
  OutputFolder(std::string dir, std::string what, const std::vector<std::string>& inputs);
  // Removes the staging folder unless committed: an export that fails
  // leaves the old folder as it was.
  ~OutputFolder();
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;

  // Where the new files go (each fsynced by its writer).
  const std::string& staging() const { return staging_; }

  // Keeps the user's other files: each file of the old folder that the new
  // one does not have and `replaced` does not claim (stale weights of
  // another layout, say) is hard-linked into the staging folder. Then
  // fsyncs the staging folder, swaps it in (renameat2 RENAME_EXCHANGE, or a
  // plain rename when the destination does not exist yet), fsyncs the
  // parent, moves over what another process made in the old folder since
  // the links, and removes the old folder.
  void commit(const std::function<bool(const std::string& name)>& replaced);

 private:
  // Note [files made during an export] in output_folder.cpp.
  void keep_late_files(const std::string& old_dir, const std::string& dest,
                       const std::function<bool(const std::string& name)>& own);

  std::string dir_, what_, parent_, name_, staging_, old_;
  std::unique_ptr<ckpt::DirLock> lock_;
  bool committed_ = false;
};

// zinc-export's stop on a signal (SIGINT, SIGTERM, SIGHUP): its handler
// calls stop_writers(signal), and every SafetensorsWriter's next append()
// throws, naming the signal, so the export unwinds, its temporaries and
// staging folder are removed, and what --out held before stays as it was.
// zinc-train does not call it: a signal there lets the export under way
// finish (its exports are the run's last copy of the weights).
void stop_writers(int signal) noexcept;
int writers_stopped_by();  // the signal, or 0
std::string signal_text(int signal);  // "SIGTERM"; "signal 40" for one without a name

// Test hook: ZINC_EXPORT_FAULT=PHASE kills this process (SIGKILL) at PHASE
// of an OutputFolder's commit: "staged" (the new files written, nothing
// linked), "linked" (the user's files linked, before the swap), "swapped"
// (the new folder in place, the old one not yet removed). Also used by the
// writers: "shard" (hf_export.cpp after the first weights file is written,
// peft_adapter.cpp after adapter_model.safetensors is), "append" (a
// SafetensorsWriter's first data). PHASE:stop stops the process there
// (SIGSTOP) and PHASE:term sends it SIGTERM and waits until the signal
// thread has stopped the writers, instead.
void export_fault_point(const char* phase);

}  // namespace zinc::tools

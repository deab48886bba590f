// zinc tools: is there room for the run? --check and the start of every
// zinc-train run compare --estimate's figures with what this machine grants
// before any work, instead of letting the OOM killer or a full disk end the
// run hours in: RAM against what the process may still take (the cgroup's
// memory.max less its usage, where a cgroup limits it, and MemAvailable),
// each NVMe path's files and one checkpoint against the free space of their
// file systems. Ranks on one host share both, so each need is counted once
// per local rank. --ignore-resources skips the check for those who know
// better (memory the estimate cannot see, a disk that will be emptied).
#pragma once

#include <string>
#include <vector>

#include "tools/experiment.h"

namespace zinc::tools {

// What the machine grants this process now (bytes; -1 where unknown).
struct Room {
  int64_t mem_available = -1;  // /proc/meminfo MemAvailable
  int64_t cgroup_room = -1;    // the tightest cgroup memory.max less memory.current, over the cgroup's ancestors
  std::string cgroup_where;    // the cgroup file of that limit
  // RLIMIT_AS (ulimit -v, a batch scheduler's limit) less the address
  // space in use (VmSize): past it an allocation fails whatever RAM is free.
  int64_t address_room = -1;
  std::string address_where;
  int64_t ram() const;        // the smallest known figure, -1 if none
  std::string where() const;  // what ram() is: "cgroup ...", "RLIMIT_AS ...", "MemAvailable ..."
};
Room memory_room();
// Free bytes for an unprivileged writer on the file system of `path` (its
// nearest existing ancestor); -1 if none can be found.
int64_t free_disk_bytes(const std::string& path);

// One line per need that does not fit, naming the need, the limit and the
// JSON path or file involved; empty when everything fits. local_ranks: the
// ranks of this run on this host; local_rank: this one's index among them
// (on the GPU path it asks its own GPU, local_rank % GPUs, for its memory:
// asking GPU 0 from every rank left a CUDA context of each rank there).
// An export the run writes at its end (--save-weights, --save-pretrained,
// --save-adapter): its flag, its file or folder, and its size. Its new
// files are written before the earlier export's go, so the whole size must
// fit beside them.
struct ExportOnDisk {
  std::string flag, path;
  int64_t bytes = 0;
};
// exports: those this host's rank writes (rank 0's), counted with the
// checkpoints and NVMe files of their file system.
std::vector<std::string> resource_refusals(const Experiment& ex, int local_ranks, int local_rank = 0,
                                           const std::vector<ExportOnDisk>& exports = {});

// A batch of B x T tokens (the Python API's, whose size the config does not
// bound): where the activations `model` keeps for it (Model::activation_
// memory, in `compute`) grow past what the machine grants the process now,
// beyond those of the largest batch it has run (held_B x held_T, whose
// buffers it holds; 0 x 0: none), the line that says so; empty where it
// fits or the model cannot tell. A batch 10^6 rows long was not refused,
// and the OOM killer ended the interpreter.
std::string batch_room_refusal(const Model& model, DType compute, int64_t B, int64_t T, int64_t held_B,
                               int64_t held_T);

}  // namespace zinc::tools

// zinc engine: how much RAM and disk one rank will need, without building
// anything (zinc-train --estimate).
//
// The estimate walks the engine's own plan: the model's blocks through
// BlockLayout and Partition, what the ZeRO stage keeps of each (StagePlan),
// the optimizer state's device (and, on NVMe, the swapper's sub-groups and
// buffers, OptimizerSwapper::plan), the ZeRO-3 coordinator's persistent
// blocks and parameter file, the gradient reducer's buffers, and the model's
// own activations and kernel scratch (Model::activation_memory). Its model
// state is what Engine::model_state_peak_bytes() will report after training
// (tests check the two against each other); where that peak depends on
// timing (stage 2 buckets, ZeRO-3 gathers with a small reuse distance) the
// estimate is the bound the engine guarantees. What it cannot know is the
// process itself (code, libraries, the data source, MPI's buffers): the
// caller measures that and adds it (process_bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"

namespace zinc {

struct MemoryPart {
  std::string name;  // e.g. "gradients (fp32, full)"
  int64_t bytes = 0;
  std::string note;  // how it was sized, e.g. "12 B x 28.5M elements of the rank's shards"
  bool model_state = true;  // counted by the engine's StateMemory (false: activations, scratch)
};

struct MemoryEstimate {
  int stage = 0;
  int world = 1;  // the ranks ZeRO partitions over (a stage's replicas with pipeline stages)
  // With pipeline stages: the stage this estimate is for (the one that
  // needs the most RAM), and their number.
  int pipeline_stage = -1;
  int pipeline_stages = 1;
  int tensor_parts = 1;  // tensor_parallel.autotp_size: the estimate is one part's
  // RAM while the engine sets up (initial weights are built, and with
  // parameters on NVMe every shard is in RAM once before it is written).
  std::vector<MemoryPart> setup;
  // RAM at the peak of a training step: model states, activations, kernel
  // scratch.
  std::vector<MemoryPart> training;
  // This rank's files on NVMe.
  std::vector<MemoryPart> disk;
  // GPU memory ("device": "cuda", Note [the GPU path]): the compute
  // parameters and gradient accumulators of every block, GPU-resident
  // optimizer states, and the model's activations and scratch (then not in
  // training). Sized from the same plan; cuBLAS's workspaces and the CUDA
  // context come on top.
  std::vector<MemoryPart> gpu;
  // The model could not say what its activations take (training lacks them).
  bool activations_unknown = false;
  // The process before any of the above (measured by the caller; 0 if not).
  int64_t process_bytes = 0;

  static int64_t sum(const std::vector<MemoryPart>& parts);
  // The model state parts of training (what StateMemory counts), and the
  // larger of that and setup: what Engine::model_state_peak_bytes() reports.
  int64_t training_state_bytes() const;
  int64_t model_state_bytes() const;
  int64_t ram_bytes() const;
  int64_t disk_bytes() const { return sum(disk); }
  int64_t gpu_bytes() const { return sum(gpu); }
};

// One rank's needs for `model` under `config` (its world size, stage,
// offload, micro-batch) with sequences of seq_len tokens. Ranks differ by
// less than one shard's alignment, so rank 0 stands for all; with pipeline
// stages, a rank of the stage that needs the most RAM.
MemoryEstimate estimate_memory(const Model& model, const Config& config, int64_t seq_len);

}  // namespace zinc

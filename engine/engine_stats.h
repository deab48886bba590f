// zinc engine: the figures the engine reports about itself (Engine::timings,
// Engine::param_gather_stats), in a header of their own so that the parts
// that count them need not include the public engine.h.
#pragma once

#include <cstdint>

namespace zinc {

// Time spent per phase since the engine started (wall_clock_breakdown).
struct StepTimings {
  double forward_s = 0, backward_s = 0, step_s = 0;
  // The GPU path's host update run behind the next forward (Note [the
  // update behind the forward] in engine/gpu_offload.cpp): its seconds on
  // its own thread, and the seconds forward, backward and the other calls
  // waited for it (inside forward_s, backward_s and the rest). An update
  // counts once the engine has settled it (the next backward, a checkpoint,
  // evaluate, ...), so a window of steps holds the updates of the steps
  // before each. 0 elsewhere.
  double update_behind_s = 0, update_wait_s = 0;
};

// ZeRO-3's parameter gathers since the engine started (all zero below stage
// 3 or with one rank). Sizes in elements.
struct ParamGatherStats {
  int64_t live_numel = 0;       // elements of the blocks gathered or gathering now
  int64_t peak_live_numel = 0;  // ... at most
  int64_t gathers = 0;          // all-gathers of a block submitted
  int64_t gathered_numel = 0;   // ... their elements (padded), all together
  int64_t prefetched = 0;       // ... of which by a prefetch along the trace, ahead of the acquire
  int64_t waited = 0;           // acquires that found their block's gather still running
  int64_t trace_length = 0;     // acquires per training pass in the recorded order (0: none yet)
  int64_t departures = 0;       // training passes that left the recorded order
};

}  // namespace zinc

// DeviceMirror::make without CUDA (it refuses), and GpuPlan::make: what the
// GPU keeps at each stage (device_mirror.h). The CUDA mirror is
// device_mirror_cuda.cpp; without a GPU, kernel emulation (tests/cuda_emu)
// runs it on the CPU.
#include <vector>

#include "core/error.h"
#include "engine/device_mirror.h"
#include "engine/shard.h"

namespace zinc {

GpuPlan GpuPlan::make(const Config& c, int world) {
  const ZeroConfig& z = c.zero;
  const bool states_on_gpu = z.offload_optimizer.device == OffloadDevice::kNone;
  const bool params_sharded = StagePlan::make(z.stage, world, z.offload_param.device != OffloadDevice::kNone).params_sharded;
  GpuPlan g;
  // The GPU keeps what the host keeps (Note [ZeRO stages] in shard.h): at
  // stage 3 a block's parameters only while gathered, from stage 2 the
  // gradients only until reduced or copied out (GPU-resident states on one
  // rank read them in place: they stay).
  g.mirror.transient_params = params_sharded;
  g.mirror.transient_grads = z.stage >= 2 && !(states_on_gpu && world == 1);
  g.host_grads = !(states_on_gpu && world == 1);
  g.device_gathers = params_sharded && world > 1 && z.offload_param.device != OffloadDevice::kNvme;
  g.upload_gathers = params_sharded && world == 1 && z.offload_param.device == OffloadDevice::kCpu;
  return g;
}

#if !defined(ZINC_WITH_CUDA)
std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute,
                                                 const MirrorOptions& options) {
  throw Error("device \"cuda\": zinc was built without CUDA");
}
#endif

}  // namespace zinc

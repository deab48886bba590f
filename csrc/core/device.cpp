#include "core/device.h"

#include <cstdlib>
#include <filesystem>

#include "core/error.h"

#if defined(ZINC_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace zinc {

std::string CudaStatus::summary() const {
  if (!built) {
#if defined(ZINC_CUDA_DEFERRED)
    return "CUDA: no GPU found (this first build left the CUDA kernels out; the full build, scripts/setup.sh, "
           "adds them)";
#else
    return nvidia_driver_present() ? "CUDA: not built (ZINC_CUDA off or no nvcc at build time)"
                                   : "CUDA: not built (ZINC_CUDA off or no nvcc at build time); no GPU found";
#endif
  }
  if (devices == 0 && none_here) return "CUDA: built, no GPU found";
  if (devices == 0) return "CUDA: built, no usable GPU (" + why + ")";
  return "CUDA: " + std::to_string(devices) + " GPU(s)";
}

bool nvidia_driver_present() {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::exists("/proc/driver/nvidia/version", ec) || fs::exists("/dev/nvidiactl", ec) ||
         fs::exists("/dev/nvidia0", ec);
}

namespace {
CudaStatus probe() {
  CudaStatus s;
#if defined(ZINC_WITH_CUDA)
  s.built = true;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // Without a driver the runtime answers "CUDA driver version is
    // insufficient" (or "no CUDA-capable device"), which reads like a
    // version problem: where no NVIDIA driver or device node exists, say
    // plainly that there is no GPU.
    s.none_here = (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice) && !nvidia_driver_present();
    s.why = s.none_here ? "no NVIDIA GPU or driver on this machine" : cudaGetErrorString(e);
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    n = 0;
  } else if (n == 0) {
    s.why = "the CUDA runtime reports 0 devices";
  }
  s.devices = n;
#else
  s.why = "zinc was built without CUDA";
#endif
  return s;
}
}  // namespace

int use_cuda_device(int local_rank) {
  const CudaStatus& st = cuda_status();
  if (st.devices == 0) throw Error("device \"cuda\": no GPU is visible (" + st.why + ")");
#if defined(ZINC_WITH_CUDA)
  const int dev = local_rank % st.devices;
  const cudaError_t e = cudaSetDevice(dev);
  if (e != cudaSuccess)
    throw Error("cudaSetDevice(" + std::to_string(dev) + "): " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  return dev;
#else
  (void)local_rank;
  return 0;
#endif
}

std::pair<int64_t, int64_t> cuda_memory(int local_rank) {
#if defined(ZINC_WITH_CUDA)
  if (cuda_status().devices == 0) return {-1, -1};
  int was = 0;
  if (cudaGetDevice(&was) != cudaSuccess) was = -1;
  size_t free_b = 0, total_b = 0;
  const bool ok = cudaSetDevice(local_rank % cuda_status().devices) == cudaSuccess &&
                  cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
  if (was >= 0) (void)cudaSetDevice(was);
  (void)cudaGetLastError();
  if (!ok) return {-1, -1};
  return {static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
#else
  (void)local_rank;
  return {-1, -1};
#endif
}

const CudaStatus& cuda_status() {
  static const CudaStatus s = probe();
  return s;
}

}  // namespace zinc

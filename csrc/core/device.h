// zinc core: which devices this process can compute on.
//
// cuda_status() answers whether zinc was built with CUDA and how many GPUs
// the CUDA runtime sees, with the runtime's reason when it sees none (no
// driver, no device, CUDA_VISIBLE_DEVICES empty). It never throws and is
// cheap after the first call. Without a CUDA build it says so.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace zinc {

struct CudaStatus {
  bool built = false;  // zinc was compiled with ZINC_CUDA (the kernels and NCCL exist)
  int devices = 0;     // GPUs visible to this process
  std::string why;     // when devices == 0: why (one line)
  bool none_here = false;  // devices == 0 because the machine has no NVIDIA driver or device at all
  // "CUDA: 1 GPU(s)" / "CUDA: built, no GPU found" / "CUDA: built, no usable
  // GPU (the runtime's reason)" / "CUDA: not built (...)"
  std::string summary() const;
};
const CudaStatus& cuda_status();
// Whether an NVIDIA driver or device node is on this machine
// (/proc/driver/nvidia/version, /dev/nvidiactl, /dev/nvidia0).
bool nvidia_driver_present();

// Makes GPU (local_rank % visible GPUs) this thread's current device
// (cudaSetDevice) and returns its index: the ranks of one machine spread
// over its GPUs. Throws zinc::Error without a CUDA build or a GPU.
int use_cuda_device(int local_rank);
// GPU (local_rank % visible GPUs)'s memory: free and total bytes (-1, -1
// without a CUDA build, a GPU, or an answer).
std::pair<int64_t, int64_t> cuda_memory(int local_rank);

}  // namespace zinc

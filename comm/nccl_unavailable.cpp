// The NCCL entry points of comm.h in a build without NCCL (compiled instead
// of nccl_communicator.cpp): make_nccl_communicator refuses with the reason,
// so that the symbol always exists and callers (make_communicator("nccl"),
// the engine, the tests) fail with one clear line instead of a link error.
#include <string>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "core/device.h"

#if defined(ZINC_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace zinc::comm {
namespace {

std::string why_unavailable() {
  if (!cuda_status().built)
    return "zinc was built without CUDA, so without NCCL (ZINC_CUDA=OFF or no nvcc at configure time)";
  return "zinc was built without NCCL (nccl.h and libnccl were not found next to the CUDA toolkit at configure time)";
}

}  // namespace

namespace detail {

CommError nccl_backend_error(int rank, const std::string& why) {
  return CommError("[rank " + std::to_string(rank) + "] nccl backend: " + why);
}

std::unique_ptr<Communicator> make_nccl_backend(std::unique_ptr<Communicator> bootstrap, int device) {
  throw nccl_backend_error(bootstrap->rank(), why_unavailable());
}

}  // namespace detail

std::string nccl_library() { throw CommError("nccl backend: zinc was built without CUDA, so without NCCL"); }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device) {
  throw detail::nccl_backend_error(bootstrap.rank(), why_unavailable());
}

void wait_cuda_event(Communicator& comm, void* cuda_event) {
  if (!cuda_event) return;
#if defined(ZINC_WITH_CUDA)
  const cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(cuda_event));
  if (e == cudaSuccess) return;
  throw detail::comm_error(
      comm.rank(), "wait_cuda_event",
      std::string("cudaEventSynchronize failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
#else
  throw detail::comm_error(comm.rank(), "wait_cuda_event", "zinc was built without CUDA: there is no CUDA event");
#endif
}

}  // namespace zinc::comm

// zinc's CUDA kernels run on the CPU, for machines without a GPU (tests only).
//
// Note [kernel emulation]
// No project machine has a GPU, so the CUDA code was only ever compiled.
// This harness compiles its source a second time as plain C++ against an
// emulated runtime and runs it on the host: the kernels against the CPU
// kernels, the engine's GPU path against the CPU path, and the NCCL backend,
// on every CI run (tests/CMakeLists.txt; the CTest names start with
// "emulated."; the test files are the real GPU tests). What it models:
// - A launch runs its blocks one after another. Each thread of a block is a
//   fiber with its own stack; a fiber runs until it reaches __syncthreads,
//   a warp operation, or its end. threadIdx, blockIdx, blockDim and gridDim
//   are those of the fiber running. Threads take turns in ascending order,
//   or descending with ZINC_EMU_ORDER=reverse (CTest runs the kernel tests
//   both ways): a race inside a block that one order hides shows in the other.
// - __syncthreads releases the block when every thread still running has
//   reached it (threads that returned count as arrived, as on sm_70+).
// - __shfl_sync / __shfl_xor_sync exchange values among the 32 lanes of a
//   warp; a lane that returned while its warp still shuffles is an error
//   (undefined behaviour on a GPU), as is any state where no thread can go on
//   (a __syncthreads some threads never reach). Both name the kernel, block
//   and thread, and the device then fails every later wait
//   (cudaErrorLaunchFailure), as after a fault on a GPU.
// - __shared__ is a function-local static: one copy, which the blocks reuse
//   in turn (the launches of all host threads are serialised), refilled with
//   NaN bytes before each block after the kernel's first (register_shared).
//   A kernel declaring more than 48 KiB of it is an error. Dynamic shared
//   memory (extern __shared__, which translate.py rewrites into a call of
//   dynamic_shared()) is the launch's size of NaN bytes before every block,
//   its end against a page that faults; more than 48 KiB needs
//   cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize)
//   first, up to sm_80's 163 KiB (an H100 allows more; the kernels must
//   also run on an A100), as the driver checks.
// - WMMA (mma.h here): a fragment holds 8 of its tile's 256 elements in each
//   lane; mma_sync gathers the warp's fragments (a warp operation) and each
//   lane computes its own 8 results in fp32. The fragments' lane layout is
//   the emulation's, not the GPU's, as CUDA leaves it unspecified; loads and
//   stores check the pointer's 32-byte alignment and ldm as CUDA requires.
// - Device memory is host memory, filled with NaN bytes when allocated,
//   each allocation between pages that fault (so are freed ones): an access
//   past an end or after the free stops the test naming kernel and thread.
//   Streams are queues whose work runs only when something waits for it
//   (Note [emulated streams] in cuda_emu.cpp), so a missing wait shows.
// - cuBLAS and NCCL are stand-in libraries (emu_cublas.cpp, emu_nccl.cpp)
//   opened by zinc's own dlopen: the GEMM by its documented definition, the
//   collectives over MPI.
// - Launch limits (1024 threads per block, grid sizes) are checked as the
//   driver does and reported through cudaGetLastError.
// What it cannot model: timing and overlap, memory coalescing, the GPU's
// memory model, cuBLAS's and NCCL's own code (and their summation orders),
// and shuffle masks (every lane of the warp takes part).
//
// The .cu files reach this header through -include; tests/cuda_emu/
// translate.py rewrites their kernel<<<grid, block, smem, stream>>>(args)
// into ::zinc_emu::launcher("kernel", kernel, grid, block, smem, stream)(args), the
// only syntax C++ lacks.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- the CUDA keywords ----------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static
#define __align__(n) alignas(n)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace zinc_emu {

// The running fiber's coordinates.
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void syncthreads();
void syncwarp();
// Every lane of the running fiber's warp deposits `bits`; returns lane
// `src`'s deposit (src is a lane of the warp).
uint64_t warp_exchange(uint64_t bits, int src);
int lane_id();

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// A kernel's __shared__ array (translate.py adds the call after each
// declaration): refilled with NaN bytes before every block; a kernel
// declaring more than 48 KiB is an error, as at a real launch.
bool register_shared(void* p, size_t bytes);

// The running launch's dynamic shared memory (see the Note).
void* dynamic_shared();
// Scratch of the running fiber's warp (mma.h), 4 KiB, reused by every warp
// operation that needs it.
float* warp_scratch();
// Stops the running kernel with `what`, naming kernel, block and thread.
[[noreturn]] void fail(const char* what);

using Body = std::function<void()>;
// Queues a launch of `body` as every thread of the grid on `stream` (see the
// Note); a grid or block beyond the limits sets cudaErrorInvalidConfiguration
// instead. `name` is for errors.
void launch(const char* name, const void* kernel, dim3 grid, dim3 block, size_t shared_bytes, void* stream,
            Body body);

template <class Kernel>
struct Launch {
  const char* name;
  Kernel* kernel;
  dim3 grid, block;
  size_t shared_bytes;
  void* stream;
  template <class... Args>
  void operator()(Args&&... args) const {
    // The arguments are copied at the launch, as a launch copies them into
    // the kernel's parameter space; every thread then gets them by value.
    Kernel* k = kernel;
    launch(name, reinterpret_cast<const void*>(k), grid, block, shared_bytes, stream,
           [k, bound = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...)] { std::apply(*k, bound); });
  }
};

template <class Kernel, class Stream = void*>
Launch<Kernel> launcher(const char* name, Kernel* kernel, dim3 grid, dim3 block, size_t shared_bytes = 0,
                        Stream stream = {}) {
  void* s = nullptr;
  if constexpr (std::is_pointer_v<Stream>) s = reinterpret_cast<void*>(stream);
  return Launch<Kernel>{name, kernel, grid, block, shared_bytes, s};
}

}  // namespace zinc_emu

#define ZINC_EMU_SHARED(name) \
  static const bool zinc_emu_shared_##name = ::zinc_emu::register_shared(&name, sizeof(name)); \
  (void)zinc_emu_shared_##name
#define threadIdx (::zinc_emu::thread_idx())
#define blockIdx (::zinc_emu::block_idx())
#define blockDim (::zinc_emu::block_dim())
#define gridDim (::zinc_emu::grid_dim())
constexpr int warpSize = 32;

// ---- device intrinsics ---------------------------------------------------------------
inline void __syncthreads() { ::zinc_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::zinc_emu::syncwarp(); }

template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  const int lane = ::zinc_emu::lane_id();
  const int base = lane / width * width;
  return ::zinc_emu::from_bits<T>(::zinc_emu::warp_exchange(::zinc_emu::to_bits(v), base + (src % width)));
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const int lane = ::zinc_emu::lane_id();
  const int base = lane / width * width;
  return ::zinc_emu::from_bits<T>(
      ::zinc_emu::warp_exchange(::zinc_emu::to_bits(v), base + ((lane - base) ^ mask) % width));
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = ::zinc_emu::lane_id();
  const int base = lane / width * width;
  const int src = lane - base + static_cast<int>(delta);
  return ::zinc_emu::from_bits<T>(::zinc_emu::warp_exchange(::zinc_emu::to_bits(v), src < width ? base + src : lane));
}

inline float __int_as_float(int i) { return ::zinc_emu::from_bits<float>(static_cast<uint32_t>(i)); }
inline float __uint_as_float(unsigned u) { return ::zinc_emu::from_bits<float>(u); }
inline int __float_as_int(float f) { return static_cast<int>(static_cast<uint32_t>(::zinc_emu::to_bits(f))); }
inline unsigned __float_as_uint(float f) { return static_cast<uint32_t>(::zinc_emu::to_bits(f)); }
// Blocks run one at a time on one host thread: plain read-modify-writes are atomic.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T __ldg(const T* p) {
  return *p;
}

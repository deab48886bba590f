// Kernel emulation on the CPU: the fiber scheduler and the runtime API (Note
// [kernel emulation] in cuda_emu.h).
#include "tests/cuda_emu/cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <iterator>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/cuda_emu/include/cuda_runtime_api.h"

// Fibers switch with a few instructions of their own rather than ucontext's
// swapcontext, which makes a system call (the signal mask) on every switch:
// a launch switches twice per thread and once more per barrier, and the
// engine tests launch tens of thousands of threads per step.
// zinc_emu_switch(save, load): pushes the callee-saved registers, stores
// the stack pointer in *save, continues on the stack `load` (System V
// x86-64). The FPU and SSE control words are not switched: all fibers run
// with the launching thread's, and kernels do not change them.
extern "C" void zinc_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl zinc_emu_switch
  .type zinc_emu_switch, @function
zinc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size zinc_emu_switch, .-zinc_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace zinc_emu {
namespace {

enum class St { kRun, kBlock, kWarp, kDone };

struct Fiber {
  void* sp = nullptr;  // its saved stack pointer while suspended
  uint3 tid{};
  St st = St::kDone;
  bool shuffle = false;  // waiting in a shuffle: needs every lane of its warp
  int phase = 0;         // which of the warp's two exchange buffers it writes next
};

constexpr size_t kStackBytes = 256 << 10;
constexpr int kMaxThreads = 1024;
// sm_80's most dynamic shared memory per block (cudaFuncSetAttribute's
// ceiling there; sm_90 allows 227 KiB), and the default without the attribute.
constexpr size_t kMaxDynamicShared = 166912;
constexpr size_t kDefaultDynamicShared = 48 << 10;

struct Grid {
  std::mutex launch;  // one launch at a time, from any host thread
  const char* name = "";
  dim3 grid, block;
  uint3 bid{};
  const Body* body = nullptr;
  std::vector<Fiber> fibers = std::vector<Fiber>(kMaxThreads);
  std::vector<std::array<std::array<uint64_t, 32>, 2>> exchange =
      std::vector<std::array<std::array<uint64_t, 32>, 2>>(kMaxThreads / 32);
  char* stacks = nullptr;  // kMaxThreads stacks, each above a guard page
  int threads = 0;
  size_t dynamic_bytes = 0;  // the launch's dynamic shared memory
  char* dynamic_end = nullptr;  // its end: a page that faults follows
  std::vector<std::array<float, 1024>> warp_scratch = std::vector<std::array<float, 1024>>(kMaxThreads / 32);
  int cur = -1;
  void* sched = nullptr;  // the scheduler's saved stack pointer
  std::exception_ptr error;
};

Grid& grid = *new Grid();  // one (launches are serialised), never destroyed (see allocations())
inline Grid& grid_state() { return grid; }

Fiber& running(const char* what) {
  Grid& g = grid_state();
  if (g.cur < 0) {
    std::fprintf(stderr, "zinc_emu: %s called outside a kernel\n", what);
    std::abort();
  }
  return g.fibers[static_cast<size_t>(g.cur)];
}

void yield(St st) {
  Grid& g = grid_state();
  Fiber& f = g.fibers[static_cast<size_t>(g.cur)];
  f.st = st;
  zinc_emu_switch(&f.sp, g.sched);
}

// The bottom of every fiber's stack (entered by zinc_emu_switch's ret):
// runs the thread, then hands back to the scheduler for good.
[[noreturn]] void fiber_main() {
  Grid& g = grid_state();
  try {
    (*g.body)();
  } catch (...) {
    if (!g.error) g.error = std::current_exception();
  }
  Fiber& f = g.fibers[static_cast<size_t>(g.cur)];
  f.st = St::kDone;
  zinc_emu_switch(&f.sp, g.sched);
  std::abort();  // a finished fiber is never resumed
}

// A fresh stack for zinc_emu_switch to start fiber_main on: from the
// 16-aligned top, a zero return address (fiber_main never returns; this
// aligns its frame as a call would), fiber_main's address for the ret and
// zeros for the six callee-saved registers.
void* fresh_stack(char* top) {
  auto* p = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t{15});
  *--p = 0;
  *--p = reinterpret_cast<uint64_t>(&fiber_main);
  for (int r = 0; r < 6; ++r) *--p = 0;
  return p;
}

std::string where(const Grid& g, int i) {
  const uint3 t = g.fibers[static_cast<size_t>(i)].tid;
  return std::string("kernel ") + g.name + ", block (" + std::to_string(g.bid.x) + "," + std::to_string(g.bid.y) + "," +
         std::to_string(g.bid.z) + "), thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," +
         std::to_string(t.z) + ")";
}

// Releases the warps whose live lanes all wait at a warp operation, else the
// block when every live thread waits at __syncthreads. False: nothing can go on.
bool release(Grid& g) {
  bool any = false;
  for (int w0 = 0; w0 < g.threads; w0 += 32) {
    const int w1 = std::min(w0 + 32, g.threads);
    int alive = 0, waiting = 0, exited = -1, shuffling = -1;
    for (int i = w0; i < w1; ++i) {
      const Fiber& f = g.fibers[static_cast<size_t>(i)];
      if (f.st == St::kDone) {
        exited = i;
        continue;
      }
      ++alive;
      if (f.st == St::kWarp) {
        ++waiting;
        if (f.shuffle) shuffling = i;
      }
    }
    if (alive == 0 || waiting != alive) continue;
    if (shuffling >= 0 && exited >= 0)
      throw zinc::Error("kernel emulation: " + where(g, shuffling) + " shuffles with lane " +
                        std::to_string(exited % 32) + " of its warp, which has returned (undefined on a GPU)");
    for (int i = w0; i < w1; ++i)
      if (g.fibers[static_cast<size_t>(i)].st == St::kWarp) g.fibers[static_cast<size_t>(i)].st = St::kRun;
    any = true;
  }
  if (any) return true;
  int alive = 0, at_barrier = 0, other = -1, barrier = -1;
  for (int i = 0; i < g.threads; ++i) {
    const St st = g.fibers[static_cast<size_t>(i)].st;
    if (st == St::kDone) continue;
    ++alive;
    if (st == St::kBlock) {
      ++at_barrier;
      barrier = i;
    } else {
      other = i;
    }
  }
  if (alive == 0) return false;
  if (at_barrier != alive)
    throw zinc::Error("kernel emulation: deadlock: " + where(g, barrier >= 0 ? barrier : other) +
                      (barrier >= 0 ? " waits at __syncthreads while " + where(g, other) + " waits at a warp operation"
                                    : " waits at a warp operation its warp never reaches"));
  for (int i = 0; i < g.threads; ++i)
    if (g.fibers[static_cast<size_t>(i)].st == St::kBlock) g.fibers[static_cast<size_t>(i)].st = St::kRun;
  return true;
}

struct SharedArray {
  void* p;
  size_t bytes;
};
std::vector<SharedArray>& shared_arrays() {
  static auto* v = new std::vector<SharedArray>();
  return *v;
}
std::map<std::string, size_t>& shared_bytes_by_kernel() {
  static auto* m = new std::map<std::string, size_t>();
  return *m;
}

void run_block(Grid& g) {
  for (const SharedArray& a : shared_arrays()) std::memset(a.p, 0xff, a.bytes);
  if (g.dynamic_bytes) std::memset(g.dynamic_end - g.dynamic_bytes, 0xff, g.dynamic_bytes);
  for (int i = 0; i < g.threads; ++i) {
    Fiber& f = g.fibers[static_cast<size_t>(i)];
    const unsigned bx = g.block.x, by = g.block.y;
    f.tid = uint3{static_cast<unsigned>(i) % bx, static_cast<unsigned>(i) / bx % by, static_cast<unsigned>(i) / (bx * by)};
    f.st = St::kRun;
    f.shuffle = false;
    f.phase = 0;
    f.sp = fresh_stack(g.stacks + static_cast<size_t>(i + 1) * (kStackBytes + 4096));
  }
  // The order threads take turns in: ascending, or with ZINC_EMU_ORDER=reverse
  // descending, so that a race inside a block that one order hides (a
  // thread reading shared memory before another has written it, a missing
  // __syncthreads) shows in the other. CTest runs the kernel tests both ways.
  static const bool reverse = [] {
    const char* e = std::getenv("ZINC_EMU_ORDER");
    return e && std::string(e) == "reverse";
  }();
  for (;;) {
    bool ran = false;
    for (int n = 0; n < g.threads; ++n) {
      const int i = reverse ? g.threads - 1 - n : n;
      if (g.fibers[static_cast<size_t>(i)].st != St::kRun) continue;
      g.cur = i;
      zinc_emu_switch(&g.sched, g.fibers[static_cast<size_t>(i)].sp);
      g.cur = -1;
      ran = true;
      if (g.error) std::rethrow_exception(g.error);
    }
    if (!ran && !release(g)) return;
  }
}

}  // namespace

bool register_shared(void* p, size_t bytes) {
  Grid& g = grid_state();  // called by a thread of a running kernel (launches are serialised)
  shared_arrays().push_back({p, bytes});
  size_t& total = shared_bytes_by_kernel()[g.name];
  total += bytes;
  if (total > 48 * 1024)
    throw zinc::Error(std::string("kernel emulation: kernel ") + g.name + " declares " + std::to_string(total) +
                      " bytes of __shared__ memory, more than the 48 KiB a block may declare statically");
  return true;
}

void* dynamic_shared() {
  Grid& g = grid_state();
  running("dynamic shared memory");
  return g.dynamic_end - g.dynamic_bytes;
}
float* warp_scratch() {
  Grid& g = grid_state();
  running("a warp operation");
  return g.warp_scratch[static_cast<size_t>(g.cur / 32)].data();
}
void fail(const char* what) {
  Grid& g = grid_state();
  running(what);
  throw zinc::Error("kernel emulation: " + where(g, g.cur) + ": " + what);
}

const uint3& thread_idx() { return running("threadIdx").tid; }
const uint3& block_idx() {
  running("blockIdx");
  return grid_state().bid;
}
const dim3& block_dim() {
  running("blockDim");
  return grid_state().block;
}
const dim3& grid_dim() {
  running("gridDim");
  return grid_state().grid;
}
int lane_id() {
  Grid& g = grid_state();
  running("a warp operation");
  return g.cur % 32;
}

void syncthreads() {
  running("__syncthreads");
  yield(St::kBlock);
}
void syncwarp() {
  running("__syncwarp");
  yield(St::kWarp);
}

uint64_t warp_exchange(uint64_t bits, int src) {
  Grid& g = grid_state();
  Fiber& f = running("a shuffle");
  const int me = g.cur, w0 = me / 32 * 32;
  auto& buf = g.exchange[static_cast<size_t>(me / 32)][static_cast<size_t>(f.phase)];
  buf[static_cast<size_t>(me % 32)] = bits;
  f.shuffle = true;
  yield(St::kWarp);
  f.shuffle = false;
  f.phase ^= 1;
  if (src < 0 || src >= 32 || w0 + src >= g.threads)
    throw zinc::Error("kernel emulation: " + where(g, me) + " shuffles from lane " + std::to_string(src) +
                      ", outside its warp");
  return buf[static_cast<size_t>(src)];
}

namespace {

// A fault inside a kernel (past an allocation's end, after its free, or a
// fiber's stack overflowing into its guard page) names the kernel, block and
// thread before the process ends.
void on_fault(int sig) {
  const Grid& g = grid_state();
  char msg[256];
  int n;
  if (g.cur >= 0) {
    const uint3 t = g.fibers[static_cast<size_t>(g.cur)].tid;
    n = std::snprintf(msg, sizeof msg,
                      "kernel emulation: memory fault (signal %d) in kernel %s, block (%u,%u,%u), thread (%u,%u,%u): "
                      "an access outside every live allocation\n",
                      sig, g.name, g.bid.x, g.bid.y, g.bid.z, t.x, t.y, t.z);
  } else {
    n = std::snprintf(msg, sizeof msg, "kernel emulation: memory fault (signal %d) outside a kernel\n", sig);
  }
  if (n > 0) (void)!write(2, msg, static_cast<size_t>(n));
  signal(sig, SIG_DFL);
  raise(sig);
}

// Runs a launch now (every check done by launch()).
void run_grid(const char* name, dim3 grid, dim3 block, size_t shared_bytes, const Body& body) {
  Grid& g = grid_state();
  std::lock_guard<std::mutex> lock(g.launch);
  if (!g.dynamic_end) {
    // kMaxDynamicShared bytes (rounded up to pages) before a page that faults.
    const size_t data = (kMaxDynamicShared + 4095) / 4096 * 4096;
    void* p = mmap(nullptr, data + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw zinc::Error("kernel emulation: cannot map dynamic shared memory");
    g.dynamic_end = static_cast<char*>(p) + data;
    mprotect(g.dynamic_end, 4096, PROT_NONE);
  }
  // The start 128-byte aligned, as a GPU's dynamic shared memory is at least.
  g.dynamic_bytes = (shared_bytes + 127) / 128 * 128;
  if (!g.stacks) {
    signal(SIGSEGV, on_fault);
    signal(SIGBUS, on_fault);
    const size_t bytes = static_cast<size_t>(kMaxThreads) * (kStackBytes + 4096);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw zinc::Error("kernel emulation: cannot map the fibers' stacks");
    g.stacks = static_cast<char*>(p);
    for (int i = 0; i < kMaxThreads; ++i)  // a guard page below each stack: an overflow faults
      mprotect(g.stacks + static_cast<size_t>(i) * (kStackBytes + 4096), 4096, PROT_NONE);
  }
  g.name = name;
  g.grid = grid;
  g.block = block;
  g.body = &body;
  g.threads = static_cast<int>(block.x * block.y * block.z);
  g.error = nullptr;
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          g.bid = uint3{x, y, z};
          run_block(g);
        }
  } catch (...) {
    g.cur = -1;
    g.body = nullptr;
    throw;
  }
  g.body = nullptr;
}

bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e && std::string(e) == value;
}

// ---- streams ----------------------------------------------------------------------------
// Note [emulated streams]
// Work queued on a stream (launches, asynchronous copies and sets, waits on
// events, stream-ordered frees) runs only when something needs it done:
// cudaStreamSynchronize, cudaEventSynchronize or cudaEventQuery of an event
// recorded after it, cudaDeviceSynchronize, a wait of another stream that
// runs, or a collective on the stream (emulated NCCL flushes its stream, then
// runs at once). So a consumer that forgot to wait, on the host or on another
// stream, reads what was there before (fresh device memory reads as NaN), and
// the tests that compare with the CPU fail. As on a GPU, a copy from pageable
// host memory reads the source when called, and a copy to pageable memory
// returns once done; cudaMemcpy and cudaMemset go on the legacy stream, which
// does NOT order zinc's streams (they are non-blocking). ZINC_EMU_SYNC=1 runs
// everything when called instead (to tell an ordering bug from another one).
//
// Note [a held collective]
// An emulated NCCL collective whose peers never come (ZINC_EMU_NCCL_STALL,
// emu_nccl.cpp) is an op with a gate: the queue stops before it until
// ncclCommAbort opens the gate, as a GPU's stream stops behind a NCCL
// kernel that waits for its peers until the communicator is aborted.
// cudaEventQuery of an event behind it reports cudaErrorNotReady (the
// caller polls on); any other wait that reaches it would, on a GPU, wait
// forever, so the emulation says so on stderr and ends the process (a test
// that reaches it fails instead of hanging). cudaStreamDestroy does not
// wait, as on a GPU.
struct Queue {
  std::deque<std::function<void()>> ops;
  uint64_t queued = 0, done = 0;
  std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> gates;  // op index -> open
};
struct EventState {
  Queue* q = nullptr;  // where it was last recorded
  uint64_t at = 0;     // done when q->done reaches this
  unsigned flags = 0;  // cudaEventDisableTiming: no time is kept
  // When the queue reached the record (steady clock, seconds), for
  // cudaEventElapsedTime: set by a marker queued with the record, so, as
  // on a GPU, it says when the work before it was done. Below 0 until then.
  std::shared_ptr<std::atomic<double>> stamp;
};
struct Runtime {
  std::recursive_mutex mu;
  Queue legacy;
  std::vector<Queue*> queues{&legacy};  // never freed: waits may name a destroyed stream
};
Runtime& runtime() {
  static Runtime* r = new Runtime();  // never destroyed (see allocations())
  return *r;
}
Queue* queue_of(const void* stream) {
  return stream ? static_cast<Queue*>(const_cast<void*>(stream)) : &runtime().legacy;
}
const bool kImmediate = env_is("ZINC_EMU_SYNC", "1");

// Runs q's work up to position `at` (runtime().mu held).
// A failure inside queued work (a kernel's deadlock or bad shuffle) is, as
// on a GPU, a sticky error: printed once, then every call that waits for the
// device returns cudaErrorLaunchFailure, which zinc's checks turn into an
// error naming the operation. (Thrown from whatever call ran the queue, it
// could escape through a destructor or a noexcept function.)
std::atomic<bool> sticky_failure{false};

void run_until(Queue* q, uint64_t at) {
  while (q->done < at && !q->ops.empty()) {
    if (auto g = q->gates.find(q->done); g != q->gates.end()) {
      if (!g->second->load()) return;  // held (Note [a held collective])
      q->gates.erase(g);
    }
    std::function<void()> op = std::move(q->ops.front());
    q->ops.pop_front();
    ++q->done;
    if (sticky_failure) continue;  // the device is lost: later work does not run
    try {
      op();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "zinc_emu: queued work failed: %s\n", e.what());
      sticky_failure = true;
    }
  }
}
cudaError_t status() { return sticky_failure ? cudaErrorLaunchFailure : cudaSuccess; }
// A wait that reached a held collective (Note [a held collective]).
[[noreturn]] void waits_forever(const char* call) {
  std::fprintf(stderr,
               "zinc_emu: %s waits for an NCCL collective whose peers never come: on a GPU it would wait "
               "forever (abort the communicator first)\n",
               call);
  std::fflush(stderr);
  std::_Exit(86);
}
// Runs q's work up to `at`, which a wait needs done.
void wait_until(Queue* q, uint64_t at, const char* call) {
  run_until(q, at);
  if (q->done < at && !sticky_failure) waits_forever(call);
}
void run_all(const char* call) {
  Runtime& r = runtime();
  for (bool again = true; again;) {
    again = false;
    for (Queue* q : r.queues)
      if (q->done < q->queued) {
        const uint64_t before = q->done;
        run_until(q, q->queued);
        again = again || q->done != before;
      }
  }
  for (Queue* q : r.queues)
    if (q->done < q->queued && !sticky_failure) waits_forever(call);
}
void enqueue(const void* stream, std::function<void()> op) {
  Runtime& r = runtime();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  Queue* q = queue_of(stream);
  if (kImmediate) {
    wait_until(q, q->queued, "a call under ZINC_EMU_SYNC=1");
    op();
    return;
  }
  q->ops.push_back(std::move(op));
  ++q->queued;
}
void flush(const void* stream, const char* call) {
  Runtime& r = runtime();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  Queue* q = queue_of(stream);
  wait_until(q, q->queued, call);
}
// Note [a held collective]: an op that runs once `open` is set.
void enqueue_held(const void* stream, std::shared_ptr<std::atomic<bool>> open) {
  Runtime& r = runtime();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  Queue* q = queue_of(stream);
  q->gates[q->queued] = std::move(open);
  q->ops.push_back([] {});
  ++q->queued;
}

}  // namespace

std::mutex& attribute_mu() {
  static auto* m = new std::mutex();
  return *m;
}
// cudaFuncAttributeMaxDynamicSharedMemorySize by kernel.
std::map<const void*, size_t>& max_dynamic_shared() {
  static auto* m = new std::map<const void*, size_t>();
  return *m;
}

void launch(const char* name, const void* kernel, dim3 grid, dim3 block, size_t shared_bytes, void* stream,
            Body body) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (shared_bytes > kDefaultDynamicShared) {
    std::lock_guard<std::mutex> lock(attribute_mu());
    auto it = max_dynamic_shared().find(kernel);
    if (it == max_dynamic_shared().end() || it->second < shared_bytes) {
      set_last_error(cudaErrorInvalidValue);
      return;
    }
  }
  static const bool trace = env_is("ZINC_EMU_TRACE", "1");
  if (trace)
    std::fprintf(stderr, "zinc_emu: %s grid (%u,%u,%u) block (%u,%u,%u) stream %p\n", name, grid.x, grid.y, grid.z,
                 block.x, block.y, block.z, stream);
  enqueue(stream, [name, grid, block, shared_bytes, body = std::move(body)] {
    run_grid(name, grid, block, shared_bytes, body);
  });
}

namespace {
thread_local cudaError_t last_error = cudaSuccess;

enum class Kind { kDevice, kPinned };
struct Allocation {
  size_t bytes;
  Kind kind;
  char* map;  // the mapping: a guard page, the data's pages, a guard page
  size_t map_bytes;
};
struct Allocations {
  std::mutex mu;
  std::map<const char*, Allocation> live;  // cudaMalloc*, cudaHostAlloc
  std::map<const char*, size_t> registered;  // cudaHostRegister
  size_t device_bytes = 0;                   // live cudaMalloc bytes
  size_t device_peak = 0;                    // their most since the last zinc_emu_reset_device_peak
};
// ZINC_EMU_GPU_BYTES: the emulated GPU's memory (cudaMalloc past it fails
// with cudaErrorMemoryAllocation, and cudaMemGetInfo reports it); 0 or
// unset: 80 GiB, never enforced. Read at each call (a test sets it).
size_t gpu_capacity() {
  const char* e = std::getenv("ZINC_EMU_GPU_BYTES");
  return e && *e ? static_cast<size_t>(std::strtoull(e, nullptr, 0)) : 0;
}
// Never destroyed: static destructors elsewhere (thread- and function-local
// caches of device buffers) may still free memory during exit.
Allocations& allocations() {
  static Allocations* a = new Allocations();
  return *a;
}
// Each allocation is a mapping of its own, its end (rounded up to 256 bytes,
// CUDA's alignment) against a page that faults, with another below its
// start; freeing unmaps it. So an access past either end or after the free
// faults instead of reading a neighbour. Fresh memory is NaN bytes (it is
// not zero on a GPU), so reading what was never written shows.
cudaError_t allocate(void** p, size_t bytes, Kind kind) {
  if (!p) return cudaErrorInvalidValue;
  if (bytes == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  constexpr size_t kPage = 4096;
  const size_t rounded = (bytes + 255) / 256 * 256;
  const size_t data_pages = (rounded + kPage - 1) / kPage;
  const size_t map_bytes = (data_pages + 2) * kPage;
  if (kind == Kind::kDevice) {  // within ZINC_EMU_GPU_BYTES
    const size_t cap = gpu_capacity();
    Allocations& a = allocations();
    std::lock_guard<std::mutex> lock(a.mu);
    if (cap > 0 && a.device_bytes + rounded > cap) return cudaErrorMemoryAllocation;
    a.device_bytes += rounded;
    a.device_peak = std::max(a.device_peak, a.device_bytes);
  }
  auto fail = [&] {
    if (kind == Kind::kDevice) {
      Allocations& a = allocations();
      std::lock_guard<std::mutex> lock(a.mu);
      a.device_bytes -= rounded;
    }
    return cudaErrorMemoryAllocation;
  };
  void* m = mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return fail();
  char* map = static_cast<char*>(m);
  if (mprotect(map + kPage, data_pages * kPage, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, map_bytes);
    return fail();
  }
  char* q = map + kPage + data_pages * kPage - rounded;
  std::memset(q, 0xff, rounded);
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  a.live[q] = {bytes, kind, map, map_bytes};
  *p = q;
  return cudaSuccess;
}
// cudaFree of host memory, or cudaFreeHost of device memory, is an error, as in CUDA.
cudaError_t release_memory(void* p, Kind kind) {
  if (!p) return cudaSuccess;
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.live.find(static_cast<const char*>(p));
  if (it == a.live.end() || it->second.kind != kind) return cudaErrorInvalidValue;
  if (kind == Kind::kDevice) a.device_bytes -= (it->second.bytes + 255) / 256 * 256;
  munmap(it->second.map, it->second.map_bytes);
  a.live.erase(it);
  return cudaSuccess;
}
// Where p points: device memory, page-locked host memory (cudaHostAlloc or
// cudaHostRegister; copies from and to both are asynchronous), or pageable
// host memory.
enum class Where { kPageable, kDevice, kPinned };
Where where(const void* p) {
  const char* c = static_cast<const char*>(p);
  Allocations& a = allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.live.upper_bound(c);
  if (it != a.live.begin() && c < std::prev(it)->first + std::prev(it)->second.bytes)
    return std::prev(it)->second.kind == Kind::kDevice ? Where::kDevice : Where::kPinned;
  auto r = a.registered.upper_bound(c);
  if (r != a.registered.begin() && c < std::prev(r)->first + std::prev(r)->second) return Where::kPinned;
  return Where::kPageable;
}
}  // namespace

void set_last_error(cudaError_t e) { last_error = e; }

}  // namespace zinc_emu

// For the emulated cuBLAS and NCCL libraries (tests/cuda_emu/emu_*.cpp),
// which find them in the test executable (ENABLE_EXPORTS).
extern "C" void zinc_emu_enqueue(cudaStream_t stream, void (*fn)(void*), void* arg) {
  zinc_emu::enqueue(stream, [fn, arg] { fn(arg); });
}
extern "C" void zinc_emu_flush(cudaStream_t stream) {
  zinc_emu::flush(stream, "an NCCL call (its stream's work first)");
}
// Note [a held collective]: queues a collective that waits until
// zinc_emu_release(handle); returns the handle (released exactly once).
extern "C" void* zinc_emu_hold(cudaStream_t stream) {
  auto* open = new std::shared_ptr<std::atomic<bool>>(std::make_shared<std::atomic<bool>>(false));
  zinc_emu::enqueue_held(stream, *open);
  return open;
}
extern "C" void zinc_emu_release(void* handle) {
  std::unique_ptr<std::shared_ptr<std::atomic<bool>>> open(static_cast<std::shared_ptr<std::atomic<bool>>*>(handle));
  std::lock_guard<std::recursive_mutex> lock(zinc_emu::runtime().mu);
  (*open)->store(true);
}

// The emulated GPU's live device bytes (each allocation rounded up to 256)
// and their most since the last reset: what a test weighs an estimate against.
extern "C" size_t zinc_emu_device_bytes() {
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.device_bytes;
}
extern "C" size_t zinc_emu_device_peak_bytes() {
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.device_peak;
}
extern "C" void zinc_emu_reset_device_peak() {
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  a.device_peak = a.device_bytes;
}

using zinc_emu::last_error;

cudaError_t cudaGetLastError() { return std::exchange(last_error, cudaSuccess); }
cudaError_t cudaPeekAtLastError() { return last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    default: return "cudaErrorLaunchFailure";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    default: return "unspecified launch failure";
  }
}
// The emulated GPUs: ZINC_EMU_GPUS (default 1), so that several ranks of one
// machine each get their own, as NCCL needs. They share the host's memory.
// 0: none, a machine without a GPU (cudaGetDeviceCount fails with
// cudaErrorNoDevice, as CUDA's does).
namespace zinc_emu {
namespace {
int device_count() {
  static const int n = [] {
    const char* e = std::getenv("ZINC_EMU_GPUS");
    const int v = e && *e ? std::atoi(e) : 1;
    return v >= 0 ? v : 1;
  }();
  return n;
}
thread_local int current_device = 0;  // per host thread, as CUDA's current device
std::unique_lock<std::recursive_mutex> lock_runtime() { return std::unique_lock<std::recursive_mutex>(runtime().mu); }
}  // namespace
}  // namespace zinc_emu
cudaError_t cudaGetDeviceCount(int* n) {
  *n = zinc_emu::device_count();
  return *n > 0 ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (!func || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > zinc_emu::kMaxDynamicShared)
    return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(zinc_emu::attribute_mu());
  zinc_emu::max_dynamic_shared()[func] = static_cast<size_t>(value);
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = zinc_emu::current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= zinc_emu::device_count()) return cudaErrorInvalidValue;
  zinc_emu::current_device = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrComputeCapabilityMajor ? 9 : attr == cudaDevAttrMemoryPoolsSupported ? 1 : 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop || device < 0 || device >= zinc_emu::device_count()) return cudaErrorInvalidValue;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "zinc kernel emulation (no GPU)");
  prop->totalGlobalMem = size_t{80} << 30;
  prop->major = 9;
  prop->multiProcessorCount = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  auto lock = zinc_emu::lock_runtime();
  zinc_emu::run_all("cudaDeviceSynchronize (cudaFree and cudaFreeHost run it too)");
  return zinc_emu::status();
}
cudaError_t cudaMalloc(void** p, size_t bytes) { return zinc_emu::allocate(p, bytes, zinc_emu::Kind::kDevice); }
// cudaFree and cudaFreeHost wait for the device first, as CUDA's do.
cudaError_t cudaFree(void* p) {
  cudaDeviceSynchronize();
  return zinc_emu::release_memory(p, zinc_emu::Kind::kDevice);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  return zinc_emu::allocate(p, bytes, zinc_emu::Kind::kPinned);
}
cudaError_t cudaFreeHost(void* p) {
  cudaDeviceSynchronize();
  return zinc_emu::release_memory(p, zinc_emu::Kind::kPinned);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t s) {
  if (!bytes) return cudaSuccess;
  if (zinc_emu::where(src) == zinc_emu::Where::kPageable) {  // pageable source: read now
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    zinc_emu::enqueue(s, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  if (zinc_emu::where(dst) == zinc_emu::Where::kPageable) {  // pageable destination: done on return
    auto lock = zinc_emu::lock_runtime();
    zinc_emu::flush(s, "cudaMemcpyAsync to pageable memory");
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  zinc_emu::enqueue(s, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}
// On the legacy stream, returning as CUDA documents: device to device at
// once, without waiting; from pageable memory to the device once the source
// is staged (the copy itself lands in stream order); otherwise once done.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const zinc_emu::Where from = zinc_emu::where(src);
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (zinc_emu::where(dst) == zinc_emu::Where::kDevice && from != zinc_emu::Where::kPinned) return e;
  zinc_emu::flush(nullptr, "cudaMemcpy");
  return e != cudaSuccess ? e : zinc_emu::status();
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  if (bytes) zinc_emu::enqueue(s, [p, value, bytes] { std::memset(p, value, bytes); });
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  auto lock = zinc_emu::lock_runtime();
  auto* q = new zinc_emu::Queue();
  zinc_emu::runtime().queues.push_back(q);
  *s = reinterpret_cast<cudaStream_t>(q);
  return cudaSuccess;
}
// Work already queued still runs, as on a GPU; the queue stays (empty) for
// waits recorded on it.
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  auto lock = zinc_emu::lock_runtime();
  zinc_emu::Queue* q = zinc_emu::queue_of(s);
  zinc_emu::run_until(q, q->queued);  // up to a held collective, if any: a GPU does not wait for it here
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  zinc_emu::flush(s, "cudaStreamSynchronize");
  return zinc_emu::status();
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  auto* state = new zinc_emu::EventState();
  state->flags = flags;
  *e = reinterpret_cast<cudaEvent_t>(state);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  auto lock = zinc_emu::lock_runtime();
  delete reinterpret_cast<zinc_emu::EventState*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto lock = zinc_emu::lock_runtime();
  zinc_emu::Queue* q = zinc_emu::queue_of(s);
  if (zinc_emu::kImmediate) zinc_emu::wait_until(q, q->queued, "cudaEventRecord under ZINC_EMU_SYNC=1");
  auto* state = reinterpret_cast<zinc_emu::EventState*>(e);
  std::shared_ptr<std::atomic<double>> stamp;
  if (!(state->flags & cudaEventDisableTiming)) {
    stamp = std::make_shared<std::atomic<double>>(-1.0);
    zinc_emu::enqueue(s, [stamp] {
      stamp->store(std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count());
    });
  }
  state->q = q;
  state->at = q->queued;
  state->stamp = std::move(stamp);
  return cudaSuccess;
}
// As CUDA's: both events recorded with timing and done (else
// cudaErrorNotReady, which does not run the work), in milliseconds.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  auto lock = zinc_emu::lock_runtime();
  if (!ms || !start || !end) return cudaErrorInvalidValue;
  const auto* a = reinterpret_cast<const zinc_emu::EventState*>(start);
  const auto* b = reinterpret_cast<const zinc_emu::EventState*>(end);
  if ((a->flags | b->flags) & cudaEventDisableTiming || !a->q || !b->q) return cudaErrorInvalidResourceHandle;
  if (a->q->done < a->at || b->q->done < b->at) return cudaErrorNotReady;
  *ms = static_cast<float>((b->stamp->load() - a->stamp->load()) * 1e3);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  auto lock = zinc_emu::lock_runtime();
  const zinc_emu::EventState at = *reinterpret_cast<zinc_emu::EventState*>(e);
  if (at.q) zinc_emu::enqueue(s, [at] { zinc_emu::wait_until(at.q, at.at, "a stream's cudaStreamWaitEvent"); });
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  auto lock = zinc_emu::lock_runtime();
  const zinc_emu::EventState at = *reinterpret_cast<zinc_emu::EventState*>(e);
  if (at.q) zinc_emu::wait_until(at.q, at.at, "cudaEventSynchronize");
  return zinc_emu::status();
}
// Work still queued before the event: reports cudaErrorNotReady and runs
// it, so the caller's not-ready branch runs and the next query succeeds
// (polling loops end).
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto lock = zinc_emu::lock_runtime();
  const zinc_emu::EventState at = *reinterpret_cast<zinc_emu::EventState*>(e);
  const bool pending = at.q && at.q->done < at.at;
  if (pending) zinc_emu::run_until(at.q, at.at);
  if (zinc_emu::status() != cudaSuccess) return zinc_emu::status();
  return pending ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, nullptr); }
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  const size_t cap = zinc_emu::gpu_capacity();
  if (cap == 0) {
    *free_bytes = *total_bytes = size_t{80} << 30;
    return cudaSuccess;
  }
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  *total_bytes = cap;
  *free_bytes = cap > a.device_bytes ? cap - a.device_bytes : 0;
  return cudaSuccess;
}
// Host memory needs no page-locking here; it is recorded so that copies from
// and to it are asynchronous. Registering twice is an error, as on a GPU.
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  if (!p || !bytes || !a.registered.emplace(static_cast<const char*>(p), bytes).second) return cudaErrorInvalidValue;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  zinc_emu::Allocations& a = zinc_emu::allocations();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.registered.erase(static_cast<const char*>(p)) ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
// Freed in stream order: work queued before it may still use the memory.
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (p)
    zinc_emu::enqueue(s, [p] {
      if (zinc_emu::release_memory(p, zinc_emu::Kind::kDevice) != cudaSuccess)
        throw zinc::Error("kernel emulation: cudaFreeAsync of memory that is not a live device allocation");
    });
  return cudaSuccess;
}
cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  if (!props || props->allocType != cudaMemAllocationTypePinned || props->location.type != cudaMemLocationTypeDevice ||
      props->location.id < 0 || props->location.id >= zinc_emu::device_count())
    return cudaErrorInvalidValue;
  *pool = reinterpret_cast<cudaMemPool_t>(new char(0));
  return cudaSuccess;
}
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  delete reinterpret_cast<char*>(pool);
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr, void* value) {
  return pool && value ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool, cudaStream_t) {
  return pool ? cudaMalloc(p, bytes) : cudaErrorInvalidValue;
}

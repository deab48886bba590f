// The NCCL of kernel emulation (Note [kernel emulation] in cuda_emu.h): a
// shared library with the C entry points comm/nccl_communicator.cpp opens,
// running each collective over MPI on host memory (the emulated device
// memory) before it returns. Each communicator is an MPI communicator of its
// own (ncclCommInitRank: MPI_Comm_split of the MPI world by the unique id,
// ranked by the NCCL rank, so every rank of the world makes a communicator
// at the same point, each of its own group's, as zinc's engine does;
// ncclCommSplit: MPI_Comm_split of its parent), so collectives on two of
// them never mix.
// A collective first runs the work queued on its stream, then exchanges at
// once; its result lands in recv in stream order (Landing).
// Reductions gather every rank's data and add it in rank order (fp32 in
// fp32, fp64 in fp64, 16-bit values in fp32 rounded once), so every rank
// gets the same bits; real NCCL adds in its own ring or tree order.
// Point to point: ncclSend and ncclRecv between ncclGroupStart and
// ncclGroupEnd are queued on the calling thread and run together at the
// group's end (nonblocking MPI sends and receives, then one wait), so ranks
// that send to each other in one group never wait on each other; outside a
// group each runs at once. A send takes its data after the work queued on
// its stream; a receive's data lands in stream order.
// It needs MPI initialised with MPI_THREAD_MULTIPLE, as zinc's MPI backend does.
// ZINC_EMU_NCCL_STALL=1 (read at each call; set it on every rank at the same
// point) makes the peers of every collective and transfer never come: the
// call returns, and its stream stops behind it until ncclCommAbort (Note [a
// held collective] in cuda_emu.cpp), as on a GPU whose peer rank died; a
// blocking ncclCommSplit, which has no time limit, ends the process (86).
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "tests/cuda_emu/include/nccl.h"

// In the test executable (tests/cuda_emu/cuda_emu.cpp, exported): runs the
// work queued on a stream, so that a collective sees what came before it on
// its stream (Note [emulated streams]).
extern "C" void zinc_emu_flush(cudaStream_t stream);
extern "C" void zinc_emu_enqueue(cudaStream_t stream, void (*fn)(void*), void* arg);
extern "C" void* zinc_emu_hold(cudaStream_t stream);
extern "C" void zinc_emu_release(void* handle);

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::vector<void*> held;  // collectives whose peers never came (ZINC_EMU_NCCL_STALL)
};

namespace {

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclFloat32: return 4;
    case ncclFloat64: return 8;
  }
  return 0;
}

double load(const char* p, ncclDataType_t t, size_t i) {
  switch (t) {
    case ncclFloat16: return zinc::from_16(reinterpret_cast<const uint16_t*>(p)[i], zinc::DType::kF16);
    case ncclBfloat16: return zinc::from_16(reinterpret_cast<const uint16_t*>(p)[i], zinc::DType::kBF16);
    case ncclInt32: return reinterpret_cast<const int32_t*>(p)[i];
    case ncclFloat32: return reinterpret_cast<const float*>(p)[i];
    case ncclFloat64: return reinterpret_cast<const double*>(p)[i];
  }
  return 0;
}

// Adds (or takes the max of) ranks' values in rank order: in fp64 for fp64,
// in fp32 for the others, rounding 16-bit results once at the end.
void reduce_into(char* out, const std::vector<const char*>& in, ncclDataType_t t, ncclRedOp_t op, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (t == ncclFloat64) {
      double s = load(in[0], t, i);
      for (size_t r = 1; r < in.size(); ++r) {
        const double v = load(in[r], t, i);
        s = op == ncclMax ? (v > s ? v : s) : s + v;
      }
      reinterpret_cast<double*>(out)[i] = s;
      continue;
    }
    float s = static_cast<float>(load(in[0], t, i));
    for (size_t r = 1; r < in.size(); ++r) {
      const float v = static_cast<float>(load(in[r], t, i));
      s = op == ncclMax ? (v > s ? v : s) : s + v;
    }
    switch (t) {
      case ncclFloat16: reinterpret_cast<uint16_t*>(out)[i] = zinc::float_to_16(s, zinc::DType::kF16); break;
      case ncclBfloat16: reinterpret_cast<uint16_t*>(out)[i] = zinc::float_to_16(s, zinc::DType::kBF16); break;
      case ncclInt32: reinterpret_cast<int32_t*>(out)[i] = static_cast<int32_t>(s); break;
      default: reinterpret_cast<float*>(out)[i] = s;
    }
  }
}

// Every rank's `bytes` from `send`, in rank order.
ncclResult_t gather_all(const ncclComm* c, const void* send, size_t bytes, std::vector<char>& all) {
  if (bytes > static_cast<size_t>(INT32_MAX)) return ncclInvalidArgument;
  std::vector<char> mine(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
  all.resize(bytes * static_cast<size_t>(c->size));
  return MPI_Allgather(mine.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes), MPI_BYTE,
                       c->mpi) == MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}

// A collective's result, written into recv when its stream gets there: a
// reader on another stream or the host that does not wait for it sees what
// was there before, as on a GPU.
struct Landing {
  void* recv;
  std::vector<char> data;
};
void land(cudaStream_t stream, void* recv, std::vector<char> data) {
  if (data.empty()) return;
  auto* l = new Landing{recv, std::move(data)};
  zinc_emu_enqueue(stream, [](void* p) {
    std::unique_ptr<Landing> l(static_cast<Landing*>(p));
    std::memcpy(l->recv, l->data.data(), l->data.size());
  }, l);
}

// Under ZINC_EMU_NCCL_STALL=1: holds `stream` behind a collective of `c`
// that never completes (until ncclCommAbort), and returns true.
bool peers_never_come(ncclComm* c, cudaStream_t stream) {
  const char* v = std::getenv("ZINC_EMU_NCCL_STALL");
  if (!v || std::strcmp(v, "1") != 0) return false;
  c->held.push_back(zinc_emu_hold(stream));
  return true;
}
void release_held(ncclComm* c) {
  for (void* h : c->held) zinc_emu_release(h);
  c->held.clear();
}

ncclResult_t check(const ncclComm* c, ncclDataType_t t, ncclRedOp_t op = ncclSum) {
  if (!c || c->mpi == MPI_COMM_NULL) return ncclInvalidArgument;
  if (type_bytes(t) == 0 || (op != ncclSum && op != ncclMax)) return ncclInvalidArgument;
  return ncclSuccess;
}

// One queued ncclSend or ncclRecv.
struct P2p {
  bool send;
  const void* from;
  void* to;
  size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};
constexpr int kP2pTag = 0x5e4d;
thread_local int g_group_depth = 0;
thread_local std::vector<P2p> g_p2p;

// Runs the queued transfers together: every send's data after its stream's
// work, nonblocking sends and receives, one wait, the received data landing
// in stream order.
ncclResult_t run_p2p() {
  std::vector<P2p> ops;
  ops.swap(g_p2p);
  for (const P2p& o : ops) zinc_emu_flush(o.stream);
  if (!ops.empty() && peers_never_come(ops[0].comm, ops[0].stream)) return ncclSuccess;
  std::vector<std::vector<char>> data(ops.size());
  std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2p& o = ops[i];
    if (o.send) data[i].assign(static_cast<const char*>(o.from), static_cast<const char*>(o.from) + o.bytes);
    else data[i].resize(o.bytes);
    const int rc = o.send ? MPI_Isend(data[i].data(), static_cast<int>(o.bytes), MPI_BYTE, o.peer, kP2pTag,
                                      o.comm->mpi, &reqs[i])
                          : MPI_Irecv(data[i].data(), static_cast<int>(o.bytes), MPI_BYTE, o.peer, kP2pTag,
                                      o.comm->mpi, &reqs[i]);
    if (rc != MPI_SUCCESS) return ncclSystemError;
  }
  if (!reqs.empty() && MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    return ncclSystemError;
  for (size_t i = 0; i < ops.size(); ++i)
    if (!ops[i].send) land(ops[i].stream, ops[i].to, std::move(data[i]));
  return ncclSuccess;
}

ncclResult_t queue_p2p(P2p o, ncclDataType_t t) {
  if (ncclResult_t r = check(o.comm, t)) return r;
  if (o.peer < 0 || o.peer >= o.comm->size || o.bytes > static_cast<size_t>(INT32_MAX)) return ncclInvalidArgument;
  g_p2p.push_back(o);
  return g_group_depth > 0 ? ncclSuccess : run_p2p();
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (kernel emulation)";
    case ncclInvalidUsage: return "invalid usage (kernel emulation: a communicator whose ranks disagree; every rank of the MPI world makes one at the same point)";
    case ncclSystemError: return "system error (kernel emulation: an MPI call failed)";
    default: return "internal error (kernel emulation)";
  }
}
const char* ncclGetLastError(ncclComm_t) { return ""; }
ncclResult_t ncclGetVersion(int* v) {
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::random_device rd;
  for (char& ch : id->internal) ch = static_cast<char>(rd());
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  int inited = 0, world = 0, me = 0;
  MPI_Initialized(&inited);
  if (!inited) return ncclInvalidUsage;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (nranks < 1 || nranks > world || rank < 0 || rank >= nranks) return ncclInvalidUsage;
  // The group's colour: its unique id (the bootstrap gave every member the same).
  uint32_t color = 2166136261u;
  for (char ch : id.internal) color = (color ^ static_cast<uint8_t>(ch)) * 16777619u;
  auto* c = new ncclComm();
  if (MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(color & 0x3fffffffu), rank, &c->mpi) != MPI_SUCCESS) {
    delete c;
    return ncclSystemError;
  }
  MPI_Comm_rank(c->mpi, &c->rank);
  MPI_Comm_size(c->mpi, &c->size);
  if (c->size != nranks || c->rank != rank) {  // two groups drew one id, or a rank made none
    MPI_Comm_free(&c->mpi);
    delete c;
    return ncclInvalidUsage;
  }
  *comm = c;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* child, ncclConfig_t*) {
  if (!comm || comm->mpi == MPI_COMM_NULL) return ncclInvalidArgument;
  // A blocking split whose peers never come waits forever on a GPU.
  if (const char* v = std::getenv("ZINC_EMU_NCCL_STALL"); v && std::strcmp(v, "1") == 0) {
    std::fprintf(stderr, "zinc_emu: ncclCommSplit waits for peers that never come: on a GPU it would wait forever\n");
    std::fflush(stderr);
    std::_Exit(86);
  }
  auto* c = new ncclComm();
  if (MPI_Comm_split(comm->mpi, color, key, &c->mpi) != MPI_SUCCESS) {
    delete c;
    return ncclSystemError;
  }
  MPI_Comm_rank(c->mpi, &c->rank);
  MPI_Comm_size(c->mpi, &c->size);
  *child = c;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* result) {
  if (!comm) return ncclInvalidArgument;
  *result = ncclSuccess;  // the exchange itself finished in the call
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  if (comm->mpi != MPI_COMM_NULL) MPI_Comm_free(&comm->mpi);
  release_held(comm);
  delete comm;
  return ncclSuccess;
}
// The peers may be gone: the MPI communicator is dropped without a collective
// free. Its held collectives end (their results never land).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  release_held(comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  zinc_emu_flush(stream);  // runs at once, after what its stream holds
  if (ncclResult_t r = check(comm, t, op)) return r;
  if (peers_never_come(comm, stream)) return ncclSuccess;
  const size_t bytes = count * type_bytes(t);
  std::vector<char> all;
  if (ncclResult_t r = gather_all(comm, send, bytes, all)) return r;
  std::vector<const char*> in;
  for (int q = 0; q < comm->size; ++q) in.push_back(all.data() + static_cast<size_t>(q) * bytes);
  std::vector<char> out(bytes);
  reduce_into(out.data(), in, t, op, count);
  land(stream, recv, std::move(out));
  return ncclSuccess;
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  zinc_emu_flush(stream);  // runs at once, after what its stream holds
  if (ncclResult_t r = check(comm, t, op)) return r;
  if (peers_never_come(comm, stream)) return ncclSuccess;
  const size_t seg = recvcount * type_bytes(t), bytes = seg * static_cast<size_t>(comm->size);
  std::vector<char> all;
  if (ncclResult_t r = gather_all(comm, send, bytes, all)) return r;
  std::vector<const char*> in;
  for (int q = 0; q < comm->size; ++q)
    in.push_back(all.data() + static_cast<size_t>(q) * bytes + static_cast<size_t>(comm->rank) * seg);
  std::vector<char> out(seg);
  reduce_into(out.data(), in, t, op, recvcount);
  land(stream, recv, std::move(out));
  return ncclSuccess;
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) {
  zinc_emu_flush(stream);  // runs at once, after what its stream holds
  if (ncclResult_t r = check(comm, t)) return r;
  if (peers_never_come(comm, stream)) return ncclSuccess;
  std::vector<char> all;
  if (ncclResult_t r = gather_all(comm, send, sendcount * type_bytes(t), all)) return r;
  land(stream, recv, std::move(all));
  return ncclSuccess;
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  zinc_emu_flush(stream);  // runs at once, after what its stream holds
  if (ncclResult_t r = check(comm, t)) return r;
  if (peers_never_come(comm, stream)) return ncclSuccess;
  if (root < 0 || root >= comm->size) return ncclInvalidArgument;
  const size_t bytes = count * type_bytes(t);
  if (bytes > static_cast<size_t>(INT32_MAX)) return ncclInvalidArgument;
  std::vector<char> data(bytes);
  if (comm->rank == root && bytes) std::memcpy(data.data(), send, bytes);
  if (MPI_Bcast(data.data(), static_cast<int>(bytes), MPI_BYTE, root, comm->mpi) != MPI_SUCCESS) return ncclSystemError;
  land(stream, recv, std::move(data));
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return queue_p2p({true, send, nullptr, count * type_bytes(t), peer, comm, stream}, t);
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
  return queue_p2p({false, nullptr, recv, count * type_bytes(t), peer, comm, stream}, t);
}
ncclResult_t ncclGroupStart() {
  ++g_group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (g_group_depth == 0) return ncclInvalidUsage;
  return --g_group_depth > 0 ? ncclSuccess : run_p2p();
}

}  // extern "C"

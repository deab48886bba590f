// matmul through oneDNN.
//
// Note [matmul primitive cache]
// A oneDNN primitive is expensive to create (JIT code generation, ~ms) and
// cheap to execute, and a training step calls the same handful of shapes over
// and over. So primitives are created once per MatmulDesc (all fields are part
// of the key, alpha included, because 2.6 bakes output scales into the
// primitive) and kept for the life of the process in a map guarded by a mutex.
// Primitives are created with fully known dims (no DNNL_RUNTIME_DIM_VAL):
// oneDNN picks its blocking for the exact shape, which is what makes the
// brgemm kernels fast.
//
// Scratchpads are user-managed (scratchpad_mode::user) and come from a
// thread-local buffer, and each calling thread has its own stream, so two
// threads may run the same cached primitive at once on different outputs.
// Operands whose dtype differs from desc.compute are converted into
// thread-local scratch first.
//
// Layouts: op(A) = A stored (M,K) is tag ab; A stored (K,M) (trans_a) is the
// same logical (M,K) tensor with strides {1,M}, tag ba (acb with a batch).
// oneDNN 2.6 picks brgemm (brg:avx512_core_bf16 / brg:avx512_core) for all
// four transpose combinations at the GPT shapes and copies transposed blocks
// into its packed format itself. Measured on 2 cores (bf16, M=2048 rows):
// y = x W^T (trans_b) and dX = dY W (plain) ~800 GFLOP/s, dW += dY^T X
// (trans_a) ~600-700 GFLOP/s. An explicit transpose-and-convert of dY into
// scratch costs about as much as the gap, so none is done.
#include <oneapi/dnnl/dnnl.hpp>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/alloc.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/profile.h"

namespace zinc::kernels {
namespace {

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool, uint32_t, DType>;

Key make_key(const MatmulDesc& d) {
  return {d.batch, d.M, d.N, d.K, d.trans_a, d.trans_b, d.accumulate, float_bits(d.alpha), d.compute};
}

struct CachedMatmul {
  dnnl::matmul prim;
  dnnl::memory::desc scratch_md;
  size_t scratch_bytes = 0;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(cpu_engine());
  return s;
}

// Grow-only thread-local scratch; slot 0,1 for converted operands, 2 for the
// oneDNN scratchpad.
void* thread_scratch(int slot, size_t bytes) {
  thread_local AlignedBuffer bufs[3];
  AlignedBuffer& b = bufs[slot];
  if (b.bytes() < bytes) b = AlignedBuffer(round_up(bytes, 4096));
  return b.data();
}

dnnl::memory::data_type dnnl_type(DType t) {
  return t == DType::kF32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
}

// Logical (rows, cols) matrix, stored transposed when `trans`.
dnnl::memory::desc operand_desc(int64_t batch, int64_t rows, int64_t cols, bool trans,
                                dnnl::memory::data_type dt) {
  using tag = dnnl::memory::format_tag;
  if (batch == 1) return dnnl::memory::desc({rows, cols}, dt, trans ? tag::ba : tag::ab);
  return dnnl::memory::desc({batch, rows, cols}, dt, trans ? tag::acb : tag::abc);
}

std::shared_ptr<const CachedMatmul> create(const MatmulDesc& d) {
  auto dt = dnnl_type(d.compute);
  auto a_md = operand_desc(d.batch, d.M, d.K, d.trans_a, dt);
  auto b_md = operand_desc(d.batch, d.K, d.N, d.trans_b, dt);
  auto c_md = operand_desc(d.batch, d.M, d.N, false, dnnl::memory::data_type::f32);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (d.alpha != 1.0f) attr.set_output_scales(0, {d.alpha});
  if (d.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, cpu_engine());
  auto out = std::make_shared<CachedMatmul>();
  out->prim = dnnl::matmul(pd);
  out->scratch_md = pd.scratchpad_desc();
  out->scratch_bytes = out->scratch_md.get_size();
  return out;
}

std::shared_ptr<const CachedMatmul> lookup(const MatmulDesc& d) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const CachedMatmul>> cache;
  Key k = make_key(d);
  std::scoped_lock lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  try {
    auto p = create(d);
    cache.emplace(k, p);
    return p;
  } catch (const dnnl::error& e) {
    throw Error("matmul: oneDNN could not create a primitive for batch=" + std::to_string(d.batch) +
                " M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) +
                " K=" + std::to_string(d.K) + ": " + e.what());
  }
}

// Returns a pointer to the operand in the compute dtype, converting into
// thread-local scratch slot `slot` when needed.
const void* as_compute(CView v, DType compute, size_t n, int slot) {
  if (v.dtype == compute) return v.data;
  void* dst = thread_scratch(slot, n * dtype_bytes(compute));
  if (compute == DType::kBF16) {
    convert_f32_to_bf16(static_cast<const float*>(v.data), static_cast<bf16*>(dst), n);
  } else {
    convert_bf16_to_f32(static_cast<const bf16*>(v.data), static_cast<float*>(dst), n);
  }
  return dst;
}

}  // namespace

void matmul(const MatmulDesc& d, CView a, CView b, float* c) {
  ProfileScope profile_scope(Op::kMatmul);
  if (d.batch < 0 || d.M < 0 || d.N < 0 || d.K < 0) throw Error("matmul: negative dimension");
  if (d.batch == 0 || d.M == 0 || d.N == 0) return;
  const size_t c_numel = static_cast<size_t>(d.batch * d.M * d.N);
  if (d.K == 0) {  // empty sum: alpha * 0 (+ C)
    if (!d.accumulate) std::memset(c, 0, c_numel * sizeof(float));
    return;
  }
  auto cached = lookup(d);
  const void* a_ptr = as_compute(a, d.compute, static_cast<size_t>(d.batch * d.M * d.K), 0);
  const void* b_ptr = as_compute(b, d.compute, static_cast<size_t>(d.batch * d.K * d.N), 1);
  auto dt = dnnl_type(d.compute);
  auto& eng = cpu_engine();
  dnnl::memory a_mem(operand_desc(d.batch, d.M, d.K, d.trans_a, dt), eng, const_cast<void*>(a_ptr));
  dnnl::memory b_mem(operand_desc(d.batch, d.K, d.N, d.trans_b, dt), eng, const_cast<void*>(b_ptr));
  dnnl::memory c_mem(operand_desc(d.batch, d.M, d.N, false, dnnl::memory::data_type::f32), eng, c);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
  if (cached->scratch_bytes > 0) {
    dnnl::memory s_mem(cached->scratch_md, eng, thread_scratch(2, cached->scratch_bytes));
    args.emplace(DNNL_ARG_SCRATCHPAD, s_mem);
  }
  auto& s = thread_stream();
  cached->prim.execute(s, args);
  s.wait();
}

}  // namespace zinc::kernels

// zinc models, private: a linear layer y = x W^T + b in the PyTorch layout
// (W stored (out, in)), over kernels::matmul. Shared by the built-in models.
#pragma once

#include <vector>

#include "core/alloc.h"
#include "core/error.h"
#include "kernels/kernels.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {

using kernels::CView;

// The matmuls of a linear layer (shared with the memory tally below).
// y = x W^T (+ b fused into the matmul: one pass over y)
inline kernels::MatmulDesc forward_desc(int64_t N, int64_t in, int64_t out, bool bias, DType compute) {
  kernels::MatmulDesc d;
  d.M = N;
  d.N = out;
  d.K = in;
  d.trans_b = true;
  d.compute = compute;
  d.bias = bias;
  return d;
}
// dx = dy W
inline kernels::MatmulDesc input_grad_desc(int64_t N, int64_t in, int64_t out, DType compute) {
  kernels::MatmulDesc d;
  d.M = N;
  d.N = in;
  d.K = out;
  d.compute = compute;
  return d;
}
// dW += dy^T x
inline kernels::MatmulDesc weight_grad_desc(int64_t N, int64_t in, int64_t out, DType compute) {
  kernels::MatmulDesc g;
  g.M = out;
  g.N = in;
  g.K = N;
  g.trans_a = true;
  g.accumulate = true;
  g.compute = compute;
  return g;
}

// Where a frozen weight's product keeps it packed between calls (Note
// [packed frozen weights] in kernels/matmul.cpp): the model's slot for that
// weight and product, and its block's BlockParams::generation. Empty: the
// plain product.
struct PackedSlot {
  kernels::PackedWeight* slot = nullptr;
  uint64_t generation = 0;
};
// A model's slots: `per_layer` weights in each of `layers` layers, each
// packed for its forward and for its input gradient.
class PackedSlots {
 public:
  // Layer l's weight w for its forward (grad false) or its input gradient,
  // under its block's generation (BlockParams::generation); empty where
  // that is 0 (the weight may change) or `on` is false.
  PackedSlot at(uint64_t generation, bool on, int64_t layers, int per_layer, int64_t l, int w, bool grad) {
    if (generation == 0 || !on) return {};
    if (slots_.empty()) slots_.resize(static_cast<size_t>(layers * per_layer * 2));
    return {&slots_[static_cast<size_t>((l * per_layer + w) * 2 + (grad ? 1 : 0))], generation};
  }

 private:
  std::vector<kernels::PackedWeight> slots_;
};
inline void linear_matmul(Ops& ops, const kernels::MatmulDesc& d, CView a, CView w, float* c, CView bias,
                          PackedSlot pk) {
  if (pk.slot && pk.generation != 0)
    ops.matmul_packed(d, a, w, pk.generation, *pk.slot, c, bias);
  else
    ops.matmul(d, a, w, c, bias);
}

// y(N,out) = x(N,in) W^T + b   (b.data may be null). pk: W packed (a
// frozen weight's, PackedSlot).
inline void linear_forward(Ops& ops, float* y, CView x, CView w, CView b, int64_t N, int64_t in, int64_t out,
                           DType compute, PackedSlot pk = {}) {
  linear_matmul(ops, forward_desc(N, in, out, b.data != nullptr, compute), x, w, y, b, pk);
}
inline void linear_forward(float* y, CView x, CView w, CView b, int64_t N, int64_t in, int64_t out,
                           DType compute) {
  linear_forward(cpu_ops(), y, x, w, b, N, in, out, compute);
}

// dx(N,in) = dy W (written; skipped when dx is null); dW(out,in) += dy^T x
// (skipped when dW is null: a frozen weight);
// db(out) += column sums of dy (skipped when db is null).
// dy is fp32; Ops::dy_operand sums the bias gradient and, with bf16 (fp16)
// compute, converts dy once for both matmuls (one pass where the backend
// fuses them). `scratch` holds the 16-bit copy of dy (grown as needed).
// `dy_op`, where given, is dy as the matmuls read it, made by dy's producer
// together with the bias gradient (Ops::gelu_backward_operand); db is then
// null.
// dw_overwrite: dW = dy^T x, written (BlockGrads::overwrite: Note [gradients
// written, not zeroed] in engine/model.h). pk: dx's product with W packed
// (a frozen weight's).
inline void linear_backward(Ops& ops, Buf& scratch, float* dx, float* dw, float* db, CView dy, CView x, CView w,
                            int64_t N, int64_t in, int64_t out, DType compute, CView dy_op = {},
                            bool dw_overwrite = false, PackedSlot pk = {}) {
  if (dy_op.data) {
    ZINC_CHECK(!db, "linear_backward: a ready dy operand comes with its bias gradient summed");
    dy = dy_op;
  } else {
    ZINC_CHECK(dy.dtype == DType::kF32 && !dy.bf16_exact, "linear_backward needs the fp32 dy");
    dy = ops.dy_operand(static_cast<const float*>(dy.data), db, N, out, compute, scratch);
  }
  if (dx) {
    linear_matmul(ops, input_grad_desc(N, in, out, compute), dy, w, dx, {}, pk);
  }
  if (dw) {  // null: a frozen weight
    kernels::MatmulDesc g = weight_grad_desc(N, in, out, compute);
    g.accumulate = !dw_overwrite;
    ops.matmul(g, dy, x, dw);
  }
}
inline void linear_backward(float* dx, float* dw, float* db, CView dy, CView x, CView w, int64_t N,
                            int64_t in, int64_t out, DType compute) {
  thread_local Buf scratch;
  linear_backward(cpu_ops(), scratch, dx, dw, db, dy, x, w, N, in, out, compute);
}

inline CView f32(const float* p) { return CView{p, DType::kF32}; }

// ---- memory estimates (Model::activation_memory) ------------------------------
// How the functions here hand a layer's input to the matmuls: the dtype and
// bf16-exactness of what matmul_input returns.
struct OperandKind {
  DType dtype = DType::kF32;
  bool exact = false;
};
inline OperandKind matmul_input_kind(DType compute) {
  if (compute == DType::kF16) return {DType::kF32, true};
  if (compute != DType::kBF16) return {};
  return kernels::bf16_operands_native() ? OperandKind{DType::kBF16, false} : OperandKind{DType::kF32, true};
}
// Bytes of the scratch matmul_input fills for an n-element activation.
inline int64_t matmul_input_bytes(int64_t n, DType compute) {
  return is_16bit(compute) ? kernels::ScratchTally::operand16_bytes(n, /*in_place=*/true, compute) : 0;
}
// The kernel scratch linear_forward asks for (parameters in compute dtype;
// packed: the weight kept packed, PackedSlot).
inline void tally_linear_forward(kernels::ScratchTally& t, OperandKind x, int64_t N, int64_t in, int64_t out,
                                 bool bias, DType compute, bool packed = false) {
  if (packed)
    t.matmul_packed(forward_desc(N, in, out, bias, compute), x.dtype, x.exact, compute, compute);
  else
    t.matmul(forward_desc(N, in, out, bias, compute), x.dtype, x.exact, compute, false, compute);
}
// ... and linear_backward with an fp32 dy (returns the bytes of the dy copy
// it makes, which its one thread-local scratch holds at most of); dw false:
// a frozen weight, whose weight-gradient product never runs; packed: its
// input gradient's product with the weight kept packed.
inline int64_t tally_linear_backward(kernels::ScratchTally& t, OperandKind x, int64_t N, int64_t in, int64_t out,
                                     bool dx, DType compute, bool dw = true, bool packed = false) {
  OperandKind dy;
  int64_t copy = 0;
  if (is_16bit(compute)) {
    dy = matmul_input_kind(compute);
    copy = kernels::ScratchTally::operand16_bytes(N * out, /*in_place=*/false, compute);
  }
  if (dx && packed) t.matmul_packed(input_grad_desc(N, in, out, compute), dy.dtype, dy.exact, compute);
  else if (dx) t.matmul(input_grad_desc(N, in, out, compute), dy.dtype, dy.exact, compute, false);
  if (dw) {
    kernels::MatmulDesc g = weight_grad_desc(N, in, out, compute);
    t.matmul(g, dy.dtype, dy.exact, x.dtype, x.exact);
    g.accumulate = false;  // the first backward of a window writes it (linear_backward's dw_overwrite)
    t.matmul(g, dy.dtype, dy.exact, x.dtype, x.exact);
  }
  return copy;
}
// The bytes a frozen weight (out, in) keeps packed for its forward and its
// input gradient over N rows (Note [packed frozen weights] in
// kernels/matmul.cpp; the models' packed slots).
inline int64_t packed_linear_bytes(int64_t N, int64_t in, int64_t out, bool bias, DType compute) {
  return kernels::packed_weight_bytes(forward_desc(N, in, out, bias, compute)) +
         kernels::packed_weight_bytes(input_grad_desc(N, in, out, compute));
}
// An AlignedBuffer's bytes as allocated (64-byte aligned blocks).
inline int64_t buffer_bytes(int64_t n, int64_t elem_bytes = 4) {
  return static_cast<int64_t>(round_up(static_cast<size_t>(n * elem_bytes), kSimdAlign));
}

// The view of an activation that only matmuls read (a layer's input): with
// bf16 (fp16) compute converted once for its forward and weight-gradient matmuls
// (kernels::bf16_operand_in_place; `scratch` holds the bf16 copy where one
// is made), else the fp32 buffer itself.
inline CView matmul_input(float* x, int64_t n, DType compute, AlignedBuffer& scratch) {
  if (!is_16bit(compute)) return f32(x);
  return kernels::operand16_in_place(x, n, compute, scratch);
}

}  // namespace zinc::models::detail

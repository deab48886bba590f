// zinc models, private: LoRA adapters on a model's linear layers (models.h's
// LoraConfig), shared by the families that take them.
//
// Note [LoRA by groups]
// The targets that adapt one zinc weight form a group: q, k and v of a
// fused q|k|v, gate and up of a fused gate|up, or one module alone. A
// group's adapters run as one: U = x [A_1; A_2; ...]^T (N, n r), then the
// whole output of the weight = scale * U Bbd^T with Bbd the group's B's
// placed block-diagonally (each B_t at its target's rows and its own r
// columns, zeros elsewhere), added after the base's product wrote it (one
// pass over the output, where a column copy, an accumulate and a copy back
// per target took three; Note [LoRA after the base]). The zeros cost n
// times the adapters' r-wide products, small beside the base's. In backward the same shapes give dBbd =
// scale dy^T U and dA = dU^T x whole (their blocks added to each target's
// gradients), dU = scale dy Bbd and dx += dU [A_1; ...] (after the base's
// input gradient wrote dx) in one product each. A one-member group
// spanning its weight uses A and B themselves and their gradients directly.
// A group whose members cover its weight's rows (q, k and v all adapted;
// gate and up) runs B's products per member instead, on column blocks of
// the output and of dy in place (MatmulDesc::lda/ldb/ldc): no zeros
// multiplied, B and its gradient used as they are. The block-diagonal B
// stays for a group that adapts part of its weight (q and v alone), whose
// other columns it writes as zeros.
//
// Note [LoRA after the base]
// In forward the base's product writes the output and the adapters' B
// products add themselves to it (an accumulating matmul of K = r). The
// other order (the adapters writing first, the base accumulating) made
// the base's wide product read the output back inside its kernel: 8-10%
// slower for q|k|v and gate|up on oneDNN's bf16 brgemm, more than the
// adapters' r-wide products lose by accumulating (measured, 2026-11-29:
// a gate|up layer of the ~100M Llama 15.2 ms against 14.1). Backward takes
// the same order: the base's input gradient writes dx and the adapters'
// dU A adds itself. The base's product reading dx back cost 4-12% of it
// (down_proj's most: its dx is the widest); with the adapters after, the
// ~100M Llama's LoRA backward took 7.7 ms less of oneDNN's time a step
// (339.5 against 347.2 ms, bf16, 2026-11-30, bench/RESULTS.md).
//
// Note [LoRA's B gradient transposed]
// dB = scale dy^T U (the output's width x r) runs as its transpose, dB^T =
// scale U^T dy (r x width), into scratch, then added into B's gradient
// transposed (Ops::add_transposed). The same sums, but oneDNN reads dy
// (N x width, the large operand, a column block of the group's in place)
// as the B operand in its own layout, where dy^T as the A operand went to
// a slower kernel: 2.2x faster for a gate|up member of the ~100M Llama
// (440 us against 200, bf16, measured 2026-11-29).
//
// Note [LoRA dropout]
// PEFT drops each target's input on its own (one nn.Dropout per target:
// y_t += scale B_t A_t dropout_t(x)), so with lora_dropout the members of
// a group no longer share their input and each runs its own U_t = x_t A_t^T
// into its columns of U; B's product over the group stays one. The masks
// are counter-based (Note [dropout masks] in kernels/math.h), keyed by the
// engine's per-micro-batch seed (StepContext::dropout_seed), the layer, the
// group and the member: backward makes x_t again instead of keeping it,
// for dA_t = dU_t^T x_t, and drops dU_t A_t with the same mask for dx. An
// evaluation's seed is 0: nothing dropped, as PEFT in eval(). The masks are
// zinc's own, so a run with dropout matches PEFT's statistically, not bit
// for bit.
//
// Note [LoRA over tensor parts]
// With tensor parts (Note [tensor parallelism] in engine/tensor_parallel.cpp)
// each adapter splits the way its weight does, so that a part's group is
// an ordinary group of the part's sizes and the code above runs unchanged:
//   - a weight split by rows (q|k|v, gate|up: y_t = x W_t^T, each part
//     its rows t): B splits by the same rows, A stays whole. U = x A^T is
//     the same on every part and y_t += s U B_t^T is the part's rows of
//     the whole. dB_t is the part's own; dA = dU^T x with dU = s dy_t B_t
//     is a partial sum over the parts (TensorSplit::sum_grads: the engine
//     adds them at the step), and so is the adapters' share of dx, which
//     joins the base's before the parts add it up.
//   - a weight split by columns (o, down: y = sum_t x_t W_t^T): A splits by
//     the same columns, B stays whole. U_t = x_t A_t^T is a partial sum,
//     and so is s U_t B^T, which the parts' all-reduce of the base's
//     output adds up with it: y = x W^T + s (sum_t U_t) B^T. dy is whole
//     on every part, so dU = s dy B is too and dA_t = dU^T x_t and dx_t +=
//     dU A_t are the part's own; dB = s dy^T U_t is a partial sum
//     (sum_grads).
// Dropout: a row-split weight's input is whole, and every part draws the
// same mask (the same seed: the parts share the data replica's). A
// column-split weight's input is the part's columns; its mask is those
// columns of the whole input's (kernels::DropoutColumns), so the parts drop
// what one rank would. So a run at T parts is the run at 1 to float
// rounding, dropout or not, and its adapters are gathered whole into
// checkpoints and PEFT files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/model.h"
#include "kernels/math.h"
#include "models/detail/linear.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {

// One target of a group: A's and B's indices in the layer's adapter block,
// and the rows of the group's weight its B covers.
struct LoraMember {
  int a = -1, b = -1;
  int64_t row = 0, rows = 0;
};
// A group: the input width, the weight's rows (the output's width) and its
// adapted targets (none: nothing to do).
struct LoraGroup {
  int64_t in = 0, width = 0;
  std::vector<LoraMember> members;
};

// A group's dropout (Note [LoRA dropout]): off where p or key is 0.
// `cols`: a tensor part's columns of a row-parallel weight's input, which
// drop as the whole input's would (Note [LoRA over tensor parts]).
struct LoraDropout {
  float p = 0.0f;
  uint64_t key = 0;
  kernels::DropoutColumns cols;
  bool on() const { return p > 0.0f && key != 0; }
  // The stream of group `g` of layer `l` under the forward's seed.
  static LoraDropout of(double p, uint64_t seed, int64_t l, int64_t g, kernels::DropoutColumns cols = {}) {
    if (p <= 0.0 || seed == 0) return {};
    return {static_cast<float>(p), kernels::math::dropout_subkey(seed, static_cast<uint64_t>(l * 64 + g)), cols};
  }
};

// A layer's adapter block in backward: held, with its gradient buffers
// (nothing where the model has no adapters).
struct HeldAdapter {
  HeldParams p;
  BlockGrads g;
  const HeldParams* get() const { return p.held() ? &p : nullptr; }
};
// block < 0: no adapters.
inline HeldAdapter hold_adapter(StepContext& ctx, int block) {
  HeldAdapter h;
  if (block < 0) return h;
  h.p = ctx.acquire(block);
  h.g = ctx.grads(block);
  return h;
}

// Every layer's groups in one list (the scratch and the estimate size by all of them).
template <class Layers>
std::vector<LoraGroup> lora_all_groups(const Layers& layers) {
  std::vector<LoraGroup> all;
  for (const auto& layer : layers) all.insert(all.end(), layer.begin(), layer.end());
  return all;
}

// What a group's forward keeps for its backward: U and what B's products read of it.
struct LoraSaved {
  CView u_in;
  Buf u16;
};

// The scratch every group of a model shares (sized by ensure for the largest).
class LoraScratch {
 public:
  // dropout: also the buffers of Note [LoRA dropout] (dropout_bytes).
  void ensure(Ops& ops, int64_t N, int64_t r, const std::vector<LoraGroup>& groups, bool dropout = false) {
    const auto [in, width, n, out] = sizes(groups);
    if (N == N_ && r == r_ && in == in_ && width == width_ && n == n_ && out == out_ && dropout == dropout_) return;
    N_ = N, r_ = r, in_ = in, width_ = width, n_ = n, out_ = out, dropout_ = dropout;
    const size_t nr = static_cast<size_t>(n * r);
    du = ops.alloc_f32(static_cast<size_t>(N) * nr);
    ag = ops.alloc_f32(nr * static_cast<size_t>(in));
    dag = ops.alloc_f32(nr * static_cast<size_t>(in));
    bbd = ops.alloc_f32(static_cast<size_t>(width) * nr);
    dbbd = ops.alloc_f32(static_cast<size_t>(width) * nr);
    wide = ops.alloc_f32(static_cast<size_t>(r * std::max(in, out)));
    if (dropout) {
      xd = ops.alloc_f32(static_cast<size_t>(N * in));
      uj = ops.alloc_f32(static_cast<size_t>(N * r));
    }
  }
  // What ensure allocates for these groups (the estimate's count), with the
  // 16-bit copies the products make of dU and a member's dropped input.
  static int64_t bytes(int64_t N, int64_t r, const std::vector<LoraGroup>& groups, bool dropout, DType dt) {
    const auto [in, width, n, out] = sizes(groups);
    const int64_t nr = n * r;
    int64_t b = buffer_bytes(N * nr) + matmul_input_bytes(N * nr, dt) + 2 * buffer_bytes(nr * in) +
                2 * buffer_bytes(width * nr) + buffer_bytes(r * std::max(in, out));
    if (dropout) b += buffer_bytes(N * in) + matmul_input_bytes(N * in, dt) + buffer_bytes(N * r);
    return b;
  }
  Buf du, du16, ag, dag, bbd, dbbd, wide, xd, xd16, uj;

 private:
  // The groups' widest input, widest output, most members and most rows of one member.
  struct Sizes {
    int64_t in = 0, width = 0, n = 0, out = 0;
  };
  static Sizes sizes(const std::vector<LoraGroup>& groups) {
    Sizes z;
    for (const LoraGroup& g : groups) {
      z.in = std::max(z.in, g.in);
      z.width = std::max(z.width, g.width);
      z.n = std::max<int64_t>(z.n, static_cast<int64_t>(g.members.size()));
      for (const LoraMember& m : g.members) z.out = std::max(z.out, m.rows);
    }
    return z;
  }
  int64_t N_ = -1, r_ = -1, in_ = -1, width_ = -1, n_ = -1, out_ = -1;
  bool dropout_ = false;
};

// The (N, n r) bytes a group's U takes (ActivationMemory).
inline int64_t lora_u_bytes(int64_t N, int64_t r, const LoraGroup& g, DType dt) {
  const int64_t n = N * r * static_cast<int64_t>(g.members.size());
  return buffer_bytes(n) + matmul_input_bytes(n, dt);
}

namespace lora_impl {
// A compute-dtype parameter as fp32: itself, or widened into `at`, marked
// exact in the compute dtype.
inline CView as_f32(Ops& ops, CView p, int64_t n, float* at, DType dt) {
  if (p.dtype == DType::kF32) return p;
  ops.to_f32(at, p, n);
  return CView{at, DType::kF32, is_16bit(dt)};
}
inline bool direct(const LoraGroup& g) { return g.members.size() == 1 && g.members[0].rows == g.width; }
// Whether the members' rows cover the weight's, in order (B's products per member).
inline bool covers(const LoraGroup& g) {
  int64_t end = 0;
  for (const LoraMember& m : g.members) {
    if (m.row != end) return false;
    end += m.rows;
  }
  return g.members.size() > 1 && end == g.width;
}
// dx (N, in) += dU A over the k = n r columns of dU (Note [LoRA after the base]).
inline kernels::MatmulDesc adapter_dx_desc(int64_t N, int64_t in, int64_t k, DType dt) {
  kernels::MatmulDesc d = input_grad_desc(N, in, k, dt);
  d.accumulate = true;
  return d;
}
// A view `elems` elements on.
inline CView at(CView v, int64_t elems) {
  v.data = static_cast<const char*>(v.data) + static_cast<size_t>(elems) * dtype_bytes(v.dtype);
  return v;
}
// Member j's input dropped (Note [LoRA dropout]) into s.xd, as the matmuls read it.
inline CView dropped_input(Ops& ops, LoraScratch& s, CView x, int64_t N, int64_t in, const LoraDropout& drop,
                           int64_t j, DType dt) {
  float* xd = s.xd.as<float>();
  const float* src = static_cast<const float*>(x.data);
  if (x.dtype != DType::kF32) {
    ops.to_f32(xd, x, N * in);
    src = xd;
  }
  ops.dropout(xd, src, N * in, drop.p, kernels::math::dropout_subkey(drop.key, static_cast<uint64_t>(j)), false,
              drop.cols);
  return ops.matmul_input(xd, N * in, dt, s.xd16);
}
// dB^T (k x width) = scale U^T dy over the N rows: U's k columns (of its
// row stride lda) and dy's `width` columns (of its row stride ldb), written
// (Note [LoRA's B gradient transposed]).
inline kernels::MatmulDesc b_grad_desc(int64_t N, int64_t k, int64_t width, int64_t lda, int64_t ldb, float scale,
                                       DType dt) {
  kernels::MatmulDesc d;
  d.M = k;
  d.N = width;
  d.K = N;
  d.trans_a = true;
  d.alpha = scale;
  d.lda = lda == k ? 0 : lda;
  d.ldb = ldb == width ? 0 : ldb;
  d.compute = dt;
  return d;
}
// Rows [j r, (j + 1) r) of the group's A operand (stacked fp32, or A itself).
inline CView a_rows(CView A, int64_t j, int64_t r, int64_t in) {
  if (j == 0) return A;
  return CView{static_cast<const float*>(A.data) + j * r * in, A.dtype, A.bf16_exact};
}
// The group's stacked A (n r, in) and block-diagonal B (width, n r; not
// made for a covering group, whose B's products run per member).
inline std::pair<CView, CView> operands(Ops& ops, LoraScratch& s, const HeldParams& lp, const LoraGroup& g, int64_t r,
                                        DType dt) {
  if (direct(g)) return {lp[g.members[0].a], lp[g.members[0].b]};
  const int64_t n = static_cast<int64_t>(g.members.size()), nr = n * r;
  const bool with_bbd = !covers(g);
  float* ag = s.ag.as<float>();
  float* bbd = s.bbd.as<float>();
  float* wide = s.wide.as<float>();
  if (with_bbd) ops.zero(bbd, g.width * nr);
  for (int64_t j = 0; j < n; ++j) {
    const LoraMember& m = g.members[static_cast<size_t>(j)];
    const CView a = as_f32(ops, lp[m.a], r * g.in, wide, dt);
    ops.copy_columns(ag + j * r * g.in, g.in, static_cast<const float*>(a.data), g.in, r, g.in);
    if (!with_bbd) continue;
    const CView b = as_f32(ops, lp[m.b], m.rows * r, wide, dt);
    ops.copy_columns(bbd + m.row * nr + j * r, nr, static_cast<const float*>(b.data), r, m.rows, r);
  }
  return {CView{ag, DType::kF32, is_16bit(dt)}, with_bbd ? CView{bbd, DType::kF32, is_16bit(dt)} : CView{}};
}
}  // namespace lora_impl

// dst (N, g.width) += scale * (x A^T) Bbd^T, after the base's product wrote
// dst (Note [LoRA after the base]); U goes to u (N, n r) and `saved`.
// Returns whether it added anything (false: the group adapts nothing).
inline bool lora_forward(Ops& ops, LoraScratch& s, const HeldParams& lp, const LoraGroup& g, int64_t r, float scale,
                         CView x, float* dst, int64_t N, DType dt, float* u, LoraSaved& saved,
                         const LoraDropout& drop = {}) {
  if (g.members.empty()) return false;
  const int64_t n = static_cast<int64_t>(g.members.size()), nr = n * r;
  const auto [A, Bbd] = lora_impl::operands(ops, s, lp, g, r, dt);
  if (!drop.on()) {
    linear_forward(ops, u, x, A, CView{}, N, g.in, nr, dt);
  } else {
    // Note [LoRA dropout]: each member's U from its own dropped input.
    for (int64_t j = 0; j < n; ++j) {
      const CView xj = lora_impl::dropped_input(ops, s, x, N, g.in, drop, j, dt);
      float* uj = n == 1 ? u : s.uj.as<float>();
      linear_forward(ops, uj, xj, lora_impl::a_rows(A, j, r, g.in), CView{}, N, g.in, r, dt);
      if (n > 1) ops.copy_columns(u + j * r, nr, uj, r, N, r);
    }
  }
  saved.u_in = ops.matmul_input(u, N * nr, dt, saved.u16);
  if (lora_impl::covers(g)) {
    // Each member's columns of the output from its columns of U.
    for (int64_t j = 0; j < n; ++j) {
      const LoraMember& m = g.members[static_cast<size_t>(j)];
      kernels::MatmulDesc d = forward_desc(N, r, m.rows, false, dt);
      d.alpha = scale;
      d.lda = nr;
      d.ldc = g.width;
      d.accumulate = true;
      ops.matmul(d, lora_impl::at(saved.u_in, j * r), lp[m.b], dst + m.row);
    }
    return true;
  }
  kernels::MatmulDesc d = forward_desc(N, nr, g.width, false, dt);
  d.alpha = scale;
  d.accumulate = true;
  ops.matmul(d, saved.u_in, Bbd, dst);
  return true;
}

// Backward from dy_in (the gradient of the group's whole output as the
// matmuls read it): the adapters' gradients into lg, and dx (N, g.in) +=
// the adapters' part of the input's gradient, after the base's part wrote
// it (Note [LoRA after the base]; null: nothing needs the input's
// gradient, Note [no input gradient under a frozen embedding]). Returns
// whether it added to dx.
inline bool lora_backward(Ops& ops, LoraScratch& s, const HeldParams& lp, const BlockGrads& lg, const LoraGroup& g,
                          int64_t r, float scale, CView x, const LoraSaved& saved, CView dy_in, float* dx, int64_t N,
                          DType dt, const LoraDropout& drop = {}) {
  if (g.members.empty()) return false;
  const int64_t n = static_cast<int64_t>(g.members.size()), nr = n * r, W = g.width, in = g.in;
  const auto [A, Bbd] = lora_impl::operands(ops, s, lp, g, r, dt);
  const bool direct = lora_impl::direct(g), covers = lora_impl::covers(g);
  float* dbbd = s.dbbd.as<float>();  // dB^T: a member's, or the group's (nr, W)
  if (covers) {
    // Per member, on its columns of dy: dB_j += s dy_j^T U_j (as its
    // transpose: Note [LoRA's B gradient transposed]) and dU_j = s dy_j B_j.
    for (int64_t j = 0; j < n; ++j) {
      const LoraMember& m = g.members[static_cast<size_t>(j)];
      ops.matmul(lora_impl::b_grad_desc(N, r, m.rows, nr, W, scale, dt), lora_impl::at(saved.u_in, j * r),
                 lora_impl::at(dy_in, m.row), dbbd);
      ops.add_transposed(lg[m.b], r, dbbd, m.rows, m.rows, r);
      kernels::MatmulDesc du = input_grad_desc(N, r, m.rows, dt);
      du.alpha = scale;
      du.lda = W;
      du.ldc = nr;
      ops.matmul(du, lora_impl::at(dy_in, m.row), lp[m.b], s.du.as<float>() + j * r);
    }
  } else {
    // dBbd^T = s U^T dy (Note [LoRA's B gradient transposed]); a direct
    // group's is its B's gradient.
    ops.matmul(lora_impl::b_grad_desc(N, nr, W, nr, W, scale, dt), saved.u_in, dy_in, dbbd);
    if (direct) ops.add_transposed(lg[g.members[0].b], r, dbbd, W, W, r);
    // dU = s dy Bbd
    kernels::MatmulDesc du = input_grad_desc(N, nr, W, dt);
    du.alpha = scale;
    ops.matmul(du, dy_in, Bbd, s.du.as<float>());
  }
  if (drop.on()) {
    // Note [LoRA dropout], per member: dA_j += dU_j^T x_j with x_j made
    // again, and dx (=, then +=) the dropped dU_j A_j.
    for (int64_t j = 0; j < n; ++j) {
      const LoraMember& m = g.members[static_cast<size_t>(j)];
      float* uj = s.du.as<float>();
      if (n > 1) {
        uj = s.uj.as<float>();
        ops.copy_columns(uj, r, s.du.as<float>() + j * r, nr, N, r);
      }
      const CView duj = ops.matmul_input(uj, N * r, dt, s.du16);
      const CView xj = lora_impl::dropped_input(ops, s, x, N, in, drop, j, dt);
      kernels::MatmulDesc da = weight_grad_desc(N, in, r, dt);
      da.accumulate = true;
      ops.matmul(da, duj, xj, lg[m.a]);
      if (!dx) continue;
      float* t = s.xd.as<float>();  // x_j is no longer needed
      ops.matmul(input_grad_desc(N, in, r, dt), duj, lora_impl::a_rows(A, j, r, in), t);
      ops.dropout(dx, t, N * in, drop.p, kernels::math::dropout_subkey(drop.key, static_cast<uint64_t>(j)), true,
                  drop.cols);
    }
    if (!direct && !covers)
      for (int64_t j = 0; j < n; ++j) {  // member j's block of dBbd^T: rows j r.., columns m.row..
        const LoraMember& m = g.members[static_cast<size_t>(j)];
        ops.add_transposed(lg[m.b], r, dbbd + j * r * W + m.row, W, m.rows, r);
      }
    return dx != nullptr;
  }
  const CView du_in = ops.matmul_input(s.du.as<float>(), N * nr, dt, s.du16);
  // dA = dU^T x
  kernels::MatmulDesc da = weight_grad_desc(N, in, nr, dt);
  da.accumulate = direct;
  float* dag = direct ? lg[g.members[0].a] : s.dag.as<float>();
  ops.matmul(da, du_in, x, dag);
  // dx += dU A
  if (dx) ops.matmul(lora_impl::adapter_dx_desc(N, in, nr, dt), du_in, A, dx);
  if (direct) return dx != nullptr;
  // Each target's blocks of dBbd^T and dA, added to its gradients.
  for (int64_t j = 0; j < n; ++j) {
    const LoraMember& m = g.members[static_cast<size_t>(j)];
    if (!covers) ops.add_transposed(lg[m.b], r, dbbd + j * r * W + m.row, W, m.rows, r);
    ops.add(lg[m.a], lg[m.a], dag + j * r * in, r * in);
  }
  return dx != nullptr;
}

// The kernel scratch the groups' products ask for (Model::activation_memory:
// the same descriptors as lora_forward and lora_backward, so that the
// oneDNN primitives a CPU picks for them, and their scratchpads, are
// counted).
inline void lora_tally(kernels::ScratchTally& t, int64_t N, int64_t r, float scale, const std::vector<LoraGroup>& groups,
                       DType dt, bool dropout) {
  const OperandKind act = matmul_input_kind(dt);  // x, U, dU and dy as the products read them
  const OperandKind dy = is_16bit(dt) ? act : OperandKind{};
  const bool exact = is_16bit(dt);
  for (const LoraGroup& g : groups) {
    if (g.members.empty()) continue;
    const int64_t n = static_cast<int64_t>(g.members.size()), nr = n * r, W = g.width, in = g.in;
    const bool direct = lora_impl::direct(g), covers = lora_impl::covers(g);
    const DType a_dtype = direct ? dt : DType::kF32;  // A itself, or the stacked copy
    const bool a_exact = direct ? false : exact;
    if (dropout) {
      t.matmul(forward_desc(N, in, r, false, dt), act.dtype, act.exact, a_dtype, a_exact);
      kernels::MatmulDesc da = weight_grad_desc(N, in, r, dt);
      t.matmul(da, act.dtype, act.exact, act.dtype, act.exact);
      t.matmul(input_grad_desc(N, in, r, dt), act.dtype, act.exact, a_dtype, a_exact);
    } else {
      t.matmul(forward_desc(N, in, nr, false, dt), act.dtype, act.exact, a_dtype, a_exact);
      kernels::MatmulDesc da = weight_grad_desc(N, in, nr, dt);
      da.accumulate = direct;
      t.matmul(da, act.dtype, act.exact, act.dtype, act.exact);
      t.matmul(lora_impl::adapter_dx_desc(N, in, nr, dt), act.dtype, act.exact, a_dtype, a_exact);
    }
    if (covers) {
      for (const LoraMember& m : g.members) {
        kernels::MatmulDesc y = forward_desc(N, r, m.rows, false, dt);
        y.alpha = scale;
        y.lda = nr;
        y.ldc = W;
        y.accumulate = true;
        t.matmul(y, act.dtype, act.exact, dt, false);
        t.matmul(lora_impl::b_grad_desc(N, r, m.rows, nr, W, scale, dt), act.dtype, act.exact, dy.dtype, dy.exact);
        kernels::MatmulDesc du = input_grad_desc(N, r, m.rows, dt);
        du.alpha = scale;
        du.lda = W;
        du.ldc = nr;
        t.matmul(du, dy.dtype, dy.exact, dt, false);
      }
    } else {
      const DType b_dtype = direct ? dt : DType::kF32;  // B itself, or the block-diagonal copy
      const bool b_exact = direct ? false : exact;
      kernels::MatmulDesc y = forward_desc(N, nr, W, false, dt);
      y.alpha = scale;
      y.accumulate = true;
      t.matmul(y, act.dtype, act.exact, b_dtype, b_exact);
      t.matmul(lora_impl::b_grad_desc(N, nr, W, nr, W, scale, dt), act.dtype, act.exact, dy.dtype, dy.exact);
      kernels::MatmulDesc du = input_grad_desc(N, nr, W, dt);
      du.alpha = scale;
      t.matmul(du, dy.dtype, dy.exact, b_dtype, b_exact);
    }
  }
}

}  // namespace zinc::models::detail

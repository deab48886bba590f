// Next-token MLP over the zinc model interface. Shapes: B batch, T sequence,
// N = B*T rows, E n_embd, X = context*E input width, Hd hidden, V vocabulary.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "core/alloc.h"
#include "core/error.h"
#include "core/parallel.h"
#include "models/detail/linear.h"
#include "models/models.h"

namespace zinc::models {
namespace {

using detail::f32;
using kernels::CView;

class Mlp final : public Model {
 public:
  explicit Mlp(const MlpConfig& c) : c_(c) {
    if (auto bad = size_error(c)) throw Error("mlp: " + bad->field + ": " + bad->message);
    specs_.push_back({"embed", {{"wte", {c.vocab_size, c.n_embd}}}});
    for (int64_t l = 0; l < c.n_layer; ++l) {
      int64_t in = l == 0 ? c.context * c.n_embd : c.hidden;
      float std = 1.0f / std::sqrt(static_cast<float>(in));
      specs_.push_back({"fc." + std::to_string(l),
                        {{"weight", {c.hidden, in}, Init::kNormal, std}, {"bias", {c.hidden}, Init::kZeros}}});
    }
    specs_.push_back({"head",
                      {{"weight", {c.vocab_size, c.hidden}, Init::kNormal, 0.02f},
                       {"bias", {c.vocab_size}, Init::kZeros}}});
  }

  std::string name() const override { return "mlp"; }
  const std::vector<BlockSpec>& blocks() const override { return specs_; }
  double flops_per_token(int64_t) const override {
    double p = static_cast<double>(c_.context * c_.n_embd * c_.hidden) +
               static_cast<double>((c_.n_layer - 1) * c_.hidden * c_.hidden) +
               static_cast<double>(c_.hidden * c_.vocab_size);
    return 6.0 * p;
  }

  // The buffers ensure_buffers allocates and the linear layers' kernel
  // calls by shape (keep in step with both).
  std::optional<ActivationMemory> activation_memory(int64_t B, int64_t T, DType dt) const override {
    using detail::buffer_bytes;
    const int64_t N = B * T, X = c_.context * c_.n_embd, Hd = c_.hidden, V = c_.vocab_size, L = c_.n_layer;
    ActivationMemory m;
    m.saved = 2 * buffer_bytes(N * X) + (2 * L + 2) * buffer_bytes(N * Hd) + 2 * buffer_bytes(N * V) +
              N * static_cast<int64_t>(sizeof(int32_t));
    kernels::ScratchTally t;
    const detail::OperandKind x;  // the layers' inputs go to the matmuls as plain fp32
    int64_t dy_copy = 0;
    for (int64_t l = 0; l <= L; ++l) {
      const int64_t in = l == 0 ? X : Hd, out = l == L ? V : Hd;
      detail::tally_linear_forward(t, x, N, in, out, true, dt);
      dy_copy = std::max(dy_copy, detail::tally_linear_backward(t, x, N, in, out, true, dt));
    }
    m.workspace = t.bytes() + dy_copy;
    return m;
  }

  float forward(StepContext& ctx, const Batch& batch) override {
    const int64_t B = batch.B, T = batch.T, N = B * T, E = c_.n_embd, X = c_.context * E;
    const int64_t Hd = c_.hidden, V = c_.vocab_size;
    ensure_buffers(B, T);
    tokens_ = batch.inputs;
    positions_ = batch.positions;
    const DType dt = ctx.compute_dtype();

    // Gather the context window: row (b,t), slot j holds token t-context+1+j,
    // zeros before the row's start and, with packed documents, before the
    // document's (as attention sees none of an earlier document).
    HeldParams emb = ctx.acquire(0);
    CView wte = emb[0];
    float* x0 = x_[0].as<float>();
    for (int64_t k = 0; k < N; ++k) {  // validate before the parallel gather
      int32_t tok = batch.inputs[static_cast<size_t>(k)];
      if (tok < 0 || tok >= V)
        throw Error("mlp: input token " + std::to_string(tok) + " at position " + std::to_string(k) +
                    " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
    parallel_for(static_cast<size_t>(N), 64, [&](size_t lo, size_t hi) {
      for (size_t r = lo; r < hi; ++r) {
        const int64_t b = static_cast<int64_t>(r) / T, t = static_cast<int64_t>(r) % T;
        float* row = x0 + static_cast<int64_t>(r) * X;
        const int64_t first = first_seen(b, t, T);
        for (int64_t j = 0; j < c_.context; ++j) {
          int64_t src = t - c_.context + 1 + j;
          float* dst = row + j * E;
          if (src < first) {
            std::memset(dst, 0, static_cast<size_t>(E) * sizeof(float));
          } else {
            int64_t tok = batch.inputs[static_cast<size_t>(b * T + src)];
            for (int64_t e = 0; e < E; ++e) dst[e] = wte.at(tok * E + e);
          }
        }
      }
    });
    emb.release();

    for (int64_t l = 0; l < c_.n_layer; ++l) {
      const int blk = static_cast<int>(l + 1);
      HeldParams p = ctx.acquire(blk);
      int64_t in = l == 0 ? X : Hd;
      detail::linear_forward(pre_[l].as<float>(), f32(x_[l].as<float>()), p[0], p[1], N, in, Hd, dt);
      kernels::gelu_forward(x_[l + 1].as<float>(), pre_[l].as<float>(), N * Hd);
      p.release();
    }
    const int head = static_cast<int>(c_.n_layer + 1);
    HeldParams ph = ctx.acquire(head);
    detail::linear_forward(logits_.as<float>(), f32(x_[c_.n_layer].as<float>()), ph[0], ph[1], N, Hd, V, dt);
    ph.release();
    return static_cast<float>(kernels::cross_entropy(logits_.as<float>(), batch.targets.data(), N, V,
                                                     dlogits_.as<float>(), 1.0f));
  }

  void backward(StepContext& ctx, float loss_scale) override {
    const int64_t B = B_, T = T_, N = B * T, E = c_.n_embd, X = c_.context * E;
    const int64_t Hd = c_.hidden, V = c_.vocab_size;
    const DType dt = ctx.compute_dtype();
    if (loss_scale != 1.0f) kernels::scale(dlogits_.as<float>(), loss_scale, N * V);

    const int head = static_cast<int>(c_.n_layer + 1);
    HeldParams ph = ctx.acquire(head);
    BlockGrads gh = ctx.grads(head);
    float* dh = dh_.as<float>();  // (N, Hd)
    detail::linear_backward(dh, gh[0], gh[1], f32(dlogits_.as<float>()), f32(x_[c_.n_layer].as<float>()), ph[0],
                            N, Hd, V, dt);
    ph.release();
    ctx.grads_ready(head);

    for (int64_t l = c_.n_layer - 1; l >= 0; --l) {
      const int blk = static_cast<int>(l + 1);
      HeldParams p = ctx.acquire(blk);
      BlockGrads g = ctx.grads(blk);
      int64_t in = l == 0 ? X : Hd;
      kernels::gelu_backward(dpre_.as<float>(), pre_[l].as<float>(), dh, N * Hd);
      float* dx = l == 0 ? dx0_.as<float>() : dh;
      detail::linear_backward(dx, g[0], g[1], f32(dpre_.as<float>()), f32(x_[l].as<float>()), p[0], N, in, Hd,
                              dt);
      p.release();
      ctx.grads_ready(blk);
    }

    // Scatter the window gradient into the embedding rows, in row order so the
    // sum is deterministic. Parallel over embedding columns.
    BlockGrads ge = ctx.grads(0);
    float* dwte = ge[0];
    const float* dx0 = dx0_.as<float>();
    parallel_for(static_cast<size_t>(E), 8, [&](size_t elo, size_t ehi) {
      for (int64_t r = 0; r < N; ++r) {
        const int64_t b = r / T, t = r % T, first = first_seen(b, t, T);
        for (int64_t j = 0; j < c_.context; ++j) {
          int64_t src = t - c_.context + 1 + j;
          if (src < first) continue;
          int64_t tok = tokens_[static_cast<size_t>(b * T + src)];
          const float* g = dx0 + r * X + j * E;
          for (size_t e = elo; e < ehi; ++e) dwte[tok * E + static_cast<int64_t>(e)] += g[e];
        }
      }
    });
    ctx.grads_ready(0);
  }

 private:
  void ensure_buffers(int64_t B, int64_t T) {
    if (B == B_ && T == T_) return;
    const size_t N = static_cast<size_t>(B * T), X = static_cast<size_t>(c_.context * c_.n_embd);
    const size_t Hd = static_cast<size_t>(c_.hidden), V = static_cast<size_t>(c_.vocab_size);
    x_.clear();
    pre_.clear();
    x_.push_back(make_buffer<float>(N * X));
    for (int64_t l = 0; l < c_.n_layer; ++l) {
      pre_.push_back(make_buffer<float>(N * Hd));
      x_.push_back(make_buffer<float>(N * Hd));
    }
    logits_ = make_buffer<float>(N * V);
    dlogits_ = make_buffer<float>(N * V);
    dh_ = make_buffer<float>(N * Hd);
    dpre_ = make_buffer<float>(N * Hd);
    dx0_ = make_buffer<float>(N * X);
    B_ = B;
    T_ = T;
  }

  MlpConfig c_;
  std::vector<BlockSpec> specs_;
  std::vector<AlignedBuffer> x_;    // x_[0] (N,X) window; x_[l+1] (N,Hd) layer l output
  std::vector<AlignedBuffer> pre_;  // (N,Hd) layer l before GELU
  AlignedBuffer logits_, dlogits_, dh_, dpre_, dx0_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> positions_;  // the batch's packed-document positions (empty: none)
  // The first token row (b, t)'s window sees: the row's, or its document's.
  int64_t first_seen(int64_t b, int64_t t, int64_t T) const {
    return positions_.empty() ? 0 : t - positions_[static_cast<size_t>(b * T + t)];
  }
  int64_t B_ = 0, T_ = 0;
};

}  // namespace

std::optional<SizeError> size_error(const MlpConfig& c) {
  if (c.vocab_size < 2) return SizeError{"vocab_size", "must be >= 2, got " + std::to_string(c.vocab_size)};
  for (auto [field, v] : {std::pair<const char*, int64_t>{"context", c.context},
                          {"n_embd", c.n_embd},
                          {"hidden", c.hidden},
                          {"n_layer", c.n_layer}}) {
    if (v < 1) return SizeError{field, "must be >= 1, got " + std::to_string(v)};
  }
  if (const std::string why = layers_refusal(c.n_layer); !why.empty()) return SizeError{"n_layer", why};
  return std::nullopt;
}

std::shared_ptr<Model> make_mlp(const MlpConfig& cfg) { return std::make_shared<Mlp>(cfg); }

}  // namespace zinc::models

// zinc engine: the model interface.
//
// A model is a list of blocks; a block is a group of parameters that the
// engine fetches, reduces and offloads together (a transformer layer, the
// embeddings, the final norm). Each block's parameters live in one flat
// vector (see BlockLayout); the model never owns parameters or parameter
// gradients: it asks the engine for them through a StepContext at block
// boundaries, which is what lets the engine gather (ZeRO-3), prefetch, and
// start reducing a block's gradients while backward continues.
//
// Models own their activations. forward() and backward() are called from one
// thread (the training thread); the model may use OpenMP inside kernels.
// This header is the only engine header that models/ may include.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "data/data.h"  // Batch
#include "kernels/kernels.h"

namespace zinc {

// kUniform: U(-init_std, init_std) (LoRA's A, PEFT's Kaiming-uniform bound).
enum class Init { kZeros, kOnes, kNormal, kUniform };

// Where a model computes: its activations and the parameter and gradient
// views the engine hands it (StepContext) live on the host (kCpu) or in GPU
// memory (kCuda; CUDA builds).
enum class Device { kCpu, kCuda };
inline const char* device_name(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }

// Tensor parallelism (Note [tensor parallelism] in engine/tensor_parallel.cpp):
// which part of the whole parameter a tensor-parallel rank's parameter is.
// kRows: the whole parameter's rows in `ranges` ([first, first + count),
// in this order, one after the other: a column-parallel weight, e.g. each
// of q, k and v's rows of this rank's heads); kColumns: its columns in
// `ranges` (a row-parallel weight, o_proj and down_proj). kWhole: every
// rank holds all of it (norms, the embedding, biases after the sum).
// sum_grads: a whole parameter that each part uses on its own share of
// the work (Qwen3's per-head q and k norms, on the part's heads): its
// gradient is the sum of the parts' (the engine adds them up).
struct TensorSplit {
  enum Kind { kWhole, kRows, kColumns };
  Kind kind = kWhole;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (first, count)
  bool sum_grads = false;
  bool operator==(const TensorSplit&) const = default;
};

struct ParamSpec {
  std::string name;  // e.g. "attn.qkv.weight"
  Shape shape;
  Init init = Init::kNormal;
  float init_std = 0.02f;  // for kNormal (mean 0); kUniform's bound
  // Note [gradients written, not zeroed]: the model's backward writes this
  // parameter's whole gradient in one product where BlockGrads::overwrite
  // says so (and adds to it otherwise), so the engine need not zero it
  // between steps.
  bool grad_overwrite = false;
};

struct BlockSpec {
  std::string name;  // e.g. "h.3"
  std::vector<ParamSpec> params;
  // A frozen block (LoRA's base weights) is never trained: the engine keeps
  // its compute parameters (gathered, sharded and offloaded as any block's)
  // but gives it no gradient buffer, no master copy and no optimizer state.
  // The model never asks for its grads() nor reports it grads_ready(), and a
  // checkpoint does not hold it (it comes from initial_values on resume).
  bool frozen = false;
};

// Where each parameter sits in its block's flat vector. Offsets are multiples
// of kParamAlignNumel elements so that every parameter starts 64-byte aligned
// in fp32 and bf16 alike.
constexpr int64_t kParamAlignNumel = 32;
struct BlockLayout {
  std::vector<int64_t> offsets;  // per param, in elements
  std::vector<int64_t> numels;   // per param
  std::vector<uint8_t> overwrite;  // per param: ParamSpec::grad_overwrite
  int64_t numel = 0;             // used elements (end of the last param, aligned)
  static BlockLayout from_spec(const BlockSpec& spec) {
    BlockLayout l;
    int64_t off = 0;
    for (const ParamSpec& p : spec.params) {
      // Checked: a model's sizes come from a user's config, and a block of
      // 2^63 elements or more is refused here rather than wrapped.
      int64_t n = 1;
      for (int i = 0; i < p.shape.ndim; ++i)
        if (p.shape.dims[i] < 0 || __builtin_mul_overflow(n, p.shape.dims[i], &n))
          throw Error("block '" + spec.name + "': parameter '" + p.name +
                      "' has more elements than a 64-bit count holds (or a negative size)");
      l.offsets.push_back(off);
      l.numels.push_back(n);
      l.overwrite.push_back(p.grad_overwrite ? 1 : 0);
      const int64_t aligned = n / kParamAlignNumel * kParamAlignNumel + (n % kParamAlignNumel ? kParamAlignNumel : 0);
      if (aligned < n || __builtin_add_overflow(off, aligned, &off))
        throw Error("block '" + spec.name + "' has more elements than a 64-bit count holds (at parameter '" +
                    p.name + "')");
    }
    l.numel = off;
    return l;
  }
  // Elements of the parameters themselves (numel less the alignment gaps).
  int64_t param_numel() const {
    int64_t n = 0;
    for (int64_t k : numels) n += k;
    return n;
  }
};

// A block's parameters in compute precision (fp32, or bf16 with bf16 on).
struct BlockParams {
  const void* base = nullptr;
  DType dtype = DType::kF32;
  const BlockLayout* layout = nullptr;
  // Nonzero where these parameters stay at this address with these values
  // for as long as the number is the same (a frozen block the engine holds
  // in place: ZeRO stages 0-2), so that a model may keep what it derives
  // from them (Note [packed frozen weights] in kernels/matmul.cpp); 0 where
  // they may move or change between acquires.
  uint64_t generation = 0;
  kernels::CView operator[](int i) const {
    return {static_cast<const char*>(base) + layout->offsets[i] * dtype_bytes(dtype), dtype};
  }
};

// A block's gradient accumulators (fp32, same layout as the parameters).
// Note [gradients written, not zeroed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A gradient buffer is an accumulator: backward adds to it, and the engine
// used to zero every block's buffer after each step. For a weight whose
// gradient is one product per backward (dW = dy^T x), the zeroing and the
// product's read of those zeros (oneDNN's sum post-op) are pure memory
// traffic: 8-10% of a weight-gradient product of the ~100M Llama, and a
// memset over all the gradients besides (bench/RESULTS.md). So a model may
// mark such a parameter (ParamSpec::grad_overwrite), and the first backward
// of an accumulation window that asks for the block's gradients gets them
// `fresh`: the marked parameters hold whatever was there, and overwrite(i)
// tells the model to write them (a product without accumulate); every other
// parameter and the layout's gaps are zeros as before. Later micro-batches
// of the window accumulate. The engine zeroes the marked ranges itself
// where a backward reports a block without having asked for its gradients,
// so a block no product wrote never carries a stale gradient into a step.
struct BlockGrads {
  float* base = nullptr;
  const BlockLayout* layout = nullptr;
  // The first backward of the window to write this buffer.
  bool fresh = false;
  float* operator[](int i) const { return base + layout->offsets[i]; }
  // Whether parameter i's gradient is to be written rather than added to.
  bool overwrite(int i) const {
    return fresh && i >= 0 && static_cast<size_t>(i) < layout->overwrite.size() && layout->overwrite[static_cast<size_t>(i)] != 0;
  }
};

class StepContext;

// One tensor part of a model (Model::tensor_part): its blocks (the whole
// model's blocks and parameters, in the same order, with the part's
// shapes) and how each parameter is cut from the whole one.
struct TensorPart {
  std::vector<BlockSpec> blocks;
  std::vector<std::vector<TensorSplit>> splits;  // per block, per parameter
  std::string what;  // its share of a layer, for people: "heads 2-3 of 4, kv heads 1 of 2, MLP 12-23 of 24"
  bool empty() const { return blocks.empty(); }
};

// Pipeline stages (Note [pipeline parallelism] in engine/pipeline.cpp). A
// model that splits into stages lists its layers in forward order, each
// with the blocks it uses; the engine gives each stage a contiguous run of
// them. `kind` names the layer for the "type:REGEX" partition
// ("Embedding", "DecoderLayer", "Head").
struct PipelineLayer {
  std::string kind;
  std::vector<int> blocks;
  int64_t params = 0;  // its parameters (the "parameters" partition balances them)
};

// The run of layers a pass computes, and what crosses the stage's edges:
// (B*T, Model::pipeline_width()) fp32 rows of the hidden state, and their
// gradients in backward. The whole model (no pipeline): first 0, end -1,
// no buffers.
// Sequence parallelism (Note [sequence parallelism] in
// engine/sequence_parallel.cpp): the model is given `rank`'s slice of each
// row, tokens [rank T / size, (rank + 1) T / size) of rows of T tokens,
// with their positions in the whole row (Batch::positions always set), and
// exchanges its attention's inputs and outputs with the other sequence
// ranks through StepContext::sequence_all_to_all.
struct SequenceSplit {
  int size = 1, rank = 0;
  int64_t T = 0;  // the whole rows' length (the slice's times size)
  // The whole rows' positions (B*T, Batch::positions of packed documents),
  // or null: each row is one sequence, causal by index.
  const std::vector<int32_t>* positions = nullptr;
  bool split() const { return size > 1; }
};

struct PipelineStage {
  int first = 0;  // index into pipeline_layers()
  int end = -1;   // one past the stage's last layer; -1: the model's end
  // forward: the hidden state entering `first` (null where first is 0) and
  // where the stage writes what leaves its last layer (null at the end).
  const float* input = nullptr;
  float* output = nullptr;
  // backward: the gradient of `output` (null at the end) and where the
  // stage writes the gradient of `input` (null where first is 0).
  const float* output_grad = nullptr;
  float* input_grad = nullptr;
  bool whole() const { return first == 0 && end < 0; }
};

// A block's parameters held by the model: valid until release() or until the
// handle goes out of scope (an exception included), whichever comes first.
// Move-only; releasing twice is a no-op. A handle lives inside one forward or
// backward: the engine refuses a model that still holds one when it returns,
// and a handle must never outlive the engine that issued it.
class HeldParams {
 public:
  HeldParams() = default;
  HeldParams(StepContext* ctx, int block, BlockParams params) : ctx_(ctx), block_(block), params_(params) {}
  ~HeldParams() { release(); }
  HeldParams(HeldParams&& o) noexcept : ctx_(o.ctx_), block_(o.block_), params_(o.params_) { o.ctx_ = nullptr; }
  HeldParams& operator=(HeldParams&& o) noexcept {
    if (this != &o) {
      release();
      ctx_ = o.ctx_;
      block_ = o.block_;
      params_ = o.params_;
      o.ctx_ = nullptr;
    }
    return *this;
  }
  HeldParams(const HeldParams&) = delete;
  HeldParams& operator=(const HeldParams&) = delete;

  kernels::CView operator[](int i) const { return params_[i]; }
  const BlockParams& params() const { return params_; }
  int block() const { return block_; }
  bool held() const { return ctx_ != nullptr; }
  inline void release() noexcept;

 private:
  StepContext* ctx_ = nullptr;
  int block_ = -1;
  BlockParams params_;
};

// The engine's side of a step, as the model sees it. The engine's
// implementation guarantees that every rank issues the same collectives in
// the same order; the model only has to call these at block boundaries.
class StepContext {
 public:
  virtual ~StepContext() = default;
  virtual DType compute_dtype() const = 0;
  // Full compute-precision parameters of `block`, held until the handle is
  // released (ZeRO-3 gathers them here and may free them on release).
  HeldParams acquire(int block) { return HeldParams(this, block, acquire_params(block)); }
  // The block's fp32 gradient buffers to accumulate (+=) into.
  virtual BlockGrads grads(int block) = 0;
  // The block's gradients for this micro-batch are complete.
  virtual void grads_ready(int block) = 0;
  // The dropout stream of the forward under way (Note [dropout masks] in
  // kernels/math.h): 0 where nothing is dropped (an evaluation), else a key
  // of the run's seed, the micro-batch's index and the rank, the same again
  // for the same micro-batch of a resumed run. The model keeps it for the
  // forward's backward (and its recomputed forward).
  virtual uint64_t dropout_seed() const { return 0; }
  // The loss scale the backward of the forward under way will be given
  // (fp16's, which changes only between steps; 1 without one). A model may
  // fold it into the logit gradient its forward writes (the GPU's 16-bit
  // operand, Ops::cross_entropy_operand16) and checks in backward that it
  // was the one.
  virtual float coming_loss_scale() const { return 1.0f; }
  // The stage this pass computes (the whole model without a pipeline).
  virtual const PipelineStage& pipeline_stage() const {
    static const PipelineStage whole;
    return whole;
  }
  // Tensor parallelism: sums `n` fp32 values in place over the ranks that
  // hold the other parts of this model (a no-op on one part). Every part
  // calls it at the same points, in the same order.
  virtual void tensor_all_reduce(float* data, int64_t n) {}
  // The same for fp64 sums and maxima (the vocabulary parts' cross-entropy).
  virtual void tensor_all_reduce_f64(double* data, int64_t n) {}
  virtual void tensor_all_reduce_max_f64(double* data, int64_t n) {}
  // Sequence parallelism: the split of the pass under way (size 1: none).
  virtual const SequenceSplit& sequence_split() const {
    static const SequenceSplit none;
    return none;
  }
  // Sends `per_rank` fp32 values from send + r * per_rank to sequence rank
  // r and receives r's into recv + r * per_rank (an all-to-all over the
  // ranks that share this model's rows). Every sequence rank calls it at
  // the same points, in the same order.
  virtual void sequence_all_to_all(const float* send, float* recv, int64_t per_rank) {}
  // Expert parallelism (Note [expert parallelism] in
  // engine/expert_parallel.cpp), over the ranks that hold the other
  // experts (use_expert_part): expert_counts sends `per_rank` int32 values
  // from send + r * per_rank to expert rank r and receives r's into recv +
  // r * per_rank; expert_exchange sends send_rows[r] rows of `width` fp32
  // values (the blocks one after the other in rank order) to rank r and
  // receives recv_rows[r] rows from r, in rank order (each pair's counts
  // agree: they come from expert_counts). Every expert rank calls them at
  // the same points, in the same order.
  virtual void expert_counts(const int32_t* send, int32_t* recv, int64_t per_rank) {}
  virtual void expert_exchange(const float* send, const int64_t* send_rows, float* recv, const int64_t* recv_rows,
                               int64_t width) {}

 protected:
  friend class HeldParams;
  virtual BlockParams acquire_params(int block) = 0;
  // Must not throw: it runs from HeldParams' destructor.
  virtual void release_params(int block) noexcept = 0;
};

inline void HeldParams::release() noexcept {
  if (ctx_) ctx_->release_params(block_);
  ctx_ = nullptr;
}

// What a model holds for micro-batches of B sequences of T tokens, in bytes
// (Model::activation_memory; zinc-train --estimate).
struct ActivationMemory {
  // Activations forward keeps for backward and the buffers backward computes
  // activation gradients in; held from the first forward on.
  int64_t saved = 0;
  // The kernels' grow-only scratch for the pass (kernels::ScratchTally).
  int64_t workspace = 0;
  // What keeping frozen weights packed for the matmuls adds (Note [packed
  // frozen weights] in kernels/matmul.cpp), where the engine holds them in
  // place (BlockParams::generation: ZeRO stages 0-2): the packed copies,
  // held from the first forward on, less the kernel scratch the packed
  // products no longer need (a weight converted on every call).
  int64_t packed = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string name() const = 0;
  virtual const std::vector<BlockSpec>& blocks() const = 0;
  // Where forward and backward run; the engine places the parameters and
  // gradient buffers it hands out there (config key "device").
  virtual Device device() const { return Device::kCpu; }
  // Forward one micro-batch; keeps what backward needs. Returns the mean loss
  // over the batch's targets (those not kIgnoreTarget; 0 when none), with
  // attention and positions following batch.positions when given.
  virtual float forward(StepContext& ctx, const Batch& batch) = 0;
  // Backward of the last forward, for the objective loss_scale * (sum of
  // the targets' losses) / (B*T): loss_scale * mean loss when every
  // position has a target. The engine normalises by the target count.
  // Accumulates into ctx.grads() and calls grads_ready(block) once per block,
  // last block first.
  virtual void backward(StepContext& ctx, float loss_scale) = 0;
  // The model's layers for pipeline stages (PipelineLayer), in forward
  // order; empty where the model does not split (the engine refuses
  // pipeline.stages > 1 then, naming the model). A model that lists them
  // computes, in forward and backward, only the layers of
  // ctx.pipeline_stage(), and touches only their blocks.
  virtual std::vector<PipelineLayer> pipeline_layers() const { return {}; }
  // Why pipeline_layers() is empty, where a model that splits cannot in
  // this configuration (the engine's refusal says it); empty otherwise.
  virtual std::string pipeline_split_error() const { return {}; }
  // fp32 elements per token of the hidden state between two layers.
  virtual int64_t pipeline_width() const { return 0; }
  // Pipeline stages keep several micro-batches in flight: the forwards and
  // backwards that follow use activation set `slot` (0 until asked; a set
  // is made when first selected). A model that keeps one set returns false,
  // and the engine computes a micro-batch's forward again before its
  // backward instead.
  virtual bool select_activations(int slot) { return slot == 0; }
  // Tensor parallelism (Note [tensor parallelism] in
  // engine/tensor_parallel.cpp): part `rank` of `size` (TensorPart). Empty
  // where the model cannot split so, with the reason in *why. blocks()
  // keeps describing the whole model.
  virtual TensorPart tensor_part(int rank, int size, std::string* why) const {
    if (why) *why = "model '" + name() + "' does not split its layers";
    return {};
  }
  // From now on the model computes part `rank` of `size` (its parameters
  // those of tensor_part(rank, size)), summing partial results with
  // ctx.tensor_all_reduce. Called once, before the first forward.
  virtual void use_tensor_part(int rank, int size) {}
  // Expert parallelism (Note [expert parallelism] in
  // engine/expert_parallel.cpp): part `rank` of `size` with that share of
  // each mixture-of-experts layer's experts, every other parameter whole
  // and marked TensorSplit::sum_grads (the expert ranks train on their own
  // batches). Empty where the model cannot share out its experts so, with
  // the reason in *why.
  virtual TensorPart expert_part(int rank, int size, std::string* why) const {
    if (why) *why = "model '" + name() + "' has no mixture-of-experts layers to share out";
    return {};
  }
  // From now on the model holds and computes the experts of
  // expert_part(rank, size), sending each token to the rank of its experts
  // through ctx.expert_counts and ctx.expert_exchange. Called once, before
  // the first forward.
  virtual void use_expert_part(int rank, int size) {}
  // Sequence parallelism (SequenceSplit): "" where the model computes a
  // slice of each row at `size` sequence ranks, else why not (one line).
  virtual std::string sequence_split_error(int size) const {
    return "model '" + name() + "' does not split its sequences";
  }
  // Model FLOPs per token of one training step (forward + backward), the
  // usual 6 * matmul parameters + attention count. 0 if unknown.
  virtual double flops_per_token(int64_t T) const { return 0; }
  // The logits of the last forward, (B*T, V) fp32 rows, where the model
  // keeps them in host memory; empty otherwise (the GPU). Valid until the
  // next forward.
  virtual std::span<const float> logits() const { return {}; }
  // Initial values from outside, e.g. a pretrained checkpoint: writes
  // elements [first, first + count) of parameter `param` of block `block`
  // (flat, row-major) to out as fp32 and returns true; false when the model
  // has none, and the engine initialises from the specs' Init and the seed.
  // The engine asks, per block, only for the elements the rank keeps (at
  // ZeRO-3 its own shard), so no rank needs to read the whole model. Throws
  // zinc::Error naming what could not be read.
  virtual bool initial_values(int block, int param, int64_t first, int64_t count, float* out) const {
    return false;
  }
  // The memory the model's forward and backward hold for micro-batches of
  // (B, T) in this compute dtype, from the same sizes it allocates; nothing
  // if the model cannot say (the estimate then lacks activations).
  virtual std::optional<ActivationMemory> activation_memory(int64_t B, int64_t T, DType compute) const {
    return std::nullopt;
  }
  // The same for pipeline stage `stage` holding `sets` activation sets
  // (select_activations), of one of `tensor_parts` tensor parts
  // (tensor_part: its share of each layer): its own layers only. Without
  // an override, the whole model's (an overestimate).
  virtual std::optional<ActivationMemory> stage_activation_memory(int64_t B, int64_t T, DType compute,
                                                                  const PipelineStage& stage, int sets,
                                                                  int tensor_parts) const {
    return activation_memory(B, T, compute);
  }
  // The same for one of `size` sequence ranks, rows of T tokens (each
  // holding T / size of them), of one of `tensor_parts` tensor parts.
  // Without an override, the whole rows' (an overestimate).
  virtual std::optional<ActivationMemory> sequence_activation_memory(int64_t B, int64_t T, DType compute, int size,
                                                                     int tensor_parts) const {
    return activation_memory(B, T, compute);
  }
};

}  // namespace zinc

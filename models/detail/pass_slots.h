// zinc models, private: the state a forward leaves for its backward, and
// the activation sets of pipeline stages (Model::select_activations).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/model.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {

// The decoder layers [lo, hi) a pass computes, and whether it starts at the
// embedding and ends with the head: PipelineStage's layers numbered as
// decoder_pipeline_layers numbers them (0 the embedding, 1..L the decoder
// layers, L + 1 the head), for a model of L decoder layers.
struct StageRange {
  int64_t lo = 0, hi = 0;
  bool embed = true, head = true;
  bool operator==(const StageRange&) const = default;
  static StageRange of(const PipelineStage& st, int64_t L) {
    const int64_t first = st.first, end = st.end < 0 ? L + 2 : st.end;
    return {std::max<int64_t>(first, 1) - 1, std::min<int64_t>(end, L + 1) - 1, first == 0, end == L + 2};
  }
};

// What a model's forward leaves for its backward: the layer inputs and
// activations (Acts: the model's per-layer set, with its attention
// workspace `ws`), the tokens and positions the kernels read, the dropout
// seed, the batch's shape and the layers (Range) the buffers were made for.
template <class Acts, class Range>
struct PassState {
  std::vector<Buf> x_in;
  std::vector<Acts> acts;
  int64_t acts_hold = -1;  // gradient checkpointing: the layer whose activations the shared set holds
  std::vector<int32_t> tokens, positions;  // the forward's inputs and Batch::positions
  const int32_t* tok = nullptr;            // ... where the kernels read them
  const int32_t* pos = nullptr;            // (nullptr: one document per row)
  Buf tokens_store, positions_store;       // device copies (GPU)
  // Sequence ranks (GPT-2): the positions as indexes into wpe, for its lookup.
  const int32_t* pos_tok = nullptr;
  Buf pos_tok_store;
  std::vector<int32_t> pos_rows;  // rows' positions 0..T-1 where the batch gives none (pos_tok's source)
  uint64_t lora_seed = 0;                  // StepContext::dropout_seed of the forward
  int64_t B = 0, T = 0;
  bool fused = false;  // the GPT's bf16 operands fused (Ops::fuses_operand16)
  int dropped = 0;     // the fp32 buffers left out (a model's own flags; Ops::fuses_every_operand16)
  Range alloc;         // the layers ensure_buffers allocated for
};

// Several PassStates for the micro-batches a pipeline stage has in flight:
// the selected one is the model's own (`current`), the others wait here.
// Swapping moves vectors and buffers, not their contents.
template <class State>
class PassSlots {
 public:
  // Makes `slot` the current one (a new slot gets as many layer sets as the
  // current, each with a workspace from new_ws()).
  template <class NewWs>
  void select(int slot, State& current, NewWs&& new_ws) {
    if (slot == cur_) return;
    if (slots_.empty()) slots_.resize(1);  // the selected slot's place: empty while it is current
    while (static_cast<int>(slots_.size()) <= slot) {
      State s;
      s.acts.resize(current.acts.size());
      for (auto& a : s.acts) a.ws = new_ws();
      s.x_in.resize(current.x_in.size());
      slots_.push_back(std::move(s));
    }
    std::swap(current, slots_[static_cast<size_t>(cur_)]);
    std::swap(current, slots_[static_cast<size_t>(slot)]);
    cur_ = slot;
  }
  // The states not selected (to free their workspaces).
  template <class F>
  void for_each(F&& f) {
    for (State& s : slots_) f(s);
  }

 private:
  std::vector<State> slots_;
  int cur_ = 0;
};

// The pipeline layers of a decoder whose blocks are numbered as zinc's
// models number them: the embedding (block 0), layer l in block l + 1 (and
// its adapters' block lora_first + l where lora_first >= 0), then the head
// (the blocks `head` lists: the final norm's, a head of its own, or the
// embedding's when tied).
inline std::vector<PipelineLayer> decoder_pipeline_layers(const std::vector<BlockSpec>& specs, int64_t layers,
                                                          int lora_first, std::vector<int> head) {
  std::vector<PipelineLayer> out;
  out.push_back({"Embedding", {0}});
  for (int64_t l = 0; l < layers; ++l) {
    PipelineLayer d{"DecoderLayer", {static_cast<int>(l + 1)}};
    if (lora_first >= 0) d.blocks.push_back(lora_first + static_cast<int>(l));
    out.push_back(std::move(d));
  }
  out.push_back({"Head", std::move(head)});
  for (PipelineLayer& p : out)
    for (int b : p.blocks)
      for (const ParamSpec& ps : specs[static_cast<size_t>(b)].params) p.params += ps.shape.numel();
  return out;
}

}  // namespace zinc::models::detail

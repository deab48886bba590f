// zinc engine: pipeline stages. The grid of ranks, the split of the model's
// layers into stages, the 1F1B schedule of a global batch, and the step's
// sums over every rank.
//
// Note [pipeline parallelism]
// ---------------------------
// With "pipeline": {"stages": P}, the W ranks form a grid of P stages by
// D = W / P data-parallel replicas, numbered as DeepSpeed's
// PipeDataParallelTopology numbers them: rank = stage * D + replica, so the
// replicas of one stage are neighbours (on one machine where ranks are
// placed in order) and only activations cross between stages. The engine's
// communicator is split twice: the data-parallel group (the ranks of one
// stage; ZeRO partitions over it, and the reducer and the parameter
// gathers run over it as without stages) and the pipeline group (the
// stages of one replica, ranked by stage; activations go point to point
// over it).
//
// The model lists its layers (Model::pipeline_layers: the embedding, each
// decoder layer, the head) and the blocks each uses. Stages take
// contiguous runs of layers: balanced by parameters ("parameters", and
// DeepSpeed's "best"), by count ("uniform"), or by the count of layers
// whose kind matches a regular expression ("type:REGEX"); every stage gets
// at least one layer. A stage keeps only its own blocks: the others are
// BlockShard::absent (no parameters, gradients or optimizer state). A block
// used by layers on two stages (a head tied to the embedding) is refused:
// sharing it needs a reduction of its gradient between the stages, which
// is not built.
//
// The schedule is 1F1B (PipeDream-Flush, as Megatron-LM and DeepSpeed run
// it): stage s runs min(P - s - 1, M) forwards of the M micro-batches
// first, then alternates one forward and one backward, then drains the
// remaining backwards. The forward output goes to the next stage together
// with the receipt of the gradient it sends back (Communicator::exchange),
// so that two neighbours that send to each other never wait on each other.
// Stage s has at most K = P - s micro-batches in flight (the last stage
// one: its backward follows its forward). The model keeps one activation
// set per micro-batch in flight (Model::select_activations: micro-batch m
// in set m % K), so no forward runs twice; a model that keeps one set only
// gets the forward computed again before each backward, from the input the
// stage kept (a forward more per micro-batch on every stage but the last).
// Backwards run in micro-batch order 0..M-1 on every stage, so each block's
// gradient sums the micro-batches in the order a run without stages sums
// them.
//
// Note [the gradient norm over stages]
// ------------------------------------
// The norm for clipping and the batch's loss sums are taken over every
// rank: each rank's squares per block (its own shard's), summed over the
// data-parallel group, then over the pipeline group, where only the stage
// that holds a block has a non-zero entry, so that sum is exact. The
// squares are then added in block order, as a one-rank run adds them. So a
// run with P stages and one replica computes the weights of the one-rank
// run bit for bit, and P stages by D replicas those of the D-rank run. The
// loss sums come from the last stage only (the others count zero).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine_impl.h"
#include "kernels/math.h"

namespace zinc {
namespace {

using Clock = std::chrono::steady_clock;
double pipe_seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The point-to-point transfers between neighbouring stages. With tensor
// parts (Note [tensor parallelism]) every part of a stage holds the same
// hidden state, so each part sends only its 1/T of it to its counterpart on
// the next stage, and the parts of the receiving stage gather the whole over
// their group (Megatron's scatter-gather): the stages' link carries each
// hidden state once, not T times. A buffer that does not split evenly goes
// whole.
class PipeLink {
 public:
  // dev: the device path, whose kernels each transfer waits for (Note
  // [pipeline stages on the GPU]).
  PipeLink(comm::Communicator& pipe, comm::Communicator* parts, int part, int nparts, DevicePath& dev)
      : pipe_(pipe), parts_(parts), part_(part), nparts_(parts ? nparts : 1), dev_(dev) {}
  void send(const float* buf, int64_t n, DType dt, int to) {
    const auto [o, c] = slice(n);
    dev_.before_device_transfer();
    pipe_.send(buf + o, c, dt, to);
  }
  void recv(float* buf, int64_t n, DType dt, int from) {
    const auto [o, c] = slice(n);
    dev_.before_device_transfer();
    pipe_.recv(buf + o, c, dt, from);
    gather(buf, n);
  }
  void exchange(const float* sbuf, int64_t sn, int to, float* rbuf, int64_t rn, int from, DType dt) {
    const auto [so, sc] = slice(sn);
    const auto [ro, rc] = slice(rn);
    dev_.before_device_transfer();
    pipe_.exchange(sbuf + so, sc, to, rbuf + ro, rc, from, dt);
    gather(rbuf, rn);
  }

 private:
  bool split(int64_t n) const { return nparts_ > 1 && n % nparts_ == 0; }
  std::pair<int64_t, int64_t> slice(int64_t n) const {
    if (!split(n)) return {0, n};
    const int64_t c = n / nparts_;
    return {part_ * c, c};
  }
  void gather(float* buf, int64_t n) {
    if (!split(n)) return;
    const int64_t c = n / nparts_;
    own_.assign(buf + part_ * c, buf + (part_ + 1) * c);
    parts_->all_gather(own_.data(), buf, c, DType::kF32);
  }
  comm::Communicator& pipe_;
  comm::Communicator* parts_;
  int part_, nparts_;
  DevicePath& dev_;
  std::vector<float> own_;
};

// Note [pipeline stages on the GPU]
// On the GPU path ("device": "cuda") the model reads a stage's input and
// writes its output, and their gradients, in GPU memory: the engine keeps
// them in buffers the device path allocates there (DevicePath::
// stage_buffer) and sends them between the stages over NCCL, GPU to GPU as
// DeepSpeed's pipeline engine does: a communicator over the pipeline
// group's ranks (DevicePath::device_communicator) whose send, recv and
// exchange are ncclSend and ncclRecv (Note [NCCL point to point]). NCCL
// runs on a stream of its own, so every transfer first waits for the
// compute stream's kernels (DevicePath::before_device_transfer): those that
// wrote what it sends, and those that still read a buffer it receives into
// (the last backward's output gradient, when the next one arrives in the
// same buffer); a receive has completed when it returns, before any kernel
// reads it. The schedule, the loss and
// clipping's sums (host values over the host communicators) are the CPU's,
// and the data-parallel replicas of each stage reduce their gradients over
// NCCL as without stages. Not yet on the GPU: a block two stages share (a
// tied head, refused with one line), tensor parts and sequence ranks.
//
// A stage's buffer: host memory, or the device's (Note [pipeline stages on
// the GPU]); it keeps what it holds while a resize fits.
class StageBuf {
 public:
  explicit StageBuf(DevicePath* device = nullptr) : device_(device) {}
  float* resize(int64_t n) {
    n_ = n;
    if (!device_) {
      host_.resize(static_cast<size_t>(n));
    } else if (n > cap_) {
      buf_ = device_->stage_buffer(n);
      cap_ = n;
    }
    return data();
  }
  float* data() { return device_ ? buf_.get() : host_.data(); }
  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  void clear() {
    n_ = cap_ = 0;
    host_ = {};
    buf_.reset();
  }

 private:
  DevicePath* device_;
  int64_t n_ = 0, cap_ = 0;
  std::vector<float> host_;
  std::shared_ptr<float> buf_;
};

// Contiguous parts of `w` (non-negative weights), each non-empty, whose
// largest sum is the smallest possible: the first index of each part, then
// w.size(). Binary search on the bound over the sums' prefix; ties go to
// earlier parts taking more.
std::vector<int> balanced_parts(const std::vector<int64_t>& w, int parts) {
  const int n = static_cast<int>(w.size());
  auto split = [&](int64_t bound, std::vector<int>* out) {
    // Greedy: each part takes one layer, then more while it stays within
    // the bound and leaves one layer for each later part; the last takes
    // the rest.
    std::vector<int> b{0};
    int i = 0;
    for (int p = 0; p < parts; ++p) {
      const int later = parts - p - 1;
      if (i >= n - later) return false;
      int64_t sum = w[static_cast<size_t>(i)];
      int j = i + 1;
      if (later == 0) {
        for (; j < n; ++j) sum += w[static_cast<size_t>(j)];
      } else {
        for (; j < n - later && sum + w[static_cast<size_t>(j)] <= bound; ++j) sum += w[static_cast<size_t>(j)];
      }
      if (sum > bound) return false;
      i = j;
      b.push_back(i);
    }
    if (out) *out = b;
    return true;
  };
  int64_t lo = 0, hi = 0;
  for (int64_t x : w) {
    lo = std::max(lo, x);
    hi += x;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (split(mid, nullptr)) hi = mid;
    else lo = mid + 1;
  }
  std::vector<int> out;
  ZINC_CHECK(split(lo, &out), "pipeline: no balanced split");
  return out;
}

}  // namespace

PipelinePlan plan_pipeline(const Model& model, const Config& cfg) {
  PipelinePlan plan;
  const int stages = static_cast<int>(cfg.pipeline.stages);
  plan.layers = model.pipeline_layers();
  const std::vector<PipelineLayer>& layers = plan.layers;
  if (layers.empty()) {
    const std::string why = model.pipeline_split_error();
    throw ConfigError("pipeline.stages", "model '" + model.name() + "' does not split into pipeline stages (" +
                                             std::to_string(stages) + " asked for)" + (why.empty() ? "" : ": " + why));
  }
  const int n = static_cast<int>(layers.size());
  if (n < stages)
    throw ConfigError("pipeline.stages", std::to_string(stages) + " stages for the " + std::to_string(n) +
                                             " layers of model '" + model.name() + "' (embedding, decoder layers, "
                                             "head): each stage needs at least one");
  std::vector<int64_t> weight;
  for (const PipelineLayer& l : layers) {
    switch (cfg.pipeline.partition) {
      case PipePartition::kParameters: weight.push_back(l.params); break;
      case PipePartition::kUniform: weight.push_back(1); break;
      case PipePartition::kType:
        weight.push_back(std::regex_search(l.kind, std::regex(cfg.pipeline.type_regex, std::regex::icase)) ? 1 : 0);
        break;
    }
  }
  if (cfg.pipeline.partition == PipePartition::kType) {
    int64_t matched = 0;
    for (int64_t x : weight) matched += x;
    if (matched < stages)
      throw ConfigError("pipeline.partition", "\"type:" + cfg.pipeline.type_regex + "\" matches " +
                                                  std::to_string(matched) + " of model '" + model.name() +
                                                  "''s layers (kinds Embedding, DecoderLayer, Head), fewer than the " +
                                                  std::to_string(stages) + " stages");
  }
  plan.bounds = balanced_parts(weight, stages);
  const std::vector<BlockSpec>& specs = model.blocks();
  plan.block_stages.assign(specs.size(), {});
  for (int s = 0; s < stages; ++s)
    for (int l = plan.bounds[static_cast<size_t>(s)]; l < plan.bounds[static_cast<size_t>(s) + 1]; ++l)
      for (int b : layers[static_cast<size_t>(l)].blocks) {
        std::vector<int>& at = plan.block_stages.at(static_cast<size_t>(b));
        if (at.empty() || at.back() != s) at.push_back(s);
      }
  plan.block_stage.assign(specs.size(), -1);
  for (size_t b = 0; b < specs.size(); ++b) {
    const std::vector<int>& at = plan.block_stages[b];
    ZINC_CHECK(!at.empty(), "model '" + model.name() + "': block '" + specs[b].name + "' is in no pipeline layer");
    // Note [tied blocks across stages]: at most two stages share a block.
    if (at.size() > 2)
      throw ConfigError("pipeline.stages", "block '" + specs[b].name + "' of model '" + model.name() + "' is used on " +
                                               std::to_string(at.size()) + " stages; at most two may share a block");
    plan.block_stage[b] = at.front();
  }
  for (const std::vector<int>& at : plan.block_stages) {
    if (at.size() != 2) continue;
    if (!plan.tied_stages.empty() && plan.tied_stages != at)
      throw ConfigError("pipeline.stages", "model '" + model.name() + "' shares blocks between two different "
                                           "pairs of stages; one pair at most");
    plan.tied_stages = at;
  }
  // Refused here, so that --check refuses it too (and "auto" stays on the CPU).
  if (!plan.tied_stages.empty() && cfg.device == Device::kCuda)
    throw ConfigError("pipeline.stages", "model '" + model.name() + "' shares blocks between stages " +
                                         std::to_string(plan.tied_stages[0]) + " and " +
                                         std::to_string(plan.tied_stages[1]) +
                                         " (a head tied to the embedding), which the GPU path does not sum between "
                                         "stages yet (Note [pipeline stages on the GPU]); use \"device\": \"cpu\" "
                                         "(or, in a model with an untied form, tie_word_embeddings false; GPT-2's "
                                         "head is always tied)");
  return plan;
}

bool PipelinePlan::holds(int block, int stage) const {
  const std::vector<int>& at = block_stages.at(static_cast<size_t>(block));
  return std::find(at.begin(), at.end(), stage) != at.end();
}

std::vector<std::string> PipelinePlan::describe(int world) const {
  std::vector<std::string> out;
  const int stages = static_cast<int>(bounds.size()) - 1;
  const int replicas = world / stages;
  for (int s = 0; s < stages; ++s) {
    const int a = bounds[static_cast<size_t>(s)], e = bounds[static_cast<size_t>(s) + 1];
    int64_t p = 0;
    std::string kinds;  // in order, runs of one kind counted: "Embedding, 2 DecoderLayer"
    for (int l = a; l < e;) {
      int run = l;
      while (run < e && layers[static_cast<size_t>(run)].kind == layers[static_cast<size_t>(l)].kind) {
        p += layers[static_cast<size_t>(run)].params;
        ++run;
      }
      kinds += (kinds.empty() ? "" : ", ") + (run - l > 1 ? std::to_string(run - l) + " " : std::string()) +
               layers[static_cast<size_t>(l)].kind;
      l = run;
    }
    const std::string ranks = replicas == 1 ? "rank " + std::to_string(s)
                                            : "ranks " + std::to_string(s * replicas) + "-" +
                                                  std::to_string((s + 1) * replicas - 1);
    char buf[192];
    std::snprintf(buf, sizeof buf, "stage %d (%s): layers %d-%d (%s), %.2fM parameters", s, ranks.c_str(), a, e - 1,
                  kinds.c_str(), static_cast<double>(p) / 1e6);
    out.push_back(buf);
  }
  return out;
}

void Engine::Impl::setup_pipeline() {
  const int replicas = world;  // setup_grid has split the world
  pipe_plan = plan_pipeline(*model, cfg);
  const PipelinePlan& plan = pipe_plan;
  const std::vector<int>& tied_stages = plan.tied_stages;
  pass_stage = PipelineStage{plan.bounds[static_cast<size_t>(stage)],
                             stage + 1 == stages ? -1 : plan.bounds[static_cast<size_t>(stage) + 1]};
  if (!tied_stages.empty()) {  // the pair of stages of this replica that share blocks (collective over the pipe)
    const bool in = std::find(tied_stages.begin(), tied_stages.end(), stage) != tied_stages.end();
    tied_comm = pipe_comm->split(in ? 0 : 1, stage);
    if (!in) tied_comm.reset();
  }
  if (world_rank == 0) {
    const int d = replicas / static_cast<int>(cfg.sequence_parallel_size);  // the sequence ranks of a replica
    std::string line = "pipeline: " + std::to_string(stages) + " stages x " + std::to_string(d) +
                       " data-parallel " + (d == 1 ? "replica" : "replicas") + ", 1F1B over " +
                       std::to_string(cfg.gradient_accumulation_steps) + " micro-batches";
    if (tensor_split()) line += ", " + std::to_string(tp_size) + " tensor parts each";
    if (cfg.sequence_split()) line += ", " + std::to_string(cfg.sequence_parallel_size) + " sequence ranks each";
    for (const std::string& d : plan.describe(world_all)) line += "; " + d;
    log_info(line);
  }
}

void Engine::Impl::refuse_with_stages(const char* what) const {
  if (!pipelined()) return;
  throw Error(std::string("Engine::") + what + "(): this run has " + std::to_string(stages) +
              " pipeline stages and each computes only its own layers; train with train_batch(loader), which runs "
              "the global batch's micro-batches through every stage (as DeepSpeed's PipelineEngine.train_batch)");
}

float Engine::Impl::stage_forward(const Batch& batch, int64_t micro, const float* in, float* out) {
  const auto t0 = Clock::now();
  pass_stage.input = in;
  pass_stage.output = out;
  pass_stage.output_grad = nullptr;
  pass_stage.input_grad = nullptr;
  params->begin_pass(ParamCoordinator::Pass::kTrain);
  // The dropout key of a one-stage run's same micro-batch: its index and the replica.
  pass_dropout_seed = kernels::math::dropout_subkey(
      kernels::math::dropout_subkey(cfg.seed, static_cast<uint64_t>(micro)), static_cast<uint64_t>(rank));
  const float loss = model->forward(*this, batch);
  check_released("forward");
  timings.forward_s += pipe_seconds(t0);
  return loss;
}

void Engine::Impl::stage_backward(bool boundary, const float* dout, float* din) {
  const auto t0 = Clock::now();
  pass_stage.input = nullptr;
  pass_stage.output = nullptr;
  pass_stage.output_grad = dout;
  pass_stage.input_grad = din;
  boundary_backward = boundary;
  run_backward(boundary);
  micro_steps += 1;
  timings.backward_s += pipe_seconds(t0);
}

float Engine::Impl::train_pipeline(DataLoader& loader) {
  check_loaded("train_batch");
  check_stepped("train_batch");
  device->make_current();
  const int64_t M = cfg.gradient_accumulation_steps;
  const int P = stages, s = stage;
  const bool first = s == 0, last = s == P - 1;
  const int64_t W = model->pipeline_width();
  const int64_t base = micro_steps;
  // Every stage of a replica reads the same micro-batches (its loader is
  // the replica's); only the first and last use their tokens and targets,
  // but every stage counts their targets for the normaliser.
  // With sequence ranks each stage's ranks take their slice of every
  // micro-batch (Note [sequence parallelism]) and the stages pass on the
  // slices' hidden states; each micro-batch keeps its whole rows'
  // positions for the passes that compute it.
  std::vector<Batch> batches(static_cast<size_t>(M));
  std::vector<int64_t> targets(static_cast<size_t>(M));
  std::vector<SequenceSplit> splits(static_cast<size_t>(M));
  std::vector<std::vector<int32_t>> split_positions(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const size_t i = static_cast<size_t>(m);
    if (sequence_ranks()) {
      batches[i] = sequence_slice(loader.next());
      targets[i] = count_targets(batches[i]);
      split_positions[i] = sp_positions;
      splits[i] = sp_pass;
    } else {
      batches[i] = loader.next();
      targets[i] = check_batch(batches[i]);
    }
  }
  auto use_split = [&](int64_t m) {  // the pass computes micro-batch m's slice
    if (!sequence_ranks()) return;
    sp_positions = split_positions[static_cast<size_t>(m)];
    sp_pass = splits[static_cast<size_t>(m)];
    sp_pass.positions = sp_positions.empty() ? nullptr : &sp_positions;
  };
  auto width = [&](int64_t m) {
    const Batch& b = batches[static_cast<size_t>(m)];
    return b.B * b.T * W;
  };
  DevicePath* on_device = pipe_device_comm ? device.get() : nullptr;  // Note [pipeline stages on the GPU]
  std::vector<StageBuf> inputs(static_cast<size_t>(M), StageBuf(on_device));  // a later stage's, per micro-batch in flight
  StageBuf out(on_device), dout(on_device), din(on_device);
  // The model's activation sets (Model::select_activations): one per
  // micro-batch in flight, P - s of them (the last stage's backward follows
  // its forward), micro-batch m in set m % K. A model with one set: the
  // forward again before each backward.
  int64_t K = last ? 1 : std::min<int64_t>(P - s, M);
  if (K > 1 && !model->select_activations(static_cast<int>(K - 1))) K = 1;
  std::vector<int64_t> holds(static_cast<size_t>(K), -1);  // the micro-batch whose forward each set holds
  auto select = [&](int64_t m) {
    const int k = static_cast<int>(m % K);
    ZINC_CHECK(model->select_activations(k), "model '" + model->name() + "' refused activation set " + std::to_string(k));
    return static_cast<size_t>(k);
  };
  int64_t next_fwd = 0, next_bwd = 0;

  auto forward_one = [&](int64_t m) {
    if (!first && inputs[static_cast<size_t>(m)].empty())
      throw Error("pipeline stage " + std::to_string(s) + ": micro-batch " + std::to_string(m) + " has no input");
    const size_t k = select(m);
    holds[k] = m;
    use_split(m);
    out.resize(last ? 0 : width(m));
    const float loss = stage_forward(batches[static_cast<size_t>(m)], base + m,
                                     first ? nullptr : inputs[static_cast<size_t>(m)].data(), last ? nullptr : out.data());
    const Batch& b = batches[static_cast<size_t>(m)];
    batch_loss.add(last ? loss : 0.0f, targets[static_cast<size_t>(m)], b.B * b.T);
  };
  auto backward_one = [&](int64_t m) {
    const size_t k = select(m);
    use_split(m);
    if (holds[k] != m) {  // Note [pipeline parallelism]: the forward again, from the kept input
      StageBuf scratch(on_device);
      scratch.resize(last ? 0 : width(m));
      stage_forward(batches[static_cast<size_t>(m)], base + m, first ? nullptr : inputs[static_cast<size_t>(m)].data(),
                    last ? nullptr : scratch.data());
      pipe_recomputed += 1;
    }
    din.resize(first ? 0 : width(m));
    stage_backward(m == M - 1, last ? nullptr : dout.data(), first ? nullptr : din.data());
    inputs[static_cast<size_t>(m)].clear();
    holds[k] = -1;  // backward may overwrite what forward kept
  };
  // The transfers, over the pipeline group (its ranks are the stages);
  // the time in them is the stage's wait for its neighbours.
  PipeLink pc(pipe_device_comm ? *pipe_device_comm : *pipe_comm, tp_comm.get(), tp_rank, tp_size, *device);
  auto timed = [&](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    pipe_wait_s += pipe_seconds(t0);
  };
  // Where micro-batch m's input arrives (written whole by the transfer).
  auto input_of = [&](int64_t m) {
    return inputs[static_cast<size_t>(m)].resize(width(m));
  };
  auto recv_input = [&](int64_t m) {
    if (!first) timed([&] { pc.recv(input_of(m), width(m), DType::kF32, s - 1); });
  };

  const int64_t warmup = std::min<int64_t>(P - s - 1, M), steady = M - warmup;
  for (int64_t i = 0; i < warmup; ++i) {
    recv_input(next_fwd);
    forward_one(next_fwd++);
    if (!last) timed([&] { pc.send(out.data(), out.size(), DType::kF32, s + 1); });
  }
  if (steady > 0) recv_input(next_fwd);
  for (int64_t i = 0; i < steady; ++i) {
    forward_one(next_fwd++);
    // The output goes on while the gradient for the oldest micro-batch comes back.
    dout.resize(last ? 0 : width(next_bwd));
    if (!last)
      timed([&] {
        pc.exchange(out.data(), out.size(), s + 1, dout.data(),
                    dout.size(), s + 1, DType::kF32);
      });
    const int64_t m = next_bwd++;
    backward_one(m);
    if (first) continue;
    if (i + 1 == steady) {
      timed([&] { pc.send(din.data(), din.size(), DType::kF32, s - 1); });
    } else {
      timed([&] {
        pc.exchange(din.data(), din.size(), s - 1, input_of(next_fwd), width(next_fwd), s - 1,
                    DType::kF32);
      });
    }
  }
  while (next_bwd < M) {
    const int64_t m = next_bwd++;
    dout.resize(last ? 0 : width(m));
    if (!last) timed([&] { pc.recv(dout.data(), dout.size(), DType::kF32, s + 1); });
    backward_one(m);
    if (!first) timed([&] { pc.send(din.data(), din.size(), DType::kF32, s - 1); });
  }
  model->select_activations(0);
  step_pending = true;
  step();
  pass_stage.input = pass_stage.output = nullptr;
  pass_stage.output_grad = nullptr;
  pass_stage.input_grad = nullptr;
  return static_cast<float>(last_loss);
}

float Engine::Impl::evaluate_pipeline(const Batch& whole) {
  check_loaded("evaluate");
  Batch slice;  // a sequence rank's part of the rows (sequence_slice checks the batch)
  if (sequence_ranks()) slice = sequence_slice(whole);
  const Batch& batch = sequence_ranks() ? slice : whole;
  const int64_t targets = sequence_ranks() ? count_targets(whole) : check_batch(whole);
  device->make_current();
  const bool first = stage == 0, last = stage == stages - 1;
  const int64_t n = batch.B * batch.T * model->pipeline_width();
  DevicePath* on_device = pipe_device_comm ? device.get() : nullptr;  // Note [pipeline stages on the GPU]
  StageBuf in(on_device), out(on_device);
  in.resize(first ? 0 : n);
  out.resize(last ? 0 : n);
  PipeLink link(pipe_device_comm ? *pipe_device_comm : *pipe_comm, tp_comm.get(), tp_rank, tp_size, *device);
  if (!first) link.recv(in.data(), n, DType::kF32, stage - 1);
  pass_stage.input = first ? nullptr : in.data();
  pass_stage.output = last ? nullptr : out.data();
  params->begin_pass(ParamCoordinator::Pass::kEval);
  pass_dropout_seed = 0;  // nothing dropped in an evaluation
  float loss = model->forward(*this, batch);
  check_released("evaluate");
  params->end_pass();
  device->on_release();
  pass_stage.input = pass_stage.output = nullptr;
  if (!last) link.send(out.data(), n, DType::kF32, stage + 1);
  pipe_comm->broadcast(&loss, 1, DType::kF32, stages - 1);  // the last stage's loss, to every stage
  // Its slices' losses, summed over the stage's sequence ranks (every stage
  // has the same slices, so every stage gets the whole rows' loss).
  if (sequence_ranks()) loss = sequence_loss(loss, count_targets(batch));
  return targets > 0 ? loss : std::numeric_limits<float>::quiet_NaN();
}

// Note [tied blocks across stages]
// ---------------------------------
// A block that layers on two stages use (a head tied to the embedding) is
// kept whole on both: each computes its part of the gradient (the
// embedding's on the first stage, the head's on the last), the replicas of
// each reduce it as any block, and then the two stages' reduced gradients
// are summed between them (one all-reduce over the pair), so both apply the
// same update to the same weights. Its squares count once, on its first
// stage, and only that stage writes it into a checkpoint. The sum takes
// the micro-batches' embedding and head parts in another order than one
// rank accumulating both in one buffer: the weights then agree to fp32
// rounding, not bit for bit.
void Engine::Impl::reduce_tied_gradients() {
  if (!tied_comm) return;
  for (size_t b = 0; b < blocks.size(); ++b) {
    BlockShard& s = blocks[b];
    if (s.frozen || pipe_plan.block_stages[b].size() != 2) continue;  // the same blocks, in the same order, on both stages
    float* g = plan.optimizer_spans_block ? s.grad.as<float>() : reducer->reduced_shard(s);
    const int64_t n = plan.optimizer_spans_block ? s.part.padded_numel : s.part.shard_numel;
    tied_comm->all_reduce(g, g, n, DType::kF32);
  }
}

void Engine::Impl::reduce_step_sums(double sums[7], bool local_grads) {
  const BatchLoss& b = batch_loss;
  const size_t nb = blocks.size();
  std::vector<double> v(nb + 6, 0.0);
  if (local_grads) {
    v[0] = rule->local_squares();
  } else if (!device->grad_squared_norm(v[0])) {
    for (size_t i = 0; i < nb; ++i)  // a block two stages share counts on its first (Note [tied blocks across stages])
      if (!blocks[i].frozen && (!pipelined() || pipe_plan.block_stage[i] == stage)) v[i] = block_squares(i);
  }
  // The loss lives on the last stage; its tensor parts see the same batch
  // (part 0's counts), expert ranks their own (every one's).
  if ((!pipelined() || stage == stages - 1) && (tp_rank == 0 || expert_parts)) {
    const double tail[6] = {b.loss_sum, b.targets, b.positions, b.positions_sq, static_cast<double>(b.count),
                            b.target_loss};
    std::copy(tail, tail + 6, v.begin() + static_cast<std::ptrdiff_t>(nb));
  }
  if (reduce_stream) reduce_stream->submit([&v](comm::Communicator& c) { c.all_reduce_f64(v.data(), static_cast<int64_t>(v.size())); }).wait();
  if (pipelined()) pipe_comm->all_reduce_f64(v.data(), static_cast<int64_t>(v.size()));
  if (tensor_split()) tp_comm->all_reduce_f64(v.data(), static_cast<int64_t>(v.size()));
  sums[0] = 0.0;
  for (size_t i = 0; i < nb; ++i) sums[0] += v[i];  // block order, as one rank adds them
  std::copy(v.begin() + static_cast<std::ptrdiff_t>(nb), v.end(), sums + 1);
}

}  // namespace zinc

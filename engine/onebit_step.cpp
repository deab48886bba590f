// OneBitAdam in the engine: the compressed step and its checkpoint part.
//
// Note [1-bit Adam]
// ~~~~~~~~~~~~~~~~~
// DeepSpeed's OnebitAdam (deepspeed/runtime/fp16/onebit/adam.py; Tang et
// al. 2021), read at deepspeedai/DeepSpeed master, and what zinc does:
//
//  - Warm-up, optimizer steps 1..freeze_step: plain Adam on the averaged
//    gradient, with no bias correction (DeepSpeed's update is
//    m / (sqrt(v) + eps) whatever bias_correction says) and decoupled weight
//    decay. zinc runs its own Adam kernel with exactly those settings, so
//    the warm-up equals zinc's AdamW with bias_correction false bit for bit
//    (tests/engine/onebit_engine_test.cpp checks it).
//  - After freeze_step updates: the variance v stays as it is. No gradient
//    is reduced at the accumulation boundary (DeepSpeed turns off its
//    engine's backward all-reduce); each rank folds its own gradient into
//    its momentum, m = b1 m + (1 - b1) g_r, then m := the compressed
//    average of the ranks' m (comm/onebit.h: one scale per tensor and rank,
//    the signs at 1 bit, worker and server error feedback), one tensor at a
//    time as DeepSpeed does per parameter; then w -= lr (m / (sqrt(v) + eps)
//    + wd w), in zinc's AdamW order (the decay first). Every rank ends with
//    the same m and w. On one rank nothing is compressed (DeepSpeed skips it
//    too): Adam with a frozen variance.
//  - The local gradient g_r is scaled so that its average over ranks is the
//    global batch's mean gradient (the engine's usual scale times the world
//    size; Note [the loss normaliser] in engine.cpp). The gradient norm that
//    clipping and the overflow check use is sqrt(mean over ranks of
//    |g_r|^2), computed from one all-reduce, so every rank clips by the same
//    factor and skips (a non-finite gradient anywhere) together. DeepSpeed
//    clips each rank by its own local norm there; a common factor keeps the
//    ranks' inputs to the average on one scale.
//  - Different from DeepSpeed on purpose: DeepSpeed's first step() only
//    allocates its buffers (the weights do not move and that batch's
//    gradient is dropped), and that step counts towards freeze_step, so it
//    runs freeze_step - 1 real Adam updates; zinc updates at every step and
//    runs freeze_step. exp_avg_mask (a Python param-group field) has no
//    config key and is not implemented. DeepSpeed resets the error feedback
//    at every checkpoint load (it saves rank 0's only); zinc saves each
//    rank's and restores them when the world size is the same, so a resume
//    is bit-exact across the freeze, and starts them from zero (with a
//    warning) when it is not.
//  - Stage 0 only: DeepSpeed asserts "1bit-Adam is not compatible with ZeRO"
//    for any stage above 0 (engine.py), and so does zinc's config.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"
#include "kernels/kernels.h"

namespace zinc {

bool Engine::Impl::onebit_compressing() const {
  return cfg.optimizer.type == OptimizerType::kOneBitAdam && optimizer_steps >= cfg.optimizer.onebit.freeze_step;
}

double Engine::Impl::onebit_local_squares() {
  double sum = 0;
  for (BlockShard& s : blocks)
    if (!s.grad.empty()) sum += optim::grad_squared_norm(s.grad.as<float>(), DType::kF32, s.part.padded_numel);
  return sum;
}

void Engine::Impl::onebit_make_compressors() {
  onebit_ar.clear();
  if (world == 1) return;
  for (const BlockShard& s : blocks) {
    std::vector<comm::CompressedAllReduce> per;
    for (int64_t n : s.layout.numels) per.emplace_back(n, world);
    onebit_ar.push_back(std::move(per));
  }
}

void Engine::Impl::onebit_update_all(float grad_scale) {
  if (world > 1 && onebit_ar.empty()) onebit_make_compressors();
  if (!onebit_announced && rank == 0) {
    int64_t full = 0, compressed = 0;
    for (const auto& per : onebit_ar)
      for (const comm::CompressedAllReduce& ar : per) compressed += ar.wire_bytes_per_rank();
    for (const BlockShard& s : blocks) full += s.layout.param_numel();
    full = world > 1 ? 2 * full * 4 * (world - 1) / world : 0;  // ring all-reduce of fp32 gradients
    log_info("OneBitAdam: the variance is frozen after " + std::to_string(cfg.optimizer.onebit.freeze_step) +
             " Adam steps; from optimizer step " + std::to_string(optimizer_steps) +
             " each rank sends its momentum at 1 bit per element (" + std::to_string(compressed) +
             " bytes per step per rank, against " + std::to_string(full) + " for the fp32 gradient all-reduce)");
  }
  onebit_announced = true;
  visit_updating([&](const StateSpan& sp) { onebit_span(sp, grad_scale); });
}

void Engine::Impl::onebit_span(const StateSpan& sp, float grad_scale) {
  BlockShard& s = blocks[static_cast<size_t>(sp.block)];
  ZINC_CHECK(plan.optimizer_spans_block && sp.offset == 0 && sp.count >= s.layout.numel,
             "OneBitAdam: a span that is not a whole block (stage 0 keeps whole blocks)");
  const float* g = s.grad.as<float>();
  float* m = sp.m;
  const float b1 = static_cast<float>(adam.beta1), one_minus_b1 = static_cast<float>(1.0 - adam.beta1);
  for (int64_t i = 0; i < sp.count; ++i) m[i] = b1 * m[i] + one_minus_b1 * (g[i] * grad_scale);
  if (world > 1) {
    std::vector<comm::CompressedAllReduce>& per = onebit_ar[static_cast<size_t>(sp.block)];
    reduce_stream->submit([&](comm::Communicator& c) {
      for (size_t t = 0; t < per.size(); ++t) per[t].average(c, m + s.layout.offsets[t], s.layout.numels[t]);
    }).wait();
  }
  float* w = sp.master;
  const float* v = sp.v;
  const float lr = static_cast<float>(adam.lr), eps = static_cast<float>(adam.eps);
  const float decay = static_cast<float>(-adam.lr * adam.weight_decay);
  if (adam.weight_decay > 0)
    for (int64_t i = 0; i < sp.count; ++i) w[i] = decay * w[i] + w[i];
  for (int64_t i = 0; i < sp.count; ++i) w[i] = -lr * (m[i] / (std::sqrt(v[i]) + eps)) + w[i];
  if (char* out = compute_out(sp)) convert_f32_to_16(w, out, static_cast<size_t>(sp.count), dtype);
}

// ---- checkpoints -----------------------------------------------------------------------

namespace {
std::string onebit_file(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "onebit%05d.bin", rank);
  return name;
}
}  // namespace

nlohmann::json Engine::Impl::onebit_save(const std::string& partial_dir) {
  if (onebit_ar.empty()) return nullptr;
  std::string bytes;
  int64_t tensors = 0;
  for (const auto& per : onebit_ar)
    for (const comm::CompressedAllReduce& ar : per) {
      bytes.append(reinterpret_cast<const char*>(ar.worker_error().data()), ar.worker_error().size() * 4);
      bytes.append(reinterpret_cast<const char*>(ar.server_error().data()), ar.server_error().size() * 4);
      tensors += 1;
    }
  const std::string name = onebit_file(rank);
  ckpt::write_file_atomic((std::filesystem::path(partial_dir) / name).string(), bytes);
  return {{"file", name},
          {"bytes", static_cast<int64_t>(bytes.size())},
          {"xxh3_64", ckpt::xxh3_hex(bytes.data(), bytes.size())},
          {"world_size", world},
          {"tensors", tensors}};
}

std::string Engine::Impl::onebit_read(const ckpt::TagFiles& files, std::string& why) const {
  why.clear();
  if (cfg.optimizer.type != OptimizerType::kOneBitAdam || world == 1) return {};
  const int saved_world = files.meta.at("world_size").get<int>();
  const nlohmann::json& index = files.ranks.at(static_cast<size_t>(std::min(rank, saved_world - 1)));
  if (!index.contains("onebit") || index["onebit"].is_null()) {
    why = "the checkpoint holds no 1-bit error feedback (saved before any compressed step, or by another optimizer)";
    return {};
  }
  if (saved_world != world) {
    why = "the checkpoint's error feedback is for " + std::to_string(saved_world) + " ranks, this run has " +
          std::to_string(world);
    return {};
  }
  const nlohmann::json& e = index["onebit"];
  const std::string where = files.dir + "/" + onebit_file(rank);
  if (!e.is_object() || !e.contains("file") || e["file"] != onebit_file(rank) || !e.contains("bytes") ||
      !e["bytes"].is_number_integer() || !e.contains("xxh3_64") || !e["xxh3_64"].is_string())
    throw IoError("checkpoint: the rank index of rank " + std::to_string(rank) + " in " + files.dir +
                  " has a malformed \"onebit\" entry (nothing was loaded)");
  int64_t want = 0;
  for (const BlockShard& s : blocks)
    for (int64_t n : s.layout.numels) {
      const int64_t padded = comm::onebit_padded_size(n, world);
      want += (padded + padded / world) * 4;
    }
  std::string bytes = ckpt::read_bytes(where);
  if (static_cast<int64_t>(bytes.size()) != e["bytes"].get<int64_t>() ||
      ckpt::xxh3_hex(bytes.data(), bytes.size()) != e["xxh3_64"].get<std::string>())
    throw IoError("checkpoint: " + where + " is corrupted: its size or checksum is not the one its rank index "
                  "holds (edited, damaged or from another checkpoint; nothing was loaded)");
  if (static_cast<int64_t>(bytes.size()) != want)
    throw IoError("checkpoint: " + where + " has " + std::to_string(bytes.size()) + " bytes of error feedback; "
                  "this model at " + std::to_string(world) + " ranks needs " + std::to_string(want) +
                  " (nothing was loaded)");
  return bytes;
}

void Engine::Impl::onebit_restore(const std::string& bytes, const std::string& why) {
  onebit_ar.clear();
  onebit_announced = false;
  if (cfg.optimizer.type != OptimizerType::kOneBitAdam || world == 1) return;
  if (bytes.empty()) {
    if (onebit_compressing() && rank == 0)
      log_warn("OneBitAdam: " + why + "; the error feedback restarts from zero (as DeepSpeed's does at every load)");
    return;
  }
  onebit_make_compressors();
  std::vector<float> errors(bytes.size() / 4);
  std::memcpy(errors.data(), bytes.data(), errors.size() * 4);
  const float* at = errors.data();
  for (auto& per : onebit_ar)
    for (comm::CompressedAllReduce& ar : per) {
      ar.set_errors(at, at + ar.padded_size());
      at += ar.padded_size() + ar.chunk_size();
    }
}

}  // namespace zinc

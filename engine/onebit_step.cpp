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
//
// Note [0/1 Adam]
// ~~~~~~~~~~~~~~~
// DeepSpeed's ZeroOneAdam (deepspeed/runtime/fp16/onebit/zoadam.py; Lu et
// al. 2022), with zinc's t = the optimizer step (1-based) being applied:
//  - Before the freeze (t <= var_freeze_step): where t is a multiple of
//    var_interval the gradients are averaged in full and the step is
//    Adam's (no bias correction; zinc's Adam kernel, so these steps equal
//    AdamW with bias_correction false bit for bit); var_interval starts at
//    1 and doubles after every var_update_scaler such steps. At the other
//    steps each rank's gradient is averaged at 1 bit (per tensor, with
//    error feedback), folded into the momentum, and the weights move with
//    the variance as it stands.
//  - At the freeze the error feedback restarts from zero, as DeepSpeed's
//    does (reinitial_error_buffer).
//  - After it: every rank steps on its own gradient (m = b1 m + (1 - b1) g,
//    u = m / (sqrt(v) + eps) + wd w, w -= lr u) and accumulates -lr u and
//    the lr; every local_step_interval steps (1, doubling every
//    local_step_scaler steps up to local_step_clipper) the ranks undo their
//    local steps, average the accumulated updates times sqrt(v) + eps at 1
//    bit, set m to minus that over the summed lr, and apply it divided by
//    sqrt(v) + eps. Between synchronisations the ranks' weights differ; a
//    checkpoint keeps each rank's own (with the accumulator and the lr sum)
//    and a resume at the same world size is bit-exact; at another it takes
//    one copy and the accumulation restarts.
//  - Different from DeepSpeed: DeepSpeed counts its buffer-allocating first
//    step, so its variance and synchronisation steps fall at t + 1 where
//    zinc's fall at t; on one rank DeepSpeed leaves the momentum unchanged at
//    the steps between variance updates, where zinc folds in the gradient.
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

Engine::Impl::OneBitMode Engine::Impl::onebit_mode() const {
  const OneBitConfig& b = cfg.optimizer.onebit;
  const int64_t t = optimizer_steps + 1;
  if (cfg.optimizer.type == OptimizerType::kOneBitAdam)
    return t <= b.freeze_step ? OneBitMode::kFull : OneBitMode::kCompressedMomentum;
  if (cfg.optimizer.type == OptimizerType::kZeroOneAdam) {
    if (t > b.var_freeze_step) return OneBitMode::kLocal;
    return t % zo_var_interval == 0 ? OneBitMode::kFull : OneBitMode::kCompressedGrad;
  }
  return OneBitMode::kFull;
}

bool Engine::Impl::onebit_local_grads() const { return onebit_mode() != OneBitMode::kFull; }

void Engine::Impl::zero_one_after_step(int64_t t) {
  const OneBitConfig& b = cfg.optimizer.onebit;
  if (t <= b.var_freeze_step) {
    if (t % zo_var_interval == 0 && ++zo_var_counter == b.var_update_scaler) {
      zo_var_counter = 0;
      zo_var_interval *= 2;
    }
  } else if (++zo_local_counter == b.local_step_scaler) {
    zo_local_counter = 0;
    zo_local_interval = std::min(b.local_step_clipper, zo_local_interval * 2);
  }
  if (t >= b.var_freeze_step && !zo_errors_reset) {  // the next step is frozen
    zo_errors_reset = true;
    if (!onebit_ar.empty()) onebit_make_compressors();
  }
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

void Engine::Impl::onebit_average(int block, float* buf) {
  if (world == 1) return;
  if (onebit_ar.empty()) onebit_make_compressors();
  std::vector<comm::CompressedAllReduce>& per = onebit_ar[static_cast<size_t>(block)];
  const BlockLayout& l = blocks[static_cast<size_t>(block)].layout;
  reduce_stream->submit([&](comm::Communicator& c) {
    for (size_t t = 0; t < per.size(); ++t) per[t].average(c, buf + l.offsets[t], l.numels[t]);
  }).wait();
}

void Engine::Impl::onebit_update_all(float grad_scale) {
  if (world > 1 && onebit_ar.empty()) onebit_make_compressors();
  if (!onebit_announced && rank == 0) {
    int64_t full = 0, compressed = 0;
    for (const auto& per : onebit_ar)
      for (const comm::CompressedAllReduce& ar : per) compressed += ar.wire_bytes_per_rank();
    for (const BlockShard& s : blocks) full += s.layout.param_numel();
    full = world > 1 ? 2 * full * 4 * (world - 1) / world : 0;  // ring all-reduce of fp32 gradients
    const std::string bytes = " (" + std::to_string(compressed) + " bytes per rank, against " +
                              std::to_string(full) + " for the fp32 gradient all-reduce)";
    if (cfg.optimizer.type == OptimizerType::kOneBitAdam)
      log_info("OneBitAdam: the variance is frozen after " + std::to_string(cfg.optimizer.onebit.freeze_step) +
               " Adam steps; from optimizer step " + std::to_string(optimizer_steps) +
               " each rank sends its momentum at 1 bit per element" + bytes);
    else
      log_info("ZeroOneAdam: from optimizer step " + std::to_string(optimizer_steps) +
               ", steps between variance updates average the gradient at 1 bit per element" + bytes +
               "; the variance freezes after step " + std::to_string(cfg.optimizer.onebit.var_freeze_step));
  }
  onebit_announced = true;
  bool sync = false;
  if (onebit_now == OneBitMode::kLocal) {
    if (zo_accum.empty())
      for (const BlockShard& s : blocks) zo_accum.emplace_back(static_cast<size_t>(s.opt_numel), 0.0f);
    zo_lrs += adam.lr;
    sync = optimizer_steps % zo_local_interval == 0;
  }
  visit_updating([&](const StateSpan& sp) { onebit_span(sp, grad_scale, sync); });
  if (sync) zo_lrs = 0;
}

void Engine::Impl::onebit_span(const StateSpan& sp, float grad_scale, bool sync) {
  BlockShard& s = blocks[static_cast<size_t>(sp.block)];
  ZINC_CHECK(plan.optimizer_spans_block && sp.offset == 0 && sp.count >= s.layout.numel,
             "1-bit optimizers: a span that is not a whole block (stage 0 keeps whole blocks)");
  const int64_t n = sp.count;
  const float* g = s.grad.as<float>();
  float* m = sp.m;
  float* w = sp.master;
  const float* v = sp.v;
  const float b1 = static_cast<float>(adam.beta1), one_minus_b1 = static_cast<float>(1.0 - adam.beta1);
  const float lr = static_cast<float>(adam.lr), eps = static_cast<float>(adam.eps);
  const float wd = static_cast<float>(adam.weight_decay);
  switch (onebit_now) {
    case OneBitMode::kCompressedMomentum: {  // Note [1-bit Adam]
      for (int64_t i = 0; i < n; ++i) m[i] = b1 * m[i] + one_minus_b1 * (g[i] * grad_scale);
      onebit_average(sp.block, m);
      break;
    }
    case OneBitMode::kCompressedGrad: {  // Note [0/1 Adam], before the freeze
      std::vector<float> avg(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) avg[i] = g[i] * grad_scale;
      onebit_average(sp.block, avg.data());
      for (int64_t i = 0; i < n; ++i) m[i] = b1 * m[i] + one_minus_b1 * avg[i];
      break;
    }
    case OneBitMode::kLocal: {  // Note [0/1 Adam], after the freeze
      float* acc = zo_accum[static_cast<size_t>(sp.block)].data();
      for (int64_t i = 0; i < n; ++i) {
        m[i] = b1 * m[i] + one_minus_b1 * (g[i] * grad_scale);
        const float u = m[i] / (std::sqrt(v[i]) + eps) + wd * w[i];
        w[i] = w[i] + -lr * u;
        acc[i] = acc[i] + -lr * u;
      }
      if (sync) {
        const float lrs = static_cast<float>(zo_lrs);
        for (int64_t i = 0; i < n; ++i) {
          w[i] = w[i] - acc[i];
          acc[i] = acc[i] * (std::sqrt(v[i]) + eps);
        }
        onebit_average(sp.block, acc);
        for (int64_t i = 0; i < n; ++i) {
          m[i] = -(acc[i] / lrs);
          w[i] = w[i] + acc[i] / (std::sqrt(v[i]) + eps);
          acc[i] = 0.0f;
        }
      }
      if (char* out = compute_out(sp)) convert_f32_to_16(w, out, static_cast<size_t>(n), dtype);
      return;
    }
    case OneBitMode::kFull:
      ZINC_CHECK(false, "1-bit optimizers: a full step reached the compressed update");
  }
  // The frozen-variance update, in zinc's AdamW order (the decay first).
  const float decay = static_cast<float>(-adam.lr * adam.weight_decay);
  if (adam.weight_decay > 0)
    for (int64_t i = 0; i < n; ++i) w[i] = decay * w[i] + w[i];
  for (int64_t i = 0; i < n; ++i) w[i] = -lr * (m[i] / (std::sqrt(v[i]) + eps)) + w[i];
  if (char* out = compute_out(sp)) convert_f32_to_16(w, out, static_cast<size_t>(n), dtype);
}

// ---- checkpoints -----------------------------------------------------------------------

namespace {
std::string onebit_file(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "onebit%05d.bin", rank);
  return name;
}
void append(std::string& bytes, const float* p, size_t n) {
  bytes.append(reinterpret_cast<const char*>(p), n * 4);
}
}  // namespace

nlohmann::json Engine::Impl::onebit_save(const std::string& partial_dir) {
  if (world == 1 || (onebit_ar.empty() && zo_accum.empty())) return nullptr;
  std::string bytes;
  int64_t tensors = 0;
  for (const auto& per : onebit_ar)
    for (const comm::CompressedAllReduce& ar : per) {
      append(bytes, ar.worker_error().data(), ar.worker_error().size());
      append(bytes, ar.server_error().data(), ar.server_error().size());
      tensors += 1;
    }
  const bool local = !zo_accum.empty();
  if (local) {
    for (const auto& a : zo_accum) append(bytes, a.data(), a.size());
    opt_state->for_each_read([&](const StateSpan& sp) { append(bytes, sp.master, static_cast<size_t>(sp.count)); });
    opt_state->for_each_read([&](const StateSpan& sp) { append(bytes, sp.m, static_cast<size_t>(sp.count)); });
  }
  const std::string name = onebit_file(rank);
  ckpt::write_file_atomic((std::filesystem::path(partial_dir) / name).string(), bytes);
  nlohmann::json j = {{"file", name},
                      {"bytes", static_cast<int64_t>(bytes.size())},
                      {"xxh3_64", ckpt::xxh3_hex(bytes.data(), bytes.size())},
                      {"world_size", world},
                      {"tensors", tensors},
                      {"local_state", local}};
  if (local) j["lr_sum"] = zo_lrs;
  return j;
}

Engine::Impl::OneBitSaved Engine::Impl::onebit_read(const ckpt::TagFiles& files) const {
  OneBitSaved out;
  if (!cfg.optimizer.one_bit() || world == 1) return out;
  const int saved_world = files.meta.at("world_size").get<int>();
  const nlohmann::json& index = files.ranks.at(static_cast<size_t>(std::min(rank, saved_world - 1)));
  if (!index.contains("onebit") || index["onebit"].is_null()) {
    out.why = "the checkpoint holds no 1-bit state (saved before any compressed step, or by another optimizer)";
    return out;
  }
  if (saved_world != world) {
    out.why = "the checkpoint's 1-bit state is for " + std::to_string(saved_world) + " ranks, this run has " +
              std::to_string(world);
    return out;
  }
  const nlohmann::json& e = index["onebit"];
  const std::string where = files.dir + "/" + onebit_file(rank);
  auto malformed = [&] {
    throw IoError("checkpoint: the rank index of rank " + std::to_string(rank) + " in " + files.dir +
                  " has a malformed \"onebit\" entry (nothing was loaded)");
  };
  if (!e.is_object() || e.value("file", "") != onebit_file(rank) || !e.contains("bytes") ||
      !e["bytes"].is_number_integer() || !e.contains("xxh3_64") || !e["xxh3_64"].is_string() ||
      !e.contains("tensors") || !e["tensors"].is_number_integer())
    malformed();
  const bool local = e.value("local_state", false);
  if (local && (!e.contains("lr_sum") || !e["lr_sum"].is_number())) malformed();
  int64_t errors = 0, tensors = 0, span = 0;
  for (const BlockShard& s : blocks) {
    span += s.opt_numel;
    for (int64_t n : s.layout.numels) {
      const int64_t padded = comm::onebit_padded_size(n, world);
      errors += padded + padded / world;
      tensors += 1;
    }
  }
  const int64_t saved_tensors = e["tensors"].get<int64_t>();
  if (saved_tensors != 0 && saved_tensors != tensors) malformed();
  const int64_t want = (saved_tensors != 0 ? errors : 0) + (local ? 3 * span : 0);
  const std::string bytes = ckpt::read_bytes(where);
  if (static_cast<int64_t>(bytes.size()) != e["bytes"].get<int64_t>() ||
      ckpt::xxh3_hex(bytes.data(), bytes.size()) != e["xxh3_64"].get<std::string>())
    throw IoError("checkpoint: " + where + " is corrupted: its size or checksum is not the one its rank index "
                  "holds (edited, damaged or from another checkpoint; nothing was loaded)");
  if (static_cast<int64_t>(bytes.size()) != want * 4)
    throw IoError("checkpoint: " + where + " has " + std::to_string(bytes.size()) + " bytes of 1-bit state; this "
                  "model at " + std::to_string(world) + " ranks needs " + std::to_string(want * 4) +
                  " (nothing was loaded)");
  auto take = [&](std::vector<float>& v, int64_t count, int64_t& at) {
    v.resize(static_cast<size_t>(count));
    std::memcpy(v.data(), bytes.data() + at * 4, static_cast<size_t>(count) * 4);
    at += count;
  };
  int64_t at = 0;
  if (saved_tensors != 0) take(out.errors, errors, at);
  if (local) {
    take(out.accum, span, at);
    take(out.master, span, at);
    take(out.m, span, at);
    out.lrs = e["lr_sum"].get<double>();
  }
  return out;
}

void Engine::Impl::onebit_overwrite_span(const OneBitSaved& saved, const StateSpan& sp) const {
  if (saved.master.empty()) return;
  int64_t at = 0;
  for (int b = 0; b < sp.block; ++b) at += blocks[static_cast<size_t>(b)].opt_numel;
  at += sp.offset;
  std::memcpy(sp.master, saved.master.data() + at, static_cast<size_t>(sp.count) * 4);
  std::memcpy(sp.m, saved.m.data() + at, static_cast<size_t>(sp.count) * 4);
}

void Engine::Impl::onebit_restore(const OneBitSaved& saved) {
  onebit_ar.clear();
  zo_accum.clear();
  zo_lrs = 0;
  onebit_announced = false;
  if (cfg.optimizer.type == OptimizerType::kZeroOneAdam) {  // the schedule is a function of the step count
    zo_var_interval = 1;
    zo_var_counter = zo_local_counter = 0;
    zo_local_interval = 1;
    zo_errors_reset = false;
    for (int64_t t = 1; t <= optimizer_steps; ++t) zero_one_after_step(t);
  }
  if (!cfg.optimizer.one_bit() || world == 1) return;
  if (!saved.errors.empty()) {
    onebit_make_compressors();
    const float* at = saved.errors.data();
    for (auto& per : onebit_ar)
      for (comm::CompressedAllReduce& ar : per) {
        ar.set_errors(at, at + ar.padded_size());
        at += ar.padded_size() + ar.chunk_size();
      }
  }
  if (!saved.accum.empty()) {
    const float* at = saved.accum.data();
    for (const BlockShard& s : blocks) {
      zo_accum.emplace_back(at, at + s.opt_numel);
      at += s.opt_numel;
    }
    zo_lrs = saved.lrs;
  }
  if (!saved.why.empty() && onebit_local_grads() && rank == 0)
    log_warn(std::string(optimizer_type_name(cfg.optimizer.type)) + ": " + saved.why +
             "; the error feedback restarts from zero (as DeepSpeed's does at every load)");
}

}  // namespace zinc

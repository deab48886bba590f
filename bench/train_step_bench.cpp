// zinc-bench train-step: model FLOP/s of a training step of a reference GPT
// over oneDNN's matmul rate at the model's shapes, in the same run.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "core/alloc.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "kernels/kernels.h"
#include "kernels/profile.h"
#include "tools/experiment.h"
#include "tools/monitor.h"

namespace zinc::bench {
namespace {

// ---- train-step -------------------------------------------------------------------

struct MatmulCase {
  zinc::kernels::MatmulDesc d;
  zinc::AlignedBuffer a, b, c;
  double flops() const { return 2.0 * d.batch * d.M * d.N * d.K; }
};

// The matmuls of one training step of the GPT (gpt_matmul_descs), with
// operands already in the compute precision: what oneDNN can do at these
// shapes is the bound.
std::vector<MatmulCase> matmul_cases(const std::vector<zinc::kernels::MatmulDesc>& descs, zinc::DType dt) {
  std::vector<MatmulCase> cases;
  for (const zinc::kernels::MatmulDesc& d : descs) {
    MatmulCase mc;
    mc.d = d;
    const size_t es = zinc::dtype_bytes(dt);
    mc.a = zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.M * d.K) * es);
    mc.b = zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.K * d.N) * es);
    mc.c = zinc::AlignedBuffer(static_cast<size_t>(d.batch * d.M * d.N) * 4);
    cases.push_back(std::move(mc));
  }
  zinc::Rng rng(1);
  for (MatmulCase& mc : cases) {
    // Small random values: keeps the accumulate cases finite over many reps.
    auto fill = [&](zinc::AlignedBuffer& buf) {
      if (dt == zinc::DType::kF32)
        for (float& x : buf.span<float>()) x = static_cast<float>(rng.uniform() - 0.5) * 1e-3f;
      else
        for (zinc::bf16& x : buf.span<zinc::bf16>())
          x = zinc::float_to_bf16(static_cast<float>(rng.uniform() - 0.5) * 1e-3f);
    };
    fill(mc.a);
    fill(mc.b);
  }
  return cases;
}

// The loader's batch as packed documents of 16 to 128 tokens (seeded), the
// first third of each document's targets masked as a prompt would be, and
// the target crossing into the next document masked: what zinc.prepare's
// files give a fine-tune.
zinc::Batch as_packed(zinc::Batch b, zinc::Rng& rng) {
  b.positions.assign(b.inputs.size(), 0);
  for (int64_t r = 0; r < b.B; ++r) {
    int64_t t = 0;
    while (t < b.T) {
      const int64_t len = std::min<int64_t>(b.T - t, 16 + static_cast<int64_t>(rng.below(113)));
      for (int64_t i = 0; i < len; ++i) {
        const size_t at = static_cast<size_t>(r * b.T + t + i);
        b.positions[at] = static_cast<int32_t>(i);
        if (i < len / 3 || i + 1 == len) b.targets[at] = zinc::kIgnoreTarget;
      }
      t += len;
    }
  }
  return b;
}

}  // namespace

int bench_train_step(const BenchOptions& o) {
  const bool json = o.json, fp16 = o.fp16 && !o.fp32, bf16 = !o.fp32 && !fp16;
  const bool half = bf16 || fp16;  // timed against fp32 in the same rounds
  const char* case_name = bf16 ? "bf16" : fp16 ? "fp16" : "fp32";
  const int steps = o.steps, rounds = o.rounds;
  const StepSizes sz = step_sizes(o);
  const bool llama = sz.llama;
  const int64_t B = sz.B, T = sz.T, C = sz.C, H = sz.H, L = sz.L, V = sz.V, KV = sz.KV, I = sz.I;
  nlohmann::json model = {{"type", "gpt"}, {"n_layer", L}, {"n_head", H}, {"n_embd", C}, {"vocab_size", V}};
  if (llama)
    model = {{"type", sz.family},        {"hidden_size", C},          {"intermediate_size", I},
             {"num_hidden_layers", L},    {"num_attention_heads", H},  {"num_key_value_heads", KV},
             {"head_dim", sz.D},          {"vocab_size", V}};
  if (sz.moe.E > 0) {
    model["num_experts"] = sz.moe.E;
    model["num_experts_per_tok"] = sz.moe.k;
    model["moe_intermediate_size"] = sz.moe.Ie;
  }
  nlohmann::json doc = {
      {"train_micro_batch_size_per_gpu", B},
      {"gradient_accumulation_steps", 1},
      {"gradient_clipping", 1.0},
      {"steps_per_print", 1000000},
      {"bf16", {{"enabled", bf16}}},
      {"fp16", {{"enabled", fp16}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}}},
      {"model", model},
      {"data", {{"type", "synthetic"}, {"vocab_size", V}, {"seq_len", T}}},
  };
  zinc::tools::Experiment ex = zinc::tools::build_experiment(doc, 1);
  zinc::Engine engine = zinc::Engine::initialize(ex.model, ex.config);
  zinc::DataLoader loader(ex.data, B, 1, 1, 0, 1);
  // A bf16 run also times the same step in fp32, in the same rounds, so that
  // "bf16 against fp32" compares two figures taken in the same machine state.
  nlohmann::json doc32 = doc;
  doc32["bf16"]["enabled"] = false;
  doc32["fp16"]["enabled"] = false;
  zinc::tools::Experiment ex32 = zinc::tools::build_experiment(doc32, 1);
  std::optional<zinc::Engine> engine32;
  if (half) engine32.emplace(zinc::Engine::initialize(ex32.model, ex32.config));
  zinc::DataLoader loader32(ex32.data, B, 1, 1, 0, 1);
  // The bound multiplies in what the hardware can: bf16 where oneDNN has
  // native bf16 kernels, else fp32 (zinc's bf16 fallback multiplies in fp32
  // too, Note [bf16 matmul without native bf16]; fp16 always does, Note
  // [fp16 compute]).
  zinc::DType dt = bf16 ? zinc::DType::kBF16 : zinc::DType::kF32;
  bool bound_via_f32 = false;
  if (bf16) {
    zinc::kernels::MatmulDesc probe;
    probe.M = B * T;
    probe.N = 3 * C;
    probe.K = C;
    probe.trans_b = true;
    probe.compute = zinc::DType::kBF16;
    if (zinc::kernels::matmul_path(probe).multiply == zinc::DType::kF32) {
      dt = zinc::DType::kF32;
      bound_via_f32 = true;
    }
  }
  std::vector<MatmulCase> mm = matmul_cases(sz.matmuls(dt), dt);
  double mm_flops = 0;
  for (const MatmulCase& m : mm) mm_flops += m.flops();
  auto run_matmuls = [&] {
    for (MatmulCase& m : mm)
      zinc::kernels::matmul(m.d, {m.a.data(), dt}, {m.b.data(), dt}, m.c.as<float>());
  };

  // --packed: the same step on packed, masked batches (as_packed), an
  // engine of its own with the same config, in the same rounds.
  std::optional<zinc::Engine> engine_pk;
  if (o.packed) engine_pk.emplace(zinc::Engine::initialize(zinc::tools::build_experiment(doc, 1).model, ex.config));
  zinc::DataLoader loader_pk(ex.data, B, 1, 1, 0, 1);
  zinc::Rng pack_rng(17);
  // --lora: the same model with LoRA adapters on every linear layer (its
  // base frozen: no weight gradients, masters or optimizer states for it),
  // an engine of its own, in the same rounds.
  std::optional<zinc::Engine> engine_lora;
  if (o.lora) {
    if (!llama) throw zinc::Error("train-step --lora: LoRA needs a Llama-style --model");
    nlohmann::json doc_lora = doc;
    doc_lora["model"]["lora"] = {{"r", 16}, {"lora_alpha", 32}, {"target_modules", "all-linear"}};
    if (!o.lora_targets.empty()) doc_lora["model"]["lora"]["target_modules"] = o.lora_targets;
    if (o.lora_unpacked) doc_lora["model"]["pack_frozen_weights"] = false;
    zinc::tools::Experiment exl = zinc::tools::build_experiment(doc_lora, 1);
    engine_lora.emplace(zinc::Engine::initialize(exl.model, exl.config));
  }
  zinc::DataLoader loader_lora(ex.data, B, 1, 1, 0, 1);
  auto packed_step = [&] {
    const zinc::Batch b = as_packed(loader_pk.next(), pack_rng);
    engine_pk->forward(b);
    engine_pk->backward();
    engine_pk->step();
  };

  // --monitor: the same engine's steps followed by what zinc-train's loop
  // writes to the monitors every step (Note [monitor scalars] in
  // run_loop.cpp), tensorboard and csv_monitor both on, into a temporary
  // folder, in the same rounds.
  std::unique_ptr<zinc::tools::Monitors> monitors;
  std::string monitor_dir;
  if (o.monitor) {
    char tmpl[] = "/tmp/zinc_bench_monitor_XXXXXX";
    if (!mkdtemp(tmpl)) throw zinc::IoError("train-step --monitor: cannot make a folder in /tmp");
    monitor_dir = tmpl;
    zinc::Config mc = ex.config;
    mc.tensorboard = {true, monitor_dir, "tb"};
    mc.csv_monitor = {true, monitor_dir, "csv"};
    monitors = std::make_unique<zinc::tools::Monitors>(mc, 0);
  }
  int64_t monitored_samples = 0;
  auto monitored_step = [&] {
    const float loss = engine.train_batch(loader);
    monitored_samples += B;
    monitors->write("Train/Samples/train_loss", loss, monitored_samples);
    monitors->write("Train/Samples/lr", engine.learning_rate(), monitored_samples);
    monitors->write("Train/Samples/grad_norm", engine.global_grad_norm(), monitored_samples);
    monitors->write("Train/Samples/tokens_per_s", 1.0, monitored_samples);
    monitors->flush();
  };

  // Warm up both (primitive creation, page faults), then alternate rounds so
  // that both figures see the same machine state.
  run_matmuls();
  engine.train_batch(loader);
  engine.train_batch(loader);
  if (engine_pk) {
    packed_step();
    packed_step();
  }
  if (engine32) {
    engine32->train_batch(loader32);
    engine32->train_batch(loader32);
  }
  if (engine_lora) {
    engine_lora->train_batch(loader_lora);
    engine_lora->train_batch(loader_lora);
  }
  std::vector<double> step_s, mm_s, fwd_s, bwd_s, opt_s, step32_s, step_pk_s, step_mon_s, step_lora_s;
  std::vector<double> lora_fwd_s, lora_bwd_s, lora_opt_s;
  for (int r = 0; r < rounds; ++r) {
    double t0 = now_s();
    run_matmuls();
    run_matmuls();
    mm_s.push_back((now_s() - t0) / 2);
    if (engine32) {
      t0 = now_s();
      for (int s = 0; s < steps; ++s) engine32->train_batch(loader32);
      step32_s.push_back((now_s() - t0) / steps);
    }
    zinc::StepTimings before = engine.timings();
    t0 = now_s();
    for (int s = 0; s < steps; ++s) engine.train_batch(loader);
    step_s.push_back((now_s() - t0) / steps);
    if (engine_pk) {
      t0 = now_s();
      for (int s = 0; s < steps; ++s) packed_step();
      step_pk_s.push_back((now_s() - t0) / steps);
    }
    if (engine_lora) {
      const zinc::StepTimings lb = engine_lora->timings();
      t0 = now_s();
      for (int s = 0; s < steps; ++s) engine_lora->train_batch(loader_lora);
      step_lora_s.push_back((now_s() - t0) / steps);
      const zinc::StepTimings la = engine_lora->timings();
      lora_fwd_s.push_back((la.forward_s - lb.forward_s) / steps);
      lora_bwd_s.push_back((la.backward_s - lb.backward_s) / steps);
      lora_opt_s.push_back((la.step_s - lb.step_s) / steps);
    }
    zinc::StepTimings after = engine.timings();  // the plain steps' parts (the monitored run the same engine)
    fwd_s.push_back((after.forward_s - before.forward_s) / steps);
    bwd_s.push_back((after.backward_s - before.backward_s) / steps);
    opt_s.push_back((after.step_s - before.step_s) / steps);
    if (monitors) {
      t0 = now_s();
      for (int s = 0; s < steps; ++s) monitored_step();
      step_mon_s.push_back((now_s() - t0) / steps);
    }
  }
  // One more round with the kernel profile on (kept out of the figures above:
  // the profile adds a clock read per kernel call) to say where the time goes.
  zinc::kernels::profile_reset();
  zinc::kernels::profile_enable(true);
  zinc::StepTimings pbefore = engine.timings();
  double tp0 = now_s();
  for (int s = 0; s < steps; ++s) engine.train_batch(loader);
  const double profiled_step_s = (now_s() - tp0) / steps;
  zinc::kernels::profile_enable(false);
  const double profiled_opt_s = (engine.timings().step_s - pbefore.step_s) / steps;
  // The profile's totals as shares of a profiled step (json: seconds per step).
  auto breakdown_of = [&](double step_s_profiled, double opt_s_profiled, nlohmann::json& breakdown) {
    const zinc::kernels::ProfileTotals prof = zinc::kernels::profile_read();
    double accounted = opt_s_profiled;
    std::string text;
    for (int i = 0; i < zinc::kernels::kNumOps; ++i) {
      double per_step = prof.seconds[i] / steps;
      const auto op = static_cast<zinc::kernels::Op>(i);
      if (op == zinc::kernels::Op::kVector) continue;  // folded into "other"
      if (op == zinc::kernels::Op::kConvert || op == zinc::kernels::Op::kOptimizer || op == zinc::kernels::Op::kCopy)
        continue;  // the GPU's alone
      breakdown[zinc::kernels::op_name(static_cast<zinc::kernels::Op>(i))] = per_step;
      accounted += per_step;
      char part[96];
      std::snprintf(part, sizeof part, "%s %.1f%% | ", zinc::kernels::op_name(static_cast<zinc::kernels::Op>(i)),
                    100 * per_step / step_s_profiled);
      text += part;
    }
    breakdown["optimizer"] = opt_s_profiled;
    breakdown["other"] = step_s_profiled - accounted;
    char part[128];
    std::snprintf(part, sizeof part, "optimizer %.1f%% | other %.1f%%", 100 * opt_s_profiled / step_s_profiled,
                  100 * (step_s_profiled - accounted) / step_s_profiled);
    return text + part;
  };
  nlohmann::json breakdown = nlohmann::json::object();
  const std::string breakdown_text = breakdown_of(profiled_step_s, profiled_opt_s, breakdown);
  // And LoRA's (its matmuls against the full step's: the adapters' share).
  std::string lora_breakdown_text;
  nlohmann::json lora_breakdown = nlohmann::json::object();
  if (engine_lora) {
    zinc::kernels::profile_reset();
    zinc::kernels::profile_enable(true);
    const zinc::StepTimings lb = engine_lora->timings();
    const double tl0 = now_s();
    for (int s = 0; s < steps; ++s) engine_lora->train_batch(loader_lora);
    const double lora_profiled_s = (now_s() - tl0) / steps;
    zinc::kernels::profile_enable(false);
    lora_breakdown_text =
        breakdown_of(lora_profiled_s, (engine_lora->timings().step_s - lb.step_s) / steps, lora_breakdown);
    lora_breakdown["step"] = lora_profiled_s;
  }

  const double t_step = median(step_s), t_mm = median(mm_s);
  const double tokens_per_s = static_cast<double>(B * T) / t_step;
  const double model_flops = ex.model->flops_per_token(T) * tokens_per_s;
  const double bound = mm_flops / t_mm;
  const double ratio = model_flops / bound;
  nlohmann::json line = {{"bench", "train-step"},
                         {"case", case_name},
                         {"model", sz.name()},
                         {"figure", model_flops / 1e9},
                         {"unit", "GFLOP/s"},
                         {"bound", bound / 1e9},
                         {"ratio", ratio},
                         {"tokens_per_s", tokens_per_s},
                         {"step_s", t_step},
                         {"forward_s", median(fwd_s)},
                         {"backward_s", median(bwd_s)},
                         {"optimizer_s", median(opt_s)},
                         {"matmul_bound_s", t_mm},
                         {"bound_dtype", zinc::dtype_name(dt)},
                         {"threads", zinc::num_threads()},
                         {"params", engine.num_parameters()},
                         {"breakdown_s", breakdown}};
  std::string vs_fp32;
  if (engine32) {
    const double tps32 = static_cast<double>(B * T) / median(step32_s);
    line["fp32_tokens_per_s"] = tps32;
    line[std::string(case_name) + "_over_fp32"] = tokens_per_s / tps32;
    if (fp16) line["skipped_steps"] = engine.skipped_steps();
    char part[160];
    std::snprintf(part, sizeof part, "\n  fp32:   %.0f tokens/s in the same rounds; %s / fp32 = %.3f", tps32,
                  case_name, tokens_per_s / tps32);
    vs_fp32 = part;
  }
  if (engine_pk) {
    const double tps_pk = static_cast<double>(B * T) / median(step_pk_s);
    line["packed_tokens_per_s"] = tps_pk;
    line["packed_over_plain"] = tps_pk / tokens_per_s;
    char part[200];
    std::snprintf(part, sizeof part,
                  "\n  packed: %.0f tokens/s in the same rounds (documents of 16-128 tokens, a third of the targets "
                  "masked); packed / plain = %.3f",
                  tps_pk, tps_pk / tokens_per_s);
    vs_fp32 += part;
  }
  if (engine_lora) {
    const double t_lora = median(step_lora_s);
    line["lora_step_s"] = t_lora;
    line["lora_over_full"] = t_lora / t_step;
    line["lora_trained_params"] = engine_lora->num_trained_parameters();
    line["lora_breakdown_s"] = lora_breakdown;
    line["lora_packed_base"] = !o.lora_unpacked;
    std::string targets = "every linear layer";
    if (!o.lora_targets.empty()) {
      targets.clear();
      for (const std::string& t : o.lora_targets) targets += (targets.empty() ? "" : ",") + t;
    }
    char part[640];
    std::snprintf(part, sizeof part,
                  "\n  LoRA:   %.3f s/step in the same rounds (r 16 on %s, %.2fM of %.1fM parameters "
                  "trained%s; forward %.3f s | backward %.3f s | optimizer %.3f s); LoRA / full = %.3f"
                  "\n  LoRA's time (profiled round, share of its step): %s",
                  t_lora, targets.c_str(), static_cast<double>(engine_lora->num_trained_parameters()) / 1e6,
                  static_cast<double>(engine_lora->num_parameters()) / 1e6,
                  o.lora_unpacked ? ", base not packed" : "", median(lora_fwd_s), median(lora_bwd_s),
                  median(lora_opt_s), t_lora / t_step, lora_breakdown_text.c_str());
    vs_fp32 += part;
  }
  if (monitors) {
    const double tps_mon = static_cast<double>(B * T) / median(step_mon_s);
    line["monitored_tokens_per_s"] = tps_mon;
    line["monitored_over_plain"] = tps_mon / tokens_per_s;
    char part[200];
    std::snprintf(part, sizeof part,
                  "\n  monitored: %.0f tokens/s in the same rounds (tensorboard and csv_monitor on); monitored / "
                  "plain = %.3f",
                  tps_mon, tps_mon / tokens_per_s);
    vs_fp32 += part;
    monitors.reset();
    std::error_code ec;
    std::filesystem::remove_all(monitor_dir, ec);
  }
  char buf[4096];
  std::snprintf(buf, sizeof buf,
                "train-step (%s, %s L=%lld C=%lld H=%lld%s T=%lld B=%lld V=%lld, %d threads)\n"
                "  figure: %.1f GFLOP/s model FLOPs (%.0f tokens/s, %.3f s/step)\n"
                "  bound:  %.1f GFLOP/s oneDNN %s matmul at the model's shapes (%.3f s for one step's matmuls)%s\n"
                "  ratio:  %.3f\n"
                "  step:   forward %.3f s | backward %.3f s | optimizer %.3f s\n"
                "  where the time goes (profiled round, share of the step): %s%s",
                case_name, llama ? sz.family.c_str() : "GPT", (long long)L, (long long)C, (long long)H,
                llama ? (" KV=" + std::to_string(KV) + " I=" + std::to_string(I)).c_str() : "", (long long)T, (long long)B,
                (long long)V, zinc::num_threads(), model_flops / 1e9, tokens_per_s, t_step, bound / 1e9,
                std::string(zinc::dtype_name(dt)).c_str(), t_mm,
                bound_via_f32 ? " (no native bf16 matmul here)" : "",
                ratio, median(fwd_s), median(bwd_s), median(opt_s), breakdown_text.c_str(), vs_fp32.c_str());
  emit(json, line, buf);
  return 0;
}


}  // namespace zinc::bench

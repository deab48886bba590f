// zinc-bench activation-checkpointing: what the GPT's gradient_checkpointing
// (Note [activation checkpointing], models/gpt/model.cpp) saves in memory and costs
// in time, on a GPT whose activations dominate its memory.
//
// Memory: each case (plain, checkpointed) trains for 2 steps in a fresh
// zinc-train process (one rank), whose summary gives its peak RSS, and
// `zinc-train --estimate --json` of the same config gives the estimate. The
// figure is the RSS saved; the bound is the saving the estimate predicts
// (the model's own accounting of its activations); ratio = measured /
// predicted.
// Time: both engines in this process, alternating rounds of `steps` steps
// (medians of the engine's forward and backward times). The figure is the
// recomputation's seconds per step (checkpointed forward + backward less
// plain); the bound is one plain forward (which recomputes more: every layer,
// each with its MLP projection, and the head): ratio below 1. Also reported:
// that time as a share of the plain step, and the share of the step's model
// FLOPs the recomputation adds ((n_layer - 1) layer forwards less each MLP
// projection; Model::flops_per_token); one whole forward is about 1/3.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "engine/engine.h"

namespace zinc::bench {
namespace {


}  // namespace

int bench_activation_checkpointing(const BenchOptions& o) {
  // A GPT-2-small-wide, 12-layer model at T = 256: about 21M parameters
  // (model state ~0.4 GB) against ~1 GB of activations per micro-batch of 8.
  const int64_t L = 12, C = 384, H = 6, T = 256, B = 8;
  const std::string zinc_train = zinc_train_path();
  char tmpl[] = "/tmp/zinc-ackpt-XXXXXX";
  if (!::mkdtemp(tmpl)) throw Error("activation-checkpointing bench: mkdtemp failed");
  const std::string config = std::string(tmpl) + "/config.json";
  auto doc_for = [&](bool ck) {
    return nlohmann::json{
        {"train_batch_size", B},
        {"gradient_clipping", 1.0},
        {"bf16", {{"enabled", !o.fp32}}},
        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}}}}},
        {"zero_optimization", {{"stage", 0}}},
        {"model", {{"type", "gpt"}, {"n_layer", L}, {"n_head", H}, {"n_embd", C}, {"gradient_checkpointing", ck}}},
        {"data", {{"type", "synthetic"}, {"vocab_size", 256}, {"seq_len", T}}},
        {"run", {{"eval_interval", 0}}}};
  };

  // ---- memory: a fresh process per case ----
  double rss[2], est[2], act[2];
  for (int ck = 0; ck < 2; ++ck) {
    std::FILE* f = std::fopen(config.c_str(), "w");
    if (!f) throw Error("activation-checkpointing bench: cannot write " + config);
    std::fprintf(f, "%s\n", doc_for(ck == 1).dump(2).c_str());
    std::fclose(f);
    const std::string base = "'" + zinc_train + "' '" + config + "'";
    const nlohmann::json e = last_json_event(base + " --estimate --json 2>/dev/null", "estimate", "activation-checkpointing");
    const nlohmann::json run = last_json_event(base + " --steps 2 --json 2>/dev/null", "summary", "activation-checkpointing");
    est[ck] = e["ram_bytes"].get<double>();
    act[ck] = 0;
    for (const auto& p : e["breakdown"]["training"])
      if (p["name"] == "activations") act[ck] = p["bytes"].get<double>();
    rss[ck] = run["peak_rss_bytes"].get<double>();
  }
  std::remove(config.c_str());
  ::rmdir(tmpl);
  const double saved = rss[0] - rss[1], predicted = est[0] - est[1];
  {
    nlohmann::json line = {{"bench", "activation-checkpointing"},
                           {"case", "memory"},
                           {"figure", saved},
                           {"unit", "bytes of peak RSS saved"},
                           {"bound", predicted},
                           {"ratio", saved / predicted},
                           {"peak_rss_plain", rss[0]},
                           {"peak_rss_checkpointed", rss[1]},
                           {"estimate_plain", est[0]},
                           {"estimate_checkpointed", est[1]},
                           {"activations_plain", act[0]},
                           {"activations_checkpointed", act[1]}};
    char buf[640];
    std::snprintf(buf, sizeof buf,
                  "activation-checkpointing memory gpt%lldx%lld B=%lld T=%lld %s | peak RSS plain %.1f MiB, "
                  "checkpointed %.1f MiB: saved %.1f MiB | estimate plain %.1f MiB (activations %.1f), "
                  "checkpointed %.1f MiB (activations %.1f): predicted saving %.1f MiB | ratio %.3f | "
                  "estimate/RSS %.3f, %.3f",
                  static_cast<long long>(L), static_cast<long long>(C), static_cast<long long>(B),
                  static_cast<long long>(T), o.fp32 ? "fp32" : "bf16", rss[0] / (1 << 20), rss[1] / (1 << 20),
                  saved / (1 << 20), est[0] / (1 << 20), act[0] / (1 << 20), est[1] / (1 << 20),
                  act[1] / (1 << 20), predicted / (1 << 20), saved / predicted, est[0] / rss[0], est[1] / rss[1]);
    emit(o.json, line, buf);
  }

  // ---- time: both engines here, alternating rounds ----
  tools::Experiment ex[2] = {tools::build_experiment(doc_for(false), 1), tools::build_experiment(doc_for(true), 1)};
  std::vector<Engine> engines;
  std::vector<DataLoader> loaders;
  for (int ck = 0; ck < 2; ++ck) {
    engines.push_back(Engine::initialize(ex[ck].model, ex[ck].config));
    loaders.emplace_back(ex[ck].data, B, 1, 1, 0, 1);
  }
  for (int ck = 0; ck < 2; ++ck) engines[ck].train_batch(loaders[ck]);  // warm-up: primitives, buffers
  std::vector<double> step_s[2], fwd_s[2], bwd_s[2];
  for (int round = 0; round < o.rounds; ++round)
    for (int ck = 0; ck < 2; ++ck) {
      const StepTimings before = engines[ck].timings();
      const double t0 = now_s();
      for (int s = 0; s < o.steps; ++s) engines[ck].train_batch(loaders[ck]);
      step_s[ck].push_back((now_s() - t0) / o.steps);
      const StepTimings after = engines[ck].timings();
      fwd_s[ck].push_back((after.forward_s - before.forward_s) / o.steps);
      bwd_s[ck].push_back((after.backward_s - before.backward_s) / o.steps);
    }
  const double plain = median(step_s[0]), checkpointed = median(step_s[1]);
  // Forward plus backward (the optimizer step is the same work in both).
  const double pass_plain = median(fwd_s[0]) + median(bwd_s[0]);
  const double pass_ck = median(fwd_s[1]) + median(bwd_s[1]);
  const double extra_s = pass_ck - pass_plain;
  const double overhead = extra_s / plain;
  const double Cd = static_cast<double>(C), Td = static_cast<double>(T);
  // Recomputed per token: (L-1) x (qkv, attention projection and fc matmuls,
  // 2 x 8 C^2, plus attention's two (T x T) products, 2 x 2 T C).
  const double recompute = static_cast<double>(L - 1) * (16 * Cd * Cd + 4 * Td * Cd);
  const double predicted_overhead = recompute / ex[0].model->flops_per_token(T);
  nlohmann::json line = {{"bench", "activation-checkpointing"},
                         {"case", "time"},
                         {"figure", extra_s},
                         {"unit", "seconds of recomputation per step (forward + backward, checkpointed - plain)"},
                         {"bound", median(fwd_s[0])},
                         {"ratio", extra_s / median(fwd_s[0])},
                         {"overhead_share_of_step", overhead},
                         {"recomputed_flops_share", predicted_overhead},
                         {"step_s_plain", plain},
                         {"step_s_checkpointed", checkpointed},
                         {"forward_s_plain", median(fwd_s[0])},
                         {"forward_s_checkpointed", median(fwd_s[1])},
                         {"backward_s_plain", median(bwd_s[0])},
                         {"backward_s_checkpointed", median(bwd_s[1])},
                         {"rounds", o.rounds},
                         {"steps", o.steps}};
  char buf[768];
  std::snprintf(buf, sizeof buf,
                "activation-checkpointing time | step plain %.3f s (forward %.3f, backward %.3f), checkpointed "
                "%.3f s (forward %.3f, backward %.3f) (medians of %d rounds of %d steps) | recomputation %.3f s "
                "= %.1f%% of the plain step (its FLOPs: %.1f%% of the step's) | bound: one plain forward %.3f s | "
                "ratio %.2f",
                plain, median(fwd_s[0]), median(bwd_s[0]), checkpointed, median(fwd_s[1]), median(bwd_s[1]),
                o.rounds, o.steps, extra_s, 100 * overhead, 100 * predicted_overhead, median(fwd_s[0]),
                extra_s / median(fwd_s[0]));
  emit(o.json, line, buf);
  return 0;
}

}  // namespace zinc::bench

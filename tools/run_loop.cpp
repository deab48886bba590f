#include "tools/run_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "tools/hf_model.h"
#include "tools/monitor.h"
#include "tools/peft_adapter.h"
#include "tools/train_events.h"

namespace zinc::tools {

namespace {

// Test hook: ZINC_INJECT_ERROR=RANK:STEP makes that rank throw at that step.
void maybe_inject_error(int rank, int64_t step) {
  const char* spec = std::getenv("ZINC_INJECT_ERROR");
  if (!spec) return;
  int r = -1;
  long long st = -1;
  if (std::sscanf(spec, "%d:%lld", &r, &st) == 2 && r == rank && st == step)
    throw Error("injected failure at step " + std::to_string(step) + " (ZINC_INJECT_ERROR)");
}

}  // namespace

// Note [monitor scalars]
// ----------------------
// What the monitors (csv_monitor, tensorboard; tools/monitor.h) get, with x
// the samples trained (step x train_batch_size), as DeepSpeed's engine
// writes them:
//   every step: DeepSpeed's Train/Samples/train_loss, Train/Samples/lr, and
//     with fp16 Train/Samples/loss_scale (the scale after the step); zinc's
//     Train/Samples/grad_norm;
//   at each step event (every steps_per_print steps and the last):
//     Train/Samples/tokens_per_s, and under several ranks
//     Train/Samples/comm_wait_share (rank 0's), the values the event carries;
//   at each eval event: Eval/Samples/eval_loss.
// So with steps_per_print 1 every scalar is one of the step and eval
// events' values.

RunLoop::RunLoop(Engine& engine, DataLoader& loader, const Experiment& ex, comm::Communicator* comm, Hooks hooks)
    : engine_(engine),
      loader_(loader),
      ex_(ex),
      comm_(comm),
      hooks_(std::move(hooks)),
      world_(comm ? comm->size() : 1),
      rank_(comm ? comm->rank() : 0),
      steps_(ex.experiment.run.steps),
      tokens_per_step_(ex.config.train_batch_size * ex.data->seq_len()),
      loss_(NAN),
      eval_loss_(NAN) {
  monitor_ = std::make_unique<Monitors>(ex.config, rank_);
  if (ex.eval_data && rank_ == 0) {
    const int64_t held = eval_batches_held(*ex.eval_data, ex.config.train_micro_batch_size_per_gpu);
    if (ex.experiment.run.eval_batches > held)
      log_warn("run.eval_batches " + std::to_string(ex.experiment.run.eval_batches) + " is more than the held-out " +
               "set fills (" + std::to_string(held) + (held == 1 ? " micro-batch" : " micro-batches") + " of its " +
               std::to_string(ex.eval_data->num_samples()) + " samples): each evaluation reads the set once");
  }
}

RunLoop::~RunLoop() = default;

namespace {

std::string adapters_text(const models::LoraConfig& l) {
  std::string targets;
  for (const std::string& t : l.targets) targets += (targets.empty() ? "" : ", ") + t;
  char alpha[32];
  std::snprintf(alpha, sizeof alpha, "%g", l.alpha);
  return "r " + std::to_string(l.r) + ", lora_alpha " + alpha + (l.rslora ? ", use_rslora" : "") + " on " + targets;
}

// A resume must train the checkpoint's adapters: the same rank and targets
// (the blocks' sizes), and the same scale (lora_alpha, use_rslora), which
// no block records and which would change the model without a word; over
// the same frozen base, which the checkpoint does not hold (its digest,
// where the checkpoint records one). Said before the engine reads
// anything, with both sides' settings. The dropout may differ (it changes
// training, not the model), and so may the base's path.
void check_resumed_adapters(const ckpt::TagFiles& files, const models::LoraConfig& mine,
                            const std::function<const std::string&()>& base_fingerprint, const std::string& base) {
  const nlohmann::json client = files.meta.value("client_state", nlohmann::json::object());
  if (!client.is_object() || !client.contains("lora") || !mine.enabled()) return;  // the blocks say the rest
  const models::LoraConfig theirs = parse_peft_adapter_config(client["lora"], files.dir + ": client_state.lora");
  if (theirs.r != mine.r || theirs.alpha != mine.alpha || theirs.rslora != mine.rslora || theirs.targets != mine.targets)
    throw Error("checkpoint " + files.dir + " trained LoRA adapters of " + adapters_text(theirs) +
                "; this run's are " + adapters_text(mine) +
                ": resume with the checkpoint's model.lora (or start a new run in another run.checkpoint_dir)");
  if (client.contains("hf_fingerprint") && client["hf_fingerprint"].is_string() && !base.empty() &&
      client["hf_fingerprint"].get<std::string>() != base_fingerprint())
    throw Error("checkpoint " + files.dir + " trained LoRA adapters over a frozen base whose weights differ from " +
                base + "'s (" + client.value("hf_source", std::string("?")) + " when it was saved; a sampled digest "
                "of the safetensors files): the checkpoint does not hold the base, so resume over the same one");
}

}  // namespace

std::string data_fingerprint(const DataConfig& data) {
  if (data.type == DataType::kSynthetic) {
    // Its samples are its parameters: another seed, determinism or length
    // is other data (an epoch of 2^40 samples never shows it by its count).
    char text[160];
    std::snprintf(text, sizeof text, "synthetic V=%lld T=%lld p=%.17g seed=%llu",
                  static_cast<long long>(data.vocab_size), static_cast<long long>(data.seq_len), data.determinism,
                  static_cast<unsigned long long>(data.seed));
    return text;
  }
  std::vector<std::pair<std::string, std::string>> files = {{"data", data.path}};
  if (!data.mask_path.empty()) files.emplace_back("mask", data.mask_path);
  if (!data.documents_path.empty()) files.emplace_back("documents", data.documents_path);
  return ckpt::sampled_files_digest(files, "the training data");
}

namespace {
// The learning-rate schedule's shape as check_resume compares it: its type
// and the step counts that place a step in it ("auto" ones resolved, from
// run.steps: a resume with other --steps stretches the schedule).
nlohmann::json schedule_json(const SchedulerConfig& s) {
  nlohmann::json j = {{"type", scheduler_type_name(s.type)}};  // the counts its type reads, only
  switch (s.type) {
    case SchedulerType::kWarmupDecayLR:
    case SchedulerType::kWarmupCosineLR:
      j["total_num_steps"] = s.total_num_steps;
      [[fallthrough]];
    case SchedulerType::kWarmupLR:
      j["warmup_num_steps"] = s.warmup_num_steps;
      break;
    case SchedulerType::kOneCycle:
      j["cycle_first_step_size"] = s.cycle_first_step_size;
      j["cycle_second_step_size"] = s.cycle_second_step_size;
      break;
    default:
      break;
  }
  return j;
}
// And the optimizer's settings and the global batch, which a resume takes
// from its own config (as DeepSpeed's): a change is said, not refused.
nlohmann::json optimizer_json(const Config& c) {
  const OptimizerConfig& o = c.optimizer;
  return {{"type", optimizer_type_name(o.type)}, {"lr", o.lr()},
          {"betas", {o.beta1(), o.beta2()}},      {"weight_decay", o.weight_decay()},
          {"train_batch_size", c.train_batch_size}};
}
// "k a -> b" for each key of `mine` whose value `theirs` does not share
// (a saved value shown to 40 characters: the file may have been edited).
std::string differences(const nlohmann::json& theirs, const nlohmann::json& mine) {
  auto shown = [](const nlohmann::json& v) {
    const std::string s = v.dump();
    return s.size() > 40 ? s.substr(0, 40) + "..." : s;
  };
  std::string out;
  for (auto it = mine.begin(); it != mine.end(); ++it)
    if (!theirs.contains(it.key()) || theirs[it.key()] != it.value())
      out += (out.empty() ? "" : ", ") + it.key() + " " +
             (theirs.contains(it.key()) ? shown(theirs[it.key()]) : std::string("(none)")) + " -> " + shown(it.value());
  return out;
}
}  // namespace

void add_resume_state(nlohmann::json& client, const Experiment& ex, const DataLoader& loader, int64_t step,
                      const std::function<const std::string&()>& base_fingerprint) {
  client["samples"] = loader.position();
  client["data_samples"] = loader.source().num_samples();  // an epoch's, for check_resume
  if (const std::string d = data_fingerprint(ex.experiment.data); !d.empty()) client["data_fingerprint"] = d;
  client["step"] = step;
  client["shuffle_seed"] = ex.experiment.run.seed;  // the data order's, for check_resume
  client["lr_schedule"] = schedule_json(ex.config.scheduler);  // its length, for check_resume
  client["optimizer_settings"] = optimizer_json(ex.config);
  // What zinc-export --format hf needs to write the model in the Hugging
  // Face layout: its config.json, and the folder it came from (tokenizer files).
  if (!ex.hf) return;
  client["hf_config"] = ex.hf->raw;
  // Absolute: zinc-export runs from another folder (a relative path was
  // resolved there, against another folder's tokenizer and protection).
  if (!ex.experiment.model.from_pretrained.empty())
    client["hf_source"] =
        std::filesystem::absolute(ex.experiment.model.from_pretrained).lexically_normal().string();
  // And for zinc-export --format peft and check_resume: the adapters'
  // configuration, as PEFT's adapter_config.json writes it.
  if (ex.hf->model->lora().enabled()) {
    client["lora"] = peft_adapter_config_json(ex.hf->model->lora(), ex.experiment.model.from_pretrained,
                                              ex.hf->model->lora_fan_in_fan_out());
    if (!base_fingerprint().empty()) client["hf_fingerprint"] = base_fingerprint();
  }
}

void check_resume(const Experiment& ex, const std::string& dir, const std::string& tag, const DataLoader& loader,
                  const std::function<const std::string&()>& base_fingerprint, bool position_required) {
  const ckpt::TagFiles files = ckpt::open_tag(dir, tag);
  if (ex.hf) check_resumed_adapters(files, ex.hf->model->lora(), base_fingerprint, ex.experiment.model.from_pretrained);
  const nlohmann::json client = files.meta.value("client_state", nlohmann::json::object());
  const std::string meta = files.dir + "/metadata.json";
  if (!client.is_object())
    throw Error("checkpoint " + meta + ": client_state is " + client.dump().substr(0, 60) +
                ", not an object; nothing was loaded");
  // The data position zinc-train goes on from: an integer within what a
  // run can reach (a value near INT64_MAX overflowed the loader's position
  // arithmetic and aborted the run), read before anything loads.
  const nlohmann::json* samples = client.contains("samples") ? &client["samples"] : nullptr;
  if (!samples && !position_required) return;
  if (!samples)
    throw Error("checkpoint " + meta + " has no client_state.samples, the data position zinc-train keeps (saved by "
                "a program that keeps its own, Engine::save_checkpoint's caller?); resume it there; nothing was loaded");
  if (!samples->is_number_integer() || samples->get<int64_t>() < 0 || samples->get<int64_t>() > (int64_t{1} << 62))
    throw Error("checkpoint " + meta + ": client_state.samples is " + samples->dump() +
                ", not a data position (an integer from 0 to 2^62); nothing was loaded");
  try {
    loader.check_position(samples->get<int64_t>());
  } catch (const Error& e) {
    throw Error("checkpoint " + files.dir + ": " + e.what() + "; nothing was loaded");
  }
  if (client.contains("shuffle_seed") && client["shuffle_seed"].is_number_integer() &&
      client["shuffle_seed"].get<uint64_t>() != ex.experiment.run.seed)
    log_warn("checkpoint " + files.dir + " was saved by a run whose run.seed (the data order's) was " +
             std::to_string(client["shuffle_seed"].get<uint64_t>()) + "; this run's is " +
             std::to_string(ex.experiment.run.seed) +
             ": the run goes on from the saved position, but in another order than the saved run's (some of "
             "this epoch's samples twice, others not at all)");
  // Said once (rank 0), and only where this run trains: a resume at or
  // past run.steps only loads.
  const bool trains = !(client.contains("step") && client["step"].is_number_integer() &&
                        client["step"].get<int64_t>() >= ex.experiment.run.steps);
  if (trains && client.contains("optimizer_settings") && client["optimizer_settings"].is_object()) {
    if (const std::string differ = differences(client["optimizer_settings"], optimizer_json(ex.config)); !differ.empty())
      log_warn_rank0("checkpoint " + files.dir + " was saved by a run whose optimizer or batch differs from this run's (" +
                     differ + "): the run goes on from the saved states with this run's settings");
  }
  if (trains && client.contains("lr_schedule") && client["lr_schedule"].is_object()) {
    const std::string differ = differences(client["lr_schedule"], schedule_json(ex.config.scheduler));
    if (!differ.empty())
      log_warn_rank0("checkpoint " + files.dir + " was saved by a run whose learning-rate schedule differs from this run's (" +
                     differ + "; an \"auto\" step count follows run.steps / --steps): the run goes on from the saved "
                     "step along this run's schedule, not the saved run's");
  }
  // What the weights' shapes do not show, said (DeepSpeed loads such a
  // checkpoint without a word too): data of another length, whose epochs
  // and shuffled order the saved position no longer continues; and model
  // settings that change what the same weights compute (n_head, rope,
  // norms' eps).
  if (client.contains("data_samples") && client["data_samples"].is_number_integer() &&
      client["data_samples"].get<int64_t>() != loader.source().num_samples())
    log_warn("checkpoint " + files.dir + " was saved over data of " + std::to_string(client["data_samples"].get<int64_t>()) +
             " samples an epoch; this run's data has " + std::to_string(loader.source().num_samples()) +
             ": the run goes on from the saved position, but in another epoch and order than the saved run would");
  else if (client.contains("data_fingerprint") && client["data_fingerprint"].is_string()) {
    // One sampled digest of the data files (reads), compared once.
    const std::string theirs = client["data_fingerprint"].get<std::string>();
    const std::string mine = data_fingerprint(ex.experiment.data);
    if (theirs != mine && ex.experiment.data.type == DataType::kSynthetic)
      log_warn("checkpoint " + files.dir + " was saved over other synthetic data (" + theirs + "; this run's: " + mine +
               "): the run goes on from the saved position, over other samples than the saved run's");
    else if (theirs != mine)
      log_warn("checkpoint " + files.dir + " was saved over other data than this run's " + ex.experiment.data.path +
               " (as many samples an epoch, but a sampled digest of the data" +
               (ex.experiment.data.mask_path.empty() && ex.experiment.data.documents_path.empty()
                    ? std::string()
                    : ", mask and documents") +
               " files differs): the run goes on from the saved position, over other samples than the saved run's");
  }
  if (ex.hf && client.contains("hf_config") && client["hf_config"].is_object() && ex.hf->raw.is_object()) {
    static const std::set<std::string> kNotTheModel = {"_name_or_path", "transformers_version", "torch_dtype", "dtype",
                                                       "use_cache"};
    const nlohmann::json& theirs = client["hf_config"];
    const nlohmann::json& mine = ex.hf->raw;
    std::string differ;
    int n = 0;
    auto note = [&](const std::string& k) {
      if (kNotTheModel.count(k) || (theirs.contains(k) && mine.contains(k) && theirs[k] == mine[k])) return;
      if (++n <= 4)
        differ += (differ.empty() ? "" : ", ") + k + " " + (theirs.contains(k) ? theirs[k].dump() : "(none)") + " -> " +
                  (mine.contains(k) ? mine[k].dump() : "(none)");
    };
    for (auto it = theirs.begin(); it != theirs.end(); ++it) note(it.key());
    for (auto it = mine.begin(); it != mine.end(); ++it)
      if (!theirs.contains(it.key())) note(it.key());
    if (n > 0)
      log_warn("checkpoint " + files.dir + " was saved by a model whose settings differ from this run's (" + differ +
               (n > 4 ? ", and " + std::to_string(n - 4) + " more" : "") +
               "): a load of weights whose shapes differ is refused next; where they fit, these settings may change what "
               "they compute");
  }
}

const std::string& RunLoop::base_fingerprint() {
  if (!base_fingerprint_) {
    const std::string& base = ex_.experiment.model.from_pretrained;
    base_fingerprint_ = ex_.hf && ex_.hf->model->lora().enabled() && !base.empty() ? hf_weights_fingerprint(base)
                                                                                    : std::string();
  }
  return *base_fingerprint_;
}

nlohmann::json RunLoop::resume(const std::string& dir) {
  check_resume(ex_, dir, "", loader_, [this]() -> const std::string& { return base_fingerprint(); });
  const nlohmann::json client = engine_.load_checkpoint(dir);
  loader_.set_position(client.at("samples").get<int64_t>());
  first_step_ = engine_.global_steps() + 1;
  monitor_->resumed(engine_.global_steps() * ex_.config.train_batch_size);  // Note [monitor scalars]: x is samples
  done_ = last_saved_ = step_last_ = first_step_ - 1;
  return resume_event(dir, engine_.global_steps());
}

std::vector<nlohmann::json> RunLoop::start() {
  std::vector<nlohmann::json> evs;
  evs.push_back(config_event(ex_, world_));
  if (std::optional<nlohmann::json> a = auto_event(ex_)) evs.push_back(std::move(*a));
  t0_ = t_last_ = Clock::now();
  comm_wait_last_ = engine_.comm_wait_seconds();
  return evs;
}

void RunLoop::emit(std::vector<nlohmann::json>& evs, nlohmann::json ev) {
  if (hooks_.on_event) hooks_.on_event(ev);
  evs.push_back(std::move(ev));
}

// A checkpoint of `step` into run.checkpoint_dir with the client state that
// resumes it (zinc-train's and zinc.train's alike: either resumes the
// other's), then keep_last's pruning on rank 0.
void RunLoop::save(int64_t step, std::vector<nlohmann::json>& evs) {
  const RunConfig& run = ex_.experiment.run;
  const auto c0 = Clock::now();
  nlohmann::json client = nlohmann::json::object();
  add_resume_state(client, ex_, loader_, step, [this]() -> const std::string& { return base_fingerprint(); });
  engine_.save_checkpoint(run.checkpoint_dir, "", client);
  if (rank_ == 0) prune_checkpoints(run.checkpoint_dir, run.keep_last, step);
  last_saved_ = step;
  const double secs = std::chrono::duration<double>(Clock::now() - c0).count();
  save_s_ += secs;
  ++saves_;
  emit(evs, checkpoint_event(step, run.checkpoint_dir + "/global_step" + std::to_string(step), secs));
}

std::optional<std::vector<nlohmann::json>> RunLoop::step() {
  if (stopped_by_ != 0 || done_ >= steps_) return std::nullopt;
  const Config& cfg = ex_.config;
  const RunConfig& run = ex_.experiment.run;
  const int64_t s = done_ + 1;
  std::vector<nlohmann::json> evs;
  maybe_inject_error(rank_, s);
  loss_ = engine_.train_batch(loader_);
  done_ = s;
  // The monitors' curves (Note [monitor scalars]): x is the samples trained.
  const int64_t samples = s * cfg.train_batch_size;
  monitor_->write("Train/Samples/train_loss", loss_, samples);
  monitor_->write("Train/Samples/lr", engine_.learning_rate(), samples);
  if (cfg.fp16.enabled) monitor_->write("Train/Samples/loss_scale", engine_.loss_scale(), samples);
  monitor_->write("Train/Samples/grad_norm", engine_.global_grad_norm(), samples);
  if (s % cfg.steps_per_print == 0 || s == steps_) {
    const auto now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - t0_).count();
    const double window = std::chrono::duration<double>(now - t_last_).count();
    // Note [training time]: the window's evaluations and saves left out.
    const double training = window - (eval_s_ + save_s_ - aside_last_);
    aside_last_ = eval_s_ + save_s_;
    const double tps = training > 0 ? static_cast<double>((s - step_last_) * tokens_per_step_) / training : 0;
    // This rank's time blocked on communication over the window's time.
    std::optional<double> wait_share;
    if (world_ > 1) {
      const double wait = engine_.comm_wait_seconds();
      wait_share = window > 0 ? (wait - comm_wait_last_) / window : 0;
      comm_wait_last_ = wait;
    }
    t_last_ = now;
    step_last_ = s;
    nlohmann::json ev = step_event(engine_, s, loss_, tps, elapsed, wait_share);
    ev["eta_s"] = eta_seconds(s, elapsed);
    emit(evs, std::move(ev));
    monitor_->write("Train/Samples/tokens_per_s", tps, samples);
    if (wait_share) monitor_->write("Train/Samples/comm_wait_share", *wait_share, samples);
  }
  if (ex_.eval_data && (s % run.eval_interval == 0 || s == steps_)) {
    const auto e0 = Clock::now();
    eval_loss_ = evaluate(engine_, *ex_.eval_data, run.eval_batches, cfg.train_micro_batch_size_per_gpu);
    eval_s_ += std::chrono::duration<double>(Clock::now() - e0).count();
    ++evals_;
    eval_step_ = s;
    emit(evs, eval_event(s, eval_loss_));
    monitor_->write("Eval/Samples/eval_loss", eval_loss_, samples);
  }
  // Out before the save: a crash while saving keeps this step's curve.
  monitor_->flush();
  if (run.checkpoint_interval > 0 && s % run.checkpoint_interval == 0) save(s, evs);
  // A stop requested on any rank stops every rank at this boundary, saved.
  if (hooks_.stop_requested) {
    double stop = hooks_.stop_requested();
    if (world_ > 1) comm_->all_reduce_max_f64(&stop, 1);
    if (stop > 0) {
      stopped_by_ = static_cast<int>(stop);
      if (last_saved_ != s) save(s, evs);
      return evs;
    }
  }
  // The last step's checkpoint: after the stop's agreement, so that a stop
  // requested during this save finds the run already over.
  if (run.checkpoint_interval > 0 && s == steps_ && last_saved_ != s) save(s, evs);
  return evs;
}

// Note [training time]
// A run's time goes to its steps, its evaluations and its checkpoint saves.
// tokens_per_s (the step events' and the summary's) counts the steps' time
// alone: with the evaluations in, a 32-batch evaluation every 4 steps showed
// a fifth of the training rate after each one, and the summary a quarter.
// The ETA adds the evaluations and saves still to come (those at this step
// too: they run after its event), each at the mean of those measured so
// far (none before the first).
double RunLoop::eta_seconds(int64_t step, double elapsed) const {
  const RunConfig& run = ex_.experiment.run;
  const double per_step = (elapsed - eval_s_ - save_s_) / static_cast<double>(step - first_step_ + 1);
  // The steps k in [step, steps_] at which something runs every `interval`
  // steps and at the last step.
  auto due = [&](int64_t interval) -> int64_t {
    if (interval <= 0) return 0;
    return steps_ / interval - (step - 1) / interval + (steps_ % interval != 0 ? 1 : 0);
  };
  double eta = std::max(per_step, 0.0) * static_cast<double>(steps_ - step);
  if (ex_.eval_data && evals_ > 0) eta += eval_s_ / static_cast<double>(evals_) * static_cast<double>(due(run.eval_interval));
  if (saves_ > 0) eta += save_s_ / static_cast<double>(saves_) * static_cast<double>(due(run.checkpoint_interval));
  return eta;
}

nlohmann::json RunLoop::summary() const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
  const int64_t trained = done_ - first_step_ + 1;  // steps this process trained
  const double training = elapsed - eval_s_ - save_s_;  // Note [training time]
  nlohmann::json sum = {{"event", "summary"},
                        {"steps", done_},
                        {"final_loss", loss_},
                        {"tokens_per_s", training > 0 ? static_cast<double>(std::max<int64_t>(trained, 0) *
                                                                            tokens_per_step_) / training
                                                      : 0.0},
                        {"elapsed_s", elapsed},
                        {"eval_s", eval_s_},
                        {"checkpoint_s", save_s_},
                        {"run_steps", steps_},  // the steps asked for: "steps" is fewer after a stop
                        {"stopped_by", stopped_by_ != 0 ? nlohmann::json(stopped_by_) : nlohmann::json(nullptr)},
                        {"world_size", world_},
                        {"zero_stage", ex_.config.zero.stage},
                        {"skipped_steps", engine_.skipped_steps()}};
  const std::optional<double> floor = ex_.data->loss_floor();
  sum["loss_floor"] = floor ? nlohmann::json(*floor) : nlohmann::json(nullptr);
  if (ex_.eval_data) {
    // The last evaluation's, at its step: a run stopped between evaluations
    // (a signal) does not evaluate again on its way out.
    sum["final_eval_loss"] = eval_loss_;
    sum["final_eval_step"] = eval_step_;
  }
  return sum;
}

}  // namespace zinc::tools

#include "tools/run_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.h"
#include "tools/train_events.h"

namespace zinc::tools {

// DeepSpeed's csv_monitor layout: <output_path>/<job_name>/<event with '/'
// and ' ' replaced by '_'>.csv, rows "step,value" under a "step,<last part of
// the event name>" header written the first time this process writes a file.
// The step column is the number of samples seen, as DeepSpeed's engine logs it.
class CsvMonitor {
 public:
  explicit CsvMonitor(const CsvMonitorConfig& c) : enabled_(c.enabled) {
    if (!enabled_) return;
    dir_ = std::filesystem::path(c.output_path) / c.job_name;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) throw IoError("csv_monitor: cannot create " + dir_.string() + ": " + ec.message());
  }
  void write(const std::string& event, double value, int64_t step) {
    if (!enabled_) return;
    std::string file = event;
    for (char& ch : file)
      if (ch == '/' || ch == ' ') ch = '_';
    std::filesystem::path path = dir_ / (file + ".csv");
    std::ofstream out(path, std::ios::app);
    if (!out) throw IoError("csv_monitor: cannot write " + path.string());
    if (!written_[file]) {
      written_[file] = true;
      out << "step," << event.substr(event.rfind('/') + 1) << "\n";
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", value);
    out << step << "," << buf << "\n";
    if (!out) throw IoError("csv_monitor: write failed on " + path.string());
  }

 private:
  bool enabled_;
  std::filesystem::path dir_;
  std::map<std::string, bool> written_;
};

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

RunLoop::RunLoop(Engine& engine, DataLoader& loader, const Experiment& ex, nlohmann::json doc,
                 comm::Communicator* comm, Hooks hooks)
    : engine_(engine),
      loader_(loader),
      ex_(ex),
      doc_(std::move(doc)),
      comm_(comm),
      hooks_(std::move(hooks)),
      world_(comm ? comm->size() : 1),
      rank_(comm ? comm->rank() : 0),
      steps_(ex.experiment.run.steps),
      tokens_per_step_(ex.config.train_batch_size * ex.data->seq_len()),
      loss_(NAN),
      eval_loss_(NAN) {
  CsvMonitorConfig monitor = ex.config.csv_monitor;
  monitor.enabled = monitor.enabled && rank_ == 0;  // one writer
  monitor_ = std::make_unique<CsvMonitor>(monitor);
}

RunLoop::~RunLoop() = default;

nlohmann::json RunLoop::resume(const std::string& dir) {
  const nlohmann::json client = engine_.load_checkpoint(dir);
  loader_.set_position(client.at("samples").get<int64_t>());
  first_step_ = engine_.global_steps() + 1;
  done_ = last_saved_ = step_last_ = first_step_ - 1;
  return resume_event(dir, engine_.global_steps());
}

std::vector<nlohmann::json> RunLoop::start() {
  std::vector<nlohmann::json> evs;
  evs.push_back(config_event(ex_, doc_, world_));
  if (std::optional<nlohmann::json> a = auto_event(ex_)) evs.push_back(std::move(*a));
  t0_ = t_last_ = Clock::now();
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
  nlohmann::json client = {{"samples", loader_.position()}, {"step", step}};
  // What zinc-export --format hf needs to write the model in the Hugging
  // Face layout: its config.json, and the folder it came from (tokenizer files).
  if (ex_.hf) {
    client["hf_config"] = ex_.hf->raw;
    if (!ex_.experiment.model.from_pretrained.empty()) client["hf_source"] = ex_.experiment.model.from_pretrained;
  }
  engine_.save_checkpoint(run.checkpoint_dir, "", client);
  if (rank_ == 0) prune_checkpoints(run.checkpoint_dir, run.keep_last, step);
  last_saved_ = step;
  const double secs = std::chrono::duration<double>(Clock::now() - c0).count();
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
  const int64_t samples = s * cfg.train_batch_size;
  monitor_->write("Train/Samples/train_loss", loss_, samples);
  monitor_->write("Train/Samples/lr", engine_.learning_rate(), samples);
  if (s % cfg.steps_per_print == 0 || s == steps_) {
    const auto now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - t0_).count();
    const double window = std::chrono::duration<double>(now - t_last_).count();
    const double tps = window > 0 ? static_cast<double>((s - step_last_) * tokens_per_step_) / window : 0;
    t_last_ = now;
    step_last_ = s;
    emit(evs, step_event(engine_, s, loss_, tps, elapsed));
  }
  if (ex_.eval_data && (s % run.eval_interval == 0 || s == steps_)) {
    eval_loss_ = evaluate(engine_, *ex_.eval_data, run.eval_batches, cfg.train_micro_batch_size_per_gpu);
    emit(evs, eval_event(s, eval_loss_));
  }
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

nlohmann::json RunLoop::summary() const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
  const int64_t trained = done_ - first_step_ + 1;  // steps this process trained
  nlohmann::json sum = {{"event", "summary"},
                        {"steps", done_},
                        {"final_loss", loss_},
                        {"tokens_per_s", static_cast<double>(std::max<int64_t>(trained, 0) * tokens_per_step_) / elapsed},
                        {"elapsed_s", elapsed},
                        {"world_size", world_},
                        {"zero_stage", ex_.config.zero.stage},
                        {"skipped_steps", engine_.skipped_steps()}};
  const std::optional<double> floor = ex_.data->loss_floor();
  sum["loss_floor"] = floor ? nlohmann::json(*floor) : nlohmann::json(nullptr);
  if (ex_.eval_data) sum["final_eval_loss"] = eval_loss_;
  return sum;
}

}  // namespace zinc::tools

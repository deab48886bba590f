// zinc engine: the parsers of zinc's own config sections for config-only
// experiments (model, data, run, comm), apart from the DeepSpeed sections in
// config.cpp. (They belong to tools/ and will move there with the
// experiment's own config type.)
#include "engine/detail/config_experiment.h"

#include "engine/detail/config_reader.h"

namespace zinc::config_detail {

void parse_model(Reader& root, ModelConfig& m) {
  Reader r = root.section("model");
  r.get_choice("type", m.type, {"gpt", "mlp"});
  r.get_int("vocab_size", m.vocab_size, closed(0, 1 << 24));
  r.get_int("block_size", m.block_size, at_least(0));
  r.get_int("n_layer", m.n_layer, at_least(1));
  r.get_int("n_head", m.n_head, at_least(1));
  r.get_int("n_embd", m.n_embd, at_least(1));
  r.get_int("context", m.context, at_least(1));
  r.get_int("hidden", m.hidden, at_least(1));
  r.finish();
}

void parse_data(Reader& root, DataConfig& d) {
  Reader r = root.section("data");
  r.get_choice("type", d.type, {"synthetic", "text", "tokens"});
  bool has_path = r.get_string("path", d.path);
  r.get_int("seq_len", d.seq_len, at_least(1));
  bool has_vocab = r.get_int("vocab_size", d.vocab_size, closed(2, 65536));
  bool has_det = r.get_number("determinism", d.determinism, closed(0, 1));
  r.get_u64("seed", d.seed);
  bool has_eval = r.get_number("eval_fraction", d.eval_fraction, lo_closed(0, 1));
  r.finish();
  if (d.type == "synthetic") {
    if (has_path) r.warn(r.path_of("path"), "ignored for type \"synthetic\"");
    if (has_eval && d.eval_fraction > 0) {
      r.warn(r.path_of("eval_fraction"), "ignored for type \"synthetic\" (an endless stream)");
    }
  } else {
    if (d.path.empty()) {
      throw ConfigError(r.path_of("path"), "required for type \"" + d.type + "\" (the file to read)");
    }
    if (d.type == "tokens") {
      // A token file's vocabulary comes from the file unless the config
      // states it (then every token is checked against it).
      if (!has_vocab) d.vocab_size = 0;
    } else if (has_vocab) {
      r.warn(r.path_of("vocab_size"), "ignored for type \"text\" (bytes: the vocabulary is 256)");
    }
    if (has_det) {
      r.warn(r.path_of("determinism"), "ignored for type \"" + d.type + "\" (only synthetic data takes it)");
    }
  }
}

void parse_run(Reader& root, RunConfig& run) {
  Reader r = root.section("run");
  r.get_int("steps", run.steps, at_least(1));
  r.get_u64("seed", run.seed);
  r.get_int("eval_interval", run.eval_interval, at_least(0));
  r.get_int("eval_batches", run.eval_batches, at_least(1));
  r.get_int("checkpoint_interval", run.checkpoint_interval, at_least(0));
  if (r.get_string("output_dir", run.output_dir)) {
    if (run.output_dir.empty()) throw ConfigError(r.last_path(), "must not be empty");
    r.warn(r.last_path(), "ignored: zinc-train writes nothing there yet (checkpoints are not implemented)");
  }
  r.finish();
}

void parse_comm(Reader& root, CommConfig& comm) {
  Reader r = root.section("comm");
  r.get_choice("backend", comm.backend, {"auto", "mpi", "shm", "hierarchical"});
  r.get_number("timeout_seconds", comm.timeout_seconds, above(0));
  r.finish();
}

}  // namespace zinc::config_detail

namespace zinc {

CommConfig Config::parse_comm(const nlohmann::json& j) {
  CommConfig c;
  if (!j.is_object()) return c;
  std::vector<std::string> warnings;
  config_detail::Reader root(j, "", warnings);
  config_detail::parse_comm(root, c);
  return c;  // no root.finish(): the other keys are parse()'s
}

}  // namespace zinc

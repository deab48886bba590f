// zinc engine: config parsing and validation (see config.h).
//
// Every section parser walks its JSON object through a Reader, which knows
// the JSON path, converts and range-checks values, and remembers which keys
// it was asked about; finish() turns every other key into an "unknown key"
// error with the nearest known key suggested. Cross-field rules live in
// Config::validate(), which parse() calls last.
#include "engine/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/log.h"

namespace zinc {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------
// Small helpers

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The offending value as it appeared in the JSON, shortened for messages.
std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// A number for a message: integral values without exponent or ".0".
std::string num(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string join_path(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

// Type errors say what was expected and show the value; "auto" gets a hint
// because configs written for the Hugging Face integration are full of it.
[[noreturn]] void type_error(const std::string& path, const char* expected, const json& v) {
  std::string msg = std::string("expected ") + expected + ", got " + show(v);
  if (v.is_string() && v.get_ref<const std::string&>() == "auto") {
    msg += " (\"auto\" is a placeholder the Hugging Face Trainer fills in; zinc needs a concrete value)";
  }
  throw ConfigError(path, msg);
}

// An allowed interval of numbers, described the way error messages state it.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;

  bool contains(double v) const { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi); }
  std::string describe() const {
    bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
    if (has_lo && has_hi) {
      return std::string("in ") + (lo_open ? "(" : "[") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
    }
    if (has_lo) return std::string(lo_open ? "> " : ">= ") + num(lo);
    if (has_hi) return std::string(hi_open ? "< " : "<= ") + num(hi);
    return "a number";
  }
};
Range any() { return {}; }
Range at_least(double lo) { return {lo, std::numeric_limits<double>::infinity(), false, false}; }
Range above(double lo) { return {lo, std::numeric_limits<double>::infinity(), true, false}; }
Range closed(double lo, double hi) { return {lo, hi, false, false}; }
Range lo_closed(double lo, double hi) { return {lo, hi, false, true}; }  // [lo, hi)
Range hi_closed(double lo, double hi) { return {lo, hi, true, false}; }  // (lo, hi]

void check_range(const std::string& path, double v, const Range& r, const json& shown) {
  if (!r.contains(v)) throw ConfigError(path, "must be " + r.describe() + ", got " + show(shown));
}

// JSON value -> C++ value, with the path for errors. Integers also accept
// integral floats, since DeepSpeed configs write sizes as 5e8.
int64_t to_int(const json& v, const std::string& path, const Range& r) {
  int64_t out = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw ConfigError(path, "does not fit in a 64-bit integer, got " + show(v));
    }
    out = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) type_error(path, "an integer", v);
    if (std::fabs(d) >= 9.2e18) throw ConfigError(path, "does not fit in a 64-bit integer, got " + show(v));
    out = static_cast<int64_t>(d);
  } else {
    type_error(path, "an integer", v);
  }
  check_range(path, static_cast<double>(out), r, v);
  return out;
}

uint64_t to_u64(const json& v, const std::string& path) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() < 0) {
    throw ConfigError(path, "must be >= 0, got " + show(v));
  }
  return static_cast<uint64_t>(to_int(v, path, at_least(0)));
}

double to_number(const json& v, const std::string& path, const Range& r) {
  if (!v.is_number()) type_error(path, "a number", v);
  double d = v.get<double>();
  if (!std::isfinite(d)) throw ConfigError(path, "must be a finite number, got " + show(v));
  check_range(path, d, r, v);
  return d;
}

bool to_bool(const json& v, const std::string& path) {
  if (!v.is_boolean()) type_error(path, "true or false", v);
  return v.get<bool>();
}

std::string to_string(const json& v, const std::string& path) {
  if (!v.is_string()) type_error(path, "a string", v);
  return v.get<std::string>();
}

// A string that must be one of `choices`; returns the choice's spelling.
std::string to_choice(const json& v, const std::string& path, const std::vector<std::string>& choices,
                      bool case_insensitive) {
  std::string s = to_string(v, path);
  for (const auto& c : choices) {
    if (case_insensitive ? lower(c) == lower(s) : c == s) return c;
  }
  std::string msg = "must be one of " + join(choices) + ", got " + show(v);
  std::string near = did_you_mean(s, choices);
  if (!near.empty()) msg += " (did you mean '" + near + "'?)";
  throw ConfigError(path, msg);
}

// ---------------------------------------------------------------------------
// Reader: one JSON object at a known path.

// A key and an optional alias spelling (DeepSpeed's pydantic aliases, e.g.
// prefetch_bucket_size / stage3_prefetch_bucket_size).
struct Name {
  std::string_view key, alias;
  Name(const char* k) : key(k) {}  // NOLINT: implicit on purpose
  Name(const char* k, const char* a) : key(k), alias(a) {}
};

class Reader {
 public:
  Reader(const json& j, std::string path, std::vector<std::string>& warnings, bool given = true)
      : j_(j), path_(std::move(path)), warnings_(warnings), given_(given) {
    if (!j_.is_object()) {
      if (path_.empty()) {
        throw ConfigError("", "the top level of the config must be a JSON object, got " + show(j_));
      }
      type_error(path_, "an object", j_);
    }
  }

  const std::string& path() const { return path_; }
  // False for a section that was absent or null (read as {}).
  bool given() const { return given_; }
  std::string path_of(std::string_view key) const { return join_path(path_, key); }

  // The value under `name` (either spelling), or nullptr. Marks the name
  // known. After a hit, last_path() is the path of the spelling used.
  const json* find(const Name& name) {
    remember(name.key);
    if (!name.alias.empty()) remember(name.alias);
    auto a = j_.find(std::string(name.key));
    auto b = name.alias.empty() ? j_.end() : j_.find(std::string(name.alias));
    if (a != j_.end() && b != j_.end()) {
      throw ConfigError(path_of(name.key), "set twice, as '" + std::string(name.key) +
                                               "' and as its alias '" + std::string(name.alias) +
                                               "'; keep one");
    }
    if (a != j_.end()) {
      last_path_ = path_of(name.key);
      return &*a;
    }
    if (b != j_.end()) {
      last_path_ = path_of(name.alias);
      return &*b;
    }
    return nullptr;
  }
  const std::string& last_path() const { return last_path_; }
  bool has(const Name& name) { return find(name) != nullptr; }

  // Typed getters: if present, convert and check, store in `out`, return true.
  bool get_int(const Name& n, int64_t& out, const Range& r = any()) {
    const json* v = find(n);
    if (v) out = to_int(*v, last_path_, r);
    return v;
  }
  bool get_int(const Name& n, int& out, const Range& r) {
    int64_t x = out;
    bool got = get_int(n, x, r);
    out = static_cast<int>(x);
    return got;
  }
  bool get_u64(const Name& n, uint64_t& out) {
    const json* v = find(n);
    if (v) out = to_u64(*v, last_path_);
    return v;
  }
  bool get_number(const Name& n, double& out, const Range& r = any()) {
    const json* v = find(n);
    if (v) out = to_number(*v, last_path_, r);
    return v;
  }
  bool get_bool(const Name& n, bool& out) {
    const json* v = find(n);
    if (v) out = to_bool(*v, last_path_);
    return v;
  }
  bool get_string(const Name& n, std::string& out) {
    const json* v = find(n);
    if (v) out = to_string(*v, last_path_);
    return v;
  }
  bool get_choice(const Name& n, std::string& out, const std::vector<std::string>& choices,
                  bool case_insensitive = false) {
    const json* v = find(n);
    if (v) out = to_choice(*v, last_path_, choices, case_insensitive);
    return v;
  }

  // A nested object; absent or null gives an empty object (the defaults).
  Reader section(const Name& n) {
    const json* v = find(n);
    if (!v || v->is_null()) return Reader(empty_object(), path_of(n.key), warnings_, false);
    return Reader(*v, last_path_, warnings_, true);
  }

  // Known DeepSpeed keys that zinc does not implement. A value equal to
  // DeepSpeed's default is what zinc does anyway and passes silently;
  // anything else is a warning (harmless to ignore) or an error (ignoring it
  // would change the result).
  void ignore_bool(const Name& n, bool deflt, const char* why = nullptr) {
    bool v = deflt;
    if (get_bool(n, v) && v != deflt) warn_ignored(last_path_, why);
  }
  void ignore_int(const Name& n, int64_t deflt, const char* why = nullptr) {
    int64_t v = deflt;
    if (get_int(n, v) && v != deflt) warn_ignored(last_path_, why);
  }
  void refuse_bool(const Name& n, bool deflt, const char* why) {
    bool v = deflt;
    if (get_bool(n, v) && v != deflt) refuse(last_path_, why);
  }
  void refuse_int(const Name& n, int64_t deflt, const char* why) {
    int64_t v = deflt;
    if (get_int(n, v) && v != deflt) refuse(last_path_, why);
  }
  // Any value other than null / {} / false.
  void refuse_present(const Name& n, const char* why) {
    const json* v = find(n);
    if (v && !v->is_null() && !(v->is_object() && v->empty()) && !(v->is_boolean() && !v->get<bool>())) {
      refuse(last_path_, why);
    }
  }
  // Known, no effect in zinc, but must be a string or null (DeepSpeed's Optional[str]).
  void accept_string(const Name& n) {
    const json* v = find(n);
    if (v && !v->is_null() && !v->is_string()) type_error(last_path_, "a string", *v);
  }

  void warn(const std::string& path, const std::string& msg) {
    std::string w = path.empty() ? msg : path + ": " + msg;
    log_warn("config: " + w);
    warnings_.push_back(w);
  }
  void warn_ignored(const std::string& path, const char* why = nullptr) {
    warn(path, std::string("ignored: not implemented in zinc") + (why ? std::string("; ") + why : ""));
  }
  [[noreturn]] static void refuse(const std::string& path, const char* why) {
    throw ConfigError(path, std::string("not implemented in zinc; ") + why);
  }

  // Every key nobody asked about is an error, with the nearest known key.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) != known_.end()) continue;
      std::string msg = "unknown key";
      std::string near = did_you_mean(it.key(), known_);
      if (!near.empty()) {
        msg += " (did you mean '" + near + "'?)";
      } else if (known_.size() <= 12) {
        std::vector<std::string> sorted = known_;
        std::sort(sorted.begin(), sorted.end());
        msg += "; known keys here: " + join(sorted);
      }
      throw ConfigError(path_of(it.key()), msg);
    }
  }

 private:
  void remember(std::string_view key) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.emplace_back(key);
  }
  static const json& empty_object() {
    static const json kEmpty = json::object();
    return kEmpty;
  }

  const json& j_;
  std::string path_;
  std::vector<std::string>& warnings_;
  bool given_;
  std::vector<std::string> known_;
  std::string last_path_;
};

// ---------------------------------------------------------------------------
// Section parsers, one per struct.

// train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size;
// any two give the third (DeepSpeed's _set_batch_related_parameters), but
// zinc refuses a division with a remainder instead of rounding down.
constexpr int64_t kMaxBatch = int64_t{1} << 40;

void parse_batch(Reader& r, Config& c) {
  int64_t tbs = 0, mbs = 0, gas = 0;
  bool has_tbs = r.get_int("train_batch_size", tbs, at_least(1));
  bool has_mbs = r.get_int("train_micro_batch_size_per_gpu", mbs, at_least(1));
  bool has_gas = r.get_int("gradient_accumulation_steps", gas, at_least(1));
  // A cap far above any real batch keeps the 128-bit products below exact.
  for (auto [name, v] : {std::pair{"train_batch_size", tbs},
                         {"train_micro_batch_size_per_gpu", mbs},
                         {"gradient_accumulation_steps", gas}}) {
    if (v > kMaxBatch) {
      throw ConfigError(name, "must be <= " + std::to_string(kMaxBatch) + ", got " + std::to_string(v));
    }
  }
  const int64_t ws = c.world_size;
  const std::string w = " * world size " + std::to_string(ws);
  // Products in 128 bits: each factor fits in int64, so no overflow here.
  auto product = [](__int128 a, __int128 b, __int128 d) { return a * b * d; };
  auto fits = [](__int128 v) { return v <= std::numeric_limits<int64_t>::max(); };
  auto divide = [&](__int128 by, const std::string& by_desc) {
    if (!fits(by) || tbs % static_cast<int64_t>(by) != 0) {
      throw ConfigError("train_batch_size",
                        std::to_string(tbs) + " is not divisible by " + by_desc + " (= " +
                            (fits(by) ? std::to_string(static_cast<int64_t>(by)) : "too large") + ")");
    }
    return tbs / static_cast<int64_t>(by);
  };
  if (has_tbs && has_mbs && has_gas) {
    __int128 prod = product(mbs, gas, ws);
    if (prod != tbs) {
      throw ConfigError("train_batch_size",
                        "the batch triad does not multiply out: train_batch_size " + std::to_string(tbs) +
                            " != train_micro_batch_size_per_gpu " + std::to_string(mbs) +
                            " * gradient_accumulation_steps " + std::to_string(gas) + w + " (= " +
                            (fits(prod) ? std::to_string(static_cast<int64_t>(prod)) : "too large") + ")");
    }
  } else if (has_tbs && has_mbs) {
    gas = divide(product(mbs, ws, 1), "train_micro_batch_size_per_gpu " + std::to_string(mbs) + w);
  } else if (has_tbs && has_gas) {
    mbs = divide(product(gas, ws, 1), "gradient_accumulation_steps " + std::to_string(gas) + w);
  } else if (has_mbs && has_gas) {
    if (!fits(product(mbs, gas, ws))) {
      throw ConfigError("train_batch_size", "the product of the batch triad is too large");
    }
    tbs = mbs * gas * ws;
  } else if (has_tbs) {
    gas = 1;
    mbs = divide(ws, "world size " + std::to_string(ws));
  } else if (has_mbs) {
    gas = 1;
    if (!fits(product(mbs, ws, 1))) {
      throw ConfigError("train_batch_size", "the product of the batch triad is too large");
    }
    tbs = mbs * ws;
  } else if (has_gas) {
    throw ConfigError("gradient_accumulation_steps",
                      "needs train_batch_size or train_micro_batch_size_per_gpu as well (as in DeepSpeed)");
  } else {
    throw ConfigError("train_batch_size",
                      "missing: set train_batch_size or train_micro_batch_size_per_gpu (or both, with "
                      "gradient_accumulation_steps)");
  }
  c.train_batch_size = tbs;
  c.train_micro_batch_size_per_gpu = mbs;
  c.gradient_accumulation_steps = gas;
}

void parse_precision(Reader& r, Config& c) {
  // "bfloat16" is DeepSpeed's older spelling of "bf16".
  Reader bf = r.section({"bf16", "bfloat16"});
  bf.get_bool("enabled", c.bf16);
  bf.ignore_bool("immediate_grad_update", false);
  bf.ignore_bool("check_grad_overflow", false);
  bf.refuse_bool("bf16_master_weights_and_grads", false,
                 "zinc keeps fp32 master weights and gradients, and bf16 ones would change the result");
  bf.refuse_bool("bf16_optimizer_states", false,
                 "zinc keeps fp32 optimizer states, and bf16 ones would change the result");
  bf.finish();

  Reader fp = r.section("fp16");
  bool fp16 = false;
  fp.get_bool("enabled", fp16);
  if (fp16 && c.bf16) {
    throw ConfigError("fp16.enabled",
                      "fp16 and bf16 cannot both be enabled; keep \"bf16\": {\"enabled\": true}");
  }
  if (fp16) {
    throw ConfigError("fp16.enabled",
                      "fp16 is not supported on the CPU build; use \"bf16\": {\"enabled\": true} instead");
  }
  // The rest of the fp16 section only matters when it is enabled; check
  // types so that a config stays valid for DeepSpeed.
  bool b = false;
  int64_t i = 0;
  double d = 0;
  fp.get_bool("auto_cast", b);
  fp.get_number("loss_scale", d, at_least(0));
  fp.get_int("initial_scale_power", i);
  fp.get_int("loss_scale_window", i, at_least(1));
  fp.get_int("hysteresis", i, at_least(1));
  fp.get_bool("consecutive_hysteresis", b);
  fp.get_number("min_loss_scale", d, above(0));
  fp.get_bool("fused_mode", b);
  fp.get_bool("fp16_master_weights_and_grads", b);
  fp.finish();

  // Apex AMP: its other keys are passed to amp.initialize, so any are allowed.
  const json* amp = r.find("amp");
  if (amp && !amp->is_null()) {
    if (!amp->is_object()) type_error("amp", "an object", *amp);
    auto en = amp->find("enabled");
    if (en != amp->end() && to_bool(*en, "amp.enabled")) {
      throw ConfigError("amp.enabled", "NVIDIA Apex AMP is not supported; use \"bf16\": {\"enabled\": true}");
    }
  }

  Reader dt = r.section("data_types");
  if (dt.get_choice("grad_accum_dtype", c.grad_accum_dtype, {"fp32", "bf16", "fp16"}) &&
      c.grad_accum_dtype != "fp32") {
    throw ConfigError(dt.last_path(), "\"" + c.grad_accum_dtype +
                                          "\" is not implemented in zinc (gradients accumulate in fp32; a "
                                          "narrower accumulator would change the result); use \"fp32\"");
  }
  dt.finish();

  const json* comm = r.find("communication_data_type");
  if (comm && !comm->is_null()) {
    c.communication_data_type = to_choice(*comm, "communication_data_type", {"fp32", "bf16", "fp16"}, false);
    if (c.communication_data_type == "fp16") {
      throw ConfigError("communication_data_type",
                        "\"fp16\" is not supported on the CPU build; use \"fp32\" or \"bf16\"");
    }
  }
  const json* sp = r.find("seq_parallel_comm_data_type");
  if (sp && !sp->is_null()) r.warn_ignored("seq_parallel_comm_data_type", "zinc has no sequence parallelism");
}

void parse_optimizer(Reader& root, OptimizerConfig& o) {
  Reader r = root.section("optimizer");
  if (!r.given()) return;
  const json* t = r.find("type");
  if (!t || t->is_null()) {
    throw ConfigError("optimizer.type", "missing; set \"Adam\" or \"AdamW\" (zinc has no client optimizer)");
  }
  std::string type = to_string(*t, "optimizer.type");
  if (lower(type) == "adam") {
    o.type = "Adam";
  } else if (lower(type) == "adamw") {
    o.type = "AdamW";
  } else {
    // DeepSpeed's other built-in optimizers (lower case, as it compares them).
    static const std::vector<std::string> kDeepSpeedOnly = {"adagrad",    "lamb", "onebitadam", "zerooneadam",
                                                            "onebitlamb", "lion", "muadam",     "muadamw",
                                                            "musgd",      "muon"};
    std::string msg = show(*t) + " is not implemented in zinc; supported: Adam, AdamW";
    bool ds_known =
        std::find(kDeepSpeedOnly.begin(), kDeepSpeedOnly.end(), lower(type)) != kDeepSpeedOnly.end();
    std::string near = ds_known ? "" : did_you_mean(type, {"Adam", "AdamW"});
    if (!near.empty()) msg += " (did you mean '" + near + "'?)";
    throw ConfigError("optimizer.type", msg);
  }
  r.ignore_bool("legacy_fusion", false);

  Reader p = r.section("params");
  p.get_number("lr", o.lr, above(0));
  if (const json* b = p.find("betas")) {
    if (!b->is_array() || b->size() != 2) {
      type_error(p.last_path(), "a list of two numbers [beta1, beta2]", *b);
    }
    o.beta1 = to_number((*b)[0], p.last_path() + "[0]", lo_closed(0, 1));
    o.beta2 = to_number((*b)[1], p.last_path() + "[1]", lo_closed(0, 1));
  }
  p.get_number("eps", o.eps, above(0));
  p.get_number("weight_decay", o.weight_decay, at_least(0));
  p.get_bool("bias_correction", o.bias_correction);
  bool w_mode = o.adam_w_mode;
  bool has_w_mode = p.get_bool("adam_w_mode", w_mode);
  if (o.type == "AdamW") {
    // As in DeepSpeed, type AdamW means decoupled weight decay whatever adam_w_mode says.
    if (has_w_mode && !w_mode) {
      p.warn(p.path_of("adam_w_mode"),
             "false is overridden by type \"AdamW\" (as in DeepSpeed); use type \"Adam\" for L2-style decay");
    }
    o.adam_w_mode = true;
  } else {
    o.adam_w_mode = w_mode;
  }
  bool unused = false;
  p.get_bool("torch_adam", unused);     // torch's and DeepSpeed's Adam compute the same update
  p.get_bool("set_grad_none", unused);  // FusedAdam option; zinc zeroes gradient buffers itself
  p.refuse_bool("amsgrad", false, "AMSGrad changes the update rule; remove it or set it to false");
  p.finish();
  r.finish();
}

void parse_scheduler(Reader& root, SchedulerConfig& s) {
  Reader r = root.section("scheduler");
  if (!r.given()) return;
  const json* t = r.find("type");
  if (!t || t->is_null()) {
    throw ConfigError(
        "scheduler.type",
        "missing; set WarmupLR, WarmupDecayLR or WarmupCosineLR (or remove 'scheduler' for a constant lr)");
  }
  if (t->is_string() && (*t == "OneCycle" || *t == "LRRangeTest")) {
    throw ConfigError(
        "scheduler.type",
        show(*t) + " is not implemented in zinc; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR");
  }
  s.type = to_choice(*t, "scheduler.type", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}, false);
  const bool cosine = s.type == "WarmupCosineLR";
  const bool decays = s.type != "WarmupLR";

  Reader p = r.section("params");
  // Keys that belong to another of the three schedules get a precise message.
  for (const char* k : {"warmup_min_lr", "warmup_max_lr"}) {
    if (cosine && p.has(k)) {
      throw ConfigError(p.path_of(k),
                        "not a WarmupCosineLR parameter: it scales the optimizer's lr by "
                        "warmup_min_ratio and cos_min_ratio instead");
    }
  }
  for (const char* k : {"warmup_min_ratio", "cos_min_ratio"}) {
    if (!cosine && p.has(k)) throw ConfigError(p.path_of(k), "only used by WarmupCosineLR, not " + s.type);
  }
  if (!decays && p.has("total_num_steps")) {
    throw ConfigError(p.path_of("total_num_steps"),
                      "not a WarmupLR parameter (WarmupLR holds the lr after warmup); use WarmupDecayLR or "
                      "WarmupCosineLR to decay");
  }
  if (cosine) {
    p.get_number("warmup_min_ratio", s.warmup_min_ratio, closed(0, 1));
    p.get_number("cos_min_ratio", s.cos_min_ratio, closed(0, 1));
  } else {
    p.get_number("warmup_min_lr", s.warmup_min_lr, at_least(0));
    p.get_number("warmup_max_lr", s.warmup_max_lr, at_least(0));
  }
  p.get_int("warmup_num_steps", s.warmup_num_steps, at_least(0));
  p.get_choice("warmup_type", s.warmup_type, {"log", "linear"});
  bool has_total = decays && p.get_int("total_num_steps", s.total_num_steps, at_least(1));
  int64_t last = -1;
  if (p.get_int("last_batch_iteration", last, at_least(-1)) && last != -1) {
    p.warn_ignored(p.last_path(), "the schedule starts at step 0, or at the checkpoint's step when resuming");
  }
  p.finish();
  r.finish();

  if (decays && !has_total) {
    throw ConfigError("scheduler.params.total_num_steps",
                      "required for " + s.type + " (the step at which the decay ends)");
  }
  if (has_total && s.total_num_steps < s.warmup_num_steps) {
    p.warn("scheduler.params.total_num_steps",
           std::to_string(s.total_num_steps) + " is less than warmup_num_steps " +
               std::to_string(s.warmup_num_steps) + "; the lr drops to its floor right after warmup");
  }
  if (!cosine && s.warmup_min_lr > s.warmup_max_lr) {
    p.warn("scheduler.params.warmup_min_lr", num(s.warmup_min_lr) + " is above warmup_max_lr " +
                                                 num(s.warmup_max_lr) + "; the lr decreases during warmup");
  }
}

void parse_offload(Reader& zero, const char* key, OffloadConfig& o, bool is_param) {
  Reader r = zero.section(key);
  r.get_choice("device", o.device, {"none", "cpu", "nvme"});
  const json* path = r.find("nvme_path");
  if (path && !path->is_null()) o.nvme_path = to_string(*path, r.last_path());
  r.get_bool("pin_memory", o.pin_memory);
  r.get_int("buffer_count", o.buffer_count, at_least(2));
  if (is_param) {
    r.get_int("buffer_size", o.buffer_size, at_least(1));
    r.get_int("max_in_cpu", o.max_in_cpu, at_least(0));
  } else {
    r.get_number("ratio", o.ratio, hi_closed(0, 1));
    r.ignore_bool("pipeline_read", false);
    r.ignore_bool("pipeline_write", false);
    r.ignore_bool("fast_init", false);
    r.ignore_bool("super_offload", false);
    bool b = false;
    r.get_bool("convert_grad_on_cpu", b);  // zinc's gradients are on the CPU already
    double perc = 0.8;
    if (r.get_number("cpuadam_cores_perc", perc, closed(0, 1)) && perc != 0.8) {
      r.warn_ignored(r.last_path(), "the optimizer uses zinc's thread pool");
    }
  }
  r.finish();
}

void parse_zero(Reader& root, ZeroConfig& z) {
  z.offload_param.buffer_count = 5;  // DeepSpeed's default for parameters (4 for the optimizer)
  const json* v = root.find("zero_optimization");
  if (v && v->is_boolean()) {
    // DeepSpeed's deprecated form: true means stage 1.
    z.stage = v->get<bool>() ? 1 : 0;
    z.overlap_comm = false;
    root.warn("zero_optimization",
              "the boolean form is deprecated; write {\"stage\": " + std::to_string(z.stage) + "}");
    return;
  }
  Reader r = root.section("zero_optimization");
  r.get_int("stage", z.stage, closed(0, 3));
  if (!r.get_bool("overlap_comm", z.overlap_comm)) z.overlap_comm = z.stage == 3;
  if (r.get_bool("contiguous_gradients", z.contiguous_gradients) && !z.contiguous_gradients) {
    r.warn(r.path_of("contiguous_gradients"),
           "false is ignored: zinc's gradients always live in flat per-block buffers");
  }
  // Both false forms ask DeepSpeed for a different collective with the same
  // result; zinc keeps its own (Note [ZeRO stages] in engine/shard.h).
  if (r.get_bool("reduce_scatter", z.reduce_scatter) && !z.reduce_scatter) {
    r.warn(r.path_of("reduce_scatter"),
           "false is ignored: zinc reduce-scatters every bucket (the same sums an all-reduce gives)");
  }
  if (r.get_bool("allgather_partitions", z.allgather_partitions) && !z.allgather_partitions) {
    r.warn(r.path_of("allgather_partitions"),
           "false is ignored: zinc all-gathers the updated partitions (broadcasts would move the same data)");
  }
  r.get_int("reduce_bucket_size", z.reduce_bucket_size, at_least(1));
  r.get_int("allgather_bucket_size", z.allgather_bucket_size, at_least(1));
  r.get_int("sub_group_size", z.sub_group_size, at_least(1));
  r.get_int({"prefetch_bucket_size", "stage3_prefetch_bucket_size"}, z.stage3_prefetch_bucket_size,
            at_least(0));
  r.get_int({"param_persistence_threshold", "stage3_param_persistence_threshold"},
            z.stage3_param_persistence_threshold, at_least(0));
  r.get_int({"max_live_parameters", "stage3_max_live_parameters"}, z.stage3_max_live_parameters, at_least(1));
  r.get_int({"max_reuse_distance", "stage3_max_reuse_distance"}, z.stage3_max_reuse_distance, at_least(0));

  const bool new_opt = r.has("offload_optimizer"), new_param = r.has("offload_param");
  parse_offload(r, "offload_optimizer", z.offload_optimizer, false);
  parse_offload(r, "offload_param", z.offload_param, true);
  // Deprecated booleans that DeepSpeed maps onto the offload sections.
  bool dep = false;
  if (r.get_bool("cpu_offload", dep)) {
    if (new_opt) {
      throw ConfigError(r.last_path(),
                        "deprecated and set together with offload_optimizer; keep offload_optimizer");
    }
    r.warn(r.last_path(), "deprecated; use \"offload_optimizer\": {\"device\": \"cpu\"}");
    if (dep) z.offload_optimizer.device = "cpu";
  }
  if (r.get_bool("cpu_offload_param", dep)) {
    if (new_param) {
      throw ConfigError(r.last_path(), "deprecated and set together with offload_param; keep offload_param");
    }
    r.warn(r.last_path(), "deprecated; use \"offload_param\": {\"device\": \"cpu\"}");
    if (dep) z.offload_param.device = "cpu";
  }
  if (r.get_bool("cpu_offload_use_pin_memory", dep)) {
    r.warn(r.last_path(), "deprecated; use pin_memory in offload_optimizer / offload_param");
    if (!new_opt) z.offload_optimizer.pin_memory = dep;
    if (!new_param) z.offload_param.pin_memory = dep;
  }

  // Known DeepSpeed keys without an effect in zinc: harmless ones warn...
  r.ignore_bool("load_from_fp32_weights", true, "zinc's checkpoints always hold fp32 master weights");
  r.ignore_bool("elastic_checkpoint", false);
  r.ignore_bool("ignore_unused_parameters", true, "every zinc model parameter receives a gradient");
  r.ignore_bool("legacy_stage1", false);
  r.ignore_bool("round_robin_gradients", false);
  r.ignore_bool("use_multi_rank_bucket_allreduce", true);
  r.ignore_bool({"gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"}, false,
                "zinc's checkpoints hold fp32 weights");
  r.ignore_bool("stage3_gather_fp16_weights_on_model_save", false, "zinc's checkpoints hold fp32 weights");
  r.ignore_int({"model_persistence_threshold", "stage3_model_persistence_threshold"},
               std::numeric_limits<int64_t>::max());
  r.ignore_int({"module_granularity_threshold", "stage3_module_granularity_threshold"}, 0);
  r.ignore_bool({"use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params"}, false);
  r.ignore_bool({"allgather_sequential", "stage3_allgather_sequential"}, false);
  r.ignore_int({"partition_stream_chunk_size", "stage3_partition_stream_chunk_size"}, 0);
  r.ignore_bool("memory_efficient_linear", true);
  r.ignore_bool("pipeline_loading_checkpoint", false);
  r.ignore_bool("override_module_apply", true);
  r.ignore_bool("log_trace_cache_warnings", false);
  r.ignore_bool("enable_sanity_checks", false);
  r.ignore_bool("save_muon_momentum_buffer_in_memory", false);
  if (const json* leaf = r.find("leaf_module");
      leaf && !leaf->is_null() && !(leaf->is_object() && leaf->empty())) {
    r.warn_ignored(r.last_path(), "zinc's models declare their blocks themselves");
  }
  // ...and the ones that would change the result are errors.
  const char* kQuant = "quantized communication changes the result; set it to false";
  r.refuse_bool("zero_quantized_weights", false, kQuant);
  r.refuse_bool("zero_quantized_nontrainable_weights", false, kQuant);
  r.refuse_bool("zero_quantized_gradients", false, kQuant);
  r.refuse_present("zeropp_loco_param", "LoCo error feedback for quantized gradients; remove it");
  r.refuse_int("zero_hpz_partition_size", 1, "hierarchical (ZeRO++ hpZ) partitioning; set it to 1");
  r.refuse_int("mics_shard_size", -1, "MiCS sharding; set it to -1");
  r.refuse_bool("mics_hierarchical_params_gather", false, "MiCS sharding; set it to false");
  r.refuse_present("zenflow",
                   "ZenFlow delays part of the optimizer update, which changes the result; remove it");
  r.finish();
}

void parse_aio(Reader& root, AioConfig& a) {
  Reader r = root.section("aio");
  // O_DIRECT needs requests aligned to the device's logical block; 4096 is
  // safe for every device (DeepSpeed does not check).
  if (r.get_int("block_size", a.block_size, at_least(4096)) && a.block_size % 4096 != 0) {
    throw ConfigError(r.last_path(),
                      "must be a multiple of 4096 (O_DIRECT alignment), got " + std::to_string(a.block_size));
  }
  r.get_int("queue_depth", a.queue_depth, at_least(1));
  r.get_int({"intra_op_parallelism", "thread_count"}, a.intra_op_parallelism, at_least(1));
  r.get_bool("single_submit", a.single_submit);
  r.get_bool("overlap_events", a.overlap_events);
  r.refuse_bool("use_gds", false, "GPUDirect Storage needs a GPU; set it to false");
  std::string backend;
  if (r.get_choice("io_backend", backend, {"async_io", "posix"}) && backend == "posix") {
    r.warn_ignored(r.last_path(), "zinc always uses io_uring");
  }
  r.finish();
}

void parse_monitors(Reader& root, CsvMonitorConfig& csv) {
  Reader c = root.section("csv_monitor");
  c.get_bool("enabled", csv.enabled);
  c.get_string("output_path", csv.output_path);
  c.get_string("job_name", csv.job_name);
  c.finish();

  struct Monitor {
    const char* key;
    std::vector<const char*> string_keys;
  };
  const Monitor kIgnored[] = {
      {"tensorboard", {"output_path", "job_name"}},
      {"wandb", {"group", "team", "project"}},
      {"comet", {"project", "workspace", "api_key", "experiment_name", "experiment_key", "mode"}},
  };
  for (const Monitor& m : kIgnored) {
    Reader r = root.section(m.key);
    bool enabled = false;
    r.get_bool("enabled", enabled);
    for (const char* k : m.string_keys) r.accept_string(k);
    if (std::string_view(m.key) == "comet") {
      int64_t interval = 0;
      bool online = false;
      r.get_int("samples_log_interval", interval, at_least(1));
      r.get_bool("online", online);
    }
    r.finish();
    if (enabled) r.warn_ignored(r.path_of("enabled"), "use csv_monitor");
  }
}

// Is a DeepSpeed feature section switched on? An object with "enabled" says
// so itself; otherwise any member that is set counts.
bool feature_active(const json& v, const std::string& path) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_object()) {
    auto en = v.find("enabled");
    if (en != v.end()) return to_bool(*en, path + ".enabled");
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (feature_active(*it, join_path(path, it.key()))) return true;
    }
    return false;
  }
  return true;
}

// Top-level DeepSpeed sections and flags that zinc knows but does not
// implement. Their inner keys are not checked: zinc does not read them.
void parse_unimplemented(Reader& r) {
  enum class Act { kWarn, kError };
  struct Feature {
    const char* key;
    Act act;
    const char* why;
  };
  const Feature kFeatures[] = {
      {"flops_profiler", Act::kWarn, nullptr},
      {"activation_checkpointing", Act::kWarn, "zinc's models do not use DeepSpeed's checkpointing API"},
      {"comms_logger", Act::kWarn, nullptr},
      {"autotuning", Act::kWarn, nullptr},
      {"memory_breakdown", Act::kWarn, nullptr},
      {"dump_state", Act::kWarn, nullptr},
      {"prescale_gradients", Act::kWarn,
       "zinc averages after the reduction; prescaling changes only rounding"},
      {"disable_allgather", Act::kWarn, nullptr},
      {"dataloader_drop_last", Act::kWarn, "zinc's DataLoader always draws whole global batches"},
      {"eigenvalue", Act::kWarn, nullptr},
      {"pipeline", Act::kWarn, "zinc has no pipeline parallelism"},
      {"tensor_parallel", Act::kWarn, "zinc has no tensor parallelism"},
      {"hybrid_engine", Act::kWarn, nullptr},
      {"compile", Act::kWarn, nullptr},
      {"timers", Act::kWarn, nullptr},
      {"nebula", Act::kWarn, nullptr},
      {"graph_harvesting", Act::kWarn, nullptr},
      {"use_data_before_expert_parallelism", Act::kWarn, "zinc has no expert parallelism"},
      {"elasticity", Act::kError, "elastic training changes the batch size with the world size; remove it"},
      {"compression_training", Act::kError, "it quantizes or prunes the model, which changes the result"},
      {"sparse_gradients", Act::kError, "zinc reduces dense gradients; set it to false"},
      {"progressive_layer_drop", Act::kError, "layer drop changes the model's computation"},
      {"curriculum_learning", Act::kError, "it changes the data order and sequence lengths"},
      {"data_efficiency", Act::kError, "it changes the data order and sequence lengths"},
      {"quantize_training", Act::kError, "it quantizes weights during training"},
      {"sparse_attention", Act::kError, "it changes the attention pattern"},
      {"weight_quantization", Act::kError, "it quantizes the weights"},
      {"torch_autocast", Act::kError, "autocast changes the numerics; use \"bf16\": {\"enabled\": true}"},
  };
  for (const Feature& f : kFeatures) {
    const json* v = r.find(f.key);
    if (!v || !feature_active(*v, f.key)) continue;
    if (f.act == Act::kWarn) {
      r.warn_ignored(f.key, f.why);
    } else {
      Reader::refuse(f.key, f.why);
    }
  }
  double predivide = 1.0;
  if (r.get_number("gradient_predivide_factor", predivide, above(0)) && predivide != 1.0) {
    r.warn_ignored("gradient_predivide_factor", "zinc divides by the world size after the reduction");
  }
  bool b = false;
  r.get_bool("zero_allow_untested_optimizer", b);  // zinc's optimizers are all ZeRO-aware
  r.get_bool("zero_force_ds_cpu_optimizer", b);
  int64_t vocab = 0;
  r.get_int("vocabulary_size", vocab, at_least(1));  // DeepSpeed reads it for nothing zinc does

  Reader ck = r.section("checkpoint");
  std::string tag = "Warn";
  if (ck.get_choice("tag_validation", tag, {"Ignore", "Warn", "Fail"}, true) && tag != "Warn") {
    ck.warn_ignored(ck.last_path(), "zinc does not validate checkpoint tags across ranks");
  }
  ck.ignore_bool("load_universal", false);
  ck.ignore_bool("use_node_local_storage", false);
  for (const char* k : {"parallel_write", "writer"}) {
    if (const json* w = ck.find(k); w && feature_active(*w, ck.last_path())) ck.warn_ignored(ck.last_path());
  }
  ck.finish();
}

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

// Line and column (1-based) of a byte offset in `text`.
std::pair<size_t, size_t> line_col(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

}  // namespace

// ---------------------------------------------------------------------------

Config Config::parse(const json& j, int world_size) {
  if (world_size < 1) throw ConfigError("", "world size must be >= 1, got " + std::to_string(world_size));
  Config c;
  c.world_size = world_size;
  Reader r(j, "", c.warnings);
  parse_batch(r, c);
  r.get_number("gradient_clipping", c.gradient_clipping, at_least(0));
  r.get_int("steps_per_print", c.steps_per_print, at_least(1));
  r.get_bool("wall_clock_breakdown", c.wall_clock_breakdown);
  parse_precision(r, c);
  parse_optimizer(r, c.optimizer);
  parse_scheduler(r, c.scheduler);
  parse_zero(r, c.zero);
  parse_aio(r, c.aio);
  parse_monitors(r, c.csv_monitor);
  parse_unimplemented(r);
  parse_model(r, c.model);
  parse_data(r, c.data);
  parse_run(r, c.run);
  parse_comm(r, c.comm);
  r.finish();
  c.validate();
  return c;
}

void Config::validate() const {
  // The batch triad, for configs built in code as well as parsed ones.
  if (world_size < 1) throw ConfigError("", "world size must be >= 1, got " + std::to_string(world_size));
  if (train_batch_size < 1 || train_micro_batch_size_per_gpu < 1 || gradient_accumulation_steps < 1 ||
      train_micro_batch_size_per_gpu > kMaxBatch || gradient_accumulation_steps > kMaxBatch ||
      static_cast<__int128>(train_micro_batch_size_per_gpu) * gradient_accumulation_steps * world_size !=
          train_batch_size) {
    throw ConfigError("train_batch_size",
                      "the batch triad does not multiply out: train_batch_size " +
                          std::to_string(train_batch_size) + " != train_micro_batch_size_per_gpu " +
                          std::to_string(train_micro_batch_size_per_gpu) + " * gradient_accumulation_steps " +
                          std::to_string(gradient_accumulation_steps) + " * world size " +
                          std::to_string(world_size));
  }
  if (!(gradient_clipping >= 0)) {
    throw ConfigError("gradient_clipping", "must be >= 0, got " + num(gradient_clipping));
  }
  if (steps_per_print < 1) {
    throw ConfigError("steps_per_print", "must be >= 1, got " + std::to_string(steps_per_print));
  }
  if (grad_accum_dtype != "fp32") {
    throw ConfigError("data_types.grad_accum_dtype",
                      "only \"fp32\" is implemented, got \"" + grad_accum_dtype + "\"");
  }
  if (!communication_data_type.empty() && communication_data_type != "fp32" &&
      communication_data_type != "bf16") {
    throw ConfigError("communication_data_type", "must be \"fp32\" or \"bf16\" on the CPU build, got \"" +
                                                     communication_data_type + "\"");
  }
  if (optimizer.type != "Adam" && optimizer.type != "AdamW") {
    throw ConfigError("optimizer.type",
                      "\"" + optimizer.type + "\" is not implemented in zinc; supported: Adam, AdamW");
  }
  if (optimizer.type == "AdamW" && !optimizer.adam_w_mode) {
    throw ConfigError("optimizer.params.adam_w_mode", "type AdamW needs adam_w_mode true");
  }
  if (!scheduler.type.empty() && scheduler.type != "WarmupLR" && scheduler.type != "WarmupDecayLR" &&
      scheduler.type != "WarmupCosineLR") {
    throw ConfigError("scheduler.type",
                      "\"" + scheduler.type +
                          "\" is not implemented in zinc; supported: WarmupLR, WarmupDecayLR, "
                          "WarmupCosineLR");
  }
  if ((scheduler.type == "WarmupDecayLR" || scheduler.type == "WarmupCosineLR") &&
      scheduler.total_num_steps < 1) {
    throw ConfigError("scheduler.params.total_num_steps",
                      "required for " + scheduler.type + " (the step at which the decay ends)");
  }

  // zinc's own sections.
  if (model.type == "gpt") {
    if (model.n_embd % model.n_head != 0) {
      throw ConfigError("model.n_embd", "must be divisible by n_head " + std::to_string(model.n_head) +
                                            ", got " + std::to_string(model.n_embd));
    }
    if (model.block_size > 0 && model.block_size < data.seq_len) {
      throw ConfigError("model.block_size", "must be >= data.seq_len " + std::to_string(data.seq_len) +
                                                ", got " + std::to_string(model.block_size));
    }
  }
  int64_t data_vocab = data.type == "synthetic" ? data.vocab_size : data.type == "text" ? 256 : 0;
  if (model.vocab_size > 0 && data_vocab > 0 && model.vocab_size < data_vocab) {
    throw ConfigError("model.vocab_size", "must be >= the data's vocabulary " + std::to_string(data_vocab) +
                                              " (or 0 to take it from the data), got " +
                                              std::to_string(model.vocab_size));
  }
  if ((data.type == "text" || data.type == "tokens") && data.path.empty()) {
    throw ConfigError("data.path", "required for type \"" + data.type + "\" (the file to read)");
  }

  // ZeRO: inconsistent combinations first, then what zinc does not do yet.
  const auto& oo = zero.offload_optimizer;
  const auto& op = zero.offload_param;
  if (op.device != "none" && zero.stage != 3) {
    throw ConfigError(
        "zero_optimization.offload_param",
        "parameter offload needs ZeRO stage 3 (parameters are only partitioned there), got stage " +
            std::to_string(zero.stage));
  }
  if (oo.device != "none" && zero.stage == 0) {
    throw ConfigError("zero_optimization.offload_optimizer",
                      "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0");
  }
  if (oo.ratio < 1.0 && zero.stage != 3) {
    throw ConfigError("zero_optimization.offload_optimizer.ratio",
                      "partial offload (ratio < 1) needs ZeRO stage 3, got ratio " + num(oo.ratio) +
                          " at stage " + std::to_string(zero.stage));
  }
  for (const auto* o : {&oo, &op}) {
    const char* name = o == &oo ? "offload_optimizer" : "offload_param";
    if (o->device == "nvme" && o->nvme_path.empty()) {
      throw ConfigError(std::string("zero_optimization.") + name + ".nvme_path",
                        "required for device \"nvme\"");
    }
  }
  if (op.device != "none") {
    throw ConfigError("zero_optimization.offload_param.device",
                      "parameter offload (\"" + op.device + "\") is not implemented yet in zinc; set \"none\"");
  }
  if (zero.stage == 3) {
    throw ConfigError("zero_optimization.stage",
                      "ZeRO stage 3 is not implemented yet in zinc (stages 0, 1 and 2 are); set 0, 1 or 2");
  }
}

json read_json_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw posix_error("cannot open config file " + path, errno);
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f);
  int err = errno;
  std::fclose(f);
  if (failed) throw posix_error("cannot read config file " + path, err);

  // DeepSpeed rejects duplicate keys (dict_raise_error_on_duplicate_keys);
  // nlohmann would keep the last one silently. Track the keys per object.
  std::vector<std::set<std::string>> seen;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        seen.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!seen.empty()) seen.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!seen.empty() && !seen.back().insert(key).second) {
          throw ConfigError(path, "duplicate key '" + key + "' (DeepSpeed rejects duplicate keys too)");
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, callback);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_col(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    // nlohmann's text starts with "[json.exception.parse_error.101] parse error at line L, column C: ".
    if (auto pos = what.find(": "); pos != std::string::npos && what.find("parse error") < pos) {
      what = what.substr(pos + 2);
    }
    throw ConfigError(path, "JSON syntax error at line " + std::to_string(line) + ", column " +
                                std::to_string(col) + ": " + what);
  }
  return j;
}

Config Config::load(const std::string& path, int world_size) { return parse(read_json_file(path), world_size); }

void apply_override(json& j, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos) {
    throw ConfigError(assignment,
                      "an override must look like key.path=value (e.g. optimizer.params.lr=3e-4)");
  }
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& p : parts) {
    if (p.empty()) throw ConfigError(key, "empty component in override path '" + key + "'");
  }
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;  // a bare word: `--set optimizer.type=AdamW`
  }

  if (j.is_null()) j = json::object();
  json* cur = &j;
  std::string at;  // the path walked so far
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    const bool last = i + 1 == parts.size();
    std::string here = join_path(at, p);
    if (cur->is_array()) {
      bool numeric = std::all_of(p.begin(), p.end(),
                                 [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
      if (!numeric) {
        throw ConfigError(
            here, "'" + (at.empty() ? std::string("<root>") : at) + "' is a list; index it with a number");
      }
      size_t idx = std::stoul(p);
      if (idx > cur->size() || (!last && idx == cur->size())) {
        throw ConfigError(here,
                          "index " + p + " is out of range for a list of " + std::to_string(cur->size()));
      }
      if (idx == cur->size()) {
        cur->push_back(value);  // appending one past the end
        return;
      }
      cur = &(*cur)[idx];
    } else if (cur->is_object()) {
      cur = &(*cur)[p];
    } else {
      throw ConfigError(here,
                        "cannot set a key inside '" + at + "', which is " + show(*cur) + ", not an object");
    }
    if (last) {
      *cur = value;
    } else if (cur->is_null()) {
      *cur = json::object();
    }
    at = here;
  }
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates) {
  const std::string k = lower(key);
  const size_t limit = std::max<size_t>(2, k.size() / 3);
  std::string best;
  size_t best_dist = limit + 1;
  std::vector<size_t> row;
  for (const auto& cand : candidates) {
    const std::string c = lower(cand);
    // Levenshtein distance, one row at a time.
    row.resize(c.size() + 1);
    for (size_t x = 0; x <= c.size(); ++x) row[x] = x;
    for (size_t y = 1; y <= k.size(); ++y) {
      size_t diag = row[0];
      row[0] = y;
      for (size_t x = 1; x <= c.size(); ++x) {
        size_t up = row[x];
        row[x] = std::min({row[x] + 1, row[x - 1] + 1, diag + (k[y - 1] == c[x - 1] ? 0 : 1)});
        diag = up;
      }
    }
    if (row[c.size()] < best_dist) {
      best_dist = row[c.size()];
      best = cand;
    }
  }
  return best;
}

}  // namespace zinc

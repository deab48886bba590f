// zinc engine: the config's section parsers and Config::parse (see
// config.h). Every section parser walks its JSON object through a Reader
// (engine/config_reader.h). Cross-field rules live in
// Config::validate() (config_validate.cpp), which parse() calls last; files
// and --set overrides are config_file.cpp's.
#include "engine/config.h"

#include "core/device.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <regex>
#include <limits>
#include <set>
#include <utility>
#include <string_view>

#include "core/error.h"
#include "core/log.h"
#include "engine/config_reader.h"
#include "engine/config_sections.h"

namespace zinc {
namespace {

using namespace config;

// ---------------------------------------------------------------------------
// Section parsers, one per struct.

// train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size;
// any two give the third (DeepSpeed's _set_batch_related_parameters), but
// zinc refuses a division with a remainder instead of rounding down.

void parse_batch(Reader& r, Config& c) {
  int64_t tbs = 0, mbs = 0, gas = 0;
  bool has_tbs = r.get_int("train_batch_size", tbs, at_least(1));
  bool has_mbs = r.get_int("train_micro_batch_size_per_gpu", mbs, at_least(1));
  bool has_gas = r.get_int("gradient_accumulation_steps", gas, at_least(1));
  // A cap far above any real batch keeps the 128-bit products below exact.
  for (auto [name, v] : {std::pair{"train_batch_size", tbs},
                         {"train_micro_batch_size_per_gpu", mbs},
                         {"gradient_accumulation_steps", gas}}) {
    if (v > Config::kMaxBatch) {
      throw ConfigError(name,
                        "must be <= " + std::to_string(Config::kMaxBatch) + ", got " + std::to_string(v));
    }
  }
  const int64_t ws = c.data_parallel_size();
  const std::string w =
      c.model_parallel_size() > 1
          ? " * data-parallel size " + std::to_string(ws) + " (world size " + std::to_string(c.world_size) +
                (c.pipelined() ? " / pipeline.stages " + std::to_string(c.pipeline.stages) : std::string()) +
                (c.tensor_split() ? " / tensor_parallel.autotp_size " + std::to_string(c.tensor_parallel.size)
                                  : std::string()) +
                (c.sequence_split() ? " / sequence_parallel_size " + std::to_string(c.sequence_parallel_size)
                                    : std::string()) +
                ")"
          : " * world size " + std::to_string(ws);
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
  // DeepSpeed's default (true): a step whose gradients are not finite is
  // skipped, which zinc always does; false (apply it) is not followed.
  bf.ignore_bool("check_grad_overflow", true, "zinc always skips a step whose gradient norm is not finite");
  // Megatron-DeepSpeed's configs carry fp16's loss_scale into this section;
  // DeepSpeed never read it there (bf16 needs no loss scaling).
  if (double ls = 0; bf.get_number("loss_scale", ls, at_least(0)) && ls != 0 && ls != 1)
    bf.warn_ignored(bf.last_path(), "bf16 trains without loss scaling (DeepSpeed does not read it here either)");
  // Some configs (DeepSpeedExamples' cifar) copy fp16's other loss-scaling
  // keys here too; DeepSpeed's bf16 section never read them.
  for (const char* k : {"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}) {
    if (double v = 0; bf.get_number(k, v, at_least(0)))
      bf.warn_ignored(bf.last_path(), "bf16 trains without loss scaling (DeepSpeed does not read it here either)");
  }
  if (bool v = false; bf.get_bool("consecutive_hysteresis", v))
    bf.warn_ignored(bf.last_path(), "bf16 trains without loss scaling (DeepSpeed does not read it here either)");
  bf.refuse_bool("bf16_master_weights_and_grads", false,
                 "zinc keeps fp32 master weights and gradients, and bf16 ones would change the result");
  bf.refuse_bool("bf16_optimizer_states", false,
                 "zinc keeps fp32 optimizer states, and bf16 ones would change the result");
  bf.finish();

  Reader fp = r.section("fp16");
  Fp16Config& f = c.fp16;
  fp.get_bool("enabled", f.enabled);
  if (f.enabled && c.bf16) {
    throw ConfigError("fp16.enabled",
                      "fp16 and bf16 cannot both be enabled; keep one of \"fp16\" and \"bf16\"");
  }
  // Read (and range-checked) whether or not enabled, so that a config stays
  // valid for DeepSpeed.
  fp.get_number("loss_scale", f.loss_scale, at_least(0));
  fp.get_int("initial_scale_power", f.initial_scale_power, closed(0, 64));
  fp.get_int("loss_scale_window", f.loss_scale_window, at_least(1));
  fp.get_int("hysteresis", f.hysteresis, at_least(1));
  fp.get_bool("consecutive_hysteresis", f.consecutive_hysteresis);
  fp.get_number("min_loss_scale", f.min_loss_scale, above(0));
  if (bool ac = false; fp.get_bool("auto_cast", ac) && ac && f.enabled)
    fp.warn_ignored(fp.last_path(), "zinc's models take token ids, so there are no float inputs to cast");
  fp.ignore_bool("fused_mode", false);
  fp.refuse_bool("fp16_master_weights_and_grads", false,
                 "zinc keeps fp32 master weights and gradients, and fp16 ones would change the result");
  fp.finish();
  // A static scale: 1 / scale multiplies every gradient in fp32, and the
  // loss times scale is what backward starts from. Past 2^-64..2^64 (the
  // dynamic scale's own range: initial_scale_power <= 64) one of them
  // leaves float's range: 1e-40 made the unscaling factor inf and every
  // weight NaN, 1e300 overflowed every step for good.
  if (f.loss_scale != 0 && (f.loss_scale < std::ldexp(1.0, -64) || f.loss_scale > std::ldexp(1.0, 64)))
    throw ConfigError("fp16.loss_scale", "a static loss scale must lie between 2^-64 and 2^64 (0: dynamic), got " +
                                             num(f.loss_scale));
  if (f.enabled && f.loss_scale == 0 && std::ldexp(1.0, static_cast<int>(f.initial_scale_power)) < f.min_loss_scale)
    throw ConfigError("fp16.initial_scale_power",
                      "2^" + std::to_string(f.initial_scale_power) + " is below fp16.min_loss_scale " +
                          num(f.min_loss_scale));

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
  std::string accum;
  if (dt.get_choice("grad_accum_dtype", accum, {"fp32", "bf16", "fp16"}) && accum != "fp32") {
    throw ConfigError(dt.last_path(), "\"" + accum +
                                          "\" is not implemented in zinc (gradients accumulate in fp32; a "
                                          "narrower accumulator would change the result); use \"fp32\"");
  }
  c.grad_accum_dtype = DType::kF32;
  dt.finish();

  const json* comm = r.find("communication_data_type");
  if (comm && !comm->is_null()) {
    const std::string wire = to_choice(*comm, "communication_data_type", {"fp32", "bf16", "fp16"}, false);
    c.communication_data_type = wire == "bf16" ? DType::kBF16 : wire == "fp16" ? DType::kF16 : DType::kF32;
  }
  // DeepSpeed reads "seq_parallel_comm_data_type"; its constants.py documents
  // the key as "seq_parallel_communication_data_type", and configs copied from
  // there (Accelerate's ALST example) carry that spelling, which DeepSpeed
  // never reads. Either way it only sets the wire type of sequence-parallel
  // collectives.
  for (const char* key : {"seq_parallel_comm_data_type", "seq_parallel_communication_data_type"}) {
    const json* sp = r.find(key);
    if (!sp || sp->is_null()) continue;
    to_choice(*sp, key, {"fp32", "bf16", "fp16"}, false);
    r.warn_ignored(key, std::string_view(key) == "seq_parallel_comm_data_type"
                            ? "zinc's sequence ranks (sequence_parallel_size) exchange activations in fp32"
                            : "zinc's sequence ranks (sequence_parallel_size) exchange activations in fp32 (and "
                              "DeepSpeed reads this type from seq_parallel_comm_data_type, the spelling its "
                              "documentation does not give)");
  }
}

void parse_offload(Reader& zero, const char* key, OffloadConfig& o, bool is_param) {
  Reader r = zero.section(key);
  r.get_enum<OffloadDevice>("device", o.device,
                            {{"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}});
  const json* path = r.find("nvme_path");
  if (path && !path->is_null()) o.nvme_path = to_file_name(*path, r.last_path());
  r.get_bool("pin_memory", o.pin_memory);
  if (is_param) {
    // DeepSpeed's pool of parameter buffers; zinc's gathered blocks are
    // bounded by stage3_max_live_parameters and its NVMe read buffers by
    // the blocks gathered, so these size nothing here.
    const char* why = "zinc bounds parameter buffers by stage3_max_live_parameters";
    const OffloadConfig d;
    if (r.get_int("buffer_count", o.buffer_count, at_least(2)) && o.buffer_count != 5)
      r.warn_ignored(r.last_path(), why);
    if (r.get_int("buffer_size", o.buffer_size, at_least(1)) && o.buffer_size != d.buffer_size)
      r.warn_ignored(r.last_path(), why);
    if (r.get_int("max_in_cpu", o.max_in_cpu, at_least(0)) && o.max_in_cpu != d.max_in_cpu)
      r.warn_ignored(r.last_path(), why);
  } else {
    r.get_int("buffer_count", o.buffer_count, at_least(2));
    r.get_number("ratio", o.ratio, hi_closed(0, 1));
    // "pipeline": DeepSpeed 0.4's switch for pipeline_read or pipeline_write.
    r.ignore_bool("pipeline", false, "zinc's swapper always overlaps reads and writes with the update");
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
  // 0 (DeepSpeed allows it): every block is its own bucket.
  r.get_int("reduce_bucket_size", z.reduce_bucket_size, at_least(0));
  r.get_int("allgather_bucket_size", z.allgather_bucket_size, at_least(1));
  // 0 (DeepSpeed: one sub-group per parameter): the smallest sub-groups zinc
  // makes (4 KiB of elements).
  r.get_int("sub_group_size", z.sub_group_size, at_least(0));
  r.get_int({"prefetch_bucket_size", "stage3_prefetch_bucket_size"}, z.stage3_prefetch_bucket_size,
            at_least(0));
  r.get_int({"param_persistence_threshold", "stage3_param_persistence_threshold"},
            z.stage3_param_persistence_threshold, at_least(0));
  // 0: nothing gathered beyond the block an acquire needs.
  r.get_int({"max_live_parameters", "stage3_max_live_parameters"}, z.stage3_max_live_parameters, at_least(0));
  r.get_int({"max_reuse_distance", "stage3_max_reuse_distance"}, z.stage3_max_reuse_distance, at_least(0));
  r.get_int({"model_persistence_threshold", "stage3_model_persistence_threshold"},
            z.stage3_model_persistence_threshold, at_least(0));

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
    if (dep) z.offload_optimizer.device = OffloadDevice::kCpu;
  }
  // cpu_offload_params: the spelling DeepSpeed 0.4 to 0.5 documented.
  if (r.get_bool({"cpu_offload_param", "cpu_offload_params"}, dep)) {
    if (new_param) {
      throw ConfigError(r.last_path(), "deprecated and set together with offload_param; keep offload_param");
    }
    r.warn(r.last_path(), "deprecated; use \"offload_param\": {\"device\": \"cpu\"}");
    if (dep) z.offload_param.device = OffloadDevice::kCpu;
  }
  if (r.get_bool("cpu_offload_use_pin_memory", dep)) {
    r.warn(r.last_path(), "deprecated; use pin_memory in offload_optimizer / offload_param");
    if (!new_opt) z.offload_optimizer.pin_memory = dep;
    if (!new_param) z.offload_param.pin_memory = dep;
  }

  // Known DeepSpeed keys without an effect in zinc: harmless ones warn...
  r.ignore_bool("load_from_fp32_weights", true, "zinc always restores the fp32 master weights from a checkpoint");
  r.ignore_bool("elastic_checkpoint", false);
  r.ignore_bool("ignore_unused_parameters", true, "every zinc model parameter receives a gradient");
  // DeepSpeed 0.3's name for handling parameters without gradients.
  r.ignore_bool("find_unused_parameters", false, "every zinc model parameter receives a gradient");
  r.ignore_bool("legacy_stage1", false);
  r.ignore_bool("round_robin_gradients", false);
  r.ignore_bool("use_multi_rank_bucket_allreduce", true);
  r.ignore_bool({"gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"}, false,
                "zinc-export writes the consolidated weights from a checkpoint (--dtype bf16 for 16-bit)");
  r.ignore_bool("stage3_gather_fp16_weights_on_model_save", false,
                "zinc-export writes the consolidated weights from a checkpoint");
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
  // The ranges the NVMe store takes (offload::validate), here so that
  // --check refuses what a run would, and no value is narrowed to an int
  // on its way there (2^32 + 8 ran as a queue depth of 8).
  if (r.get_int("block_size", a.block_size, closed(4096, 1 << 30)) && a.block_size % 4096 != 0) {
    throw ConfigError(r.last_path(),
                      "must be a multiple of 4096 (O_DIRECT alignment), got " + std::to_string(a.block_size));
  }
  r.get_int("queue_depth", a.queue_depth, closed(1, 4096));
  r.get_int({"intra_op_parallelism", "thread_count"}, a.intra_op_parallelism, closed(1, 256));
  r.get_bool("single_submit", a.single_submit);
  r.get_bool("overlap_events", a.overlap_events);
  r.refuse_bool("use_gds", false, "GPUDirect Storage needs a GPU; set it to false");
  std::string backend;
  if (r.get_choice("io_backend", backend, {"async_io", "posix"}) && backend == "posix") {
    r.warn_ignored(r.last_path(), "zinc always uses io_uring");
  }
  r.finish();
}

void parse_monitors(Reader& root, Config& c) {
  for (auto [key, m] : {std::pair<const char*, MonitorConfig*>{"csv_monitor", &c.csv_monitor},
                        std::pair<const char*, MonitorConfig*>{"tensorboard", &c.tensorboard}}) {
    Reader r = root.section(key);
    r.get_bool("enabled", m->enabled);
    r.get_file_name("output_path", m->output_path);
    // One folder name under output_path: "../x", "/abs" or "a/b" would put
    // the files somewhere the user did not ask for (into another run's
    // folder, or a checkpoint tag that a save replaces).
    if (r.get_file_name("job_name", m->job_name) &&
        (m->job_name.empty() || m->job_name == "." || m->job_name == ".." ||
         m->job_name.find('/') != std::string::npos))
      throw ConfigError(r.last_path(), "must be one folder name (not empty, no '/', not '.' or '..'): the files go "
                                       "to output_path/job_name; got " + config::show(m->job_name));
    if (m->job_name.size() > NAME_MAX)  // a check of output_path's folder named output_path for it
      throw ConfigError(r.last_path(), "is " + std::to_string(m->job_name.size()) + " bytes, past the file system's " +
                                           std::to_string(NAME_MAX) + " for one folder name");
    r.finish();
  }

  // DeepSpeed's monitors that log to a network service: their keys are
  // checked, and enabled is refused (zinc runs talk to no service).
  struct Online {
    const char* key;
    std::vector<const char*> string_keys;
  };
  const Online kOnline[] = {
      {"wandb", {"group", "team", "project"}},
      {"comet", {"project", "workspace", "api_key", "experiment_name", "experiment_key", "mode"}},
  };
  for (const Online& m : kOnline) {
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
    if (enabled)
      throw ConfigError(r.path_of("enabled"), std::string(m.key) +
                                                  " logs to a network service, which zinc does not use; for curves "
                                                  "offline use tensorboard or csv_monitor (files under their output_path)");
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

// Top-level keys of earlier DeepSpeed releases (deepspeed/pt/deepspeed_constants.py
// and deepspeed/runtime/constants.py across 0.1 to 0.14), and the
// parallelism sizes deepspeed.initialize reads from the config.
void parse_legacy(Reader& r, Config& c, bool zero_bool_form) {
  // allgather_size: the bucket of the boolean "zero_optimization": true form
  // (DeepSpeed maps it onto allgather_bucket_size there and reads it nowhere else).
  int64_t size = 0;
  if (r.get_int("allgather_size", size, at_least(1))) {
    if (zero_bool_form) {
      c.zero.allgather_bucket_size = size;
    } else {
      r.warn_ignored("allgather_size", "it only applies to the boolean \"zero_optimization\": true form; set "
                                       "zero_optimization.allgather_bucket_size");
    }
  }
  // ZeRO stage 1's keys before the zero_optimization section existed.
  r.ignore_bool("zero_reduce_scatter", true, "zinc reduce-scatters every bucket (the same sums an all-reduce gives)");
  int64_t elems = 0;
  if (r.get_int("zero_max_elements_per_comm", elems, at_least(1)) && elems != 500000000)
    r.warn_ignored("zero_max_elements_per_comm", "use zero_optimization.reduce_bucket_size");
  // fp32_allreduce: reduce 16-bit gradients in fp32. zinc's gradients are
  // fp32 on the wire unless communication_data_type says otherwise.
  bool fp32_allreduce = false;
  if (r.get_bool("fp32_allreduce", fp32_allreduce) && fp32_allreduce && c.communication_data_type &&
      *c.communication_data_type != DType::kF32) {
    throw ConfigError("fp32_allreduce", "true asks for fp32 reductions and communication_data_type for " +
                                            std::string(dtype_name(*c.communication_data_type)) + "; keep one");
  }
  int64_t dp = 0;
  if (r.get_int("data_parallel_size", dp, at_least(1)) && dp != c.data_parallel_size()) {
    throw ConfigError("data_parallel_size",
                      std::to_string(dp) + " differs from the " + std::to_string(c.data_parallel_size()) +
                          (c.model_parallel_size() > 1
                               ? " replicas of this run (the world size " + std::to_string(c.world_size) + " / " +
                                     std::to_string(c.model_parallel_size()) + " ranks per replica)"
                               : " ranks of this run (zinc's data-parallel size is the world size)"));
  }
}

// data_efficiency: names the part that is on (DeepSpeed's
// deepspeed/runtime/data_pipeline/constants.py).
void refuse_data_efficiency(const json& v) {
  if (!v.is_object()) return;
  auto on = [](const json& o, const char* key) -> const json* {
    auto it = o.find(key);
    if (it == o.end() || !it->is_object()) return nullptr;
    auto en = it->find("enabled");
    return en != it->end() && en->is_boolean() && en->get<bool>() ? &*it : nullptr;
  };
  if (const json* ds = on(v, "data_sampling")) {
    if (on(*ds, "curriculum_learning"))
      Reader::refuse("data_efficiency.data_sampling.curriculum_learning",
                     "curriculum learning changes the data order and sequence lengths");
    Reader::refuse("data_efficiency.data_sampling", "it changes which samples each step draws");
  }
  if (const json* dr = on(v, "data_routing")) {
    if (on(*dr, "random_ltd"))
      Reader::refuse("data_efficiency.data_routing.random_ltd",
                     "random layerwise token dropping skips tokens in the middle layers, which changes the model's "
                     "computation");
    Reader::refuse("data_efficiency.data_routing", "it changes which tokens the layers compute");
  }
}

// activation_checkpointing: DeepSpeed's keys and defaults
// (ActivationCheckpointingConfig says what each means here). Each key set to
// other than its default is a warning saying why it changes nothing.
void parse_activation_checkpointing(Reader& root, ActivationCheckpointingConfig& a, Device device) {
  Reader r = root.section("activation_checkpointing");
  a.given = r.given();
  if (r.get_bool("partition_activations", a.partition_activations) && a.partition_activations)
    r.warn_ignored(r.last_path(), "it splits checkpointed activations across tensor-parallel ranks; zinc's "
                                  "tensor parts each keep the whole layer inputs they recompute from");
  if (r.get_bool("contiguous_memory_optimization", a.contiguous_memory_optimization) &&
      a.contiguous_memory_optimization)
    r.warn_ignored(r.last_path(), "it packs partitioned checkpoints (partition_activations, model parallelism); "
                                  "zinc's GPT allocates its layer inputs once and reuses them");
  if (const json* v = r.find("number_checkpoints"); v && !v->is_null() && !(v->is_boolean() && !v->get<bool>())) {
    a.number_checkpoints = to_int(*v, r.last_path(), at_least(1));
    r.warn_ignored(r.last_path(), "DeepSpeed uses it only to size contiguous_memory_optimization's buffers; "
                                  "zinc's GPT checkpoints every layer's input");
  }
  const bool gpu = device == Device::kCuda;
  if (r.get_bool("cpu_checkpointing", a.cpu_checkpointing) && a.cpu_checkpointing) {
    if (gpu)
      r.warn_ignored(r.last_path(), "it moves the checkpointed layer inputs to host RAM; zinc's GPU path keeps "
                                    "them in GPU memory");
    else
      r.warn(r.last_path(), "no effect: on the CPU the checkpoints already live in host RAM");
  }
  if (r.get_bool("synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary) &&
      a.synchronize_checkpoint_boundary) {
    if (gpu)
      r.warn_ignored(r.last_path(), "it waits for the GPU at each checkpoint boundary (for profiling); zinc's GPU "
                                    "path times whole passes with events (wall_clock_breakdown)");
    else
      r.warn(r.last_path(), "no effect: zinc's CPU kernels are synchronous, there is no device to synchronize");
  }
  if (r.get_bool("profile", a.profile) && a.profile)
    r.warn_ignored(r.last_path(), "zinc times whole forward and backward passes (wall_clock_breakdown), not "
                                  "each checkpoint");
  r.finish();
}

// "pipeline" (PipelineConfig): DeepSpeed's keys. Read before the batch
// triad, which fits the data-parallel part of the world.
void parse_pipeline(Reader& root, Config& c) {
  Reader r = root.section("pipeline");
  if (const json* v = r.find("stages"); v && !v->is_null()) {
    if (v->is_string() && v->get<std::string>() == "auto")
      c.pipeline.stages = 1;  // DeepSpeed takes the count from its PipelineModule; zinc's models have none
    else
      c.pipeline.stages = to_int(*v, r.last_path(), Range{1, 1 << 20});
  }
  if (const json* v = r.find("partition"); v && !v->is_null()) {
    if (!v->is_string()) type_error(r.last_path(), "a string", *v);
    const std::string m = v->get<std::string>();
    std::string lower = m;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (lower == "parameters" || lower == "best") {
      c.pipeline.partition = PipePartition::kParameters;
    } else if (lower == "uniform") {
      c.pipeline.partition = PipePartition::kUniform;
    } else if (lower.rfind("type:", 0) == 0) {
      c.pipeline.partition = PipePartition::kType;
      c.pipeline.type_regex = m.substr(5);
      try {
        std::regex re(c.pipeline.type_regex, std::regex::icase);
      } catch (const std::regex_error& e) {
        throw ConfigError(r.last_path(), "\"" + c.pipeline.type_regex + "\" is not a regular expression: " + e.what());
      }
    } else {
      throw ConfigError(r.last_path(), "expected \"parameters\", \"uniform\" or \"type:REGEX\" (\"best\" is "
                                       "\"parameters\"), got " + show(*v));
    }
  }
  bool b = false;
  if (r.get_bool("seed_layers", b) && b)
    r.warn(r.last_path(), "no effect: zinc seeds every parameter from the run's seed and its block, so each layer "
                          "starts the same at any number of stages");
  r.get_bool("pipe_partitioned", b);  // split activations over tensor-parallel ranks: none here
  r.get_bool("grad_partitioned", b);
  int64_t interval = 0;
  if (r.get_int("activation_checkpoint_interval", interval, at_least(0)) && interval > 0)
    r.warn_ignored(r.last_path(), "each stage keeps its in-flight micro-batches' activations; the model's "
                                  "gradient_checkpointing recomputes a stage's layers instead");
  r.finish();
}

// "tensor_parallel" (TensorParallelConfig): DeepSpeed's AutoTP training
// keys. Read after "pipeline" and before the batch triad: the stages times
// the tensor parts must divide the world, and the rest are replicas.
void parse_tensor_parallel(Reader& root, Config& c) {
  Reader r = root.section("tensor_parallel");
  int64_t size = 1;
  if (r.get_int("autotp_size", size, Range{1, 1 << 20})) c.tensor_parallel.size = size;
  const std::string size_path = r.path_of("autotp_size");
  {  // DeepSpeed's inference-style "tp": {"tp_size": N} says the same
    Reader t = r.section("tp");
    int64_t n = 1;
    if (t.get_int("tp_size", n, Range{1, 1 << 20}) && n != 1) {
      if (c.tensor_parallel.size != 1 && n != c.tensor_parallel.size)
        throw ConfigError(t.last_path(), std::to_string(n) + " differs from autotp_size " +
                                             std::to_string(c.tensor_parallel.size) + "; give one of them");
      c.tensor_parallel.size = n;
    }
    if (const json* v = t.find("tp_grain_size"); v && !v->is_null()) t.warn_ignored(t.last_path());
    t.finish();
  }
  for (const char* k : {"dtype", "keep_module_on_host", "injection_policy_tuple", "partition_config", "tp_overlap_comm"})
    if (const json* v = r.find(k); v && !v->is_null())
      r.warn_ignored(r.last_path(), "zinc splits the layers of the model families it knows by their own rules "
                                   "(whole heads, the MLP's inner size) and keeps each part in the run's precision");
  r.finish();
}

// Top-level DeepSpeed sections and flags that zinc knows but does not
// implement. Their inner keys are not checked: zinc does not read them.
enum class Act { kWarn, kError };
struct Feature {
  const char* key;
  Act act;
  const char* why;
};
const Feature kFeatures[] = {
      {"flops_profiler", Act::kWarn, nullptr},
      {"comms_logger", Act::kWarn, nullptr},
      {"comms_config", Act::kWarn, "it only sets how DeepSpeed's communication layer logs"},
      {"monitor_config", Act::kWarn,
       "a wrapper some configs carry; zinc, like DeepSpeed, reads csv_monitor, tensorboard and wandb at the top level"},
      {"autotuning", Act::kWarn, nullptr},
      {"memory_breakdown", Act::kWarn, nullptr},
      {"dump_state", Act::kWarn, nullptr},
      {"prescale_gradients", Act::kWarn,
       "zinc averages after the reduction; prescaling changes only rounding"},
      {"disable_allgather", Act::kWarn, nullptr},
      {"dataloader_drop_last", Act::kWarn, "zinc's DataLoader always draws whole global batches"},
      {"eigenvalue", Act::kWarn, nullptr},
      {"hybrid_engine", Act::kWarn, nullptr},
      {"compile", Act::kWarn, nullptr},
      {"timers", Act::kWarn, nullptr},
      {"nebula", Act::kWarn, nullptr},
      {"graph_harvesting", Act::kWarn, nullptr},
      {"use_data_before_expert_parallelism", Act::kWarn,
       "DeepSpeed's legacy MoE layer reads it; zinc's expert exchange always sends each rank's own tokens"},
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

// The features zinc refuses, checked before
// anything else: they do not depend on the world size, so a config that asks
// for one is refused for it at every world size, before a batch triad
// written for another world size is.
void refuse_features(Reader& r, const json& j) {
  for (const Feature& f : kFeatures) {
    if (f.act != Act::kError) continue;
    const json* v = r.find(f.key);
    if (!v || !feature_active(*v, f.key)) continue;
    if (std::string_view(f.key) == "data_efficiency") refuse_data_efficiency(*v);
    Reader::refuse(f.key, f.why);
  }
}

// "sequence_parallel_size" (Note [sequence parallelism] in
// engine/sequence_parallel.cpp). Read after the pipeline and tensor
// sections and before the batch triad, whose replicas it divides.
void parse_sequence_parallel(Reader& r, Config& c) {
  int64_t size = 1;
  if (!r.get_int("sequence_parallel_size", size, Range{1, 1 << 20})) return;
  c.sequence_parallel_size = size;
}

// The grid's ranks: a replica of the model spans stages x parts x sequence
// ranks, which must divide the world. Checked once all three are read, so
// that the multiple it asks for is the whole grid's (one axis's alone sent
// a user to a world the next axis refused), naming the last axis given.
void check_grid(Reader& root, Config& c) {
  const int64_t grid = c.model_parallel_size();
  if (c.world_size % grid == 0) return;
  std::string axes, path;
  auto axis = [&](int64_t n, const char* what, std::string key) {
    if (n <= 1) return;
    axes += (axes.empty() ? "" : " times ") + std::to_string(n) + " " + what;
    path = std::move(key);
  };
  axis(c.pipeline.stages, "pipeline stages", root.path_of("pipeline") + ".stages");
  axis(c.tensor_parallel.size, "tensor parts", root.path_of("tensor_parallel") + ".autotp_size");
  axis(c.sequence_parallel_size, "sequence ranks", root.path_of("sequence_parallel_size"));
  throw ConfigError(path, axes + " do not divide the " +
                              (c.world_size == 1 ? std::string("one rank") : std::to_string(c.world_size) + " ranks") +
                              " of this run (a replica of the model spans " + std::to_string(grid) +
                              " ranks): run it on a multiple of " + std::to_string(grid) + " ranks");
}

// "expert_parallel": DeepSpeed's AutoEP section (Note [expert parallelism]
// in engine/expert_parallel.cpp). autoep_size ranks share out each
// mixture-of-experts layer's experts; they train on their own batches, so
// the replicas of the batch triad are not divided by it. The keys that
// find a torch model's MoE layers are DeepSpeed's business (zinc's families
// name their experts); those that would route tokens otherwise than the
// model's own config says are refused.
void parse_expert_parallel(Reader& root, Config& c) {
  Reader r = root.section("expert_parallel");
  bool enabled = false;
  r.get_bool("enabled", enabled);
  int64_t size = 1;
  const bool has_size = r.get_int("autoep_size", size, Range{1, 1 << 20});
  const std::string size_path = r.path_of("autoep_size");
  std::string preset;
  r.get_string("preset_model", preset);  // DeepSpeed's hint; the model section says the family (shown by --check)
  for (const char* k : {"moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
                        "num_experts_attr", "top_k_attr", "shared_experts_pattern", "has_shared_experts",
                        "use_grouped_mm", "grouped_mm_backend"})
    if (const json* v = r.find(k); v && !v->is_null())
      r.warn_ignored(r.last_path(), "zinc's model families name their routers and experts themselves, and zinc runs "
                                    "one GEMM per local expert over the tokens it got");
  // Routing overrides: only the values that leave the model's routing as it is.
  for (const char* k : {"score_func", "score_apply", "top_k", "routed_scaling_factor"})
    if (const json* v = r.find(k); v && !v->is_null() && !(v->is_string() && v->get<std::string>() == "auto"))
      Reader::refuse(r.last_path(), "zinc routes each token as the model's own config says (its softmax router, "
                                    "num_experts_per_tok, norm_topk_prob); leave it \"auto\"");
  for (const char* k : {"route_norm", "num_expert_groups", "num_limited_groups"})
    if (const json* v = r.find(k); v && !v->is_null())
      Reader::refuse(r.last_path(), "zinc routes each token as the model's own config says (norm_topk_prob, no "
                                    "expert groups); remove it");
  double scale = 1.0;
  if (r.get_number("route_scale", scale) && scale != 1.0)
    Reader::refuse(r.last_path(), "zinc scales no routing weights beyond the model's own routing; set 1.0");
  if (const json* v = r.find("load_balance_coeff"); v && !v->is_null())
    Reader::refuse(r.last_path(),
                   "zinc has no bias-based (auxiliary-loss-free) load balancing; the model's router_aux_loss_coef "
                   "(with output_router_logits) sets its load-balancing loss; remove it or set it to null");
  r.finish();
  if (!enabled) {
    if (has_size && size > 1)
      r.warn(size_path, "ignored: expert_parallel.enabled is false (every rank holds every expert)");
    return;
  }
  if (size == 1) return;  // every rank holds every expert: plain data parallelism
  c.expert_parallel.size = size;
  c.expert_parallel.preset_model = preset;
  if (c.world_size % (c.model_parallel_size() * size) != 0)
    throw ConfigError(size_path, std::to_string(size) + " expert ranks" +
                                     (c.model_parallel_size() > 1
                                          ? " times " + std::to_string(c.model_parallel_size()) + " model-parallel ranks"
                                          : std::string()) +
                                     " do not divide the " +
                                     (c.world_size == 1 ? std::string("one rank")
                                                        : std::to_string(c.world_size) + " ranks") +
                                     " of this run (run it on a multiple of " +
                                     std::to_string(c.model_parallel_size() * size) + " ranks)");
}

void parse_unimplemented(Reader& r, Config& c) {
  for (const Feature& f : kFeatures) {
    const json* v = r.find(f.key);
    if (!v || !feature_active(*v, f.key)) continue;
    if (f.act == Act::kWarn) r.warn_ignored(f.key, f.why);
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

  // checkpoint: what each DeepSpeed key means for zinc's checkpoints (Note
  // [checkpoints] in engine/checkpoint.cpp).
  Reader ck = r.section("checkpoint");
  ck.get_enum<TagValidation>("tag_validation", c.checkpoint.tag_validation,
                             {{"Ignore", TagValidation::kIgnore}, {"Warn", TagValidation::kWarn},
                              {"Fail", TagValidation::kFail}},
                             true);
  ck.ignore_bool("load_universal", false,
                 "zinc's own checkpoints load at any world size and stage without conversion; DeepSpeed's "
                 "universal checkpoints (PyTorch files) cannot be read");
  ck.refuse_bool("use_node_local_storage", false,
                 "zinc commits a checkpoint from rank 0 and any rank may read any rank's shards when it loads, "
                 "so the checkpoint folder must be one that every rank sees; remove it or set it to false");
  if (const json* w = ck.find("parallel_write"); w && feature_active(*w, ck.last_path()))
    ck.warn_ignored(ck.last_path(), "every zinc rank, of every pipeline stage, already writes its own shards in "
                                    "parallel");
  if (const json* w = ck.find("writer"); w && feature_active(*w, ck.last_path()))
    ck.warn_ignored(ck.last_path(), "zinc writes each rank's shards with its own writer (checksummed, fsynced)");
  ck.finish();
}

}  // namespace

// ---------------------------------------------------------------------------

// "device": cpu | cuda | auto (Config::device). cuda is refused here, at its
// JSON path, where zinc was built without CUDA or no GPU is visible, and
// where the GPU path does not cover the rest of the config (checked after
// the zero section: check_device).
namespace {
// Returns whether the value was "auto" (check_device may then fall back).
bool parse_device(Reader& r, Config& c) {
  std::string d = "cpu";
  if (!r.get_string("device", d)) return false;
  if (d == "cpu") {
    c.device = Device::kCpu;
  } else if (d == "auto") {
    c.device = cuda_status().devices > 0 ? Device::kCuda : Device::kCpu;
    return true;
  } else if (d == "cuda") {
    const CudaStatus& st = cuda_status();
    if (!st.built)
      throw ConfigError("device", "\"cuda\" needs a CUDA build of zinc; this one was built without CUDA "
                                  "(no nvcc at configure time, or -DZINC_CUDA=OFF)");
    if (st.devices == 0) throw ConfigError("device", "\"cuda\" but no GPU is visible: " + st.why);
    c.device = Device::kCuda;
  } else {
    throw ConfigError("device", "expected \"cpu\", \"cuda\" or \"auto\", got " + show(json(d)));
  }
  return false;
}

// What the GPU path covers (Note [the GPU path] in engine/engine.cpp):
// ZeRO-Offload (optimizer states on the host or NVMe, updated by the CPU
// optimizer) at stages 1-3 (optimizer offload needs stage >= 1), and AdamW
// or Lamb over GPU-resident states at stages 0-3; not the 1-bit optimizers.
void check_device_covered(const Config& c) {
  if (c.device != Device::kCuda) return;
  if (c.optimizer.one_bit())
    throw ConfigError("optimizer.type", std::string(optimizer_type_name(c.optimizer.type)) +
                                            " runs on CPU ranks only in zinc (its compressed all-reduce has no NCCL "
                                            "path yet); use \"device\": \"cpu\", or AdamW on the GPU");
  // Note [tensor parts on the GPU] in engine/tensor_parallel.cpp.
  if (c.tensor_split() && c.zero.stage > 2)
    throw ConfigError("tensor_parallel.autotp_size", "tensor parts on the GPU path run at ZeRO stages 0-2 (not 3 yet)");
  if (c.tensor_split() && c.pipelined())
    throw ConfigError("tensor_parallel.autotp_size",
                      "tensor parts with pipeline stages do not run on the GPU path yet; use one of them, or "
                      "\"device\": \"cpu\"");
  if (c.expert_split())
    throw ConfigError("expert_parallel.autoep_size",
                      "the GPU path does not share out experts yet; use \"device\": \"cpu\"");
}

// "auto" picks the GPU only where the GPU path covers the rest of the
// config; elsewhere it says why and stays on the CPU. An explicit "cuda"
// that is not covered is an error.
void check_device(Reader& r, Config& c, bool chosen_by_auto) {
  if (!chosen_by_auto) return check_device_covered(c);
  try {
    check_device_covered(c);
  } catch (const ConfigError& e) {
    r.warn("device", std::string("\"auto\" stays on the CPU: ") + e.what());
    c.device = Device::kCpu;
    c.validate();  // what depends on the device (gradients on NVMe at stage 3), for the CPU
  }
}
}  // namespace

Config Config::parse(const json& j, int world_size, const std::vector<std::string>& caller_sections) {
  if (world_size < 1) throw ConfigError("", "world size must be >= 1, got " + std::to_string(world_size));
  Config c;
  c.world_size = world_size;
  c.source = j;
  Reader r(j, "", c.warnings);
  refuse_features(r, j);
  parse_pipeline(r, c);
  parse_tensor_parallel(r, c);
  parse_sequence_parallel(r, c);
  check_grid(r, c);
  parse_expert_parallel(r, c);
  parse_batch(r, c);
  r.get_number("gradient_clipping", c.gradient_clipping, at_least(0));
  r.get_int("steps_per_print", c.steps_per_print, at_least(1));
  r.get_bool("wall_clock_breakdown", c.wall_clock_breakdown);
  const bool device_auto = parse_device(r, c);
  parse_precision(r, c);
  detail::parse_optimizer(r, c.optimizer);
  detail::parse_scheduler(r, c.scheduler);
  // DeepSpeed 0.19's WarmupLR (not its subclasses, whose default is 0.001)
  // warms up to the optimizer's lr when warmup_max_lr is not given.
  if (c.scheduler.type == SchedulerType::kWarmupLR) {
    const json* params = j.contains("scheduler") && j["scheduler"].is_object() && j["scheduler"].contains("params")
                             ? &j["scheduler"]["params"]
                             : nullptr;
    if (!params || !params->is_object() || !params->contains("warmup_max_lr") || (*params)["warmup_max_lr"].is_null())
      c.scheduler.warmup_max_lr = c.optimizer.lr();
  }
  if (c.scheduler.type == SchedulerType::kOneCycle && c.scheduler.cycle_momentum && c.optimizer.beta2() != 0.99) {
    r.warn("scheduler.params.cycle_momentum",
           "OneCycle sets the optimizer's betas to (momentum, 0.99) as DeepSpeed does: optimizer.params.betas[1] " +
               num(c.optimizer.beta2()) + " is replaced by 0.99 (set cycle_momentum false to keep it)");
    // The value training uses (and the serialized config shows).
    (c.optimizer.lamb_family() ? c.optimizer.lamb.beta2 : c.optimizer.adam.beta2) = 0.99;
  }
  parse_zero(r, c.zero);
  parse_legacy(r, c, j.is_object() && j.contains("zero_optimization") && j["zero_optimization"].is_boolean());
  parse_aio(r, c.aio);
  parse_monitors(r, c);
  parse_activation_checkpointing(r, c.activation_checkpointing, c.device);
  parse_unimplemented(r, c);
  for (const std::string& key : caller_sections) r.skip(key);
  r.finish_top_level();
  c.validate();
  check_device(r, c, device_auto);
  c.device_auto = device_auto && c.device == Device::kCuda;
  return c;
}

const char* optimizer_type_name(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kLamb: return "Lamb";
    case OptimizerType::kOneBitAdam: return "OneBitAdam";
    case OptimizerType::kZeroOneAdam: return "ZeroOneAdam";
    case OptimizerType::kOneBitLamb: return "OneBitLamb";
  }
  return "?";
}

const char* offload_device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

}  // namespace zinc

// The checkpoint protocol of Engine::Impl (engine_impl.h): every rank
// writes its spans of the optimizer states, rank 0 seals the metadata and
// commits the tag, and a load verifies everything before it changes
// anything. The format, its checks and the commit are checkpoint.cpp's
// (Note [checkpoints] there).
#include <array>
#include <map>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"
#include "engine/rank_agreement.h"
#include "kernels/kernels.h"

namespace zinc {

// With pipeline stages the checkpoint protocol runs over every rank (each
// stage writes its own blocks' spans): its collectives go over the world
// communicator, which no stream drives, from the training thread.
int Engine::Impl::failed_rank(bool failed) {
  double v = failed ? world_rank + 1 : 0;
  if (world_comm)
    world_comm->all_reduce_max_f64(&v, 1);
  else if (reduce_stream)
    reduce_stream->submit([&v](comm::Communicator& c) { c.all_reduce_max_f64(&v, 1); }).wait();
  return static_cast<int>(v);
}

std::map<int, std::array<std::vector<float>, ckpt::kKinds>> Engine::Impl::gather_whole_states(
    const std::function<bool(size_t)>& saves) {
  // This rank's own spans of every block, by kind.
  std::map<int, std::array<std::vector<float>, ckpt::kKinds>> own;
  opt_state->for_each_read([&](const StateSpan& sp) {
    if (!saves(static_cast<size_t>(sp.block))) return;
    auto& kinds = own[sp.block];
    const float* src[ckpt::kKinds] = {sp.master, sp.m, sp.v};
    for (int k = 0; k < ckpt::kKinds; ++k) {
      std::vector<float>& v = kinds[static_cast<size_t>(k)];
      v.resize(static_cast<size_t>(blocks[static_cast<size_t>(sp.block)].opt_numel));
      std::memcpy(v.data() + sp.offset, src[k], static_cast<size_t>(sp.count) * sizeof(float));
    }
  });
  // Each block whole (the replicas' spans, then the parts), kept by its
  // writer: block b by rank b mod (replicas x parts) of the stage.
  std::map<int, std::array<std::vector<float>, ckpt::kKinds>> mine;
  const int group = world * tp_size, me = rank * tp_size + tp_rank;
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (!saves(b)) continue;
    BlockShard& s = blocks[b];
    auto& kinds = own[static_cast<int>(b)];
    for (int k = 0; k < ckpt::kKinds; ++k) {
      std::vector<float>& shard = kinds[static_cast<size_t>(k)];
      std::vector<float> local;
      if (plan.optimizer_spans_block || world == 1) {
        local = std::move(shard);
      } else {
        local.resize(static_cast<size_t>(s.part.padded_numel));
        gather_stream->submit([&](comm::Communicator& c) {
          c.all_gather(shard.data(), local.data(), s.part.shard_numel, DType::kF32);
        }).wait();
      }
      std::vector<float> w = whole_from_parts(static_cast<int>(b), local);
      if (static_cast<int>(b) % group == me) mine[static_cast<int>(b)][static_cast<size_t>(k)] = std::move(w);
    }
  }
  return mine;
}

std::string Engine::Impl::agree_on_tag(const std::string& tag) {
  if (world_all == 1) return tag;
  std::array<char, ckpt::kMaxTagBytes + 2> buf{};  // even: broadcast in 2-byte elements
  if (world_rank == 0) std::memcpy(buf.data(), tag.data(), tag.size());
  auto send = [&buf](comm::Communicator& c) {
    c.broadcast(buf.data(), static_cast<int64_t>(buf.size() / 2), DType::kBF16, 0);
  };
  if (world_comm) send(*world_comm);
  else gather_stream->submit(send).wait();
  const std::string root_tag(buf.data());
  const bool differs = root_tag != tag;
  const int bad = failed_rank(differs);
  const TagValidation tv = cfg.checkpoint.tag_validation;
  if (bad == 0 || tv == TagValidation::kIgnore) return root_tag;
  const std::string what =
      differs ? "rank " + std::to_string(world_rank) + " passed checkpoint tag \"" + tag + "\" but rank 0 passed \"" +
                    root_tag + "\""
              : "rank " + std::to_string(bad - 1) + " passed another checkpoint tag than rank 0's \"" + root_tag + "\"";
  if (tv == TagValidation::kFail) throw Error(what + " (checkpoint.tag_validation is Fail; nothing was saved)");
  if (differs || world_rank == 0) log_warn(what + "; saving under rank 0's tag (checkpoint.tag_validation: Warn)");
  return root_tag;
}

void Engine::Impl::check_between_batches(const char* what) const {
  if (forward_pending || micro_steps % cfg.gradient_accumulation_steps != 0)
    throw Error(std::string(what) + " must come between global batches (after step() at an accumulation "
                "boundary), not after micro-step " + std::to_string(micro_steps));
  // A boundary backward whose step() has not run: its gradients and losses
  // (and on the GPU its reductions in flight) belong to that step.
  if (batch_loss.count != 0)
    throw Error(std::string(what) + " must come after step(): the global batch ending at micro-step " +
                std::to_string(micro_steps) + " has not been stepped");
}

nlohmann::json Engine::Impl::blocks_json() const {
  nlohmann::json out = nlohmann::json::array();
  // The whole model's blocks and layout, with tensor parts too (Note
  // [tensor parallelism]: a checkpoint holds whole blocks).
  const std::vector<BlockSpec>& specs = model->blocks();
  for (size_t b = 0; b < specs.size(); ++b) {
    const BlockLayout layout = BlockLayout::from_spec(specs[b]);
    nlohmann::json ps = nlohmann::json::array();
    for (size_t p = 0; p < specs[b].params.size(); ++p)
      ps.push_back({{"name", specs[b].params[p].name},
                    {"shape", std::vector<int64_t>(specs[b].params[p].shape.dims.begin(),
                                                   specs[b].params[p].shape.dims.begin() +
                                                       specs[b].params[p].shape.ndim)},
                    {"offset", layout.offsets[p]}});
    out.push_back({{"name", specs[b].name}, {"numel", layout.numel}, {"params", ps}});
    if (specs[b].frozen) out.back()["frozen"] = true;  // not saved: it comes from the model's initial values
  }
  return out;
}

void Engine::Impl::save_checkpoint(const std::string& dir, std::string tag, const nlohmann::json& client_state) {
  namespace fs = std::filesystem;
  check_loaded("save_checkpoint");
  check_between_batches("save_checkpoint");
  device->make_current();
  device->states_to_host();
  if (tag.empty()) tag = "global_step" + std::to_string(global_steps);
  ckpt::check_tag(tag);
  tag = agree_on_tag(tag);
  ckpt::count_save();
  const std::string partial = (fs::path(dir) / ("." + tag + ".partial")).string();
  std::string error;
  auto attempt = [&error](const std::function<void()>& fn) {
    if (!error.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  auto agree = [&](const char* phase) {
    const int bad = failed_rank(!error.empty());
    if (bad == 0) return;
    if (world_rank == 0) {
      std::error_code ec;
      fs::remove_all(partial, ec);  // no partial tag is left behind
    }
    if (!error.empty()) throw IoError(error);
    throw IoError("checkpoint " + (fs::path(dir) / tag).string() + ": rank " + std::to_string(bad - 1) +
                  " failed " + phase + " (its error is on its own output); nothing was committed");
  };
  // Rank 0 holds the folder's lock for the save (zinc-train holds it for
  // its whole run): another run's save could otherwise replace our tags.
  std::optional<ckpt::DirLock> lock;
  if (world_rank == 0)
    attempt([&] {
      lock.emplace(dir);
      ckpt::check_replaceable_tag(dir, tag);
      ckpt::check_replaceable_latest(dir);
      fs::remove_all(partial);
      fs::create_directory(partial);
    });
  agree("to create the folder");
  // Every rank: its spans of master, m, v, streamed span by span (from
  // NVMe through the swapper's buffers).
  char name[32];
  std::snprintf(name, sizeof name, "rank%05d", world_rank);
  // BlockSpec::frozen: nothing saved; a block two pipeline stages share,
  // by its first stage only.
  auto saves = [&](size_t b) { return !blocks[b].frozen && (!pipelined() || pipe_plan.block_stage[b] == stage); };
  // Tensor parts: whole blocks, each written by one rank of the stage
  // (gathered over the replicas and the parts first: collective).
  std::map<int, std::array<std::vector<float>, ckpt::kKinds>> whole;
  if (tensor_split()) whole = gather_whole_states(saves);
  attempt([&] {
    std::vector<ckpt::RankWriter::Span> spans;
    if (tensor_split()) {
      for (const auto& [b, kinds] : whole) spans.push_back({b, 0, static_cast<int64_t>(kinds[0].size())});
      ckpt::RankWriter w((fs::path(partial) / (std::string(name) + ".bin")).string(), spans);
      for (const auto& [b, kinds] : whole)
        for (int k = 0; k < ckpt::kKinds; ++k)
          w.write(b, k, 0, kinds[static_cast<size_t>(k)].data(), static_cast<int64_t>(kinds[0].size()), true);
      nlohmann::json index = w.finish();
      index["rank"] = world_rank;
      ckpt::write_file_atomic((fs::path(partial) / (std::string(name) + ".json")).string(), index.dump());
      ckpt::fault_point("index");
      return;
    }
    for (size_t b = 0; b < blocks.size(); ++b)
      if (saves(b))
        spans.push_back({static_cast<int>(b), plan.optimizer_spans_block ? 0 : blocks[b].part.own_offset(),
                         blocks[b].opt_numel});
    ckpt::RankWriter w((fs::path(partial) / (std::string(name) + ".bin")).string(), spans);
    // States in RAM stay put until finish(): written from where they are.
    const bool stable = offload_device != OffloadDevice::kNvme;
    opt_state->for_each_read([&](const StateSpan& sp) {
      if (!saves(static_cast<size_t>(sp.block))) return;
      w.write(sp.block, ckpt::kMaster, sp.offset, sp.master, sp.count, stable);
      w.write(sp.block, ckpt::kM, sp.offset, sp.m, sp.count, stable);
      w.write(sp.block, ckpt::kV, sp.offset, sp.v, sp.count, stable);
    });
    nlohmann::json index = w.finish();
    index["rank"] = world_rank;
    // The update rule's own part (the 1-bit optimizers' error feedback:
    // this rank's own, Note [1-bit Adam] in update_onebit.cpp).
    if (const nlohmann::json own = rule->save(partial); own.is_object())
      for (const auto& [key, value] : own.items()) index[key] = value;
    ckpt::write_file_atomic((fs::path(partial) / (std::string(name) + ".json")).string(), index.dump());
    ckpt::fault_point("index");
  });
  agree("to write its shards");
  if (world_rank == 0)
    attempt([&] {
      // Each rank's index by its size and checksum: the metadata (sealed
      // with its own checksum) vouches for every file of the tag.
      nlohmann::json ranks = nlohmann::json::array();
      for (int r = 0; r < world_all; ++r) {
        std::snprintf(name, sizeof name, "rank%05d.json", r);
        std::ifstream in(fs::path(partial) / name, std::ios::binary);
        const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (!in.good() && !in.eof()) throw IoError("checkpoint: cannot read " + (fs::path(partial) / name).string());
        ranks.push_back({{"file", name},
                         {"bytes", static_cast<int64_t>(text.size())},
                         {"xxh3_64", ckpt::xxh3_hex(text.data(), text.size())}});
      }
      nlohmann::json meta = {
          {"format", "zinc-checkpoint"},
          {"version", 2},
          {"zinc_version", ZINC_VERSION},
          {"tag", tag},
          {"world_size", world_all},
          {"pipeline_stages", stages},
          {"tensor_parallel", expert_parts ? 1 : tp_size},
          {"expert_parallel", expert_parts ? tp_size : 1},
          {"zero_stage", cfg.zero.stage},
          {"compute_dtype", dtype_name(dtype)},
          {"model", model->name()},
          {"blocks", blocks_json()},
          {"rank_indexes", ranks},
          {"training",
           {{"global_steps", global_steps},
            {"micro_steps", micro_steps},
            {"skipped_steps", skipped_steps},
            {"optimizer_steps", optimizer_steps},
            {"loss_scale",
             {{"scale", scaler.scale()},
              {"hysteresis", scaler.hysteresis_left()},
              {"iteration", scaler.iteration()},
              {"last_overflow", scaler.last_overflow_iteration()}}},
            {"lr", lr},
            {"grad_norm", std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr)},
            {"last_loss", std::isfinite(last_loss) ? nlohmann::json(last_loss) : nlohmann::json(nullptr)}}},
          {"client_state", client_state},
          {"config", cfg.source}};
      ckpt::write_file_atomic((fs::path(partial) / "metadata.json").string(), ckpt::sealed_dump(meta, 1));
      ckpt::fault_point("metadata");
      ckpt::commit_tag(dir, partial, tag);
    });
  agree("to commit");
}

void Engine::Impl::check_same_model(const ckpt::TagFiles& files, std::vector<std::string>& names) const {
  const std::string where = "checkpoint " + files.dir;
  const nlohmann::json mine = blocks_json();
  const nlohmann::json& theirs = files.meta.at("blocks");
  if (theirs.size() != mine.size()) {
    // LoRA's adapter blocks come on top of the base's: say which side has them.
    auto frozen = [](const nlohmann::json& blocks) {
      for (const nlohmann::json& b : blocks)
        if (b.value("frozen", false)) return true;
      return false;
    };
    const bool t = frozen(theirs), m = frozen(mine);
    std::string why = t == m ? ""
                      : t    ? " (the checkpoint's run trained adapters on a frozen base, LoRA; this model has "
                               "none: give the run's model.lora or model.adapter)"
                             : " (this model trains adapters on a frozen base, LoRA; the checkpoint's run had none)";
    if (t == m) {  // the blocks one side has and the other not, by name
      auto names_of = [](const nlohmann::json& blocks) {
        std::set<std::string> out;
        for (const nlohmann::json& b : blocks) out.insert(b.value("name", std::string()));
        return out;
      };
      const std::set<std::string> tn = names_of(theirs), mn = names_of(mine);
      auto only = [](const std::set<std::string>& a, const std::set<std::string>& b) {
        std::string out;
        int n = 0;
        for (const std::string& x : a)
          if (!b.count(x) && n++ < 4) out += (out.empty() ? "'" : ", '") + x + "'";
        return out;
      };
      const std::string there = only(tn, mn), here = only(mn, tn);
      if (!there.empty()) why += " (only in the checkpoint: " + there;
      if (!here.empty()) why += std::string(there.empty() ? " (" : "; ") + "only here: " + here;
      if (!there.empty() || !here.empty()) why += ")";
      // LoRA's modules_to_save trains the untied head in a block of its own.
      if (t && (tn.count("lm_head") != mn.count("lm_head")))
        why += "; LoRA's model.lora.modules_to_save trains the head in a block of its own: the checkpoint's run " +
               std::string(tn.count("lm_head") ? "had" : "did not have") + " it there";
    }
    throw Error(where + " holds a model of " + std::to_string(theirs.size()) + " blocks; this one has " +
                std::to_string(mine.size()) + why);
  }
  for (size_t b = 0; b < mine.size(); ++b) {
    names.push_back(mine[b]["name"]);
    if (theirs[b].value("frozen", false) != mine[b].value("frozen", false))
      throw Error(where + ": block " + std::to_string(b) + " '" + names.back() + "' is " +
                  (mine[b].value("frozen", false) ? "trained in the checkpoint but frozen here"
                                                  : "frozen in the checkpoint (not saved) but trained here"));
    if (theirs[b]["params"].size() != mine[b]["params"].size() || theirs[b]["numel"] != mine[b]["numel"])
      throw Error(where + ": block " + std::to_string(b) + " '" + names.back() + "' differs from this model's: " +
                  std::to_string(theirs[b]["params"].size()) + " parameters of " + theirs[b]["numel"].dump() +
                  " elements there, " + std::to_string(mine[b]["params"].size()) + " of " +
                  mine[b]["numel"].dump() + " here (another model size, another family, or other LoRA adapters)");
    for (size_t p = 0; p < mine[b]["params"].size(); ++p)
      if (theirs[b]["params"][p] != mine[b]["params"][p])
        throw Error(where + ": block '" + names.back() + "' parameter " + theirs[b]["params"][p].dump() +
                    " differs from this model's " + mine[b]["params"][p].dump());
  }
}

void Engine::Impl::check_loaded(const char* what) const {
  if (!failed_load.empty())
    throw Error(std::string(what) + ": the engine's state is incomplete after a failed load (" + failed_load +
                "); load a whole checkpoint first");
}

void Engine::Impl::on_every_rank(const std::string& what, const std::function<void()>& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  const int bad = failed_rank(err != nullptr);
  if (err) std::rethrow_exception(err);
  if (bad != 0)
    throw IoError(what + ": rank " + std::to_string(bad - 1) + " failed (its error is on its own output)");
}

// Every rank must load the same checkpoint: ranks that opened two (a
// relative folder taken from two working directories, `latest` moved by a
// save between their reads, copies that differ) would go on from two
// states, with no word. Their metadata (the step, the config, the layout
// and the seal of each rank's files) is compared over all ranks.
void Engine::Impl::agree_on_checkpoint(const std::string& dir, const ckpt::TagFiles& files) {
  if (world_all == 1) return;
  const nlohmann::json mine = {{"checkpoint", std::filesystem::path(files.dir).filename().string()},
                               {"metadata", files.meta}};
  std::optional<RankDifference> d;
  if (world_comm)
    d = rank_difference(*world_comm, mine);
  else
    reduce_stream->submit([&](comm::Communicator& c) { d = rank_difference(c, mine); }).wait();
  if (!d) return;
  throw IoError("checkpoint " + dir + ": the ranks opened different checkpoints: rank " + std::to_string(d->other) +
                (d->path == "checkpoint" ? " opened " + d->at_other + ", rank 0 " + d->at_root
                                         : "'s " + mine["checkpoint"].get<std::string>() + " differs from rank 0's at " +
                                               d->path + " (" + d->at_other + " against " + d->at_root + ")") +
                "; a relative folder is taken from each rank's working directory: give every rank the same "
                "folder (nothing was loaded)");
}

nlohmann::json Engine::Impl::load_checkpoint(const std::string& dir, std::string tag) {
  check_between_batches("load_checkpoint");
  device->make_current();
  ckpt::TagFiles files;
  std::vector<std::string> names;
  on_every_rank("checkpoint " + dir + (tag.empty() ? "" : "/" + tag) + ": nothing was loaded", [&] {
    files = ckpt::open_tag(dir, std::move(tag));
    check_same_model(files, names);
    rule->prepare_load(files);
  });
  agree_on_checkpoint(dir, files);
  const nlohmann::json& meta = files.meta;
  ckpt::CheckpointReader reader(files.dir, files.ranks, names);
  device->before_load();
  params->before_update();
  // Tensor parts: each block's whole states, read once, with this part
  // cut out of each parameter (the part's own layout).
  int part_block = -1;
  std::array<std::vector<float>, ckpt::kKinds> part_states;
  auto read = [&](int block, int kind, int64_t flat, int64_t count, float* out) {
    if (!tensor_split()) return reader.read(block, kind, flat, count, out);
    if (part_block != block) {
      const BlockSpec& ws = model->blocks()[static_cast<size_t>(block)];
      const BlockLayout wl = BlockLayout::from_spec(ws);
      const BlockShard& s = blocks[static_cast<size_t>(block)];
      std::vector<float> all(static_cast<size_t>(wl.numel));
      for (int k = 0; k < ckpt::kKinds; ++k) {
        reader.read(block, k, 0, wl.numel, all.data());
        std::vector<float>& part = part_states[static_cast<size_t>(k)];
        part.assign(static_cast<size_t>(s.part.padded_numel), 0.0f);
        for (size_t p = 0; p < ws.params.size(); ++p)
          cut_part(block, static_cast<int>(p), all.data() + wl.offsets[p], part.data() + s.layout.offsets[p]);
      }
      part_block = block;
    }
    std::memcpy(out, part_states[static_cast<size_t>(kind)].data() + flat, static_cast<size_t>(count) * sizeof(float));
  };
  auto read_states = [&] {
    visit_updating([&](const StateSpan& sp) {
      const BlockShard& s = blocks[static_cast<size_t>(sp.block)];
      const int64_t flat = (plan.optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
      read(sp.block, ckpt::kMaster, flat, sp.count, sp.master);
      read(sp.block, ckpt::kM, flat, sp.count, sp.m);
      read(sp.block, ckpt::kV, flat, sp.count, sp.v);
      rule->load_span(sp);  // where the rule keeps a rank's own values (0/1 Adam between synchronisations)
      // The compute weights, as the update writes them: rounded to 16 bits or copied.
      char* out = compute_out(sp);
      if (!out) return;
      convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
    }, /*overwrite=*/true);  // every element is read from the checkpoint (zeros where none was saved)
  };
  try {
    on_every_rank("checkpoint " + files.dir + ": the load failed", read_states);
  } catch (const std::exception& e) {
    failed_load = e.what();  // Note [a failed load]
    throw;
  }
  failed_load.clear();
  device->after_load_states();
  params->gather_after_step();
  device->after_load_gather();
  const nlohmann::json& t = meta.at("training");
  global_steps = t.at("global_steps");
  micro_steps = t.at("micro_steps");
  skipped_steps = t.at("skipped_steps");
  optimizer_steps = t.at("optimizer_steps");
  rule->finish_load(optimizer_steps);
  lr = t.at("lr");
  grad_norm = t.at("grad_norm").is_null() ? NAN : t.at("grad_norm").get<double>();  // null: an overflowed step
  // The loss scale continues where it was (a checkpoint without fp16, or
  // from before zinc kept it, starts the scaler afresh).
  if (loss_scaling && cfg.fp16.loss_scale == 0 && t.contains("loss_scale") &&
      meta.value("compute_dtype", "") == "fp16") {
    const nlohmann::json& ls = t["loss_scale"];
    scaler.restore(ls.at("scale"), ls.at("hysteresis"), ls.at("iteration"), ls.at("last_overflow"));
  }
  last_loss = t.at("last_loss").is_null() ? NAN : t.at("last_loss").get<double>();
  // At another accumulation: the micro-step count follows the global steps.
  micro_steps = global_steps * cfg.gradient_accumulation_steps;
  step_pending = false;
  return meta.value("client_state", nlohmann::json::object());
}

}  // namespace zinc

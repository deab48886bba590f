// The 1-bit optimizers' part of a checkpoint (update_onebit.h): each rank's
// error feedback, 0/1 Adam's own weights, momentum and accumulated updates,
// 1-bit Lamb's fresh variance and per-tensor numbers, in a file beside the
// rank's shard (Notes [1-bit Adam], [0/1 Adam], [1-bit Lamb] in update_onebit.cpp).
#include "engine/update_onebit.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"

namespace zinc {

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

// The file holds up to three sections, in this order, each listed in the
// rank index with its length in bytes: "errors" (the error feedback: every
// tensor's worker then server error, or 1-bit Lamb's one flat pair) and
// "zero_one" (0/1 Adam's accumulator, weights and momentum, per block span)
// are this rank's and this world size's; "lamb" (1-bit Lamb's fresh
// variance per block span, then per tensor the trust-ratio average, the
// last factor and the momentum scale as doubles) is the same on every rank.
nlohmann::json OneBitRule::save(const std::string& partial_dir) {
  std::string errors, zero_one, lamb_part;
  for (const auto& per : onebit_ar)
    for (const comm::CompressedAllReduce& ar : per) {
      append(errors, ar.worker_error().data(), ar.worker_error().size());
      append(errors, ar.server_error().data(), ar.server_error().size());
    }
  nlohmann::json extra = nlohmann::json::object();
  save_sections(errors, zero_one, lamb_part, extra);
  if (errors.empty() && zero_one.empty() && lamb_part.empty()) return nullptr;
  const std::string bytes = errors + zero_one + lamb_part;
  const std::string name = onebit_file(ctx_.rank);
  ckpt::write_file_atomic((std::filesystem::path(partial_dir) / name).string(), bytes);
  nlohmann::json j = {{"file", name},
                      {"bytes", static_cast<int64_t>(bytes.size())},
                      {"xxh3_64", ckpt::xxh3_hex(bytes.data(), bytes.size())},
                      {"world_size", ctx_.world},
                      {"sections",
                       {{"errors", static_cast<int64_t>(errors.size())},
                        {"zero_one", static_cast<int64_t>(zero_one.size())},
                        {"lamb", static_cast<int64_t>(lamb_part.size())}}}};
  j.update(extra);
  return {{"onebit", j}};  // the rank index's entry
}

void ZeroOneAdamRule::save_sections(std::string&, std::string& zero_one, std::string&, nlohmann::json& entry) const {
  if (accum_.empty()) return;
  for (const auto& a : accum_) append(zero_one, a.data(), a.size());
  ctx_.opt_state->for_each_read([&](const StateSpan& sp) { append(zero_one, sp.master, static_cast<size_t>(sp.count)); });
  ctx_.opt_state->for_each_read([&](const StateSpan& sp) { append(zero_one, sp.m, static_cast<size_t>(sp.count)); });
  entry["lr_sum"] = lrs_;
}

void OneBitLambRule::save_sections(std::string& errors, std::string&, std::string& lamb_part,
                                   nlohmann::json& entry) const {
  if (flat_) {
    append(errors, flat_->worker_error().data(), flat_->worker_error().size());
    append(errors, flat_->server_error().data(), flat_->server_error().size());
  }
  if (coeff_.empty()) return;
  for (const auto& v : v_fresh_) append(lamb_part, v.data(), v.size());
  for (const std::vector<double>* d : {&coeff_, &last_factor_, &scaling_})
    lamb_part.append(reinterpret_cast<const char*>(d->data()), d->size() * sizeof(double));
  entry["lamb"] = {{"v_fresh", !v_fresh_.empty()}, {"scaling", !scaling_.empty()}};
}

// One rank's 1-bit file as its rank index describes it, read and verified.
struct OneBitRule::SavedFile {
  std::string path, bytes;
  const nlohmann::json* entry = nullptr;
  int64_t errors = 0, zero_one = 0, lamb = 0;  // the sections' bytes, in this order
};
namespace {
using OneBitFile = OneBitRule::SavedFile;
OneBitFile read_onebit_file(const ckpt::TagFiles& files, int r) {
  OneBitFile f;
  const nlohmann::json& e = files.ranks.at(static_cast<size_t>(r))["onebit"];
  f.entry = &e;
  f.path = files.dir + "/" + onebit_file(r);
  auto malformed = [&](const std::string& what) {
    throw IoError("checkpoint: the rank index of rank " + std::to_string(r) + " in " + files.dir +
                  " has a malformed \"onebit\" entry (" + what + "; nothing was loaded)");
  };
  if (!e.is_object() || e.value("file", "") != onebit_file(r)) malformed("file");
  auto int_at = [&](const nlohmann::json& o, const char* k) {
    if (!o.is_object() || !o.contains(k) || !o[k].is_number_integer() || o[k].get<int64_t>() < 0) malformed(k);
    return o[k].get<int64_t>();
  };
  if (!e.contains("xxh3_64") || !e["xxh3_64"].is_string()) malformed("xxh3_64");
  if (!e.contains("sections")) malformed("sections");
  const int64_t n_bytes = int_at(e, "bytes");
  f.errors = int_at(e["sections"], "errors");
  f.zero_one = int_at(e["sections"], "zero_one");
  f.lamb = int_at(e["sections"], "lamb");
  if (f.errors + f.zero_one + f.lamb != n_bytes) malformed("the sections do not add up to the file");
  if (f.lamb > 0 && (!e.contains("lamb") || !e["lamb"].is_object())) malformed("lamb");
  f.bytes = ckpt::read_bytes(f.path);
  if (static_cast<int64_t>(f.bytes.size()) != n_bytes ||
      ckpt::xxh3_hex(f.bytes.data(), f.bytes.size()) != e["xxh3_64"].get<std::string>())
    throw IoError("checkpoint: " + f.path + " is corrupted: its size or checksum is not the one its rank index "
                  "holds (edited, damaged or from another checkpoint; nothing was loaded)");
  return f;
}
// A saved rank's spans, in file order: (block, flat_offset, count) from its
// rank index (verified by open_tag).
std::vector<std::array<int64_t, 3>> saved_spans(const ckpt::TagFiles& files, int r) {
  std::vector<std::array<int64_t, 3>> out;
  for (const nlohmann::json& bl : files.ranks.at(static_cast<size_t>(r)).at("blocks"))
    out.push_back({bl.at("block").get<int64_t>(), bl.at("flat_offset").get<int64_t>(), bl.at("count").get<int64_t>()});
  return out;
}
}  // namespace

void OneBitRule::prepare_load(const ckpt::TagFiles& files) { saved_ = read_saved(files); }

namespace {
[[noreturn]] void wrong_size(const std::string& file, const char* section, int64_t have, int64_t want, int world) {
  throw IoError("checkpoint: " + file + " has " + std::to_string(have) + " bytes of 1-bit " + section +
                " state; this model at " + std::to_string(world) + " ranks needs " + std::to_string(want) +
                " (nothing was loaded)");
}
std::vector<float> floats_at(const std::string& bytes, int64_t at, int64_t count) {
  std::vector<float> v(static_cast<size_t>(count));
  std::memcpy(v.data(), bytes.data() + at, static_cast<size_t>(count) * 4);
  return v;
}
}  // namespace

int64_t OneBitRule::error_floats() const {
  int64_t errors = 0;
  for (const BlockShard& s : blocks())
    for (int64_t n : s.layout.numels) {
      const int64_t padded = comm::onebit_padded_size(n, ctx_.world);
      errors += padded + padded / ctx_.world;
    }
  return errors;
}

int64_t OneBitLambRule::error_floats() const {
  int64_t total = 0;
  for (const BlockShard& s : blocks()) total += s.layout.param_numel();
  const int64_t padded = comm::onebit_padded_size(total, ctx_.world);
  return padded + padded / ctx_.world;
}

OneBitRule::Saved OneBitRule::read_saved(const ckpt::TagFiles& files) const {
  Saved out;
  const int saved_world = files.meta.at("world_size").get<int>();
  const int from = std::min(ctx_.rank, saved_world - 1);
  const nlohmann::json& index = files.ranks.at(static_cast<size_t>(from));
  if (!index.contains("onebit") || index["onebit"].is_null()) {
    out.why = "the checkpoint holds no 1-bit state (saved before any compressed step, or by another optimizer)";
    return out;
  }
  const OneBitFile f = read_onebit_file(files, from);
  if (saved_world != ctx_.world)
    out.why = "the checkpoint's error feedback is for " + std::to_string(saved_world) + " ranks, this run has " +
              std::to_string(ctx_.world);
  if (saved_world == ctx_.world && f.errors > 0) {
    const int64_t errors = error_floats();
    if (f.errors != errors * 4) wrong_size(f.path, "error feedback", f.errors, errors * 4, ctx_.world);
    out.errors = floats_at(f.bytes, 0, errors);
  }
  read_sections(files, f, saved_world, out);
  return out;
}

void ZeroOneAdamRule::read_sections(const ckpt::TagFiles& files, const SavedFile& f, int saved_world,
                                    Saved& out) const {
  if (saved_world != ctx_.world || f.zero_one == 0) return;  // each rank's own weights: the same world size only
  int64_t span = 0;
  for (const BlockShard& s : blocks()) span += s.opt_numel;
  if (f.zero_one != 3 * span * 4) wrong_size(f.path, "0/1 Adam", f.zero_one, 3 * span * 4, ctx_.world);
  const nlohmann::json& e = *f.entry;
  if (!e.contains("lr_sum") || !e["lr_sum"].is_number())
    throw IoError("checkpoint: the rank index of rank " + std::to_string(std::min(ctx_.rank, saved_world - 1)) +
                  " in " + files.dir + " has a malformed \"onebit\" entry (lr_sum; nothing was loaded)");
  out.accum = floats_at(f.bytes, f.errors, span);
  out.master = floats_at(f.bytes, f.errors + span * 4, span);
  out.m = floats_at(f.bytes, f.errors + 2 * span * 4, span);
  out.lrs = e["lr_sum"].get<double>();
}

// 1-bit Lamb's part: the fresh variance per span (like Adam's v: each rank
// holds its own span, so at another world size or stage it is stitched from
// every saved rank's file by flat offsets), then per tensor numbers that
// every rank holds alike.
void OneBitLambRule::read_sections(const ckpt::TagFiles& files, const SavedFile& f, int saved_world,
                                   Saved& out) const {
  if (f.lamb == 0) return;
  const int from = std::min(ctx_.rank, saved_world - 1);
  const nlohmann::json& e = *f.entry;
  const int64_t tensors = tensor_count();
  int64_t span = 0;
  std::vector<std::array<int64_t, 3>> mine;  // this rank's spans (block order)
  for (size_t b = 0; b < blocks().size(); ++b) {
    const BlockShard& s = blocks()[b];
    mine.push_back({static_cast<int64_t>(b), ctx_.plan->optimizer_spans_block ? 0 : s.part.own_offset(), s.opt_numel});
    span += s.opt_numel;
  }
  const bool v_fresh = e["lamb"].value("v_fresh", false), scaling = e["lamb"].value("scaling", false);
  auto lamb_bytes = [&](const std::vector<std::array<int64_t, 3>>& spans) {
    int64_t n = 0;
    for (const auto& sp : spans) n += sp[2];
    return (v_fresh ? n * 4 : 0) + (scaling ? 3 : 2) * tensors * 8;
  };
  const std::vector<std::array<int64_t, 3>> theirs = saved_spans(files, from);
  if (f.lamb != lamb_bytes(theirs)) wrong_size(f.path, "Lamb", f.lamb, lamb_bytes(theirs), ctx_.world);
  int64_t at = f.errors + f.zero_one;
  if (v_fresh) {
    if (theirs == mine) {
      out.v_fresh = floats_at(f.bytes, at, span);
    } else {
      out.v_fresh.assign(static_cast<size_t>(span), 0.0f);  // padding no saved span covers stays 0
      std::vector<int64_t> my_at(blocks().size());  // each block's first element in out.v_fresh
      for (size_t b = 1; b < blocks().size(); ++b) my_at[b] = my_at[b - 1] + mine[b - 1][2];
      for (int r = 0; r < saved_world; ++r) {
        const OneBitFile g = r == from ? OneBitFile{} : read_onebit_file(files, r);
        const OneBitFile& h = r == from ? f : g;
        const std::vector<std::array<int64_t, 3>> spans = r == from ? theirs : saved_spans(files, r);
        if (h.lamb != lamb_bytes(spans) || (*h.entry)["lamb"].value("v_fresh", false) != v_fresh)
          wrong_size(h.path, "Lamb", h.lamb, lamb_bytes(spans), ctx_.world);
        int64_t pos = h.errors + h.zero_one;  // this saved span's first byte in h
        for (const auto& [b, off, cnt] : spans) {
          const auto& [mb, moff, mcnt] = mine[static_cast<size_t>(b)];
          const int64_t lo = std::max(off, moff), hi = std::min(off + cnt, moff + mcnt);
          if (lo < hi)
            std::memcpy(out.v_fresh.data() + my_at[static_cast<size_t>(b)] + (lo - moff),
                        h.bytes.data() + pos + (lo - off) * 4, static_cast<size_t>(hi - lo) * 4);
          pos += cnt * 4;
        }
      }
    }
    at += lamb_bytes(theirs) - (scaling ? 3 : 2) * tensors * 8;  // past the saved rank's fresh variance
  }
  auto doubles = [&](std::vector<double>& d) {
    d.resize(static_cast<size_t>(tensors));
    std::memcpy(d.data(), f.bytes.data() + at, static_cast<size_t>(tensors) * 8);
    at += tensors * 8;
  };
  doubles(out.lamb_coeff);
  doubles(out.last_factor);
  if (scaling) doubles(out.scaling);
  out.lamb = true;
}

void OneBitRule::load_span(const StateSpan& sp) {
  const Saved& saved = saved_;
  if (saved.master.empty()) return;
  int64_t at = 0;
  for (int b = 0; b < sp.block; ++b) at += blocks()[static_cast<size_t>(b)].opt_numel;
  at += sp.offset;
  std::memcpy(sp.master, saved.master.data() + at, static_cast<size_t>(sp.count) * 4);
  std::memcpy(sp.m, saved.m.data() + at, static_cast<size_t>(sp.count) * 4);
}

void OneBitRule::finish_load(int64_t t) {
  const Saved saved = std::move(saved_);
  saved_ = Saved{};
  onebit_ar.clear();
  onebit_announced = false;
  restore(saved, t);
  if (!saved.why.empty() && local_gradients(t + 1) && ctx_.world > 1 && ctx_.rank == 0)
    log_warn(std::string(optimizer_type_name(type_)) + ": " + saved.why +
             "; the error feedback restarts from zero (as DeepSpeed's does at every load)");
}

// The Adam pair's error feedback: per tensor, worker then server error.
void OneBitRule::restore(const Saved& saved, int64_t) {
  if (saved.errors.empty() || ctx_.world == 1) return;
  make_compressors();
  const float* at = saved.errors.data();
  for (auto& per : onebit_ar)
    for (comm::CompressedAllReduce& ar : per) {
      ar.set_errors(at, at + ar.padded_size());
      at += ar.padded_size() + ar.chunk_size();
    }
}

void ZeroOneAdamRule::restore(const Saved& saved, int64_t t) {
  accum_.clear();
  lrs_ = 0;
  // The schedule is a function of the step count.
  var_interval_ = 1;
  var_counter_ = local_counter_ = 0;
  local_interval_ = 1;
  errors_reset_ = false;
  for (int64_t k = 1; k <= t; ++k) after_update(k);
  OneBitRule::restore(saved, t);
  if (!saved.accum.empty()) {
    const float* at = saved.accum.data();
    for (const BlockShard& s : blocks()) {
      accum_.emplace_back(at, at + s.opt_numel);
      at += s.opt_numel;
    }
    lrs_ = saved.lrs;
  }
}

void OneBitLambRule::restore(const Saved& saved, int64_t) {
  flat_.reset();
  coeff_.clear();
  last_factor_.clear();
  scaling_.clear();
  v_fresh_.clear();
  if (saved.lamb) {
    coeff_ = saved.lamb_coeff;
    last_factor_ = saved.last_factor;
    scaling_ = saved.scaling;
    const float* at = saved.v_fresh.data();
    if (!saved.v_fresh.empty())
      for (const BlockShard& s : blocks()) {
        v_fresh_.emplace_back(at, at + s.opt_numel);
        at += s.opt_numel;
      }
  }
  if (!saved.errors.empty() && ctx_.world > 1) {
    int64_t total = 0;
    for (const BlockShard& s : blocks()) total += s.layout.param_numel();
    flat_ = std::make_unique<comm::CompressedAllReduce>(total, ctx_.world);
    flat_->set_errors(saved.errors.data(), saved.errors.data() + flat_->padded_size());
  }
}

}  // namespace zinc

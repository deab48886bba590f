// Every rank must be given the same config and model (Engine::Impl,
// engine_impl.h): ranks that differ train diverging shards and save a
// checkpoint whose metadata names one config. The comparison itself
// (rank_difference, engine/rank_agreement.h) serves zinc-train's command
// line and inputs too.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/error.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"
#include "engine/rank_agreement.h"
#include "optim/optim.h"

namespace zinc {

nlohmann::json Engine::Impl::what_we_train() const {
  nlohmann::json blocks_spec = nlohmann::json::object();
  for (const BlockSpec& b : model->blocks()) {
    nlohmann::json ps = nlohmann::json::object();
    for (const ParamSpec& p : b.params)
      ps[p.name] = std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
    blocks_spec[b.name] = ps;  // object keys: a difference is named by block and parameter
  }
  nlohmann::json what = {{"config", cfg.source}, {"model", {{"name", model->name()}, {"blocks", blocks_spec}}}};
  // Where each rank computes: "device": "auto" is decided on each rank (one
  // without a usable GPU takes the CPU), so one config text can mean two
  // paths whose collectives differ; they waited on each other until the
  // communicator's timeout, then blamed a stall.
  what["device"] = cfg.device == Device::kCuda ? "cuda" : "cpu";
  // At stage 0 every rank updates the whole model on its own CPU: kernels
  // that round differently (ZINC_OPTIM_ISA on one rank, or CPUs of two
  // classes) make replicas that drift apart without a word.
  if (cfg.zero.stage == 0 && cfg.device != Device::kCuda)
    what["optimizer_isa"] = std::string(optim::isa_name(optim::active_isa()));
  return what;
}

namespace {

// Numbers that JSON's equality calls equal print alike: an integral float
// (1.0, -0.0) as the integer it is.
nlohmann::json canonical(const nlohmann::json& j) {
  if (j.is_number_float()) {
    const double d = j.get<double>();
    if (d == static_cast<double>(static_cast<int64_t>(d)) && std::abs(d) < 9.2e18) return static_cast<int64_t>(d);
    return j;
  }
  if (j.is_object()) {
    nlohmann::json out = nlohmann::json::object();
    for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = canonical(it.value());
    return out;
  }
  if (j.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const nlohmann::json& e : j) out.push_back(canonical(e));
    return out;
  }
  return j;
}

}  // namespace

std::string broadcast_text(comm::Communicator& comm, const std::string& text, int root) {
  double len = comm.rank() == root ? static_cast<double>(text.size()) : 0.0;
  comm.all_reduce_max_f64(&len, 1);
  std::string buf(static_cast<size_t>(len) + (static_cast<size_t>(len) & 1), '\0');  // 2-byte elements
  if (comm.rank() == root) std::memcpy(buf.data(), text.data(), text.size());
  comm.broadcast(buf.data(), static_cast<int64_t>(buf.size() / 2), DType::kBF16, root);
  buf.resize(static_cast<size_t>(len));
  return buf;
}

std::optional<RankDifference> rank_difference(comm::Communicator& comm, const nlohmann::json& mine) {
  const int world = comm.size(), rank = comm.rank();
  if (world == 1) return std::nullopt;
  const std::string text = canonical(mine).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const uint64_t h = std::strtoull(ckpt::xxh3_hex(text.data(), text.size()).c_str(), nullptr, 16);
  const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);
  double v[4] = {hi, lo, -hi, -lo};
  comm.all_reduce_max_f64(v, 4);
  if (v[0] == -v[2] && v[1] == -v[3]) return std::nullopt;
  const std::string root_text = broadcast_text(comm, text, 0);
  double lowest = root_text != text ? world - rank : 0;  // the lowest differing rank has the largest
  comm.all_reduce_max_f64(&lowest, 1);
  RankDifference d;
  d.other = world - static_cast<int>(lowest);
  const nlohmann::json a = nlohmann::json::parse(root_text);
  const nlohmann::json b = nlohmann::json::parse(broadcast_text(comm, text, d.other));
  first_difference(a, b, "", d.path, d.at_root, d.at_other);
  return d;
}

void Engine::Impl::agree_on_config() {
  const std::optional<RankDifference> d = rank_difference(*comm, what_we_train());
  if (!d) return;
  std::string path = d->path;
  if (path == "optimizer_isa")
    throw Error("the ranks' optimizer kernels differ: rank " + std::to_string(d->other) + " runs " + d->at_other +
                ", rank 0 " + d->at_root + "; at ZeRO stage 0 every rank updates the whole model, and these round "
                "differently, so the replicas would drift apart: set ZINC_OPTIM_ISA to one path every rank's CPU "
                "has (nothing was trained)");
  if (path == "device")
    throw ConfigError("device", "the ranks compute on different devices: rank " + std::to_string(d->other) +
                                    " on " + d->at_other + ", rank 0 on " + d->at_root +
                                    " (\"auto\" is decided on each rank, and one without a usable GPU takes the "
                                    "CPU); give every rank a GPU, or set \"cpu\" (nothing was trained)");
  if (path.rfind("config.", 0) == 0) path = path.substr(7);  // the config's own JSON path
  throw ConfigError(path, "the ranks were given different configs: rank " + std::to_string(d->other) + " has " +
                              d->at_other + ", rank 0 has " + d->at_root +
                              " (every rank must train the same config and model; nothing was trained)");
}

bool first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at,
                      std::string& path, std::string& va, std::string& vb) {
  auto brief = [](const nlohmann::json* j) {
    if (!j) return std::string("nothing");
    std::string d = j->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return d.size() > 80 ? d.substr(0, 77) + "..." : d;
  };
  auto join = [&](const std::string& k) { return at.empty() ? k : at + "." + k; };
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
    for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
    for (const std::string& k : keys) {
      const nlohmann::json* x = a.contains(k) ? &a[k] : nullptr;
      const nlohmann::json* y = b.contains(k) ? &b[k] : nullptr;
      if (x && y) {
        if (*x != *y) return first_difference(*x, *y, join(k), path, va, vb);
      } else {
        path = join(k), va = brief(x), vb = brief(y);
        return true;
      }
    }
    return false;
  }
  if (a.is_array() && b.is_array() && a.size() == b.size()) {
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != b[i]) return first_difference(a[i], b[i], at + "[" + std::to_string(i) + "]", path, va, vb);
    return false;
  }
  path = at, va = brief(&a), vb = brief(&b);
  return true;
}

}  // namespace zinc

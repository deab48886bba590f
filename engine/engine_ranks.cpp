// Every rank must be given the same config and model (Engine::Impl,
// engine_impl.h): ranks that differ train diverging shards and save a
// checkpoint whose metadata names one config.
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/error.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"

namespace zinc {

nlohmann::json Engine::Impl::what_we_train() const {
  nlohmann::json blocks_spec = nlohmann::json::object();
  for (const BlockSpec& b : model->blocks()) {
    nlohmann::json ps = nlohmann::json::object();
    for (const ParamSpec& p : b.params)
      ps[p.name] = std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
    blocks_spec[b.name] = ps;  // object keys: a difference is named by block and parameter
  }
  return {{"config", cfg.source}, {"model", {{"name", model->name()}, {"blocks", blocks_spec}}}};
}

std::string Engine::Impl::broadcast_text(const std::string& text, int root) {
  double len = rank == root ? static_cast<double>(text.size()) : 0.0;
  comm->all_reduce_max_f64(&len, 1);
  std::string buf(static_cast<size_t>(len) + (static_cast<size_t>(len) & 1), '\0');  // 2-byte elements
  if (rank == root) std::memcpy(buf.data(), text.data(), text.size());
  comm->broadcast(buf.data(), static_cast<int64_t>(buf.size() / 2), DType::kBF16, root);
  buf.resize(static_cast<size_t>(len));
  return buf;
}

void Engine::Impl::agree_on_config() {
  const nlohmann::json mine = what_we_train();
  const std::string text = mine.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const uint64_t h = std::strtoull(ckpt::xxh3_hex(text.data(), text.size()).c_str(), nullptr, 16);
  const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);
  double v[4] = {hi, lo, -hi, -lo};
  comm->all_reduce_max_f64(v, 4);
  if (v[0] == -v[2] && v[1] == -v[3]) return;
  const std::string root_text = broadcast_text(text, 0);
  double lowest = root_text != text ? world - rank : 0;  // the lowest differing rank has the largest
  comm->all_reduce_max_f64(&lowest, 1);
  const int other = world - static_cast<int>(lowest);
  const nlohmann::json a = nlohmann::json::parse(root_text);
  const nlohmann::json b = nlohmann::json::parse(broadcast_text(text, other));
  std::string path, va, vb;
  first_difference(a, b, "", path, va, vb);
  if (path.rfind("config.", 0) == 0) path = path.substr(7);  // the config's own JSON path
  throw ConfigError(path, "the ranks were given different configs: rank " + std::to_string(other) + " has " + vb +
                              ", rank 0 has " + va + " (every rank must train the same config and model; nothing "
                              "was trained)");
}

bool Engine::Impl::first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at,
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

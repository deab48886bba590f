// Python values and JSON documents (convert.h).
#include "convert.h"

#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "engine/config.h"
#include "engine/config_reader.h"
#include "tools/experiment.h"

namespace zinc::python {

using json = nlohmann::json;

namespace {
// Note [configs from Python]
// --------------------------
// A dict is held to what a config file is held to, and refused by JSON path
// with a ConfigError (ValueError) rather than crashing or hanging:
//   - a dict or list that contains itself ("a.b refers to config, which
//     contains it"): JSON has no references;
//   - nesting deeper than zinc::kMaxConfigDepth, before this recursion could
//     exhaust the C++ stack (as a 100,000-deep dict did);
//   - more than kMaxConfigValues values in all: a dict or list that appears
//     in many places counts once per place, and a few nested lists sharing
//     one element would otherwise expand to 2^60 values (a hang);
//   - an int outside 64 bits (2**64): JSON numbers here are int64, or uint64
//     above it, as the file parser reads them;
//   - a str that is not Unicode text (a lone surrogate): JSON text is UTF-8.

constexpr size_t kMaxConfigValues = 1000000;  // a config has hundreds

struct FromPy {
  std::vector<std::pair<PyObject*, std::string>> open;  // the dicts and lists being converted, outermost first
  size_t values = 0;

  static std::string where(const std::string& path) { return path.empty() ? "config" : path; }

  // A str as UTF-8, or a ConfigError naming `path`.
  static std::string utf8(py::handle s, const std::string& path, const char* what) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
    if (!p) {
      PyErr_Clear();
      throw zinc::ConfigError(where(path), std::string(what) +
                                               " is not Unicode text (it holds a lone surrogate such as "
                                               "'\\ud800'), so it cannot be JSON");
    }
    return std::string(p, static_cast<size_t>(n));
  }

  json integer(py::handle h, const std::string& path) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow == 0) {
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      return static_cast<int64_t>(v);
    }
    if (overflow > 0) {
      const unsigned long long u = PyLong_AsUnsignedLongLong(h.ptr());
      if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return static_cast<uint64_t>(u);
      PyErr_Clear();
    }
    // Python refuses to print ints of thousands of digits: name the size.
    const size_t bits = h.attr("bit_length")().cast<size_t>();
    const std::string shown = bits <= 256 ? std::string(py::str(h)) : "a " + std::to_string(bits) + "-bit integer";
    throw zinc::ConfigError(where(path), shown + " does not fit in 64 bits (a config's integers lie in "
                                                 "[-2**63, 2**64 - 1])");
  }

  json convert(py::handle h, const std::string& path) {
    if (++values > kMaxConfigValues)
      throw zinc::ConfigError(where(path), "the config holds more than " + std::to_string(kMaxConfigValues) +
                                               " values (a dict or list counts once per place it appears); a "
                                               "config has hundreds");
    if (h.is_none()) return nullptr;
    if (py::isinstance<py::bool_>(h)) return h.cast<bool>();
    if (py::isinstance<py::int_>(h)) return integer(h, path);
    if (py::isinstance<py::float_>(h)) return h.cast<double>();
    if (py::isinstance<py::str>(h)) return utf8(h, path, "the string");
    const bool is_dict = py::isinstance<py::dict>(h);
    if (!is_dict && !py::isinstance<py::list>(h) && !py::isinstance<py::tuple>(h)) {
      throw zinc::ConfigError(where(path), "expected a JSON value (dict, list, str, int, float, bool or None), got " +
                                               type_name(h));
    }
    for (const auto& [obj, at] : open) {
      if (obj == h.ptr())
        throw zinc::ConfigError(where(path), "refers to " + where(at) + ", which contains it (a config is JSON, "
                                             "and no dict or list in it may contain itself)");
    }
    if (open.size() >= static_cast<size_t>(zinc::kMaxConfigDepth))
      throw zinc::ConfigError(where(path), "nested deeper than " + std::to_string(zinc::kMaxConfigDepth) +
                                               " levels of dicts and lists (the limit for a config; DeepSpeed's "
                                               "need a handful)");
    open.emplace_back(h.ptr(), path);
    json out;
    if (is_dict) {
      out = json::object();
      for (auto kv : py::reinterpret_borrow<py::dict>(h)) {
        if (!py::isinstance<py::str>(kv.first))
          throw zinc::ConfigError(where(path),
                                  "keys must be strings, got " + std::string(py::str(py::repr(kv.first))));
        const std::string k = utf8(kv.first, path, "a key");
        const std::string shown = zinc::config::key_text(k);
        out[k] = convert(kv.second, path.empty() ? shown : path + "." + shown);
      }
    } else {
      out = json::array();
      size_t i = 0;
      for (py::handle x : h) out.push_back(convert(x, path + "[" + std::to_string(i++) + "]"));
    }
    open.pop_back();
    return out;
  }
};


}  // namespace

json from_py(py::handle h, const std::string& path) { return FromPy{}.convert(h, path); }

std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

py::object to_py(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return py::none();
    case json::value_t::boolean: return py::bool_(j.get<bool>());
    case json::value_t::number_integer: return py::int_(j.get<int64_t>());
    case json::value_t::number_unsigned: return py::int_(j.get<uint64_t>());
    case json::value_t::number_float: return py::float_(j.get<double>());
    case json::value_t::string: return py::str(j.get_ref<const std::string&>());
    case json::value_t::array: {
      py::list l;
      for (const json& x : j) l.append(to_py(x));
      return l;
    }
    case json::value_t::object: {
      py::dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d[py::str(it.key())] = to_py(it.value());
      return d;
    }
    default: return py::none();
  }
}

// The experiment document from `config` (a dict, or a str / os.PathLike
// naming a JSON file), with run.steps replaced when steps is given.
json load_config(py::handle config, std::optional<int64_t> steps, const char* fn) {
  json doc;
  if (py::isinstance<py::dict>(config)) {
    doc = from_py(config, "");
  } else if (py::isinstance<py::str>(config) || py::hasattr(config, "__fspath__")) {
    // os.fsencode: the file name's bytes, for a str path, a bytes one and a
    // name that is not UTF-8 alike.
    const std::string path = py::module_::import("os").attr("fsencode")(config).cast<std::string>();
    if (path.find('\0') != std::string::npos)
      throw py::value_error(std::string(fn) + ": the config's file name contains a NUL byte");
    doc = zinc::tools::load_document(path, {});
  } else {
    throw py::type_error(std::string(fn) + ": config must be a dict or a path to a JSON file, got " +
                         type_name(config));
  }
  if (steps) {
    if (*steps <= 0) throw py::value_error(std::string(fn) + ": steps must be positive, got " + std::to_string(*steps));
    // A document that is not an object is refused by the parser, at its top level.
    if (doc.is_object() && !doc.contains("run")) doc["run"] = json::object();
    if (doc.is_object() && doc["run"].is_object()) doc["run"]["steps"] = *steps;
  }
  return doc;
}

}  // namespace zinc::python

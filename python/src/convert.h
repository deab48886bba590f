// zinc Python module, private: Python values and JSON documents (Note
// [configs from Python] in convert.cpp). Called with the GIL held.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <pybind11/pybind11.h>

#include <nlohmann/json.hpp>

namespace zinc::python {

namespace py = pybind11;

// The name of an object's type, for messages.
std::string type_name(py::handle h);
// A JSON value as the Python value it is (dicts, lists, str, int, float, bool, None).
py::object to_py(const nlohmann::json& j);
// A Python value as JSON, held to what a config file is held to (Note
// [configs from Python]): a ConfigError naming `path` otherwise.
nlohmann::json from_py(py::handle h, const std::string& path);
// The experiment document from `config` (a dict, or a str / os.PathLike
// naming a JSON file), with run.steps replaced when steps is given; `fn`
// names the caller in errors.
nlohmann::json load_config(py::handle config, std::optional<int64_t> steps, const char* fn);

}  // namespace zinc::python

// zinc._zinc._bench: what bench/python_adamw_bench.py needs to measure its
// bound in the same process as the figure: the Adam-pattern streaming probe
// (optim/adam_probe.h), the one zinc-bench adamw runs. Private: not part of
// the package's API.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "optim/adam_probe.h"

namespace py = pybind11;

namespace {

py::array probe_arg(py::handle h, const char* name, bool write) {
  if (!py::isinstance<py::array>(h))
    throw py::type_error(std::string("zinc._bench.adam_probe: ") + name + " must be a numpy.ndarray of float32");
  py::array a = py::reinterpret_borrow<py::array>(h);
  if (a.dtype().kind() != 'f' || a.itemsize() != 4)
    throw py::type_error(std::string("zinc._bench.adam_probe: ") + name + " must have dtype float32, got " +
                         std::string(py::str(a.dtype())));
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string("zinc._bench.adam_probe: ") + name + " must be C-contiguous");
  if (write && !a.writeable())
    throw py::value_error(std::string("zinc._bench.adam_probe: ") + name + " must be writeable");
  return a;
}

}  // namespace

void bind_bench(py::module_& m) {
  py::module_ b = m.def_submodule("_bench", "Private: the probes bench/python_adamw_bench.py measures bounds with.");
  b.def(
      "adam_probe",
      [](py::handle a, py::handle x, py::handle c, py::handle d) {
        py::array aa = probe_arg(a, "a", true), xa = probe_arg(x, "b", false), ca = probe_arg(c, "c", true),
                  da = probe_arg(d, "d", true);
        const py::ssize_t n = aa.size();
        if (xa.size() != n || ca.size() != n || da.size() != n)
          throw py::value_error("zinc._bench.adam_probe: a, b, c and d must have one size");
        float* pa = static_cast<float*>(aa.mutable_data());
        const float* pb = static_cast<const float*>(xa.data());
        float* pc = static_cast<float*>(ca.mutable_data());
        float* pd = static_cast<float*>(da.mutable_data());
        py::gil_scoped_release release;
        zinc::optim::adam_probe(pa, pb, pc, pd, n);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"),
      "adam_probe(a, b, c, d): per element a += b; c -= b; d = 0.5 d + b (read 4 float32 arrays, write 3: "
      "28 bytes), threaded like the optimizer; zinc-bench adamw's bound. Releases the GIL.");
  b.attr("ADAM_PROBE_BYTES") = zinc::optim::kAdamProbeBytes;
}

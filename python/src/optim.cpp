// zinc.optim: zinc's AdamW kernels (optim/optim.h) in place on NumPy arrays.
// Zero-copy: the arrays' own memory goes to adam_step through the buffer
// protocol; nothing is allocated per call. The GIL is released while the
// kernel runs (threaded, ISA chosen at run time as in C++).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "optim/optim.h"
#include "python/src/unconstructed.h"

namespace py = pybind11;

namespace {

std::string type_of(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A hyperparameter the kernels compute with in float32 (optim/adam.cpp
// casts each one). NaN, an infinity, or a double beyond float32's range
// (which the cast makes an infinity) would write NaN or inf into every
// parameter of the span, so each is refused here, naming it. Zero is
// allowed everywhere (grad_scale 0: a step on zero gradients, which only
// decays); a negative value nowhere (a negative grad_scale or lr would
// ascend the loss).
void check_hyper(const char* where, const char* name, double v) {
  if (std::isfinite(v) && std::isfinite(static_cast<float>(v)) && v >= 0) return;
  throw py::value_error(std::string(where) + ": " + name + " must be a finite number >= 0 (a float32), got " +
                        num(v));
}

// The scalar arguments, converted here rather than by pybind: a wrong
// type got pybind's "incompatible function arguments" and the whole
// signature, not the argument's name. A number is what float() takes from
// a number (int, float, a NumPy scalar), not from a str; an int (step) what
// operator.index() takes; a flag a bool.
double number_arg(py::handle h, const char* where, const char* name) {
  if (!py::isinstance<py::str>(h) && !py::isinstance<py::bytes>(h) && !py::isinstance<py::bool_>(h)) {
    const double v = PyFloat_AsDouble(h.ptr());
    if (!(v == -1.0 && PyErr_Occurred())) return v;
    const bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (overflow)
      throw py::value_error(std::string(where) + ": " + name + " must be a finite number >= 0 (a float32), got an " +
                            type_of(h) + " past a float's range");
  }
  throw py::type_error(std::string(where) + ": " + name + " must be a number, got " + type_of(h));
}
int64_t int_arg(py::handle h, const char* where, const char* name) {
  if (PyIndex_Check(h.ptr()) && !py::isinstance<py::bool_>(h)) {
    const long long v = PyLong_AsLongLong(py::reinterpret_steal<py::object>(PyNumber_Index(h.ptr())).ptr());
    if (!(v == -1 && PyErr_Occurred())) return v;
    PyErr_Clear();
    throw py::value_error(std::string(where) + ": " + name + " is past a 64-bit integer");
  }
  throw py::type_error(std::string(where) + ": " + name + " must be an int, got " + type_of(h));
}
bool flag_arg(py::handle h, const char* where, const char* name) {
  const bool numpy_bool = py::hasattr(h, "dtype") && py::hasattr(h, "ndim") && h.attr("ndim").cast<int>() == 0 &&
                          py::str(h.attr("dtype").attr("kind")).cast<std::string>() == "b";
  if (py::isinstance<py::bool_>(h) || numpy_bool) return PyObject_IsTrue(h.ptr()) == 1;
  throw py::type_error(std::string(where) + ": " + name + " must be True or False, got " + type_of(h));
}
std::pair<double, double> betas_arg(py::handle h, const char* where) {
  if (!py::isinstance<py::str>(h) && PySequence_Check(h.ptr()) && PySequence_Size(h.ptr()) == 2) {
    py::sequence s = py::reinterpret_borrow<py::sequence>(h);
    return {number_arg(s[0], where, "betas[0]"), number_arg(s[1], where, "betas[1]")};
  }
  PyErr_Clear();
  throw py::type_error(std::string(where) + ": betas must be a pair of numbers (beta1, beta2), got " + type_of(h) +
                       (PySequence_Check(h.ptr()) && !py::isinstance<py::str>(h)
                            ? " of " + std::to_string(py::len(h)) + " items"
                            : std::string()));
}

struct Arg {
  const char* name;
  py::array a;
};

// Whether a dtype's bytes are in this machine's order ('=' native, '|' one
// byte; '<' or '>' where it is written out). A '>f4' array passed as float32
// would be read as other numbers.
bool native_order(const py::dtype& d) {
  const char b = d.byteorder();
  const uint16_t one = 1;
  const bool little = *reinterpret_cast<const unsigned char*>(&one) == 1;
  return b == '=' || b == '|' || b == (little ? '<' : '>');
}

// One array argument, checked: a NumPy array of `dtype_name` (itemsize 4 and
// kind 'f', or 2 and kind 'u') in the machine's byte order, C-contiguous,
// writeable when written.
py::array array_arg(py::handle h, const char* name, char kind, int itemsize, const char* dtype_name, bool write) {
  if (!py::isinstance<py::array>(h))
    throw py::type_error(std::string("zinc.optim.AdamW.step: ") + name + " must be a numpy.ndarray of " + dtype_name +
                         ", got " + type_of(h));
  py::array a = py::reinterpret_borrow<py::array>(h);
  if (a.dtype().kind() != kind || a.itemsize() != itemsize || !native_order(a.dtype()))
    throw py::type_error(std::string("zinc.optim.AdamW.step: ") + name + " must have dtype " + dtype_name +
                         (native_order(a.dtype()) ? ", got " + std::string(py::str(a.dtype()))
                                                  : " in this machine's byte order, got " + std::string(py::str(a.dtype())) +
                                                        " (its bytes are swapped; a.astype(a.dtype.newbyteorder('=')) "
                                                        "makes a copy in this machine's order)"));
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string("zinc.optim.AdamW.step: ") + name +
                          " must be C-contiguous (the update works in place; a copy would not be updated)");
  if (write && !a.writeable())
    throw py::value_error(std::string("zinc.optim.AdamW.step: ") + name + " must be writeable");
  return a;
}

class AdamW {
 public:
  static AdamW from_py(py::handle lr, py::handle betas, py::handle eps, py::handle weight_decay,
                       py::handle bias_correction, py::handle adamw_mode) {
    const char* where = "zinc.optim.AdamW";
    return AdamW(number_arg(lr, where, "lr"), betas_arg(betas, where), number_arg(eps, where, "eps"),
                 number_arg(weight_decay, where, "weight_decay"), flag_arg(bias_correction, where, "bias_correction"),
                 flag_arg(adamw_mode, where, "adamw_mode"));
  }
  AdamW(double lr, std::pair<double, double> betas, double eps, double weight_decay, bool bias_correction,
        bool adamw_mode) {
    check_hyper("zinc.optim.AdamW", "lr", lr);
    if (!(betas.first >= 0 && betas.first < 1) || !(betas.second >= 0 && betas.second < 1))
      throw py::value_error("zinc.optim.AdamW: betas must be in [0, 1), got (" + num(betas.first) + ", " +
                            num(betas.second) + ")");
    check_hyper("zinc.optim.AdamW", "eps", eps);
    check_hyper("zinc.optim.AdamW", "weight_decay", weight_decay);
    p_.lr = lr;
    p_.beta1 = betas.first;
    p_.beta2 = betas.second;
    p_.eps = eps;
    p_.weight_decay = weight_decay;
    p_.bias_correction = bias_correction;
    p_.adam_w_mode = adamw_mode;
  }

  void step_py(py::handle step_number, py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
               py::handle bf16_out, py::handle grad_scale) {
    const char* where = "zinc.optim.AdamW.step";
    step(int_arg(step_number, where, "step"), param, grad, exp_avg, exp_avg_sq, bf16_out,
         number_arg(grad_scale, where, "grad_scale"));
  }
  void step(int64_t step, py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq,
            py::handle bf16_out, double grad_scale) {
    if (step < 1) throw py::value_error("zinc.optim.AdamW.step: step must be >= 1 (counted from 1), got " +
                                        std::to_string(step));
    check_hyper("zinc.optim.AdamW.step", "grad_scale", grad_scale);
    std::vector<Arg> args;
    args.push_back({"param", array_arg(param, "param", 'f', 4, "float32", true)});
    zinc::DType grad_dtype = zinc::DType::kF32;
    if (py::isinstance<py::array>(grad) && py::reinterpret_borrow<py::array>(grad).dtype().kind() == 'u') {
      args.push_back({"grad", array_arg(grad, "grad", 'u', 2, "float32 (or uint16 holding bf16)", false)});
      grad_dtype = zinc::DType::kBF16;
    } else {
      args.push_back({"grad", array_arg(grad, "grad", 'f', 4, "float32 (or uint16 holding bf16)", false)});
    }
    args.push_back({"exp_avg", array_arg(exp_avg, "exp_avg", 'f', 4, "float32", true)});
    args.push_back({"exp_avg_sq", array_arg(exp_avg_sq, "exp_avg_sq", 'f', 4, "float32", true)});
    if (!bf16_out.is_none()) args.push_back({"bf16_out", array_arg(bf16_out, "bf16_out", 'u', 2, "uint16", true)});
    const py::ssize_t n = args[0].a.size();
    auto shape = [](const py::array& a) {
      std::string t = "(";
      for (py::ssize_t d = 0; d < a.ndim(); ++d) t += (d ? ", " : "") + std::to_string(a.shape(d));
      return t + (a.ndim() == 1 ? ",)" : ")");
    };
    for (const Arg& x : args) {
      if (x.a.size() != n)
        throw py::value_error(std::string("zinc.optim.AdamW.step: ") + x.name + " has " + std::to_string(x.a.size()) +
                              " elements; param has " + std::to_string(n));
      // Element i of each goes with element i of the others in memory order: the same shape, or a flat
      // (1-D) buffer of the same size; a transposed shape would pair elements that do not belong together.
      bool same = x.a.ndim() == args[0].a.ndim();
      for (py::ssize_t d = 0; same && d < x.a.ndim(); ++d) same = x.a.shape(d) == args[0].a.shape(d);
      if (!same && x.a.ndim() != 1 && args[0].a.ndim() != 1)
        throw py::value_error(std::string("zinc.optim.AdamW.step: ") + x.name + " has shape " + shape(x.a) +
                              "; param has " + shape(args[0].a) + " (the same shape, or a 1-D array of its size)");
    }
    // Overlapping memory would make the result depend on the kernel's order.
    for (size_t i = 0; i < args.size(); ++i)
      for (size_t j = i + 1; j < args.size(); ++j) {
        const auto* a0 = static_cast<const char*>(args[i].a.data());
        const auto* b0 = static_cast<const char*>(args[j].a.data());
        if (n > 0 && a0 < b0 + args[j].a.nbytes() && b0 < a0 + args[i].a.nbytes())
          throw py::value_error(std::string("zinc.optim.AdamW.step: ") + args[i].name + " and " + args[j].name +
                                " share memory; each must be its own array");
      }
    zinc::optim::AdamSpan span;
    span.param = static_cast<float*>(args[0].a.mutable_data());
    span.grad = args[1].a.data();
    span.grad_dtype = grad_dtype;
    span.exp_avg = static_cast<float*>(args[2].a.mutable_data());
    span.exp_avg_sq = static_cast<float*>(args[3].a.mutable_data());
    span.bf16_out = args.size() > 4 ? static_cast<zinc::bf16*>(args[4].a.mutable_data()) : nullptr;
    span.n = n;
    py::gil_scoped_release release;
    zinc::optim::adam_step(p_, step, static_cast<float>(grad_scale), span);
  }

  zinc::optim::AdamParams p_;
};

}  // namespace

void bind_optim(py::module_& m) {
  py::module_ o = m.def_submodule("optim", "zinc's CPU optimizers on NumPy arrays (use zinc.optim).");
  py::class_<AdamW>(o, "AdamW", zinc::python::refuse_unconstructed(), R"doc(
AdamW (or Adam with L2 decay, adamw_mode=False) with zinc's kernels: the
same code the engine runs, vectorised (AVX2 / AVX-512 / AVX512-BF16 chosen
at run time, ZINC_OPTIM_ISA to force one) and threaded (OMP_NUM_THREADS).
Works in place on NumPy arrays, with no copies; the formula is PyTorch's
AdamW (DeepSpeed's CPU Adam), in optim/optim.h.

    opt = zinc.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for t in range(1, steps + 1):
        opt.step(t, param, grad, exp_avg, exp_avg_sq)   # float32 arrays, same size

lr, eps and weight_decay must be finite and >= 0, betas in [0, 1): anything
else (NaN, inf, a value beyond float32) is a ValueError naming it, as NaN
would otherwise be written into every parameter.
)doc")
      .def(py::init(&AdamW::from_py), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("bias_correction") = true,
           py::arg("adamw_mode") = true)
      .def("step", &AdamW::step_py, py::arg("step"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::kw_only(), py::arg("bf16_out") = py::none(), py::arg("grad_scale") = 1.0,
           R"doc(step(step, param, grad, exp_avg, exp_avg_sq, *, bf16_out=None, grad_scale=1.0)

One update of param, exp_avg and exp_avg_sq in place. step: the step
number, from 1 (bias correction). param, exp_avg, exp_avg_sq: C-contiguous,
writeable float32 arrays of one size; grad: float32, or uint16 holding bf16,
of that size (multiplied by grad_scale first, which must be finite and
>= 0: ValueError otherwise, before anything is written); bf16_out: a uint16
array that receives the new param rounded to bf16. No two may share memory.
Releases the GIL.)doc")
      .def_property(
          "lr", [](const AdamW& a) { return a.p_.lr; },
          [](AdamW& a, py::handle value) {
            const double lr = number_arg(value, "zinc.optim.AdamW", "lr");
            check_hyper("zinc.optim.AdamW", "lr", lr);
            a.p_.lr = lr;
          },
          "The learning rate of the next step (settable, for schedules).")
      .def_property_readonly("betas", [](const AdamW& a) { return std::make_pair(a.p_.beta1, a.p_.beta2); },
                             "(beta1, beta2).")
      .def_property_readonly("eps", [](const AdamW& a) { return a.p_.eps; }, "Added to the denominator.")
      .def_property_readonly("weight_decay", [](const AdamW& a) { return a.p_.weight_decay; }, "Weight decay.")
      .def_property_readonly("bias_correction", [](const AdamW& a) { return a.p_.bias_correction; },
                             "Whether the moments are bias-corrected.")
      .def_property_readonly("adamw_mode", [](const AdamW& a) { return a.p_.adam_w_mode; },
                             "True: decoupled decay (AdamW); False: L2 decay added to the gradient (Adam).");
  o.def("isa", [] { return std::string(zinc::optim::isa_name(zinc::optim::active_isa())); },
        "The kernel path the optimizer runs: scalar, avx2, avx512 or avx512_bf16.");
}

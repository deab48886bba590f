// zinc Python bindings: refusing an instance whose constructor never ran.
//
// Note [an instance made with __new__]
// Python can make an instance of a bound class without its constructor:
// Engine.__new__(Engine), zinc.optim.AdamW.__new__(AdamW). pybind11 then
// hands its methods a C++ object of uninitialised memory (allocated when
// first touched), so a property read garbage and a method crashed the
// process (a segfault, a failed mutex assertion, a hang). The classes made
// with `refuse_unconstructed()` look up their attributes through a check
// that the object was constructed, and raise TypeError naming the class
// otherwise. The dunder names Python's machinery looks up on an instance
// (its class, __init__, its docs) are let through. Python looks up special
// methods on the type (a with block's __enter__ and __exit__): those check
// with constructed_self. A method called unbound on such an instance
// (Engine.close(e)) is not looked up on the instance and is not covered.
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

namespace zinc::python {

namespace detail {
inline bool constructed(PyObject* self) {
  auto* inst = reinterpret_cast<pybind11::detail::instance*>(self);
  // A Python view of a C++ object the instance does not own (a property
  // returned by reference) has no holder: its object exists.
  if (!inst->owned) return true;
  for (const pybind11::detail::value_and_holder& vh : pybind11::detail::values_and_holders(inst))
    if (!vh.holder_constructed()) return false;
  return true;
}
extern "C" inline PyObject* constructed_getattro(PyObject* self, PyObject* name) {
  if (!constructed(self)) {
    const char* n = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
    for (const char* allowed : {"__class__", "__init__", "__doc__", "__module__", "__dict__", "__weakref__"})
      if (n && std::strcmp(n, allowed) == 0) return PyObject_GenericGetAttr(self, name);
    PyErr_Format(PyExc_TypeError,
                 "%s: this object was made by __new__ without its constructor, so it has no %s (make one as "
                 "the class's docs say)",
                 Py_TYPE(self)->tp_name, n ? n : "attributes");
    return nullptr;
  }
  return PyObject_GenericGetAttr(self, name);
}
}  // namespace detail

// The special methods Python looks up on the type, not through the
// instance's attributes (__enter__, __exit__), call this first.
template <class T>
T& constructed_self(pybind11::handle self) {
  if (!pybind11::isinstance<T>(self))
    throw pybind11::type_error(std::string("expected an instance of ") +
                               pybind11::type::of<T>().attr("__qualname__").template cast<std::string>() + ", got " +
                               Py_TYPE(self.ptr())->tp_name);
  if (!detail::constructed(self.ptr()))
    throw pybind11::type_error(std::string(Py_TYPE(self.ptr())->tp_name) +
                               ": this object was made by __new__ without its constructor (make one as the "
                               "class's docs say)");
  return self.cast<T&>();
}

// For py::class_<T>(..., refuse_unconstructed()).
inline pybind11::custom_type_setup refuse_unconstructed() {
  return pybind11::custom_type_setup(
      [](PyHeapTypeObject* heap) { heap->ht_type.tp_getattro = detail::constructed_getattro; });
}

}  // namespace zinc::python

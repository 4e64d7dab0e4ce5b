// The library as a CPython extension module (torchq._native) with one function, linear: the same
// call as the exported tq_linear (weight_abi.cpp) without ctypes' per-argument conversions
// (ctypes: 1.7 us per call with 7 arguments; this: about 0.1 us). torchq loads the same file with
// ctypes for everything else (torchq/backends/native_cpu/library.py), and checks that both see one
// tq_linear (linear_address) before it calls this. Built only where the compiler finds Python.h;
// without it the library is the plain C ABI and every call goes through ctypes.
#if defined(__has_include)
#if __has_include(<Python.h>)
#define TQ_HAVE_PYTHON 1
#endif
#endif

#ifdef TQ_HAVE_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "weight_abi.h"

extern "C" int tq_linear(const tq_weight* w, const void* x, int x_dtype, int64_t M, const float* bias, void* out, int threads);

namespace {

// An address argument: a Python int (None for the bias: null). Sets a Python error and returns
// false for anything else.
bool address(PyObject* arg, bool none_ok, void** out) {
  if (arg == Py_None && none_ok) {
    *out = nullptr;
    return true;
  }
  if (!PyLong_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "torchq._native.linear: expected an int address%s, got %s", none_ok ? " or None" : "",
                 Py_TYPE(arg)->tp_name);
    return false;
  }
  *out = PyLong_AsVoidPtr(arg);
  return !PyErr_Occurred();
}

// linear(weight, x, x_dtype, m, bias, out, threads) -> tq_linear's status. The caller (BoundLinear
// in library.py) passes addresses it has checked; the GIL is released while the kernel runs, as
// ctypes does.
PyObject* linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "torchq._native.linear: expected 7 arguments, got %zd", nargs);
    return nullptr;
  }
  void *w, *x, *bias, *out;
  if (!address(args[0], false, &w) || !address(args[1], false, &x) || !address(args[4], true, &bias) ||
      !address(args[5], false, &out))
    return nullptr;
  const long dtype = PyLong_AsLong(args[2]);
  const long long m = PyLong_AsLongLong(args[3]);
  const long threads = PyLong_AsLong(args[6]);
  if (PyErr_Occurred()) return nullptr;
  if (dtype < INT32_MIN || dtype > INT32_MAX || threads < INT32_MIN || threads > INT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "torchq._native.linear: x_dtype or threads out of int range");
    return nullptr;
  }
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = tq_linear(static_cast<const tq_weight*>(w), x, static_cast<int>(dtype), m, static_cast<const float*>(bias), out,
                     static_cast<int>(threads));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(status);
}

// The address of the tq_linear this module calls (to compare with the one ctypes found).
PyObject* linear_address(PyObject*, PyObject*) { return PyLong_FromVoidPtr(reinterpret_cast<void*>(&tq_linear)); }

PyMethodDef kMethods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&linear)), METH_FASTCALL,
     "linear(weight, x, x_dtype, m, bias, out, threads) -> status: tq_linear (csrc/weight_abi.cpp) on checked addresses"},
    {"linear_address", &linear_address, METH_NOARGS, "the address of the tq_linear that linear calls"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "torchq's native CPU kernels: the fast call of tq_linear", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
#endif

// pybind11 entry point of the cpu backend's native module (flashqla.backends.cpu._native).
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "flashqla cpu backend (C++17)";
#ifdef FLASHQLA_HAVE_OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}

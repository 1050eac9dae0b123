// Placeholder until the hostfunc issue lands: an importable module with no functions.
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_C, m) { m.doc() = "specdec hostfunc trampoline (stub)"; }

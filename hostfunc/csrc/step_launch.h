// hostfunc._C's launch_step (step_launch.cpp), registered on the module by hostfunc.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace hostfunc {
void register_step_launch(pybind11::module_& m);
}  // namespace hostfunc

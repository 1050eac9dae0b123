"""Capturable CUDA host callbacks (see csrc/hostfunc.cpp)."""

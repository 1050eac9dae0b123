"""Test support for hostfunc without a GPU: a fake libcuda.so.1 and a scenario that drives it."""

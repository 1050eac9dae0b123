"""GPU kernel benchmarks: GEMV/GEMM, attention, kernel boundaries, compiles and kernel traces."""

"""Matmuls of decode steps with few rows (the GEMV, the small-M tensor-core GEMM, the draft's GEMV + argmax) and
the CPU matmul extension."""

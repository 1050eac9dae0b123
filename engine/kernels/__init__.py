"""Triton kernels and their torch references: paged attention, fused norm/RoPE/SiLU ops, small-batch GEMV."""

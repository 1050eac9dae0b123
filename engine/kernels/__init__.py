"""Triton kernels and their torch references, by concept: attention/, matmul/, sampling/, speculative/; common.py and
fused_ops.py (norm, RoPE + KV store, SiLU * up) beside them, shared by all four."""

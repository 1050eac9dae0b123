"""Tensor parallelism: one model over N processes (one per GPU), Megatron-style (docs/tensor_parallel.md)."""

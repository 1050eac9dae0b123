"""Peers on our workload: transformers and vLLM, and the staging of vLLM for the GPU machine."""

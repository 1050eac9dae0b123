"""Attention over the paged KV cache: the kernels of decode, prefill and mixed steps, the merge of their KV
splits, the RoPE + KV store rows they fold in, and their argument checks."""

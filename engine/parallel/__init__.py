"""Tensor parallelism's primitives, Megatron-style (docs/tensor_parallel.md): the process group and its
collectives (group.py) and how the model's weights are split across ranks (sharding.py). Running the ranks as
processes is engine/workers/."""

"""What every Triton kernel module shares: the interpreter check and the two reductions.

tl.max and tl.sum are @jit functions of triton.language, compiled or interpreted as TRITON_INTERPRET was
when triton was first imported; ours follow it as it is when this module is (re)loaded. If the two disagree
(interpreter enabled after triton's import), the interpreter cannot call the compiled stdlib reductions:
reduce with local combiners instead (correct, but slow to interpret). A kernel module reloaded for the
interpreter must reload this one first (tests/conftest.py's triton_module does). Apart from these two
reductions, the kernels use only builtins.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_op(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_op(a, b):
    return a + b


def is_interpreted(fn) -> bool:
    """True when the @triton.jit function `fn` was built for the CPU interpreter."""
    return type(fn).__name__ == "InterpretedFunction"


_LOCAL_REDUCE = tl.constexpr(is_interpreted(_max_op) and not is_interpreted(tl.max))


@triton.jit
def reduce_max(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _max_op) if _LOCAL_REDUCE else tl.max(x, AXIS)


@triton.jit
def reduce_sum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _add_op) if _LOCAL_REDUCE else tl.sum(x, AXIS)

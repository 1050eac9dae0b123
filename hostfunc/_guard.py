"""Debug guard: make CUDA calls fail inside a host callback instead of deadlocking (docs/hostfunc.md).

In debug mode the trampoline calls ``run_guarded(fn, args, kwargs)`` instead of ``fn``. For the duration of
the callback, and on the callback's thread only, it installs

* a ``TorchDispatchMode`` that rejects every aten op with a CUDA tensor or a CUDA device among its
  arguments (``x.item()``, ``x.cpu()``, ``torch.zeros(n, device="cuda")``, kernel launches, ...);
* a ``sys.setprofile`` hook that rejects calls into ``torch/cuda/`` (``torch.cuda.synchronize``,
  ``current_stream``, ``Event.record`` / ``synchronize``, ...) and into the ``torch._C._cuda_*`` builtins.

Both raise ``HostfuncError("CUDA call inside a host callback: ...")`` before CUDA is reached. The first
violation is re-raised when the callback returns even if the callback swallowed it.
"""
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._errors import HostfuncError

_TORCH_CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.cuda.__file__)), "")
_ALLOWED_FILES = frozenset({os.path.join(_TORCH_CUDA_DIR, "nvtx.py")})  # NVTX ranges are not CUDA calls
_CUDA_BASES = tuple(
    cls for cls in (getattr(torch._C, "_CudaStreamBase", None), getattr(torch._C, "_CudaEventBase", None))
    if isinstance(cls, type)
)


def _is_cuda_builtin(fn):
    owner = getattr(fn, "__self__", None)
    if _CUDA_BASES and isinstance(owner, _CUDA_BASES):
        return True
    return owner is torch._C and getattr(fn, "__name__", "").startswith("_cuda")


def _touches(devices, tree):
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            kind = leaf.device.type
        elif isinstance(leaf, torch.device):
            kind = leaf.type
        else:
            continue
        if kind in devices:
            return True
    return False


class _Guard:
    """Per-callback state; only the callback's own thread touches it."""

    def __init__(self, devices):
        self.devices = frozenset(devices)
        self.violation = None

    def fail(self, what):
        message = f"CUDA call inside a host callback: {what}"
        if self.violation is None:
            self.violation = message
        raise HostfuncError(message)

    def profile(self, frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(_TORCH_CUDA_DIR) and path not in _ALLOWED_FILES:
                self.fail(f"torch.cuda ({frame.f_code.co_name} in {os.path.basename(path)})")
        elif event == "c_call" and _is_cuda_builtin(arg):
            self.fail(getattr(arg, "__qualname__", repr(arg)))


class _NoCudaMode(TorchDispatchMode):
    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _touches(self.guard.devices, (args, kwargs)):
            self.guard.fail(f"{func} on a {'/'.join(sorted(self.guard.devices))} tensor or device")
        return func(*args, **kwargs)


def run_guarded(fn, args, kwargs, devices=("cuda",)):
    """Call ``fn(*args, **kwargs)`` with CUDA calls forbidden on this thread (``devices`` is for tests)."""
    guard = _Guard(devices)
    previous = sys.getprofile()
    sys.setprofile(guard.profile)
    try:
        with _NoCudaMode(guard):
            result = fn(*args, **(kwargs or {}))
    finally:
        sys.setprofile(previous)
    if guard.violation is not None:
        raise HostfuncError(guard.violation + " (the callback caught the error, but it is still a bug)")
    return result

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
# Module bodies (lazy imports) and cached queries torch itself makes on CPU paths; whatever they call is not
# checked. Inside a callback CUDA is already initialised, so _lazy_init returns at once.
_ALLOWED_QUERIES = frozenset({"<module>", "_is_compiled", "is_available", "is_initialized", "_lazy_init",
                              "device_count"})
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
        self.allowed_frame = None  # the outermost running _ALLOWED_QUERIES frame, if any

    def fail(self, what):
        message = f"CUDA call inside a host callback: {what}"
        if self.violation is None:
            self.violation = message
        raise HostfuncError(message)

    def profile(self, frame, event, arg):
        if self.allowed_frame is not None:
            if event == "return" and frame is self.allowed_frame:
                self.allowed_frame = None
        elif event == "call":
            self._check_call(frame)
        elif event == "c_call" and _is_cuda_builtin(arg):
            self.fail(getattr(arg, "__qualname__", repr(arg)))

    def _check_call(self, frame):
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_CUDA_DIR) or path in _ALLOWED_FILES:
            return
        if frame.f_code.co_name in _ALLOWED_QUERIES:
            self.allowed_frame = frame
            return
        self.fail(f"torch.cuda ({frame.f_code.co_name} in {os.path.basename(path)})")


class _NoCudaMode(TorchDispatchMode):
    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _touches(self.guard.devices, (args, kwargs)):
            self.guard.fail(f"{func} on a {'/'.join(sorted(self.guard.devices))} tensor or device")
        return func(*args, **kwargs)


def warm_up():
    """Run the dispatch mode once unguarded: its first use imports torch._dynamo, which must not happen
    (slowly, and calling torch.cuda queries) inside the first guarded callback."""
    with _NoCudaMode(_Guard(())):
        torch.zeros(1).add_(1)


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

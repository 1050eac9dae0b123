"""Capturable CUDA host callbacks: Python functions that a CUDA graph can capture and replay.

``launch_hostfunc(stream, fn, *args, **kwargs)`` enqueues ``fn(*args, **kwargs)`` on a CUDA stream through
``cuLaunchHostFunc`` and a C trampoline (``csrc/hostfunc.cpp``). The packed ``(fn, args, kwargs)`` live in
a heap struct whose address is the returned integer handle:

* eager launch (stream not capturing): the trampoline releases the data right after the callback ran;
  the handle is only informative and must not be freed by hand;
* captured launch (``cuStreamIsCapturing`` says the stream is capturing): the data belongs to the graph
  and stays alive for every replay until ``free_hostfunc_user_data(handle)``, ``HostfuncScope.free()``
  or ``free_all_hostfunc_user_data()``. Free it only after the last replay has finished.

Errors raised by callbacks never crash the process: the trampoline records them (with traceback) and
``check_errors()`` / ``synchronize()`` raise ``HostfuncError`` on the calling thread.

Rules (breaking them deadlocks or corrupts the stream; see docs/hostfunc.md):

1. No CUDA call inside a callback: no kernels, copies, ``.item()``, syncs, ``torch.cuda.*``, and no
   ``launch_hostfunc``. ``set_debug(True)`` (or ``HOSTFUNC_DEBUG=1``) makes such calls raise.
2. No Python thread may hold the GIL while it blocks in CUDA on work queued behind a callback: the
   callback needs the GIL to run. Implicit syncs such as ``torch.zeros(x.max())``, ``.item()``,
   ``.tolist()`` of CUDA tensors hold the GIL, and so do kernels launched by torch.compile'd code.
   ``torch.cuda.synchronize()``, ``Stream.synchronize()``, ``Event.synchronize()`` and
   ``CUDAGraph.replay()`` release it and are safe.

Without libcuda or a GPU the package imports fine and launching raises ``RuntimeError`` saying why.
"""
import atexit
import functools
import os
import threading

import torch

from . import _C, _guard
from ._errors import HostfuncError

__all__ = [
    "HostfuncError", "HostfuncScope", "capture_scope", "check_errors", "free_all_hostfunc_user_data",
    "free_hostfunc_user_data", "hostfunc", "is_available", "is_debug", "launch_hostfunc", "live_handles",
    "set_debug", "stats", "synchronize",
]

_scopes = threading.local()  # per-thread stack of active HostfuncScope objects; callbacks never touch it


def _stream_handle(stream):
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"hostfunc: a raw stream handle must be >= 0, got {stream}")
        return stream
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream
    if stream is None:
        try:
            return torch.cuda.current_stream().cuda_stream
        except (AssertionError, RuntimeError) as exc:
            raise RuntimeError(f"hostfunc: no current CUDA stream to launch on ({exc}); host callbacks need an "
                               f"NVIDIA GPU and driver") from exc
    raise TypeError(f"hostfunc: stream must be a torch.cuda.Stream, an int handle or None, "
                    f"not {type(stream).__name__}")


def _active_scopes():
    stack = getattr(_scopes, "stack", None)
    if stack is None:
        stack = _scopes.stack = []
    return stack


def launch_hostfunc(stream, fn, *args, **kwargs):
    """Enqueue ``fn(*args, **kwargs)`` on ``stream`` (torch.cuda.Stream, raw int handle, or None for the
    current stream). Returns the integer handle of the packed data (see the module docstring)."""
    if not callable(fn):
        raise TypeError(f"hostfunc: fn must be callable, not {type(fn).__name__}")
    if _C.in_callback():
        raise HostfuncError("launch_hostfunc inside a host callback: callbacks must not call CUDA")
    handle, captured = _C.launch(_stream_handle(stream), fn, args, kwargs)
    if captured:
        stack = _active_scopes()
        if stack:
            stack[-1].handles.append(handle)
    return handle


def hostfunc(fn):
    """Decorator: ``f(*args, **kwargs)`` then launches ``fn`` on the current stream and returns the handle."""
    if not callable(fn):
        raise TypeError(f"hostfunc: fn must be callable, not {type(fn).__name__}")

    @functools.wraps(fn)
    def launcher(*args, **kwargs):
        return launch_hostfunc(None, fn, *args, **kwargs)

    return launcher


def free_hostfunc_user_data(handle):
    """Free a captured launch's data. KeyError: unknown or already freed; ValueError: eager handle."""
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"hostfunc: handle must be an int, not {type(handle).__name__}")
    if handle <= 0:
        raise KeyError(f"unknown hostfunc handle {handle}")
    _C.free(handle)


def free_all_hostfunc_user_data():
    """Free the data of every captured launch (all graphs); returns how many were freed. Pending eager
    launches are left to their trampolines."""
    return _C.free_all()


class HostfuncScope:
    """Collects the handles of callbacks captured on this thread while the scope is active::

        with hostfunc.capture_scope() as scope, torch.cuda.graph(g):
            ...
        ...  # replay g
        scope.free()  # once g will not be replayed again

    Scopes nest; a handle goes to the innermost one. ``free()`` frees what is left and returns the count.
    """

    def __init__(self):
        self.handles = []

    def __enter__(self):
        _active_scopes().append(self)
        return self

    def __exit__(self, *exc_info):
        stack = _active_scopes()
        if self in stack:
            stack.remove(self)
        return False

    def free(self):
        freed = 0
        while self.handles:
            free_hostfunc_user_data(self.handles[-1])
            self.handles.pop()
            freed += 1
        return freed


def capture_scope():
    """Shorthand for ``HostfuncScope()``."""
    return HostfuncScope()


def check_errors():
    """Raise ``HostfuncError`` with the first error recorded by callbacks since the last check (and clear)."""
    errors, dropped = _C.take_errors()
    if errors:
        more = len(errors) - 1 + dropped
        message = errors[0] + (f"\n({more} more callback error(s), see .errors)" if more else "")
        raise HostfuncError(message, errors, dropped)


def synchronize(target=None):
    """Wait for ``target`` (a torch.cuda.Stream or Event; None: the whole device) with the GIL released,
    then ``check_errors()``."""
    if _C.in_callback():
        raise HostfuncError("hostfunc.synchronize inside a host callback would deadlock")
    if target is None:
        torch.cuda.synchronize()
    elif isinstance(target, (torch.cuda.Stream, torch.cuda.Event)):
        target.synchronize()
    else:
        raise TypeError(f"hostfunc: cannot synchronize a {type(target).__name__}; pass a torch.cuda.Stream, "
                        f"a torch.cuda.Event or None")
    check_errors()


def set_debug(enabled):
    """Debug mode: callbacks run under a guard that makes CUDA calls raise HostfuncError."""
    if enabled:
        _guard.warm_up()
    _C.set_debug(bool(enabled))


def is_debug():
    return _C.debug()


def is_available():
    """True when host callbacks can be launched (libcuda loads and a GPU is present)."""
    return _C.driver_error() == ""


def live_handles():
    """Number of packed callbacks alive: captured ones plus eager ones not yet run."""
    return _C.stats()["live"]


def stats():
    """Dict with ``live``, ``captured``, ``pending_eager`` and ``errors`` counts."""
    return _C.stats()


_C.set_debug_runner(_guard.run_guarded)
set_debug(os.environ.get("HOSTFUNC_DEBUG", "0") not in ("", "0"))
atexit.register(_C.shutdown)  # later callbacks become no-ops instead of touching a finalising interpreter

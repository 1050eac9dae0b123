"""Capturable CUDA host callbacks: Python functions that a CUDA graph can capture and replay.

``launch_hostfunc(stream, fn, *args, **kwargs)`` enqueues ``fn(*args, **kwargs)`` on a CUDA stream through
``cuLaunchHostFunc`` and a C trampoline (``csrc/hostfunc.cpp``). The packed ``(fn, args, kwargs)`` are
registered under a fresh id from a counter that is never reused; the id is the returned integer handle and
the driver's user data, so a graph replayed after its data was freed runs nothing and records an error:

* eager launch (stream not capturing): the data is released once the callback ran (through the graveyard,
  below); the handle is only informative and must not be freed by hand;
* captured launch (``cuStreamIsCapturing`` says the stream is capturing): the data belongs to the graph
  and stays alive for every replay until ``free_hostfunc_user_data(handle)``, ``HostfuncScope.free()``
  or ``free_all_hostfunc_user_data()``. Free it only after the last replay has finished.

Errors raised by callbacks never crash the process: the trampoline records them (with traceback) as
``(owner, message)``, where the owner is the int tag of the innermost ``HostfuncScope(owner=N)`` active on
the launching thread (0: none); ``check_errors(owner)`` / ``synchronize()`` raise ``HostfuncError`` on the
calling thread, ``take_errors(owner)`` returns them.

The driver's callback thread never drops the last reference to a Python object (its destructor might call
CUDA there): what a callback leaves behind waits in a graveyard that ordinary threads release in
``launch_hostfunc``, the frees, ``take_errors``/``check_errors``, ``stats`` and ``collect()``.

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
import itertools
import os
import threading

import torch

from . import _C, _guard
from ._errors import HostfuncError

__all__ = [
    "HostfuncError", "HostfuncScope", "capture_scope", "check_errors", "collect", "free_all_hostfunc_user_data",
    "free_hostfunc_user_data", "hostfunc", "is_available", "is_debug", "launch_hostfunc", "launch_native",
    "live_handles", "new_owner", "owner_scope", "set_debug", "standing_callback", "stats", "synchronize",
    "take_errors",
]

_scopes = threading.local()  # per-thread stack of active HostfuncScope objects; callbacks never touch it
_owners = itertools.count(1 << 32)  # new_owner's tags, above the small ones callers pick by hand


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


def _check_owner(owner):
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"hostfunc: owner must be an int, not {type(owner).__name__}")
    if not 0 <= owner < 2**64:
        raise ValueError(f"hostfunc: owner must be in [0, 2**64), got {owner}")
    return owner


def _current_owner(stack):
    for scope in reversed(stack):
        if scope.owner is not None:
            return scope.owner
    return 0


def _not_in_callback(what):
    if _C.in_callback():
        raise HostfuncError(f"{what} inside a host callback: callbacks must not call CUDA or release CUDA objects")


def launch_hostfunc(stream, fn, *args, **kwargs):
    """Enqueue ``fn(*args, **kwargs)`` on ``stream`` (torch.cuda.Stream, raw int handle, or None for the
    current stream). Returns the integer handle (id) of the packed data (see the module docstring). The launch
    carries the owner of the innermost active ``HostfuncScope`` that has one."""
    if not callable(fn):
        raise TypeError(f"hostfunc: fn must be callable, not {type(fn).__name__}")
    _not_in_callback("launch_hostfunc")
    stack = _active_scopes()
    handle, captured = _C.launch(_stream_handle(stream), fn, args, kwargs, _current_owner(stack))
    collector = next((scope for scope in reversed(stack) if scope.collect), None)
    if captured and collector is not None:
        collector.handles.append(handle)
    return handle


def hostfunc(fn):
    """Decorator: ``f(*args, **kwargs)`` then launches ``fn`` on the current stream and returns the handle."""
    if not callable(fn):
        raise TypeError(f"hostfunc: fn must be callable, not {type(fn).__name__}")

    @functools.wraps(fn)
    def launcher(*args, **kwargs):
        return launch_hostfunc(None, fn, *args, **kwargs)

    return launcher


def launch_native(stream, fn_address, data_address):
    """Enqueue a native host function ``void fn(void* data)`` on ``stream``: it runs on the driver's thread
    with no Python and no GIL. The caller keeps ``data`` valid while any graph that captured the launch may
    replay. Returns whether the stream was capturing."""
    _not_in_callback("launch_native")
    return _C.launch_native(_stream_handle(stream), fn_address, data_address)


def standing_callback(fn, *args, **kwargs):
    """Register ``fn(*args, **kwargs)`` for native code to run: ``(handle, trampoline)``; calling the C
    function at address ``trampoline`` with ``handle`` as its argument takes the GIL and runs it, with the
    callbacks' rules and error records. Free it with ``free_hostfunc_user_data(handle)`` once no native
    code can call it any more."""
    if not callable(fn):
        raise TypeError(f"hostfunc: fn must be callable, not {type(fn).__name__}")
    handle = _C.register_standing(fn, args, kwargs, _current_owner(_active_scopes()))
    return handle, _C.trampoline_address()


def free_hostfunc_user_data(handle):
    """Free a captured launch's data. KeyError: unknown or already freed; ValueError: eager handle."""
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"hostfunc: handle must be an int, not {type(handle).__name__}")
    if handle <= 0:
        raise KeyError(f"unknown hostfunc handle {handle}")
    _not_in_callback("free_hostfunc_user_data")
    _C.free(handle)


def free_all_hostfunc_user_data():
    """Free the data of every captured launch (all graphs); returns how many were freed. Pending eager
    launches are left to their trampolines."""
    _not_in_callback("free_all_hostfunc_user_data")
    return _C.free_all()


def collect():
    """Release the references callbacks left in the graveyard (their destructors run on this thread);
    returns how many objects were released. Inside a callback it releases nothing and returns 0."""
    return _C.collect()


class HostfuncScope:
    """Collects the handles of callbacks captured on this thread while the scope is active::

        with hostfunc.capture_scope() as scope, torch.cuda.graph(g):
            ...
        ...  # replay g
        scope.free()  # once g will not be replayed again

    Scopes nest; a handle goes to the innermost one that collects (``collect=False``: an ``owner_scope``,
    which only tags). ``free()`` frees what is left and returns the count.

    ``owner`` (an int >= 0; 0 means none) tags every launch, eager or captured, made on this thread while the
    scope is active, so that its errors can be checked per owner (``check_errors(owner)``). The innermost
    scope whose owner is not None wins; ``owner=None`` (the default) inherits the enclosing one.
    """

    def __init__(self, owner=None, collect=True):
        self.owner = None if owner is None else _check_owner(owner)
        self.collect = collect
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


def capture_scope(owner=None):
    """Shorthand for ``HostfuncScope(owner)``."""
    return HostfuncScope(owner)


def owner_scope(owner):
    """Tag this thread's launches and standing callbacks with ``owner`` while active, and collect nothing:
    handles captured inside still go to the enclosing collecting scope (a graph's), which frees them."""
    return HostfuncScope(_check_owner(owner), collect=False)


def new_owner():
    """An owner tag no other call of this process gets: one per component whose errors are taken apart
    (an engine's grammar masks, say), so two of them in one process never take each other's."""
    return next(_owners)


def _owner_filter(owner):
    return None if owner is None else _check_owner(owner)


def check_errors(owner=None):
    """Raise ``HostfuncError`` with the first error recorded by callbacks of ``owner`` (None: any owner)
    since the last check, clearing those errors only. ``.errors`` and ``.owners`` list them all, ``.dropped``
    counts the ones the bounded log had to drop."""
    records, dropped = _C.take_errors(_owner_filter(owner))
    dropped = sum(count for _, count in dropped)
    if records or dropped:
        owners = [who for who, _ in records]
        errors = [message for _, message in records]
        if errors:
            more = len(errors) - 1 + dropped
            message = errors[0] + (f"\n({more} more callback error(s), see .errors)" if more else "")
        else:
            message = f"{dropped} host callback error(s) were dropped: the error log keeps {_C.MAX_ERRORS}"
        raise HostfuncError(message, errors, dropped, owners)


def take_errors(owner=None):
    """Return and clear the errors recorded by callbacks of ``owner`` (None: all owners) as a list of
    ``(owner, message)``, oldest first, without raising. Errors the bounded log dropped appear as one note
    per owner at the end (owner 0 for drops it could not attribute)."""
    records, dropped = _C.take_errors(_owner_filter(owner))
    notes = [(who or 0, f"{count} more host callback error(s) dropped: the error log keeps {_C.MAX_ERRORS}")
             for who, count in dropped]
    return [tuple(record) for record in records] + notes


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
    """Number of launched callbacks alive: captured ones plus eager ones not yet run (standing entries,
    which their owners free, are counted apart in ``stats()["standing"]``)."""
    return _C.stats()["live"]


def stats():
    """Release the graveyard, then return a dict of counts: ``live`` (= ``captured`` + ``pending_eager``),
    ``standing`` (registered by standing_callback), ``errors`` (recorded and dropped) and ``graveyard``
    (objects still waiting to be released)."""
    return _C.stats()


def _at_exit():
    _C.shutdown()  # later callbacks become no-ops instead of touching a finalising interpreter
    _C.collect()  # the interpreter is still whole while atexit handlers run


_C.set_debug_runner(_guard.run_guarded)
set_debug(os.environ.get("HOSTFUNC_DEBUG", "0") not in ("", "0"))
atexit.register(_at_exit)

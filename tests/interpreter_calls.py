"""Triton's CPU interpreter, without its redundant work on helper calls (tests only).

Under TRITON_INTERPRET=1 a kernel's launch (GridExecutor.__call__) patches the language modules its function sees
(triton.language, triton.language.core) for the interpreter, and restores them after the grid. A @triton.jit helper
called from inside the kernel (InterpretedFunction.__call__) patches the modules its own function sees, on every
call of every program, walking them with inspect.getmembers each time: about a quarter of an interpreted engine
test's time. Inside a launch, a helper whose modules the launch (or an earlier helper of it) has patched skips that
walk and does the rest as before; any other takes the interpreter's own path. Installed only where the interpreter
has the shape this was written against (triton 3.x); elsewhere nothing changes.
"""
from __future__ import annotations

import threading


def install() -> bool:
    """Returns whether helper calls now skip the redundant walk."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    launch, helper = getattr(it, "GridExecutor", None), getattr(it, "InterpretedFunction", None)
    if launch is None or helper is None or not hasattr(it, "_patch_lang") or not hasattr(helper, "rewrite"):
        return False
    if getattr(helper.__call__, "skips_patch", False):
        return True
    grid_call, helper_call, inside = launch.__call__, helper.__call__, threading.local()
    langs_of: dict = {}         # a jit function -> ids of the language modules its globals hold

    def langs(fn) -> frozenset:
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return found

    def launch_call(self, *args, **kwargs):
        outer = getattr(inside, "patched", None)
        inside.patched = set(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            inside.patched = outer

    def helper_call_inside(self, *args, **kwargs):
        patched = getattr(inside, "patched", None)
        needed = langs(self.fn)
        if patched is None or not needed <= patched:
            if patched is not None:
                patched |= needed
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:      # as the interpreter's own helper call reports it
            raise it.InterpreterError(repr(e)) from e

    helper_call_inside.skips_patch = True
    launch.__call__, helper.__call__ = launch_call, helper_call_inside
    return True

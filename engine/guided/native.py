"""The grammar node's binding to xgrammar (engine/guided/csrc/): the tvm-ffi method handles it calls.

xgrammar 0.2.8's GrammarMatcher is an apache-tvm-ffi object; its type info lists its methods as tvm-ffi
Function objects, callable through tvm-ffi's C API (`TVMFFIFunctionCall`) with no interpreter. The node gets
their handles and libtvm_ffi's path once per process; both are immutable after that. The closing search
(engine/guided/closing_search.py) calls a few more of them the same way. llguidance's rows hand the
node their native matcher instead (engine/guided/csrc/llg.h).
"""
from __future__ import annotations

import functools

import xgrammar as xgr
from tvm_ffi import libinfo

from engine.guided import _native
from engine.guided.llg import LLGMatcher

TARGET_NODE, DRAFT_NODE = _native.TARGET_NODE, _native.DRAFT_NODE
Node, RowState, NativeSnapshot, Registry = _native.Node, _native.RowState, _native.Snapshot, _native.Registry
registry_entries = _native.registry_entries
_METHODS = ("accept_token", "fill_next_token_bitmask", "rollback", "is_terminated")
_SEARCH_METHODS = ("accept_string", "find_jump_forward_string", "is_completed", "rollback")


def _handles(names: tuple, user: str) -> list[int]:
    """The tvm-ffi handles of these GrammarMatcher methods; RuntimeError naming `user` if xgrammar lacks one."""
    info = xgr.base._core.GrammarMatcher.__tvm_ffi_type_info__
    funcs = {m.name: m.func for m in info.methods if not m.is_static}
    missing = [name for name in names if name not in funcs]
    if missing:
        raise RuntimeError(f"xgrammar {xgr.__version__}'s GrammarMatcher lacks {', '.join(missing)}: "
                           f"{user} needs them")
    return [funcs[name].__chandle__() for name in names]


@functools.lru_cache(maxsize=None)
def matchers() -> _native.Matchers:
    """The method handles of xgrammar's GrammarMatcher, bound once per process."""
    return _native.matchers(libinfo.find_libtvm_ffi(), *_handles(_METHODS, "the grammar node"))


def closing_search(candidates: tuple, branches: tuple, closers: bytes, branch_points: int) -> _native.ClosingSearch:
    """The native closing search, bound with engine/guided/closing_search.py's constants (its caller keeps it)."""
    return _native.closing_search(libinfo.find_libtvm_ffi(), *_handles(_SEARCH_METHODS, "the closing search"),
                                  list(candidates), list(branches), closers, branch_points)


def llg_matcher(matcher):
    """The native matcher inside llguidance's own LLGMatcher; None for anything else (a wrapper around it runs
    its step on the Python path, as one around xgrammar's does)."""
    return matcher.native if type(matcher) is LLGMatcher else None


def handle(matcher) -> int:
    """The tvm-ffi object handle of xgrammar's own GrammarMatcher; 0 for anything else (a Python wrapper
    runs its step on the Python path)."""
    if type(matcher) is xgr.GrammarMatcher:
        return matcher._handle.__chandle__()
    return 0

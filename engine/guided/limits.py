"""Bounds on one guide, checked before it is compiled: what makes xgrammar's compile time or grammar explode.

An `enum`'s compile time grows much faster than its size, and a long repetition in a pattern runs long before
xgrammar gives up on it (docs/server.md, "Bounds on one request"). The real schemas under test (JSON Mode Eval,
BFCL, Glaive, GitHub: 4,269 schemas) reach at most 6.9 KB, an enum of 238, nesting 16 and a repetition of 255, so
the defaults leave them an order of magnitude of room. Each bound is an EngineConfig field and a serve flag.
"""
from __future__ import annotations

import json
import re

from engine.guided.guide import Guide

# {n}, {n,} and {n,m} in regexes, JSON Schema patterns and EBNF (xgrammar's EBNF repeats the same way)
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_PATTERN_KEYS = ("pattern",)


def check_guide(guide: Guide, max_bytes: int, max_enum: int, max_depth: int, max_repeat: int) -> None:
    """Raise ValueError naming the bound, the value found and where, if `guide` passes a bound."""
    size = len(guide.source.encode())
    if size > max_bytes:
        raise ValueError(f"{guide.kind} is {size} bytes; the limit is {max_bytes} (guide_max_bytes)")
    if guide.kind in ("json_schema", "structural_tag"):
        _check_json(json.loads(guide.source), guide.kind, "#", 0, (max_enum, max_depth, max_repeat))
    elif guide.kind == "choice":
        n = len(json.loads(guide.source))
        if n > max_enum:
            raise ValueError(f"choice has {n} options; the limit is {max_enum} (guide_max_enum)")
    elif guide.kind in ("regex", "ebnf"):
        _check_repeat(guide.source, guide.kind, max_repeat)


def _check_repeat(text: str, where: str, max_repeat: int) -> None:
    for low, high in _REPEAT.findall(text):
        n = max(int(low), int(high or 0))
        if n > max_repeat:
            raise ValueError(f"{where} repeats {{{low}{',' + high if high else ''}}} times; the limit is "
                             f"{max_repeat} (guide_max_repeat)")


def _check_json(node, kind: str, path: str, depth: int, bounds: tuple[int, int, int]) -> None:
    max_enum, max_depth, max_repeat = bounds
    if depth > max_depth:
        raise ValueError(f"{kind} nests deeper than {max_depth} at {path[:200]} (guide_max_depth)")
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_json(item, kind, f"{path}/{i}", depth + 1, bounds)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{key}"
        if key == "enum" and isinstance(value, list) and len(value) > max_enum:
            raise ValueError(f"{kind} has an enum of {len(value)} values at {where[:200]}; the limit is "
                             f"{max_enum} (guide_max_enum)")
        if key in _PATTERN_KEYS and isinstance(value, str):
            _check_repeat(value, f"{kind} pattern at {where[:200]}", max_repeat)
        if key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                _check_repeat(pattern, f"{kind} patternProperties key at {where[:200]}", max_repeat)
        if key == "regex" and isinstance(value, str) and kind == "structural_tag":
            _check_repeat(value, f"{kind} regex at {where[:200]}", max_repeat)
        _check_json(value, kind, where, depth + 1, bounds)


def timeout_message(guide, timeout_s: float) -> str:
    return (f"compiling the {guide.kind} took longer than {timeout_s:g} s (grammar_compile_timeout_s); "
            "it was abandoned")


_SCALARS = {"integer": 1, "number": 1, "boolean": 4, "null": 4}


def min_chars(schema, depth: int = 0) -> int:
    """A lower bound of the characters of any JSON instance of `schema` (compact): what minLength, minItems,
    minProperties and required properties force. 0 where it cannot tell ($ref, nesting past 64)."""
    if not isinstance(schema, dict) or "$ref" in schema or depth > 64:
        return 0
    own = 0
    for key, pick in (("allOf", max), ("anyOf", min), ("oneOf", min)):
        branches = [min_chars(b, depth + 1) for b in schema.get(key) or [] if isinstance(b, dict)]
        if branches:
            own = max(own, pick(branches))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return max(own, min(len(json.dumps(v, separators=(",", ":"))) for v in values))
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else _implied(schema)
    typed = [_typed_min(schema, k, depth) for k in kinds]
    return max(own, min(typed)) if typed else own


def _implied(schema: dict) -> list[str]:
    if {"properties", "required", "minProperties"} & set(schema):
        return ["object"]
    if {"items", "minItems"} & set(schema):
        return ["array"]
    return ["string"] if {"minLength", "pattern"} & set(schema) else []


def _typed_min(schema: dict, kind, depth: int) -> int:
    if kind == "string":
        return 2 + _count(schema.get("minLength"))
    if kind == "array":
        n, items = _count(schema.get("minItems")), schema.get("items")
        return 2 + n * max(1, min_chars(items, depth + 1)) + max(0, n - 1)
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        sizes = [len(json.dumps(k)) + 1 + max(1, min_chars(props.get(k), depth + 1)) for k in required]
        n = max(len(sizes), _count(schema.get("minProperties")))
        return 2 + sum(sizes) + 4 * (n - len(sizes)) + max(0, n - 1)   # a property is at least `"":0`
    return _SCALARS.get(kind, 0)


def _count(value) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0


def budget_problem(minimum: int | None, max_tokens: int, guide) -> str | None:
    """Why `max_tokens` cannot hold any whole output of `guide` (its shortest takes `minimum`), or None."""
    if minimum is None or max_tokens >= minimum:
        return None
    return (f"max_tokens={max_tokens} cannot hold any complete output of this {guide.kind}: the shortest takes "
            f"{minimum} tokens (set max_tokens >= {minimum}, or close_at_budget=false to accept a cut output)")

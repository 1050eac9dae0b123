"""The intersection of JSON schemas (`allOf`) as one schema that accepts exactly the same instances.

`merge` takes branches already rewritten (engine/guided/schema_rewrite.py) and returns one schema, or raises
`Inexpressible` (the caller leaves the `allOf` as it was, for the keyword check to refuse) or `Conflict` (no
instance can match: the request is refused with the path and the reason). Keywords fall into groups whose
meaning depends only on each other (`additionalProperties` on `properties` and `patternProperties`, `then` on
`if`); a group found in one branch only is carried over verbatim, which is exact because groups are
independent. Groups in several branches are merged only where this module knows the exact intersection.
"""
from __future__ import annotations

import json
import math
from typing import Callable, NamedTuple

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "deprecated", "readOnly",
               "writeOnly", "$defs", "definitions", "$anchor", "$id", "id"}
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT = ("properties", "additionalProperties", "patternProperties")
_GROUPS = (("if", "then", "else"), ("contains", "minContains", "maxContains"),
           ("items", "prefixItems", "additionalItems"))
_NEVER = ("unevaluatedProperties", "unevaluatedItems", "allOf", "$ref", "$dynamicRef", "$recursiveRef")
_TYPE_OF = {bool: "boolean", str: "string", type(None): "null", list: "array", dict: "object"}


class Inexpressible(Exception):
    """The intersection exists but this module cannot write it exactly."""


class Conflict(ValueError):
    """No instance matches every branch; the message is 'path: reason'."""


class Hooks(NamedTuple):
    resolve: Callable       # branch -> the branch with a local `$ref` replaced by its target (or Inexpressible)
    finish: Callable        # (merged schema, path) -> the schema simplified


def merge(branches: list, path: str, hooks: Hooks) -> dict:
    """The schema that accepts what every branch accepts (annotations from the first branch having them)."""
    parts = []
    for b in branches:
        b = hooks.resolve(b)
        if b is False:
            raise Conflict(f"{path}: a branch is `false`, which nothing matches")
        if b is not True and b != {}:
            if not isinstance(b, dict):
                raise Inexpressible
            parts.append(b)
    if any(k in b for b in parts for k in _NEVER):
        raise Inexpressible
    return hooks.finish(_merge(parts, path, hooks), path)


def _merge(parts: list, path: str, hooks) -> dict:
    out: dict = {}
    for b in parts:
        for k, v in b.items():
            if k in ANNOTATIONS and k not in out:
                out[k] = v
    if len(parts) == 1:
        return dict(parts[0])
    choice = [b for b in parts if "anyOf" in b or "oneOf" in b]
    if len(choice) == 1:
        return _distribute(parts, choice[0], out, path, hooks)
    if choice:
        raise Inexpressible
    types = _types(parts, path)
    if types is not None:
        out["type"] = types[0] if len(types) == 1 else types
    _constants(parts, types, out, path)
    _bounds(parts, types, out, path)
    _objects(parts, out, path, hooks)
    _rest(parts, out, path, hooks)
    return out


def _distribute(parts, chooser, out, path, hooks) -> dict:
    """allOf[R, {anyOf: [X...]}] = anyOf[allOf[R, X]...] (and the same for oneOf: exactly one X matches with R
    exactly when exactly one allOf[R, X] does). A branch that conflicts with R matches nothing: dropped."""
    key = "anyOf" if "anyOf" in chooser else "oneOf"
    if "anyOf" in chooser and "oneOf" in chooser:
        raise Inexpressible
    rest = [{k: v for k, v in b.items() if k != key} if b is chooser else b for b in parts]
    rest = [b for b in rest if any(k not in ANNOTATIONS for k in b)]
    merged_rest = _merge(rest, path, hooks) if rest else {}
    kept = []
    for i, x in enumerate(chooser[key]):
        try:
            kept.append(merge([merged_rest, x], f"{path}/{key}/{i}", hooks))
        except Conflict:
            continue
    if not kept:
        raise Conflict(f"{path}: no branch of its `{key}` can match the rest of the schema")
    return {**{k: v for k, v in out.items() if k in ANNOTATIONS}, key: kept}


def _types(parts, path) -> list | None:
    found = None
    for b in parts:
        if "type" not in b:
            continue
        t = b["type"] if isinstance(b["type"], list) else [b["type"]]
        found = t if found is None else _meet(found, t)
        if not found:
            raise Conflict(f"{path}: the branches' types have nothing in common")
    return found


def _meet(a: list, b: list) -> list:
    """Types in both lists, in a's order (an integer is a number)."""
    def has(ts, t):
        return t in ts or (t == "integer" and "number" in ts)
    out = [t for t in a if has(b, t)] + [t for t in b if t == "integer" and "number" in a and t not in a]
    return list(dict.fromkeys(out))


def canon(value):
    """Equal JSON values compare equal (1 == 1.0; true is not 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [canon(v) for v in value]
    if isinstance(value, dict):
        return {k: canon(v) for k, v in value.items()}
    return value


def key(value) -> str:
    return json.dumps(canon(value), sort_keys=True)


def type_of(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "integer" if float(value).is_integer() else "number"
    return _TYPE_OF.get(type(value), "?")


def _constants(parts, types, out, path) -> None:
    sets = [[b["const"]] if "const" in b else b["enum"] for b in parts if "const" in b or "enum" in b]
    if not sets:
        return
    if not all(isinstance(s, list) for s in sets):
        raise Inexpressible
    keep = sets[0]
    for s in sets[1:]:
        keys = {key(v) for v in s}
        keep = [v for v in keep if key(v) in keys]
    if types is not None:
        keep = [v for v in keep if type_of(v) in types or (type_of(v) == "integer" and "number" in types)]
    if not keep:
        raise Conflict(f"{path}: no value is allowed by every branch's `enum`/`const` and type")
    if len(keep) == 1 and any("const" in b for b in parts):
        out["const"] = keep[0]
    else:
        out["enum"] = keep


def _bounds(parts, types, out, path) -> None:
    numeric = [b for b in parts if any(k in b for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))]
    if len(numeric) > 1 and any(isinstance(b.get(k), bool) for b in numeric
                                for k in ("exclusiveMinimum", "exclusiveMaximum")):
        raise Inexpressible         # draft-04 booleans modify their sibling: merge only numbers
    for k in _LOWER + _UPPER:
        vals = [b[k] for b in parts if k in b]
        if vals:
            if not all(isinstance(v, (int, float)) for v in vals):
                raise Inexpressible
            out[k] = max(vals) if k in _LOWER else min(vals)
    for lo, hi, kind in (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
                         ("minProperties", "maxProperties", "object"), ("minimum", "maximum", "number")):
        only = types is not None and all(t in (kind, "integer" if kind == "number" else kind) for t in types)
        if only and lo in out and hi in out and out[lo] > out[hi]:
            raise Conflict(f"{path}: `{lo}` {out[lo]} is above `{hi}` {out[hi]}")
    _multiple(parts, out)


def _multiple(parts, out) -> None:
    vals = list(dict.fromkeys(b["multipleOf"] for b in parts if "multipleOf" in b))
    if len(vals) > 1 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vals):
        vals = [math.lcm(*vals)]
    if len(vals) > 1:
        raise Inexpressible
    if vals:
        out["multipleOf"] = vals[0]


def _objects(parts, out, path, hooks) -> None:
    required = [n for b in parts for n in (b.get("required") or []) if isinstance(b.get("required"), list)]
    if any("required" in b and not isinstance(b["required"], list) for b in parts):
        raise Inexpressible
    if required:
        out["required"] = list(dict.fromkeys(required))
    shaping = [b for b in parts if any(k in b for k in _OBJECT)]
    if len(shaping) == 1:
        out.update({k: shaping[0][k] for k in _OBJECT if k in shaping[0]})
        return
    if not shaping:
        return
    extra = [_extra(b) for b in shaping]
    if any("patternProperties" in b for b in shaping) and any(e is not None for e in extra):
        raise Inexpressible         # which keys a pattern matches decides where additionalProperties applies
    _patterns(shaping, out, path, hooks)
    names = list(dict.fromkeys(n for b in shaping for n in (b.get("properties") or {})))
    extras = [e for e in extra if e is not None]
    merged_extra = _sub([e for e in extras], f"{path}/additionalProperties", hooks) if extras else None
    props = {}
    for n in names:
        subs = [(b.get("properties") or {}).get(n, e) for b, e in zip(shaping, extra)]
        sub = _sub([s for s in subs if s is not None], f"{path}/properties/{n}", hooks)
        if sub is False:
            if n in out.get("required", ()):
                raise Conflict(f"{path}: required property {n!r} is not allowed by every branch")
            if merged_extra is not False:
                raise Inexpressible     # xgrammar compiles no `false` property: only an unlisted key is barred
            continue
        props[n] = sub
    out["properties"] = props
    if merged_extra is not None:
        out["additionalProperties"] = merged_extra


def _extra(b):
    """A branch's additionalProperties as a constraint, None when it allows anything."""
    e = b.get("additionalProperties", True)
    return None if e is True or e == {} else e


def _sub(subs: list, path: str, hooks):
    """The intersection of property schemas: False if one is `false`; an `allOf` left for the check to refuse
    where it cannot be written exactly."""
    subs = [s for s in subs if s is not True and s != {}]
    if any(s is False for s in subs):
        return False
    if len(subs) <= 1:
        return subs[0] if subs else {}
    try:
        return merge(subs, path, hooks)
    except Inexpressible:
        return {"allOf": subs}


def _patterns(shaping, out, path, hooks) -> None:
    found: dict = {}
    for b in shaping:
        for pattern, sub in (b.get("patternProperties") or {}).items():
            found.setdefault(pattern, []).append(sub)
    if found:
        out["patternProperties"] = {p: _sub(s, f"{path}/patternProperties/{p}", hooks) for p, s in found.items()}


def _rest(parts, out, path, hooks) -> None:
    """Keywords not merged above: carried when one branch has them or all that have them agree."""
    done = set(out) | {"type", "enum", "const", "required", "multipleOf", *_LOWER, *_UPPER, *_OBJECT}
    grouped = {k for g in _GROUPS for k in g}
    for group in _GROUPS:
        _group(parts, group, out, path, hooks)
    for k in dict.fromkeys(k for b in parts for k in b):
        if k in done or k in grouped or k.startswith("x-"):
            continue
        vals = list(dict.fromkeys(key(b[k]) for b in parts if k in b))
        if k == "uniqueItems":
            out[k] = any(b.get(k) is True for b in parts)
        elif len(vals) == 1:
            out[k] = next(b[k] for b in parts if k in b)
        else:
            raise Inexpressible


def _group(parts, group, out, path, hooks) -> None:
    having = [{k: b[k] for k in group if k in b} for b in parts if any(k in b for k in group)]
    if not having:
        return
    if len({key(h) for h in having}) == 1:
        out.update(having[0])
    elif all(set(h) == {"items"} and isinstance(h["items"], (dict, bool)) for h in having):
        out["items"] = _sub([h["items"] for h in having], f"{path}/items", hooks)
        if out["items"] is False:
            out["maxItems"] = 0         # an empty array still matches `items: false`
            del out["items"]
    else:
        raise Inexpressible

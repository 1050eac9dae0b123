"""Property-presence constraints rewritten into `anyOf` branches that say which properties are present and
which are absent, for the llguidance backend (engine/guided/llg.py), which does not implement them.

A constraint on which properties an object has is a boolean formula over "p is present". These keywords are
such formulas, and are rewritten exactly (same instances):

- `dependentRequired` / `dependencies` with a list: `{a: [b, c]}` is "a absent, or a, b and c present";
- `dependentSchemas` / `dependencies` with a schema S: "a absent, or a present and S" (S kept as an `allOf`);
- `not: {required: [...]}`: "one of them absent";
- a `oneOf` whose branches say only which properties are required (or absent, or `not` required): "branch i
  and no other branch" for some i.

The formula is expanded into disjunctive normal form; each term becomes a branch
`{"required": [present...], "properties": {absent: false...}, "allOf": [schemas...]}` of an `anyOf` beside the
object's own keywords. A formula that expands past MAX_TERMS terms, or negates a term holding a schema, is
left as written (the backend then refuses it, naming the keyword).
"""
from __future__ import annotations

import itertools
import json

MAX_TERMS = 64
_NOTES = {"description", "title", "$comment"}
_DATA = ("enum", "const", "default", "examples", "required")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
TRUE = [(frozenset(), frozenset(), ())]     # one term with no condition: always holds


class _Unsupported(Exception):
    """The formula is not expressible here (a schema under negation, or too many terms)."""


def rewrite_presence(node):
    """`node` (a schema, not modified) with its presence constraints as `anyOf` branches."""
    if isinstance(node, list):
        return [rewrite_presence(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA:
            out[key] = value
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rewrite_presence(sub) for name, sub in value.items()}
        else:
            out[key] = rewrite_presence(value)
    return _node(out)


def _node(node: dict) -> dict:
    # `required` holds vacuously for a value that is not an object, so `not` and `oneOf` of presence are exact
    # only where the node admits objects alone; a dependency holds vacuously either way
    keys = ("dependentRequired", "dependencies", "dependentSchemas") + (
        ("not", "oneOf") if node.get("type") == "object" else ())
    pieces = {k: node[k] for k in keys if k in node}
    formula, used = TRUE, []
    for key, value in pieces.items():
        try:
            part = _keyword(key, value)
            formula = _and(formula, part)
        except _Unsupported:
            continue
        used.append(key)
    if not used or not formula:        # nothing rewritten, or nothing can match: left for the backend to refuse
        return node
    out = {k: v for k, v in node.items() if k not in used}
    if formula == TRUE:
        return out
    branches = [_branch(t) for t in formula]
    if "anyOf" in out:
        out["allOf"] = list(out.get("allOf", [])) + [{"anyOf": branches}]
    else:
        out["anyOf"] = branches
    return out


def _keyword(key: str, value) -> list:
    if key == "not":
        return _not(_presence(value))
    if key == "oneOf":
        if not isinstance(value, list) or not value:
            raise _Unsupported
        forms = [_presence(b) for b in value]
        terms = []
        for i, form in enumerate(forms):
            others = [_not(f) for j, f in enumerate(forms) if j != i]
            terms += _and_all([form] + others)
        return _cap(terms)
    if not isinstance(value, dict):
        raise _Unsupported
    formula = TRUE
    for name, dep in value.items():
        formula = _and(formula, _dependency(key, name, dep))
    return formula


def _dependency(key: str, name: str, dep) -> list:
    absent = (frozenset(), frozenset([name]), ())
    if isinstance(dep, list) and key != "dependentSchemas" and all(isinstance(d, str) for d in dep):
        return [absent, (frozenset([name, *dep]), frozenset(), ())]
    if dep is True or dep == {}:
        return TRUE
    if dep is False:
        return [absent]
    if isinstance(dep, dict) and key != "dependentRequired":
        try:
            return [absent] + _and([(frozenset([name]), frozenset(), ())], _presence(dep))
        except _Unsupported:
            return [absent, (frozenset([name]), frozenset(), (dep,))]
    raise _Unsupported


def _presence(branch) -> list:
    """The formula of a schema that only says which properties are present or absent."""
    if not isinstance(branch, dict) or not set(branch) <= {"required", "properties", "not"} | _NOTES:
        raise _Unsupported
    required = branch.get("required", [])
    props = branch.get("properties", {})
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _Unsupported
    if not isinstance(props, dict) or not all(v is False for v in props.values()):
        raise _Unsupported
    formula = [(frozenset(required), frozenset(props), ())]
    if "not" in branch:
        formula = _and(formula, _not(_presence(branch["not"])))
    return formula


def _not(formula: list) -> list:
    """not (t1 or t2 ...) = (not t1) and (not t2) ...; not (P present and A absent) = some p absent or some a
    present."""
    result = TRUE
    for present, absent, schemas in formula:
        if schemas:
            raise _Unsupported
        negated = [(frozenset(), frozenset([p]), ()) for p in sorted(present)]
        negated += [(frozenset([a]), frozenset(), ()) for a in sorted(absent)]
        result = _and(result, negated)          # an empty `negated` (a term that always holds) gives []
    return result


def _and(x: list, y: list) -> list:
    terms = []
    for (p1, a1, s1), (p2, a2, s2) in itertools.product(x, y):
        present, absent = p1 | p2, a1 | a2
        if not present & absent:
            terms.append((present, absent, s1 + s2))
    return _cap(terms)


def _and_all(formulas: list) -> list:
    result = TRUE
    for f in formulas:
        result = _and(result, f)
    return result


def _cap(terms: list) -> list:
    unique = list({(p, a, json.dumps(s, sort_keys=True)): (p, a, s) for p, a, s in terms}.values())
    if len(unique) > MAX_TERMS:
        raise _Unsupported
    return unique


def _branch(term) -> dict:
    present, absent, schemas = term
    out: dict = {}
    if present:
        out["required"] = sorted(present)
    if absent:
        out["properties"] = {name: False for name in sorted(absent)}
    if schemas:
        out["allOf"] = list(schemas)
    return out

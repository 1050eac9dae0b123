"""JSON Schema keywords the grammar compiler accepts but does not enforce, found before a request is taken.

xgrammar compiles a schema with `not`, `if`/`then`/`else`, `dependentSchemas`, `uniqueItems`, `contains`,
`allOf` of several parts, an overlapping `oneOf`, a `required` name missing from `properties`, string lengths
beside a `pattern` or `format`, `multipleOf` on a number, an anchor inside a pattern, keywords beside a `$ref`,
`enum` values of another `type` or a type's keywords where no `type` is named, but its grammar ignores them (or,
for `oneOf`, falls back to `anyOf`): the output would parse yet could fail the schema. A guided request must be
able to promise a valid output, so such a schema is refused with the keyword and where it is
(tests/guided/test_guided_schema_check.py checks each keyword here against the compiler: if xgrammar starts enforcing
one, that test says so).
"""
from __future__ import annotations

import json

# keyword -> why it is refused (each one measured: xgrammar 0.2 accepts an instance that violates it)
UNENFORCED = {
    "not": "`not` is ignored",
    "if": "`if`/`then`/`else` are ignored",
    "dependentSchemas": "`dependentSchemas` is ignored",
    "dependentRequired": "`dependentRequired` is ignored",
    "dependencies": "`dependencies` is ignored",
    "contains": "`contains` is ignored",
}
_ANNOTATIONS = {"$ref", "title", "description", "default", "examples", "$comment", "definitions", "$defs", "$schema",
                "$id", "id"}
# keywords of one JSON type, which xgrammar enforces only where the schema names a type
_TYPED = ("pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
          "minItems", "maxItems", "minProperties", "maxProperties")
_TYPE_GIVERS = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")     # values, not schemas: not walked


def unenforced_keywords(schema) -> list[str]:
    """Where `schema` (a dict) uses what the grammar cannot enforce, as 'path: reason' strings."""
    found: list[str] = []
    _walk(schema, "#", schema, found)
    return found


def _walk(node, path: str, root, found: list) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{path}/{i}", root, found)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in UNENFORCED:
            found.append(f"{where}: {UNENFORCED[key]}")
        elif key == "uniqueItems" and value is True:
            found.append(f"{where}: `uniqueItems` is ignored")
        elif key == "allOf" and isinstance(value, list) and len(value) > 1:
            found.append(f"{where}: `allOf` of {len(value)} schemas is not intersected")
        elif key == "oneOf" and isinstance(value, list) and not _disjoint(value, root):
            found.append(f"{where}: `oneOf` branches that may overlap are treated as `anyOf`")
        elif key == "required" and isinstance(value, list):
            declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = [n for n in value if isinstance(n, str) and n not in declared]
            if missing:
                found.append(f"{where}: required {', '.join(map(repr, missing[:3]))} not in `properties` "
                             "cannot be required")
        if key in _DATA:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{where}/{name}", root, found)
        else:
            _walk(value, where, root, found)
    _dropped_keywords(node, path, found)


def _dropped_keywords(node: dict, path: str, found: list) -> None:
    """What xgrammar's converter drops from one schema node: string lengths beside a pattern or format,
    `multipleOf` unless the type is integer, a type's keywords on a schema that names no type, `enum` values of
    another type, anchors inside a pattern (not at its ends or those of an alternative), keywords beside a
    `$ref`."""
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    shaped = [k for k in ("pattern", "format") if isinstance(node.get(k), str)]
    if lengths and shaped:
        found.append(f"{path}/{lengths[0]}: `{'`/`'.join(lengths)}` beside `{shaped[0]}` is ignored")
    if "multipleOf" in node and node.get("type") != "integer":
        found.append(f"{path}/multipleOf: `multipleOf` is ignored unless the type is integer")
    if not any(k in node for k in _TYPE_GIVERS):
        untyped = [k for k in _TYPED if k in node]
        if untyped:
            found.append(f"{path}/{untyped[0]}: `{untyped[0]}` on a schema without `type` is ignored (name the type "
                         "it is for)")
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if types and isinstance(node.get("enum"), list) and not all(_json_type(v) & types for v in node["enum"]):
        found.append(f"{path}/enum: `enum` values outside `type` are still allowed")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _inner_anchor(pattern):
        found.append(f"{path}/pattern: a `^` or `$` inside the pattern is ignored")
    beside = sorted(set(node) - _ANNOTATIONS) if isinstance(node.get("$ref"), str) else []
    if beside:
        found.append(f"{path}/$ref: {', '.join(f'`{k}`' for k in beside[:3])} beside `$ref` are ignored "
                     "(xgrammar follows the reference alone)")


def _json_type(value) -> set:
    """The JSON Schema types a value has (an integral number is both integer and number)."""
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    return {float: {"number"}, str: {"string"}, type(None): {"null"}, list: {"array"},
            dict: {"object"}}.get(type(value), set())


def _inner_anchor(pattern: str) -> bool:
    """`pattern` has a `^` not at its start or an alternative's (groups opening before it aside), or a `$` not
    at its end or an alternative's (groups closing after it aside): one a full match cannot honour."""
    tokens, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            tokens.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            tokens.append("[")              # a class, whatever it holds (its `^` negates)
        elif pattern.startswith("(?:", i):
            tokens.append("(")
            i += 3
            continue
        else:
            tokens.append(c)
        i += 1
    for j, t in enumerate(tokens):
        if t == "^":
            k = j - 1
            while k >= 0 and tokens[k] == "(":
                k -= 1
            if k >= 0 and tokens[k] != "|":
                return True
        elif t == "$":
            k = j + 1
            while k < len(tokens) and tokens[k] == ")":
                k += 1
            if k < len(tokens) and tokens[k] != "|":
                return True
    return False


def _resolve(branch, root):
    """A local `$ref` ('#/...') to what it names; anything else as it is."""
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#"):
        return branch
    node = root
    for part in ref[1:].split("/")[1:]:
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else branch


def _disjoint(branches: list, root) -> bool:
    """True when no JSON value can match two branches, by a check simple enough to trust: distinct single
    types (integer and number overlap), distinct constants, or objects told apart by a required property
    with distinct constant values (a tagged union)."""
    resolved = [_resolve(b, root) for b in branches]
    if len(resolved) < 2:
        return True
    if not all(isinstance(b, dict) for b in resolved):
        return False
    return _by_type(resolved) or _by_constants(resolved) or _by_tag(resolved)


def _by_type(branches) -> bool:
    types = [b.get("type") for b in branches]
    if not all(isinstance(t, str) for t in types):
        return False
    kinds = ["number" if t == "integer" else t for t in types]
    return len(set(kinds)) == len(kinds)


def _constants(branch) -> set | None:
    if "const" in branch:
        return {json.dumps(branch["const"], sort_keys=True)}
    if isinstance(branch.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in branch["enum"]}
    return None


def _pairwise_disjoint(sets) -> bool:
    seen: set = set()
    for s in sets:
        if s is None or seen & s:
            return False
        seen |= s
    return True


def _by_constants(branches) -> bool:
    return _pairwise_disjoint([_constants(b) for b in branches])


def _by_tag(branches) -> bool:
    required = [set(b.get("required") or ()) for b in branches]
    for tag in set.intersection(*required):
        values = [_constants(b.get("properties", {}).get(tag) or {}) for b in branches]
        if _pairwise_disjoint(values):
            return True
    return False

"""JSON schemas rewritten, before the keyword check and the compile, into schemas that accept exactly the same
instances and that xgrammar enforces in full.

xgrammar ignores `allOf` of several schemas, and every keyword beside an `anyOf`/`oneOf` (a schema
`{"type": "object", "required": ["a"], "anyOf": [...]}` loses its `required`). So:
- `allOf` is merged into one schema (engine/guided/schema_merge.py), its local `$ref` branches resolved first;
- the siblings of an `anyOf`/`oneOf` are merged into each of its branches;
- a `oneOf` whose branches no value can match two of becomes an `anyOf`;
- a name in `required` missing from `properties` gets the schema `additionalProperties` gives it there;
- empty `dependencies` are dropped, and a dependency of an always-present property becomes `required`;
- a `type` list of one is a string.
What cannot be written exactly is left as it was, so engine/guided/schema_check.py still refuses it with its
reason; a contradiction (nothing could match where something must) raises ValueError naming the path.

A `$ref` is resolved only inside what is merged, only when local ('#/...'), without sibling keywords, and not
while resolving itself (a recursive schema keeps its references). A node holding what some `$ref` points into
(other than its `$defs`/`definitions`) is not rewritten, so every reference keeps its meaning.
"""
from __future__ import annotations

from engine.guided.schema_merge import ANNOTATIONS, Conflict, Hooks, Inexpressible, canon, key, merge, type_of

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SINGLE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_KEPT_UNDER = ("$defs", "definitions")
MAX_MERGES = 2000       # merges per schema: inlining references can multiply work, this bounds it


def rewrite_schema(schema: dict) -> dict:
    """A new schema equivalent to `schema` (which is not modified). Raises ValueError('path: reason')."""
    ctx = _Context(schema)
    return _node(schema, "#", ctx, ())


class _Context:
    """One rewrite's root, the places references point to, and its merge budget."""

    def __init__(self, root):
        self.root = root
        self.targets = set()
        _collect_refs(root, self.targets)
        self.merges = 0

    def resolve(self, ref: str):
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return None
        return node

    def pinned(self, path: str) -> bool:
        """Whether some reference points inside this node, other than into its $defs/definitions."""
        prefix = path + "/"
        return any(t.startswith(prefix) and t[len(prefix):].split("/")[0] not in _KEPT_UNDER
                   for t in self.targets)


def _collect_refs(node, out: set) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out.add("#" + ref[1:].rstrip("/") if ref != "#" else "#")
        for v in node.values():
            _collect_refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _collect_refs(v, out)


def _pointer(path: str, name) -> str:
    return f"{path}/{str(name).replace('~', '~0').replace('/', '~1')}"


def _node(node, path: str, ctx: _Context, resolving: tuple):
    if not isinstance(node, dict):
        return node
    out = _children(node, path, ctx, resolving)
    if ctx.pinned(path):
        return _simplify(out, path, pinned=True)
    _fold_active_dependencies(out)
    try:
        if isinstance(out.get("allOf"), list):
            out = _combined(out, "allOf", path, ctx, resolving)
        elif _chooser(out) and any(k not in ANNOTATIONS and k != _chooser(out) for k in out):
            out = _combined(out, _chooser(out), path, ctx, resolving)
    except Inexpressible:
        pass
    return _simplify(out, path)


def _chooser(node) -> str | None:
    found = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    return found[0] if len(found) == 1 else None


def _children(node: dict, path: str, ctx, resolving) -> dict:
    out = {}
    for k, v in node.items():
        where = _pointer(path, k)
        if k in _MAPS and isinstance(v, dict):
            out[k] = {n: _node(s, _pointer(where, n), ctx, resolving) for n, s in v.items()}
        elif k in _LISTS and isinstance(v, list):
            out[k] = [_node(s, f"{where}/{i}", ctx, resolving) for i, s in enumerate(v)]
        elif k == "items" and isinstance(v, list):
            out[k] = [_node(s, f"{where}/{i}", ctx, resolving) for i, s in enumerate(v)]
        elif k in _SINGLE:
            out[k] = _node(v, where, ctx, resolving)
        else:
            out[k] = v
    return out


def _combined(node: dict, keyword: str, path: str, ctx, resolving) -> dict:
    """The node as one merged schema: its own keywords are one more branch of its allOf (or the rest of the
    schema beside its anyOf/oneOf). Its $defs/definitions stay where they are."""
    kept = {k: node[k] for k in _KEPT_UNDER if k in node}
    own = {k: v for k, v in node.items() if k not in kept and k != keyword}
    if keyword == "allOf":
        branches = [own, *node["allOf"]]
    else:
        branches = [own, {keyword: node[keyword]}]
    ctx.merges += 1
    if ctx.merges > MAX_MERGES:
        raise Inexpressible
    hooks = Hooks(lambda b: _resolved(b, path, ctx, resolving), _simplify)
    return {**kept, **merge(branches, _pointer(path, keyword) if keyword == "allOf" else path, hooks)}


def _resolved(branch, path: str, ctx: _Context, resolving: tuple):
    """A branch with its local `$ref` replaced by the rewritten target; a reference to where it is used from
    (or to one being resolved) is recursive and stays."""
    seen = resolving
    while isinstance(branch, dict) and "$ref" in branch:
        ref = branch["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#") or ref in seen or (path + "/").startswith(ref + "/"):
            raise Inexpressible
        if any(k != "$ref" and k not in ANNOTATIONS for k in branch):
            raise Inexpressible         # beside a $ref, drafts disagree on whether siblings apply
        target = ctx.resolve(ref)
        if target is None or (isinstance(target, dict) and ("$id" in target or "id" in target)):
            raise Inexpressible
        seen = (*seen, ref)
        branch = _node(target, ref, ctx, seen)
    return branch


def _simplify(node: dict, path: str, pinned: bool = False) -> dict:
    """Node-level rewrites that move no subschema (a pinned node, one a reference points into, gets only
    those that keep every path)."""
    out = dict(node)
    if isinstance(out.get("type"), list):
        types = list(dict.fromkeys(out["type"]))
        out["type"] = types[0] if len(types) == 1 else types
    _required_properties(out, path)
    if pinned:
        return out
    _dependencies(out)
    if _chooser(out) == "oneOf" and disjoint(out["oneOf"]):
        out["anyOf"] = out.pop("oneOf")
    return out


def _fold_active_dependencies(node: dict) -> None:
    """A schema dependency (`dependencies` / `dependentSchemas`) of a name the node requires always applies:
    one more `allOf` branch, so the merge can intersect it (a `oneOf` in it then gets the node's `required`
    in each branch, which may prove it disjoint)."""
    required = set(_names(node.get("required")))
    for keyword in ("dependencies", "dependentSchemas"):
        deps = node.get(keyword)
        if not isinstance(deps, dict):
            continue
        active = [n for n, dep in deps.items() if n in required and isinstance(dep, dict)]
        if not active:
            continue
        node["allOf"] = [*(node.get("allOf") if isinstance(node.get("allOf"), list) else []),
                         *(deps[n] for n in active)]
        rest = {n: dep for n, dep in deps.items() if n not in active}
        if rest:
            node[keyword] = rest
        else:
            del node[keyword]


def _dependencies(node: dict) -> None:
    for keyword in ("dependencies", "dependentRequired"):
        if isinstance(node.get(keyword), dict):
            _dependency(node, keyword)


def _dependency(node: dict, keyword: str) -> None:
    """Drop empty dependencies; a property dependency of an always-present name is plain `required`."""
    deps = node[keyword]
    required = node.get("required") if isinstance(node.get("required"), list) else []
    rest, needed = {}, list(required)
    for name, dep in deps.items():
        if dep == [] or dep is True or dep == {}:
            continue
        if name in required and isinstance(dep, list) and all(isinstance(d, str) for d in dep):
            needed += dep
        else:
            rest[name] = dep
    if len(needed) > len(required):
        node["required"] = list(dict.fromkeys(needed))
    if rest:
        node[keyword] = rest
    else:
        del node[keyword]


def _required_properties(node: dict, path: str) -> None:
    """A required name missing from `properties` is given the schema that `additionalProperties` applies
    to it (any value when there is none); xgrammar cannot require a name it does not list."""
    required = node.get("required")
    if not isinstance(required, list) or "patternProperties" in node or "unevaluatedProperties" in node:
        return
    props = node.get("properties", {})
    if not isinstance(props, dict):
        return
    missing = [n for n in required if isinstance(n, str) and n not in props]
    if not missing:
        return
    extra = node.get("additionalProperties", True)
    if extra is False:
        if node.get("type") == "object":
            raise Conflict(f"{path}/required: {missing[0]!r} is required but `additionalProperties` is false "
                           "and it is not in `properties`")
        return
    node["properties"] = {**props, **{n: ({} if extra is True else extra) for n in missing}}


def disjoint(branches: list) -> bool:
    """True when no value can match two of `branches`, each pair told apart by type, by constants, or by a
    property both require with constants that differ (a tagged union)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    return all(_apart(a, b) for i, a in enumerate(branches) for b in branches[i + 1:])


def _apart(a: dict, b: dict) -> bool:
    ta, tb = _type_set(a), _type_set(b)
    if ta is not None and tb is not None and not _overlap(ta, tb):
        return True
    ca, cb = _const_keys(a), _const_keys(b)
    if ca is not None and cb is not None and not ca & cb:
        return True
    for tag in set(_names(a.get("required"))) & set(_names(b.get("required"))):
        pa, pb = (_const_keys((x.get("properties") or {}).get(tag)) for x in (a, b))
        if pa is not None and pb is not None and not pa & pb:
            return True
    return False


def _type_set(s: dict) -> set | None:
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    consts = _const_values(s)
    return {type_of(v) for v in consts} if consts is not None else None


def _overlap(a: set, b: set) -> bool:
    widen = lambda s: s | ({"integer"} if "number" in s else set())     # noqa: E731
    return bool(widen(a) & widen(b))


def _const_values(s) -> list | None:
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return [canon(s["const"])]
    return s["enum"] if isinstance(s.get("enum"), list) else None


def _const_keys(s) -> set | None:
    values = _const_values(s)
    return None if values is None else {key(v) for v in values}


def _names(required) -> list:
    return [n for n in required if isinstance(n, str)] if isinstance(required, list) else []

"""What a request asks its output to match: one guide, validated and normalised when SamplingParams is built.

A `Guide` is a hashable description (kind, canonical source text, whitespace option, backend): the compiler's
cache key, and what a future compile is run from. The backend is chosen here: xgrammar for every guide it
enforces, llguidance for a JSON schema it would refuse and llguidance validates (engine/guided/llg.py), or the
one a request names (`guided_backend`). Checks here are the ones that need no tokenizer (types,
JSON syntax, exactly one guide, schema keywords the grammar would ignore once the schema is rewritten into an
equivalent one it enforces: engine/guided/schema_rewrite.py, engine/guided/schema_check.py);
what only the grammar compiler can tell (an unsupported schema feature,
a bad regex) fails the request when it compiles (engine/guided/compiler.py).
"""
from __future__ import annotations

import functools
import json
from typing import NamedTuple

from engine.guided.schema_check import unenforced_keywords
from engine.guided.schema_rewrite import rewrite_schema

GUIDE_FIELDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")
BACKENDS = ("auto", "xgrammar", "llguidance")
LLGUIDANCE_KINDS = ("json_schema", "json_object", "regex", "choice")
SCHEMA_CACHE = 256      # schema texts whose check a process remembers


class Guide(NamedTuple):
    kind: str               # one of GUIDE_FIELDS
    source: str             # JSON text (json_schema, structural_tag), regex, EBNF, or a JSON list (choice)
    any_whitespace: bool    # JSON guides: allow free whitespace between tokens (default: compact)
    backend: str = "xgrammar"   # the grammar backend that runs it, chosen when it is made: xgrammar or llguidance

    def describe(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind} {text}"


def _json_text(name: str, value, want: type) -> str:
    """A dict or its JSON text -> JSON text (keys in their given order)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, want) or isinstance(value, bool):
        raise ValueError(f"{name} must be a JSON {want.__name__} (or its text), got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False)     # key order kept: it is the output's order
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} cannot be written as JSON: {exc}") from exc


def _text(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _choice(value) -> str:
    items = value if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(c, str) and c for c in items):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {value!r}")
    return json.dumps(list(items), ensure_ascii=False)


def grammar_schema(schema: dict, name: str = "json_schema") -> dict:
    """The schema a grammar is compiled from: `schema` rewritten into an equivalent one the grammar enforces
    (engine/guided/schema_rewrite.py), then checked. Raises ValueError naming `name`, the path and the reason.
    The guide keeps the original text: outputs are promised to match it, and compiling rewrites it again
    (a pure function of the text)."""
    rewritten = _rewritten(schema, name)
    unenforced = unenforced_keywords(rewritten)
    if unenforced:
        raise ValueError(f"{name} uses what guided decoding cannot enforce, so an output could violate it: "
                         + "; ".join(unenforced[:3])
                         + (f" (and {len(unenforced) - 3} more)" if len(unenforced) > 3 else ""))
    return rewritten


def _rewritten(schema: dict, name: str = "json_schema") -> dict:
    """`schema` rewritten (engine/guided/schema_rewrite.py); a contradiction or runaway nesting is a ValueError
    naming `name`."""
    try:
        return rewrite_schema(schema)
    except RecursionError as exc:
        raise ValueError(f"{name} nests too deeply to check") from exc
    except ValueError as exc:
        raise ValueError(f"{name} can match nothing: {exc}") from exc


def _schema_backend(schema: dict, backend: str, any_whitespace: bool) -> str:
    """The backend that runs a JSON schema: xgrammar when it enforces the schema (after the rewrite), else
    llguidance when that validates it. Raises ValueError naming the problem when the asked backend (or, for
    auto, neither) can enforce it."""
    if backend == "llguidance":
        _llguidance_check(schema, any_whitespace, None)
        return backend
    try:
        grammar_schema(schema)
        return "xgrammar"
    except ValueError as exc:
        if backend == "xgrammar" or "can match nothing" in str(exc) or "nests too deeply" in str(exc):
            raise
        _llguidance_check(schema, any_whitespace, exc)
        return "llguidance"


@functools.lru_cache(maxsize=SCHEMA_CACHE)
def _text_backend(text: str, backend: str, any_whitespace: bool) -> str:
    """_schema_backend of a schema's JSON text. Agents send the same few schemas again and again, and the check
    rewrites each (a pure function of the text): each text is checked once. A refusal raises and is not kept."""
    return _schema_backend(json.loads(text), backend, any_whitespace)


def _llguidance_check(schema: dict, any_whitespace: bool, xgrammar_refusal: ValueError | None) -> None:
    from engine.guided import llg      # loaded on the first schema that needs it
    if xgrammar_refusal is None:        # (auto: grammar_schema has rewritten it already, without a contradiction)
        _rewritten(schema)              # finds contradictions (llguidance compiles the schema as given)
    why = llg.refusal(schema, any_whitespace)
    if why is None:
        return
    if xgrammar_refusal is None:
        raise ValueError(f"json_schema cannot be enforced by llguidance: {why}")
    raise ValueError(f"{xgrammar_refusal}; llguidance cannot enforce it either: {why}. Remove or rewrite that "
                     "keyword (e.g. list the allowed values with `enum` instead of `not`, make `oneOf` branches "
                     "exclusive with a distinct `const`)") from xgrammar_refusal


def _source(kind: str, value, backend: str, any_whitespace: bool) -> tuple[str, str]:
    """(the guide's source text, the backend that runs it)."""
    if backend == "llguidance" and kind not in LLGUIDANCE_KINDS:
        raise ValueError(f"guided_backend='llguidance' runs {', '.join(LLGUIDANCE_KINDS)}; {kind} runs on xgrammar")
    chosen = "xgrammar" if backend == "auto" else backend
    if kind == "json_schema":
        text = _json_text(kind, value, dict)
        return text, _text_backend(text, backend, any_whitespace)
    if kind == "structural_tag":
        return _json_text(kind, value, dict), chosen
    if kind == "json_object":
        return '{"type": "object"}', chosen
    if kind == "choice":
        return _choice(value), chosen
    return _text(kind, value), chosen


def make_guide(fields: dict, any_whitespace, backend: str = "auto") -> Guide | None:
    """fields: GUIDE_FIELDS -> value (None / False: not asked); backend: one of BACKENDS. Raises ValueError for a
    bad or double guide, or a backend that cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"guided_backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if not isinstance(any_whitespace, bool):
        raise ValueError(f"any_whitespace must be a bool, got {any_whitespace!r}")
    if not isinstance(fields["json_object"], bool):
        raise ValueError(f"json_object must be a bool, got {fields['json_object']!r}")
    asked = [k for k in GUIDE_FIELDS if fields[k] is not None and fields[k] is not False]
    if len(asked) > 1:
        raise ValueError(f"give at most one guide, got {', '.join(asked)}")
    if not asked:
        return None
    kind = asked[0]
    source, chosen = _source(kind, fields[kind], backend, any_whitespace)
    return Guide(kind, source, any_whitespace, chosen)

"""What a request asks its output to match: one guide, validated and normalised when SamplingParams is built.

`Guide.key` is a hashable description (kind, canonical source text, whitespace option): the compiler's
cache key, and what a future compile is run from. Checks here are the ones that need no tokenizer (types,
JSON syntax, exactly one guide, schema keywords the grammar would ignore once the schema is rewritten into an
equivalent one it enforces: engine/guided/schema_rewrite.py, engine/guided/schema_check.py);
what only the grammar compiler can tell (an unsupported schema feature,
a bad regex) fails the request when it compiles (engine/guided/compiler.py).
"""
from __future__ import annotations

import json
from typing import NamedTuple

from engine.guided.schema_check import unenforced_keywords
from engine.guided.schema_rewrite import rewrite_schema

GUIDE_FIELDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")


class Guide(NamedTuple):
    kind: str               # one of GUIDE_FIELDS
    source: str             # JSON text (json_schema, structural_tag), regex, EBNF, or a JSON list (choice)
    any_whitespace: bool    # JSON guides: allow free whitespace between tokens (default: compact)

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
    try:
        rewritten = rewrite_schema(schema)
    except RecursionError as exc:
        raise ValueError(f"{name} nests too deeply to check") from exc
    except ValueError as exc:
        raise ValueError(f"{name} can match nothing: {exc}") from exc
    unenforced = unenforced_keywords(rewritten)
    if unenforced:
        raise ValueError(f"{name} uses what guided decoding cannot enforce, so an output could violate it: "
                         + "; ".join(unenforced[:3]) + (f" (and {len(unenforced) - 3} more)" if len(unenforced) > 3 else ""))
    return rewritten


def _source(kind: str, value) -> str:
    if kind == "json_schema":
        text = _json_text(kind, value, dict)
        grammar_schema(json.loads(text))
        return text
    if kind == "structural_tag":
        return _json_text(kind, value, dict)
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "choice":
        return _choice(value)
    return _text(kind, value)


def make_guide(fields: dict, any_whitespace) -> Guide | None:
    """fields: GUIDE_FIELDS -> value (None / False: not asked). Raises ValueError for a bad or double guide."""
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
    return Guide(kind, _source(kind, fields[kind]), any_whitespace)

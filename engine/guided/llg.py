"""The llguidance backend: JSON schemas xgrammar compiles but cannot enforce, run by llguidance's matcher.

A schema goes here when the keyword check refuses it for xgrammar (engine/guided/schema_check.py) and
llguidance validates it (`refusal`), or when a request asks for `guided_backend="llguidance"`. llguidance
enforces `patternProperties`, `allOf` of schemas it cannot merge (two patterns), `oneOf` whose branches it
proves disjoint, and (after engine/guided/schema_presence.py rewrites them) `dependencies`,
`dependentRequired`, `dependentSchemas`, `not: {required}` and a `oneOf` of required-property groups. It
refuses what it does not implement (`not` of anything else, overlapping `oneOf`, `if`/`then`/`else`,
`uniqueItems`, `contains`, `unevaluatedProperties`): such a schema is refused up front, naming the keyword.

Objects without `additionalProperties` are closed (as xgrammar's strict mode does), where closing cannot
drop what a sibling `allOf` or an object branch adds. The llguidance package turns a guide into its grammar
and validates it; its matchers run in native code through llguidance's C API (engine/guided/csrc/llg.h), so
the grammar node fills llguidance rows' masks without the GIL, as it does xgrammar's. `LLGMatcher` gives that
matcher xgrammar's Python interface for the Python path (engine/guided/matching.py); the bitmask layout is
xgrammar's (32-bit words, bit t % 32 of word t // 32).
"""
from __future__ import annotations

import functools
import json

import llguidance as llg
import numpy as np
import torch

from engine.guided import _native
from engine.guided.schema_presence import rewrite_presence

KINDS = ("json_schema", "json_object", "regex", "choice")     # guide kinds this backend compiles
MATCHER_BYTES = 1 << 20     # what the service's cache counts per compiled grammar (llguidance does not say)
SPECIAL = b"\xff"          # llguidance's mark of a special token's bytes
_COMBINATORS = ("allOf", "$ref", "unevaluatedProperties", "patternProperties", "dependentSchemas")


def options(any_whitespace: bool) -> dict:
    """The JSON layout xgrammar uses: compact `, ` and `: `, or free whitespace."""
    if any_whitespace:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def prepare(schema):
    """The schema llguidance compiles: presence constraints rewritten, objects closed (same or fewer instances)."""
    return _close(rewrite_presence(schema))


def _adds_nothing(branch, declared) -> bool:
    """The branch constrains only properties in `declared` (its parent's): closing the parent drops nothing
    the branch allows."""
    if not isinstance(branch, dict) or not set(branch) <= {"required", "properties", "allOf", "description", "title"}:
        return False
    props = branch.get("properties", {})
    return isinstance(props, dict) and set(props) <= declared and \
        all(_adds_nothing(b, declared) for b in branch.get("allOf", []))


_OBJECT_KEYS = ("properties", "required", "patternProperties", "additionalProperties")


def _close(node, closable: bool = True):
    """Close objects (no properties beyond their own) where that keeps every property something may need:
    not an `allOf` branch (the intersection's properties are the union), not a branch beside its parent's own
    properties, not a parent of branches that add properties."""
    if isinstance(node, list):
        return [_close(item) for item in node]
    if not isinstance(node, dict):
        return node
    bare = not any(k in node for k in _OBJECT_KEYS)    # its branches may close: they need nothing of it
    out = {}
    for k, v in node.items():
        if k in ("enum", "const", "default", "examples", "required"):
            out[k] = v
        elif k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {n: _close(sub) for n, sub in v.items()}
        elif k in ("anyOf", "oneOf", "allOf") and isinstance(v, list):
            out[k] = [_close(b, bare and k != "allOf") for b in v]
        else:
            out[k] = _close(v)
    branches = [b for k in ("anyOf", "oneOf") for b in (out.get(k) or [])]
    declared = set(out.get("properties") or ())
    if closable and (out.get("type") == "object" or isinstance(out.get("properties"), dict)) and \
            "additionalProperties" not in out and not any(k in out for k in _COMBINATORS) and \
            all(_adds_nothing(b, declared) for b in branches):
        out["additionalProperties"] = False
    return out


def schema_grammar(schema, any_whitespace: bool) -> str:
    return llg.LLMatcher.grammar_from_json_schema(prepare(schema), defaults=options(any_whitespace))


def refusal(schema, any_whitespace: bool = False) -> str | None:
    """Why llguidance cannot enforce `schema` (None: it can). No tokenizer needed."""
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(schema_grammar(schema, any_whitespace))
    except (ValueError, RecursionError) as exc:
        return str(exc)
    return messages[0] if is_error else None


def guide_grammar(guide) -> str:
    """An llguidance grammar for `guide` (kind in KINDS). A schema is compiled as given (llguidance intersects
    `allOf` and applies keywords beside `anyOf` itself), after `prepare`."""
    kind, source, ws = guide.kind, guide.source, guide.any_whitespace
    if kind in ("json_schema", "json_object"):
        return schema_grammar(json.loads(source), ws)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(source))
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    raise ValueError(f"the llguidance backend runs {', '.join(KINDS)}, not {kind}")


def vocab_bytes(hf_tokenizer, info) -> list[bytes]:
    """Each token's bytes as xgrammar decodes them (`info`: its TokenizerInfo); special tokens (added special
    tokens, and ids past the tokenizer's vocabulary: the model's padding) get their name after a 0xFF byte,
    llguidance's mark for a token that never matches text. llguidance's own reading of a HF tokenizer's JSON is
    not used: it depends on how that JSON was written (a GGUF tokenizer converted by some transformers versions
    declares byte fallback beside its byte-level decoder, and llguidance then kept 'Ġ' as text)."""
    tokens = [bytes(b) for b in info.decoded_vocab]     # (the property builds the whole list each time)
    for i, added in hf_tokenizer.added_tokens_decoder.items():
        if added.special and i < len(tokens):
            tokens[i] = SPECIAL + added.content.encode()
    return [t if t else SPECIAL + f"<[{i}]>".encode() for i, t in enumerate(tokens)]


def tokenizer(hf_tokenizer, info, eos_ids) -> _native.LlgTokenizer:
    """llguidance's tokenizer in native code over xgrammar's reading of the vocabulary (the same bytes for
    every token); `eos_ids` end the output."""
    return _native.LlgTokenizer(api(), vocab_bytes(hf_tokenizer, info), sorted(eos_ids))


@functools.lru_cache(maxsize=None)
def api() -> _native.LlgApi:
    """llguidance's C API, resolved in its Python extension once per process."""
    return _native.llg_api(llg._lib.__file__)


class LLGrammar:
    """A compiled llguidance grammar: a matcher at its start (native), copied for each request."""

    def __init__(self, tok: _native.LlgTokenizer, grammar: str):
        self.template = _native.LlgGrammar(tok, grammar)       # a grammar llguidance refuses: ValueError
        self.memory_size_bytes = MATCHER_BYTES + len(grammar)

    def matcher(self) -> LLGMatcher:
        return LLGMatcher(self.template.matcher())


class LLGMatcher:
    """llguidance's native row matcher (engine/guided/csrc/llg.h: xgrammar's GrammarMatcher semantics, the stop
    token tracked beside llguidance) with xgrammar's Python interface, for the Python grammar path; the grammar
    node calls the same object (`native`) without Python. Callback thread only, like every matcher."""

    def __init__(self, matcher: _native.LlgMatcher):
        self.native = matcher

    def accept_token(self, token: int) -> bool:
        return self.native.accept_token(token)

    def is_terminated(self) -> bool:
        return self.native.is_terminated()

    def rollback(self, n: int) -> None:
        self.native.rollback(n)

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        """Row `index` of a host int32 bitmask (torch or numpy), in xgrammar's layout."""
        if isinstance(bitmask, torch.Tensor):
            row = bitmask[index]
            if row.dtype != torch.int32 or not row.is_cpu or not row.is_contiguous():
                raise ValueError("the bitmask must be a contiguous int32 tensor on the host")
            self.native.fill(row.data_ptr(), row.numel())
        else:
            row = np.asarray(bitmask)[index]
            if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
                raise ValueError("the bitmask must be a contiguous int32 array")
            self.native.fill(row.ctypes.data, row.size)

    def find_jump_forward_string(self) -> str:
        """'' (no forced drafts): llguidance computes forced tokens only with a canonical tokenize function,
        and the native tokenizer has none (it would be Python's, under the GIL)."""
        return ""

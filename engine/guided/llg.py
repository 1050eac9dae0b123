"""The llguidance backend: JSON schemas xgrammar compiles but cannot enforce, run by llguidance's LLMatcher.

A schema goes here when the keyword check refuses it for xgrammar (engine/guided/schema_check.py) and
llguidance validates it (`refusal`), or when a request asks for `guided_backend="llguidance"`. llguidance
enforces `patternProperties`, `allOf` of schemas it cannot merge (two patterns), `oneOf` whose branches it
proves disjoint, and (after engine/guided/schema_presence.py rewrites them) `dependencies`,
`dependentRequired`, `dependentSchemas`, `not: {required}` and a `oneOf` of required-property groups. It
refuses what it does not implement (`not` of anything else, overlapping `oneOf`, `if`/`then`/`else`,
`uniqueItems`, `contains`, `unevaluatedProperties`): such a schema is refused up front, naming the keyword.

Objects without `additionalProperties` are closed (as xgrammar's strict mode does), where closing cannot
drop what a sibling `allOf` or an object branch adds. `LLGMatcher` gives an LLMatcher xgrammar's matcher
interface, so the engine's Python path runs it (engine/guided/matching.py); its bitmask layout is
xgrammar's (32-bit words, bit t % 32 of word t // 32).
"""
from __future__ import annotations

import json

import llguidance as llg
import llguidance.hf
import numpy as np
import torch

from engine.guided.schema_presence import rewrite_presence

KINDS = ("json_schema", "json_object", "regex", "choice")     # guide kinds this backend compiles
MATCHER_BYTES = 1 << 20     # what the service's cache counts per compiled grammar (llguidance does not say)
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


def tokenizer(hf_tokenizer, vocab_size: int, eos_ids) -> llg.LLTokenizer:
    """llguidance's tokenizer: the HF tokenizer's special tokens never appear inside text; `eos_ids` end it."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))


class LLGrammar:
    """A compiled llguidance grammar: a matcher at its start, copied for each request."""

    def __init__(self, tok: llg.LLTokenizer, grammar: str, eos_ids):
        self.template = llg.LLMatcher(tok, grammar, log_level=0)
        if self.template.is_error():
            raise ValueError(f"llguidance: {self.template.get_error()}")
        self.eos_ids = frozenset(eos_ids)
        self.memory_size_bytes = MATCHER_BYTES + len(grammar)

    def matcher(self) -> LLGMatcher:
        return LLGMatcher(self.template.deep_copy(), self.eos_ids)


class LLGMatcher:
    """An LLMatcher with xgrammar's GrammarMatcher interface and semantics: a rejected token leaves the state
    as it was (llguidance would enter its error state for good), and the matcher terminates once it accepts a
    stop token where the grammar may end. The stop token is not fed to llguidance: rolling it back only clears
    `_ended`. Callback thread only, like every matcher."""

    def __init__(self, matcher: llg.LLMatcher, eos_ids):
        self._m, self._eos, self._ended = matcher, eos_ids, False

    def _check(self) -> None:
        if self._m.is_error():
            raise RuntimeError(f"llguidance: {self._m.get_error()}")

    def accept_token(self, token: int) -> bool:
        self._check()
        if self._ended:
            return False
        if token in self._eos:
            self._ended = self._m.is_accepting()
            return self._ended
        ok = self._m.try_consume_tokens([token]) == 1
        self._check()
        return ok

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, n: int) -> None:
        if n > 0 and self._ended:
            self._ended, n = False, n - 1
        if n > 0 and not self._m.rollback(n):
            self._check()
            raise RuntimeError(f"llguidance could not roll back {n} tokens")

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        """What llguidance.torch / llguidance.numpy's fill_next_token_bitmask do (without importing
        llguidance.torch, which loads torch._dynamo): the row's words computed in place."""
        if isinstance(bitmask, torch.Tensor):
            row = bitmask[index]
            if row.dtype != torch.int32 or not row.is_cpu or not row.is_contiguous():
                raise ValueError("the bitmask must be a contiguous int32 tensor on the host")
            address, size = row.data_ptr(), row.numel() * 4
        else:
            row = np.asarray(bitmask)[index]
            if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
                raise ValueError("the bitmask must be a contiguous int32 array")
            address, size = row.ctypes.data, row.size * 4
        self._m.unsafe_compute_mask_ptr(address, size)
        self._check()

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next ('' when none, or when it does not end on a character)."""
        try:
            return self._m.compute_ff_bytes().decode("utf-8")
        except UnicodeDecodeError:
            return ""

"""OpenAI request fields -> one SamplingParams per choice (`n`), guides included, and the notes a response
carries about what it did not do as asked (ignored fields, a max_tokens larger than the context)."""
from __future__ import annotations

import dataclasses
import math

from engine.guided.guide import BACKENDS
from engine.requests.sequence import SamplingParams
from engine.server.openai.protocol import APIError


def response_format_guide(fmt) -> dict:
    """`response_format` -> SamplingParams guide fields ({} for plain text)."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        return {"json_schema": schema}
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


_VLLM_GUIDES = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "ebnf", "structural_tag": "structural_tag"}
_VLLM_BACKENDS = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "llguidance", "llguidance": "llguidance"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
               "json_object": "json_object", "structural_tag": "structural_tag"}


def vllm_guide(req) -> dict:
    """vLLM's guide fields -> SamplingParams guide fields ({} when none). `structured_outputs` is vLLM's current
    form ({"json": ...} and the like); the `guided_*` fields its older one."""
    found = {_VLLM_GUIDES[k]: getattr(req, k) for k in _VLLM_GUIDES if getattr(req, k) is not None}
    if req.structured_outputs is not None:
        for key, value in req.structured_outputs.items():
            if key not in _STRUCTURED:
                raise APIError(f"structured_outputs.{key} is not supported; use one of {', '.join(_STRUCTURED)}",
                               param=f"structured_outputs.{key}")
            if value is not None and value is not False:
                found[_STRUCTURED[key]] = value
    if len(found) > 1:
        raise APIError(f"give at most one guide, got {', '.join(found)}", param="structured_outputs")
    return found


def sampling_params(req, max_tokens: int | None, room: int, guide: dict, tokenizer=None) -> list[SamplingParams]:
    """`room`: context left after the prompt (the default max_tokens: as OpenAI, up to the context)."""
    bad = req.unsupported()
    if bad:
        raise APIError(f"{bad[0]} is not supported by this server", param=bad[0])
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs is not available with stream", param="prompt_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = req.logit_bias_ids() or {}
    if req.bad_words:
        bias = bias | bad_word_bias(tokenizer, req.bad_words)
    try:
        base = SamplingParams(max_tokens=max(max_tokens or room, 1), temperature=1.0 if req.temperature is None
                              else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=max(req.top_k or 0, 0), seed=req.seed, stop=tuple(stop),
                              stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              logprobs=req.num_logprobs(), prompt_logprobs=req.prompt_logprobs,
                              presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              min_p=req.min_p, min_tokens=req.min_tokens, logit_bias=bias or None,
                              close_at_budget=req.close_at_budget, repetition_guard=req.repetition_guard,
                              guided_backend=guide_backend(req), **guide)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    if req.n == 1:
        return [base]
    # distinct seeds per choice, still reproducible when the request gives one
    return [dataclasses.replace(base, seed=None if req.seed is None else (req.seed + i) % 2 ** 63)
            for i in range(req.n)]


def guide_backend(req) -> str:
    if req.guided_backend and req.guided_decoding_backend and req.guided_backend != req.guided_decoding_backend:
        raise APIError("give guided_backend or guided_decoding_backend, not both", param="guided_decoding_backend")
    if req.guided_decoding_backend:
        backend = _VLLM_BACKENDS.get(req.guided_decoding_backend)
        if backend is None:
            raise APIError(f"guided_decoding_backend must be one of {', '.join(_VLLM_BACKENDS)}, got "
                           f"{req.guided_decoding_backend!r}"[:300], param="guided_decoding_backend")
        return backend
    backend = req.guided_backend or "auto"
    if backend not in BACKENDS:
        raise APIError(f"guided_backend must be one of {', '.join(BACKENDS)}, got {backend!r}"[:300],
                       param="guided_backend")
    return backend


def bad_word_bias(tokenizer, words: list[str]) -> dict[int, float]:
    """vLLM's bad_words as banned tokens: each word, with and without a leading space, must be one token of the
    vocabulary, which is then never chosen. (vLLM bans the last token of a longer word only right after the
    others, which needs each step's tokens on the host before sampling: this server samples ahead of them.)"""
    if tokenizer is None:
        raise APIError("bad_words needs the model's tokenizer, and this model has none", param="bad_words")
    banned: dict[int, float] = {}
    for word in words:
        for text in dict.fromkeys((word, " " + word.lstrip(" "))):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise APIError(f"bad_words: {text!r} is {len(ids)} tokens for this model; only words of one token "
                               "(with and without a leading space) can be banned"[:300], param="bad_words")
            banned[ids[0]] = -math.inf
    return banned


def ignored_note(req) -> list[str]:
    """The note naming the fields `req` ignores (raises the 400 of a field the server cannot honour)."""
    ignored = req.ignored()
    return [f"ignored unknown fields: {', '.join(ignored)}"[:500]] if ignored else []


def notes(req, asked: int | None, room: int) -> list[str]:
    """What the response should say it did not do as asked: fields ignored, max_tokens past the context."""
    out = ignored_note(req)
    if asked is not None and asked > room:
        out.append(f"max_tokens {asked} is more than the {room} tokens the context leaves after the prompt; at most "
                   f"{room} will be generated")
    return out

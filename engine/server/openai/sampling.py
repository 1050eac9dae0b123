"""OpenAI request fields -> one SamplingParams per choice (`n`), guides included."""
from __future__ import annotations

import dataclasses

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
                "guided_grammar": "ebnf"}
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


def sampling_params(req, max_tokens: int | None, room: int, guide: dict) -> list[SamplingParams]:
    """`room`: context left after the prompt (the default max_tokens: as OpenAI, up to the context)."""
    bad = req.unsupported()
    if bad:
        raise APIError(f"{bad[0]} is not supported by this server", param=bad[0])
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    backend = req.guided_backend or "auto"
    if backend not in BACKENDS:
        raise APIError(f"guided_backend must be one of {', '.join(BACKENDS)}, got {backend!r}"[:300],
                       param="guided_backend")
    try:
        base = SamplingParams(max_tokens=max(max_tokens or room, 1), temperature=1.0 if req.temperature is None
                              else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=req.top_k or 0, seed=req.seed, stop=tuple(stop), ignore_eos=req.ignore_eos,
                              logprobs=req.num_logprobs(), presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              min_p=req.min_p, min_tokens=req.min_tokens, logit_bias=req.logit_bias_ids(),
                              guided_backend=backend, **guide)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    if req.n == 1:
        return [base]
    # distinct seeds per choice, still reproducible when the request gives one
    return [dataclasses.replace(base, seed=None if req.seed is None else (req.seed + i) % 2 ** 63)
            for i in range(req.n)]

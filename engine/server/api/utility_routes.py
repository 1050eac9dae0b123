"""Routes beside the generation endpoints: one model's card, vLLM's /tokenize and /detokenize (and, with
--allow-cache-reset, its /reset_prefix_cache), and OpenAI's error shape for every HTTP error the framework raises
itself (an unknown route, a wrong method)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.server.api.limits import read_json
from engine.server.openai.chat import chat_prompt, normalize_messages, template_options
from engine.server.openai.protocol import APIError, ChatCompletionRequest, validated
from engine.server.processes.submission import EngineDead

_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


def add_utility_routes(app: FastAPI, state, handle) -> None:
    """handle(endpoint, request, build): the app's error-handling wrapper."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        err = APIError(message, exc.status_code, _TYPES.get(exc.status_code, "invalid_request_error"))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        try:
            state.check_model(model_id)
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return state.model_card(model_id)

    async def build_tokenize(request: Request, arrival: float):
        body = await read_json(request, state.limits.max_body_bytes)
        _check_model(state, body)
        ids = await asyncio.get_running_loop().run_in_executor(None, _tokenize, state, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}

    async def build_detokenize(request: Request, arrival: float):
        body = await read_json(request, state.limits.max_body_bytes)
        _check_model(state, body)
        ids = body.get("tokens")
        vocab = state.info.vocab
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise APIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": _tokenizer(state).decode(ids)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle("tokenize", request, build_tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle("detokenize", request, build_detokenize)

    if state.allow_cache_reset:         # an operator's tool: any client could otherwise empty everyone's cache
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            try:
                return {"reset_pages": await state.aengine.reset_prefix_cache()}
            except EngineDead as exc:
                err = APIError(str(exc), 503, "service_unavailable")
                return JSONResponse(err.body(), status_code=503)


def _tokenize(state, body: dict) -> list[int]:
    """On a worker thread: a prompt's ids, or a conversation's through the chat template (as a chat request)."""
    tok = _tokenizer(state)
    if "messages" in body:
        req = validated(ChatCompletionRequest, body | {"model": state.model_name})
        return chat_prompt(tok, normalize_messages(req.messages), None, state.limits, template_options(req),
                           state.tool_format)
    if isinstance(body.get("prompt"), str):
        state.limits.check_prompt(body["prompt"])
        return tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
    raise APIError("give `prompt` (a string) or `messages`", param="prompt")


def _check_model(state, body: dict) -> None:
    if body.get("model") is not None:
        state.check_model(body["model"])


def _tokenizer(state):
    if state.tokenizer is None:
        raise APIError("this model has no tokenizer")
    return state.tokenizer

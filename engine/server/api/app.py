"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics.

Every bad request is answered before it reaches the engine (400 with an OpenAI-style error body): the body,
its fields, the model name, tools, guides (bounded and compiled here, awaited on the event loop:
engine/server/api/guides.py), and the checks that need the engine (context length, KV size), which
`AsyncEngine.submit` returns as ValueError.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.server.api.guides import ClientGone, admit_guide, blamed, until_disconnect
from engine.server.api.limits import RequestLimits, read_json
from engine.server.api.responses_route import add_responses_route
from engine.server.api.utility_routes import add_utility_routes
from engine.server.metrics import ServerMetrics
from engine.server.openai.chat import chat_prompt, normalize_messages, template_options
from engine.server.openai.generation import ChatFormat, CompletionFormat, Generation
from engine.server.openai.logprobs import token_table
from engine.server.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, StreamOptions, validated
from engine.server.openai.sampling import notes, response_format_guide, sampling_params, vllm_guide
from engine.server.openai.tool_formats import ToolFormat
from engine.server.openai.tool_formats import resolve as resolve_tool_format
from engine.server.openai.tools import HERMES, plan_tools
from engine.server.processes.async_engine import AsyncEngine
from engine.server.processes.submission import EngineDead, Overloaded


@dataclass
class ServerState:
    aengine: AsyncEngine         # or an EngineClient: the same interface, the engine in its own process
    tokenizer: object            # the server's own instance (the engine decodes with another)
    model_name: str              # the first served name: the one responses carry
    metrics: ServerMetrics
    limits: RequestLimits = RequestLimits()
    on_ready: object = None      # called once the engine thread runs (prints the "listening" line)
    aliases: tuple = ()          # further names clients may ask for (--served-model-name a b ...)
    client_key_header: str | None = None    # the header naming a request's client (--client-key-header)
    tool_format: ToolFormat = HERMES        # how the model writes tool calls (--tool-call-parser)
    allow_cache_reset: bool = False         # POST /reset_prefix_cache exists (--allow-cache-reset)

    @classmethod
    def for_engine(cls, args, aengine, tokenizer) -> "ServerState":
        """The state `serve`'s options give, in front of `aengine` (an engine thread or the engine process)."""
        names = args.served_model_name or [aengine.info.name]
        limits = RequestLimits.for_model(tokenizer, aengine.info.max_model_len, args.max_request_bytes)
        return cls(aengine, tokenizer, names[0], ServerMetrics(names[0]), limits, aliases=tuple(names[1:]),
                   client_key_header=args.client_key_header,
                   allow_cache_reset=getattr(args, "allow_cache_reset", False),
                   tool_format=resolve_tool_format(tokenizer, getattr(args, "tool_call_parser", "auto")))

    @property
    def info(self):
        return self.aengine.info

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)

    def model_card(self, name: str | None = None) -> dict:
        return {"id": name or self.model_name, "object": "model", "created": int(self.aengine.started),
                "owned_by": "specdec", "max_model_len": self.info.max_model_len}

    def check_model(self, name) -> None:
        if name not in self.names:
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.names))}", status=404, param="model", code="model_not_found")


async def _parse(request: Request, model, limits: RequestLimits):
    return validated(model, await read_json(request, limits.max_body_bytes))


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.aengine.start(asyncio.get_running_loop())
        if state.on_ready:
            state.on_ready()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.aengine.shutdown)

    app = FastAPI(title="specdec", lifespan=lifespan)
    aengine, metrics = state.aengine, state.metrics

    def error(endpoint: str, err: APIError) -> JSONResponse:
        metrics.request(endpoint, err.status)
        return JSONResponse(err.body(), status_code=err.status)

    async def admit(endpoint: str, request: Request, req, prep: Prepared, fmt, arrival: float):
        gen = await start(request, prep, fmt, arrival, bool(req.stream))
        return await respond(endpoint, request, gen, req)

    async def start(request: Request, prep: Prepared, fmt, arrival: float, streamed: bool) -> Generation:
        ids, params = prep.ids, prep.params
        asks = params[0].logprobs is not None or params[0].prompt_logprobs is not None
        table = await off_loop(token_table, state.tokenizer) if asks else None
        try:
            engine = aengine.place(ids)
            if params[0].guide is not None:
                await admit_guide(aengine.guides, params[0], request, state.client_key_header, engine)
            sub = await aengine.submit(ids, params, stream=streamed, engine=engine)
        except ValueError as exc:
            raise APIError(str(exc)) from exc
        except Overloaded as exc:
            raise APIError(str(exc), status=429, type="rate_limit_error", code="overloaded") from exc
        except EngineDead as exc:
            raise APIError(str(exc), status=503, type="server_error", code="engine_stopped") from exc
        metrics.admitted(len(ids))
        return Generation(fmt, sub, state.model_name, len(ids), prep.tools, metrics, arrival, table, prep.notes,
                          prep.request_id)

    async def respond(endpoint: str, request: Request, gen: Generation, req):
        if req.stream:
            opts = req.stream_options or StreamOptions()
            metrics.request(endpoint, 200)
            return StreamingResponse(stream(gen, opts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"} | gen.headers())
        body = await whole(endpoint, request, gen)
        return Response(status_code=499) if body is None else JSONResponse(body, headers=gen.headers())

    async def whole(endpoint: str, request: Request, gen: Generation) -> dict | None:
        """The whole response's body, or None when the client left first (its request is aborted)."""
        result = asyncio.ensure_future(gen.full())
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                aengine.abort(gen.sub)
                gen.abandon()
        if result.cancelled():                  # the client is gone: nobody reads this
            metrics.request(endpoint, 499)
            return None
        body = result.result()                  # raises the APIError of a choice that failed
        metrics.request(endpoint, 200)
        return body

    async def stream(gen: Generation, opts: StreamOptions):
        try:
            async for chunk in gen.sse(opts.include_usage, opts.continuous_usage_stats):
                yield chunk
        finally:
            if gen.open:                       # the client went away: end its requests, free their pages
                aengine.abort(gen.sub)
                gen.abandon()

    async def handle(endpoint: str, request: Request, build):
        arrival = time.perf_counter()
        try:
            return await build(request, arrival)
        except APIError as err:
            return error(endpoint, err)
        except ClientGone:
            metrics.request(endpoint, 499)
            return Response(status_code=499)
        except asyncio.CancelledError:
            raise
        except RecursionError:                  # a deeply nested field (a schema, tool parameters) met recursion
            return error(endpoint, APIError("the request is nested too deeply to process"))
        except Exception as exc:                # a bug: the request fails, the server goes on
            return error(endpoint, APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error"))

    async def prepare_chat(req: ChatCompletionRequest) -> Prepared:
        """A chat request's prompt ids, its per-choice SamplingParams, its ToolPlan, and its messages."""
        state.check_model(req.model)
        req.ignored()                       # refuses the fields the server cannot honour
        messages = normalize_messages(req.messages)
        guide, asked = response_format_guide(req.response_format), vllm_guide(req)
        if guide and asked:
            raise APIError("response_format cannot be combined with structured_outputs or guided_* fields",
                           param="response_format")
        guide = guide or asked
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, guide, state.tool_format)
        guide = {"structural_tag": plan.guide} if plan.guide else guide
        ids = await off_loop(chat_prompt, state.tokenizer, messages, plan.tools, state.limits, template_options(req),
                             state.tool_format)
        prep = prepared(req, ids, req.max_completion_tokens or req.max_tokens, guide, plan, messages)
        if plan.mode in ("required", "named"):          # the output is calls: the shortest one must fit
            room = state.info.max_model_len - len(prep.ids)
            forced = [t["function"] for t in plan.tools if plan.mode == "required" or t["function"]["name"] ==
                      req.tool_choice["function"]["name"]]
            state.limits.check_output_fits({"anyOf": [f["parameters"] for f in forced]}, room,
                                           "the tools' parameters", "tools")
        return prep

    def prepared(req, ids: list[int], asked: int | None, guide: dict, plan=None, messages=None) -> Prepared:
        ids = truncated(req, ids)
        room = state.info.max_model_len - len(ids)
        params = sampling_params(req, asked, room, guide, state.tokenizer)
        if params[0].guide is not None:
            state.limits.check_guide_fits(params[0].guide, room, blamed(params[0].guide))
        return Prepared(ids, params, plan, messages, notes(req, asked, room), req.request_id)

    async def build_chat(request: Request, arrival: float):
        req = await _parse(request, ChatCompletionRequest, state.limits)
        return await admit("chat", request, req, await prepare_chat(req), ChatFormat(), arrival)

    async def run_chat(request: Request, body: dict, arrival: float):
        """A chat request given as a dict (the Responses API's translation): its Generation and messages."""
        prep = await prepare_chat(validated(ChatCompletionRequest, body))
        return await start(request, prep, ChatFormat(), arrival, True), prep.messages

    async def build_completion(request: Request, arrival: float):
        req = await _parse(request, CompletionRequest, state.limits)
        state.check_model(req.model)
        req.ignored()
        guide, asked = response_format_guide(req.response_format), vllm_guide(req)
        if guide and asked:
            raise APIError("response_format cannot be combined with structured_outputs or guided_* fields",
                           param="response_format")
        ids = await off_loop(completion_prompt, state.tokenizer, req.prompt, state.limits, bool(req.add_special_tokens))
        return await admit("completions", request, req, prepared(req, ids, req.max_tokens, guide or asked),
                           CompletionFormat(), arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("chat", request, build_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("completions", request, build_completion)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [state.model_card(name) for name in state.names]}

    add_utility_routes(app, state, handle)
    add_responses_route(app, state, handle, lambda request, model: _parse(request, model, state.limits), run_chat,
                        lambda request, gen: whole("responses", request, gen))

    @app.get("/health")
    async def health():
        if aengine.healthy():
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": aengine.error or "the engine is not running"}, 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(await aengine.stats()), media_type=CONTENT_TYPE_LATEST)

    return app


@dataclass(frozen=True)
class Prepared:
    """A request ready to be admitted: prompt ids, per-choice SamplingParams, tools (a ToolPlan or None), the
    chat messages, the notes its response carries, and the id the client asked for."""
    ids: list
    params: list
    tools: object = None
    messages: list | None = None
    notes: list = ()
    request_id: str | None = None


def truncated(req, ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens."""
    n = req.truncate_prompt_tokens
    return ids[-n:] if n and len(ids) > n else ids


async def off_loop(fn, *args):
    """Templating and tokenizing on a worker thread: the event loop goes on streaming others' tokens."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def completion_prompt(tokenizer, prompt, limits: RequestLimits, special: bool = False) -> list[int]:
    """One prompt: text, or token ids (a model without a tokenizer takes only ids)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError("give one prompt per request (use n for several completions of it)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this model has no tokenizer: give the prompt as token ids", param="prompt")
        limits.check_prompt(prompt)
        return tokenizer.encode(prompt, add_special_tokens=special)
    return list(prompt)

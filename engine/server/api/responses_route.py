"""`POST /v1/responses`: a Responses request runs as a chat request (engine/server/openai/responses.py
translates), answered whole or as Responses' typed SSE events."""
from __future__ import annotations

import copy

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server.openai.generation import failure
from engine.server.openai.responses import ResponseBuilder, ResponsesRequest, ResponseStore, chat_body, event
from engine.server.openai.sampling import ignored_note


def add_responses_route(app: FastAPI, state, handle, parse, run_chat, whole) -> None:
    """parse(request, model) -> validated body; run_chat(request, chat_dict, arrival) -> (Generation, messages);
    whole(request, gen) -> the chat body, or None when the client left."""
    store = ResponseStore()

    async def build(request: Request, arrival: float):
        req = await parse(request, ResponsesRequest)
        state.check_model(req.model)
        ignored = ignored_note(req)
        history = store.get(req.previous_response_id) if req.previous_response_id else []
        gen, messages = await run_chat(request, chat_body(req, history), arrival)
        gen.notes[:0] = ignored
        builder = ResponseBuilder(req, state.model_name)
        if req.stream:
            state.metrics.request("responses", 200)
            return StreamingResponse(_events(gen, builder, store if req.store else None, messages, state),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"} | gen.headers())
        body = await whole(request, gen)
        if body is None:
            return Response(status_code=499)
        choice = body["choices"][0]
        if choice["message"].get("content"):
            builder.text(choice["message"]["content"])
            builder.logprobs(choice["logprobs"])
            builder.close_message()
        for call in choice["message"].get("tool_calls") or []:
            builder.call(call)
        if req.store:
            store.put(builder.id, builder.conversation(messages))
        return JSONResponse(builder.body("completed", body["usage"], choice["finish_reason"]), headers=gen.headers())

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await handle("responses", request, build)


async def _events(gen, builder: ResponseBuilder, store: ResponseStore | None, messages: list, state):
    seq = iter(range(1 << 62))
    try:
        yield event("response.created", next(seq), response=builder.body("in_progress", None))
        yield event("response.in_progress", next(seq), response=builder.body("in_progress", None))
        async for per_choice in gen.batches():
            for kind, item in per_choice.get(0, []):
                for text in (_text_events(builder, item, seq) if kind == "content"
                             else _call_events(builder, item, seq)):
                    yield text
        st = gen.choices[0]
        builder.logprobs(gen.logprobs(st))
        for text in _close_message(builder, seq):
            yield text
        if st.finish == "error":
            err = failure(st.error or "failed")
            yield event("response.failed", next(seq), response=builder.body(
                "failed", gen.usage(), error={"code": err.type, "message": err.message}))
            return
        body = builder.body("completed", gen.usage(), st.finish_reason())      # as the whole response
        if store is not None:
            store.put(builder.id, builder.conversation(messages))
        yield event("response.completed" if body["status"] == "completed" else "response.incomplete", next(seq),
                    response=body)
    finally:
        if gen.open:                            # the client went away: end its request, free its pages
            state.aengine.abort(gen.sub)
            gen.abandon()


def _text_events(builder: ResponseBuilder, delta: str, seq):
    opened, item = builder.text(delta)
    index = len(builder.items) - 1
    if opened:
        empty = copy.deepcopy(item)
        empty["content"][0]["text"] = ""
        yield event("response.output_item.added", next(seq), output_index=index, item=dict(empty, content=[]))
        yield event("response.content_part.added", next(seq), item_id=item["id"], output_index=index, content_index=0,
                    part=empty["content"][0])
    yield event("response.output_text.delta", next(seq), item_id=item["id"], output_index=index, content_index=0,
                delta=delta)


def _close_message(builder: ResponseBuilder, seq):
    index = len(builder.items) - 1
    item = builder.close_message()
    if item is None:
        return
    part = item["content"][0]
    yield event("response.output_text.done", next(seq), item_id=item["id"], output_index=index, content_index=0,
                text=part["text"])
    yield event("response.content_part.done", next(seq), item_id=item["id"], output_index=index, content_index=0,
                part=part)
    yield event("response.output_item.done", next(seq), output_index=index, item=item)


def _call_events(builder: ResponseBuilder, call: dict, seq):
    yield from _close_message(builder, seq)
    item = builder.call(call)
    index = len(builder.items) - 1
    yield event("response.output_item.added", next(seq), output_index=index,
                item=dict(item, arguments="", status="in_progress"))
    yield event("response.function_call_arguments.delta", next(seq), item_id=item["id"], output_index=index,
                delta=item["arguments"])
    yield event("response.function_call_arguments.done", next(seq), item_id=item["id"], output_index=index,
                arguments=item["arguments"])
    yield event("response.output_item.done", next(seq), output_index=index, item=item)

"""A request's guide before it is queued: its bounds, a share of the compile pool, and its compile, awaited on
the event loop (no thread waits) until it is done, its time budget runs out or its client leaves.

The compile runs where the engine is: `LocalGuides` for an engine thread of this process, `RemoteGuides`
(engine/server/processes/remote_guides.py) for an engine process. Either hands out tickets: `finished()`, `done`
(an asyncio future), `cancel()` (stops a compile only while it is queued: xgrammar cannot be interrupted) and
`result()` (raises ValueError naming the problem, or CompileBusy)."""
from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request

from engine.guided.compile_pool import CompileBusy
from engine.guided.limits import budget_problem, timeout_message
from engine.server.openai.protocol import APIError


class ClientGone(Exception):
    """The client left while the request was being admitted (answered 499, to nobody)."""


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_key(request: Request, header: str | None) -> str | None:
    """Who a request comes from, for per-client shares: the value of `header` when the server is told to trust
    one (a gateway's user or forwarded-for header), else the peer's address."""
    if header and request.headers.get(header):
        return "header:" + request.headers[header][:200]
    return request.client.host if request.client else None


async def admit_guide(guides, params, request: Request, key_header: str | None = None,
                      engine: int | None = None) -> None:
    """Raise APIError (400: a bound, a compile error, the time budget, or a max_tokens that holds no whole output;
    429: the pool is busy) or ClientGone. On return the grammar is compiled and cached, and its first mask allows
    a token. `engine`: the engine process the request will go to (several: it compiles there)."""
    guide = params.guide
    try:
        ticket = guides.start(guide, client_key(request, key_header), engine)
        if not ticket.finished():
            try:
                await _wait(ticket.done, request, guides.timeout_s)
            except ClientGone:
                ticket.cancel()
                raise
            if not ticket.finished():
                ticket.cancel()
                raise APIError(timeout_message(guide, guides.timeout_s), param=blamed(guide))
        problem = budget_problem(await ticket.result(), params.max_tokens, guide) if params.close_at_budget else None
        if problem:
            raise APIError(problem, param="max_tokens")
    except ValueError as exc:
        raise APIError(str(exc), param=blamed(guide, str(exc))) from exc
    except CompileBusy as exc:
        raise APIError(str(exc), status=429, type="rate_limit_error", code="grammar_compile_busy") from exc


_AT = re.compile(r" at (#[^\s;]*)")
_MARK = "$comment"          # engine/server/openai/tools.py marks each schema of a tool call's tag with its field


def blamed(guide, message: str = "") -> str:
    """The request field a refused guide came from. A structural tag made of tool schemas names the one the
    message's path leads into (a bound names where it was passed), else the only one or `tools` when it
    cannot tell; any other guide is the response format (as for every guide before tools had marks)."""
    if guide.kind != "structural_tag":
        return "response_format"
    tag = json.loads(guide.source)
    marks = _marks(tag, [])
    if not marks:
        return "response_format"
    found = _AT.search(message)
    node, named = tag, None
    for part in (found.group(1).split("/")[1:] if found else []):
        if isinstance(node, dict) and isinstance(node.get(_MARK), str):
            named = node[_MARK]
        node = node.get(part) if isinstance(node, dict) else (
            node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else None)
    if isinstance(node, dict) and isinstance(node.get(_MARK), str):
        named = node[_MARK]
    if named is None and len(set(marks)) == 1:
        named = marks[0]
    return named or "tools"


def _marks(node, out: list) -> list:
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            mark = node["json_schema"].get(_MARK)
            if isinstance(mark, str):
                out.append(mark)
        for v in node.values():
            _marks(v, out)
    elif isinstance(node, list):
        for v in node:
            _marks(v, out)
    return out


async def _wait(done: asyncio.Future, request: Request, timeout: float) -> None:
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        finished, _ = await asyncio.wait({done, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if gone in finished and not done.done():
        raise ClientGone()


class LocalGuides:
    """Compiles on the grammar service of an engine in this process."""

    def __init__(self, tracker):
        self.tracker, self.timeout_s = tracker, tracker.timeout_s

    def start(self, guide, owner, engine: int | None = None) -> "_LocalTicket":
        return _LocalTicket(self.tracker, self.tracker.admit(guide, owner))


class _LocalTicket:
    def __init__(self, tracker, pending):
        self.tracker, self.pending = tracker, pending
        self.done = asyncio.wrap_future(pending.future)
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())    # its error is read from `pending`

    def finished(self) -> bool:
        return self.pending.future.done()

    def cancel(self) -> None:
        self.pending.cancel()

    async def result(self) -> int | None:
        return await asyncio.get_running_loop().run_in_executor(None, self.tracker.check_compiled, self.pending)

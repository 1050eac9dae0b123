"""A request's guide before it is queued: its bounds, a share of the compile pool, and its compile, awaited on
the event loop (no thread waits) until it is done, its time budget runs out or its client leaves."""
from __future__ import annotations

import asyncio
import concurrent.futures

from fastapi import Request

from engine.guided.compile_pool import CompileBusy
from engine.server.protocol import APIError


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


async def admit_guide(tracker, guide, request: Request, key_header: str | None = None) -> None:
    """Raise APIError (400: a bound, a compile error or the time budget; 429: the pool is busy) or ClientGone.
    On return the grammar is compiled and cached, and its first mask allows a token."""
    owner = client_key(request, key_header)
    try:
        pending = tracker.admit(guide, owner)
    except ValueError as exc:
        raise APIError(str(exc), param="response_format") from exc
    except CompileBusy as exc:
        raise APIError(str(exc), status=429, type="rate_limit_error", code="grammar_compile_busy") from exc
    if not pending.future.done():
        try:
            await _wait(pending.future, request, tracker.timeout_s)
        except ClientGone:
            pending.cancel()
            raise
        if not pending.future.done():
            pending.cancel()             # stops it only if still queued: xgrammar cannot be interrupted
            raise APIError(tracker.timeout_message(guide), param="response_format")
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, tracker.check_compiled, pending)
    except ValueError as exc:
        raise APIError(str(exc), param="response_format") from exc


async def _wait(future: concurrent.futures.Future, request: Request, timeout: float) -> None:
    compiled = asyncio.wrap_future(future)
    compiled.add_done_callback(lambda f: f.cancelled() or f.exception())    # its error is read from `future`
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({compiled, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if gone in done and not future.done():
        raise ClientGone()

"""The soak's hostile requests (bench/serving/soak.py): each with the status the server must answer it with.

A turn through HOSTILE sends, in order of name: a body past --max-request-bytes, a broken JSON body, a 100,000-value
enum, a grammar that compiles for minutes (40 anyOf branches of 30 patterned strings, new each time: refused at the
compile budget, or 429 while the queue is crowded and this client holds its share), a body nested 10,000 deep, a
2 MB prompt, a connection that sends its request a byte a second (408 at the server's read deadline), a grammar
that compiles for about a second per property, a 100,000-char stop string and 20 stop strings.
"""
from __future__ import annotations

import asyncio
import itertools
import json

_NEW = itertools.count()       # a cached grammar would compile at once: every one is new


def slow_grammar(model: str) -> bytes:
    """Within every size bound, ~1 s of compile per property (each distinct minLength with maxLength 1000)."""
    tag = f"p{next(_NEW)}_"
    props = {f"{tag}{i}": {"type": "string", "minLength": i + 1, "maxLength": 1000} for i in range(90)}
    return _guided(model, {"type": "object", "properties": props})


def heavy_grammar(model: str) -> bytes:
    """Within every size bound, yet xgrammar compiles it for minutes."""
    tag = f"h{next(_NEW)}_"
    pattern = {"type": "string", "pattern": "[a-z]{1,50}(x|y)+[0-9]{1,40}"}
    branches = [{"type": "object", "properties": {f"{tag}{b}_{i}": pattern for i in range(30)},
                 "required": [f"{tag}{b}_0"]} for b in range(40)]
    return _guided(model, {"anyOf": branches})


def _guided(model: str, schema: dict) -> bytes:
    return json.dumps({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                       }).encode()


HOSTILE = {   # name: (body, or a function of the model giving the raw bytes; the status it must get)
    "stop_100k": ({"stop": ["x" * 100_000]}, 400),
    "stop_20": ({"stop": [f"s{i}" for i in range(20)]}, 400),
    "enum_100k": ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(100_000)]}}}}}}, 400),
    "prompt_2mb": ({"messages": [{"role": "user", "content": "ab " * 700_000}]}, 400),
    "nested_10k": (lambda model: b'{"model": "%s", "messages": ' % model.encode() + b"[" * 10_000 + b"]" * 10_000
                   + b"}", 400),
    "body_too_large": (None, 413),           # built from --max-request-bytes
    "broken_json": (lambda model: b'{"model": "%s", "messages": [' % model.encode(), 400),
    "slow_grammar": (slow_grammar, (400, 429)),
    "heavy_grammar": (heavy_grammar, (400, 429)),
    "slow_body": (None, 408),                # a byte a second: sent by slow_body() below
}


async def slow_body(host: str, port: int, local_address: str | None, model: str, give_up_s: float) -> tuple[int, str]:
    """A request whose headers come whole and whose body comes a byte a second: (the status the server answers
    with, 0 if none came within give_up_s; the answer's first bytes)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port, local_addr=(local_address, 0) if local_address else None)
    try:
        writer.write(head)
        answer = b""

        async def trickle():
            for byte in body:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
        sending = asyncio.ensure_future(trickle())
        try:
            answer = await asyncio.wait_for(reader.read(200), give_up_s)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            sending.cancel()
        first = answer.split(b"\r\n", 1)[0].decode(errors="replace")
        parts = first.split()
        return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), first
    finally:
        writer.close()

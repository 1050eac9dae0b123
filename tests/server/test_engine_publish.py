"""The engine process's frames of a step's outputs (EngineServer._publish): the native walk that puts rows of token
ids only into the columns gives each API process the frame the Python walk below (its definition) gives, and
leaves the routes of finished requests as that walk does (CPU, no sockets). Both send the other rows through
_publish_out."""
import random

from engine.requests.output import RequestOutput
from engine.server.processes import ipc
from engine.server.processes.engine_process import EngineServer


class Outbox:
    def __init__(self):
        self.frames = []

    def send(self, frame):
        self.frames.append(frame)


def python_publish(server, outputs) -> None:
    """The walk the native one replaces: a row of token ids only into its client's columns, the others through
    the server's own _publish_out."""
    frames = {}
    for o in outputs:
        route = server.routes.get(o.request_id)
        if route is None:
            continue
        client, sub, choice, text, whole = route
        if whole or o.finished:
            server._publish_out(frames, o)
            continue
        frame = frames.get(client)
        if frame is None:
            frame = frames[client] = ipc.Outputs([])
        frame.subs.append(sub)
        frame.choices.append(choice)
        frame.counts.append(len(o.new_token_ids))
        frame.ids.extend(o.new_token_ids)
    for client, frame in frames.items():
        server.outboxes[client].send(ipc.encode(frame))


def server_with(routes, subs, clients=3):
    server = EngineServer.__new__(EngineServer)
    server.outboxes = [Outbox() for _ in range(clients)]
    server.routes, server.subs = dict(routes), {key: set(ids) for key, ids in subs.items()}
    return server


def test_the_native_walk_sends_each_api_process_the_python_walks_frame():
    rng = random.Random(0)
    routes, subs, outputs = {}, {}, []
    for rid in range(300):
        client, sub, choice = rng.randrange(3), rid // 2, rid % 2
        text, whole = rng.random() < 0.1, rng.random() < 0.2
        if rng.random() < 0.95:                   # the rest: an undone choice's abort, no route
            routes[rid] = (client, sub, choice, text, whole)
            subs.setdefault((client, sub), set()).add(rid)
        finished = rng.random() < 0.15
        ids = tuple(rng.randrange(50_000) for _ in range(rng.choice((0, 1, 1, 1, 4))))
        outputs.append(RequestOutput(rid, ids, "text" if text else "", finished,
                                     "length" if finished else None, cached_tokens=rng.randrange(3)))
    native, python = server_with(routes, subs), server_with(routes, subs)
    native._publish(outputs)
    python_publish(python, outputs)
    assert [box.frames for box in native.outboxes] == [box.frames for box in python.outboxes]
    assert all(box.frames for box in native.outboxes)
    assert native.routes == python.routes and native.subs == python.subs
    assert len(native.routes) < len(routes)       # finished requests left their routes
    frame = ipc.client_decoder().decode(native.outboxes[0].frames[0])
    assert frame.counts and frame.items and sum(frame.counts) == len(frame.ids)


def test_a_step_of_nothing_routed_sends_nothing():
    server = server_with({}, {})
    server._publish([RequestOutput(7, (1,), "", False)])
    assert not any(box.frames for box in server.outboxes)

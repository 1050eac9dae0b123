"""Grammar compiles of an API process, run on the grammar service of the engine process its request goes to (where
the grammar is used), over the engine client's sockets (engine/server/processes/engine_client.py)."""
from __future__ import annotations

from engine.guided.compile_pool import CompileBusy
from engine.server.processes import ipc
from engine.server.processes.submission import ENGINE_STOPPED, EngineDead


class RemoteGuides:
    """Compiles on the engine process's grammar service (where the grammars are used)."""

    def __init__(self, client):
        self.client, self.timeout_s = client, client.info.compile_timeout_s

    def start(self, guide, owner, engine: int | None = None) -> "_RemoteTicket":
        if self.client.error is not None:
            raise EngineDead(f"{ENGINE_STOPPED}: {self.client.error}")
        return _RemoteTicket(self.client, guide, owner, self.client.place([]) if engine is None else engine)


class _RemoteTicket:
    def __init__(self, client, guide, owner, engine: int):
        self.client, self.engine = client, engine
        self.token, self.done = client._expect(
            "compile", lambda token: ipc.Compile(client.client, token, ipc.guide_to_wire(guide), owner), engine)

    def finished(self) -> bool:
        return self.done.done()

    def cancel(self) -> None:
        self.client._waiters.pop(("compile", self.token), None)
        if self.client.error is None and not self.client.placement.dead[self.engine]:
            self.client._send(ipc.CancelCompile(self.client.client, self.token), self.engine)

    async def result(self) -> int | None:
        """The guide's shortest whole output in tokens (None: not known), once it compiled."""
        code, message, minimum = await self.done    # raises EngineDead if the engine went first
        if code == "busy":
            raise CompileBusy(message)
        if code != "ok":
            raise ValueError(message)
        return minimum or None

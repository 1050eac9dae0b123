"""uvicorn's server, which ends the requests still open shortly before its shutdown grace runs out."""
from __future__ import annotations

import asyncio

import uvicorn

SHUTDOWN_MESSAGE = "the server is shutting down"
GRACE_S = 5.0           # uvicorn's timeout_graceful_shutdown: open responses may finish meanwhile
END_BEFORE_S = 1.0      # the ended responses' last bytes go out in this much of it


class GracefulServer(uvicorn.Server):
    """At shutdown uvicorn lets open responses run for `timeout_graceful_shutdown`, then cancels their tasks: a
    stream was cut mid-body and each cancelled task printed a traceback. This one ends every open request a little
    before that through `end_all(message)`: a stream's last event is an error and a waiting response answers 503, so
    every response ends whole. Its config's timeout_graceful_shutdown is GRACE_S (`run`)."""

    def __init__(self, config: uvicorn.Config, end_all):
        super().__init__(config)
        self.end_all = end_all

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(GRACE_S - END_BEFORE_S, self.end_all, SHUTDOWN_MESSAGE)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run(app, sockets, log_level: str, http, end_all) -> None:
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=GRACE_S, http=http)
    GracefulServer(config, end_all).run(sockets=sockets)

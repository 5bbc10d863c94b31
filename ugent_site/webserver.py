"""The HTTP server of every web process: uvicorn (httptools, uvloop) as `rundaemon` (embedded) and
`runweb` (servers mode) both run it, so the two modes serve and shut down the same way.

SIGTERM/SIGINT stop it: it stops accepting, open requests get SHUTDOWN_GRACE_SECONDS to end (an SSE
stream never ends by itself; its client resumes from the durable log), and then each is cancelled and
still gets to write its answer: a chat request whose message was accepted answers the 503 that names
its turn with `x-should-retry: false` (docs/turns.md). uvicorn's own CLI re-raises the signal as soon as
it has cancelled them, which ends the process before those answers are written, and the client, seeing
the connection close, sends the accepted message again.
"""
from __future__ import annotations

import uvicorn

#: How long open requests may run on after SIGTERM/SIGINT before they are cancelled.
SHUTDOWN_GRACE_SECONDS = 3


def serve(bind: str, port: int) -> None:
    """Serve the ASGI application until SIGTERM/SIGINT; returns once every request has answered.

    uvicorn on the settings' logging (log_config=None). No X-Forwarded-* rewriting: a proxy in front is
    the operator's to configure. WebSockets (the live call, /v1/ugent/live) through the websockets
    package's sans-I/O protocol (what --ws auto picks; uvicorn's "websockets" is its deprecated legacy
    one)."""
    from ugent_site.asgi import application
    config = uvicorn.Config(application, host=bind, port=port, loop="uvloop", http="httptools",
                            ws="websockets-sansio",
                            lifespan="off", access_log=False, log_config=None, log_level="warning",
                            server_header=False, proxy_headers=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    _Server(config).run()


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising SIGTERM/SIGINT once it has shut down: the re-raise ends the
    process inside the loop, before the requests the shutdown cancelled have answered (asyncio.run lets
    them finish as it closes the loop), and before rundaemon stops its turn threads, worker, beat and
    channel workers."""

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

"""An ASGI app served by a real uvicorn server in a thread, for tests that want real HTTP in-process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from weightship.testing.waiting import eventually

__all__ = ["serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(app: Any, *, within: float = 30.0, **config: Any) -> Iterator[str]:
    """Serve ``app`` under uvicorn in a daemon thread (loopback, a port the kernel picks unless ``port``); yield its URL.

    ``config`` goes to ``uvicorn.Config`` (``lifespan``, ``limit_concurrency``, ``ws``, ...). The
    server is stopped, and its thread joined, when the block ends.
    """
    import uvicorn  # the control plane's server; only tests that serve an app need it

    options: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "log_level": "warning", **config}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        eventually(lambda: server.started or not thread.is_alive(), within, "uvicorn to start", interval=0.02)
        if not server.started:
            raise RuntimeError("uvicorn exited before it started serving (see the log above)")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{options['host']}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)

"""Run an app with uvicorn on a free 127.0.0.1 port in a background thread, for as long as a `with` block lasts."""

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def running_server(app):
    """Yields the base URL. proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on sockets that say so, and
    without it every small response waits ~40 ms (Nagle + delayed ACK)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "server did not shut down"

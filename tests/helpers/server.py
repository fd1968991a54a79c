"""Servers for tests: uvicorn on a free 127.0.0.1 port in a background thread (`running_server`), or an in-process
TestClient on a fresh tiny-model app (`local_client`)."""

import contextlib
import socket
import threading

import uvicorn

from tests.helpers.waiting import wait_for

LOCAL = "http://localhost"  # TestClient's default Host ("testserver") is not one a server without keys answers for
PAGE, BLOCKS = 8, 128


@contextlib.contextmanager
def running_server(app, **uvicorn_options):
    """Yields the base URL. proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on sockets that say so, and
    without it every small response waits ~40 ms (Nagle + delayed ACK)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    options = {"log_level": "warning", "timeout_graceful_shutdown": 5, **uvicorn_options}
    srv = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: srv.started or not thread.is_alive(), "the server started")
    assert thread.is_alive(), "the server thread died while starting"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "server did not shut down"


def tiny_app(settings=None, model=None, **settings_fields):
    """The app on a tiny qwen3 and the test tokenizer, with ServerSettings(**settings_fields) unless `settings`."""
    from rollout import ContinuousBatchingConfig
    from rollout.server import create_app
    from rollout.server.settings import ServerSettings
    from tests.helpers.models import tiny_model
    from tests.helpers.tokenizers import tiny_tokenizer

    settings = settings or ServerSettings(**settings_fields)
    return create_app(model or tiny_model("qwen3"), tiny_tokenizer(), "tiny",
                      ContinuousBatchingConfig(page_size=PAGE, num_blocks=BLOCKS), settings=settings)


@contextlib.contextmanager
def local_client(app=None, **settings_fields):
    """A TestClient (Host: localhost) on `app` or a fresh `tiny_app(**settings_fields)`; its backend is closed on
    exit."""
    from fastapi.testclient import TestClient

    app = app or tiny_app(**settings_fields)
    with TestClient(app, base_url=LOCAL) as client:
        client.app_state = app.state
        yield client

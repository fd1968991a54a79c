"""What one request may ask for, and what it may do to the others: bounded quantities answered with 400s (never 500s,
never a stalled server), strict types, no NaN in any response, bodies bounded in size and pace, headers in pace,
chat templates from the model only and rendered off the event loop, a pause that cannot park a client forever, and
finished-sequence counters that miss no sequence."""

import json
import math
import socket
import threading
import time
import tracemalloc

import httpx
import pytest

from rollout.server.limits import h11_protocol
from tests.helpers.server import local_client, running_server, tiny_app
from tests.helpers.waiting import HANG_GUARD_S, FakeClock, wait_for

COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    with local_client(max_n=4, max_choices=6) as c:
        yield c


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def raw_json(client, path: str, text: str):
    """POST a JSON body written by hand (lone surrogates, Infinity: what json.dumps would not send)."""
    return client.post(path, content=text.encode("utf-8", "surrogatepass"), headers={"content-type":
                                                                                     "application/json"})


def _submitted(manager) -> tuple[int, int]:
    """What reached the manager: prompt tokens the engine took, and requests still queued in front of it."""
    stats = manager.stats()
    return stats.prompt_tokens, stats.queued


def test_a_million_samples_is_a_cheap_400_and_the_server_keeps_serving():
    """n is checked before anything is built per sample: the refusal allocates far less than one million sequences
    would (traced Python memory), and no request reaches the engine."""
    with local_client() as c:  # the default bound: OpenAI's 128
        manager = c.app_state.backend.manager
        for path, body in [("/v1/completions", {"prompt": "w1 w2", "max_tokens": 1, "n": 1_000_000}),
                           ("/v1/chat/completions", {**CHAT, "n": 1_000_000})]:
            submitted = _submitted(manager)
            tracemalloc.start()
            try:
                err = error_of(c.post(path, json=body))
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert err["param"] == "n" and "128" in err["message"]
            assert peak < 16 * 2**20, f"refusing n=1e6 allocated {peak / 2**20:.0f} MiB"
            assert _submitted(manager) == submitted
        assert c.post("/v1/completions", json={**COMPLETION, "n": 128}).status_code == 200
        assert c.get("/metrics").status_code == 200
        assert manager.stats().used_blocks == 0


def test_the_sequences_of_one_request_are_bounded(client):
    assert error_of(client.post("/v1/completions", json={**COMPLETION, "n": 5}))["param"] == "n"
    err = error_of(client.post("/v1/completions", json={**COMPLETION, "prompt": [[1, 2]] * 4, "n": 2}))
    assert err["param"] == "prompt" and "8 sequences" in err["message"]
    assert len(client.post("/v1/completions", json={**COMPLETION, "prompt": [[1, 2]] * 3, "n": 2}).json()[
        "choices"]) == 6


@pytest.mark.parametrize("field, value", [("n", "2"), ("stream", "yes"), ("max_tokens", True), ("max_tokens", 2.0),
                                          ("temperature", "0.5"), ("logprobs", 1.5), ("echo", 1), ("seed", 2**64),
                                          ("stream_options", {"include_usage": "true"}), ("top_k", False),
                                          ("stop", 5), ("return_token_ids", "false")])
def test_types_are_strict_like_openai(client, field, value):
    assert error_of(client.post("/v1/completions", json={**COMPLETION, field: value}))["param"] == field


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("stop", ["x"] * 17),
                                          ("stop", "x" * 257), ("stop_token_ids", [1] * 257)])
def test_per_request_quantities_are_bounded(client, field, value):
    assert error_of(client.post("/v1/completions", json={**COMPLETION, field: value}))["param"] == field


def test_chat_bounds(client):
    assert error_of(client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 21}))["param"] == "top_logprobs"
    assert error_of(client.post("/v1/chat/completions", json={**CHAT, "messages": []}))["param"] == "messages"


@pytest.mark.parametrize("body", [
    '{"prompt": "\\ud800", "max_tokens": 1}',
    '{"prompt": ["w1", "w2 \\udfff"], "max_tokens": 1}',
    '{"prompt": [1, 2], "stop": ["\\ud800"], "max_tokens": 1}',
])
def test_a_lone_surrogate_is_a_400(client, body):
    err = error_of(raw_json(client, "/v1/completions", body))
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("content", ['"\\ud800"', '[{"type": "text", "text": "\\udc00"}]', '[{"type": "text", '
                                     '"text": 5}]', '[{}]', '[{"type": "text"}]', '[{"type": "image_url", '
                                     '"image_url": {"url": "x"}}]', '5'])
def test_bad_chat_content_is_a_400(client, content):
    body = f'{{"messages": [{{"role": "user", "content": {content}}}], "max_tokens": 1}}'
    assert error_of(raw_json(client, "/v1/chat/completions", body))["param"].startswith("messages")


def test_chat_content_parts_are_joined(client):
    parts = [{"type": "text", "text": "w1 "}, {"type": "text", "text": "w2"}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}],
                                                   "temperature": 0, "return_token_ids": True})
    plain = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == plain.json()["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("field, text", [("temperature", "1e-300"), ("temperature", "Infinity"),
                                         ("temperature", "1e999"), ("temperature", "NaN"), ("top_p", "NaN"),
                                         ("repetition_penalty", "Infinity"), ("repetition_penalty", "1e-300"),
                                         ("repetition_penalty", "1e300"), ("min_p", "-Infinity")])
def test_values_that_would_make_nan_are_refused(client, field, text):
    body = f'{{"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1, "{field}": {text}}}'
    assert error_of(raw_json(client, "/v1/completions", body))["param"] == field


def test_sampling_at_the_edges_of_the_ranges_gives_finite_logprobs(client):
    for extra in ({"temperature": 0.01}, {"temperature": 0.01, "repetition_penalty": 100.0},
                  {"temperature": 1e4, "repetition_penalty": 0.01}, {"temperature": 0}):
        r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 4, "logprobs": 1, "n": 2,
                                                 "ignore_eos": True, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert "NaN" not in r.text and "Infinity" not in r.text
        for choice in r.json()["choices"]:
            for values in (choice["logprobs"]["token_logprobs"], *choice["rollout"].values()):
                assert all(v is not None and math.isfinite(v) for v in values), (extra, choice)


SLOW_TEMPLATE = "{% for i in range(10**9) %}{% endfor %}"


@pytest.mark.parametrize("kwargs", [{"chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}},
                                    {"chat_template": SLOW_TEMPLATE}, {"chat_template_kwargs": {"tokenize": False}}])
def test_clients_cannot_bring_templates_or_rendering_options(client, kwargs):
    assert error_of(client.post("/v1/chat/completions", json={**CHAT, **kwargs}))["param"] in kwargs


def test_chat_templates_render_off_the_event_loop():
    """A slow render (a long conversation, a heavy model template) must not stall /health or other requests: /health
    answers while a render is still blocked (were the render on the event loop, /health could not answer until it
    is released, and the client would time out)."""
    app = tiny_app()
    tokenizer = app.state.server.jobs.tokenizer
    render = tokenizer.apply_chat_template
    rendering, release = threading.Event(), threading.Event()

    def slow_render(*args, **kwargs):
        rendering.set()
        release.wait(HANG_GUARD_S)
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = slow_render
    with running_server(app) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S / 4) as http:
        replies = {}
        chat = threading.Thread(target=lambda: replies.update(chat=http.post("/v1/chat/completions", json=CHAT)))
        chat.start()
        assert rendering.wait(HANG_GUARD_S), "the chat request never reached the template"
        try:
            assert http.get("/health").status_code == 200
            assert not release.is_set() and "chat" not in replies  # answered while the render was blocked
        finally:
            release.set()
        chat.join(HANG_GUARD_S)
        assert replies["chat"].status_code == 200


def test_body_size_is_bounded_before_and_while_reading():
    with local_client(max_body_bytes=2048) as c:
        big = {**COMPLETION, "user": "x" * 4096}
        err = error_of(c.post("/v1/completions", json=big), 413)
        assert "2048" in err["message"]
        streamed = (piece for piece in [json.dumps(big).encode()[:1500], json.dumps(big).encode()[1500:]])
        error_of(c.post("/v1/completions", content=streamed, headers={"content-type": "application/json"}), 413)
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def _raw_exchange(url: str, data: bytes) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; returns what came back and whether the server closed the connection
    (False: the client gave up waiting after HANG_GUARD_S / 4, so the server never cut it)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S / 4) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, False
        return received, True


def test_a_stalled_body_gets_408_and_half_sent_headers_are_cut():
    app = tiny_app(body_timeout_s=0.5)
    with running_server(app, http=h11_protocol(0.5)) as url:
        reply, closed = _raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                                      b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        assert reply.startswith(b"HTTP/1.1 408") and b"stalled" in reply and closed, reply
        assert _raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: loc") == (b"", True)  # closed, no answer
        with httpx.Client(base_url=url) as http:  # a normal keep-alive client is not affected
            for _ in range(2):
                assert http.get("/health").status_code == 200
                time.sleep(0.7)


def test_a_pause_that_outlasts_its_limit_answers_503_instead_of_hanging():
    """Requests parked behind /pause wait while the pause is within pause_timeout_s and get a 503 once it is overdue;
    one arriving after that is refused before it is queued. The limit runs on the backend's clock, driven here."""
    with local_client(pause_timeout_s=1.0) as c:
        backend = c.app_state.backend
        backend.clock = clock = FakeClock()
        manager = backend.manager
        replies = {}

        def plain():
            replies["plain"] = c.post("/v1/completions", json=COMPLETION)

        def stream():
            with c.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
                replies["stream"] = [line for line in resp.iter_lines() if line]

        assert c.post("/pause", json={}).json() == {"paused": True}
        waiting = [threading.Thread(target=fn) for fn in (plain, stream)]  # parked behind the pause
        for t in waiting:
            t.start()
        wait_for(lambda: manager.stats().queued + manager.stats().waiting >= 2, "both requests queued behind the pause")
        assert all(t.is_alive() for t in waiting) and not replies  # within the limit: they wait
        clock.advance(1.5)
        for t in waiting:
            t.join(HANG_GUARD_S)
        err = error_of(replies["plain"], 503)
        assert err["code"] == "generation_paused" and "/resume" in err["message"]
        events = replies["stream"]
        assert json.loads(events[-2][6:])["error"]["code"] == "generation_paused" and events[-1] == "data: [DONE]"
        submitted = _submitted(manager)
        assert error_of(c.post("/v1/completions", json=COMPLETION), 503)["code"] == "generation_paused"
        assert _submitted(manager) == submitted  # refused at the door, never queued
        assert c.post("/resume", json={}).json() == {"paused": False}
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        wait_for(lambda: not manager.stats().used_blocks and not manager.stats().waiting,
                 "the requests cut by the pause gave back their blocks")


def test_finished_counters_count_sequences_whose_client_left():
    """Every sequence is counted once, by how it ended, whether or not its client stayed to read it."""
    app = tiny_app()
    backend = app.state.backend
    with running_server(app) as url:
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "ignore_eos": True, "stream": True}
            for _ in range(3):  # streams left once both choices finished, before [DONE]
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    finished = 0
                    for line in resp.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                            finished += 1
                            if finished == 2:
                                break
            backend.manager.pause_generation()  # queued, then the client leaves: cancelled
            try:
                with pytest.raises(httpx.TimeoutException):
                    http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
                wait_for(lambda: backend.finished_counts().get("cancelled", 0) >= 2, "both left choices cancelled")
            finally:
                backend.manager.resume_generation()
            assert http.post("/v1/completions", json={**body, "stream": False}).status_code == 200
        wait_for(lambda: sum(backend.finished_counts().values()) >= 10, "all 10 sequences counted")
    assert backend.finished_counts() == {"length": 8, "cancelled": 2}

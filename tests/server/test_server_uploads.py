"""Chunked weight uploads are all-or-nothing and bounded: a failure of any kind in any chunk fails the whole upload
and its commit changes nothing; only real floating tensors are taken, each checked for finiteness; uploads are capped
in number, size and idle time; a chunk for an unknown upload is refused before its body is read."""

import socket

import pytest
import torch
from safetensors.torch import save

from rollout.rl.weights import StagedUpdate
from tests.helpers.models import perturbed, tiny_model
from tests.helpers.server import local_client, running_server, tiny_app
from tests.helpers.waiting import FakeClock

BINARY = {"content-type": "application/octet-stream"}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def server():
    model = tiny_model("qwen3")
    with local_client(tiny_app(model=model, max_uploads=2, upload_ttl_s=60)) as client:
        client.model = model
        yield client


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_unchanged(client, before: dict, version: int) -> None:
    assert client.app_state.backend.weight_version == version
    after = client.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before), "a refused update changed the weights"


def begin(client) -> str:
    r = client.post("/update_weights/begin", json={})
    assert r.status_code == 200, r.text
    return r.json()["update_id"]


def chunk(client, update_id: str, tensors: dict):
    return client.post("/update_weights/chunk", params={"update_id": update_id}, content=save(tensors),
                       headers=BINARY)


def failures(client) -> int:
    return client.app_state.backend.weights.counters["weight_update_failures"]


def new_state(client, seed: int) -> list[dict]:
    """A perturbed copy of the served model's weights in three chunks."""
    state = {k: v.contiguous() for k, v in perturbed(client.model, seed=seed).state_dict().items()}
    names = sorted(state)
    return [{n: state[n] for n in names[i::3]} for i in range(3)]


def nan_of(dtype: torch.dtype) -> torch.Tensor:
    value = torch.ones(tiny_model("qwen3").state_dict()[NORM].shape).to(dtype)
    value[0] = float("nan")
    return value


@pytest.mark.parametrize("bad", [
    {NORM: nan_of(torch.float8_e4m3fn)},  # torch has no finiteness reduction for float8: it used to raise
    {NORM: nan_of(torch.complex64)},  # complex values used to skip the finiteness check
    {NORM: nan_of(torch.bfloat16)},
    {NORM: torch.ones(64, dtype=torch.int32)},  # silently cast into float weights before
    {NORM: torch.ones(64, dtype=torch.bool)},
    {NORM: torch.full((64,), 1e300, dtype=torch.float64)},  # beyond float32: inf once copied
    {"model.not_a_weight": torch.ones(3)},
    {NORM: torch.ones(3)},
])
def test_any_bad_chunk_fails_the_whole_upload(server, bad):
    before, version, failed = snapshot(server.model), server.app_state.backend.weight_version, failures(server)
    first, _, last = new_state(server, seed=3)
    update_id = begin(server)
    assert chunk(server, update_id, first).status_code == 200
    r = chunk(server, update_id, bad)
    assert r.status_code == 400 and r.json()["error"]["code"] == "weight_update_rejected", r.text
    r = chunk(server, update_id, last)
    assert r.status_code == 400 and "already failed" in r.json()["error"]["message"]
    r = server.post("/update_weights/commit", json={"update_id": update_id})
    assert r.status_code == 400 and "rejected" in r.json()["error"]["message"]
    assert_unchanged(server, before, version)
    assert failures(server) == failed + 1
    assert server.app_state.backend.weights.num_open == 0


def test_an_unexpected_error_in_a_chunk_fails_the_upload_too(server, monkeypatch):
    before, version = snapshot(server.model), server.app_state.backend.weight_version
    first, second, third = new_state(server, seed=4)
    update_id = begin(server)
    assert chunk(server, update_id, first).status_code == 200

    def add(self, source):
        raise NotImplementedError("an exception nobody planned for")

    monkeypatch.setattr(StagedUpdate, "add", add)
    r = chunk(server, update_id, second)
    assert r.status_code == 400 and "NotImplementedError" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert chunk(server, update_id, third).status_code == 400
    assert server.post("/update_weights/commit", json={"update_id": update_id}).status_code == 400
    assert_unchanged(server, before, version)


def test_a_good_upload_applies_every_chunk_at_once(server):
    version = server.app_state.backend.weight_version
    chunks = new_state(server, seed=5)
    update_id = begin(server)
    for part in chunks:
        assert chunk(server, update_id, {k: v.bfloat16() for k, v in part.items()}).status_code == 200
    r = server.post("/update_weights/commit", json={"update_id": update_id, "num_tensors": sum(map(len, chunks))})
    assert r.json() == {"weight_version": version + 1}
    expected = {k: v.bfloat16().float() for part in chunks for k, v in part.items()}
    assert all(torch.equal(server.model.state_dict()[k], v) for k, v in expected.items())


def test_uploads_are_capped_in_number_and_failed_ones_do_not_count(server):
    first, second = begin(server), begin(server)
    r = server.post("/update_weights/begin", json={})
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_uploads"
    assert chunk(server, first, {NORM: torch.ones(3)}).status_code == 400  # failed: no longer holds a place
    third = begin(server)
    for update_id in (first, second, third):
        assert server.post("/update_weights/abort", json={"update_id": update_id}).json() == {"aborted": True}
    assert server.app_state.backend.weights.num_open == 0


def test_uploads_are_capped_in_size():
    model = tiny_model("qwen3")
    with local_client(tiny_app(model=model, max_upload_bytes=64 * 1024)) as client:
        client.model = model
        before = snapshot(model)
        update_id = begin(client)
        small = {NORM: torch.ones(64)}
        assert chunk(client, update_id, small).status_code == 200
        r = chunk(client, update_id, {"lm_head.weight": torch.ones(256, 64)})  # 64 KiB: over what is left
        assert r.status_code == 413 and "65536" in r.json()["error"]["message"], r.text
        assert client.post("/update_weights/commit", json={"update_id": update_id}).status_code == 400
        assert_unchanged(client, before, 0)


def test_idle_uploads_expire():
    """An upload idle past upload_ttl_s is dropped; one still in use is not (the TTL runs on the uploads' clock,
    driven here)."""
    with local_client(upload_ttl_s=0.3, max_uploads=1) as client:
        client.app_state.backend.weights.clock = clock = FakeClock()
        update_id = begin(client)
        clock.advance(0.2)
        assert chunk(client, update_id, {NORM: torch.ones(64)}).status_code == 200  # within the TTL: kept, touched
        clock.advance(0.2)
        second = client.post("/update_weights/begin", json={})  # idle 0.2 s since that chunk: still holds the place
        assert second.status_code == 429, second.text
        clock.advance(0.2)
        new_id = begin(client)  # the expired one no longer holds the only place
        r = chunk(client, update_id, {NORM: torch.ones(64)})
        assert r.status_code == 400 and "unknown weight update id" in r.json()["error"]["message"]
        assert chunk(client, new_id, {NORM: torch.ones(64)}).status_code == 200


def test_a_chunk_for_an_unknown_upload_is_refused_before_its_body_is_read():
    """200 MB announced, none sent: the answer comes at once, without waiting for (or buffering) the body."""
    with running_server(tiny_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /update_weights/chunk?update_id=nope HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/octet-stream\r\nContent-Length: 209715200\r\n\r\n")
            reply = b""
            while b"unknown weight update id" not in reply and (piece := sock.recv(65536)):
                reply += piece
    assert reply.startswith(b"HTTP/1.1 400") and b"unknown weight update id" in reply, reply

"""Who may call the server: bearer keys, the admin rule for the RL control routes, Host and Origin checks, JSON-only
POSTs (what a web page can send without a CORS preflight is refused), and weights paths confined to their roots."""

import argparse

import pytest
import uvicorn
from fastapi.testclient import TestClient

from rollout.client import RolloutClient, RolloutServerError
from rollout.server import build_parser_args, serve
from rollout.server.cli import served_name
from tests.helpers.models import perturbed, tiny_model
from tests.helpers.server import LOCAL, local_client, running_server, tiny_app
from tests.helpers.tokenizers import tiny_tokenizer

USER, ADMIN = "user-key-123", "admin-key-456"
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed():
    with local_client(api_key=USER, admin_key=ADMIN) as client:
        yield client


def test_openai_routes_need_the_api_key(keyed):
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/completions", COMPLETION), ("GET", "/weight_version", None)]:
        for headers in ({}, bearer("wrong"), {"Authorization": USER}):  # no key, a wrong one, no "Bearer"
            r = keyed.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["code"] == "invalid_api_key"
        for key in (USER, ADMIN):
            assert keyed.request(method, path, json=body, headers=bearer(key)).status_code == 200, (path, key)
    assert keyed.get("/health").status_code == 200  # load balancers probe without a key
    assert keyed.get("/openapi.json").json()["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_a_request_without_the_key_is_refused_before_its_body_is_read(keyed):
    r = keyed.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_control_routes_need_the_admin_key_and_refuse_the_api_key(keyed):
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/update_weights/begin"):
        assert keyed.post(path, json={}).status_code == 401
        r = keyed.post(path, json={}, headers=bearer(USER))
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], path
    assert keyed.post("/update_weights", json={"path": "x"}, headers=bearer(USER)).status_code == 403
    assert keyed.post("/pause", json={}, headers=bearer(ADMIN)).json() == {"paused": True}
    assert keyed.post("/resume", json={}, headers=bearer(ADMIN)).json() == {"paused": False}


def test_control_routes_are_off_on_a_public_bind_without_an_admin_key():
    with local_client(api_key=USER, host="0.0.0.0") as client:
        r = client.post("/pause", json={}, headers=bearer(USER))
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert client.app_state.backend.paused is False
        assert client.post("/v1/completions", json=COMPLETION, headers=bearer(USER)).status_code == 200


def test_on_loopback_without_an_admin_key_the_control_routes_take_the_api_key():
    with local_client(api_key=USER) as client:
        assert client.post("/pause", json={}).status_code == 401
        assert client.post("/pause", json={}, headers=bearer(USER)).json() == {"paused": True}
        assert client.post("/resume", json={}, headers=bearer(USER)).json() == {"paused": False}


@pytest.fixture(scope="module")
def open_server():
    with local_client(allowed_hosts=("rollout.internal",), cors_origins=("https://app.example",)) as client:
        yield client


@pytest.mark.parametrize("host, status", [("localhost:8000", 200), ("127.0.0.1", 200), ("[::1]:8000", 200),
                                          ("rollout.internal:80", 200), ("attacker.example", 400),
                                          ("attacker.example:8000", 400), ("127.0.0.1.nip.io", 400)])
def test_without_a_key_the_host_header_must_name_this_server(open_server, host, status):
    """A DNS-rebinding page reaches 127.0.0.1 under the attacker's name: its Host header gives it away."""
    r = open_server.get("/v1/models", headers={"host": host})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_host"
    assert open_server.get("/health", headers={"host": host}).status_code == 200  # probes use addresses of their own


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_posts_a_page_can_send_without_a_preflight_are_refused(open_server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/pause", "/update_weights/begin", "/v1/completions"):
        r = open_server.post(path, content=b"{}" if content_type else None, headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (path, r.text)
    assert open_server.app_state.backend.paused is False
    assert open_server.app_state.backend.weights.num_open == 0
    r = open_server.post("/update_weights/chunk", params={"update_id": "x"}, content=b"{}", headers={
        "content-type": "application/json"})
    assert r.status_code == 415 and "application/octet-stream" in r.json()["error"]["message"]


def test_cross_origin_requests_and_preflights(open_server):
    preflight = {"origin": "https://evil.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}
    assert open_server.options("/pause", headers=preflight).status_code in (400, 403)
    allowed = open_server.options("/v1/completions", headers={**preflight, "origin": "https://app.example"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    r = open_server.post("/pause", json={}, headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_refused"
    assert open_server.app_state.backend.paused is False
    assert open_server.get("/v1/models", headers={"origin": "http://localhost"}).status_code == 200  # same origin
    r = open_server.get("/v1/models", headers={"origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_a_post_to_a_get_route_is_a_405_not_a_content_type_error(open_server):
    assert open_server.post("/v1/models").status_code == 405


# ---------------------------------------------------------------------------------------------------- weights paths
@pytest.fixture(scope="module")
def weights_dirs(tmp_path_factory):
    root, outside = tmp_path_factory.mktemp("weights"), tmp_path_factory.mktemp("elsewhere")
    model = tiny_model("qwen3", seed=7)
    model.save_pretrained(root / "ckpt")
    model.save_pretrained(outside / "ckpt")
    (root / "link").symlink_to(outside / "ckpt")
    (root / "empty").mkdir()
    return root, outside


def test_path_updates_load_only_from_the_weights_dirs(weights_dirs):
    root, outside = weights_dirs
    with local_client(weights_dirs=(str(root),)) as client:
        refused = [str(outside / "ckpt"), str(outside / "missing"), "link", "../" + outside.name + "/ckpt",
                   str(root / "missing"), "/etc/passwd", "/etc", "ckpt/../../" + outside.name, "a\x00b", "x" * 4000]
        messages = set()
        for path in refused:
            r = client.post("/update_weights", json={"path": path})
            assert r.status_code == 400, (path, r.text)
            messages.add(r.json()["error"]["message"].replace(repr(path), "PATH"))
        assert messages == {"PATH is not a checkpoint under the server's weights directories"}, messages
        r = client.post("/update_weights", json={"path": "empty"})
        assert r.status_code == 400 and "no *.safetensors" in r.json()["error"]["message"]
        assert client.app_state.backend.weight_version == 0
        assert client.post("/update_weights", json={"path": "ckpt"}).json() == {"weight_version": 1}
        assert client.post("/update_weights", json={"path": str(root / "ckpt")}).json() == {"weight_version": 2}


def test_path_updates_are_off_without_weights_dirs(weights_dirs):
    root, _ = weights_dirs
    with local_client() as client:
        r = client.post("/update_weights", json={"path": str(root / "ckpt")})
        assert r.status_code == 400 and "--weights-dir" in r.json()["error"]["message"]
        assert client.app_state.backend.weight_version == 0


# --------------------------------------------------------------------------------------------------- rollout serve
def test_serve_shows_the_served_name_only_and_passes_the_connection_limits(tmp_path, monkeypatch):
    model_dir = tmp_path / "secret-place" / "tiny-qwen"
    tiny_model("qwen3").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    assert served_name(str(model_dir)) == "tiny-qwen" and served_name("org/model") == "org/model"
    monkeypatch.setenv("ROLLOUT_API_KEY", USER)
    args = build_parser_args(argparse.ArgumentParser()).parse_args([
        "--model", str(model_dir), "--page-size", "8", "--num-blocks", "32", "--log-level", "warning",
        "--max-header-bytes", "8192", "--header-timeout", "3"])
    launched = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: launched.update(app=app, **kw))
    serve(args)
    assert launched["h11_max_incomplete_event_size"] == 8192 and launched["limit_concurrency"] == 1024
    assert launched["http"].__name__ == "HeaderDeadlineH11Protocol"
    with TestClient(launched["app"], base_url=LOCAL) as client:
        assert client.get("/v1/models").status_code == 401  # the key came from $ROLLOUT_API_KEY
        models = client.get("/v1/models", headers=bearer(USER))
        assert models.json()["data"][0]["id"] == "tiny-qwen" and str(tmp_path) not in models.text
        r = client.post("/v1/completions", json={"model": str(model_dir), "prompt": [1, 2], "max_tokens": 1},
                        headers=bearer(USER))
        assert r.status_code == 200  # the path is still accepted as the model's name


def test_settings_refuse_one_key_for_both_roles():
    with pytest.raises(ValueError, match="must differ"):
        tiny_app(api_key="same", admin_key="same")


def test_the_client_sends_each_key_where_it_belongs(monkeypatch):
    model = tiny_model("qwen3")
    with running_server(tiny_app(model=model, api_key=USER, admin_key=ADMIN)) as url:
        monkeypatch.setenv("ROLLOUT_API_KEY", USER)
        with RolloutClient(url, timeout=30) as only_user:
            assert len(only_user.generate([1, 2, 3], max_tokens=2)) == 1
            with pytest.raises(RolloutServerError) as info:
                only_user.pause()
            assert info.value.status_code == 403
        monkeypatch.setenv("ROLLOUT_ADMIN_KEY", ADMIN)
        with RolloutClient(url, timeout=30) as both:
            both.pause()
            assert both.health()["paused"] is True
            both.resume()
            assert both.update_weights_from_model(perturbed(model, seed=2), chunk_bytes=32 * 1024) == 1
            assert both.reset_prefix_cache() >= 0

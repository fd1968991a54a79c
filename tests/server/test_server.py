"""The OpenAI-compatible server and its RL endpoints, over real HTTP on 127.0.0.1 (uvicorn in a background thread).

Clients: the official `openai` package for the OpenAI surface, `RolloutClient` for the RL endpoints, raw httpx where
the wire format itself is under test (SSE framing, malformed JSON, a client that hangs up mid-stream).
"""

import argparse
import copy
import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

import rollout.manager
from rollout import ContinuousBatchingConfig, SamplingParams, WeightUpdateError, generate_batch
from rollout.client import RolloutClient
from rollout.engine.core.request import ErrorKind, RequestOutput, RequestStatus
from rollout.engine.worker.warm_up import warm_up
from rollout.server import build_parser_args, create_app, serve
from rollout.server.errors import from_failed_output, from_invalid_request
from rollout.server.settings import ServerSettings
from rollout.validation import InvalidRequestError
from tests.helpers.models import perturbed, random_prompts, tiny_model
from tests.helpers.server import LOCAL, running_server
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.waiting import wait_for

MODEL = "tiny"
PAGE, BLOCKS = 8, 256


def _cb() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=BLOCKS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Tiny matmuls on an oversubscribed CPU are far slower with 2 intra-op threads than with 1 (threads spin-wait
    # for each other); the engine loop, the references and the test clients all share this process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = tiny_model("qwen3"), tiny_tokenizer()
    weights_dir = tmp_path_factory.mktemp("weights")
    app = create_app(model, tokenizer, MODEL, _cb(), settings=ServerSettings(weights_dirs=(str(weights_dir),)))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app, backend=app.state.backend, model=model, tokenizer=tokenizer,
                              http=httpx.Client(base_url=url, timeout=30), weights_dir=weights_dir)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def rc(server):
    with RolloutClient(server.url, timeout=30) as client:
        yield client


def metrics(server) -> dict[str, float]:
    text = server.http.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_idle(server) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free (no leak)."""

    def idle_metrics():
        m = metrics(server)
        idle = (m["rollout_num_requests_running"] == 0 and m["rollout_num_requests_waiting"] == 0
                and m["rollout_kv_cache_free_blocks"] == m["rollout_kv_cache_num_blocks"])
        return m if idle else None

    return wait_for(idle_metrics, f"server idle with every block free (last: {metrics(server)})")


def reference(server, model, prompts, max_new_tokens):
    """rollout.generate_batch's greedy tokens on a private copy of `model`, stopping on the tokenizer's EOS too."""
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, eos_token_id=server.tokenizer.eos_token_id)
    outs = generate_batch(copy.deepcopy(model), prompts, sampling_params=params, continuous_batching_config=_cb(),
                          progress_bar=False)
    return [o.generated_tokens for o in outs.values()]


def test_models_health_metrics(server, oai, rc):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    health = rc.health()
    assert health["status"] == "ok" and health["paused"] is False
    m = wait_idle(server)
    for name in ("rollout_num_requests_running", "rollout_num_requests_waiting", "rollout_kv_cache_usage_perc",
                 "rollout_generation_tokens_total", "rollout_tokens_per_second", "rollout_prefix_cache_hit_rate",
                 "rollout_weight_version"):
        assert name in m
    assert m["rollout_kv_cache_num_blocks"] == BLOCKS


def test_greedy_completions_match_generate_batch(server, oai):
    tok = server.tokenizer
    text = "w5 w9 w13 w2 w77"
    ids_a = tok(text)["input_ids"]
    ids_b = random_prompts([11], seed=5)[0]
    ref_a, ref_b = reference(server, server.model, [ids_a, ids_b], 12)

    r = oai.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                               extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ref_a
    assert choice.model_extra["prompt_token_ids"] == ids_a
    # The text continues the prompt's text: decoded after the prompt, so a word keeps its separator.
    assert text + choice.text == tok.decode(ids_a + ref_a, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids_a) and r.usage.completion_tokens == len(ref_a)

    r = oai.completions.create(model=MODEL, prompt=[ids_a, ids_b], max_tokens=12, temperature=0,
                               extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.model_extra["token_ids"] for c in r.choices] == [ref_a, ref_b]


def test_n_samples_seeded_and_rl_logprobs(server, oai):
    kwargs = dict(model=MODEL, prompt=random_prompts([9], seed=6)[0], n=4, seed=7, temperature=1.0, max_tokens=8,
                  logprobs=1, extra_body={"top_k": 20, "ignore_eos": True, "return_token_ids": True})
    first = oai.completions.create(**kwargs)
    again = oai.completions.create(**kwargs)
    tokens = [c.model_extra["token_ids"] for c in first.choices]
    assert tokens == [c.model_extra["token_ids"] for c in again.choices]
    assert len({tuple(t) for t in tokens}) > 1, "the n samples should differ"
    version = server.backend.weight_version
    for c in first.choices:
        ro = c.model_extra["rollout"]
        assert ro["token_ids"] == c.model_extra["token_ids"] and len(ro["token_ids"]) == 8
        # The OpenAI field reports the model's own logprob (temperature 1, untruncated): here the policy's.
        assert c.logprobs.token_logprobs == pytest.approx(ro["policy_logprobs"], abs=1e-5)
        lp, pol, kept = (torch.tensor(ro[k]) for k in ("logprobs", "policy_logprobs", "kept_logmass"))
        assert torch.allclose(lp, pol - kept, atol=1e-4) and bool((kept <= 1e-6).all())
        assert ro["weight_versions"] == [version] * 8
        assert c.finish_reason == "length"


def test_chat_and_streaming_chat(server, oai):
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w10 w11 w12"}]
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    content = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and content

    prompt_ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    (ref,) = reference(server, server.model, [prompt_ids], 10)
    assert content == server.tokenizer.decode(ref, skip_special_tokens=True)

    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    with server.http.stream("POST", "/v1/chat/completions", json=dict(model=MODEL, messages=messages, max_tokens=3,
                                                                      temperature=0, stream=True)) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_stop_strings_streamed_and_not(server, oai):
    prompt = random_prompts([7], seed=8)[0]
    base = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(**base).choices[0].text
    words = full.split()
    assert len(words) == 12
    stop = " ".join(words[3:5])
    expected = full[:full.find(stop)]

    cut = oai.completions.create(**base, stop=[stop]).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    streamed = list(oai.completions.create(**base, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    ("/v1/completions", {"model": "nope", "prompt": "w1"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_k": -1}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [3] * 600}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [3] * 500, "max_tokens": 100}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 300]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [-1]]}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "w1"}]}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "top_p": 2},
     "top_p"),
]


def test_bad_requests_get_openai_errors(server, oai):
    for path, body, param in BAD_REQUESTS:
        r = server.http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, (body, err)
        assert set(err) == {"message", "type", "param", "code"}
    r = server.http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="w1", temperature=-0.5)
    assert info.value.body["param"] == "temperature"
    assert server.http.get("/health").status_code == 200
    wait_idle(server)


def test_update_weights_from_model_and_rejected_update(server, rc):
    prompt = random_prompts([10], seed=9)[0]
    v0 = rc.weight_version()
    new = perturbed(server.model, seed=1)
    (ref_new,) = reference(server, new, [prompt], 10)
    assert rc.update_weights_from_model(new, chunk_bytes=64 * 1024) == v0 + 1  # several chunks
    assert rc.weight_version() == v0 + 1 == metrics(server)["rollout_weight_version"]
    (sample,) = rc.generate(prompt, max_tokens=10, temperature=0)
    assert sample["completion_ids"] == ref_new and sample["weight_versions"] == [v0 + 1] * len(ref_new)
    assert sample["prompt_ids"] == prompt and sample["finish_reason"] in ("length", "stop")

    # Good tensors first, a bad one last: the good chunks must not be applied either.
    state = dict(perturbed(new, seed=2).state_dict())
    state["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightUpdateError, match="shape"):
        rc.update_weights_from_model(state, chunk_bytes=64 * 1024)
    assert rc.weight_version() == v0 + 1
    assert rc.generate(prompt, max_tokens=10, temperature=0)[0]["completion_ids"] == ref_new
    assert metrics(server)["rollout_weight_update_failures_total"] >= 1


def test_update_weights_from_checkpoint_dir(server, rc):
    prompt = random_prompts([12], seed=10)[0]
    v0 = rc.weight_version()
    new = perturbed(server.model, seed=3)
    new.save_pretrained(server.weights_dir / "step-1")
    (ref_new,) = reference(server, new, [prompt], 10)
    assert rc.update_weights_from_path(server.weights_dir / "step-1") == v0 + 1
    assert rc.generate([prompt], max_tokens=10, temperature=0)[0]["completion_ids"] == ref_new
    with pytest.raises(WeightUpdateError):
        rc.update_weights_from_path(server.weights_dir / "missing")
    assert rc.weight_version() == v0 + 1


def test_prefix_cache_reset_and_pause_resume(server, rc):
    prompt = random_prompts([41], seed=11)[0]
    rc.generate(prompt, max_tokens=2, temperature=0)
    assert metrics(server)["rollout_prefix_cache_blocks"] >= 41 // PAGE
    assert rc.reset_prefix_cache() >= 41 // PAGE
    assert metrics(server)["rollout_prefix_cache_blocks"] == 0

    rc.pause()
    try:
        assert rc.health()["paused"] is True
        box = {}
        worker = threading.Thread(target=lambda: box.update(out=rc.generate(prompt, max_tokens=5, temperature=0)))
        worker.start()
        m = wait_for(lambda: (m := metrics(server))["rollout_num_requests_waiting"] >= 1 and m,
                     "the request queued behind the pause")  # metrics answer while paused
        assert worker.is_alive(), "a request completed while generation was paused"
        assert m["rollout_paused"] == 1
        version = rc.update_weights_from_model(server.model)  # weight updates apply while paused
    finally:
        rc.resume()
    worker.join(15)
    assert not worker.is_alive()
    (sample,) = box["out"]
    assert len(sample["completion_ids"]) == 5 and sample["weight_versions"] == [version] * 5
    wait_idle(server)


def test_disconnect_mid_stream_cancels_and_frees_blocks(server):
    before = metrics(server)
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=500, n=2, temperature=1.0, stream=True, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
    after = wait_idle(server)
    cancelled = 'rollout_request_finished_total{finish_reason="cancelled"}'
    assert after[cancelled] - before[cancelled] == 2
    assert after["rollout_generation_tokens_total"] - before["rollout_generation_tokens_total"] < 1000


def test_disconnect_while_waiting_for_a_plain_response_cancels(server, rc):
    before = metrics(server)
    rc.pause()  # the request queues, so the client surely leaves before it finishes
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", timeout=0.3,
                       json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=50, n=2))
        cancelled = 'rollout_request_finished_total{finish_reason="cancelled"}'
        wait_for(lambda: metrics(server)[cancelled] - before[cancelled] >= 2,  # the server's disconnect poll
                 "the abandoned request cancelled")
    finally:
        rc.resume()
    after = wait_idle(server)
    assert after["rollout_generation_tokens_total"] == before["rollout_generation_tokens_total"]


def test_load_200_requests_from_20_clients(server, oai):
    prompts = random_prompts([5 + i % 16 for i in range(200)], seed=12)
    before = metrics(server)

    def one(i: int):
        r = oai.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=1.0, seed=i,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        return len(r.choices[0].model_extra["token_ids"])

    with ThreadPoolExecutor(20) as pool:
        lengths = list(pool.map(one, range(200)))
    assert lengths == [6] * 200
    assert server.http.get("/health").json()["status"] == "ok"
    after = wait_idle(server)
    assert after["rollout_generation_tokens_total"] - before["rollout_generation_tokens_total"] == 1200
    # Serialized requests would need 6 steps each (1200); continuous batching shares steps between them.
    assert after["rollout_engine_steps_total"] - before["rollout_engine_steps_total"] < 900
    server.backend.engine.check_invariants()


def test_engine_side_failures_map_to_400(server, monkeypatch):
    """What slips past the server's checks is failed by the engine alone; that still reaches the client as a 400."""
    monkeypatch.setattr(server.app.state.server.jobs, "check_prompt", lambda *args: None)
    body = dict(model=MODEL, prompt=[1, 999], max_tokens=3)
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert "vocabulary" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
    assert server.http.post("/v1/completions", json=dict(model=MODEL, prompt=[1, 2], max_tokens=2)).status_code == 200
    wait_idle(server)


@pytest.mark.parametrize("kind, status", [(ErrorKind.INVALID_REQUEST, 400), (ErrorKind.CAPACITY, 400),
                                          (ErrorKind.FORWARD, 500), (ErrorKind.SHUTDOWN, 503), (None, 500)])
def test_a_failed_sequence_fails_its_request_by_error_kind(kind, status):
    out = RequestOutput(request_id="r", prompt_ids=[1], status=RequestStatus.FAILED, error="why", error_kind=kind)
    err = from_failed_output(out)
    assert err.status_code == status and err.message == "why"
    assert err.body()["error"]["type"] == {400: "invalid_request_error", 500: "internal_server_error",
                                           503: "service_unavailable_error"}[status]


def test_engine_rejections_name_the_openai_field():
    err = from_invalid_request(InvalidRequestError("min_new_tokens must be >= 0", "min_new_tokens"), "prompt")
    assert err.param == "min_tokens" and "'min_tokens'" in err.message
    err = from_invalid_request(InvalidRequestError("too long", "max_new_tokens", "context_length_exceeded"),
                               "messages")
    assert err.param == "messages" and err.code == "context_length_exceeded"  # OpenAI names the prompt
    assert from_invalid_request(InvalidRequestError("empty", "prompt", "empty_prompt"), "messages").param == "messages"


def test_requests_cut_by_a_shutdown_answer_503():
    """A hard stop fails queued requests with ErrorKind.SHUTDOWN: a 503 for a plain request, an error event for a
    stream; neither is left waiting."""
    app = create_app(tiny_model("qwen3"), tiny_tokenizer(), MODEL, _cb())
    body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    replies: dict = {}

    def plain(client):
        replies["plain"] = client.post("/v1/completions", json=body)

    def stream(client):
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            replies["stream"] = [line for line in resp.iter_lines() if line]

    with TestClient(app, base_url=LOCAL) as client:
        backend = app.state.backend
        assert client.post("/pause", json={}).json() == {"paused": True}
        threads = [threading.Thread(target=fn, args=(client,)) for fn in (plain, stream)]
        for t in threads:
            t.start()
        wait_for(lambda: backend.manager.stats().queued >= 2, "both requests reached the manager")
        backend.manager.stop(hard_stop=True, timeout=30)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a request hung after the shutdown"
    assert replies["plain"].status_code == 503
    assert replies["plain"].json()["error"]["type"] == "service_unavailable_error"
    error = json.loads(replies["stream"][-2][6:])["error"]
    assert error["type"] == "service_unavailable_error" and "hard-stopped" in error["message"]
    assert replies["stream"][-1] == "data: [DONE]"
    assert backend.finished_counts()["error"] == 2


def test_serve_loads_a_local_checkpoint(tmp_path, monkeypatch, caplog):
    """`build_parser_args` + `serve(args)`: load a save_pretrained directory and hand uvicorn a working app."""
    tiny_model("qwen3").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    parser = build_parser_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tmp_path), "--port", "8123", "--page-size", "8", "--num-blocks", "32",
                              "--served-model-name", "ckpt", "--log-level", "warning"])
    assert args.host == "127.0.0.1"
    launched, warmed = {}, []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: launched.update(app=app, **kw))
    monkeypatch.setattr(rollout.manager, "warm_up", lambda *a, **kw: warmed.append(warm_up(*a, **kw)) or warmed[-1])
    with caplog.at_level("INFO", logger="rollout.server.cli"):
        serve(args)
    assert "the first steps compile the forward (--compile-level 1; 0 starts faster" in caplog.text
    assert launched["port"] == 8123 and launched["host"] == "127.0.0.1"
    # warmed up before listening, within the 256 tokens of KV asked for, and nothing of it shows
    assert len(warmed) == 1 and max(warmed[0].prompt_lengths) == 248  # 248 + 2 tokens fit in 256
    # the CPU default: the forward compiled, its graphs built by the warm-up
    engine = launched["app"].state.backend.manager.engine
    assert engine.config.default_compile_level == 1 and engine.runner.compiled.paths
    stats = launched["app"].state.backend.manager.stats()
    assert stats.steps == 0 and stats.cached_blocks == 0 and stats.generated_tokens == 0
    with TestClient(launched["app"], base_url=LOCAL) as client:  # runs the lifespan: the backend is closed on exit
        r = client.post("/v1/completions", json=dict(model="ckpt", prompt="w1 w2", max_tokens=4, temperature=0,
                                                     ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        assert client.get("/v1/models").json()["data"][0]["id"] == "ckpt"
    assert not launched["app"].state.backend.healthy()


def test_serve_options_map_to_the_engine_config():
    """Each engine option of `rollout serve` reaches ContinuousBatchingConfig; unset ones keep the config's defaults."""
    from rollout.server.cli import continuous_batching_config_from_args

    parser = build_parser_args(argparse.ArgumentParser())
    config = continuous_batching_config_from_args(parser.parse_args([
        "--model", "m", "--compile-level", "1", "--max-batch-tokens", "512", "--cpu-threads", "1"]))
    assert (config.default_compile_level, config.max_batch_tokens, config.cpu_threads) == (1, 512, 1)
    default = continuous_batching_config_from_args(parser.parse_args(["--model", "m"]))
    assert default.default_compile_level == 1 and default.max_batch_tokens is None and default.cpu_threads == "auto"
    eager = continuous_batching_config_from_args(parser.parse_args(["--model", "m", "--compile-level", "0"]))
    assert eager.default_compile_level == 0  # asked for: kept
    on_gpu = continuous_batching_config_from_args(parser.parse_args(["--model", "m"]), device="cuda")
    assert on_gpu.default_compile_level == 0  # compile levels are CPU-only: the config's default elsewhere
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--compile-level", "4"])
    assert parser.parse_args(["--model", "m"]).warmup_tokens == 512
    assert parser.parse_args(["--model", "m", "--warmup-tokens", "0"]).warmup_tokens == 0  # no warm-up
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--warmup-tokens", "-1"])


def test_serve_default_is_eager_without_a_cpp_compiler(monkeypatch, caplog):
    """No C++ compiler for inductor: the CPU default drops to eager, and says so, instead of failing every compile."""
    from rollout.engine.worker import compiled_forward
    from rollout.server.cli import continuous_batching_config_from_args

    parser = build_parser_args(argparse.ArgumentParser())
    monkeypatch.setattr(compiled_forward, "cpp_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="rollout.server.cli"):
        config = continuous_batching_config_from_args(parser.parse_args(["--model", "m"]))
    assert config.default_compile_level == 0
    assert "no C++ compiler for torch.compile" in caplog.text
    asked = continuous_batching_config_from_args(parser.parse_args(["--model", "m", "--compile-level", "1"]))
    assert asked.default_compile_level == 1  # an explicit level is the user's call
    monkeypatch.setattr(compiled_forward, "cpp_compiler", lambda: "g++")
    assert continuous_batching_config_from_args(parser.parse_args(["--model", "m"])).default_compile_level == 1


def test_cpp_compiler_is_inductors_search():
    """cpp_compiler() follows inductor's own compiler setting: a missing compiler gives None, not an exception."""
    from torch._inductor import config as inductor_config

    from rollout.engine.worker.compiled_forward import cpp_compiler

    with inductor_config.patch({"cpp.cxx": (None, "rollout-no-such-compiler")}):
        assert cpp_compiler() is None
    with inductor_config.patch({"cpp.cxx": (None, "g++")}):
        assert (cpp_compiler() is not None) == (shutil.which("g++") is not None)


# ------------------------------------------------------------------------------------------------------ /health
class BreakableForward:
    """A forward pre-hook that raises while `broken` is set, the way a bf16 matmul fails on a CPU without bf16
    kernels: every forward of the model fails, and the engine keeps serving (failing each step's requests)."""

    MESSAGE = "\"addmm_impl_cpu_\" not implemented for 'BFloat16'"

    def __init__(self, model, broken: bool = True) -> None:
        self.broken = broken
        model.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        if self.broken:
            raise RuntimeError(self.MESSAGE)


def _health(client) -> tuple[int, dict]:
    r = client.get("/health")
    return r.status_code, r.json()


def test_health_is_degraded_while_forwards_fail_and_ok_after_one_succeeds():
    model = tiny_model("qwen3")
    forward = BreakableForward(model)
    app = create_app(model, tiny_tokenizer(), MODEL, _cb())
    body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    with TestClient(app, base_url=LOCAL) as client:
        code, state = _health(client)
        assert code == 200 and state["status"] == "ok"  # nothing ran yet: no evidence against the model

        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "BFloat16" in r.json()["error"]["message"]
        code, state = _health(client)
        assert code == 503 and state["status"] == "degraded"
        assert state["consecutive_failures"] >= 1 and "BFloat16" in state["last_error"]
        assert "model forward failed" in state["reason"] and "BFloat16" in state["reason"]
        assert state["error"]["message"] == state["reason"]  # what RolloutClient.health() raises with
        assert state["error"]["type"] == "service_unavailable_error"
        assert state["last_success_time"] is None and state["last_error_time"] is not None

        assert client.post("/v1/completions", json=body).status_code == 500
        code, state = _health(client)
        assert code == 503 and state["consecutive_failures"] >= 2 and "model forwards failed" in state["reason"]
        failed_at = state["last_error_time"]

        forward.broken = False
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        code, state = _health(client)
        assert code == 200 and state["status"] == "ok" and "reason" not in state
        assert state["consecutive_failures"] == 0
        assert "BFloat16" in state["last_error"] and state["last_success_time"] >= failed_at  # history is kept


def test_health_recovers_without_traffic_through_its_probe():
    """A load balancer stops sending requests to a 503 server; /health's own probe forward lets it come back."""
    model = tiny_model("qwen3")
    forward = BreakableForward(model)
    app = create_app(model, tiny_tokenizer(), MODEL, _cb())
    with TestClient(app, base_url=LOCAL) as client:
        assert client.post("/v1/completions", json=dict(model=MODEL, prompt=[1, 2], max_tokens=2)).status_code == 500
        forward.broken = False

        def recovered():
            state = _health(client)
            assert state[0] == 200 or state[1]["status"] == "degraded", state
            return state if state[0] == 200 else None

        state = wait_for(recovered, "/health back to 200 through its probe")
        assert state[1]["status"] == "ok"
        engine = app.state.backend.engine
        assert engine.counters["forward_errors"] == 1 and not engine.health.failing
        assert app.state.backend.finished.total() == 1  # the probe is not counted as a served request


def test_serve_with_a_broken_bf16_forward_answers_500_and_health_503(tmp_path, monkeypatch):
    """`rollout serve --dtype bfloat16` on a CPU whose bf16 forwards fail: completions 500, /health 503 with why."""
    tiny_model("qwen3").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    args = build_parser_args(argparse.ArgumentParser()).parse_args([
        "--model", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu", "--page-size", "8", "--num-blocks", "32",
        "--log-level", "warning", "--compile-level", "0"])  # eager: BreakableForward patches the module's forward
    launched = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: launched.update(app=app, **kw))
    serve(args)
    app = launched["app"]
    assert app.state.backend.model.dtype == torch.bfloat16
    BreakableForward(app.state.backend.model)
    with TestClient(app, base_url=LOCAL) as client:
        r = client.post("/v1/completions", json=dict(model=str(tmp_path), prompt="w1 w2", max_tokens=4))
        assert r.status_code == 500 and "model forward failed" in r.json()["error"]["message"]
        code, state = _health(client)
        assert code == 503 and state["status"] == "degraded" and "BFloat16" in state["error"]["message"]
    code, state = _health(TestClient(app, base_url=LOCAL))  # after shutdown (lifespan ended): unhealthy for good
    assert code == 503 and state["status"] == "unhealthy" and "shutting down" in state["reason"]

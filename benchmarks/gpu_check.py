"""The stages of `benchmarks/gpu_check.sh`: what one lent GPU machine should tell us, as JSON, in one run.

    python benchmarks/gpu_check.py env    --out DIR   # versions, optional packages, SDPA kernels per call form
    python benchmarks/gpu_check.py syncs  --out DIR   # host syncs of one decode step and one mixed step, file:line
    python benchmarks/gpu_check.py bench  --out DIR   # bf16 throughput vs transformers, step split, page sizes
    python benchmarks/gpu_check_table.py  --out DIR   # one table from the stages' JSON (and the tests')

`--dry-run` runs every stage on the CPU with a tiny model and tiny workloads: it checks the plumbing (CI runs it),
not the numbers. Each stage writes `DIR/<stage>.json`; a stage that fails still writes its error there, so the table
shows what ran.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from benchmarks.common import REPO_ROOT, environment
from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams, generate_batch

# Qwen3-0.6B's shape (random weights): the ~0.5B model the bench stage measures.
REAL_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=4096)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512)
OPTIONAL_PACKAGES = ("flash_attn", "xgrammar", "triton", "accelerate", "trl", "psutil", "tqdm", "fastapi", "uvicorn",
                     "pytest", "hypothesis", "safetensors", "tokenizers", "numpy")


class Setup:
    """Device, dtype and sizes of one run: the real thing on CUDA, a tiny stand-in for `--dry-run`."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.shape = TINY_SHAPE if dry_run else REAL_SHAPE
        self.prompts, self.prompt_len, self.new_tokens = (4, 16, 8) if dry_run else (64, 128, 128)
        self.step_rows = (1, 2) if dry_run else (1, 32, 256)
        self.page_sizes = (16,) if dry_run else (16, 64, 256)
        self.timed_steps = 1 if dry_run else 10

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model(self):
        torch.manual_seed(0)
        with torch.device(self.device):
            model = Qwen3ForCausalLM(Qwen3Config(**self.shape, eos_token_id=None, bos_token_id=None,
                                                 pad_token_id=None))
        return model.to(self.dtype).eval().requires_grad_(False)

    def workload(self, count: int | None = None, length: int | None = None) -> list[list[int]]:
        g = torch.Generator().manual_seed(0)
        vocab = self.shape["vocab_size"]
        return torch.randint(0, vocab, (count or self.prompts, length or self.prompt_len), generator=g).tolist()


# ------------------------------------------------------------------------------------------------------------ env
def sdpa_kernels(device: torch.device, dtype: torch.dtype) -> dict[str, dict[str, str]]:
    """Which SDPA backends accept each call form the engine can make (decode: 32 rows over 512 keys, 16 query
    heads on 8 KV heads; prefill: 256 tokens). 'ok' or the first line of the refusal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, heads, kv_heads, dim, width = 32, 16, 8, 64, 512
    groups = heads // kv_heads
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    keys = mk(rows, kv_heads, width, dim)
    mask = torch.ones(rows, 1, 1, width, dtype=torch.bool, device=device)
    causal = torch.ones(256, 256, dtype=torch.bool, device=device).tril()
    forms = {
        "decode, enable_gqa + bool mask": lambda: F.scaled_dot_product_attention(
            mk(rows, heads, 1, dim), keys, keys, attn_mask=mask, enable_gqa=True),
        "decode, heads grouped per KV head + bool mask": lambda: F.scaled_dot_product_attention(
            mk(rows, kv_heads, groups, dim), keys, keys, attn_mask=mask),
        "prefill, expanded K/V + bool mask": lambda: F.scaled_dot_product_attention(
            mk(1, heads, 256, dim), mk(1, heads, 256, dim), mk(1, heads, 256, dim), attn_mask=causal),
        "prefill, expanded K/V, is_causal": lambda: F.scaled_dot_product_attention(
            mk(1, heads, 256, dim), mk(1, heads, 256, dim), mk(1, heads, 256, dim), is_causal=True),
    }
    backends = {b.name: b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                    getattr(SDPBackend, "CUDNN_ATTENTION", None), SDPBackend.MATH) if b is not None}
    out: dict[str, dict[str, str]] = {}
    for form, call in forms.items():
        out[form] = {}
        for name, backend in backends.items():
            try:
                with warnings.catch_warnings(), sdpa_kernel(backend):
                    warnings.simplefilter("ignore")
                    call()
                out[form][name] = "ok"
            except RuntimeError as err:
                out[form][name] = str(err).strip().splitlines()[0][:120] if str(err).strip() else "refused"
    return out


def stage_env(setup: Setup) -> dict:
    import transformers  # noqa: F401  (its version is in environment())

    packages = {}
    for name in OPTIONAL_PACKAGES:
        try:
            module = importlib.import_module(name)
            packages[name] = getattr(module, "__version__", "present")
        except Exception as err:  # ImportError, or a compiled wheel that fails to load
            packages[name] = f"missing ({type(err).__name__})"
    cuda = {}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        cuda = dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    cuda=torch.version.cuda, free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
    default_page = ContinuousBatchingConfig().for_device(setup.device).page_size
    return dict(env=environment(), cuda=cuda, packages=packages, engine_default_page_size=default_page,
                sdpa_kernels=sdpa_kernels(setup.device, setup.dtype))


# ---------------------------------------------------------------------------------------------------------- syncs
def _engine(setup: Setup, model, page_size: int | None = None) -> LLMEngine:
    return LLMEngine(model, config=ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=4096,
                                                            num_blocks=2048 if setup.dry_run else None))


def _submit(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1, max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, sampling_params=params)


def _decoding(engine: LLMEngine, rows: int) -> bool:
    """True once every live sequence has its prompt in the cache (the next step is decode-only)."""
    live = list(engine.requests.values())
    return len(live) == rows and all(r.num_generated >= 1 for r in live)


def _repo_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of this repository (else the innermost frame) as 'path:line (function)'."""
    ours = [f for f in stack if f.filename.startswith(str(REPO_ROOT)) and "/benchmarks/" not in f.filename]
    frame = (ours or stack)[-1]
    path = Path(frame.filename)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return f"{shown}:{frame.lineno} ({frame.name})"


def audit_step(setup: Setup, engine: LLMEngine) -> dict:
    """One engine step under CUDA's sync debug mode: every synchronizing call, counted by the repository line that
    made it."""
    if setup.device.type != "cuda":
        engine.step()
        return dict(available=False, reason="torch.cuda.set_sync_debug_mode needs CUDA (plumbing only)", sites={})
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_repo_site(traceback.extract_stack()[:-1])] += 1

    setup.sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(available=True, total=sum(sites.values()), sites=dict(sites.most_common()))


def stage_syncs(setup: Setup) -> dict:
    model = setup.model()
    engine = _engine(setup, model)
    rows = 8
    _submit(engine, setup.workload(rows), 64)
    while not _decoding(engine, rows):
        engine.step()
    engine.step()  # one plain decode step first: anything lazily built on the first decode is not counted
    decode = audit_step(setup, engine)
    _submit(engine, setup.workload(1, setup.prompt_len * 2), 8)  # a prompt joins the decoding rows
    mixed = audit_step(setup, engine)
    return {"decode step (8 rows)": decode, "mixed step (8 decode rows + one prefill)": mixed}


# ---------------------------------------------------------------------------------------------------------- bench
def _timed(setup: Setup, fn) -> float:
    setup.sync()
    start = time.perf_counter()
    fn()
    setup.sync()
    return time.perf_counter() - start


def throughput(setup: Setup, model, prompts: list[list[int]]) -> dict[str, dict]:
    """Generated tokens/s of our engine, transformers' continuous batching and model.generate on one workload
    (greedy, no EOS, fixed lengths), each after one warm-up call (none in a dry run)."""
    n = setup.new_tokens
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    def ours():
        generate_batch(model, prompts, gen, ContinuousBatchingConfig(), progress_bar=False)

    def hf_cb():
        kwargs = {}
        if setup.device.type == "cpu":  # its defaults size the cache and masks for a GPU; older versions lack this
            from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFBatchingConfig

            kwargs["continuous_batching_config"] = HFBatchingConfig(num_blocks=64, max_batch_tokens=128)
        model.generate_batch(prompts, generation_config=gen, progress_bar=False, **kwargs)

    def hf_generate():
        ids = torch.tensor(prompts, device=setup.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)

    results = {}
    for name, fn in (("rollout engine", ours), ("transformers continuous batching", hf_cb),
                     ("model.generate", hf_generate)):
        try:
            if not setup.dry_run:
                fn()  # warm-up
            seconds = _timed(setup, fn)
            results[name] = dict(seconds=round(seconds, 3), tok_s=round(len(prompts) * n / seconds, 1))
        except Exception as err:
            results[name] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
    return results


def step_split(setup: Setup, model, rows: int, page_size: int | None = None) -> dict:
    """Mean ms per decode step at `rows` rows, split into schedule / build / forward / sample (a sync at each phase
    boundary), and the step without those syncs."""
    engine = _engine(setup, model, page_size)
    _submit(engine, setup.workload(rows), 4 * setup.timed_steps + 8)
    while not _decoding(engine, rows):
        engine.step()
    engine.step()
    plain = _timed(setup, lambda: [engine.step() for _ in range(setup.timed_steps)]) / setup.timed_steps
    totals: Counter[str] = Counter()
    runner, scheduler, sampler = engine.runner, engine.scheduler, engine.sampler

    def phase(name, fn):
        def wrapped(*args, **kwargs):
            setup.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            setup.sync()
            totals[name] += time.perf_counter() - start
            return out
        return wrapped

    scheduler.schedule = phase("schedule", scheduler.schedule)
    runner.build_batch = phase("build", runner.build_batch)
    runner.build_step = phase("build", runner.build_step)
    runner.run = phase("run", runner.run)
    sampler.sample = phase("sample", sampler.sample)
    split = _timed(setup, lambda: [engine.step() for _ in range(setup.timed_steps)]) / setup.timed_steps
    ms = {k: 1000 * v / setup.timed_steps for k, v in totals.items()}
    return dict(rows=rows, page_size=engine.cache.page_size, step_ms=round(1000 * plain, 3),
                step_ms_with_phase_syncs=round(1000 * split, 3), schedule_ms=round(ms.get("schedule", 0), 3),
                build_ms=round(ms.get("build", 0), 3), forward_ms=round(ms.get("run", 0) - ms.get("build", 0), 3),
                sample_ms=round(ms.get("sample", 0), 3))


def stage_bench(setup: Setup) -> dict:
    model = setup.model()
    params = sum(p.numel() for p in model.parameters())
    out = dict(model=dict(shape="tiny (dry run)" if setup.dry_run else "Qwen3-0.6B (random weights)", params=params,
                          dtype=str(setup.dtype), device=str(setup.device)),
               workload=dict(prompts=setup.prompts, prompt_len=setup.prompt_len, new_tokens=setup.new_tokens))
    out["throughput"] = throughput(setup, model, setup.workload())
    out["decode_steps"] = [step_split(setup, model, rows) for rows in setup.step_rows]
    out["page_sizes"] = [step_split(setup, model, setup.step_rows[-1] if setup.dry_run else 32, size)
                         for size in setup.page_sizes]
    return out


STAGES = {"env": stage_env, "syncs": stage_syncs, "bench": stage_bench}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--out", type=Path, required=True, help="folder for the stage's JSON")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: checks the plumbing, not the numbers")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = STAGES[args.stage](Setup(args.dry_run))
        code = 0
    except Exception as err:
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        code = 1
    (args.out / f"{args.stage}.json").write_text(json.dumps(result, indent=2, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())

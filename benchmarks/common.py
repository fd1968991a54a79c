"""Shared pieces of the benchmarks: the W1 model, the W1 workload, RSS measurement and small formatting helpers.

Everything is built locally from configs and seeds (no hub, no network), so every system in a run sees exactly the same
weights and the same requests.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/x.py` from anywhere imports this checkout's `rollout`
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.tables import format_table  # noqa: E402  (re-exported: the scripts import it from here)

# --------------------------------------------------------------------------------------------------------- the model
# Qwen3 architecture, about 25.7M parameters (tied embeddings).
MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise SystemExit(f"unknown --dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def model_config(attn_implementation: str = "sdpa"):
    from transformers import Qwen3Config

    config = Qwen3Config(**MODEL_CONFIG)
    config._attn_implementation = attn_implementation
    return config


def build_model(dtype: str | torch.dtype = "float32", attn_implementation: str = "sdpa", seed: int = 0):
    """The W1 model: Qwen3ForCausalLM from `MODEL_CONFIG`, weights drawn with `torch.manual_seed(seed)`, eval mode."""
    from transformers import Qwen3ForCausalLM

    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(model_config(attn_implementation)).eval()
    model.requires_grad_(False)
    return model.to(dtype)


def word_tokenizer(eos_id: int | None = None, vocab_size: int = MODEL_CONFIG["vocab_size"]):
    """Word-level tokenizer over the model's ids: id i <-> "t{i}" (id 0 is the pad token), plus "</s>" = `eos_id`
    (default: one past the model's vocabulary, so a model can never sample it and every completion runs to its
    length limit). Text prompts written as "t12 t7 ..." map back to exactly those ids in every system.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos_id = vocab_size if eos_id is None else eos_id
    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab_size) if i != eos_id}, "</s>": eos_id}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def ids_as_text(ids) -> str:
    """The text `word_tokenizer` encodes to exactly `ids`."""
    return " ".join("<pad>" if t == 0 else f"t{t}" for t in ids)


def save_checkpoint(model, directory: Path) -> None:
    """`model` and a `word_tokenizer` over its vocabulary as a checkpoint directory, for systems that load from disk
    (servers, vLLM). EOS is outside the vocabulary: completions run to their length limit."""
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    word_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(directory)


def save_w1_checkpoint(directory: Path, dtype: str = "float32") -> None:
    """The W1 model as a checkpoint directory (see `save_checkpoint`)."""
    save_checkpoint(build_model(dtype), directory)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------ the workload
@dataclass
class Workload:
    """W1: `num_prompts` prompts x `samples` samples; sequence i is sample `i % samples` of prompt `i // samples`."""

    prompts: list[list[int]]
    samples: int
    max_new_tokens: list[int]  # per sequence, len == len(prompts) * samples
    seed: int
    scale: float
    description: str = ""
    extra: dict = field(default_factory=dict)
    temperature: float = 1.0  # every system samples with these (top_k off): W1 and GRPO plain, W2 nucleus
    top_p: float = 1.0

    @property
    def num_sequences(self) -> int:
        return len(self.max_new_tokens)

    def sequences(self) -> list[tuple[int, list[int], int]]:
        """(prompt index, prompt ids, max_new_tokens) for every sequence, in submission order."""
        return [(i // self.samples, self.prompts[i // self.samples], n) for i, n in enumerate(self.max_new_tokens)]

    @property
    def requested_tokens(self) -> int:
        return sum(self.max_new_tokens)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all sequences (what a system without prefix sharing prefills)."""
        return sum(len(p) for _, p, _ in self.sequences())

    def summary(self) -> dict:
        lens = [len(p) for p in self.prompts]
        mnt = np.array(self.max_new_tokens)
        return dict(
            prompts=len(self.prompts), samples=self.samples, sequences=self.num_sequences,
            prompt_len_min=min(lens), prompt_len_max=max(lens), prompt_len_mean=round(float(np.mean(lens)), 1),
            max_new_min=int(mnt.min()), max_new_median=float(np.median(mnt)), max_new_mean=round(float(mnt.mean()), 1),
            max_new_max=int(mnt.max()), requested_tokens=self.requested_tokens,
            unique_prompt_tokens=sum(lens), all_prompt_tokens=self.prompt_tokens, seed=self.seed, scale=self.scale,
            temperature=self.temperature, top_p=self.top_p)


W1_PROMPTS = 32
W1_SAMPLES = 8
W1_PROMPT_LEN = (16, 128)  # inclusive
W1_MEDIAN_NEW = 64.0
W1_SIGMA = 0.6  # lognormal sigma of max_new_tokens: ~1% of samples clip at each end
W1_NEW_CLIP = (16, 256)


def build_w1(scale: float = 1.0, seed: int = 0, vocab_size: int = MODEL_CONFIG["vocab_size"]) -> Workload:
    """W1, shaped like one GRPO step: 32 prompts of 16-128 random ids, 8 samples each, per-sample max_new_tokens.

    `scale` keeps the first `round(32 * scale)` prompts (at least 1) of the full workload, so a scaled run is a prefix
    of the full one, with the same lengths and budgets.
    """
    rng = np.random.default_rng(seed)
    lens = rng.integers(W1_PROMPT_LEN[0], W1_PROMPT_LEN[1] + 1, size=W1_PROMPTS)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lens]
    new = rng.lognormal(mean=math.log(W1_MEDIAN_NEW), sigma=W1_SIGMA, size=W1_PROMPTS * W1_SAMPLES)
    new = np.clip(np.rint(new), *W1_NEW_CLIP).astype(int).tolist()
    keep = max(1, min(W1_PROMPTS, round(W1_PROMPTS * scale)))
    return Workload(
        prompts=prompts[:keep], samples=W1_SAMPLES, max_new_tokens=new[:keep * W1_SAMPLES], seed=seed, scale=scale,
        description=(f"W1: {keep} prompts x {W1_SAMPLES} samples, prompt len U[{W1_PROMPT_LEN[0]},{W1_PROMPT_LEN[1]}], "
                     f"max_new_tokens lognormal(median {W1_MEDIAN_NEW:g}, sigma {W1_SIGMA}) clipped to "
                     f"{list(W1_NEW_CLIP)}, EOS ignored, temperature 1"))


GRPO_PROMPTS = 16
GRPO_SAMPLES = 4
GRPO_PROMPT_LEN = (64, 256)  # inclusive
GRPO_MEDIAN_NEW = 64.0
GRPO_SIGMA = 0.8  # a longer tail than W1's: a few completions run 4-5x the median
GRPO_NEW_CLIP = (8, 384)


def build_grpo(vocab_size: int, scale: float = 1.0, seed: int = 0, samples: int = GRPO_SAMPLES) -> Workload:
    """A GRPO step at a real model's size: 16 prompts of 64-256 random ids, groups of `samples` (4-8 in GRPO
    recipes), long-tailed per-sample max_new_tokens. About 5k generated tokens at the default group of 4, so a
    several-hundred-million-parameter model finishes in tens of seconds on two cores. `scale` keeps a prefix of the
    prompts, as in `build_w1`."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(GRPO_PROMPT_LEN[0], GRPO_PROMPT_LEN[1] + 1, size=GRPO_PROMPTS)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lens]
    new = rng.lognormal(mean=math.log(GRPO_MEDIAN_NEW), sigma=GRPO_SIGMA, size=GRPO_PROMPTS * samples)
    new = np.clip(np.rint(new), *GRPO_NEW_CLIP).astype(int).tolist()
    keep = max(1, min(GRPO_PROMPTS, round(GRPO_PROMPTS * scale)))
    return Workload(
        prompts=prompts[:keep], samples=samples, max_new_tokens=new[:keep * samples], seed=seed, scale=scale,
        description=(f"GRPO: {keep} prompts x {samples} samples, prompt len U[{GRPO_PROMPT_LEN[0]},"
                     f"{GRPO_PROMPT_LEN[1]}], max_new_tokens lognormal(median {GRPO_MEDIAN_NEW:g}, sigma {GRPO_SIGMA}) "
                     f"clipped to {list(GRPO_NEW_CLIP)}, EOS ignored, temperature 1"))


W2_PREFIXES = 4  # few-shot templates: each opens 8 of the 32 prompts
W2_PREFIX_LEN = 200
W2_SUFFIX_LEN = (16, 64)  # inclusive: the question after the shared template
W2_MEDIAN_NEW = 48.0
W2_SIGMA = 1.0  # a long tail: about 1 completion in 20 runs 5x the median or more
W2_NEW_CLIP = (4, 384)
W2_TEMPERATURE, W2_TOP_P = 0.8, 0.95


def build_w2(scale: float = 1.0, seed: int = 0, vocab_size: int = MODEL_CONFIG["vocab_size"]) -> Workload:
    """W2, an RL step over templated prompts: W1's 32 prompts x 8 samples, but every prompt opens with one of 4
    shared 200-token prefixes, nucleus sampling (temperature 0.8, top_p 0.95) and a longer tail of lengths. It
    measures prefix sharing across requests and the truncated sampler, which W1's plain sampling never runs.
    `scale` keeps a prefix of the prompts, as in `build_w1`."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=W2_PREFIX_LEN).tolist() for _ in range(W2_PREFIXES)]
    lens = rng.integers(W2_SUFFIX_LEN[0], W2_SUFFIX_LEN[1] + 1, size=W1_PROMPTS)
    prompts = [prefixes[j % W2_PREFIXES] + rng.integers(0, vocab_size, size=int(n)).tolist()
               for j, n in enumerate(lens)]
    new = rng.lognormal(mean=math.log(W2_MEDIAN_NEW), sigma=W2_SIGMA, size=W1_PROMPTS * W1_SAMPLES)
    new = np.clip(np.rint(new), *W2_NEW_CLIP).astype(int).tolist()
    keep = max(1, min(W1_PROMPTS, round(W1_PROMPTS * scale)))
    return Workload(
        prompts=prompts[:keep], samples=W1_SAMPLES, max_new_tokens=new[:keep * W1_SAMPLES], seed=seed, scale=scale,
        temperature=W2_TEMPERATURE, top_p=W2_TOP_P,
        description=(f"W2: {keep} prompts x {W1_SAMPLES} samples, {W2_PREFIXES} shared {W2_PREFIX_LEN}-token prefixes "
                     f"+ suffixes U[{W2_SUFFIX_LEN[0]},{W2_SUFFIX_LEN[1]}], max_new_tokens lognormal(median "
                     f"{W2_MEDIAN_NEW:g}, sigma {W2_SIGMA}) clipped to {list(W2_NEW_CLIP)}, EOS ignored, "
                     f"temperature {W2_TEMPERATURE}, top_p {W2_TOP_P}"))


def build_warmup(vocab_size: int = MODEL_CONFIG["vocab_size"]) -> Workload:
    """A tiny run to pay one-off costs (lazy imports, allocator, kernels) before timing: 2 prompts x 2 samples."""
    rng = np.random.default_rng(12345)
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in (40, 20)]
    return Workload(prompts=prompts, samples=2, max_new_tokens=[8, 5, 6, 7], seed=12345, scale=0.0,
                    description="warm-up")


def useful_tokens(asked: list[int], produced: list[int]) -> tuple[int, int]:
    """(sum of min(asked, produced), number of sequences that produced fewer tokens than asked)."""
    useful = sum(min(a, p) for a, p in zip(asked, produced, strict=True))
    short = sum(1 for a, p in zip(asked, produced, strict=True) if p < a)
    return useful, short


# ------------------------------------------------------------------------------------------------------------ memory
def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def seconds_per_call(fn: Callable[[], object], min_seconds: float) -> float:
    """Mean seconds per call of `fn`, called back to back for at least `min_seconds`."""
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The geometric mean of a[i] / b[i] and its 95% confidence interval (t over the log ratios; NaN bounds with one
    pair). Pairs measured side by side in one round share the machine's state of that moment, so their ratio cancels
    the drift that moves both (on a shared VM, 10-30% over minutes); the rounds' spread is the measurement's noise.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equally long, non-empty lists (got {len(a)} and {len(b)})")
    logs = [math.log(x / y) for x, y in zip(a, b)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


# -------------------------------------------------------------------------------------------------------- formatting
# ------------------------------------------------------------------------------------------- benchmark children
def log(msg: str) -> None:
    """A timestamped progress line on stderr (stdout holds the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    """`--env KEY=VALUE` options as a dict."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env wants KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def run_json_child(argv_for: Callable[[str], list[str]], threads: int, env_pairs: list[str] | None, timeout: float,
                   **env: str) -> tuple[dict | None, str, float]:
    """Run one benchmark child (`argv_for(result_file)`) with `threads` intra-op threads, offline, and read the JSON
    result it writes. Returns (result or None, why it failed, process seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        child_env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                         TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **env)
        child_env.update(parse_env(env_pairs))
        t = time.perf_counter()
        proc = subprocess.run(argv_for(result_file), env=child_env, stdout=sys.stderr, stderr=sys.stderr,
                              timeout=timeout)
        seconds = time.perf_counter() - t
        if proc.returncode != 0 or not os.path.exists(result_file):
            return None, f"child exited with {proc.returncode}", seconds
        return json.loads(Path(result_file).read_text()), "", seconds


def environment() -> dict:
    import platform

    import transformers

    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                cpu_count=os.cpu_count(), machine=platform.machine(), processor=platform.processor() or None,
                cpu_flags=cpu_flags(), **git_state())


def cpu_flags() -> str:
    """This CPU's AVX flags, as the notes write them (`grep -o 'avx[0-9a-z_]*' /proc/cpuinfo | sort -u`)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " ".join(sorted(set(re.findall(r"\bavx[0-9a-z_]*", f.read()))))
    except OSError:
        return "unknown"


def git_state() -> dict:
    """The commit under test and whether `rollout/` has uncommitted changes (numbers belong to a code state)."""
    import subprocess

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return dict(git_commit=git("rev-parse", "--short", "HEAD") or None,
                rollout_dirty=bool(git("status", "--porcelain", "--", "rollout")))


def as_dict(obj) -> dict:
    return asdict(obj)


# --------------------------------------------------------------------------------------------------------- profiling
class PhaseTimers:
    """Wall-clock accumulators around the engine's stages, installed by patching classes for the duration of a `with`.

    Nothing in `rollout/` changes: the wrappers call the originals and are removed on exit. With `annotate=True` each
    stage is also a `torch.profiler.record_function` range, so the profiler table shows the stages and their Python
    self time next to the aten ops.
    """

    PHASES = (
        # (name, parent, description)
        ("wall", None, "wall time of the timed region"),
        ("step", "wall", "LLMEngine.step (all steps)"),
        ("schedule", "step", "Scheduler.schedule: plan the step"),
        ("runner", "step", "ModelRunner.run: inputs + forward"),
        ("build_batch", "runner", "ModelRunner.build_batch: positions, slots, block tables"),
        ("forward", "runner", "model forward (run - build_batch)"),
        ("attention", "forward", "paged attention, all layers"),
        ("kv_write", "attention", "PagedKVCache.write (index_copy_ of K and V)"),
        ("kv_gather", "attention", "attention._gather: K/V pages gathered for decode rows (if the engine has it)"),
        ("attend", "attention", "_attend: SDPA over gathered K/V (PyTorch path)"),
        ("cpu_kernel", "attention", "the C paged-attention kernel (cpu_kernel.paged_attention), all tokens at once"),
        ("attn_rest", "attention", "rest of attention: K/V gather (when not in _gather), q select, masks, copies"),
        ("linear_etc", "forward", "rest of forward: linears, norms, RoPE, MLP, lm_head"),
        ("sampler", "step", "Sampler.sample"),
        ("step_rest", "step", "step bookkeeping: logits row select, append tokens, fork, stop checks, block hashing"),
        ("outside", "wall", "outside steps: engine init, add_request, output collection"),
    )

    def __init__(self, annotate: bool = False) -> None:
        self.annotate = annotate
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.step_kinds: dict[str, list[float]] = {"decode-only": [], "mixed/prefill": []}
        self.step_rows: dict[str, list[int]] = {"decode-only": [], "mixed/prefill": []}
        self._restore: list = []
        self.missing: list[str] = []
        self._last_kind = None
        self._last_rows = 0

    def _timed(self, name, fn):
        timers = self
        import functools
        import time as _time

        from torch.profiler import record_function

        @functools.wraps(fn)
        def wrapper(*a, **k):
            ctx = record_function(f"rollout::{name}") if timers.annotate else contextlib.nullcontext()
            t = _time.perf_counter()
            with ctx:
                out = fn(*a, **k)
            timers.totals[name] = timers.totals.get(name, 0.0) + _time.perf_counter() - t
            timers.counts[name] = timers.counts.get(name, 0) + 1
            return out

        return wrapper

    def _patch(self, owner, attr, name, wrap=None):
        """Wrap `owner.attr`; a stage the engine no longer has is skipped (the engine changes under the benchmark)."""
        original = getattr(owner, attr, None)
        if original is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        setattr(owner, attr, (wrap or self._timed)(name, original))
        self._restore.append((owner, attr, original))

    def __enter__(self):
        import time as _time

        from transformers import AttentionInterface

        from rollout.engine import engine as engine_mod
        from rollout.engine.core import scheduler as sched_mod
        from rollout.engine.sample import sampler as sampler_mod
        from rollout.engine.worker import attention as attn_mod
        from rollout.engine.worker import kv_cache as kv_mod
        from rollout.engine.worker import model_runner as runner_mod

        timers = self
        timed_schedule = self._timed("schedule", sched_mod.Scheduler.schedule)

        def schedule(*a, **k):
            plan = timed_schedule(*a, **k)
            timers._last_kind = "decode-only" if plan.query_lens and max(plan.query_lens) == 1 else "mixed/prefill"
            timers._last_rows = len(plan.query_lens)
            return plan

        self._patch(sched_mod.Scheduler, "schedule", "schedule", wrap=lambda name, fn: schedule)
        timed_step = self._timed("step", engine_mod.LLMEngine.step)

        def step(*a, **k):
            timers._last_kind = None
            t = _time.perf_counter()
            out = timed_step(*a, **k)
            if timers._last_kind is not None and timers._last_rows:
                timers.step_kinds[timers._last_kind].append(_time.perf_counter() - t)
                timers.step_rows[timers._last_kind].append(timers._last_rows)
            return out

        self._patch(engine_mod.LLMEngine, "step", "step", wrap=lambda name, fn: step)
        self._patch(runner_mod.ModelRunner, "run", "runner")
        self._patch(runner_mod.ModelRunner, "build_batch", "build_batch")
        self._patch(sampler_mod.Sampler, "sample", "sampler")
        self._patch(kv_mod.PagedKVCache, "write", "kv_write")
        self._patch(attn_mod, "_attend", "attend")
        self._patch(attn_mod, "_gather", "kv_gather")
        self._patch(attn_mod, "paged_attention", "cpu_kernel")
        original_attention = attn_mod.paged_attention_forward
        AttentionInterface.register(attn_mod.ATTENTION_NAME, self._timed("attention", original_attention))
        self._restore.append((None, attn_mod.ATTENTION_NAME, original_attention))
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        for owner, attr, original in reversed(self._restore):
            if owner is None:
                AttentionInterface.register(attr, original)
            else:
                setattr(owner, attr, original)
        self._restore.clear()
        return False

    def report(self, wall_s: float) -> str:
        t = dict(self.totals)
        t["wall"] = wall_s
        t["forward"] = t.get("runner", 0.0) - t.get("build_batch", 0.0)
        t["attn_rest"] = (t.get("attention", 0.0) - t.get("kv_write", 0.0) - t.get("kv_gather", 0.0)
                          - t.get("attend", 0.0) - t.get("cpu_kernel", 0.0))
        t["linear_etc"] = t["forward"] - t.get("attention", 0.0)
        t["step_rest"] = t.get("step", 0.0) - t.get("schedule", 0.0) - t.get("runner", 0.0) - t.get("sampler", 0.0)
        t["outside"] = wall_s - t.get("step", 0.0)
        steps = max(1, self.counts.get("step", 0))
        depth = {}
        rows = []
        for name, parent, desc in self.PHASES:
            depth[name] = 0 if parent is None else depth[parent] + 1
            rows.append(["  " * depth[name] + name, f"{t.get(name, 0.0):.3f}", f"{100 * t.get(name, 0.0) / wall_s:.1f}",
                         f"{1000 * t.get(name, 0.0) / steps:.2f}", desc])
        out = [format_table(["phase", "seconds", "% wall", "ms/step", "what"], rows, align="lrrrl")]
        out.append(f"steps: {self.counts.get('step', 0)}")
        if self.missing:
            out.append(f"(not timed, absent in this engine version: {', '.join(self.missing)})")
        for kind, times in self.step_kinds.items():
            if times:
                rows_ = self.step_rows[kind]
                out.append(f"  {kind}: {len(times)} steps, {1000 * sum(times) / len(times):.2f} ms/step, "
                           f"{sum(rows_) / len(rows_):.1f} requests/step, {sum(times):.2f}s total")
        return "\n".join(out)


OP_CATEGORIES = [
    # (label, exact aten op names, substrings)
    ("matmul (linear layers, lm_head)",
     {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}, ("mkldnn", "onednn")),
    ("attention kernel (sdpa)", set(), ("scaled_dot_product", "flash_attention")),
    ("gather / scatter / index",
     {"aten::index", "aten::index_select", "aten::index_copy_", "aten::index_copy", "aten::index_put_",
      "aten::_index_put_impl_", "aten::gather", "aten::scatter", "aten::scatter_", "aten::take",
      "aten::masked_select", "aten::nonzero", "aten::repeat_interleave", "aten::masked_fill",
      "aten::masked_fill_"}, ()),
    ("copies / casts / allocation",
     {"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat", "aten::stack",
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::zeros", "aten::zeros_like", "aten::ones",
      "aten::ones_like", "aten::fill_", "aten::zero_", "aten::resize_", "aten::lift_fresh", "aten::full",
      "aten::arange", "aten::detach", "aten::alias", "aten::view", "aten::reshape", "aten::transpose",
      "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::expand", "aten::as_strided",
      "aten::t", "aten::permute", "aten::flatten", "aten::narrow", "aten::split", "aten::chunk", "aten::unbind",
      "aten::_unsafe_view", "aten::item", "aten::_local_scalar_dense", "aten::tensor_split"}, ()),
    ("sampling math",
     {"aten::exponential_", "aten::log_softmax", "aten::_log_softmax", "aten::argmax", "aten::sort",
      "aten::logsumexp", "aten::softmax", "aten::_softmax", "aten::multinomial", "aten::log", "aten::cumsum",
      "aten::topk", "aten::max", "aten::where", "aten::sub", "aten::div"}, ()),
    ("python overhead (self time of the engine phase ranges: engine + transformers module code)", set(),
     ("rollout::",)),
]


def op_categories(averages) -> str:
    """Self CPU time of a torch.profiler key_averages() grouped into coarse categories."""
    totals: dict[str, float] = {}
    names: dict[str, list[tuple[float, str]]] = {}
    grand = 0.0
    for evt in averages:
        self_us = evt.self_cpu_time_total
        grand += self_us
        cat = "elementwise / norms / other aten"
        for label, exact, substrings in OP_CATEGORIES:
            if evt.key in exact or any(p in evt.key for p in substrings):
                cat = label
                break
        totals[cat] = totals.get(cat, 0.0) + self_us
        names.setdefault(cat, []).append((self_us, evt.key))
    rows = []
    for cat, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = ", ".join(f"{k} {v / 1e6:.2f}s" for v, k in sorted(names[cat], reverse=True)[:3])
        rows.append([cat, f"{us / 1e6:.3f}", f"{100 * us / grand:.1f}", top])
    return format_table(["category", "self CPU s", "%", "largest ops"], rows, align="lrrl")


# ------------------------------------------------------------------------------------------------------------- noise
class LoadMonitor:
    """Samples the 1-minute load average and this process's CPU time during a timed region.

    The machine is shared: `cpu_util` (process CPU seconds / wall seconds) well below the thread count, or a load
    average above the core count, means other processes took cores and the run's wall time is inflated.
    """

    def __init__(self, interval: float = 1.0) -> None:
        import threading

        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(os.getloadavg()[0])

    @staticmethod
    def _cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def __enter__(self):
        import time

        self.samples.append(os.getloadavg()[0])
        self._cpu0, self._t0 = self._cpu(), time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        import time

        self._stop.set()
        self._thread.join()
        self.cpu_s = self._cpu() - self._cpu0
        self.wall_s = time.perf_counter() - self._t0
        self.samples.append(os.getloadavg()[0])
        return False

    def summary(self) -> dict:
        return dict(cpu_s=self.cpu_s, cpu_util=self.cpu_s / max(self.wall_s, 1e-9),
                    load_mean=sum(self.samples) / len(self.samples), load_max=max(self.samples))

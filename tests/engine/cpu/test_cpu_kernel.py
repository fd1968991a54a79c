"""The C paged-attention kernel equals dense attention computed in float64, for every shape the engine hands it and
for every -march it is built for (with and without OpenMP), and the engine falls back to the PyTorch path (or says
why it cannot) when the kernel is unavailable or does not fit this CPU."""

import logging
import platform
import stat

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.cpu import kernel as cpu_kernel
from rollout.engine.cpu.features import cpu_features, isa_flags
from rollout.engine.cpu.kernel import KernelBatch, kernel_build, load_kernel, paged_attention
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="the kernel cannot be built or used here (see log)")
needs_compiler = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C compiler on this machine")
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# x86-64 levels: the CPU flags each needs (of those cpu_features tracks) and the widest ISA it compiles in
MARCH_NEEDS = {"x86-64-v2": {"sse4_2"}, "x86-64-v3": {"sse4_2", "avx2", "fma3"},
               "x86-64-v4": {"sse4_2", "avx2", "fma3", "avx512_f"}}
MARCH_ISA = {"x86-64-v2": "sse4.2", "x86-64-v3": "avx2", "x86-64-v4": "avx512f"}


def _dense_reference(q, k_cache, v_cache, positions, token_rows, tables, page, scale, window, softcap):
    """Per token: gather its keys slot by slot, attend in float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        n = int(positions[t]) + 1
        slots = torch.tensor([int(tables[token_rows[t], p // page]) * page + p % page for p in range(n)])
        k = k_cache[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, n, D]
        v = v_cache[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", q[t].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if window is not None:
            scores[:, :max(0, n - window)] = float("-inf")
        out[t] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


def _step_like_batch(page, num_blocks, seed):
    """A packed step: a prefill chunk in the middle of its prompt, a whole short prompt, and decode rows (two of them
    sharing their first blocks, as forked samples do)."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(num_blocks, generator=g)[:4 * 12].view(4, 12)
    tables[3, :2] = tables[2, :2]
    rows = [(0, list(range(page + 3, 3 * page + 1))), (1, list(range(5))), (2, [2 * page + 7]), (3, [page * 5]),
            (1, [5 * page - 1])]
    token_rows = torch.tensor([r for r, positions in rows for _ in positions])
    positions = torch.tensor([p for _, ps in rows for p in ps])
    return KernelBatch(positions, token_rows, tables)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_kernel
@pytest.mark.parametrize("dtype, tol", list(TOLERANCE.items()))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 128), (6, 3, 24)])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0)])
@pytest.mark.parametrize("page", [4, 16])
def test_kernel_matches_dense_attention(dtype, tol, heads, kv_heads, head_dim, window, softcap, page):
    _assert_matches_dense(dtype, tol, heads, kv_heads, head_dim, window, softcap, page)


def _assert_matches_dense(dtype, tol, heads, kv_heads, head_dim, window, softcap, page):
    """The currently loaded kernel on a step-like batch against the float64 reference."""
    torch.manual_seed(0)
    num_blocks = 64
    batch = _step_like_batch(page, num_blocks, seed=page + head_dim)
    k_cache = torch.randn(num_blocks * page, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * page, kv_heads, head_dim).to(dtype)
    # the engine passes a transposed view of transformers' [H, T, D] query: strided, not contiguous
    q = torch.randn(heads, len(batch.positions), head_dim).to(dtype).transpose(0, 1)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, batch, page, scale, window, softcap)
    ref = _dense_reference(q, k_cache, v_cache, batch.positions, batch.token_rows, batch.tables, page, scale, window,
                           softcap)
    assert out.dtype == dtype and out.is_contiguous()
    assert (out.double() - ref).abs().max().item() < tol


def _shared_key_batch(page, seed):
    """Tokens that read the same keys, in shuffled order: eight samples forked from one prompt (two shared pages, then
    pages of their own; one sits right at the end of the shared keys), three forks of another prompt, a 40-token
    prefill chunk of one row, and a token alone."""
    g = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(200, generator=g).tolist())
    tables, rows = [], []  # rows: (table row, positions)
    for forks, shared_pages, own in ((8, 2, [0, 1, 3, 9, 17, 30, 31, 45]), (3, 1, [2, 20, 7])):
        prompt = [next(free) for _ in range(shared_pages)]
        for extra in own[:forks]:
            position = shared_pages * page + extra - 1 if extra else shared_pages * page - 1
            tables.append(prompt + [next(free) for _ in range(position // page + 1 - shared_pages)])
            rows.append((len(tables) - 1, [position]))
    tables.append([next(free) for _ in range(60 // page + 1)])
    rows.append((len(tables) - 1, list(range(5, 45))))
    tables.append([next(free) for _ in range(3)])
    rows.append((len(tables) - 1, [2 * page + 1]))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    token_rows = torch.tensor([r for r, positions in rows for _ in positions])
    positions = torch.tensor([p for _, ps in rows for p in ps])
    order = torch.randperm(len(positions), generator=g)
    return KernelBatch(positions[order], token_rows[order], table)


@needs_kernel
@pytest.mark.parametrize("dtype, tol", list(TOLERANCE.items()))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (4, 4, 128), (8, 2, 40), (32, 1, 64)])
@pytest.mark.parametrize("window, softcap", [(None, None), (9, None), (None, 20.0)])
def test_tokens_sharing_keys_match_dense_attention(dtype, tol, heads, kv_heads, head_dim, window, softcap):
    """Forked samples and prefill chunks are served as groups (16 query heads per key, each member's own pages on
    the side); every grouping the batch allows (2, 4 or 1 query heads per kv head, and 32, too many to group) equals
    the float64 reference."""
    page = 8
    batch = _shared_key_batch(page, seed=head_dim + heads)
    k_cache = torch.randn(200 * page, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(200 * page, kv_heads, head_dim).to(dtype)
    q = torch.randn(len(batch.positions), heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, batch, page, scale, window, softcap)
    ref = _dense_reference(q, k_cache, v_cache, batch.positions, batch.token_rows, batch.tables, page, scale, window,
                           softcap)
    assert (out.double() - ref).abs().max().item() < tol


def _sdpa_reference(q, k_cache, v_cache, batch, page, scale):
    """Per token: its keys and values gathered, attended by PyTorch's own CPU attention in the cache's dtype (what a
    trainer's forward runs)."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype)
    for t in range(q.shape[0]):
        n = int(batch.positions[t]) + 1
        row = batch.tables[batch.token_rows[t]]
        slots = torch.tensor([int(row[p // page]) * page + p % page for p in range(n)])
        k = k_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
        out[t] = F.scaled_dot_product_attention(q[t][None, :, None], k, v, scale=scale)[0, :, 0]
    return out


@needs_kernel
@pytest.mark.parametrize("shared_keys", [False, True])
def test_bf16_attention_rounds_as_pytorch_does(shared_keys):
    """In bf16 the probabilities weight the values rounded to bf16, as PyTorch's attention does, so nearly every
    output equals a bf16 trainer's bit for bit (kept in fp32 instead, a quarter of them differ by an ulp). The rest
    differ by rounding: exp implementations and summation order."""
    torch.manual_seed(0)
    page, heads, kv_heads, d = 8, 8, 2, 64
    batch = _shared_key_batch(page, seed=5) if shared_keys else _step_like_batch(page, 64, seed=5)
    k_cache = torch.randn(200 * page, kv_heads, d).bfloat16()
    v_cache = torch.randn(200 * page, kv_heads, d).bfloat16()
    q = (2 * torch.randn(len(batch.positions), heads, d)).bfloat16()  # peaked scores: probabilities far from 1/n
    out = paged_attention(q, k_cache, v_cache, batch, page, d ** -0.5, None, None)
    differ = (out != _sdpa_reference(q, k_cache, v_cache, batch, page, d ** -0.5)).float().mean().item()
    assert differ < 0.1


@needs_kernel
def test_kernel_uses_every_thread_setting_alike():
    _assert_thread_count_independent()


@needs_kernel
def test_grouped_tokens_use_every_thread_setting_alike():
    _assert_thread_count_independent(_shared_key_batch(8, seed=1), page=8, kv_heads=4, blocks=200)


def _assert_thread_count_independent(batch=None, page=16, kv_heads=2, blocks=64):
    """Work is split across OpenMP threads by (token group, kv heads): the result cannot depend on the thread count."""
    batch = batch if batch is not None else _step_like_batch(16, 64, seed=3)
    k_cache, v_cache = torch.randn(blocks * page, kv_heads, 64), torch.randn(blocks * page, kv_heads, 64)
    q = torch.randn(len(batch.positions), 8, 64)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(paged_attention(q, k_cache, v_cache, batch, page, 0.125, None, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """A machine whose compiler fails: the kernel cannot be built."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(cpu_kernel.ENV_CACHE_DIR, str(tmp_path))
    load_kernel.cache_clear()
    yield
    monkeypatch.undo()
    load_kernel.cache_clear()
    cpu_features.cache_clear()  # in case detection ran (and cached the failed build) meanwhile


def test_engine_falls_back_when_the_kernel_cannot_build(no_kernel, caplog):
    model = tiny_model("qwen3")
    prompt = random_prompts([20], seed=4)[0]
    with caplog.at_level(logging.WARNING, logger="rollout.engine.cpu.kernel"):
        engine = LLMEngine(model, GenerationConfig(max_new_tokens=12, do_sample=False),
                           ContinuousBatchingConfig(page_size=8))
    assert not engine.runner.use_kernel
    assert "PyTorch path" in caplog.text
    (request_id,) = engine.add_request(prompt)
    tokens = run_engine(engine)[request_id].generated_tokens
    ref, safe = greedy_reference(model, prompt, 12)
    assert tokens[:safe] == ref[:safe]
    with pytest.raises(ValueError, match="cpu_attention_kernel=True"):
        LLMEngine(model, None, ContinuousBatchingConfig(page_size=8, cpu_attention_kernel=True))


@needs_kernel
def test_kernel_is_built_into_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernel.ENV_CACHE_DIR, str(tmp_path))
    load_kernel.cache_clear()
    try:
        assert load_kernel() is not None
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
        monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
        load_kernel.cache_clear()
        assert load_kernel() is None
        assert not LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8)).runner.use_kernel
    finally:
        monkeypatch.undo()
        load_kernel.cache_clear()
        cpu_features.cache_clear()


def test_fp16_cache_uses_the_pytorch_path():
    model = tiny_model("qwen3").to(torch.float16)
    engine = LLMEngine(model, None, ContinuousBatchingConfig(page_size=8))
    assert not engine.runner.use_kernel


@needs_kernel
def test_an_unusable_cache_dir_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(cpu_kernel.ENV_CACHE_DIR, str(blocker / "kernels"))  # mkdir fails under a regular file
    load_kernel.cache_clear()
    try:
        lib = load_kernel()
        assert lib is not None and "rollout-kernels-" in lib._name
    finally:
        monkeypatch.undo()
        load_kernel.cache_clear()


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """Builds go to an empty cache dir and load_kernel() builds again; the process's kernel is restored after."""
    monkeypatch.setenv(cpu_kernel.ENV_CACHE_DIR, str(tmp_path / "cache"))
    load_kernel.cache_clear()
    yield tmp_path / "cache"
    monkeypatch.undo()
    load_kernel.cache_clear()
    cpu_features.cache_clear()  # in case detection ran (and cached this test's kernel) meanwhile


def _assert_kernel_correct():
    for dtype, tol in TOLERANCE.items():
        for heads, kv_heads, head_dim, window, softcap in [(8, 2, 64, None, None), (6, 3, 24, 7, 20.0)]:
            _assert_matches_dense(dtype, tol, heads, kv_heads, head_dim, window, softcap, page=4)


@needs_compiler
@pytest.mark.parametrize("march", list(MARCH_NEEDS))
def test_kernel_for_each_x86_64_level(fresh_kernel, monkeypatch, march):
    """x86-64-v2 is the floor any x86-64 CPU since ~2009 runs, v3 an AVX2 machine, v4 AVX-512: each level builds,
    reports its ISA and is exact where the CPU runs it, and is refused (not crashed into) where it does not."""
    monkeypatch.setenv(cpu_kernel.ENV_MARCH, march)
    lib = load_kernel()
    if not X86_64:
        assert lib is None and "build failed" in kernel_build().reason
        return
    missing = sorted(MARCH_NEEDS[march] - isa_flags())
    if missing:
        assert lib is None and missing[-1] in kernel_build().reason
        return
    build = kernel_build()
    assert lib is not None and build.available and build.march == march and build.isa == MARCH_ISA[march]
    _assert_kernel_correct()


@needs_compiler
@pytest.mark.skipif(not X86_64, reason="uses the x86-64 -march levels")
def test_march_is_part_of_the_cache_key(fresh_kernel, monkeypatch):
    names = []
    for march in ("x86-64-v2", "native", "x86-64-v2"):
        monkeypatch.setenv(cpu_kernel.ENV_MARCH, march)
        load_kernel.cache_clear()
        load_kernel()
        names.append(sorted(p.name for p in fresh_kernel.glob("*.so")))
    assert len(names[0]) == 1 and len(names[1]) == 2 and names[2] == names[1], "one library per -march, reused"


@needs_compiler
def test_a_library_this_cpu_cannot_run_is_refused(fresh_kernel, monkeypatch, caplog):
    """An AVX-512 build (say from a cache shared with another machine) on an AVX2 CPU would die on SIGILL."""
    monkeypatch.setattr(cpu_kernel, "isa_flags", lambda: frozenset({"sse4_2", "avx2", "fma3"}))
    monkeypatch.setenv(cpu_kernel.ENV_MARCH, "x86-64-v4")
    with caplog.at_level(logging.WARNING, logger="rollout.engine.cpu.kernel"):
        assert load_kernel() is None
    if X86_64:
        assert "avx512_f" in kernel_build().reason and cpu_kernel.ENV_MARCH in caplog.text
    assert not LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8)).runner.use_kernel


@needs_compiler
def test_kernel_builds_without_openmp(fresh_kernel, monkeypatch, tmp_path, caplog):
    """A compiler without OpenMP (clang without libomp): the kernel still builds, runs single-threaded, and is exact."""
    real = cpu_kernel._compiler()
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text('#!/bin/sh\nfor arg in "$@"; do\n  if [ "$arg" = -fopenmp ]; then\n'
                       '    echo "error: unsupported option \'-fopenmp\'" >&2; exit 1\n  fi\ndone\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv(cpu_kernel.ENV_MARCH, "x86-64-v2" if X86_64 else "native")  # a target any such CPU runs
    with caplog.at_level(logging.WARNING, logger="rollout.engine.cpu.kernel"):
        assert load_kernel() is not None
    assert not kernel_build().openmp and "single-threaded" in caplog.text and "-fopenmp" in caplog.text
    _assert_kernel_correct()
    _assert_thread_count_independent()

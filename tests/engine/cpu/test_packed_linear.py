"""The engine's oneDNN-packed linear weights never go stale: in-place training of a shared module and weight updates
through the engine both reach the next forward, refreshed in the packed copy's own buffer byte for byte as a fresh pack
would lay them out (or repacked where that layout could not be verified); only the dtypes this CPU can pack are
packed."""

import dataclasses
import os
import platform
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.cpu import features, mkl_packed, packed_layout, packed_linear
from rollout.engine.cpu.features import SMALL_MATMUL_ISAS, SMALL_MATMUL_ROWS, cpu_features, isa_flags
from rollout.engine.cpu.kernel import load_kernel
from rollout.engine.cpu.matmuls import small_matmul
from rollout.engine.cpu.packed_copy import PackedCopy
from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT, PackedLinears, packing_available
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model
from tests.helpers.paths import REPO_ROOT

# fp32 packs wherever torch has oneDNN (every x86-64 CPU); these tests exercise the packed copies themselves
needs_fp32_packing = pytest.mark.skipif(not packing_available(torch.float32), reason="torch built without oneDNN")
PACKABLE_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packing_available(torch.bfloat16),
    reason="oneDNN packs bf16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT"))]

NEW = 10


def _greedy(engine, prompt):
    (request_id,) = engine.add_request(prompt)
    return run_engine(engine)[request_id].generated_tokens


def _assert_follows(engine, model, prompt):
    ref, safe = greedy_reference(model, prompt, NEW)
    assert safe >= NEW // 2
    assert _greedy(engine, prompt)[:safe] == ref[:safe]


def _engine(model):
    return LLMEngine(model, GenerationConfig(max_new_tokens=NEW, do_sample=False),
                     ContinuousBatchingConfig(page_size=8, allow_block_sharing=False))


@needs_fp32_packing
def test_an_optimizer_step_on_a_shared_module_is_seen():
    model = tiny_model("qwen3")
    prompt = random_prompts([15], seed=2)[0]
    engine = _engine(model)
    assert isinstance(engine.runner.linears, PackedLinears)
    before = _greedy(engine, prompt)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    model.train()
    model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.backward()
    opt.step()  # in place, no engine call: only the version counters say the weights changed
    model.eval()
    _assert_follows(engine, model, prompt)
    assert _greedy(engine, prompt) != before, "the update must be large enough to change the greedy tokens"


@needs_fp32_packing
def test_a_write_through_data_and_a_version_bump_is_seen():
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=5)
    prompt = random_prompts([15], seed=3)[0]
    engine = _engine(model)
    _assert_follows(engine, model, prompt)
    packed = {key: entry.packed for key, entry in engine.runner.linears._packs.items()}
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)  # bumps no version counter
    engine.set_weight_version(1)
    _assert_follows(engine, other, prompt)
    if all(packed_layout.layout_for(tuple(m.weight.shape), m.weight.dtype, PACK_BATCH_HINT) is not None
           for m in model.modules() if isinstance(m, torch.nn.Linear)):
        after = {key: entry.packed for key, entry in engine.runner.linears._packs.items()}
        assert after.keys() == packed.keys() and all(after[k] is packed[k] for k in packed), \
            "a weight update refreshes the packed copies in their own buffers"


def _packed_count(engine) -> int | None:
    """How many weights have a packed copy, alone or stacked with others (MKL's gate and up projections)."""
    linears = engine.runner.linears
    if not isinstance(linears, PackedLinears):
        return None
    return len(linears._packs) + sum(len(key) for key in linears._stacks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_only_cpu_fp32_and_bf16_weights_are_packed(dtype):
    """fp16 never; bf16 where oneDNN packs it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT) or its fp32 copies serve it, else
    F.linear; fp32 wherever torch has oneDNN. Generation works either way."""
    engine = _engine(tiny_model("qwen3").to(dtype))
    assert len(_greedy(engine, random_prompts([9], seed=4)[0])) == NEW
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    expected = len(linears) if dtype in cpu_features().served_dtypes else 0
    assert _packed_count(engine) == (expected if packing_available() else None)
    engine.runner.weights_changed()  # marks the copies stale (refreshed in place by the next forward), drops none
    assert _packed_count(engine) == (expected if packing_available() else None)
    if expected:
        linears = engine.runner.linears
        assert not any(entry.current(tuple(ref() for ref in entry.refs), linears._epoch)
                       for entry in linears._packs.values())


def test_asking_for_packing_without_onednn_is_a_clear_error(monkeypatch):
    no_onednn = dataclasses.replace(cpu_features(), onednn=False, packed_dtypes=frozenset())
    for module in (packed_linear, features):  # what packing_available and require_packing read
        monkeypatch.setattr(module, "cpu_features", lambda: no_onednn)
    with pytest.raises(ValueError, match="prepack_weights=True needs a torch build with oneDNN"):
        LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8, prepack_weights=True))
    engine = LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8))
    assert not isinstance(engine.runner.linears, PackedLinears)


@needs_fp32_packing
def test_the_override_is_scoped_to_the_engine_thread_and_removed_after():
    """While the engine's forward runs, a trainer thread using the same module keeps F.linear and its gradients."""
    import threading

    model = tiny_model("qwen3")
    engine = _engine(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.tensor([random_prompts([6], seed=5)[0]])
    grads = {}

    def train_step():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads["ok"] = all(m.weight.grad is not None for m in linears)

    with engine.runner.linears:
        assert all("forward" in m.__dict__ for m in linears)
        worker = threading.Thread(target=train_step)
        worker.start()
        worker.join()
    assert grads["ok"]
    assert not any("forward" in m.__dict__ for m in model.modules()), "the model must be left exactly as it was"


@needs_fp32_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100, 256, 257, 600, 2048, 2100])
def test_packed_forward_equals_f_linear_for_any_row_count(rows):
    """Rows are padded up to a bucket for oneDNN (bounded JIT-kernel memory) and cut back; inputs over PACKED_MAX_ROWS
    run in chunks.
    Padding rows hold stale data from earlier calls: they must never leak into the result."""
    from rollout.engine.cpu.row_buckets import PACKED_MAX_ROWS, padded_rows

    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer, mkl=False)  # oneDNN's copies (MKL's need no padding: tests of their own)
    linears.unpacked_max_rows = 0  # the packed copies at every row count, whatever this CPU's small-step rule
    linears.small_matmul = False
    x = torch.randn(1, rows, 48)
    with torch.inference_mode(), linears:
        first = layer(x)
        for buf in linears._pads.buffers.values():
            buf.fill_(float("nan"))  # stale padding rows, at their worst
        out = layer(x)
    assert torch.equal(first, out)
    assert out.shape == (1, rows, 80)
    assert torch.allclose(out, F.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert len(linears._packs) == 1
    buckets = {padded_rows(r) for r in range(1, PACKED_MAX_ROWS + 1)}
    assert padded_rows(rows) >= rows and len(buckets) <= 64  # each bucket costs oneDNN a few MiB of JIT kernels
    assert padded_rows(rows) - rows < (8 if rows <= 256 else 64)  # and little padding where steps are small


@needs_fp32_packing
@pytest.mark.parametrize("limit", [0, 4])
def test_small_fp32_steps_keep_f_linear_up_to_the_cpus_row_limit(limit):
    """Up to `unpacked_max_rows` rows (as far as F.linear was timed faster, see cpu_features) an fp32 linear runs
    F.linear itself, bit for bit; above it, and for every row count where the limit is 0, the packed copy."""
    torch.manual_seed(limit)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer)
    linears.unpacked_max_rows = limit
    linears.small_matmul = False  # the small-rows kernel has tests of its own (below)
    with torch.inference_mode(), linears:
        for rows in (1, 2, 4, 5, 16):
            x = torch.randn(1, rows, 48)
            unpacked = linears.packed_for(x, layer.weight) is None
            assert unpacked == (rows <= limit), rows
            out, ref = layer(x), F.linear(x, layer.weight, layer.bias)
            assert torch.equal(out, ref) if unpacked else torch.allclose(out, ref, atol=1e-5)


needs_small_matmul = pytest.mark.skipif(load_kernel() is None, reason="the C kernels do not build here")


@needs_small_matmul
@pytest.mark.parametrize("shape", [(80, 48), (81, 50), (7, 300), (1, 16), (4096, 512)])
@pytest.mark.parametrize("bias", [True, False])
def test_small_matmul_kernel_matches_f_linear(shape, bias):
    """The C kernel for fp32 linears of a few rows: F.linear's values within fp32 rounding for every row count it
    serves (odd output counts, input widths off its 16-float vectors), each row's result independent of the other
    rows and of the thread count, bit for bit."""
    torch.manual_seed(shape[0])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    b = torch.randn(out_features) if bias else None
    x = torch.randn(16, in_features)
    threads = torch.get_num_threads()
    for rows in range(1, 17):
        out = small_matmul(x[:rows], weight, b)
        assert out.shape == (rows, out_features)
        assert torch.allclose(out, F.linear(x[:rows], weight, b), atol=1e-5, rtol=1e-5), rows
        assert torch.equal(out[-1:], small_matmul(x[rows - 1:rows], weight, b)), rows  # the last row alone
    try:
        torch.set_num_threads(1)
        alone = small_matmul(x[:8], weight, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, small_matmul(x[:8], weight, b))
    strided = torch.randn(8, in_features * 2)[:, ::2]  # rows of another stride, copied for the kernel
    assert torch.allclose(small_matmul(strided, weight, b), F.linear(strided, weight, b), atol=1e-5, rtol=1e-5)


@needs_small_matmul
@pytest.mark.parametrize("shape", [(80, 48), (81, 50), (7, 300), (1, 16), (4096, 512)])
@pytest.mark.parametrize("bias", [True, False])
def test_small_matmul_kernel_on_bf16_weights_is_the_fp32_kernel_on_the_widened_values(shape, bias):
    """bf16 weights widened in registers: for every row count, the fp32 kernel's sums over the widened input,
    weight and bias, rounded to bf16, bit for bit (so the bits hold on every target as the fp32 kernel's do); within
    a bf16 step of F.linear's fp32 result."""
    torch.manual_seed(shape[0] + 1)
    out_features, in_features = shape
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    wide_b = None if b is None else b.float()
    x = torch.randn(16, in_features).bfloat16()
    for rows in range(1, 17):
        out = small_matmul(x[:rows], weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert torch.equal(out, small_matmul(x[:rows].float(), weight.float(), wide_b).bfloat16()), rows
        exact = F.linear(x[:rows].float(), weight.float(), wide_b)
        assert torch.allclose(out.float(), exact, atol=1e-2, rtol=8e-3), rows
    strided = torch.randn(8, in_features * 2).bfloat16()[:, in_features:]  # rows further apart than they are wide
    assert torch.equal(small_matmul(strided, weight, b), small_matmul(strided.contiguous(), weight, b))
    with pytest.raises(ValueError, match="small_matmul takes fp32 or bf16 input, weight and bias of one dtype"):
        small_matmul(x[:2].float(), weight, b)  # the caller widens nothing: one dtype throughout


def _small_matmul_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Input widths with and without a tail past the 16-float steps, row counts across every tile size (8, 4, 2, 1
    rows on AVX-512; 2 and 1 elsewhere), odd output counts, with and without a bias; fp32, and bf16 weights."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for in_features, out_features, rows, bias in [(300, 81, 7, True), (301, 9, 9, False), (16, 5, 3, True),
                                                   (7, 4, 1, True), (960, 33, 8, False), (45, 2, 16, True)]:
        x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
        cases.append((x, w, torch.randn(out_features, generator=g) if bias else None))
    cases += [(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()) for x, w, b in cases[:3]]
    return cases


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_small_matmul_has_the_same_bits_on_every_target(march):
    """The kernel's sums are fixed by its source, not by the compiler or the ISA: a build for another target (AVX2
    with FMA, or SSE without FMA, where the fused multiply-adds are C's fmaf) gives this build's results bit for bit,
    in a child process built for that target, for every width, tail and tile size."""
    if load_kernel() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs the C kernels on an x86-64 CPU")
    if march == "x86-64-v3" and not {"avx2", "fma3"} <= set(isa_flags()):
        pytest.skip("an x86-64-v3 build needs an AVX2 + FMA CPU")
    code = ("import sys, torch; from rollout.engine.cpu.kernel import kernel_build; "
            "from rollout.engine.cpu.matmuls import small_matmul; "
            "from tests.engine.cpu.test_packed_linear import _small_matmul_cases; "
            "torch.save([small_matmul(*case) for case in _small_matmul_cases()], sys.argv[1]); "
            "print(kernel_build().march)")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "out.pt")
        env = {**os.environ, "ROLLOUT_KERNEL_MARCH": march}
        child = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True,
                               timeout=300, cwd=str(REPO_ROOT))
        assert child.returncode == 0, child.stderr
        assert child.stdout.split()[-1] == march
        theirs = torch.load(path)
    for case, other in zip(_small_matmul_cases(), theirs, strict=True):
        ours = small_matmul(*case)
        assert torch.equal(other, ours), (tuple(case[1].shape), (other - ours).abs().max().item())


@needs_fp32_packing
def test_steps_of_a_few_fp32_rows_run_the_small_matmul_kernel_in_the_forward_only():
    """Inside the engine's forward, fp32 linears of the kernel's rows run it where oneDNN packs (the packed copies do
    not serve them); outside it (another thread, a trainer's forward with autograd) the module is F.linear itself."""
    features = cpu_features()  # the detection PackedLinears reads (other tests clear it: its clocks may differ)
    if not features.small_matmul_kernel:
        pytest.skip("the small-rows kernel is not built here, or not for AVX-512 and timed slower at every row count")
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer, mkl=False)
    assert linears.small_matmul
    low, high = features.small_matmul_rows
    if features.kernel.isa in SMALL_MATMUL_ISAS:
        assert low <= SMALL_MATMUL_ROWS[0] and high == SMALL_MATMUL_ROWS[1], "AVX-512 builds serve their rule's rows"
    x = torch.randn(1, high + 1, 48)
    with torch.inference_mode(), linears:
        for rows in (low, high):
            assert linears.packed_for(x[:, :rows], layer.weight) is None
            assert torch.equal(layer(x[:, :rows]), small_matmul(x[:, :rows], layer.weight, layer.bias))
        assert linears.packed_for(x, layer.weight) is not None  # above the range: the packed copy
    out = layer(x[:, :low].requires_grad_())  # not inside the forward: autograd through F.linear
    assert torch.equal(out, F.linear(x[:, :low], layer.weight, layer.bias)) and out.requires_grad


@needs_fp32_packing
@needs_small_matmul
@pytest.mark.parametrize("via_fp32", [True, False], ids=["fp32 copies", "bf16 copies"])
def test_steps_of_a_few_bf16_rows_run_the_small_matmul_kernel_where_the_route_says(via_fp32):
    """bf16 inputs of at most `bf16_kernel_max_rows` rows run the kernel on the bf16 weights as stored (neither
    copy serves them); above, the packed copy; outside the forward, F.linear itself."""
    if not via_fp32 and not cpu_features().packs(torch.bfloat16):
        pytest.skip("oneDNN does not pack bf16 on this CPU")
    torch.manual_seed(1)
    layer = torch.nn.Linear(48, 80).to(torch.bfloat16)
    linears = PackedLinears(layer, dtypes=frozenset({torch.bfloat16}), mkl=False, bf16_via_fp32=via_fp32)
    linears.bf16_kernel_max_rows = 4  # as a route timed faster there sets it
    x = torch.randn(1, 6, 48).to(torch.bfloat16)
    with torch.inference_mode(), linears:
        for rows in (1, 4):
            assert linears.packed_for(x[:, :rows], layer.weight) is None
            assert torch.equal(layer(x[:, :rows]), small_matmul(x[:, :rows], layer.weight, layer.bias))
        assert linears.packed_for(x[:, :5], layer.weight) is not None
    assert torch.equal(layer(x[:, :2]), F.linear(x[:, :2], layer.weight, layer.bias))


# --------------------------------------------------------------------------- in-place refresh after weight updates
# shapes off oneDNN's block sizes (64 output rows; 16 or 32 input columns; bf16 pairs): padded tail blocks, odd widths
ODD_SHAPES = [(80, 48), (100, 31), (33, 17), (7, 300), (65, 33), (130, 1), (1, 1)]


def _buffer_bytes(packed: torch.Tensor) -> torch.Tensor:
    return packed_layout.buffer_of(packed).view(torch.uint8).clone()


def _fresh(layer: torch.nn.Linear, x: torch.Tensor, via_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fresh PackedLinears gives for `x` with the layer's current weights, and its packed buffer's bytes."""
    fresh = PackedLinears(layer, dtypes=frozenset({layer.weight.dtype}), mkl=False, bf16_via_fp32=via_fp32)
    with torch.inference_mode(), fresh:
        out = layer(x)
    return out, _buffer_bytes(fresh._packs[id(layer.weight)].packed)


def _packed_forward(linears: PackedLinears, layer: torch.nn.Linear, x: torch.Tensor):
    with torch.inference_mode(), linears:
        out = layer(x)
    return out, linears._packs[id(layer.weight)].packed


@needs_fp32_packing
@pytest.mark.parametrize("dtype", PACKABLE_DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_weight_update_refreshes_the_packed_copy_in_place_as_a_fresh_pack_would(shape, dtype):
    """After a write through .data + clear() (a weight update) and after an in-place optimizer-style write (bumps the
    version counter), the packed forward equals a fresh pack of the new weights bit for bit, padding included, and the
    copy keeps its buffer wherever the layout was verified (everywhere on x86-64)."""
    out_features, in_features = shape
    torch.manual_seed(out_features * 1000 + in_features)
    layer = torch.nn.Linear(in_features, out_features).to(dtype)
    linears = PackedLinears(layer, dtypes=frozenset({dtype}), mkl=False, bf16_via_fp32=False)
    x = torch.randn(2, 9, in_features).to(dtype)
    first, packed = _packed_forward(linears, layer, x)
    in_place = packed_layout.layout_for(shape, dtype, PACK_BATCH_HINT) is not None
    if cpu_features().machine in ("x86_64", "AMD64"):
        assert in_place, "oneDNN's packed layout is blocked on x86-64: the in-place refresh must be available"

    with torch.no_grad():
        layer.weight.data.copy_(torch.randn(shape).to(dtype))  # bumps no version counter
    linears.clear()
    out, now = _packed_forward(linears, layer, x)
    expected, expected_bytes = _fresh(layer, x)
    assert torch.equal(out, expected) and not torch.equal(out, first)
    assert torch.equal(_buffer_bytes(now), expected_bytes)
    assert (now is packed) == in_place
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(out.float(), F.linear(x, layer.weight, layer.bias).float(), atol=tol, rtol=tol)

    with torch.no_grad():
        layer.weight.mul_(-0.5)  # in place: bumps the version counter, no clear()
    out, now = _packed_forward(linears, layer, x)
    expected, expected_bytes = _fresh(layer, x)
    assert torch.equal(out, expected) and torch.equal(_buffer_bytes(now), expected_bytes)
    assert (now is packed) == in_place


@needs_fp32_packing
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no kernel"])
@pytest.mark.parametrize("dtype", PACKABLE_DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_weight_update_writes_the_weight_and_its_packed_copy_in_one_pass(shape, dtype, kernel, monkeypatch):
    """`load` (a weight update's copy) writes the new values into the weight and its packed copy at once: the weight
    equals the value, the packed copy equals a fresh pack of it byte for byte, padding included, and the `clear` told
    it is fresh keeps the copy current (no refresh on the next forward); with or without the C transposes."""
    _check_one_pass_load(shape, dtype, kernel, monkeypatch, via_fp32=False)


@needs_fp32_packing
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no kernel"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_bf16_weight_update_writes_the_weight_and_its_fp32_copy_in_one_pass(shape, kernel, monkeypatch):
    """The same for a bf16 weight computed on an fp32 copy: the copy is widened as it is written, equal byte for byte
    to a fresh pack of the widened weight."""
    _check_one_pass_load(shape, torch.bfloat16, kernel, monkeypatch, via_fp32=True)


def _check_one_pass_load(shape: tuple[int, int], dtype: torch.dtype, kernel: bool, monkeypatch, via_fp32: bool):
    if not kernel:
        monkeypatch.setattr(packed_layout, "load_kernel", lambda: None)
    torch.manual_seed(shape[0] * 7 + shape[1])
    layer = torch.nn.Linear(shape[1], shape[0]).to(dtype)
    linears = PackedLinears(layer, dtypes=frozenset({dtype}), mkl=False, bf16_via_fp32=via_fp32)
    x = torch.randn(3, 5, shape[1]).to(dtype)
    _, packed = _packed_forward(linears, layer, x)
    if packed_layout.layout_for(shape, packed.dtype, PACK_BATCH_HINT) is None:
        pytest.skip("no verified layout here: updates copy, and the next forward repacks")
    value = torch.randn(shape).to(dtype)
    assert linears.load(layer.weight, value)
    linears.clear(fresh={id(layer.weight)})
    refreshes = []
    monkeypatch.setattr(PackedCopy, "refresh_in_place", lambda *args: refreshes.append(args) or False)
    out, now = _packed_forward(linears, layer, x)
    assert torch.equal(layer.weight, value) and now is packed and not refreshes
    expected, expected_bytes = _fresh(layer, x, via_fp32)
    assert torch.equal(_buffer_bytes(now), expected_bytes) and torch.equal(out, expected)


@needs_fp32_packing
@pytest.mark.parametrize("mkl", [False, True], ids=["onednn", "mkl"])
def test_fp32_copies_of_bf16_weights_round_each_output_and_refresh_in_place(mkl):
    """bf16 linears on fp32 copies: each output is the fp32 matmul of the widened input rounded to bf16 (what a bf16
    matmul's fp32 sums give, to bf16 rounding); a weight update refreshes the copy in its own buffer, widening the
    new values as it writes them (byte for byte a fresh pack of the widened weight), and `load` writes oneDNN's copy
    in the update's pass where its layout is verified (MKL's copies: declined, the next forward repacks)."""
    if mkl and not mkl_packed.available():
        pytest.skip(f"MKL's packed sgemm is unavailable here: {mkl_packed.unavailable_reason()}")
    torch.manual_seed(3)
    layer = torch.nn.Linear(48, 80).to(torch.bfloat16)
    linears = PackedLinears(layer, dtypes=frozenset({torch.bfloat16}), mkl=mkl, bf16_via_fp32=True)
    x = torch.randn(2, 9, 48).to(torch.bfloat16)

    def widened() -> torch.Tensor:
        return F.linear(x.float(), layer.weight.float(), layer.bias.float())

    first, packed = _packed_forward(linears, layer, x)
    assert first.dtype == torch.bfloat16 and torch.allclose(first.float(), widened(), atol=1e-2, rtol=8e-3)
    assert torch.allclose(first.float(), F.linear(x, layer.weight, layer.bias).float(), atol=5e-2, rtol=5e-2)
    in_place = packed_layout.layout_for((80, 48), torch.float32, PACK_BATCH_HINT) is not None
    value = torch.randn(80, 48).to(torch.bfloat16)
    loaded = linears.load(layer.weight, value)
    assert loaded == (in_place and not linears.mkl)  # MKL's copies: only in a model with fp32 linears too
    assert torch.equal(layer.weight, value) == loaded  # declined: nothing written
    with torch.no_grad():
        layer.weight.data.copy_(torch.randn(80, 48).to(torch.bfloat16))  # and then a write the copy must follow
    linears.clear()
    out, now = _packed_forward(linears, layer, x)
    assert (now is packed) == (linears.mkl or in_place)
    assert not torch.equal(out, first)
    if not linears.mkl:
        assert torch.equal(_buffer_bytes(now), _fresh(layer, x, via_fp32=True)[1])
    # to bf16 rounding of sums taken in another order: at most one bf16 step apart
    assert torch.allclose(out.float(), widened(), atol=1e-2, rtol=8e-3)
    fresh = PackedLinears(layer, dtypes=frozenset({torch.bfloat16}), mkl=mkl, bf16_via_fp32=True)
    assert torch.equal(out, _packed_forward(fresh, layer, x)[0])


@needs_fp32_packing
def test_mkl_copies_of_bf16_weights_refresh_after_an_update():
    """In a model with fp32 linears too, MKL packs the fp32 copies of bf16 weights: a refresh after an update packs
    the new values widened, as a fresh engine's copies hold them."""
    if not mkl_packed.available():
        pytest.skip(f"MKL's packed sgemm is unavailable here: {mkl_packed.unavailable_reason()}")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Linear(48, 80).to(torch.bfloat16))
    bf16 = model[1]
    linears = PackedLinears(model, mkl=True, bf16_via_fp32=True)
    assert linears.mkl and torch.bfloat16 in linears.via_fp32
    x = torch.randn(3, 48).to(torch.bfloat16)
    with torch.inference_mode(), linears:
        bf16(x)
    assert isinstance(linears._packs[id(bf16.weight)].packed, mkl_packed.MklPackedWeight)
    with torch.no_grad():
        bf16.weight.data.copy_(torch.randn(80, 48).to(torch.bfloat16))
    linears.clear()
    with torch.inference_mode(), linears:
        out = bf16(x)
    fresh = PackedLinears(model, mkl=True, bf16_via_fp32=True)
    with torch.inference_mode(), fresh:
        assert torch.equal(out, bf16(x))


@needs_fp32_packing
def test_load_declines_what_it_cannot_write_in_one_pass():
    """Nothing written where the value is not a contiguous tensor of the weight's shape and dtype, or the weight has no
    packed copy: the caller copies and the next forward refreshes."""
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer, dtypes=frozenset({torch.float32}), mkl=False)
    assert not linears.load(layer.weight, torch.randn(80, 48))  # not packed yet
    _packed_forward(linears, layer, torch.randn(9, 48))
    before = layer.weight.detach().clone()
    assert not linears.load(layer.weight, torch.randn(80, 48, dtype=torch.float64))
    assert not linears.load(layer.weight, torch.randn(48, 80).t())
    assert not linears.load(layer.bias, torch.randn(80))
    assert torch.equal(layer.weight, before)


@needs_fp32_packing
@pytest.mark.parametrize("dtype", PACKABLE_DTYPES)
@pytest.mark.parametrize("strides", ["transposed", "row slice"])
@pytest.mark.parametrize("shape", [(80, 48), (100, 31)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_strided_weight_is_refreshed_in_place_as_a_fresh_pack_would(shape, strides, dtype):
    """Weights that are views (a transposed matrix, a slice of wider rows) take the element-wise strided copy (or the
    wide one) instead of the channel_shuffle transpose: the same bytes."""
    out_features, in_features = shape

    def weight() -> torch.Tensor:
        if strides == "transposed":
            return torch.randn(in_features, out_features).to(dtype).t()
        return torch.randn(out_features, in_features + 2).to(dtype)[:, 1:in_features + 1]

    layer = torch.nn.Linear(in_features, out_features).to(dtype)
    layer.weight = torch.nn.Parameter(weight(), requires_grad=False)
    assert not layer.weight.is_contiguous()
    linears = PackedLinears(layer, dtypes=frozenset({dtype}), mkl=False, bf16_via_fp32=False)
    x = torch.randn(7, in_features).to(dtype)
    _, packed = _packed_forward(linears, layer, x)
    layer.weight.data.copy_(weight())
    linears.clear()
    out, now = _packed_forward(linears, layer, x)
    expected, expected_bytes = _fresh(layer, x)
    assert torch.equal(out, expected) and torch.equal(_buffer_bytes(now), expected_bytes)
    assert (now is packed) == (packed_layout.layout_for(shape, dtype, PACK_BATCH_HINT) is not None)


@needs_fp32_packing
@pytest.mark.parametrize("dtype", PACKABLE_DTYPES)
def test_a_layout_that_fails_its_check_falls_back_to_a_full_repack(monkeypatch, dtype):
    """Where the strided copy does not reproduce oneDNN's reorder (another oneDNN, another CPU), no layout is used:
    every refresh repacks in full, with the same results."""
    packed_layout.layout_for.cache_clear()
    monkeypatch.setattr(packed_layout, "_verify", lambda *args, **kwargs: "forced mismatch")
    try:
        layer = torch.nn.Linear(31, 100).to(dtype)
        linears = PackedLinears(layer, dtypes=frozenset({dtype}), mkl=False, bf16_via_fp32=False)
        x = torch.randn(5, 31).to(dtype)
        _, packed = _packed_forward(linears, layer, x)
        with torch.no_grad():
            layer.weight.data.copy_(torch.randn(100, 31).to(dtype))
        linears.clear()
        out, now = _packed_forward(linears, layer, x)
        assert packed_layout.layout_for((100, 31), dtype, PACK_BATCH_HINT) is None
        assert now is not packed, "without a verified layout the copy is repacked in full"
        expected, expected_bytes = _fresh(layer, x)
        assert torch.equal(out, expected) and torch.equal(_buffer_bytes(now), expected_bytes)
    finally:
        packed_layout.layout_for.cache_clear()  # later tests derive the real layouts again


@needs_fp32_packing
def test_a_layout_writes_only_into_a_buffer_of_its_own_layout():
    """The descriptor check: a verified layout refuses a packed copy of another shape or dtype (nothing written)."""
    layout = packed_layout.layout_for((100, 31), torch.float32, PACK_BATCH_HINT)
    if layout is None:
        pytest.skip("no verified layout on this CPU")
    weight = torch.randn(100, 31)
    other = torch.ops.mkldnn._reorder_linear_weight(torch.randn(100, 33), PACK_BATCH_HINT)
    before = _buffer_bytes(other)
    assert not layout.write(other, weight)
    assert torch.equal(_buffer_bytes(other), before)
    assert layout.buffer(other) is None
    same = torch.ops.mkldnn._reorder_linear_weight(torch.randn(100, 31), PACK_BATCH_HINT)
    assert layout.write(same, weight)
    assert torch.equal(_buffer_bytes(same), _buffer_bytes(torch.ops.mkldnn._reorder_linear_weight(weight, 256)))


@needs_fp32_packing
def test_a_weight_update_drops_the_copies_of_weights_no_longer_in_the_model():
    """Stale copies are kept for the next forward, but not for a weight the model no longer uses (it may live on
    elsewhere, e.g. in a trainer); a freed weight frees its copy at once."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
    linears = PackedLinears(model)
    with torch.inference_mode(), linears:
        model(torch.randn(3, 16))
    assert len(linears._packs) == 2
    old = model[1]
    model[1] = torch.nn.Linear(24, 8)
    linears.clear()
    assert set(linears._packs) == {id(model[0].weight)}
    with torch.inference_mode(), linears:
        model(torch.randn(3, 16))
    assert len(linears._packs) == 2
    model[1] = old
    linears.clear()
    assert set(linears._packs) == {id(model[0].weight)}

    weight = torch.randn(8, 16)  # the `linear` entry point (no module), then the weight is freed
    out = linears.linear(torch.randn(3, 16), weight, None)
    assert out.shape == (3, 8) and id(weight) in linears._packs
    del weight
    assert len(linears._packs) == 1

"""The engine's oneDNN-packed linear weights never go stale: in-place training of a shared module and weight updates
through the engine both reach the next forward, refreshed in the packed copy's own buffer byte for byte as a fresh pack
would lay them out (or repacked where that layout could not be verified); only the dtypes this CPU can pack are
packed."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine import packed_layout, packed_linear
from rollout.engine.cpu_features import cpu_features
from rollout.engine.packed_linear import PACK_BATCH_HINT, PackedLinears, packing_available
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model

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
    linears = engine.runner.linears
    return len(linears._packs) if isinstance(linears, PackedLinears) else None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_only_cpu_fp32_and_bf16_weights_are_packed(dtype):
    """fp16 never; bf16 only where oneDNN packs it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), else F.linear; fp32 wherever
    torch has oneDNN. Generation works either way."""
    engine = _engine(tiny_model("qwen3").to(dtype))
    assert len(_greedy(engine, random_prompts([9], seed=4)[0])) == NEW
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    expected = len(linears) if cpu_features().packs(dtype) else 0
    assert _packed_count(engine) == (expected if packing_available() else None)
    engine.runner.weights_changed()  # marks the copies stale (refreshed in place by the next forward), drops none
    assert _packed_count(engine) == (expected if packing_available() else None)
    if expected:
        linears = engine.runner.linears
        assert not any(entry.current(entry.ref(), linears._epoch) for entry in linears._packs.values())


def test_asking_for_packing_without_onednn_is_a_clear_error(monkeypatch):
    no_onednn = dataclasses.replace(cpu_features(), onednn=False, packed_dtypes=frozenset())
    monkeypatch.setattr(packed_linear, "cpu_features", lambda: no_onednn)
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
    from rollout.engine.packed_linear import PACKED_MAX_ROWS, padded_rows

    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer)
    linears.unpacked_max_rows = 0  # the packed copies at every row count, whatever this CPU's small-step rule
    x = torch.randn(1, rows, 48)
    with torch.inference_mode(), linears:
        first = layer(x)
        for buf in linears._pads.values():
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
    """Up to `unpacked_max_rows` rows (4 on Intel CPUs with MKL, see cpu_features) an fp32 linear runs F.linear
    itself, bit for bit; above it, and for every row count where the limit is 0, the packed copy."""
    torch.manual_seed(limit)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer)
    linears.unpacked_max_rows = limit
    with torch.inference_mode(), linears:
        for rows in (1, 2, 4, 5, 16):
            x = torch.randn(1, rows, 48)
            unpacked = linears.packed_for(x, layer.weight) is None
            assert unpacked == (rows <= limit), rows
            out, ref = layer(x), F.linear(x, layer.weight, layer.bias)
            assert torch.equal(out, ref) if unpacked else torch.allclose(out, ref, atol=1e-5)


# --------------------------------------------------------------------------- in-place refresh after weight updates
# shapes off oneDNN's block sizes (64 output rows; 16 or 32 input columns; bf16 pairs): padded tail blocks, odd widths
ODD_SHAPES = [(80, 48), (100, 31), (33, 17), (7, 300), (65, 33), (130, 1), (1, 1)]


def _buffer_bytes(packed: torch.Tensor) -> torch.Tensor:
    return packed_layout.buffer_of(packed).view(torch.uint8).clone()


def _fresh(layer: torch.nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fresh PackedLinears gives for `x` with the layer's current weights, and its packed buffer's bytes."""
    fresh = PackedLinears(layer, dtypes=frozenset({layer.weight.dtype}))
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
    linears = PackedLinears(layer, dtypes=frozenset({dtype}))
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
    linears = PackedLinears(layer, dtypes=frozenset({dtype}))
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
        linears = PackedLinears(layer, dtypes=frozenset({dtype}))
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

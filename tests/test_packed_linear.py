"""The engine's oneDNN-packed linear weights never go stale: in-place training of a shared module and weight updates
through the engine both reach the next forward; only the dtypes this CPU can pack are packed."""

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine import packed_linear
from rollout.engine.cpu_features import cpu_features
from rollout.engine.packed_linear import PackedLinears, packing_available
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model

# fp32 packs wherever torch has oneDNN (every x86-64 CPU); these tests exercise the packed copies themselves
needs_fp32_packing = pytest.mark.skipif(not packing_available(torch.float32), reason="torch built without oneDNN")

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
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)  # bumps no version counter
    engine.set_weight_version(1)
    _assert_follows(engine, other, prompt)


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
    engine.runner.weights_changed()
    assert not _packed_count(engine)


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
    assert not any("forward" in m.__dict__ for m in linears), "the model must be left exactly as it was"


@needs_fp32_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100, 256, 257, 600])
def test_packed_forward_equals_f_linear_for_any_row_count(rows):
    """Rows are padded up to a bucket for oneDNN (bounded JIT-kernel memory) and cut back; large inputs run in chunks.
    Padding rows hold stale data from earlier calls: they must never leak into the result."""
    from rollout.engine.packed_linear import PACKED_MAX_ROWS, padded_rows

    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80)
    linears = PackedLinears(layer)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode(), linears:
        first = layer(x)
        for buf in linears._pads.values():
            buf.fill_(float("nan"))  # stale padding rows, at their worst
        out = layer(x)
    assert torch.equal(first, out)
    assert out.shape == (1, rows, 80)
    assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert len(linears._packs) == 1
    assert padded_rows(rows) >= rows and len({padded_rows(r) for r in range(1, PACKED_MAX_ROWS + 1)}) <= 20

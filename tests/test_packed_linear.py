"""The engine's oneDNN-packed linear weights never go stale: in-place training of a shared module and weight updates
through the engine both reach the next forward."""

import pytest
import torch
from transformers import GenerationConfig

from models import greedy_reference, random_prompts, run_engine, tiny_model
from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine import model_runner
from rollout.engine.packed_linear import PackedLinears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")

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


def test_only_cpu_fp32_and_bf16_weights_are_packed():
    model = tiny_model("qwen3").to(torch.float16)
    engine = _engine(model)
    assert len(_greedy(engine, random_prompts([9], seed=4)[0])) == NEW
    assert not engine.runner.linears._packs
    bf16 = _engine(tiny_model("qwen3").to(torch.bfloat16))
    assert len(_greedy(bf16, random_prompts([9], seed=4)[0])) == NEW
    assert bf16.runner.linears._packs
    fp32 = _engine(tiny_model("qwen3"))
    _greedy(fp32, random_prompts([9], seed=4)[0])
    linears = [m for m in fp32.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(fp32.runner.linears._packs) == len(linears)
    fp32.runner.weights_changed()
    assert not fp32.runner.linears._packs


def test_asking_for_packing_without_onednn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model_runner, "packing_available", lambda: False)
    with pytest.raises(ValueError, match="prepack_weights=True needs a torch build with oneDNN"):
        LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8, prepack_weights=True))
    engine = LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=8))
    assert not isinstance(engine.runner.linears, PackedLinears)


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

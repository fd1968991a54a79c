"""The model runner's seam into transformers: which model classes the engine can page, refused at construction
otherwise (with the class named), and the dry run that holds undeclared classes to the same rule."""

from __future__ import annotations

import pytest

from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    RolloutGenerator,
    generate_batch,
)
from rollout.engine.engine import LLMEngine
from rollout.engine.worker.model_runner import UnsupportedModelError
from tests.helpers.models import (
    greedy,
    greedy_reference,
    random_prompts,
    run_engine,
    tiny_model,
    tiny_unsupported_model,
)

BUILDERS = {
    "LLMEngine": lambda model: LLMEngine(model),
    "ContinuousBatchingManager": lambda model: ContinuousBatchingManager(model),
    "generate_batch": lambda model: generate_batch(model, [[1, 2, 3]], progress_bar=False),
    "RolloutGenerator": lambda model: RolloutGenerator(model),
}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_model_whose_attention_bypasses_the_interface_is_refused_at_construction(builder):
    model = tiny_unsupported_model("falcon")
    with pytest.raises(UnsupportedModelError) as info:
        BUILDERS[builder](model)
    message = str(info.value)
    # what Falcon's layers raise depends on the transformers release (a TypeError from its own math, or the paged
    # function called without the engine's keyword arguments): the message must name whichever it was
    cause = info.value.__cause__
    assert cause is not None
    for words in ("FalconForCausalLM", "AttentionInterface", "_supports_attention_backend", "Llama", "Qwen3",
                  "GPT-2", repr(cause)):
        assert words in message, f"{words!r} missing from {message!r}"
    assert isinstance(info.value, ValueError)


def test_model_that_never_calls_an_attention_function_is_refused():
    # BLOOM computes attention itself and raises nothing: without the dry run it would silently attend over the
    # packed batch, ignoring the cache.
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM.*layers \[\] \(expected each of its 2"):
        LLMEngine(tiny_unsupported_model("bloom"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_tested_families_declare_support_and_send_every_layer_through_the_engine(kind):
    model = tiny_model(kind)
    assert type(model)._supports_attention_backend
    engine = LLMEngine(model, None, ContinuousBatchingConfig(page_size=8, num_blocks=16))
    calls, rows = engine.runner._dry_run()  # the rule an undeclared class is held to holds for these too
    assert sorted(calls) == [(layer, None) for layer in range(model.config.num_hidden_layers)] and rows == 1
    assert engine.runner.layer_windows() == [None] * model.config.num_hidden_layers and not engine.sliding_window


def test_undeclared_model_that_goes_through_the_interface_is_served(caplog):
    base = tiny_model("llama")
    undeclared = type("UndeclaredLlama", (type(base),), {"_supports_attention_backend": False})
    model = undeclared(base.config).eval()
    model.load_state_dict(base.state_dict())
    with caplog.at_level("WARNING", logger="rollout.engine.worker.model_runner"):
        engine = LLMEngine(model, None, ContinuousBatchingConfig(page_size=8, num_blocks=64))
    assert "UndeclaredLlama does not declare" in caplog.text
    prompt = random_prompts([11], seed=6)[0]
    (rid,) = engine.add_request(prompt, sampling_params=greedy(max_new_tokens=8, ignore_eos=True))
    tokens = run_engine(engine)[rid].generated_tokens
    ref, safe = greedy_reference(base, prompt, 8)
    assert safe >= 4 and tokens[:safe] == ref[:safe]

"""TRL's tool-calling loop on the engine: a tiny policy that really calls a calculator, tool results appended as ids
and masked out of the loss, and each tool-loop turn prefilling only the tool result."""

import copy

import pytest
import torch

pytest.importorskip("trl")
from trl import GRPOConfig

from rollout import ContinuousBatchingConfig
from rollout.demo import calculator as calc
from rollout.loading import DEFAULT_MODEL, load_model
from trainer_hooks import RolloutGRPOTrainer

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)


@pytest.fixture(scope="module")
def tool_policy():
    model, tok = load_model(str(DEFAULT_MODEL), torch.float32)
    calc.tool_tokenizer(tok)
    calc.tool_policy(model, tok)
    calc.warm_up(model, tok, steps=150)  # calls the tool nearly always, gets the answer right sometimes
    return model, tok


def _trainer(tmp_path, model, tok, **config):
    args = GRPOConfig(**{**dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=16,
                                num_generations=4, max_completion_length=24, max_steps=2, logging_steps=1,
                                report_to="none", save_strategy="no", learning_rate=1e-3, seed=0, beta=0.0,
                                disable_tqdm=True, temperature=0.7, max_tool_calling_iterations=2), **config})
    return RolloutGRPOTrainer(model=model, reward_funcs=calc.reward, args=args, train_dataset=calc.make_dataset(64),
                              processing_class=tok, tools=[calc.calculator], rollout_config=CB)


class _Recorder:
    """What TRL asked the engine for (prompts, engine stats per call) and what it trained on."""

    def __init__(self, trainer):
        self.calls, self.batches = [], []
        adapter = trainer.vllm_generation
        generate, score = adapter.generate, trainer._generate_and_score_completions

        def recorded_generate(prompts, images, num_generations, profiler=None):
            out = generate(prompts, images, num_generations, profiler)
            self.calls.append(([list(p) for p in prompts], adapter.last_batch))
            return out

        def recorded_score(inputs):
            out = score(inputs)
            self.batches.append(out)
            return out

        adapter.generate = recorded_generate
        trainer._generate_and_score_completions = recorded_score


def test_trl_tool_loop_runs_on_the_engine_with_tool_results_masked(tmp_path, tool_policy):
    model, tok = copy.deepcopy(tool_policy[0]), tool_policy[1]
    trainer = _trainer(tmp_path, model, tok)
    assert trainer.vllm_generation.conversations is not None
    record = _Recorder(trainer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logs) == 2 and min(h["tools/call_frequency"] for h in logs) > 0.5, "the policy should call the tool"
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "training changed nothing"

    tool, assistant, eos = (tok.convert_tokens_to_ids(t) for t in ("<tool>", "<assistant>", "<eos>"))
    follow_ups = 0
    for (prompts, batch), (first_prompts, first_batch) in zip(record.calls[1:], record.calls):
        if not batch.samples or prompts[0][:9] != first_prompts[0][:9] or len(prompts[0]) <= len(first_prompts[0]):
            continue  # a new step's first call, not a tool-loop turn
        follow_ups += 1
        # the tool-loop prompt is prompt + completion + tool result as ids: it extends a sequence just generated,
        # whose KV was kept, so only the tool result and the completion's last token were prefilled
        generated = {tuple(s.prompt_ids + s.completion_ids) for s in first_batch.samples}
        suffixes = []
        for p in prompts:
            base = next(g for g in generated if tuple(p[:len(g)]) == g)
            suffix = p[len(base):]
            assert suffix[0] == tool and suffix[-2:] == [eos, assistant], tok.decode(suffix)
            assert tok.decode(suffix[1:-2]) == calc.calculator(calc.parse_call(tok.decode(list(base))) or "0"), (
                "the appended tool result is the calculator's answer to the call")
            suffixes.append(suffix)
        # identical prompts next to each other (same completion, same result) are one group, prefilled once
        runs = [s for k, (s, prompt) in enumerate(zip(suffixes, prompts)) if k == 0 or prompt != prompts[k - 1]]
        assert batch.stats["prefill_tokens"] == sum(len(s) + 1 for s in runs)
    assert follow_ups >= 1, "TRL never ran a tool-loop turn"

    masked_tool_tokens = 0
    for out in record.batches:
        ids, mask, tool_mask = out["completion_ids"], out["completion_mask"], out["tool_mask"]
        for row in range(ids.shape[0]):
            tokens = ids[row][mask[row].bool()].tolist()
            flags = tool_mask[row][mask[row].bool()].tolist()
            inside = False
            for t, flag in zip(tokens, flags, strict=True):
                inside = (t == tool) or (inside and t != assistant)
                in_tool_result = inside or t == assistant  # <tool> ... <eos> <assistant>: the tool's turn
                assert flag == (0 if in_tool_result else 1), (tok.decode(tokens), flags)
                masked_tool_tokens += flag == 0
    assert masked_tool_tokens > 0
    trainer.rollout_generator.close()

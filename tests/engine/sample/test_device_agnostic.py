"""The sampling path on an accelerator, without one: `meta` plays the device (see tests/helpers/devices.py), so a
per-row tensor left on the CPU, an index from the host or a host sync on the device raises. Every step reads its
results back in one host transfer (`sampler.to_host`), which these tests count; the packed transfer gives exactly
what a per-tensor read gives. A sampler failure in the engine fails that step's requests and the engine keeps
serving.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from rollout import ContinuousBatchingConfig, RequestStatus, generate_batch
from rollout.engine.engine import LLMEngine
from rollout.engine.sample import prompt_logprobs
from rollout.engine.sample import sampler as sampler_module
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.sampler import Sampler
from rollout.engine.sample.structured_output import GrammarMasker
from tests.engine.sample.test_logits_processors import forced_prefix, resolved
from tests.helpers.devices import ACCELERATOR, DeviceMixChecker
from tests.helpers.models import greedy, random_prompts, run_engine

VOCAB = 64
TOKENS = [3, 9, 4, 11, 7, 20]  # every row's history: prompt and generated tokens


@pytest.fixture
def transfers(monkeypatch) -> list[torch.Tensor]:
    """The buffers passed to `to_host`, which answers zeros for a meta buffer (it has no data to copy)."""
    calls: list[torch.Tensor] = []
    real = sampler_module.to_host

    def to_host(buffer: torch.Tensor) -> torch.Tensor:
        calls.append(buffer)
        if buffer.device == ACCELERATOR:
            return torch.zeros(buffer.shape, dtype=buffer.dtype)
        return real(buffer)

    monkeypatch.setattr(sampler_module, "to_host", to_host)
    return calls


class OnTheLogitsDevice(LogitsProcessor):
    """Checks that a batched processor gets its input ids where its scores are; masks nothing."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert input_ids.device == scores.device, (input_ids.device, scores.device)
        return scores


def _rows(*settings: dict) -> list[SampleRow]:
    return [SampleRow(resolved(**kw), list(TOKENS), num_generated=2) for kw in settings]


ROW_MIXES = {
    "greedy": [dict(temperature=0.0)] * 3,
    "unit-temperature": [dict(temperature=1.0), dict(temperature=1.0, seed=3)],
    "temperatures": [dict(temperature=0.7), dict(temperature=1.5, seed=1), dict(temperature=0.0)],
    "truncation": [dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.9, seed=2),
                   dict(temperature=1.2, min_p=0.1), dict(temperature=0.0, top_k=3), dict(temperature=1.0)],
    "seeded-and-unseeded": [dict(temperature=1.0, seed=s) for s in (None, 4, None, 5)],
    "logprobs": [dict(temperature=0.0, logprobs=3), dict(temperature=0.7, logprobs=2),
                 dict(temperature=1.0, logprobs=0), dict(temperature=1.0)],
    "logprobs-untempered": [dict(temperature=1.0, logprobs=4), dict(temperature=0.0, logprobs=1)],
    "logprobs-zero": [dict(temperature=0.5, logprobs=0)],
    "repetition-penalty": [dict(temperature=0.7, repetition_penalty=1.3), dict(temperature=0.0, repetition_penalty=0.8),
                           dict(temperature=1.0)],
    "logit-bias": [dict(temperature=1.0, logit_bias={5: 2.0, 9: -3.0}), dict(temperature=1.0)],
    "allowed-token-ids": [dict(temperature=0.9, allowed_token_ids=[1, 5, 8]),
                          dict(temperature=0.0, allowed_token_ids=[2, 3])],
    "bad-words": [dict(temperature=1.0, bad_words_ids=[[5], [9]]),  # one-token words
                  dict(temperature=1.0, bad_words_ids=[[7, 20, 30], [11, 2]]),  # the first ends TOKENS: completed
                  dict(temperature=0.0, bad_words_ids=[[1], [20, 6]])],
    "min-new-tokens": [dict(temperature=1.0, min_new_tokens=5, eos_token_id=[2, 6]),
                       dict(temperature=0.0, min_new_tokens=3, stop_token_ids=[4], eos_token_id=1)],
    "own-processors": [dict(temperature=1.0, logits_processors=[forced_prefix([5, 6, 7])]),
                       dict(temperature=0.8, logits_processors=[OnTheLogitsDevice()]),
                       dict(temperature=0.8, logits_processors=[OnTheLogitsDevice()]),
                       dict(temperature=0.0, logits_processors=[SuppressTokensLogitsProcessor([4], ACCELERATOR)])],
    "everything": [dict(temperature=0.7, top_k=8, seed=1, logprobs=2, repetition_penalty=1.2, logit_bias={3: 1.0},
                        bad_words_ids=[[5], [7, 20, 9]], min_new_tokens=4, eos_token_id=[2]),
                   dict(temperature=0.0, allowed_token_ids=[1, 2, 3], logprobs=1),
                   dict(temperature=1.0, logits_processors=[OnTheLogitsDevice()]), dict(temperature=1.3)],
}


@pytest.mark.parametrize("mix", list(ROW_MIXES), ids=list(ROW_MIXES))
def test_sampling_on_an_accelerator_stays_on_it_and_reads_back_once(mix, transfers):
    rows = _rows(*ROW_MIXES[mix])
    logits = torch.empty(len(rows), VOCAB, dtype=torch.bfloat16, device=ACCELERATOR)
    with DeviceMixChecker() as checker:
        res = Sampler(seed=0).sample(logits, rows)
    assert checker.calls > 0, "the sampler ran outside the checker"
    assert len(transfers) == 1, "one host transfer per step"
    assert res.errors == {}, "a processor failed on the device"
    assert [type(t) for t in res.tokens] == [int] * len(rows)
    for values in (res.logprobs, res.policy_logprobs, res.kept_logmass):
        assert [type(v) for v in values] == [float] * len(rows)
    asking = {i for i, r in enumerate(rows) if r.sampling.logprobs is not None}
    assert set(res.alternatives) == asking
    for i in asking:
        assert type(res.alternatives[i].raw_logprob) is float
        assert all(type(t) is int for t in res.alternatives[i].policy_top)


def test_prompt_logprobs_on_an_accelerator_read_back_once(monkeypatch, transfers):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 4)  # several slices per request

    class Prompt:
        def __init__(self, ids: list[int], **kw) -> None:
            self.prompt_ids, self.sampling = ids, resolved(**kw)

    requests = [Prompt(list(range(1, 12)), prompt_logprobs=3), Prompt([5, 6, 7, 8], prompt_logprobs=0,
                                                                    prompt_logprobs_temperature=0.5)]
    logits = torch.empty(2 + 10 + 3, VOCAB, device=ACCELERATOR)
    with DeviceMixChecker():
        kept, records = prompt_logprobs.compute([(0, 0, 10), (1, 0, 3)], requests, logits, 2)
    assert len(transfers) == 1
    assert kept.shape == (2, VOCAB)
    assert [len(r.logprobs) for r in records] == [10, 3]
    assert len(records[0].top) == 10 and all(len(t) == 1 for t in records[0].top)  # zeros: one distinct id
    assert records[1].top is None


# ----------------------------------------------------------------------------------------- the packed transfer


def test_a_packed_transfer_reads_what_each_tensor_reads():
    tensors = [torch.tensor([0, 7, 2**40 + 1]), torch.tensor([-0.5, float("-inf"), 3e-9]),
               torch.tensor([True, False]), torch.randn(2, 3).topk(2, dim=-1).indices, torch.zeros(0)]
    packed = sampler_module.pack(tensors)
    assert packed.dtype == torch.float64 and packed.dim() == 1
    got = sampler_module.unpack(packed, tensors)
    assert got == [t.tolist() for t in tensors]
    assert [type(x) for x in got[0]] == [int] * 3 and [type(x) for x in got[2]] == [bool] * 2


def test_the_packed_path_samples_exactly_what_the_direct_path_does(monkeypatch, transfers):
    """The packed path on real (CPU) data: tokens, logprobs, alternatives and failed rows all match."""
    mixes = [mix for name, mix in ROW_MIXES.items() if name != "own-processors"]  # its Suppress is on meta
    rows = [r for mix in mixes for r in _rows(*mix)]
    rows += _rows(dict(temperature=1.0, logits_processors=[forced_prefix([5, 6, 7])]),
                  dict(temperature=0.0, logits_processors=[SuppressTokensLogitsProcessor([4])]),
                  dict(temperature=1.0, allowed_token_ids=[5], bad_words_ids=[[5]]))  # nothing left: it fails
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0))
    direct = Sampler(seed=3).sample(logits, rows)
    assert transfers == [], "on the CPU the results are read directly"
    assert list(direct.errors) == [len(rows) - 1]
    monkeypatch.setattr(sampler_module, "host_lists",
                        lambda tensors: sampler_module.unpack(sampler_module.to_host(sampler_module.pack(tensors)),
                                                              tensors))
    packed = Sampler(seed=3).sample(logits, rows)
    assert len(transfers) == 1
    ok = [i for i in range(len(rows)) if i not in direct.errors]
    for field in ("tokens", "logprobs", "policy_logprobs", "kept_logmass"):
        assert [getattr(packed, field)[i] for i in ok] == [getattr(direct, field)[i] for i in ok], field
    assert packed.errors == direct.errors
    assert packed.alternatives == direct.alternatives


# ----------------------------------------------------------------------------------------- structured outputs


def test_the_grammar_bitmask_is_pinned_for_a_gpu_and_reused(monkeypatch):
    """Pinning needs a GPU: `pin_memory` is replaced by a recorder (xgrammar's fill needs real memory, so the
    meta tests above leave grammars out)."""
    pytest.importorskip("xgrammar")
    pinned: list[tuple[int, ...]] = []

    def pin_memory(self, *args, **kwargs):
        pinned.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    masker = GrammarMasker()
    host = masker.buffer(4, 100, pinned=False)
    assert masker.buffer(3, 100, pinned=False) is host and pinned == [], "a CPU step neither pins nor reallocates"
    gpu = masker.buffer(4, 100, pinned=True)
    assert pinned == [(4, 4)] and gpu is not host
    assert masker.buffer(2, 100, pinned=True) is gpu and len(pinned) == 1, "pinned once, then reused"
    assert masker.buffer(8, 100, pinned=True) is not gpu and pinned[-1] == (8, 4), "grown, and pinned again"
    assert masker.buffer(8, 100, pinned=False) is not None and len(pinned) == 2


def test_the_grammar_bitmask_is_applied_on_the_logits_device(monkeypatch):
    xgr = pytest.importorskip("xgrammar")
    applied = []
    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace",
                        lambda logits, bitmask, **kw: applied.append((logits.device, bitmask.device, kw)))

    def allow_all(bitmask, row):
        bitmask[row] = -1

    state = SimpleNamespace(sync=lambda count: None, matcher=SimpleNamespace(fill_next_token_bitmask=allow_all))
    masker = GrammarMasker()
    for device in (torch.device("cpu"), ACCELERATOR):
        masker.apply(torch.zeros(3, VOCAB, device=device), [state], [1], [0])
    assert [(logits, mask) for logits, mask, _ in applied] == [(torch.device("cpu"),) * 2, (ACCELERATOR,) * 2]
    assert not masker._pinned, "only a GPU gets a pinned bitmask"


# -------------------------------------------------------------------------------------- a failing sampler


def test_a_sampler_failure_fails_only_that_steps_requests(qwen3):
    prompts = random_prompts([12, 7, 9, 5, 6], seed=31)
    ref = generate_batch(qwen3, prompts, sampling_params=greedy(), progress_bar=False)
    engine = LLMEngine(qwen3, GenerationConfig(),
                       ContinuousBatchingConfig(page_size=4, num_blocks=64, max_requests_per_batch=2))
    for p in prompts[:4]:
        engine.add_request(p, sampling_params=greedy())
    real, calls = engine.sampler.sample, []

    def flaky(logits, rows):
        calls.append(len(rows))
        if len(calls) == 2:  # the first decode step of req_0 and req_1
            raise RuntimeError("injected sampler failure")
        return real(logits, rows)

    engine.sampler.sample = flaky
    outputs = run_engine(engine)
    failed = sorted(rid for rid, o in outputs.items() if o.status == RequestStatus.FAILED)
    assert failed == ["req_0", "req_1"], "exactly the requests of the failing step fail"
    for rid in failed:
        assert outputs[rid].finish_reason == "error" and "injected sampler failure" in outputs[rid].error
    for rid in ("req_2", "req_3"):
        assert outputs[rid].status == RequestStatus.FINISHED
        assert outputs[rid].generated_tokens == ref[rid].generated_tokens, rid
    engine.add_request(prompts[4], "later", sampling_params=greedy())
    later = run_engine(engine)["later"]
    assert later.status == RequestStatus.FINISHED and later.generated_tokens == ref["req_4"].generated_tokens
    assert engine.health.consecutive_failures == 0, "the engine is healthy again"

"""RolloutGenerator: groups, reproducibility, the logprob contract, weight updates that keep the KV cache alive."""

import threading

import pytest
import torch

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams, WeightUpdateError
from tests.helpers.models import greedy_reference, perturbed, random_prompts, tiny_model
from tests.helpers.tokenizers import tiny_tokenizer

CB = ContinuousBatchingConfig(page_size=8, num_blocks=512)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def _assert_greedy_equals(model, batch, max_new):
    for s in batch.samples:
        ref, safe = greedy_reference(model, s.prompt_ids, max_new)
        assert safe >= max_new // 2
        assert s.completion_ids[:safe] == ref[:safe]


@pytest.fixture()
def model():
    return tiny_model("qwen3")


def test_groups_are_prompt_major_reproducible_and_prefilled_once(model):
    prompts = random_prompts([21, 13, 34], seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123, ignore_eos=True)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.generate(prompts, n=8, sampling_params=params)
        assert batch.stats["prefill_tokens"] == sum(len(p) for p in prompts)  # each prompt prefilled once
        again = gen.generate(prompts, n=8, sampling_params=params)
    assert [s.prompt_index for s in batch.samples] == [j for j in range(3) for _ in range(8)]
    assert all(s.prompt_ids == prompts[s.prompt_index] for s in batch.samples)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in again.samples]
    assert len({tuple(s.completion_ids) for s in batch.group(0)}) > 4, "samples of a group should differ"
    for s in batch.samples:
        assert len(s.completion_ids) == len(s.logprobs) == len(s.policy_logprobs) == len(s.weight_versions) == 10
        assert s.finish_reason == "length" and s.weight_versions == [0] * 10


def test_forked_group_members_continue_from_the_shared_prompt_exactly(model):
    """Greedy n-groups: every member forks off the leader's prefill (shared full blocks, copied partial block)
    and must produce exactly the reference continuation."""
    prompts = random_prompts([21, 13, 34, 5], seed=13)  # none a multiple of the page size: partial blocks copied
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.generate(prompts, n=4, sampling_params=GREEDY)
        assert batch.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    _assert_greedy_equals(model, batch, 12)


def test_to_tensors_pads_and_masks(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.generate(random_prompts([3, 9], seed=3), n=2,
                             sampling_params=SamplingParams(temperature=1.0, max_new_tokens=6, seed=1,
                                                            ignore_eos=True))
    t = batch.to_tensors(pad_token_id=0)
    assert t["prompt_ids"].shape == (4, 9) and t["completion_ids"].shape == (4, 6)
    assert t["prompt_mask"][0].tolist() == [0] * 6 + [1] * 3  # left padding
    assert t["prompt_ids"][0, -3:].tolist() == batch.samples[0].prompt_ids
    assert torch.equal(t["completion_mask"].sum(1), torch.tensor([6, 6, 6, 6]))
    assert torch.allclose(t["logprobs"], t["policy_logprobs"] - t["kept_logmass"], atol=1e-5)


def test_update_weights_changes_outputs_and_keeps_every_buffer(model):
    prompts = random_prompts([17, 25], seed=4)
    new_model = perturbed(model)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        before = gen.generate(prompts, sampling_params=GREEDY)
        _assert_greedy_equals(model, before, 12)
        cache_ptrs = gen.manager.engine.cache.data_ptrs()
        param_ptrs = [p.data_ptr() for p in gen.model.parameters()]
        assert gen.update_weights(new_model) == 1 and gen.weight_version == 1
        assert gen.manager.engine.cache.data_ptrs() == cache_ptrs
        assert [p.data_ptr() for p in gen.model.parameters()] == param_ptrs
        after = gen.generate(prompts, sampling_params=GREEDY)  # same prompts: stale prefix KV must not be reused
        assert after.stats["prefix_hit_tokens"] == 0
        _assert_greedy_equals(new_model, after, 12)
        assert all(s.weight_versions == [1] * 12 for s in after.samples)
        assert [s.completion_ids for s in after.samples] != [s.completion_ids for s in before.samples]
        again = gen.generate(prompts, sampling_params=GREEDY)  # the new version's blocks are reusable
        assert again.stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize(("dtype", "route"), [(torch.float32, "0"), (torch.bfloat16, "0"), (torch.bfloat16, "1"),
                                              (torch.bfloat16, "panels")],
                         ids=["fp32", "bf16", "bf16 on fp32 copies", "bf16 on panels"])
def test_a_sync_writes_the_packed_copies_with_the_weights_and_generates_as_a_fresh_engine(dtype, route,
                                                                                          fresh_detection,
                                                                                          monkeypatch):
    """An update writes each packed copy in the same pass as its weight (fp32 copies of bf16 weights widened as they
    are written; panels, stacked or not, repacked member by member): the next forward refreshes none. Sampled tokens
    and policy logprobs then equal those of an engine built on the new weights."""
    from rollout.engine.cpu.features import ENV_BF16_PANELS, ENV_BF16_VIA_FP32, cpu_features
    from rollout.engine.cpu.packed_copy import PackedCopy
    from rollout.engine.cpu.packed_linear import PackedLinears

    monkeypatch.setenv(ENV_BF16_PANELS, "1" if route == "panels" else "0")
    monkeypatch.setenv(ENV_BF16_VIA_FP32, "0" if route == "panels" else route)
    if dtype not in cpu_features().served_dtypes:
        pytest.skip(f"{dtype} linears are not packed on this CPU")
    via_fp32 = route
    model, new_model = tiny_model("qwen3").to(dtype), perturbed(tiny_model("qwen3"), seed=9).to(dtype)
    prompts = random_prompts([17, 40], seed=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)

    def onednn_copies(gen: RolloutGenerator) -> None:
        """fp32 on oneDNN's copies even where the probe timed MKL's faster: an update cannot write MKL's in its pass
        (they are repacked by the next forward), and both engines must sum alike."""
        linears = gen.manager.engine.runner.linears
        if isinstance(linears, PackedLinears) and linears.mkl:
            linears.use_mkl(False)

    with RolloutGenerator(new_model, continuous_batching_config=CB) as fresh:
        onednn_copies(fresh)
        expected = fresh.generate(prompts, n=2, sampling_params=params)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        onednn_copies(gen)
        gen.generate(prompts, n=2, sampling_params=params)  # the packed copies exist
        linears = gen.manager.engine.runner.linears
        assert isinstance(linears, PackedLinears)
        copies = [*linears._packs.values(), *linears._stacks.values()]
        assert {entry.packed.dtype for entry in copies} == {torch.float32 if via_fp32 == "1" else dtype}
        assert bool(linears._stacks) == (route == "panels")  # the gated MLPs' gate and up: one stack each
        calls = {"refresh": 0, "load": 0}  # attempts
        written = {"refresh": 0, "load": 0}  # attempts that wrote the copy
        refresh, load = PackedCopy.refresh_in_place, PackedCopy.load_in_place

        def counting(name, fn):
            def wrapped(*args):
                calls[name] += 1
                result = fn(*args)
                written[name] += bool(result)
                return result
            return wrapped

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PackedCopy, "refresh_in_place", counting("refresh", refresh))
            patch.setattr(PackedCopy, "load_in_place", counting("load", load))
            gen.update_weights(new_model)
            after = gen.generate(prompts, n=2, sampling_params=params)
        assert written["load"] == calls["load"] > 0 and calls["refresh"] == 0
    for got, want in zip(after.samples, expected.samples, strict=True):
        assert got.completion_ids == want.completion_ids
        assert got.policy_logprobs == want.policy_logprobs


def test_update_from_a_stream_with_peft_names_bf16_and_tied_weights_once():
    model = tiny_model("qwen3")
    new_model = perturbed(model, seed=5)
    stream = []
    for name, tensor in new_model.state_dict().items():
        if "layers.0.self_attn.q_proj" in name:  # as PEFT names a merged base layer, plus an adapter to skip
            stream.append(("base_model.model." + name.replace("q_proj.", "q_proj.base_layer."), tensor.bfloat16()))
            stream.append(("base_model.model." + name.replace("q_proj.", "q_proj.lora_A.default."), tensor[:2]))
        else:
            stream.append((name, tensor.bfloat16()))
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        gen.update_weights(iter(stream))
        updated = gen.model.state_dict()
        for name, tensor in new_model.state_dict().items():
            assert torch.equal(updated[name], tensor.bfloat16().float()), name


@pytest.mark.parametrize("bad", ["unknown", "shape", "nan", "empty", "complex", "int", "bool", "float8 nan",
                                 "overflow"])
def test_rejected_update_keeps_old_weights(model, bad):
    prompts = random_prompts([15], seed=6)
    state = perturbed(model).state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    if bad in ("complex", "int", "bool", "float8 nan"):  # complex values escaped the finiteness check, ints and
        dtype = {"complex": torch.complex64, "int": torch.int32, "bool": torch.bool,  # bools were cast silently
                 "float8 nan": torch.float8_e4m3fn}[bad]
        state[name] = state[name].to(dtype)
        if bad not in ("int", "bool"):
            state[name][0, 0] = float("nan")
    elif bad == "overflow":  # finite in float64, inf in the model's float32
        state[name] = state[name].double()
        state[name][0, 0] = 1e300
    elif bad == "unknown":
        state["model.layers.0.mlp.not_a_weight"] = torch.zeros(3)
    elif bad == "shape":
        state["model.norm.weight"] = torch.ones(7)
    elif bad == "nan":
        state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    else:
        state = {"lora_A.weight": torch.zeros(2)}
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with pytest.raises(WeightUpdateError):
            gen.update_weights(state)
        assert gen.weight_version == 0
        _assert_greedy_equals(model, gen.generate(prompts, sampling_params=GREEDY), 12)


def _stream_until_update(gen, new_model, on_update, prompt, max_new=60, switch_after=5):
    manager = gen.manager
    if not manager.is_running():
        manager.start()
    rid = manager.add_request(prompt, max_new_tokens=max_new, streaming=True, temperature=0, ignore_eos=True)
    final = None
    for chunk in manager.request_id_iter(rid):
        if len(chunk.generated_tokens) == switch_after and gen.weight_version == 0:
            updater = threading.Thread(target=gen.update_weights, args=(new_model,), kwargs={"on_update": on_update})
            updater.start()
            updater.join()
        final = chunk
    return final


def test_in_flight_update_recompute_is_exact(model):
    new_model = perturbed(model, seed=7)
    prompt = random_prompts([19], seed=8)[0]
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        out = _stream_until_update(gen, new_model, "recompute", prompt)
    versions = out.weight_versions
    switch = versions.index(1)
    assert 5 <= switch < len(versions) and versions == [0] * switch + [1] * (len(versions) - switch)
    old_ref, old_safe = greedy_reference(model, prompt, switch)
    assert out.generated_tokens[:min(switch, old_safe)] == old_ref[:min(switch, old_safe)]
    prefix = prompt + out.generated_tokens[:switch]
    ref, safe = greedy_reference(new_model, prefix, len(versions) - switch)
    assert safe >= 10
    assert out.generated_tokens[switch:switch + safe] == ref[:safe]


def test_in_flight_update_keep_tags_versions(model):
    new_model = perturbed(model, seed=9)
    prompt = random_prompts([19], seed=10)[0]
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        out = _stream_until_update(gen, new_model, "keep", prompt)
        assert gen.manager.engine.stats().preemptions == 0  # kept its KV: no recompute
    versions = out.weight_versions
    switch = versions.index(1)
    assert 5 <= switch < len(versions) and versions == [0] * switch + [1] * (len(versions) - switch)


def test_share_weights_generates_from_the_live_module_while_it_trains():
    model = tiny_model("qwen3")
    model.config.attention_dropout = 0.0
    prompts = random_prompts([11, 23], seed=11)
    attn_before = model.config._attn_implementation
    with RolloutGenerator(model, continuous_batching_config=CB, share_weights=True) as gen:
        assert gen.model is model
        model.train()
        gen.generate(prompts, sampling_params=GREEDY)
        assert model.training and all(m.training for m in model.modules())
        assert model.config._attn_implementation == attn_before
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ids = torch.tensor([prompts[1]])
        model(ids, labels=ids).loss.backward()  # the training forward still works
        opt.step()
        assert gen.update_weights(model) == 1
        model.eval()
        _assert_greedy_equals(model, gen.generate(prompts, sampling_params=GREEDY), 12)


def test_bf16_copy_generates(model):
    with RolloutGenerator(model, continuous_batching_config=CB, dtype=torch.bfloat16) as gen:
        assert next(gen.model.parameters()).dtype == torch.bfloat16
        assert next(model.parameters()).dtype == torch.float32
        batch = gen.generate(random_prompts([9], seed=12), n=2,
                             sampling_params=SamplingParams(temperature=1.0, max_new_tokens=5, seed=0,
                                                            ignore_eos=True))
        assert all(len(s.completion_ids) == 5 for s in batch.samples)
        gen.update_weights(model)  # fp32 source into the bf16 copy


def test_text_chat_and_stop_strings():
    tok = tiny_tokenizer()
    model = tiny_model("qwen3")
    with RolloutGenerator(model, tokenizer=tok, continuous_batching_config=CB) as gen:
        chat = [{"role": "user", "content": "w1 w2 w3"}]
        batch = gen.generate(["w4 w5", chat], sampling_params=GREEDY)
        assert batch.samples[0].prompt_ids == tok("w4 w5")["input_ids"]
        assert batch.samples[1].prompt_ids == tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                      tokenize=True)["input_ids"]
        free = batch.samples[0].completion_ids
        stop_word = tok.decode([free[3]])
        stopped = gen.generate(["w4 w5"], sampling_params=SamplingParams(
            temperature=0, max_new_tokens=12, ignore_eos=True, stop_strings=[stop_word]))
        s = stopped.samples[0]
        first = next(i for i, t in enumerate(free) if tok.decode([t]) == stop_word)
        assert s.completion_ids == free[:first + 1] and s.finish_reason == "stop"
        assert stop_word in s.text or s.text.endswith(stop_word)


def test_eos_is_included_in_the_completion():
    model = tiny_model("qwen3")
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        free = gen.generate([[5, 6, 7]], sampling_params=GREEDY).samples[0].completion_ids
        eos = free[4]
        s = gen.generate([[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_new_tokens=12,
                                                                     eos_token_id=eos)).samples[0]
    assert s.completion_ids == free[:free.index(eos) + 1] and s.finish_reason == "stop"


def test_bad_prompt_raises_clearly(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with pytest.raises(ValueError, match="vocabulary"):
            gen.generate([[1, 2, 10_000]])
        with pytest.raises(ValueError, match="tokenizer"):
            gen.generate(["some text"])
        with pytest.raises(ValueError, match="on_update"):
            gen.update_weights(model, on_update="sometimes")


def _assert_nothing_left(gen):
    stats = gen.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.queued == 0
    assert stats.uncollected == 0
    assert stats.free_blocks == stats.num_blocks, "KV blocks leaked"
    assert not gen.manager.engine.requests
    gen.manager.engine.check_invariants()


# (bad prompt or n, words the error must contain besides the prompt index)
BAD_BATCH = {
    "empty prompt": ([], 1, ["empty"]),
    "id outside the vocabulary": ([1, 2, 10_000], 1, ["10000", "vocabulary"]),
    "negative id": ([1, -3], 1, ["-3", "vocabulary"]),
    "fractional id": ([1, 2.5], 1, ["2.5", "integers"]),
    "too long for the model": ([3] * 600, 1, ["600", "positions"]),
    "text without a tokenizer": ("hello", 1, ["tokenizer"]),
    "not a prompt": (42, 1, ["int"]),
}


@pytest.mark.parametrize("case", list(BAD_BATCH))
def test_one_bad_prompt_rejects_the_batch_before_anything_runs(model, case):
    bad, _, words = BAD_BATCH[case]
    prompts = random_prompts([9, 14], seed=8) + [bad] + random_prompts([5], seed=9)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        steps = gen.stats().steps
        for call in (gen.generate, gen.submit):
            with pytest.raises(ValueError) as info:
                call(prompts, n=2, sampling_params=GREEDY)
            message = str(info.value)
            assert "prompt 2" in message and "nothing was submitted" in message, message
            for word in words:
                assert word in message, f"{word!r} missing from {message!r}"
            _assert_nothing_left(gen)
        assert gen.stats().steps == steps, "no prompt of a rejected batch may run"
        good = gen.generate([prompts[0]], sampling_params=GREEDY)  # the generator keeps serving
        assert len(good.samples[0].completion_ids) == GREEDY.max_new_tokens


def test_every_bad_prompt_is_named(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with pytest.raises(ValueError, match=r"2 of 4 prompts") as info:
            gen.generate([[1, 2], [], [3, 4], [5, 999]], sampling_params=GREEDY)
        assert "prompt 1:" in str(info.value) and "prompt 3:" in str(info.value)
        _assert_nothing_left(gen)


@pytest.mark.parametrize("n, words", [(0, ["n must be >= 1", "0"]), ([1, 0, 2], ["n[1]", "prompt 1"]),
                                      ([1, 2], ["2 values for 3 prompts"]), (1.5, ["1.5"]),
                                      ([1, True, 1], ["n[1]", "True"])])
def test_bad_group_sizes_are_rejected_before_anything_runs(model, n, words):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with pytest.raises(ValueError) as info:
            gen.generate(random_prompts([4, 5, 6], seed=1), n=n, sampling_params=GREEDY)
        for word in words + ["nothing was submitted"]:
            assert word in str(info.value), str(info.value)
        _assert_nothing_left(gen)
        assert gen.stats().steps == 0


def test_bad_sampling_params_are_rejected_before_anything_runs(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with pytest.raises(ValueError, match=r"sampling_params.*top_p"):
            gen.generate(random_prompts([4, 5], seed=1), sampling_params=SamplingParams(top_p=0.0))
        with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
            gen.generate(random_prompts([4, 5], seed=1), sampling_params=SamplingParams(stop_strings=["x"]))
        _assert_nothing_left(gen)
        assert gen.stats().steps == 0


def test_interrupted_generate_cancels_what_it_submitted(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        real_get_result = gen.manager.get_result
        calls = []

        def interrupted(request_id=None, timeout=None):
            calls.append(request_id)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real_get_result(request_id, timeout)

        gen.manager.get_result = interrupted
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            gen.generate(random_prompts([6, 7, 8], seed=3), n=2, sampling_params=long)
        del gen.manager.get_result
        _assert_nothing_left(gen)  # cancellation is synchronous: nothing of the call is left

"""cpu_threads: the intra-op threads of an engine step, fixed or adapted to what other processes leave free."""

import gc
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, generate_batch
from rollout.engine import core_budget
from rollout.engine.core_budget import CoreBudget
from tests.helpers.models import random_prompts, tiny_model

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        ContinuousBatchingConfig(cpu_threads=bad)


def test_a_fixed_count_applies_to_the_step_and_is_restored():
    budget = CoreBudget(1)
    before = torch.get_num_threads()
    with budget.applied():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


NEVER = 3600.0  # a sampling interval the test outlives: the test takes the readings itself


def _fake_proc(monkeypatch, cpus: int, other_cores_busy: float):
    """/proc readings where other processes keep `other_cores_busy` cores busy and this one uses none."""
    clock = {"t": 0.0}
    monkeypatch.setattr(core_budget, "_allowed_cpus", lambda: set(range(cpus)))
    monkeypatch.setattr(core_budget.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(core_budget, "_busy_ticks", lambda _cpus: int(clock["t"] * core_budget._TICKS
                                                                          * other_cores_busy))
    monkeypatch.setattr(core_budget, "_own_ticks", lambda: 0)
    return clock


@pytest.mark.parametrize("busy, wanted, expected", [(0.0, 2, 2), (0.3, 2, 2), (0.6, 2, 1), (2.0, 2, 1),
                                                    (1.0, 8, 1), (0.0, 4, 2)])
def test_auto_steps_with_the_cores_others_leave_free(monkeypatch, busy, wanted, expected):
    clock = _fake_proc(monkeypatch, cpus=2, other_cores_busy=busy)
    budget = CoreBudget("auto", interval=NEVER)  # first reading at t=0
    clock["t"] = 1.0
    budget.sample()
    assert budget.threads(wanted) == expected


def test_auto_steps_with_the_last_window_only(monkeypatch):
    clock = _fake_proc(monkeypatch, cpus=2, other_cores_busy=2.0)
    budget = CoreBudget("auto", interval=NEVER)
    assert budget.threads(2) == 2  # no complete window yet: every core counts as free
    clock["t"] = 1.0
    budget.sample()
    assert budget.threads(2) == 1
    monkeypatch.setattr(core_budget, "_busy_ticks", lambda _cpus: int(1.0 * core_budget._TICKS * 2.0))  # now idle
    clock["t"] = 1.2
    assert budget.threads(2) == 1  # steps read the last window: nothing changes between readings
    budget.sample()
    assert budget.threads(2) == 2


def test_a_neighbour_gone_quiet_before_the_next_step_leaves_every_core(monkeypatch):
    """Other processes kept both cores busy, then went idle, while the engine took no step: the first step after
    uses the recent, idle window, not an average over the whole pause (which would say one core is still taken)."""
    start = time.monotonic()
    quiet_at = start + 0.6

    def busy_ticks(_cpus):
        busy_for = min(time.monotonic(), quiet_at) - start
        return int(busy_for * core_budget._TICKS * 2.0)

    monkeypatch.setattr(core_budget, "_allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(core_budget, "_busy_ticks", busy_ticks)
    monkeypatch.setattr(core_budget, "_own_ticks", lambda: 0)
    budget = CoreBudget("auto", interval=0.1)
    time.sleep(0.3)
    assert budget.threads(2) == 1  # the neighbour is still busy
    time.sleep(0.9)
    assert budget.threads(2) == 2


def _sampler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "rollout-core-budget"}


def test_the_sampling_thread_ends_with_its_budget():
    before = _sampler_threads()
    budget = CoreBudget("auto", interval=NEVER)
    (thread,) = _sampler_threads() - before
    assert CoreBudget(1) and _sampler_threads() - before == {thread}  # a fixed count samples nothing
    del budget
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_auto_sees_real_competing_processes():
    """Two busy processes on this machine's cores: auto leaves the engine one thread (whatever else runs here)."""
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(max(2, len(core_budget._allowed_cpus())))]
    try:
        budget = CoreBudget("auto")
        time.sleep(1.0)
        assert budget.threads(2) == 1
        assert budget.free_cores < 1.0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_an_engine_with_a_budget_steps_with_it_and_gives_the_same_tokens():
    model = tiny_model("qwen3")
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    prompts = random_prompts([5, 11, 7], seed=2)
    before = torch.get_num_threads()
    reference = generate_batch(model, prompts, GREEDY, ContinuousBatchingConfig(page_size=8), progress_bar=False)
    seen.clear()
    got = generate_batch(model, prompts, GREEDY, ContinuousBatchingConfig(page_size=8, cpu_threads=1),
                         progress_bar=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before
    assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in reference.values()]

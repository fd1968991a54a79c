"""cpu_threads: the intra-op threads of an engine step, fixed or adapted to what other processes leave free."""

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, generate_batch
from rollout.engine.cpu import core_budget
from rollout.engine.cpu.core_budget import CoreBudget
from tests.helpers.models import random_prompts, tiny_model
from tests.helpers.waiting import HANG_GUARD_S, wait_for

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
    uses the recent, idle window the sampling thread read, not an average over the whole pause (which would say one
    core is still taken). The readings come at 0.25 s intervals of a driven clock."""
    clock = _fake_proc(monkeypatch, cpus=2, other_cores_busy=0.0)
    quiet_at = 0.6
    monkeypatch.setattr(core_budget, "_busy_ticks", lambda _cpus: int(min(clock["t"], quiet_at) * core_budget._TICKS
                                                                         * 2.0))
    budget = CoreBudget("auto", interval=NEVER)
    for reading in (0.25, 0.5):
        clock["t"] = reading
        budget.sample()
    assert budget.threads(2) == 1  # the neighbour is still busy
    for reading in (0.75, 1.0, 1.25):  # no step in between: only the sampling thread reads
        clock["t"] = reading
        budget.sample()
    assert budget.threads(2) == 2


def test_the_sampling_thread_reads_proc_every_interval(monkeypatch):
    """The readings come from the budget's own thread, whether or not anything steps."""
    readings = threading.Semaphore(0)
    busy_ticks = core_budget._busy_ticks

    def counted(cpus):
        if threading.current_thread().name == "rollout-core-budget":
            readings.release()
        return busy_ticks(cpus)

    monkeypatch.setattr(core_budget, "_busy_ticks", counted)
    budget = CoreBudget("auto", interval=0.01)
    for i in range(3):
        assert readings.acquire(timeout=HANG_GUARD_S), f"reading {i + 1} never came"
    del budget


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


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_auto_sees_real_competing_processes():
    """Busy processes on this machine's cores: auto leaves the engine one thread (whatever else runs here). The
    window is read once the spinners have used half a second of CPU each, however long that takes."""
    spin = "import sys\nprint('spinning', flush=True)\nwhile True: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
            for _ in range(max(2, len(core_budget._allowed_cpus())))]
    try:
        for hog in hogs:
            assert hog.stdout.readline().strip() == "spinning"
        budget = CoreBudget("auto", interval=NEVER)
        start = {hog.pid: _cpu_ticks(hog.pid) for hog in hogs}
        wait_for(lambda: all(_cpu_ticks(hog.pid) - start[hog.pid] >= core_budget._TICKS // 2 for hog in hogs),
                 "each spinner used half a second of CPU", poll_s=0.05)
        budget.sample()
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

"""Interpreter exit with generation still in flight: the process ends with the script's own exit status.

Python (<= 3.13) ends a daemon thread that is still inside a torch op at teardown with pthread_exit, and the forced
unwind through torch's GIL-release destructor aborts the process ("terminate called without an active exception",
exit code 134). The manager's exit hook hard-stops every loop before teardown begins. The subprocess scripts register
a reporting atexit hook *before* rollout installs its own, so the report runs after rollout's hook (atexit is LIFO)
and shows what that hook left behind.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest

import rollout.interpreter_exit as exit_module
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, RolloutGenerator
from tests.helpers.models import long_context_model, random_prompts

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CB = ContinuousBatchingConfig(page_size=8, num_blocks=512)

PREAMBLE = f"""
import atexit, sys, time
sys.path[:0] = [{str(ROOT)!r}]
state = {{}}

def report():
    manager, rid = state["manager"], state["rid"]
    out = manager.get_result(rid, timeout=0)
    status = out.status.name if out is not None else "NO_RESULT"
    print(f"REPORT loop_running={{manager.is_running()}} status={{status}} error={{out.error if out else None}}",
          flush=True)

atexit.register(report)  # before rollout is imported: runs after rollout's own exit hook

import torch
torch.set_num_threads(1)
from tests.helpers.models import long_context_model, random_prompts
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, RolloutGenerator, SamplingParams

LONG = SamplingParams(temperature=1.0, max_new_tokens=30000, ignore_eos=True, seed=0)
CB = ContinuousBatchingConfig(page_size=8, num_blocks=4096)

def wait_until_decoding(manager):
    while manager.stats().decode_tokens < 8:  # the loop is busy stepping: exit will find it inside a step
        time.sleep(0.01)
"""

MANAGER_EXITS = PREAMBLE + """
manager = ContinuousBatchingManager(long_context_model(), continuous_batching_config=CB)
manager.start()
ids = manager.add_requests(random_prompts([40] * 6, seed=1), sampling_params=LONG)
state.update(manager=manager, rid=ids[0])
wait_until_decoding(manager)
print("script done", flush=True)
"""

GENERATOR_EXITS = PREAMBLE + """
gen = RolloutGenerator(long_context_model(), continuous_batching_config=CB)
groups = gen.submit(random_prompts([30] * 4, seed=2), n=2, sampling_params=LONG)
state.update(manager=gen.manager, rid=groups[0][2][0])
wait_until_decoding(gen.manager)
print("script done", flush=True)
"""

EXCEPTION_MID_STREAM = PREAMBLE + """
manager = ContinuousBatchingManager(long_context_model(), continuous_batching_config=CB)
manager.start()
ids = manager.add_requests(random_prompts([40] * 4, seed=3), sampling_params=LONG)
rid = manager.add_request(random_prompts([12], seed=4)[0], streaming=True, sampling_params=LONG)
state.update(manager=manager, rid=ids[0])
for i, partial in enumerate(manager.request_id_iter(rid)):
    if i == 10:
        raise ValueError("the user's code failed mid-generation")
"""


def _run_script(source: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(ROOT))


def _report(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(lines) == 1, f"no report; stdout={result.stdout[-2000:]!r} stderr={result.stderr[-3000:]!r}"
    return lines[0]


def _assert_clean_exit(result: subprocess.CompletedProcess, expected_rc: int) -> None:
    assert "terminate called" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == expected_rc, (result.returncode, result.stderr[-3000:])
    report = _report(result)
    assert "loop_running=False" in report, report  # rollout's exit hook stopped the loop before teardown
    # The request was still generating when the hook ran: it was failed, with a reason that says why.
    assert "status=FAILED" in report and "interpreter is exiting" in report, report


@pytest.mark.slow
def test_script_that_exits_mid_generation_with_a_manager_exits_cleanly():
    result = _run_script(MANAGER_EXITS)
    assert "script done" in result.stdout
    _assert_clean_exit(result, 0)


@pytest.mark.slow
def test_script_that_exits_mid_generation_with_a_rollout_generator_exits_cleanly():
    result = _run_script(GENERATOR_EXITS)
    assert "script done" in result.stdout
    _assert_clean_exit(result, 0)


@pytest.mark.slow
def test_uncaught_exception_mid_generation_exits_with_status_one_and_its_traceback():
    result = _run_script(EXCEPTION_MID_STREAM)
    assert "ValueError: the user's code failed mid-generation" in result.stderr
    _assert_clean_exit(result, 1)


# ------------------------------------------------------------------------------------------------ in-process


@pytest.fixture()
def registry(monkeypatch):
    """A private registry, so stopping "all" managers touches only this test's."""
    fresh = weakref.WeakSet()
    monkeypatch.setattr(exit_module, "_live_managers", fresh)
    return fresh


def test_exit_hook_hard_stops_running_loops_and_fails_in_flight_requests(registry):
    model = long_context_model()
    manager = ContinuousBatchingManager(model, continuous_batching_config=CB)
    manager.start()
    assert manager in registry
    ids = manager.add_requests(random_prompts([20] * 3, seed=5), max_new_tokens=20000, ignore_eos=True)
    first = manager.get_result(ids[0], timeout=0)  # nothing can have finished 20000 tokens yet
    assert first is None
    assert exit_module.stop_all_managers() == 0
    assert not manager.is_running()
    for rid in ids:
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FAILED and "interpreter is exiting" in out.error, out
    stats = manager.stats()
    assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.num_blocks
    manager.destroy()


def test_registry_does_not_keep_a_stopped_manager_alive(registry):
    manager = ContinuousBatchingManager(long_context_model(), continuous_batching_config=CB)
    manager.start()
    rid = manager.add_request([1, 2, 3], max_new_tokens=4)
    assert manager.get_result(rid).status == RequestStatus.FINISHED
    manager.stop()
    ref = weakref.ref(manager)
    del manager
    gc.collect()
    assert ref() is None
    assert len(registry) == 0


def test_a_dropped_rollout_generator_stops_its_loop(registry):
    gen = RolloutGenerator(long_context_model(), continuous_batching_config=CB)
    gen.submit([[4, 5, 6]])
    thread: threading.Thread = gen.manager._thread
    manager_ref = weakref.ref(gen.manager)
    del gen
    gc.collect()
    thread.join(timeout=120)  # the finalizer signalled a hard stop; the loop ends after its current step
    assert not thread.is_alive()
    del thread
    gc.collect()
    assert manager_ref() is None, "the stopped loop must not keep the manager (and its KV cache) alive"

"""Tensor parallelism on CPU: two gloo ranks of a model transformers shards itself (`tp_plan="auto"`).

Each test launches the ranks as plain processes (tests/engine/tp_worker.py) so that one of them can die without a
launcher tearing the other down, and compares what every rank saw with a single-process reference.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.engine.tp_worker import NEW_TOKENS, PROMPTS
from tests.helpers.models import COMMON, greedy_reference, perturbed, tiny_model

WORKER = Path(__file__).with_name("tp_worker.py")
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, models: Path, out: Path) -> list[dict | None]:
    """Every rank's record (None for a rank that wrote none), after all of them exited."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(RANKS),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(models), str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True)
             for r in range(RANKS)]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a tensor-parallel rank hung in {scenario!r}")
        errors.append(err)
    records = [json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None for r in range(RANKS)]
    assert records[0] is not None, f"rank 0 wrote nothing:\n{errors[0][-3000:]}"
    return records


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_models")
    for name, model in [("llama", tiny_model("llama")), ("qwen3", tiny_model("qwen3"))]:
        model.save_pretrained(root / name)
    perturbed(tiny_model("qwen3"), scale=0.2).save_pretrained(root / "qwen3_new")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": 1})).save_pretrained(root / "mqa")
    return root


def references(model) -> list[tuple[list[int], int]]:
    return [greedy_reference(model, p, NEW_TOKENS) for p in PROMPTS]


def assert_greedy_equal(got: list[list[int]], refs: list[tuple[list[int], int]]) -> None:
    for tokens, (ref, safe) in zip(got, refs):
        assert tokens[:safe] == ref[:safe]
        assert safe >= NEW_TOKENS // 2  # the comparison covers most of each sequence


def test_two_ranks_generate_like_one_and_stay_in_lock_step(models, tmp_path):
    ranks = run_ranks("serve", models, tmp_path)
    assert ranks[1] is not None
    qwen3, qwen3_new = tiny_model("qwen3"), perturbed(tiny_model("qwen3"), scale=0.2)
    for rank in ranks:
        assert_greedy_equal(rank["llama_generate_batch"], references(tiny_model("llama")))
        assert_greedy_equal(rank["qwen3_generate_batch"], references(qwen3))
        assert_greedy_equal(rank["after_full_update"], references(qwen3_new))  # full tensors, cut per rank
        assert_greedy_equal(rank["after_sharded_update"], references(qwen3))  # DTensors from a sharded model
        assert rank["weight_version"] == 2
        assert rank["cancelled"][0] == "CANCELLED" and rank["cancelled"][1] < 400
        assert "every rank must pass the same inputs" in rank["divergent_inputs"]
        assert "cannot split the model's 1 KV heads" in rank["mqa"]
        assert "pass share_weights=True" in rank["copy"]
    # sampling without a seed draws the same tokens on both ranks (rank 0's seed), and cancellation acts at one step
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["sampled_logprobs"] == ranks[1]["sampled_logprobs"]
    assert len({tuple(s) for s in ranks[0]["sampled"]}) > 1
    assert ranks[0]["unseeded"] == ranks[1]["unseeded"]
    assert ranks[0]["cancelled"] == ranks[1]["cancelled"]


def test_a_dead_rank_ends_the_other_with_an_error(models, tmp_path):
    ranks = run_ranks("kill", models, tmp_path)
    assert ranks[1] is None  # it died before writing
    assert ranks[0]["first"]
    assert ranks[0]["error"] is not None and "loop died" in ranks[0]["error"]

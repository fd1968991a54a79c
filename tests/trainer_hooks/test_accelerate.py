"""`accelerate launch` with 2 CPU processes (gloo): each runs its own engine on its shard and syncs weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "ppo_accelerate.py"


@pytest.mark.slow
def test_two_process_ppo_loop(tmp_path):
    out = tmp_path / "ppo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLE),
           "--steps", "3", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert set(ranks[0]["shard_prompts"]).isdisjoint(ranks[1]["shard_prompts"]), "each process gets its own shard"
    for r in ranks:
        assert r["weight_version"] == 3  # one in-place sync per optimizer step
        assert r["kv_cache_kept"] and r["engine_matches_trained_model"]
        assert [h["weight_version"] for h in r["history"]] == [1, 2, 3]
    # DDP kept the replicas identical, and the gathered reward is the same on both ranks.
    assert ranks[0]["weights_checksum"] == pytest.approx(ranks[1]["weights_checksum"], rel=1e-6)
    assert [h["reward"] for h in ranks[0]["history"]] == [h["reward"] for h in ranks[1]["history"]]

"""benchmarks/gpu_check.sh is prepared for a GPU machine we rarely get: its dry run (CPU, tiny model) must go through
every stage here, so the one run on a lent GPU does not die on plumbing."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def test_dry_run_goes_through_every_stage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    logs = {p.name: p.read_text()[-2000:] for p in Path(tmp_path).glob("*.log")}
    assert done.returncode == 0, (done.stdout[-3000:], logs)
    stages = (tmp_path / "stages.txt").read_text().split("\n")
    assert [line.split()[0] for line in stages if line] == ["env", "tests", "syncs", "bench", "table"]
    assert all(" rc=0 " in line for line in stages if line), stages

    env_json = json.loads((tmp_path / "env.json").read_text())
    assert env_json["engine_default_page_size"] >= 4 and "MATH" in next(iter(env_json["sdpa_kernels"].values()))
    syncs = json.loads((tmp_path / "syncs.json").read_text())
    assert len(syncs) == 2 and all("sites" in step for step in syncs.values())
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert set(bench["throughput"]) == {"rollout engine", "transformers continuous batching", "model.generate"}
    assert all("tok_s" in r for r in bench["throughput"].values()), bench["throughput"]
    assert [r["rows"] for r in bench["decode_steps"]] == [1, 2] and bench["page_sizes"][0]["page_size"] == 16
    assert all(r["forward_ms"] > 0 and r["sample_ms"] > 0 for r in bench["decode_steps"] + bench["page_sizes"])

    table = (tmp_path / "table.md").read_text()
    for stage in ("env", "SDPA", "tests", "syncs", "throughput", "decode step", "page size"):
        assert any(line.startswith(stage) for line in table.splitlines()), stage
    assert "stage error" not in table

"""The main job: `rollout demo` raises the embedded policy's sampled accuracy (a short run of it)."""

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from rollout.demo.run import DEFAULT_MODEL, add_arguments, run


def test_embedded_policy_ships_with_the_package():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert tok.decode(tok("37+45=")["input_ids"]) == "37+45="


def test_short_demo_raises_the_reward(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--steps", "25", "--eval-size", "100", "--no-wandb", "--output-dir", str(tmp_path),
                              "--threads", "1"])
    out = io.StringIO()
    summary = run(args, out=out)
    before, after = summary["accuracy_before"]["sampled"], summary["accuracy_after"]["sampled"]
    assert 0.15 <= before <= 0.5, "the embedded policy should start at a middling sampled accuracy"
    assert after >= before + 0.25 and after >= 0.6, (before, after)
    assert summary["accuracy_after"]["greedy"] >= 0.9
    curve = summary["reward_curve"]
    assert len(curve) == 25 and sum(curve[-5:]) / 5 > sum(curve[:5]) / 5 + 0.2
    assert summary["weight_version"] == 26  # one sync per step, plus the final one
    assert (tmp_path / "reward_curve.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 25
    text = out.getvalue()
    for phrase in ["held-out accuracy", "tokens/s", "generating", "weight sync"]:
        assert phrase in text
    assert f"summary: {tmp_path / 'summary.json'}" in text  # where to find the numbers afterwards
    assert "W&B" not in text  # --no-wandb: no run to point at


def test_short_async_demo_raises_the_reward_within_the_staleness_bound(tmp_path):
    from rollout.demo import async_grpo

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--async", "--max-staleness", "2", "--steps", "25", "--eval-size", "100", "--no-wandb",
                              "--output-dir", str(tmp_path), "--threads", "2"])
    out = io.StringIO()
    summary = async_grpo.main(args, out=out)
    before, after = summary["accuracy_before"]["sampled"], summary["accuracy_after"]["sampled"]
    assert after >= before + 0.25 and after >= 0.6, (before, after)
    assert summary["steps"] == 25 and summary["weight_version"] == 25
    assert summary["versions_behind_max"] <= 2
    assert json.loads((tmp_path / "summary.json").read_text())["max_staleness"] == 2
    text = out.getvalue()
    for phrase in ["held-out accuracy", "samples/s", "versions behind", "weight sync"]:
        assert phrase in text


def test_wandb_offline_run_directory_is_reported(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from rollout.demo.run import report, wandb_run_dir

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.init(project="rollout-demo-test")
    try:
        directory, offline = wandb_run_dir()
    finally:
        wandb.finish()
        wandb.teardown()  # wandb keeps its settings (WANDB_DIR included) process-wide until torn down
    assert offline and Path(directory).is_dir() and Path(directory).name.startswith("offline-run-")
    assert Path(directory).is_relative_to(tmp_path.resolve())
    summary = {"accuracy_before": {"sampled": 0.3, "greedy": 0.4}, "accuracy_after": {"sampled": 0.7, "greedy": 0.9},
               "temperature": 1.0, "steps": 3, "weight_version": 4, "rollout_tokens_per_second": 100.0,
               "train_seconds": 1.0, "generation_share": 0.5, "weight_sync_seconds_mean": 0.001,
               "wandb_run_dir": directory, "wandb_offline": offline}
    out = io.StringIO()
    report(summary, out, tmp_path / "summary.json")
    text = out.getvalue()
    assert f"summary: {tmp_path / 'summary.json'}" in text
    assert f"W&B run: {directory}" in text and f"wandb sync {directory}" in text


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_cli_help(command):
    result = subprocess.run([sys.executable, "-m", "rollout", command, "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout

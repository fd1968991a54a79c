"""The `rollout` command as a user meets it: `python -m rollout ...` in a subprocess, checked for exit status, for one
line on stderr that says what to do, and for no traceback."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
EMBEDDED = ROOT / "rollout" / "assets" / "tiny-policy"
HEAVY = ("torch", "transformers", "fastapi", "uvicorn")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def rollout(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout", *args], capture_output=True, text=True, timeout=300,
                          env=env or _env(), cwd=cwd or ROOT)


def assert_one_line_error(result: subprocess.CompletedProcess, start: str, *phrases: str) -> str:
    """Exit status 2, exactly one line on stderr starting with `start` and naming each phrase, no traceback."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(start), lines[0]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("command, defaults", [
    ("serve", ["(default: 8000)", "(default: 127.0.0.1)", "(default: auto)", "(default: info)"]),
    ("demo", ["(default: 60)", "(default: rollout-demo)", "(default: 16)", "(default: the embedded policy)"]),
])
def test_help_shows_defaults(command, defaults):
    result = rollout(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines; compare the words
    for default in defaults:
        assert default in text, (default, result.stdout)
    assert "(default: None)" not in text


def test_building_the_parser_imports_nothing_heavy():
    """rollout.cli, rollout.loading, rollout.server.cli and rollout.demo.run: parser and --help without torch,
    transformers or fastapi (the rollout package's own __init__ is bypassed: this checks the CLI modules)."""
    code = f"""
import contextlib, io, sys, types
pkg = types.ModuleType("rollout"); pkg.__path__ = [{str(ROOT / "rollout")!r}]; sys.modules["rollout"] = pkg
import rollout.cli
rollout.cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    rollout.cli.main(["serve", "--help"])
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    rollout.cli.main(["demo", "--help"])
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_rollout_help_imports_neither_torch_nor_transformers():
    code = """
import contextlib, io, runpy, sys
sys.argv = ["rollout", "--help"]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    runpy.run_module("rollout", run_name="__main__")
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_serve_scheduler_choices_match_the_config():
    from rollout.config import SCHEDULER_TYPES
    from rollout.server.cli import SCHEDULER_CHOICES

    assert tuple(SCHEDULER_CHOICES) == tuple(SCHEDULER_TYPES)


# --------------------------------------------------------------------------------------------------- --model
@pytest.mark.parametrize("command", ["demo", "serve"])
def test_unknown_hub_id_offline_is_one_line(command):
    result = rollout(command, "--model", "does/not-exist")
    line = assert_one_line_error(result, f"rollout {command}: --model 'does/not-exist'", "cannot be fetched offline",
                                 "HF_HUB_OFFLINE", "local model directory with config.json")
    assert ("omit --model" in line) == (command == "demo")  # serve has no default model to fall back to


def test_directory_without_config_json(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    result = rollout("serve", "--model", str(tmp_path))
    assert_one_line_error(result, "rollout serve: --model", "without config.json", "save_pretrained")


def test_file_and_missing_path(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0")
    assert_one_line_error(rollout("demo", "--model", str(weights)), "rollout demo: --model", "is a file",
                          "config.json", "omit --model")
    assert_one_line_error(rollout("demo", "--model", "./no/such/dir"), "rollout demo: --model './no/such/dir'",
                          "does not exist", "omit --model")


def test_invalid_hub_id():
    assert_one_line_error(rollout("serve", "--model", "not a model!"), "rollout serve: --model 'not a model!'",
                          "valid hub id")


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """Answers every request the way the Hugging Face Hub answers for a repository that does not exist."""

    def do_GET(self) -> None:
        body = json.dumps({"error": "Repository not found"}).encode()
        self.send_response(401)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


def test_hub_id_not_found_online(tmp_path):
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        env = _env(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{hub.server_port}", HF_HOME=str(tmp_path))
        result = rollout("demo", "--model", "does/not-exist", env=env)
    finally:
        hub.shutdown()
    assert_one_line_error(result, "rollout demo: --model 'does/not-exist'", "has no model with that id",
                          "omit --model")


def test_hub_unreachable(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path))
    result = rollout("serve", "--model", "does/not-exist", env=env)
    assert_one_line_error(result, "rollout serve: --model 'does/not-exist'", "cannot be reached", "check the network")


def test_a_valid_directory_passes_the_check(tmp_path):
    from rollout.loading import ModelLoadError, check_model

    assert check_model(str(EMBEDDED)) == str(EMBEDDED)
    with pytest.raises(ModelLoadError, match=r"without config\.json"):
        check_model(str(tmp_path))


def test_incomplete_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text((EMBEDDED / "config.json").read_text())  # no weights, no tokenizer
    result = rollout("serve", "--model", str(tmp_path))
    assert_one_line_error(result, "rollout serve: --model", "could not be loaded", "complete checkpoint")


# ------------------------------------------------------------------------------------------------ serve extra
HINT = "rollout serve needs the serve extra: pip install 'rollout[serve]'"


def test_serve_without_the_extra_prints_the_install_hint(tmp_path):
    """fastapi present but failing to import (a broken or partial install) shadows the real one on PYTHONPATH."""
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text("raise ImportError('No module named fastapi')\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = rollout("serve", "--model", "X", "--port", "1234", env=env)
    assert_one_line_error(result, HINT, "torch==2.13.0 -e '.[serve]'", "fastapi")
    assert rollout("serve", "--help", env=env).returncode == 0  # the options still parse without fastapi


def test_serve_with_fastapi_and_uvicorn_not_installed():
    code = """
import sys

class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("fastapi", "uvicorn"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Uninstalled())
from rollout.cli import main
sys.exit(main(["serve", "--model", "X", "--port", "1234"]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert_one_line_error(result, HINT, "fastapi is not installed", "uvicorn is not installed")


def test_serve_picks_uvloop_when_installed_and_asyncio_without_it(monkeypatch):
    """The serve extra installs uvloop; a machine without it still serves, on asyncio's own loop."""
    from rollout.server.cli import event_loop

    pytest.importorskip("uvloop")
    assert event_loop() == "uvloop"
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop() == "asyncio"

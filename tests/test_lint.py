"""The code base stays clean under the ruff rules configured in pyproject.toml."""

import ast
import gc
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' (it is part of the test extra)")
    result = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


CLOCKS = {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns", "process_time"}
WAITING_HELPER = ROOT / "tests" / "helpers" / "waiting.py"


def _clock_reads(tree: ast.AST) -> list[int]:
    """Lines that call the real clock: time.monotonic() and its kin, however `time` or the function was imported."""
    aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "time" for alias in node.names if alias.name in CLOCKS}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in CLOCKS and isinstance(func.value, ast.Name)
                and func.value.id == "time") or (isinstance(func, ast.Name) and func.id in aliases):
            lines.append(node.lineno)
    return lines


def _hypothesis_deadlines(tree: ast.AST) -> list[int]:
    """Lines of hypothesis `settings(...)` without `deadline=None`: hypothesis's default deadline is a wall-clock
    assertion on every example."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "settings"
            and not any(k.arg == "deadline" and isinstance(k.value, ast.Constant) and k.value.value is None
                        for k in node.keywords)]


def test_no_test_reads_the_clock():
    """Tests never assert on elapsed time: on a shared 2-core machine any duration can stretch. They wait for events
    through tests/helpers/waiting.py (the one place that reads the clock, for its hang guard) and drive the code's
    injectable clocks; hypothesis runs without deadlines. Test subprocess scripts are checked too."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = _parse(path.read_text(), str(path))
        trees = [tree] + [_parse(node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
                          and isinstance(node.value, str) and "import" in node.value and _parses(node.value)]
        for sub in trees:
            if path != WAITING_HELPER:
                found += [f"{path.relative_to(ROOT)}:{line}: reads the clock" for line in _clock_reads(sub)]
            found += [f"{path.relative_to(ROOT)}:{line}: hypothesis settings without deadline=None"
                      for line in _hypothesis_deadlines(sub)]
    assert not found, "\n".join(found)


def _parse(source: str, filename: str = "<unknown>") -> ast.AST:
    """ast.parse with the garbage collector held off: on CPython 3.11 a finalizer that the collector runs while the
    parser builds its Python objects (earlier tests leave engines behind weakref.finalize) throws off the parser's
    recursion bookkeeping, and it raises "SystemError: AST constructor recursion depth mismatch"."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=filename)
    finally:
        if enabled:
            gc.enable()


def _parses(source: str) -> bool:
    try:
        _parse(source)
    except SyntaxError:
        return False
    return True


def test_the_clock_audit_finds_what_it_looks_for():
    imports = "import time\nfrom time import perf_counter as pc\n"  # two constants: the audit does not flag itself
    source = imports + "start = time.monotonic()\nassert pc() - start < 1\n@settings(max_examples=5)\ndef f(): pass\n"
    tree = ast.parse(source)
    assert _clock_reads(tree) == [3, 4] and _hypothesis_deadlines(tree) == [5]


MAX_MODULE_LINES = 450


def test_no_library_module_is_over_the_line_limit():
    """A module past a few hundred lines holds more than one concept: split it where the concepts part."""
    long = {str(path.relative_to(REPO_ROOT)): n for package in ("rollout", "trainer_hooks")
            for path in (REPO_ROOT / package).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}

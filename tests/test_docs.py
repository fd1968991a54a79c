"""The documentation builds with no warning (broken links and anchors fail), and the README's links resolve."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

README_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_docs_build_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).with_name("mkdocs"))
    if not Path(mkdocs).exists():
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' (it is part of the test extra)")
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_readme_link_names_a_file_of_the_repository():
    text = (REPO_ROOT / "README.md").read_text()
    targets = [m.group(1) for m in README_LINK.finditer(text) if "://" not in m.group(1)]
    assert targets, "the README links to its docs pages"
    missing = [t for t in targets if not (REPO_ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_docs_page_is_in_the_navigation():
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO_ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []

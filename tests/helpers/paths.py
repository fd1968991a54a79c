"""Where the repository is, for tests that run its scripts and examples from any folder of tests/."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

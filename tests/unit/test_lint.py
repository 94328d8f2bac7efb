"""The tree passes ruff (pyproject.toml's [tool.ruff]: pycodestyle, pyflakes, isort, bugbear)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    assert importlib.util.find_spec("ruff") is not None, "ruff is missing: pip install -e '.[test]'"
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "backboard", "tests", "benchmarks"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]


def test_ruff_reads_the_project_config(tmp_path):
    """The configuration is the one that runs: an unused import in a file under the tree fails."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                        str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F401" in r.stdout

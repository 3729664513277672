"""The code base passes its own linter (``make lint``), so a style slip fails ``make test``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: run `make setup` (it is a dev dependency)")
    out = subprocess.run([ruff, "check", "stabletrain", "tests", "scripts", "examples", "train.py"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

"""The analysis package runs where torch is not installed (a laptop, a login node): it reads files only."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_analysis_imports_no_torch_trainer_models_or_data():
    modules = sorted(p.stem for p in (ROOT / "stabletrain" / "analysis").glob("[!_]*.py"))
    code = f"import sys; import {', '.join(f'stabletrain.analysis.{m}' for m in modules)}; print(*sys.modules)"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    ours = {m for m in loaded if m.startswith("stabletrain") and not m.startswith("stabletrain.analysis")}
    assert "torch" not in loaded
    assert ours == {"stabletrain", "stabletrain.monitor", "stabletrain.monitor.names"}, ours


def test_a_run_reads_back_without_matplotlib():
    """A notebook or a script of one's own reads a run's series through analysis.runs without
    drawing: it loads no plotting library."""
    code = "import sys; import stabletrain.analysis.runs; print(*sys.modules)"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert "stabletrain.analysis.runs" in loaded and not {m for m in loaded if m.startswith("matplotlib")}

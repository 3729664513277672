"""From a composed config to a finished run directory."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from stabletrain.config import ConfigError, validate
from stabletrain.engine import distributed as D


def run(cfg, run_dir: str | Path) -> dict:
    """Validate, build, train; returns the summary (also in ``run_dir/summary.json``)."""
    from stabletrain.engine.loop import Trainer

    validate(cfg)
    info = D.detect()
    run_dir = Path(run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        return Trainer(cfg, run_dir, info).fit()
    finally:
        D.shutdown(info)


def fail(msg: str, code: int = 2) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def main_guarded(cfg, run_dir) -> dict | None:
    """``run`` with config mistakes reported as one line (no traceback) and exit code 2."""
    try:
        return run(cfg, run_dir)
    except ConfigError as e:
        fail(str(e))
    return None

"""Shared test helpers: compose a config the way train.py does, run a short training."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from stabletrain.cli import compose_config

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logger=none", "monitor=off", "logger.progress=false"]
# a gpt_test run that logs every step and does not evaluate: the runs of the loop and checkpoint tests
GPT_LOGGED = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1"]


def make_cfg(*overrides: str):
    return compose_config(list(overrides))


def train(run_dir: Path, *overrides: str, quiet: bool = True) -> dict:
    """Train in-process; returns the summary."""
    from stabletrain.run import run

    cfg = make_cfg(*((QUIET if quiet else []) + list(overrides)))
    return run(cfg, run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    from stabletrain.metrics import read_records

    out = {}
    for rec in read_records(Path(run_dir) / "metrics.jsonl"):
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    e = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def model_of(cfg):
    """The model a composed training config builds (its components, init and reparametrisation)."""
    from stabletrain.config import Components
    from stabletrain.models.registry import build_model

    return build_model(cfg.model, Components.of(cfg))


def has_cpp_compiler() -> bool:
    """Inductor (``compile=true``) builds C++ kernels on a CPU."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def alert_metrics(qk=None, ent=None, sec=None, block="blocks.0") -> dict:
    """One block's metrics as the health watch reads them: sigma1(Wq^T Wk) max over heads, the
    min attention entropy and SEC(d_h, s) for ``sec = {s: value}``."""
    m = {}
    if qk is not None:
        m[f"sigma1/{block}/wq_t_wk_max"] = qk
    if ent is not None:
        m[f"entropy/{block}/min"] = ent
    for s, v in (sec or {}).items():
        m[f"sec/{block}/s{s}"] = v
    return m


def _registries():
    from stabletrain.data import DATASETS
    from stabletrain.layers.attention import ATTENTIONS
    from stabletrain.layers.deescalate import DEESCALATIONS
    from stabletrain.layers.init import INITS
    from stabletrain.layers.norm import NORMS
    from stabletrain.layers.reparam import REPARAMS
    from stabletrain.losses import LOSS_TERMS
    from stabletrain.models.registry import MODELS
    from stabletrain.optim import OPTIMIZERS
    from stabletrain.optim.schedule import SCHEDULES

    return [DATASETS, ATTENTIONS, DEESCALATIONS, INITS, NORMS, REPARAMS, LOSS_TERMS, MODELS, OPTIMIZERS, SCHEDULES]


def forget_own_code(monkeypatch):
    """A fixture's body (``yield from``): what a test imports registers into the process's
    registries; taken out again after it, so that other tests in this worker see stabletrain's
    own options only, and the modules it imported are dropped."""
    regs = _registries()
    for r in regs:
        r.names()  # stabletrain's own options, loaded before the snapshot
    before = [dict(r._entries) for r in regs]
    modules = set(sys.modules)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for r, entries in zip(regs, before):
        r._entries = entries
    for name in set(sys.modules) - modules:
        if not name.startswith(("stabletrain", "torch", "timm", "omegaconf", "hydra")):
            sys.modules.pop(name)

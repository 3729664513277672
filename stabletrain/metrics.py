"""One metrics sink: console progress, ``metrics.jsonl`` in the run directory, and wandb.

wandb runs offline unless ``logger.wandb=online``, so a run never needs an account; if
wandb cannot start, the run goes on with the JSONL log and says so once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from pathlib import Path

from stabletrain.errors import first_line
from stabletrain.registry import option_value


def _clean(v):
    """JSON has no NaN/inf: write them as strings ("nan", "inf"), recursively."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(path: Path, obj) -> None:
    """Atomically: a temp file beside ``path``, fsync, then rename over it, so a kill mid-write
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(_clean(obj), indent=2, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path) -> dict | None:
    """A JSON object file (a run's summary.json), or None when it is missing or unreadable (a torn write)."""
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def previous_name(path: Path, *together: Path) -> Path:
    """The first free name of ``a.previous.b``, ``a.previous2.b``, ... beside ``path`` (``a.b``; a
    directory's whole name takes the suffix), where an earlier run's file or directory is moved when
    a fresh run starts on its directory. With ``together``, the first number free beside each of
    those too: a run's checkpoints and records go aside under one number."""
    def nth(p: Path, n: int) -> Path:
        stem, suffix = (p.name, "") if p.is_dir() else (p.stem, p.suffix)
        return p.with_name(f"{stem}.previous{'' if n == 1 else n}{suffix}")

    paths = [Path(p) for p in (path, *together)]
    n = 1
    while any(nth(p, n).exists() for p in paths):
        n += 1
    return nth(paths[0], n)


def read_lines(path: Path) -> list[str]:
    """The complete records of a ``metrics.jsonl``: a line that is not UTF-8 JSON (a write torn by a
    kill or a full disk, normally the last one) is dropped, never an error."""
    out = []
    for raw in Path(path).read_bytes().split(b"\n"):
        try:
            line = raw.decode("utf-8").strip()
            if line and isinstance(json.loads(line), dict):
                out.append(line)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
            continue
    return out


def read_records(path: Path) -> list[dict]:
    """``metrics.jsonl`` as dicts, torn lines dropped (:func:`read_lines`); [] when it is missing."""
    if not Path(path).is_file():
        return []
    return [json.loads(ln) for ln in read_lines(path)]


def logged_value(path: Path, key: str, step: int) -> float:
    """The value of ``key`` last logged at ``step`` in a ``metrics.jsonl`` (NaN when absent)."""
    vals = [r[key] for r in read_records(path) if r.get("step") == step and key in r]
    return float(vals[-1]) if vals else float("nan")


class StartNote(str):
    """A start line that depends on the step the run starts from: its text is a fresh run's, and
    ``at(step)`` the one a run resumed at ``step`` prints (None: nothing left to say)."""

    def __new__(cls, render):
        note = super().__new__(cls, render(0) or "")
        note.render = render
        return note

    def at(self, step: int) -> str | None:
        return self.render(step)


WANDB_STEP = "trainer/step"

# wandb offline makes no network attempt: no system stats (their samplers probe cloud metadata
# endpoints), no git/code/machine info, no console capture, no viewer lookup (fields of wandb 0.31's Settings)
OFFLINE_SETTINGS = {"x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True,
                    "x_disable_viewer": True, "disable_git": True, "disable_code": True, "save_code": False,
                    "console": "off"}


class Metrics:
    """``logger`` is the ``logger`` config group; ``name`` the run's name in wandb; ``config_dict``
    the resolved config wandb records."""

    def __init__(self, run_dir: Path, logger, *, name: str = "run", enabled: bool = True,
                 resume_step: int | None = None, config_dict: dict | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        self.tty = sys.stderr.isatty()
        self.show_progress = bool(logger.progress)
        if not enabled:
            return
        # a fresh start finds no file: the trainer has moved an earlier run's aside
        if self.path.exists() and resume_step is not None:
            self._truncate_after(resume_step)
        self.file = open(self.path, "a", buffering=1)
        mode = option_value(logger.wandb)
        if mode != "disabled":
            self._start_wandb(Path(run_dir), logger, name, mode, config_dict, resumed=resume_step is not None)

    def begin_with(self, history: Path, step: int) -> int:
        """A run resumed from another run's checkpoint at ``step``: its records start with that
        run's (``history``, its metrics.jsonl) up to the step, so that its figures show the whole
        run. Returns how many records were copied."""
        if not self.enabled or not history.is_file():
            return 0
        rows = [ln for ln in read_lines(history) if json.loads(ln).get("step", 0) <= step]
        self.file.write("".join(ln + "\n" for ln in rows))
        return len(rows)

    def truncate_after(self, step: int) -> None:
        """Drop the records after ``step`` while the run goes on (a rollback): the file is
        rewritten, then opened again for the records that follow."""
        if not self.enabled:
            return
        self.file.close()
        self._truncate_after(step)
        self.file = open(self.path, "a", buffering=1)

    def _truncate_after(self, step: int) -> None:
        """A resumed run redoes the steps after its checkpoint: drop their old records."""
        keep = [ln for ln in read_lines(self.path) if json.loads(ln).get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:  # a kill while rewriting leaves the old file, not a shortened one
            with open(tmp, "w") as f:
                f.write("".join(ln + "\n" for ln in keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _start_wandb(self, run_dir: Path, logger, name: str, mode: str, config_dict: dict | None,
                     resumed: bool) -> None:
        try:
            import wandb

            id_file = run_dir / "wandb_id.txt"
            # a resume continues the run's wandb history; a fresh run in a used directory starts its own
            run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            settings = {"silent": True}
            if mode == "offline":
                settings.update(OFFLINE_SETTINGS)
                os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # no crash reports (sentry)
            self.wandb = wandb.init(project=logger.project, entity=logger.entity, mode=mode,
                                    dir=str(run_dir), id=run_id, resume="allow", name=name,
                                    config=config_dict, settings=wandb.Settings(**settings))
            # the training step as every chart's x-axis, not wandb's own step, which only goes up:
            # after a rollback or a resume from an earlier checkpoint the same steps are logged again
            self.wandb.define_metric(WANDB_STEP)
            self.wandb.define_metric("*", step_metric=WANDB_STEP)
        except Exception as e:  # a tracking hiccup must not cost the run
            if mode == "online":  # no API key, no network: the offline run a `wandb sync` uploads later
                print(f"wandb online failed ({type(e).__name__}: {first_line(e)}); logging offline instead: "
                      f"`wandb sync {run_dir}/wandb/offline-run-*` uploads it later", file=sys.stderr)
                self._start_wandb(run_dir, logger, name, "offline", config_dict, resumed=True)
                return
            print(f"wandb disabled ({type(e).__name__}: {first_line(e)}); metrics go to {self.path}", file=sys.stderr)
            self.wandb = None

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        self.file.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log({**values, WANDB_STEP: step})

    def progress(self, step: int, total: int, values: dict) -> None:
        """One status line: overwritten in place on a terminal, appended in logs."""
        if not self.enabled or not self.show_progress:
            return
        parts = [f"step {step}/{total}"] + [f"{k} {_fmt(v)}" for k, v in values.items()]
        line = " | ".join(parts)
        if self.tty:
            say("\r" + line.ljust(100), end="")
        else:
            say(line)

    def message(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                say("")
            say(text)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            say("")
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def say(text: str, end: str = "\n") -> None:
    """Print to stderr. Where its reader has gone (``train.py 2>&1 | head``, a closed terminal),
    the run goes on without a console (metrics.jsonl and summary.json still record it): stderr
    becomes /dev/null rather than a broken pipe that would end the run as failed."""
    try:
        print(text, end=end, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stderr closed
        sys.stderr = open(os.devnull, "w")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def param_count(n: int) -> str:
    """``33.73K``, ``124.44M``: a parameter count in the start lines and tables."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def si(x: float) -> str:
    """``484k``, ``1.2M``: a rate for the progress line."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def milliseconds(seconds: float) -> str:
    """``57.3``, ``412``, ``12345``: a step time for the progress line, in ms, no exponent."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def duration(seconds: float) -> str:
    """``1h05m``, ``4m07s``, ``9s``: an ETA for the progress line."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


# Dense bf16 peak FLOP/s by device name (the vendors' datasheets, no sparsity), for MFU.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
             "4090": 165e12, "3090": 71e12}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like ``NVIDIA H100 80GB HBM3``; None if unknown."""
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)

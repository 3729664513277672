"""Atomic checkpoints: write a temp file beside the target, fsync, then rename over it."""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota); the previous one is kept.
    Its message is one line."""

    def __str__(self) -> str:
        return str(self.strerror)


def save_checkpoint(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kept = f"{path} still holds the previous checkpoint" if path.is_file() else "no checkpoint was kept"
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or type(e).__name__)
        raise CheckpointWriteError(e.errno, f"cannot write {path.name}: {why}; {kept}") from None


def remove_stale_temps(ckpt_dir: Path) -> list[Path]:
    """Temp files of checkpoint writes that a kill interrupted (``.last.pt.tmp<pid>``); call it
    only while holding the run directory's lock, when no other process can be writing one."""
    ckpt_dir = Path(ckpt_dir)
    gone = sorted(ckpt_dir.glob(".*.tmp*")) if ckpt_dir.is_dir() else []
    for p in gone:
        if p.is_dir():  # a sharded checkpoint's directory (.last_dcp.tmp, .step_N_dcp.tmp)
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def _floating(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            out.append(obj.detach())
    elif isinstance(obj, dict):
        for v in obj.values():
            _floating(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _floating(v, out)
    return out


def all_finite(*states) -> torch.Tensor:
    """Whether every floating tensor in ``states`` (state dicts, nested) is finite, as a bool
    tensor on the CPU: one fused max-abs reduction per device and dtype (``torch._foreach_norm``
    with ord=inf, which cannot overflow as a 2-norm can), read back with a single copy."""
    groups: dict = {}
    for t in _floating(list(states), []):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    verdict = []
    for ts in groups.values():
        norms = torch._foreach_norm(ts, float("inf"))
        verdict.append(torch.stack(norms).isfinite().all())
    if not verdict:
        return torch.tensor(True)
    return torch.stack([v.to("cpu", non_blocking=False) for v in verdict]).all()


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def last_checkpoint(run_dir: Path) -> Path | None:
    p = Path(run_dir) / "checkpoints" / "last.pt"
    return p if p.is_file() else None


def seed_all(seed: int) -> None:
    """torch's, Python's and NumPy's global generators (timm's Mixup draws from NumPy's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """Every global generator a step draws from, as tensors and lists (``weights_only`` loads)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = random.getstate()
    random.setstate((py[0], tuple(state["python"]), py[2]))
    if "numpy" in state:  # checkpoints from before it was saved lack it
        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- the ring: the last ``ckpt.keep`` checkpoints besides last.pt, for rollbacks ---------------

RING_PREFIX = "step_"


def ring_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{RING_PREFIX}{step:06d}.pt"


def ring_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ring's checkpoints, oldest first."""
    out = []
    for p in (Path(run_dir) / "checkpoints").glob(f"{RING_PREFIX}*.pt"):
        try:
            out.append((int(p.stem[len(RING_PREFIX):]), p))
        except ValueError:
            continue
    return sorted(out)


def dcp_dir(pt: Path) -> Path:
    """The sharded model and optimizer that go with the checkpoint file ``pt``: ``last.pt`` ->
    ``last_dcp/``, the ring's ``step_000040.pt`` -> ``step_000040_dcp/``."""
    return Path(pt).parent / f"{Path(pt).stem}_dcp"


def link_tree(src: Path, dest: Path) -> None:
    """``dest``: a directory of hard links to the files of ``src`` (copies where links are not
    possible), put in place by a rename, so the ring keeps a sharded checkpoint without a write."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_to_ring(run_dir: Path, step: int, keep: int, source: Path | None = None, sharded: bool = False) -> Path | None:
    """Add the checkpoint of ``step`` to the ring and drop the oldest beyond ``keep``.

    ``source`` (last.pt, just written) is hard-linked into place (no second write), copied
    where links are not possible; either way through a temp file and a rename (atomic).
    ``sharded``: its model and optimizer are in :func:`dcp_dir` of it, linked along."""
    if keep <= 0:
        return None
    source = source or last_checkpoint(run_dir)
    if source is None:
        return None
    dest = ring_path(run_dir, step)
    if sharded:  # the directory first, so that the ring's file never lacks it
        link_tree(dcp_dir(source), dcp_dir(dest))
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dest)
    for _, old in ring_checkpoints(run_dir)[:-keep]:
        _drop(old)
    return dest


def _drop(pt: Path) -> None:
    pt.unlink(missing_ok=True)
    shutil.rmtree(dcp_dir(pt), ignore_errors=True)


def drop_ring_after(run_dir: Path, step: int) -> None:
    """A rollback abandons the checkpoints after the step it restored."""
    for s, p in ring_checkpoints(run_dir):
        if s > step:
            _drop(p)

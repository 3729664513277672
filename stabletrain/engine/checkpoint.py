"""Atomic checkpoints: write a temp file beside the target, fsync, then rename over it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch


def save_checkpoint(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


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


def save_to_ring(run_dir: Path, step: int, keep: int, source: Path | None = None) -> Path | None:
    """Add the checkpoint of ``step`` to the ring and drop the oldest beyond ``keep``.

    ``source`` (last.pt, just written) is hard-linked into place (no second write), copied
    where links are not possible; either way through a temp file and a rename (atomic)."""
    if keep <= 0:
        return None
    source = source or last_checkpoint(run_dir)
    if source is None:
        return None
    dest = ring_path(run_dir, step)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        import shutil

        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dest)
    for _, old in ring_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return dest


def drop_ring_after(run_dir: Path, step: int) -> None:
    """A rollback abandons the checkpoints after the step it restored."""
    for s, p in ring_checkpoints(run_dir):
        if s > step:
            p.unlink(missing_ok=True)

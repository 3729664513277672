"""Data that ships with the install: no download, real content.

- ``digits``: scikit-learn's 1797 handwritten digits (8x8, 16 grey levels, 10 classes),
  resized once to the model's input and split with a fixed permutation.
- ``pytext``: the Python standard library's own ``.py`` sources (site-packages excluded),
  in sorted path order, as bytes (vocab 256). The corpus differs slightly between Python
  versions; within one machine it is fixed.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

MAX_TEXT_BYTES = 16 * 2**20


def digits_tensors(img_size: int, val_fraction: float = 0.2) -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_val = int(round(len(y) * val_fraction))
    val, train = perm[:n_val], perm[n_val:]
    return {"x_train": x[train], "y_train": y[train], "x_val": x[val], "y_val": y[val]}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def pytext_bytes(max_bytes: int = MAX_TEXT_BYTES) -> np.ndarray:
    chunks, total = [], 0
    for f in stdlib_files():
        b = f.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError("no Python standard-library sources found for data=pytext")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
